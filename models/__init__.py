"""Model families. Importing this package registers every family with `models.registry`."""

import models.llama3  # noqa: F401  (registers "llama3")
from models.registry import ModelSpec, get_model_spec, model_names, register_model

__all__ = ["ModelSpec", "get_model_spec", "model_names", "register_model"]
