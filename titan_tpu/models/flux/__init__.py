"""FLUX.1: args.py (flavors), layers.py and model.py, flops.py, state_dict_adapter.py (diffusers
names) and the ModelSpec in spec.py. Import each name from its module; this door loads nothing."""
