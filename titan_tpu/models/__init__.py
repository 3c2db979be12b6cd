"""Model families. Importing this package registers every family with `titan_tpu.models.registry`."""

import titan_tpu.models.flux  # noqa: F401  (registers "flux")
import titan_tpu.models.hf  # noqa: F401  (registers "hf")
import titan_tpu.models.llama3  # noqa: F401  (registers "llama3")
import titan_tpu.models.qwen3  # noqa: F401  (registers "qwen3" and "qwen3_moe")
from titan_tpu.models.registry import ModelSpec, get_model_spec, model_names, register_model

__all__ = ["ModelSpec", "get_model_spec", "model_names", "register_model"]
