"""Our causal attention kernels inside transformers' models, through transformers' attention registry.

A transformers class that takes its attention function from the registry (`_supports_attention_backend`)
and has SDPA (`_supports_sdpa`) can run the kernel `model.attention_block` names (or the run
measured: the ATTENTION tunable, titan_tpu/models/common/attention_tunable.py): it is registered under its own
name with `AttentionInterface`, and the model is built with that name as `attn_implementation`.

The causal mask. transformers builds each layer's mask with the function registered under the same
name in `AttentionMaskInterface`; with none registered the mask is silently dropped, so SDPA's is
registered with it: it gives None where the mask is plainly causal (what the kernel computes) and a
tensor for sliding windows and padding. Where a call is anything but plain causal self-attention
(a mask, dropout, a scale other than 1/sqrt(head_dim), soft-capping, attention sinks, a cache of
earlier tokens), it goes to transformers' own SDPA with everything it was given.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from titan_tpu.models.hf.args import HFArgs, model_class, takes_registered_attention
from titan_tpu.protocols.attention import AttentionKernel


def registered_name(kernel: AttentionKernel) -> str:
    return "titan_tpu_" + kernel.name.replace(":", "_")


def attention_implementation(args: HFArgs) -> str:
    """What the model is built with: our kernel's registered name where the run chose one of ours
    and the class takes it, else SDPA where the class has it, else eager."""
    kernel = args.attention
    if args.trust_remote_code and args.folder:
        return "eager"
    if kernel is not None and kernel.name not in ("auto", "sdpa") and takes_registered_attention(args):
        register(kernel)
        return registered_name(kernel)
    return "sdpa" if getattr(model_class(args.architecture, "model"), "_supports_sdpa", False) else "eager"


def is_plain_causal(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float,
    scaling: float | None,
    extra: dict[str, Any],
) -> bool:
    """A call our kernel computes exactly: causal self-attention over the same tokens, no mask
    beyond causality, no dropout, the 1/sqrt(head_dim) scale, nothing else asked of it."""
    head_dim = query.shape[-1]
    return (
        attention_mask is None
        and getattr(module, "is_causal", True)
        and extra.get("is_causal") is not False
        and (dropout == 0.0 or not module.training)
        and (scaling is None or math.isclose(scaling, head_dim**-0.5, rel_tol=1e-6))
        and query.shape[2] == key.shape[2]
        and value.shape[-1] == head_dim
        and extra.get("softcap") is None
        and extra.get("s_aux") is None
        and getattr(module, "sinks", None) is None
    )


def register(kernel: AttentionKernel) -> None:
    """Register `kernel` with transformers' attention registry, and SDPA's causal mask with it
    (again on every build: the registry maps a name to its latest function)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    def attention(
        module: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        # query [B, H, S, D], key and value [B, H_kv, S, D]; transformers wants [B, S, H, D] back.
        if not is_plain_causal(module, query, key, value, attention_mask, dropout, scaling, kwargs):
            return sdpa_attention_forward(
                module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
            )
        return kernel(query, key, value).transpose(1, 2).contiguous(), None

    name = registered_name(kernel)
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, sdpa_mask)
