"""Worker for the expert-parallel tests: `torchrun --nproc-per-node 4 expert_parallel_worker.py OUT`.

One launch runs, on the same 4 processes:
  1. one MoE layer, experts sharded over ep = 4 with the dispatch / combine all-to-alls, against the
     same layer on one device fed every rank's tokens: outputs, input gradients and (gathered) expert
     gradients; once with ordinary routing and once with a router that sends every token to experts
     0 and 1, so three of the four ranks receive no tokens at all;
  2. for each layout (EP 2 x FSDP 2 with compiled blocks, EP 4, TP 2 x EP 2 with activation
     checkpointing, HSDP 2 x 2 with EP 2, and plain FSDP 4 without EP) a real `Trainer` on the MoE
     debug model: the freshly initialised weights, gathered, against a single-process
     initialisation, then 10 fp32 steps (8 past warmup) whose per-step losses and gradient norms
     and full final state (parity.RunResult) the test compares with a single process's;
  3. the negative control: EP 2 x FSDP 2 with the experts' weight gradients scaled by ep, as if
     the 1/ep correction were missing; the test requires the same comparison to fail for it;
  4. EP 2 x FSDP 2 again in bfloat16: it must train, gather the experts in bf16 (the run's FSDP
     policy) and stay near the float32 losses;
  5. EP 2 x FSDP 2 on TorchTPU's MoE path (experts through ragged_dot, tokens through
     ragged_all_to_all) with the CPU references of both ops (tests/support/ragged_reference.py) plugged in
     where the run looks the TPU's up; the test compares it with the all-to-all path's run.
Rank 0 writes OUT (JSON) and OUT's folder/<layout>.pt. `reference()` is the single-process side, run by
the test.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.distributed.parallel_worker import layout_run, single_process_init  # noqa: E402
from tests.distributed.worker_cases import run_cases  # noqa: E402
from tests.support.parity import RunResult, train_and_capture  # noqa: E402
from tests.support.ragged_reference import GlooRaggedAllToAll, ragged_dot  # noqa: E402
from titan_tpu.config import load_config  # noqa: E402
from titan_tpu.device.select import Device  # noqa: E402
from titan_tpu.distributed import expert_parallel  # noqa: E402
from titan_tpu.distributed.expert_parallel import ScaleGrad, apply_expert_parallel  # noqa: E402
from titan_tpu.distributed.sharded_init import canonical_name  # noqa: E402
from titan_tpu.models.qwen3.moe import MoEFeedForward  # noqa: E402

CONFIG = "qwen3_moe_debug"
BASE = layout_run(CONFIG, global_batch_size=8)
LAYOUTS: dict[str, list[str]] = {
    # With torch.compile (aot_eager): the MoE blocks compile their traceable parts around the
    # expert-parallel hooks and the experts' own FSDP group.
    "ep2_fsdp2": [
        "--parallelism.dp_shard=4",
        "--parallelism.ep=2",
        "--compile.enable=true",
        "--compile.backend=aot_eager",
    ],
    "ep4": ["--parallelism.dp_shard=4", "--parallelism.ep=4"],
    # Activation checkpointing recomputes the dispatch / combine all-to-alls inside backward.
    "tp2_ep2_ac": [
        "--parallelism.tp=2",
        "--parallelism.dp_shard=2",
        "--parallelism.ep=2",
        "--activation_checkpoint.mode=full",
    ],
    "hsdp2x2_ep2": ["--parallelism.dp_replicate=2", "--parallelism.dp_shard=2", "--parallelism.ep=2"],
    # No expert parallelism: the aux loss must still see the global batch (sum_router_stats is set
    # by the model's parallelize, which runs in every distributed run).
    "fsdp4": ["--parallelism.dp_shard=4"],
}
# Must fail the parity check: ep2_fsdp2 (eager) whose experts' gradients lack the 1/ep correction.
MISSCALED_LAYOUT = ("ep2_fsdp2_missing_1_over_ep", ["--parallelism.dp_shard=4", "--parallelism.ep=2"])
# Not a parity layout: bf16 compute, compared loosely with the float32 ep2_fsdp2 run.
BF16_LAYOUT = ("ep2_fsdp2_bf16", ["--parallelism.dp_shard=4", "--parallelism.ep=2", "--training.dtype=bfloat16"])
# ep2_fsdp2 on TorchTPU's MoE path, eager, with the references of its two ops (`tpu_moe_ops_on_cpu`).
RAGGED_LAYOUT = (
    "ep2_fsdp2_tpu_ragged",
    ["--parallelism.dp_shard=4", "--parallelism.ep=2", "--model.moe_impl=ragged_dot"],
)


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


# ---------------------------------------------------------------- 1. one MoE layer, ep = world


def moe_layer(collapse: bool) -> dict[str, float]:
    world, rank = dist.get_world_size(), dist.get_rank()
    ep_mesh = DeviceMesh("cpu", torch.arange(world), mesh_dim_names=("ep",))
    dim, hidden, experts, top_k = 32, 48, 8, 2
    torch.manual_seed(0)
    reference = MoEFeedForward(dim, hidden, experts, top_k, norm_topk_prob=True, impl="loop")
    reference.init_weights(0.02)
    if collapse:
        with torch.no_grad():  # every token prefers experts 0 and 1: ranks 1..3 receive nothing
            reference.router.gate.weight.zero_()
            reference.router.gate.weight[:2] = 1.0
    sharded = copy.deepcopy(reference)
    sharded.experts.impl = "padded_bmm"
    apply_expert_parallel(sharded, ep_mesh)

    # Every rank builds every rank's tokens (same seed) and feeds its own slice to the sharded layer.
    torch.manual_seed(1)
    tokens = torch.randn(world, 2, 5, dim).abs() if collapse else torch.randn(world, 2, 5, dim)
    mine = tokens[rank].clone().requires_grad_()
    everyone = tokens.clone().requires_grad_()
    out, _ = sharded(mine)
    ref_out, _ = reference(everyone.flatten(0, 1))
    weights = torch.randn_like(ref_out)  # a loss that gives every output element its own gradient
    (out * weights.view(world, 2, 5, dim)[rank]).sum().backward()
    (ref_out * weights).sum().backward()

    results = {
        "forward": float((out - ref_out.view(world, 2, 5, dim)[rank]).abs().max()),
        "input_grad": float((mine.grad - everyone.grad[rank]).abs().max()),
    }
    # Expert grads on rank r cover its experts and sum every rank's tokens: compare gathered.
    expert_grad_diff = 0.0
    for name in ("w1", "w2", "w3"):
        local_grad = getattr(sharded.experts, name).grad
        gathered = full(local_grad) if isinstance(local_grad, DTensor) else local_grad
        # The combine scales expert grads by 1/ep (FSDP's average over the other dp axes completes
        # the mean); undo it to compare with the single-device sum.
        ref_grad = getattr(reference.experts, name).grad
        expert_grad_diff = max(expert_grad_diff, float((gathered * world - ref_grad).abs().max()))
    results["expert_grad"] = expert_grad_diff
    # The router is replicated: its local grads summed over ranks equal the single-device grad.
    router_grad = sharded.router.gate.weight.grad.clone()
    dist.all_reduce(router_grad)
    results["router_grad"] = float((router_grad - reference.router.gate.weight.grad).abs().max())
    counts = torch.bincount(reference.router(everyone.flatten(0, 1).reshape(-1, dim))[1].flatten(), minlength=experts)
    results["ranks_without_tokens"] = int((counts.view(world, -1).sum(1) == 0).sum())
    return results


# ---------------------------------------------------------------- 2. layouts through the trainer


def misscale_expert_grads(model: torch.nn.Module, factor: float) -> None:
    """Make every experts module's weight gradients `factor` times too large and change nothing
    else: the gradient entering its output (outside the dispatch / combine hooks) is scaled by
    `factor` and the one leaving its input by 1 / factor. With factor = ep this is the bug of a
    missing 1/ep correction."""
    for name, module in model.named_modules():
        if name.endswith("feed_forward.experts"):
            module.register_forward_pre_hook(
                lambda m, args: (ScaleGrad.apply(args[0], 1.0 / factor), *args[1:]), prepend=True
            )
            module.register_forward_hook(lambda m, args, out: ScaleGrad.apply(out, factor))


@contextlib.contextmanager
def tpu_moe_ops_on_cpu(calls: dict[str, int]) -> Iterator[None]:
    """The run finds the references where it looks up TorchTPU's ragged_dot (the device) and
    ragged_all_to_all (the ep mesh); `calls` counts how often each ran, so that a run that never
    took the path cannot pass."""
    exchanges: list[GlooRaggedAllToAll] = []

    def counted_ragged_dot(**kwargs: torch.Tensor) -> torch.Tensor:
        calls["ragged_dot"] += 1
        return ragged_dot(**kwargs)

    def exchange_for(mesh: DeviceMesh) -> GlooRaggedAllToAll:
        exchanges.append(GlooRaggedAllToAll(mesh.get_group()))
        return exchanges[-1]

    calls.update(ragged_dot=0, ragged_all_to_all=0)
    with (
        mock.patch.object(Device, "ragged_dot_op", lambda self: counted_ragged_dot),
        mock.patch.object(expert_parallel, "tpu_ragged_all_to_all", exchange_for),
    ):
        yield
    calls["ragged_all_to_all"] = sum(exchange.calls for exchange in exchanges)


def run_layout(name: str, overrides: list[str], dump: Path) -> dict[str, Any]:
    if name != RAGGED_LAYOUT[0]:
        return _run_layout(name, overrides, dump)
    calls: dict[str, int] = {}
    with tpu_moe_ops_on_cpu(calls):
        result = _run_layout(name, overrides, dump)
    return {**result, "calls": calls}


def _run_layout(name: str, overrides: list[str], dump: Path) -> dict[str, Any]:
    from titan_tpu.training.trainer import Trainer

    config = load_config(CONFIG, [*BASE, *overrides, f"--job.dump_folder={dump / name}"])
    trainer = Trainer(config)
    reference = single_process_init(config)
    init_diff = max(
        float((full(p.detach()) - reference[canonical_name(n)]).abs().max())
        for n, p in trainer.model.named_parameters()
    )
    expert_params = [p for n, p in trainer.model.named_parameters() if ".experts." in n]
    local_experts = expert_params[0].to_local().shape if isinstance(expert_params[0], DTensor) else None
    # The dtype the experts' weights are gathered in: seen from a hook that runs after FSDP's
    # pre-forward (which is prepended) has unsharded them.
    experts = next(m for n, m in trainer.model.named_modules() if n.endswith("feed_forward.experts"))
    gathered: list[str] = []
    experts.register_forward_pre_hook(lambda module, args: gathered.append(str(module.w1.dtype)))
    if name == MISSCALED_LAYOUT[0]:
        misscale_expert_grads(trainer.model, float(config.parallelism.ep))
    run = train_and_capture(trainer)
    if dist.get_rank() == 0:
        run.save(dump / f"{name}.pt")
    return {
        "init_max_abs_diff": init_diff,
        "expert_local_shape": list(local_experts) if local_experts is not None else None,
        "expert_gather_dtypes": sorted(set(gathered)),
    }


def reference(dump: Path) -> RunResult:
    """Single process, same config."""
    from titan_tpu.training.trainer import Trainer

    trainer = Trainer(load_config(CONFIG, [*BASE, f"--job.dump_folder={dump / 'single'}"]))
    run = train_and_capture(trainer)
    trainer.close()
    return run


def main(out: Path) -> None:
    run_cases(
        out,
        [
            ("moe_layer", functools.partial(moe_layer, False)),
            ("moe_layer_collapsed", functools.partial(moe_layer, True)),
            *(
                (name, functools.partial(run_layout, name, overrides, out.parent))
                for name, overrides in [*LAYOUTS.items(), MISSCALED_LAYOUT, BF16_LAYOUT, RAGGED_LAYOUT]
            ),
        ],
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
