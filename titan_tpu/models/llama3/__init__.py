"""Llama 3: args.py (flavors), model.py, flops.py, state_dict_adapter.py and the ModelSpec in spec.py.
Import each name from its module; this door loads nothing."""
