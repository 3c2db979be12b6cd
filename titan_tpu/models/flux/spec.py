"""FLUX.1 family: registers the "flux" ModelSpec (trained by the "rectified_flow" task)."""

from titan_tpu.models.flux.activations import flux_block_activations
from titan_tpu.models.flux.args import FLUX_FLAVORS, FluxArgs
from titan_tpu.models.flux.flops import flux_flops_per_token, flux_param_count, flux_training_flops_per_sample
from titan_tpu.models.flux.model import FluxModel
from titan_tpu.models.flux.state_dict_adapter import FLUX_STATE_DICT_ADAPTER
from titan_tpu.models.registry import ModelSpec, register_model

FLUX_SPEC = ModelSpec(
    name="flux",
    model_cls=FluxModel,
    flavors=FLUX_FLAVORS,
    flops_per_token=flux_flops_per_token,
    state_dict_adapter=FLUX_STATE_DICT_ADAPTER,
    default_task="rectified_flow",
    block_activations=flux_block_activations,
)
register_model(FLUX_SPEC)

__all__ = [
    "FLUX_FLAVORS",
    "FLUX_SPEC",
    "FluxArgs",
    "FluxModel",
    "flux_flops_per_token",
    "flux_param_count",
    "flux_training_flops_per_sample",
]
