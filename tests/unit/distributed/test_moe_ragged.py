"""TorchTPU's MoE path on CPU: the experts through `ragged_dot` and expert parallelism's exchange
through `ragged_all_to_all`, with references of the ops' documented semantics (tests/support/ragged_reference.py)
plugged in where the TPU's ops go, so that everything but the ops themselves is tested here.

Bugs these catch: references that misread the documentation (hand examples); group sizes or weight
layouts handed to ragged_dot that differ from the routing (against today's implementations, with a
shifted-sizes negative control); output offsets computed as the receiver sees them instead of the
sender, or a combine that does not bring rows back where they came from; ragged_dot offered or
accepted off TPU, or the op not reaching the model.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.support.ragged_reference import exchange_every_rank, operand_gradients, ragged_dot
from titan_tpu.autotune.for_run import choose_run_kernels
from titan_tpu.autotune.measure import check
from titan_tpu.config.errors import ConfigError
from titan_tpu.distributed.ragged_exchange import RaggedExchange
from titan_tpu.models.qwen3.args import QWEN3_MOE_FLAVORS
from titan_tpu.models.qwen3.experts_tunable import EXPERTS
from titan_tpu.models.qwen3.model import Qwen3MoeModel
from titan_tpu.models.qwen3.moe import GroupedExperts, MoEFeedForward
from titan_tpu.protocols.tunable import KernelShape

# ---------------------------------------------------------------- the references, by hand


def test_ragged_dot_reference_on_a_hand_example() -> None:
    lhs = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    rhs = torch.stack([torch.eye(2), torch.tensor([[0.0, 1.0], [1.0, 0.0]])])  # identity, then a swap
    out = ragged_dot(lhs, rhs, torch.tensor([1, 2], dtype=torch.int32))
    assert out.tolist() == [[1.0, 2.0], [4.0, 3.0], [6.0, 5.0]]
    with pytest.raises(ValueError, match="must be >= 0 and sum to lhs's 3 rows"):
        ragged_dot(lhs, rhs, torch.tensor([1, 1]))


# Two ranks. Rank 0 sends a0 to itself and a1, a2 to rank 1; rank 1 sends b1 to rank 0 and b0 to
# itself. Output offsets are where the block lands in the *receiver's* output, listed by the sender:
# rank 0's a0 goes to row 2 of rank 0, rank 1's b1 to row 0 of rank 0; row 1 of rank 0 gets nothing.
HAND_OPERANDS = [torch.tensor([[1.0], [2.0], [3.0]]), torch.tensor([[10.0], [20.0]])]
HAND_INDEX = (
    [[0, 1], [1, 0]],  # input_offsets[sender][receiver]
    [[1, 2], [1, 1]],  # send_sizes
    [[2, 1], [0, 0]],  # output_offsets[sender][receiver], as seen by the sender
    [[1, 1], [2, 1]],  # recv_sizes[receiver][sender]
)


def test_ragged_all_to_all_reference_on_a_hand_example() -> None:
    outputs = [torch.full((3, 1), -1.0), torch.full((3, 1), -1.0)]
    results = exchange_every_rank(HAND_OPERANDS, outputs, *HAND_INDEX)
    assert [r.flatten().tolist() for r in results] == [[20.0, -1.0, 1.0], [10.0, 2.0, 3.0]]
    grad_outputs = [torch.tensor([[100.0], [200.0], [300.0]]), torch.tensor([[400.0], [500.0], [600.0]])]
    grads = operand_gradients(HAND_OPERANDS, grad_outputs, *HAND_INDEX)
    assert [g.flatten().tolist() for g in grads] == [[300.0, 500.0, 600.0], [400.0, 100.0]]
    # Negative control: sizes that disagree between sender and receiver are refused.
    bad_recv = [[1, 1], [1, 1]]
    with pytest.raises(ValueError, match="rank 0 sends 2 rows to rank 1, which expects 1"):
        exchange_every_rank(HAND_OPERANDS, outputs, *HAND_INDEX[:3], bad_recv)


# ---------------------------------------------------------------- the exchange's offsets


def _recorded(exchange_step: Any, rows: torch.Tensor) -> dict[str, Any]:
    """The arguments one rank's exchange hands the op (the op is not run)."""
    calls: list[dict[str, Any]] = []

    def record(**kwargs: Any) -> torch.Tensor:
        calls.append(kwargs)
        return kwargs["output"]

    exchange_step(rows, record)
    return calls[0]


def _run_every_rank(calls: list[dict[str, Any]]) -> list[torch.Tensor]:
    names = ("input_offsets", "send_sizes", "output_offsets", "recv_sizes")
    index = [[call[name].tolist() for call in calls] for name in names]
    return exchange_every_rank([c["operand"] for c in calls], [c["output"] for c in calls], *index)


@pytest.mark.parametrize("ep, local_experts", [(2, 2), (3, 1), (4, 2)])
def test_exchange_delivers_what_all_to_all_delivers_and_brings_it_back(ep: int, local_experts: int) -> None:
    generator = torch.Generator().manual_seed(ep)
    counts = torch.randint(0, 4, (ep, ep * local_experts), generator=generator)
    counts[0, :local_experts] = 0  # a rank that keeps nothing for itself
    rows = [torch.randn(int(c.sum()), 3, generator=generator) for c in counts]
    exchanges = [RaggedExchange.from_counts(counts, rank, "ep") for rank in range(ep)]
    arrived = _run_every_rank([_recorded(e.dispatch, x) for e, x in zip(exchanges, rows)])
    for rank in range(ep):
        # all_to_all_single's order: by source rank, each source's rows for this rank's experts.
        expected = torch.cat([x.split(c.view(ep, local_experts).sum(1).tolist())[rank] for x, c in zip(rows, counts)])
        assert torch.equal(arrived[rank], expected), rank
        mine = counts[:, rank * local_experts : (rank + 1) * local_experts]
        assert exchanges[rank].received_matrix.tolist() == mine.tolist()
    returned = _run_every_rank([_recorded(e.combine, y) for e, y in zip(exchanges, arrived)])
    assert all(torch.equal(back, x) for back, x in zip(returned, rows))


def test_offsets_as_the_receiver_sees_them_are_caught() -> None:
    """Negative control for the test above: the receiver's view of the output offsets (where each
    source's block starts in *my* output) puts the blocks in the wrong places."""
    counts = torch.tensor([[1, 2], [3, 1]])
    rows = [torch.arange(3.0).unsqueeze(1), 10 + torch.arange(4.0).unsqueeze(1)]
    calls = [_recorded(RaggedExchange.from_counts(counts, r, "ep").dispatch, x) for r, x in enumerate(rows)]
    correct = _run_every_rank(calls)
    for call in calls:
        call["output_offsets"] = torch.cumsum(call["recv_sizes"], 0) - call["recv_sizes"]
    assert not all(torch.equal(a, b) for a, b in zip(_run_every_rank(calls), correct))


# ---------------------------------------------------------------- the experts through ragged_dot


def _shifted_sizes(lhs: torch.Tensor, rhs: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """The reference with the first group one row short and the second one row long."""
    shift = torch.zeros_like(group_sizes)
    shift[0], shift[1] = -1, 1
    return ragged_dot(lhs, rhs, group_sizes + shift)


def _layer_difference(today: str, op: Any) -> float:
    """Largest relative difference of output and gradients (input, router, w1, w2, w3) between the
    MoE layer with experts `today` and with ragged_dot through `op`, in float32."""
    torch.manual_seed(0)
    layer = MoEFeedForward(32, 48, 6, top_k=2, norm_topk_prob=True, impl=today)
    layer.init_weights(0.02)
    ragged = copy.deepcopy(layer)
    ragged.experts.impl, ragged.experts.ragged_dot_op = "ragged_dot", op
    x = torch.randn(2, 9, 32)
    projection = torch.randn(2, 9, 32)
    results = []
    for module in (layer, ragged):
        inputs = x.clone().requires_grad_()
        out, _ = module(inputs)
        (out * projection).sum().backward()
        grads = [module.router.gate.weight.grad, *(getattr(module.experts, w).grad for w in ("w1", "w2", "w3"))]
        results.append([out.detach(), inputs.grad, *grads])
    counts = torch.bincount(layer.router(x.flatten(0, 1))[1].flatten(), minlength=6)
    assert counts[0] >= 1, "the negative control needs a row in the first group"
    return max(float((a - b).norm() / b.norm()) for a, b in zip(results[1], results[0]))


@pytest.mark.parametrize("today", ["padded_bmm", "loop"])
def test_moe_layer_with_ragged_dot_matches_todays_experts(today: str) -> None:
    assert _layer_difference(today, ragged_dot) <= 1e-6
    assert _layer_difference(today, _shifted_sizes) > 1e-3  # negative control: sizes off by one row


def test_the_model_hands_the_op_to_every_experts_module() -> None:
    args = QWEN3_MOE_FLAVORS["debug_moe"]
    with torch.device("meta"):
        model = Qwen3MoeModel(dataclasses.replace(args, expert_impl="ragged_dot", ragged_dot_op=ragged_dot))
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    assert len(experts) == args.n_layers and all(e.ragged_dot_op is ragged_dot for e in experts)


def test_ragged_dot_without_the_op_is_one_error() -> None:
    experts = GroupedExperts(16, 16, 2, "ragged_dot")
    with pytest.raises(ValueError, match="impl 'ragged_dot' needs the device's ragged_dot op"):
        experts(torch.randn(3, 16), torch.tensor([1, 2]))


# ---------------------------------------------------------------- when "auto" takes it


def _shape(device_type: str, op: Any) -> KernelShape:
    device = SimpleNamespace(type=device_type)  # only its type is read by the candidates
    return KernelShape(device, torch.float32, 1, 64, ragged_dot_op=op)  # type: ignore[arg-type]


def test_ragged_dot_is_a_candidate_on_tpu_only() -> None:
    args = QWEN3_MOE_FLAVORS["debug_moe"]
    offered = {
        (device, op is not None): "ragged_dot" in EXPERTS.candidates(args, _shape(device, op))
        for device, op in itertools.product(("cpu", "cuda", "tpu"), (None, ragged_dot))
    }
    assert offered == {key: key == ("tpu", True) for key in offered}


def test_the_candidate_runs_the_op_it_is_handed() -> None:
    """The measurement's correctness check sees ragged_dot (the reference here) agree with the loop."""
    args = QWEN3_MOE_FLAVORS["debug_moe"]
    shape = KernelShape(torch.device("cpu"), torch.float32, 1, 64, ragged_dot_op=ragged_dot)
    candidates = {"loop": "loop", "ragged_dot": "ragged_dot"}
    assert check(EXPERTS, args, shape, candidates) == {}
    broken = KernelShape(torch.device("cpu"), torch.float32, 1, 64, ragged_dot_op=_shifted_sizes)
    assert list(check(EXPERTS, args, broken, candidates)) == ["ragged_dot"]


def _choose(expert_impl: str, device_type: str, op: Any) -> Any:
    args = dataclasses.replace(QWEN3_MOE_FLAVORS["debug_moe"], expert_impl=expert_impl)
    device = SimpleNamespace(type=device_type, ragged_dot_op=lambda: op, name=lambda: "fake", synchronize=lambda: None)
    config = SimpleNamespace(training=SimpleNamespace(deterministic=True))
    shape = KernelShape(torch.device("cpu"), torch.float32, 1, 64)
    return choose_run_kernels([EXPERTS], args, shape, device, config, log=False)[0]  # type: ignore[arg-type]


def test_forced_ragged_dot_gets_the_devices_op_or_one_config_error() -> None:
    assert _choose("ragged_dot", "tpu", ragged_dot).ragged_dot_op is ragged_dot
    with pytest.raises(ConfigError, match=r"^model.moe_impl = 'ragged_dot' runs TorchTPU's .* cpu run"):
        _choose("ragged_dot", "cpu", None)
    today = _choose("padded_bmm", "cpu", None)  # other values are left as they are
    assert today.expert_impl == "padded_bmm" and today.ragged_dot_op is None
