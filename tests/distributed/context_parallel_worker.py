"""Worker for the context-parallel tests: `torchrun --nproc-per-node N context_parallel_worker.py OUT CASE...`.

Cases, run in order on the same processes:
  - "attention" (cp = all N ranks): one attention layer (GQA, rotary) on each rank's two chunks of
    the sequence, keys and values gathered over cp, against the same layer on the whole sequence:
    outputs and input gradients (joined back into sequence order) and the weight gradients (summed
    over the ranks, as FSDP sums them);
  - a layout of LAYOUTS (CP 2; CP 2 x FSDP 2 with compiled blocks; CP 2 x replicate 2 (HSDP);
    CP 2 x TP 2 with activation checkpointing): a real `Trainer` on the Llama 3 debug model (the
    parallelism suite's 10 fp32 steps, parallel_worker.layout_run) whose run (per-step loss and
    gradient norm, gathered final parameters and AdamW state) is saved to OUT's
    folder/<layout>.pt for the test to compare with a single process;
  - "activations" (cp = all N ranks): the live-tensor peak of one forward + backward of the Llama 3
    debug model (512 tokens, 4 samples, float32, no FSDP) on each rank's chunks, beside the
    planner's per-rank activation peak for the same config (and, for the negative control, its
    peak for one process, which holds every token);
  - UNBALANCED_MASK: the CP 2 layout with each rank's causal mask built from contiguous positions
    (rank r holding tokens r*S/2 .. (r+1)*S/2 - 1) while the data and rotary tables keep the
    balanced chunks: the negative control the parity comparison must reject.
Rank 0 writes OUT (JSON).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.distributed.parallel_worker import layout_run  # noqa: E402
from tests.distributed.worker_cases import run_cases  # noqa: E402
from tests.support.parity import RunResult, train_and_capture  # noqa: E402
from tests.support.plan_measure import LiveTensorPeak  # noqa: E402
from titan_tpu.config import load_config  # noqa: E402
from titan_tpu.distributed.context_parallel import (  # noqa: E402
    ContextParallelAttention,
    join_ranks,
    split_for_rank,
)
from titan_tpu.models.common.attention import Attention  # noqa: E402
from titan_tpu.models.common.parallelize import apply_decoder_cp  # noqa: E402
from titan_tpu.models.common.rope import RotaryEmbedding  # noqa: E402
from titan_tpu.models.registry import get_model_spec  # noqa: E402
from titan_tpu.plan.census import run_model_args  # noqa: E402
from titan_tpu.plan.planner import plan_memory  # noqa: E402

CONFIG = "llama3_debug"
BASE = layout_run(CONFIG, global_batch_size=4)
LAYOUTS: dict[str, list[str]] = {
    "cp2": ["--parallelism.cp=2", "--parallelism.dp_shard=1"],
    # With per-block torch.compile (aot_eager), as the parallelism suite's TP 2 x FSDP 2.
    "cp2_fsdp2": [
        "--parallelism.cp=2",
        "--parallelism.dp_shard=2",
        "--compile.enable=true",
        "--compile.backend=aot_eager",
    ],
    # HSDP: replicated over dp_replicate, sharded over dp_shard x cp (here cp alone).
    "cp2_replicate2": ["--parallelism.cp=2", "--parallelism.dp_replicate=2", "--parallelism.dp_shard=1"],
    # TP inside CP, sequence parallel and full activation checkpointing (the recompute gathers again).
    "cp2_tp2_ac": [
        "--parallelism.cp=2",
        "--parallelism.tp=2",
        "--parallelism.dp_shard=1",
        "--activation_checkpoint.mode=full",
    ],
}
UNBALANCED_MASK = "cp2_unbalanced_mask"


def contiguous_causal_mask(self: ContextParallelAttention, seq_len: int, device: torch.device) -> torch.Tensor:
    """The wrong mask: positions as if rank r held the r-th contiguous 1/cp of the sequence, while
    its tokens are in fact chunks r and 2 cp - 1 - r."""
    local = seq_len // self.cp
    queries = torch.arange(self.cp_rank * local, (self.cp_rank + 1) * local, device=device)
    keys = torch.arange(seq_len, device=device)
    return keys[None, :] <= queries[:, None]


def attention_case() -> dict[str, float]:
    """Max abs differences of the cp attention layer against the whole-sequence one."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    mesh = DeviceMesh("cpu", torch.arange(cp))
    torch.manual_seed(0)
    dim, seq = 64, 16
    layer = Attention(dim=dim, n_heads=8, n_kv_heads=2, head_dim=8, qk_norm=True, norm_eps=1e-5)
    layer.init_weights(0.02)
    rope = RotaryEmbedding(8, seq, theta=10000.0, scaling=None)
    x = torch.randn(2, seq, dim)
    whole = x.clone().requires_grad_()
    expected = layer(whole, *rope(seq))
    expected.square().sum().backward()
    expected_grads = {name: p.grad.clone() for name, p in layer.named_parameters()}
    layer.zero_grad()

    layer.kernel = ContextParallelAttention(layer.kernel, mesh.get_group(), cp, rank)
    mine = split_for_rank(x, cp, rank).clone().requires_grad_()
    positions = split_for_rank(torch.arange(seq)[None], cp, rank)[0]
    cos, sin = rope(seq)
    out = layer(mine, cos[positions], sin[positions])
    out.square().sum().backward()
    gathered_out = [torch.empty_like(out) for _ in range(cp)]
    gathered_grad = [torch.empty_like(mine) for _ in range(cp)]
    dist.all_gather(gathered_out, out.detach())
    dist.all_gather(gathered_grad, mine.grad)
    weight_diff = 0.0
    for name, param in layer.named_parameters():
        dist.all_reduce(param.grad)
        weight_diff = max(weight_diff, float((param.grad - expected_grads[name]).abs().max()))
    return {
        "forward": float((join_ranks(gathered_out) - expected.detach()).abs().max()),
        "input_grad": float((join_ranks(gathered_grad) - whole.grad).abs().max()),
        "weight_grad": weight_diff,
    }


# As tests/unit/plan/test_activations.py: activations (about 50 to 100 MB per rank here) dwarf anything
# incidental. As many kv heads as query heads, so the gathered keys and values weigh (10% to 23%).
ACTIVATION_RUN = [
    "--training.seq_len=512",
    "--training.global_batch_size=4",
    "--training.dtype=float32",
    "--model.overrides.n_kv_heads=8",
]


def activations_case() -> dict[str, int]:
    """Measured and planned activation peaks of this rank (bytes); for the negative controls, the
    planner's peak without the gathered keys and values, and a single process's."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    config = load_config(CONFIG, [*ACTIVATION_RUN, f"--parallelism.cp={cp}", "--parallelism.dp_shard=1"])
    spec = get_model_spec(config.model.name)
    torch.manual_seed(0)
    model = spec.model_cls(run_model_args(config))
    apply_decoder_cp(model, DeviceMesh("cpu", torch.arange(cp), mesh_dim_names=("cp",)))
    whole = torch.randint(0, 256, (config.training.global_batch_size, config.training.seq_len))
    tokens = split_for_rank(whole, cp, rank)
    # A first backward allocates the gradients (and the shared mask), as a step before the measured one.
    spec.loss_fn(model(tokens), tokens).backward()
    existing = [*model.parameters(), *(p.grad for p in model.parameters()), *model.buffers()]
    with LiveTensorPeak(existing) as tally:  # type: ignore[arg-type]
        spec.loss_fn(model(tokens), tokens).backward()
    planned = plan_memory(config, cp).activations.peak
    with mock.patch("titan_tpu.plan.planner.with_gathered_kv", lambda block, *args: block):
        without_gathered_kv = plan_memory(config, cp).activations.peak
    return {
        "measured": tally.peak,
        "planned": planned,
        "planned_without_gathered_kv": without_gathered_kv,
        "planned_one_process": plan_memory(load_config(CONFIG, ACTIVATION_RUN), 1).activations.peak,
    }


def run_layout(name: str, overrides: list[str], dump: Path) -> None:
    from titan_tpu.training.trainer import Trainer

    trainer = Trainer(load_config(CONFIG, [*BASE, *overrides, f"--job.dump_folder={dump / name}"]))
    run = train_and_capture(trainer)
    if dist.get_rank() == 0:
        run.save(dump / f"{name}.pt")


def run_unbalanced(dump: Path) -> None:
    with mock.patch.object(ContextParallelAttention, "causal_mask", contiguous_causal_mask):
        run_layout(UNBALANCED_MASK, LAYOUTS["cp2"], dump)


def reference(dump: Path) -> RunResult:
    """The single process, same config."""
    from titan_tpu.training.trainer import Trainer

    trainer = Trainer(load_config(CONFIG, [*BASE, f"--job.dump_folder={dump / 'single'}"]))
    run = train_and_capture(trainer)
    trainer.close()
    return run


def case(name: str, dump: Path) -> tuple[str, Any]:
    if name == "attention":
        return name, attention_case
    if name == "activations":
        return name, activations_case
    if name == UNBALANCED_MASK:
        return name, lambda: run_unbalanced(dump)
    return name, lambda: run_layout(name, LAYOUTS[name], dump)


def main(out: Path, names: list[str]) -> None:
    run_cases(out, [case(name, out.parent) for name in names])


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
