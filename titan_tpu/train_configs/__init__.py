"""The shipped run configs, installed as `titan_tpu.train_configs` so that the config loader finds
them through `importlib.resources` wherever the package is installed (see setup.py)."""
