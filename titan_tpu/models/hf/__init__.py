"""The hf family: any causal language model of the installed transformers, built with its own
modeling code. args.py, model.py, attention.py, parallelize.py, planning.py, flops.py,
state_dict_adapter.py and the ModelSpec in spec.py. Import each name from its module; this door loads
nothing (not even transformers)."""
