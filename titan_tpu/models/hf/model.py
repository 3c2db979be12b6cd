"""A transformers causal LM behind the interface our tasks and parallelisation use.

`HFCausalLM(args)` builds transformers' own modeling code for `args.config` (on whatever device is
current: `meta` in a run) under `self.hf`, so its state-dict keys are transformers' with an `hf.`
prefix. It adds what the run needs of a model: `forward(tokens) -> logits`, `init_weights` after
`to_empty` (transformers' own initialisation, which also recomputes the rotary tables: they are not
in the state dict, and `to_empty` leaves them garbage), and `block_containers()`, the decoder
layers that activation checkpointing, compile and FSDP wrap one by one.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from titan_tpu.models.hf.args import HFArgs, model_class
from titan_tpu.models.hf.attention import attention_implementation
from titan_tpu.models.hf.decoding import HFDecodeCache

if TYPE_CHECKING:  # transformers is imported where a model is built
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)


def build_hf_model(args: HFArgs) -> PreTrainedModel:
    """transformers' model for `args`, in float32, attention through our kernel where the run chose
    one and the class takes it (titan_tpu/models/hf/attention.py), SDPA where the class has it, else eager."""
    attention = attention_implementation(args)
    if args.trust_remote_code and args.folder:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_config(
            args.config, trust_remote_code=True, attn_implementation=attention, dtype=torch.float32
        )
    cls = model_class(args.architecture, "model")
    return cls._from_config(args.config, attn_implementation=attention, dtype=torch.float32)


def decoder_layers_path(model: nn.Module) -> str:
    """Where the model keeps its repeated decoder layers: the longest ModuleList whose children are
    all of the classes transformers itself never splits (`_no_split_modules`), or, for a class that
    names none, the longest list of one class as long as the config's layer count."""
    unsplit = set(getattr(model, "_no_split_modules", None) or ())
    layers = getattr(model.config, "num_hidden_layers", None)

    def is_layer_list(module: nn.Module) -> bool:
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            return False
        kinds = {type(child).__name__ for child in module}
        return kinds <= unsplit if unsplit else len(kinds) == 1 and len(module) == layers

    lists = [(name, module) for name, module in model.named_modules() if is_layer_list(module)]
    if not lists:
        raise ValueError(
            f"{type(model).__name__}: no list of decoder layers of its _no_split_modules {sorted(unsplit)}"
        )
    return max(lists, key=lambda item: len(item[1]))[0]


def zeroes_padding_row(owner: PreTrainedModel, embedding: nn.Embedding) -> bool:
    """Whether transformers' init (`owner._init_weights`) zeroes `embedding`'s padding row (most do,
    as nn.Embedding does; some classes' own init does not): asked of it on a copy of the module with
    a small CPU weight, the global random state left as it was."""
    assert embedding.padding_idx is not None
    probe = copy.copy(embedding)
    probe._parameters = {"weight": nn.Parameter(torch.ones(embedding.padding_idx + 1, 4, device="cpu"))}
    probe._buffers = {
        name: torch.ones(b.shape, dtype=b.dtype) for name, b in embedding._buffers.items() if b is not None
    }
    probe.__dict__.pop("_is_hf_initialized", None)
    with torch.random.fork_rng(devices=[]):
        owner._init_weights(probe)
    return bool((probe.weight[embedding.padding_idx] == 0).all())


def pretrained_models(hf: nn.Module) -> list[PreTrainedModel]:
    """`hf` and the transformers (sub)models inside it: each initialises its own modules."""
    from transformers import PreTrainedModel

    return [module for module in hf.modules() if isinstance(module, PreTrainedModel)]


def zeroed_padding_rows(hf: nn.Module) -> set[nn.Embedding]:
    """The embeddings whose padding row transformers' init zeroes (asked of the innermost
    (sub)model holding each, the one whose init transformers applies to it)."""
    owner_of: dict[nn.Embedding, PreTrainedModel] = {}
    for owner in pretrained_models(hf):
        for module in owner.modules():
            if isinstance(module, nn.Embedding) and module.padding_idx is not None:
                owner_of[module] = owner
    return {module for module, owner in owner_of.items() if zeroes_padding_row(owner, module)}


@contextlib.contextmanager
def trunc_normal_through_torch() -> Iterator[None]:
    """transformers' `initialization.trunc_normal_` calls the torch function it captured at import,
    so a caller that replaces `torch.nn.init.trunc_normal_` for the duration of an init is bypassed
    (and transformers' init itself points torch's name at its own function while it runs): the
    run's layout-invariant init replaces it because torch's rejection loop, run on a shard, redraws
    as often as that shard needs, which made FSDP's first shard of a trunc-normal table
    (ModernBERT-decoder's embedding) differ from one process's. Here it calls the function torch's
    name holds on entry, with transformers' skip of tensors already initialised."""
    from transformers import initialization

    captured = initialization.trunc_normal_
    current = torch.nn.init.trunc_normal_

    def trunc_normal_(
        tensor: torch.Tensor,
        mean: float = 0.0,
        std: float = 1.0,
        a: float = -2.0,
        b: float = 2.0,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        if getattr(tensor, "_is_hf_initialized", False):
            return tensor
        return current(tensor, mean=mean, std=std, a=a, b=b, generator=generator)

    initialization.trunc_normal_ = trunc_normal_
    try:
        yield
    finally:
        initialization.trunc_normal_ = captured


# (weight, row index) -> None: zero that row in place.
ZeroRow = Callable[[torch.Tensor, int], None]


def zero_row(weight: torch.Tensor, index: int) -> None:
    """A plain tensor's row, zeroed in place."""
    weight[index].zero_()


@contextlib.contextmanager
def padding_rows_kept(hf: nn.Module, zeroed: set[nn.Embedding], zero_row: ZeroRow) -> Iterator[None]:
    """transformers' initialisation as it is, except that the padding rows it zeroes (`zeroed`) are
    zeroed again by `zero_row(weight, index)` right after that embedding's init (a tied head's later
    draw may overwrite it, as it does in transformers). transformers zeroes through
    `weight[padding_idx]`, which on a DTensor split along the vocabulary is a copy, so the zero is
    lost there: the family's parallelize.py hands in a `zero_row` for DTensors."""
    owners = pretrained_models(hf) if zeroed else []

    def wrap(initialize: Callable[..., None]) -> Callable[..., None]:
        def initialize_and_zero(module: nn.Module, *args: Any, **kwargs: Any) -> None:
            initialize(module, *args, **kwargs)
            # `zeroed` holds embeddings with a padding row; the tests narrow the types.
            if isinstance(module, nn.Embedding) and module in zeroed and module.padding_idx is not None:
                zero_row(module.weight, module.padding_idx)

        return initialize_and_zero

    for owner in owners:
        # An instance attribute shadows the method.
        owner._initialize_weights = wrap(owner._initialize_weights)  # type: ignore[method-assign]  # on purpose
    try:
        yield
    finally:
        for owner in owners:
            del owner._initialize_weights


def is_experts_module(module: nn.Module) -> bool:
    """transformers' fused experts (`use_experts_implementation`): weights [E, ...] for E experts."""
    return hasattr(module, "_is_expert_parallel") and isinstance(getattr(module, "num_experts", None), int)


class HFCausalLM(nn.Module):
    """transformers' causal LM for `args` under `self.hf`."""

    zeroed_padding_rows: set[nn.Embedding]  # in __dict__: a plain attribute, not a submodule

    def __init__(self, args: HFArgs) -> None:
        super().__init__()
        self.args = args
        self.hf = build_hf_model(args)
        # Found once, on the bare model: activation checkpointing and compile then wrap its children.
        self.layers_path = decoder_layers_path(self.hf)
        # Asked before any sharding; a plain dict attribute, so not a submodule registration.
        self.__dict__["zeroed_padding_rows"] = zeroed_padding_rows(self.hf)
        # How init zeroes a weight's row; parallelize.py swaps in the DTensor way.
        self.zero_row: ZeroRow = zero_row
        logger.info(
            "model hf: %s by transformers' own modeling code, attention %s",
            args.architecture,
            self.hf.config._attn_implementation,
        )

    def block_containers(self) -> list[nn.ModuleList]:
        layers = self.hf.get_submodule(self.layers_path)
        assert isinstance(layers, nn.ModuleList)
        return [layers]

    @property
    def n_blocks(self) -> int:
        return len(self.block_containers()[0])

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """transformers' own initialisation of every parameter and buffer (rotary tables included),
        as `from_config` would give, on the devices `to_empty` put them (`buffer_device` is where
        that was)."""
        del buffer_device  # the buffers are recomputed in place, where to_empty put them
        for module in self.hf.modules():
            # Set by any earlier initialisation (a build outside `meta` runs one): it would skip them.
            module.__dict__.pop("_is_hf_initialized", None)
            for tensor in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
                tensor.__dict__.pop("_is_hf_initialized", None)
        if self.args.tie_embeddings:
            # to_empty gave the head and the embedding separate tensors; one again before the draw.
            self.hf.tie_weights()
        with padding_rows_kept(self.hf, self.zeroed_padding_rows, self.zero_row), trunc_normal_through_torch():
            self.hf.initialize_weights()
        for module in self.hf.modules():
            # A buffer of positions 0, 1, ... (GPT-1's, BERT-style models') is not in the state dict
            # and transformers' initialisation leaves it alone: to_empty's garbage otherwise.
            ids = module._buffers.get("position_ids")
            if ids is not None and "position_ids" in module._non_persistent_buffers_set:
                ids.copy_(torch.arange(ids.shape[-1], device=ids.device).expand_as(ids))

    def forward(
        self,
        tokens: torch.Tensor,
        document_ids: torch.Tensor | None = None,
        cache: HFDecodeCache | None = None,
        start_pos: int = 0,
        key_padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens [B, S] -> logits [B, S, vocab]. With `cache` (the sampler's decoding, decoding.py):
        `tokens` continue the cached rows from `start_pos`; at 0, `key_padding_mask` [B, S] marks a
        left-padded prompt's real tokens."""
        if document_ids is not None:
            raise ValueError(
                "model 'hf' attends across packed documents; set data.document_mask = false (pretraining) "
                "or sft.packing = false (sft)"
            )
        if cache is not None:
            positions = cache.extend(tokens, start_pos, key_padding_mask)
            return self.hf(
                input_ids=tokens,
                attention_mask=cache.mask,
                position_ids=positions,
                past_key_values=cache.kv,
                use_cache=True,
            ).logits
        # transformers' attention classes are wrapped by the `kernels` package's forward (where it is
        # installed), which sets a context variable for the call and resets it after. A compiled,
        # checkpointed layer traces that as a side effect, which dynamo refuses to leave out of the
        # backward's recompute unless told it may; set and reset within the call, it changes nothing.
        with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True):
            return self.hf(input_ids=tokens, use_cache=False).logits
