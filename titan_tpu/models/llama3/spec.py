"""The Llama 3 family's ModelSpec ("llama3" in titan_tpu/models/registry.py)."""

from titan_tpu.models.common.attention_tunable import ATTENTION
from titan_tpu.models.common.decode_step import DECODER_DECODING
from titan_tpu.models.common.decoder_activations import dense_decoder_activations
from titan_tpu.models.common.loss import cross_entropy_loss
from titan_tpu.models.common.loss_tunable import LOSS_CHUNKS
from titan_tpu.models.common.parallelize import DENSE_DECODER_TP, parallelize_dense_decoder
from titan_tpu.models.llama3.args import LLAMA3_FLAVORS
from titan_tpu.models.llama3.flops import llama3_flops_per_token
from titan_tpu.models.llama3.model import Llama3Model
from titan_tpu.models.llama3.state_dict_adapter import LLAMA3_STATE_DICT_ADAPTER
from titan_tpu.protocols.model_spec import Capabilities, ModelSpec, PlannerHooks

LLAMA3_SPEC = ModelSpec(
    name="llama3",
    model_cls=Llama3Model,
    flavors=LLAMA3_FLAVORS,
    flops_per_token=llama3_flops_per_token,
    loss_fn=cross_entropy_loss,
    parallelize=parallelize_dense_decoder,
    state_dict_adapter=LLAMA3_STATE_DICT_ADAPTER,
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
