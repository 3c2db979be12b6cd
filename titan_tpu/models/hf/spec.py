"""The hf family's ModelSpec ("hf"): any causal language model of the installed transformers, built
from its own modeling code (`[model] name = "hf"` with `[hf] config` or `architecture`)."""

import dataclasses

from titan_tpu.models.common.attention_tunable import ATTENTION
from titan_tpu.models.common.loss import cross_entropy_loss
from titan_tpu.models.common.loss_tunable import LOSS_CHUNKS
from titan_tpu.models.hf.args import HF_FLAVORS, hf_args, override_value, takes_registered_attention
from titan_tpu.models.hf.decoding import HF_DECODING
from titan_tpu.models.hf.flops import hf_flops_per_token
from titan_tpu.models.hf.model import HFCausalLM
from titan_tpu.models.hf.parallelize import HF_TP_PLAN, expert_modules, parallelize_hf
from titan_tpu.models.hf.planning import hf_block_activations, hf_expert_routing
from titan_tpu.models.hf.state_dict_adapter import HF_FAMILY_ADAPTER
from titan_tpu.protocols.model_spec import Capabilities, ModelSpec, PlannerHooks

# The attention kernel is measured only for classes that take ours (titan_tpu/models/hf/attention.py); the
# others keep "auto", which builds them with transformers' own attention.
HF_ATTENTION = dataclasses.replace(
    ATTENTION, is_auto=lambda args: args.attention.name == "auto" and takes_registered_attention(args)
)

HF_SPEC = ModelSpec(
    name="hf",
    model_cls=HFCausalLM,
    flavors=HF_FLAVORS,
    flops_per_token=hf_flops_per_token,
    loss_fn=cross_entropy_loss,
    parallelize=parallelize_hf,
    state_dict_adapter=HF_FAMILY_ADAPTER,
    tunables=(LOSS_CHUNKS, HF_ATTENTION),
    args_from_config=hf_args,
    override_value=override_value,
    # Decoding with transformers' own cache (decoding.py); its models are neither cut into stages nor
    # split over cp, and its masks do not keep packed documents apart.
    capabilities=Capabilities(decoding=HF_DECODING),
    planning=PlannerHooks(
        tp_plan=HF_TP_PLAN,
        block_activations=hf_block_activations,
        expert_routing=hf_expert_routing,
        expert_modules=expert_modules,
    ),
)
