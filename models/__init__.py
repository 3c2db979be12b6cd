"""Model families. Importing this package registers every family with `models.registry`."""

import models.flux  # noqa: F401  (registers "flux")
import models.llama3  # noqa: F401  (registers "llama3")
import models.qwen3  # noqa: F401  (registers "qwen3" and "qwen3_moe")
from models.registry import ModelSpec, get_model_spec, model_names, register_model

__all__ = ["ModelSpec", "get_model_spec", "model_names", "register_model"]
