"""The Qwen 3 family's ModelSpecs: "qwen3" (dense) and "qwen3_moe" (mixture of experts)."""

from titan_tpu.models.common.attention_tunable import ATTENTION
from titan_tpu.models.common.decode_step import DECODER_DECODING
from titan_tpu.models.common.decoder_activations import dense_decoder_activations
from titan_tpu.models.common.loss import cross_entropy_loss
from titan_tpu.models.common.loss_tunable import LOSS_CHUNKS
from titan_tpu.models.common.parallelize import DENSE_DECODER_TP
from titan_tpu.models.qwen3.activations import qwen3_moe_block_activations
from titan_tpu.models.qwen3.args import QWEN3_FLAVORS, QWEN3_MOE_FLAVORS
from titan_tpu.models.qwen3.experts_tunable import EXPERTS
from titan_tpu.models.qwen3.flops import qwen3_flops_per_token, qwen3_moe_routing
from titan_tpu.models.qwen3.model import Qwen3Model, Qwen3MoeModel, moe_loss
from titan_tpu.models.qwen3.parallelize import QWEN3_MOE_TP_PLAN, parallelize_qwen3, parallelize_qwen3_moe
from titan_tpu.models.qwen3.state_dict_adapter import QWEN3_STATE_DICT_ADAPTER
from titan_tpu.protocols.model_spec import Capabilities, ModelSpec, PlannerHooks

QWEN3_SPEC = ModelSpec(
    name="qwen3",
    model_cls=Qwen3Model,
    flavors=QWEN3_FLAVORS,
    flops_per_token=qwen3_flops_per_token,
    loss_fn=cross_entropy_loss,
    parallelize=parallelize_qwen3,
    state_dict_adapter=QWEN3_STATE_DICT_ADAPTER,
    tunables=(ATTENTION, LOSS_CHUNKS),
    capabilities=Capabilities(
        context_parallel=True,
        pipeline_stages=True,
        separates_documents=True,
        decoding=DECODER_DECODING,
        repeated_forward=True,
    ),
    planning=PlannerHooks(tp_plan=DENSE_DECODER_TP, block_activations=dense_decoder_activations),
)
QWEN3_MOE_SPEC = ModelSpec(
    name="qwen3_moe",
    model_cls=Qwen3MoeModel,
    flavors=QWEN3_MOE_FLAVORS,
    flops_per_token=qwen3_flops_per_token,
    loss_fn=moe_loss,
    parallelize=parallelize_qwen3_moe,
    state_dict_adapter=QWEN3_STATE_DICT_ADAPTER,
    tunables=(ATTENTION, EXPERTS, LOSS_CHUNKS),
    capabilities=Capabilities(pipeline_stages=True, separates_documents=True, decoding=DECODER_DECODING),
    planning=PlannerHooks(
        tp_plan=QWEN3_MOE_TP_PLAN, block_activations=qwen3_moe_block_activations, expert_routing=qwen3_moe_routing
    ),
)
