"""The FLUX.1 family's ModelSpec ("flux", trained by the "rectified_flow" task)."""

from titan_tpu.models.flux.activations import flux_block_activations
from titan_tpu.models.flux.args import FLUX_FLAVORS
from titan_tpu.models.flux.flops import flux_flops_per_token
from titan_tpu.models.flux.model import FluxModel
from titan_tpu.models.flux.state_dict_adapter import FLUX_STATE_DICT_ADAPTER
from titan_tpu.protocols.model_spec import ModelSpec, PlannerHooks

FLUX_SPEC = ModelSpec(
    name="flux",
    model_cls=FluxModel,
    flavors=FLUX_FLAVORS,
    flops_per_token=flux_flops_per_token,
    state_dict_adapter=FLUX_STATE_DICT_ADAPTER,
    default_task="rectified_flow",
    planning=PlannerHooks(block_activations=flux_block_activations),
)
