"""Qwen 3, dense and mixture of experts: args.py (flavors), model.py, moe.py, flops.py,
parallelize.py, state_dict_adapter.py, the experts' kernel choice and the ModelSpecs in spec.py.
Import each name from its module; this door loads nothing."""
