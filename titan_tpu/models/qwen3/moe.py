"""Sparse mixture-of-experts feed-forward (Qwen 3 MoE): router, grouped experts, load-balancing loss.

Data flow of one layer, T tokens, E experts, k experts per token:

    router:   logits = x W_gate^T [T, E]; probs = softmax(logits) in float32; top-k of probs,
              renormalised to sum to 1 when norm_topk_prob
    dispatch: the T*k (token, expert) pairs are sorted by expert, so each expert's tokens are one
              contiguous run; `counts[e]` is the length of expert e's run
    experts:  `GroupedExperts(x_sorted, counts)` runs every expert on its run at once
    combine:  each output row is scaled by its top-k weight and summed back into its token

Expert parallelism hooks in at exactly one place: the experts module's input (x_sorted, counts) and
output. `titan_tpu.distributed.expert_parallel` wraps it with an all-to-all that ships each run to the
rank holding that expert and brings the results back; this file stays single-device.

The load-balancing loss is transformers' `load_balancing_loss_func` (Switch Transformer eq. 4-6) over
all layers at once: with C_e the number of top-k assignments to expert e and P_e the sum of router
probabilities of e, both summed over every layer and token (R = n_layers * T rows),

    aux = E * sum_e (C_e / R) * (P_e / R)

It is not the mean of per-layer losses, so each layer returns its (C, P) and the model sums them
(how its gradient reaches each layer: `titan_tpu.models.qwen3.model._AuxLossGradient`).
"""

from collections.abc import Callable
from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from titan_tpu.models.common.init import trunc_normal_std_
from titan_tpu.models.common.precision import autocast_dtype
from titan_tpu.models.qwen3.args import ExpertImpl


class RouterStats(NamedTuple):
    """One layer's contribution to the load-balancing loss: per-expert assignment counts (float, no
    gradient), per-expert sums of router probabilities (float32, with gradient), number of tokens."""

    counts: torch.Tensor
    prob_sums: torch.Tensor
    n_tokens: int


def load_balancing_loss(stats: list[RouterStats], num_experts: int) -> torch.Tensor:
    """transformers' auxiliary loss from the layers' router statistics (formula in the module doc)."""
    counts = torch.stack([s.counts for s in stats]).sum(0)
    prob_sums = torch.stack([s.prob_sums for s in stats]).sum(0)
    rows = sum(s.n_tokens for s in stats)
    return num_experts * torch.sum((counts / rows) * (prob_sums / rows))


class TopKRouter(nn.Module):
    """A bias-free linear gate, softmax over experts, top-k. Named `gate` like transformers' router."""

    def __init__(self, dim: int, num_experts: int, top_k: int, norm_topk_prob: bool) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.gate = nn.Linear(dim, num_experts, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, D] -> (top-k weights [T, k] in the logits' dtype, expert ids [T, k], float32
        probabilities [T, E])."""
        logits = self.gate(x)
        # Softmax in float32 whatever the compute dtype: top-k picks must not flip on rounding.
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), experts, probs


def _local(weight: torch.Tensor) -> torch.Tensor:
    """The rank-local block of an expert weight. Under expert parallelism the weights are DTensors
    sharded over experts; duck-typed so this file needs nothing from torch.distributed."""
    to_local = getattr(weight, "to_local", None)
    return to_local() if to_local is not None else weight


class ExpertSwiGLU(nn.Module):
    """The experts' dense math, free of data-dependent shapes: the part of an MoE layer that
    torch.compile can take whole. No parameters (the caller passes the rank-local weights):

    - padded runs x [E, C, D] (every expert's run padded to C rows): three batched matmuls;
    - ragged runs x [N, D] with `offsets` [E] (cumulative run ends, int32): `torch._grouped_mm`.
    """

    def forward(
        self,
        x: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        w3: torch.Tensor,
        offsets: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if offsets is None:
            hidden = F.silu(torch.bmm(x, w1.transpose(-2, -1))) * torch.bmm(x, w3.transpose(-2, -1))
            return torch.bmm(hidden, w2.transpose(-2, -1))
        gate = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offsets)
        up = torch._grouped_mm(x, w3.transpose(-2, -1), offs=offsets)
        return torch._grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offs=offsets)


class GroupedExperts(nn.Module):
    """E SwiGLU experts stored as stacked weights: w1 (gate) and w3 (up) [E, hidden, dim], w2 (down)
    [E, dim, hidden], i.e. each expert's slice is laid out like an nn.Linear weight (out, in).

    forward(x [N, D] sorted by expert, counts [E] (run length of each expert, summing to N)) -> [N, D].

    Implementations, all the same function:
    - "grouped_mm": `torch._grouped_mm`, one kernel per projection over ragged runs. Fast on recent
      GPUs in bf16; on CPU it works (fp32 and bf16, 16-byte aligned widths) but is slow.
      torch.compile takes it in bf16 only (its fake-tensor kernel rejects float32).
    - "padded_bmm": runs scattered into an [E, max_run, D] buffer and three `torch.bmm`s. Pays for
      the padding (max_run - run) but is one batched matmul everywhere; the CPU default.
    - "loop": a Python loop over experts with plain matmuls: the reference, and what FLOP counting
      uses (FlopCounterMode sees no FLOPs in `_grouped_mm` and counts bmm padding as work).
    - "ragged_dot": the device's ragged grouped matmul `ragged_dot_op(lhs [N, D], rhs [E, D, H],
      group_sizes [E]) -> [N, H]` (TorchTPU's `torch.tpu.ops.ragged_dot`, differentiable in lhs and
      rhs), three calls over the runs as they are: no padding. Only where the run hands the op in.
    - "auto": grouped_mm on CUDA in bf16, padded_bmm elsewhere (a run measures it instead:
      experts_tunable.py, where ragged_dot is a candidate on TPU).

    Run lengths are data-dependent (and under expert parallelism, hooks around this module exchange
    tokens with host-side split sizes), so torch.compile takes only `swiglu`, the matmuls.
    """

    compile_children: ClassVar[tuple[str, ...]] = ("swiglu",)

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        impl: ExpertImpl,
        ragged_dot_op: Callable[..., torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.impl: ExpertImpl = impl
        self.ragged_dot_op = ragged_dot_op
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.swiglu = ExpertSwiGLU()

    def init_weights(self, out_init_std: float) -> None:
        trunc_normal_std_(self.w1, 0.02)
        trunc_normal_std_(self.w3, 0.02)
        # w2 writes into the residual stream, like the dense feed-forward's w2.
        trunc_normal_std_(self.w2, out_init_std)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        # The matmuls run in the activations' dtype (under FSDP the weights arrive gathered in it
        # already; a single process under autocast keeps float32 weights).
        w1, w2, w3 = (_local(w).to(x.dtype) for w in (self.w1, self.w2, self.w3))
        impl = self.impl
        if impl == "auto":
            use_grouped = x.is_cuda and (autocast_dtype(x) or x.dtype) == torch.bfloat16
            impl = "grouped_mm" if use_grouped else "padded_bmm"
        if impl == "loop":
            return _loop(x, counts, w1, w2, w3)
        if impl == "grouped_mm":
            return _grouped_mm(x, counts, w1, w2, w3, self.swiglu)
        if impl == "ragged_dot":
            if self.ragged_dot_op is None:
                raise ValueError(
                    "GroupedExperts: impl 'ragged_dot' needs the device's ragged_dot op (TorchTPU's, handed "
                    "in on TPU); use auto, grouped_mm, padded_bmm or loop"
                )
            return _ragged_dot(x, counts, w1, w2, w3, self.ragged_dot_op)
        return _padded_bmm(x, counts, w1, w2, w3, self.swiglu)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, impl={self.impl}"


def _loop(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    outputs = []
    for expert, rows in enumerate(x.split(counts.tolist())):
        hidden = F.silu(F.linear(rows, w1[expert])) * F.linear(rows, w3[expert])
        outputs.append(F.linear(hidden, w2[expert]))
    return torch.cat(outputs) if outputs else x.new_zeros(0, w2.shape[1])


def _grouped_mm(
    x: torch.Tensor,
    counts: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    swiglu: nn.Module,
) -> torch.Tensor:
    # _grouped_mm is on no autocast list: cast by hand as autocast would for a matmul.
    dtype = autocast_dtype(x) or x.dtype
    x, w1, w2, w3 = (t.to(dtype) for t in (x, w1, w2, w3))
    return swiglu(x, w1, w2, w3, offsets=torch.cumsum(counts, dim=0, dtype=torch.int32))


def _ragged_dot(
    x: torch.Tensor,
    counts: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    ragged_dot: Callable[..., torch.Tensor],
) -> torch.Tensor:
    # The op's rhs is [E, in, out]: the experts' (out, in) slices, transposed. Cast by hand, as for
    # _grouped_mm: the op is on no autocast list. Group sizes in int32, the type XLA's ragged dot takes.
    dtype = autocast_dtype(x) or x.dtype
    x, w1, w2, w3 = (t.to(dtype) for t in (x, w1, w2, w3))
    sizes = counts.to(torch.int32)
    gate = ragged_dot(lhs=x, rhs=w1.transpose(-2, -1), group_sizes=sizes)
    up = ragged_dot(lhs=x, rhs=w3.transpose(-2, -1), group_sizes=sizes)
    return ragged_dot(lhs=F.silu(gate) * up, rhs=w2.transpose(-2, -1), group_sizes=sizes)


def _bucket(rows: int) -> int:
    """`rows` rounded up to one of four sizes per power of two (at most 25% padding), so the padded
    shape takes few distinct values over a run: kernels and their caches (oneDNN primitives, XLA
    compilations) are reused instead of rebuilt for every new routing."""
    if rows <= 8:
        return rows
    step = 1 << (rows.bit_length() - 3)
    return -(-rows // step) * step


def _padded_bmm(
    x: torch.Tensor,
    counts: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    swiglu: nn.Module,
) -> torch.Tensor:
    # No early exit for zero rows: the weights must stay in the graph (with zero gradient) so that
    # FSDP's backward hooks, and their collectives, run on every rank alike.
    num_experts, rows = counts.shape[0], x.shape[0]
    capacity = _bucket(int(counts.max())) if num_experts > 0 else 0
    # Row r of expert e's run goes to slot e * capacity + (r - start of e's run).
    expert_ids = torch.arange(num_experts, device=x.device)
    expert_of_row = torch.repeat_interleave(expert_ids, counts, output_size=rows)
    starts = torch.cumsum(counts, dim=0) - counts
    slot = expert_of_row * capacity + torch.arange(rows, device=x.device) - starts[expert_of_row]
    padded = x.new_zeros(num_experts * capacity, x.shape[1]).index_copy(0, slot, x)
    out = swiglu(padded.view(num_experts, capacity, x.shape[1]), w1, w2, w3)
    return out.reshape(num_experts * capacity, out.shape[-1]).index_select(0, slot)


class MoEFeedForward(nn.Module):
    """The sparse feed-forward of one block: x [B, S, D] -> (y [B, S, D], RouterStats).

    Routing has data-dependent shapes (bincount, sort, the experts' runs), so torch.compile takes the
    router and the experts' matmuls, not this module whole.
    """

    compile_children: ClassVar[tuple[str, ...]] = ("router", "experts")

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        impl: ExpertImpl,
        ragged_dot_op: Callable[..., torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.router = TopKRouter(dim, num_experts, top_k, norm_topk_prob)
        self.experts = GroupedExperts(dim, hidden_dim, num_experts, impl, ragged_dot_op)

    def init_weights(self, out_init_std: float) -> None:
        trunc_normal_std_(self.router.gate.weight, 0.02)
        self.experts.init_weights(out_init_std)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, RouterStats]:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, experts, probs = self.router(x)
        flat_experts = experts.flatten()
        counts = torch.bincount(flat_experts, minlength=self.num_experts)
        stats = RouterStats(counts=counts.float(), prob_sums=probs.sum(dim=0), n_tokens=x.shape[0])
        # Stable sort: within one expert, tokens keep their order (deterministic, and the same
        # order the reference loop sees).
        order = torch.argsort(flat_experts, stable=True)
        token_of_row = order // self.top_k
        out_sorted = self.experts(x[token_of_row], counts)
        out_sorted = out_sorted * weights.flatten()[order].unsqueeze(-1).to(out_sorted.dtype)
        out = out_sorted.new_zeros(x.shape[0], out_sorted.shape[-1]).index_add(0, token_of_row, out_sorted)
        return out.reshape(shape).to(x.dtype), stats
