"""Worker for the multi-process parallelism tests: `torchrun --nproc-per-node 4 parallel_worker.py OUT`.

One launch runs, in sequence on the same 4 processes:
  1. sharded layers: each TP-sharded linear and the attention block (tp 4), and a whole block with
     sequence parallelism, forward and backward, against the unsharded module;
  2. for each layout (FSDP 4, HSDP 2x2, TP 2 x FSDP 2 (compiled blocks), TP 4 with loss parallel, TP 2 x
     replicate 2 without sequence parallel, with activation checkpointing, and TP 2 x FSDP 2 accumulating
     2 micro-batches per step): a real `Trainer` is built, its freshly initialised weights are gathered
     and compared with a single-process initialisation, it trains 10 fp32 steps (8 past warmup), and
     the per-step losses and gradient norms and the full final state (parameters and AdamW state,
     gathered) are kept (parity.RunResult); FSDP 4 also reports each rank's parameter + gradient +
     optimizer-state bytes. Every run also measures its held-out loss (`[validation]`, 2 global
     batches of OUT's folder/held_out.jsonl, which the test writes) at steps 5 and 10.
Rank 0 writes OUT (JSON) and OUT's folder/<layout>.pt. `reference()` is the single-process side, run by
the test.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import random
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.distributed.worker_cases import run_cases  # noqa: E402
from tests.support.kernel_fakes import SHAPE, FakeArgs, FakeClock, FakeKernel, fake_tunable  # noqa: E402
from tests.support.launch import fixed_kernels  # noqa: E402
from tests.support.parity import RunResult, train_and_capture  # noqa: E402
from titan_tpu.autotune.choose import choose_kernels  # noqa: E402
from titan_tpu.autotune.measure import measure  # noqa: E402
from titan_tpu.config import load_config  # noqa: E402
from titan_tpu.distributed.parallel_dims import ParallelContext, ParallelDims  # noqa: E402
from titan_tpu.distributed.parallelize import parallelize_model  # noqa: E402
from titan_tpu.distributed.sharded_init import canonical_name  # noqa: E402
from titan_tpu.distributed.tensor_parallel import loss_context  # noqa: E402
from titan_tpu.models.common.attention import Attention  # noqa: E402
from titan_tpu.models.common.loss import cross_entropy_loss  # noqa: E402
from titan_tpu.models.common.parallelize import apply_decoder_tp, decoder_block_plan  # noqa: E402
from titan_tpu.models.llama3.model import Llama3Model, build_llama3_block  # noqa: E402
from titan_tpu.models.registry import get_model_spec  # noqa: E402

STEPS = 10


def layout_run(config: str, global_batch_size: int, steps: int = STEPS) -> list[str]:
    """train.py arguments of a layout-parity run of `config`: a short float32 run with pinned
    kernels, logged every step, that each layout and the single process train alike (the
    expert-parallel worker uses it too)."""
    return [
        *fixed_kernels(config),
        "--training.seq_len=32",
        f"--training.global_batch_size={global_batch_size}",
        "--training.local_batch_size=-1",
        "--training.dtype=float32",
        f"--training.steps={steps}",
        "--metrics.log_freq=1",
        "--data.shuffle_buffer=16",
        "--lr_scheduler.warmup_steps=2",
    ]


BASE = layout_run("llama3_debug", global_batch_size=4)
HELD_OUT = "held_out.jsonl"
WORDS = "every layout evaluates the same held out rows and so reports the same validation loss".split()


def write_held_out(folder: Path) -> None:
    """A few KB of held-out text (60 records) in `folder`, for every run of the launch."""
    rng = random.Random(0)
    records = [{"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 16)))} for _ in range(60)]
    (folder / HELD_OUT).write_text("".join(json.dumps(r) + "\n" for r in records))


def validation_run(folder: Path) -> list[str]:
    """train.py arguments that evaluate the held-out text in `folder` at steps 5 and 10."""
    return [
        "--validation.enable=true",
        f"--validation.path={folder / HELD_OUT}",
        "--validation.batches=2",
        "--metrics.eval_freq=5",
    ]


LAYOUTS: dict[str, list[str]] = {
    "fsdp4": ["--parallelism.dp_shard=4"],
    "hsdp2x2": ["--parallelism.dp_replicate=2", "--parallelism.dp_shard=2"],
    # With per-block torch.compile (aot_eager: the autograd path of inductor without its C++ build).
    "tp2_fsdp2": [
        "--parallelism.tp=2",
        "--parallelism.dp_shard=2",
        "--compile.enable=true",
        "--compile.backend=aot_eager",
    ],
    "tp4": ["--parallelism.tp=4", "--parallelism.loss_parallel=true"],
    # Extra coverage, same loss: replication only (fully_shard on a (2, 1) mesh), TP without
    # sequence parallelism, full activation checkpointing under FSDP with the offload hooks on each
    # block beside FSDP's (on this CPU host they copy nothing: tests/unit/distributed/test_activation_offload.py).
    "tp2_replicate2_nosp_ac": [
        "--parallelism.tp=2",
        "--parallelism.dp_replicate=2",
        "--parallelism.dp_shard=1",
        "--parallelism.sequence_parallel=false",
        "--activation_checkpoint.mode=full",
        "--activation_checkpoint.offload=true",
    ],
    # Gradient accumulation under FSDP: 2 micro-batches of 1 sequence per rank and step, where every
    # other layout takes one batch (a missing or doubled 1/accumulation would scale the gradients).
    "tp2_fsdp2_accum2": ["--parallelism.tp=2", "--parallelism.dp_shard=2", "--training.local_batch_size=1"],
}


def local(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((local(a).detach() - local(b).detach()).abs().max())


# ---------------------------------------------------------------- 1. sharded layers (tp = world)


def grads_diff(sharded: nn.Module, reference: nn.Module) -> float:
    ref = dict(reference.named_parameters())
    return max(max_diff(p.grad, ref[n].grad) for n, p in sharded.named_parameters())


def kernel_picks() -> dict[str, list[str]]:
    """Every rank's fake kernels cost what its rank says (kernel "a" is fastest on rank 0 only), so
    ranks deciding alone would disagree ("own"); choose_kernels has them all run rank 0's pick."""
    rank = dist.get_rank()
    kernels = {"a": FakeKernel(0.001 if rank == 0 else 0.003), "b": FakeKernel(0.002)}
    clock = FakeClock()
    tunable = fake_tunable(kernels, clock)
    _, [choice] = choose_kernels([tunable], FakeArgs(), SHAPE, "fake", deterministic=False, cache=None, timer=clock)
    own = measure(tunable, FakeArgs(), SHAPE, kernels, synchronize=lambda: None, timer=clock).pick
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (choice.pick, own))
    return {"picks": [pick for pick, _ in gathered], "own": [own for _, own in gathered]}


def sharded_layers() -> dict[str, float]:
    tp_mesh = DeviceMesh("cpu", torch.arange(dist.get_world_size()))
    torch.manual_seed(0)
    dim, hidden, seq = 64, 128, 8
    x = torch.randn(2, seq, dim)
    results: dict[str, float] = {}
    for name, style, in_dim, out_dim in (
        ("colwise_linear", ColwiseParallel(), dim, hidden),
        ("rowwise_linear", RowwiseParallel(), hidden, dim),
    ):
        torch.manual_seed(1)
        reference = nn.Linear(in_dim, out_dim, bias=False)
        sharded = parallelize_module(copy.deepcopy(reference), tp_mesh, style)
        inp = torch.randn(2, seq, in_dim)
        ref_out = reference(inp)
        if name == "rowwise_linear":  # row-wise takes its input sharded on the last dim
            shard_in = distribute_tensor(inp, tp_mesh, [Shard(-1)]).to_local()
            out = sharded(shard_in)
        else:
            out = sharded(inp)
        out = local(out)
        if name == "colwise_linear":  # column-wise leaves the output sharded on the last dim
            out = DTensor.from_local(out, tp_mesh, [Shard(-1)]).full_tensor()
        out.square().sum().backward()
        ref_out.square().sum().backward()
        results[f"{name}_forward"] = max_diff(out, ref_out)
        results[f"{name}_backward"] = grads_diff(sharded, reference)

    torch.manual_seed(2)
    attention = Attention(dim=dim, n_heads=8, n_kv_heads=4, head_dim=8, qk_norm=False, norm_eps=1e-5)
    cos, sin = torch.randn(seq, 8), torch.randn(seq, 8)
    sharded_attention = parallelize_module(
        copy.deepcopy(attention),
        tp_mesh,
        {"wq": ColwiseParallel(), "wk": ColwiseParallel(), "wv": ColwiseParallel(), "wo": RowwiseParallel()},
    )
    xa = x.clone().requires_grad_()
    xb = x.clone().requires_grad_()
    out, ref_out = sharded_attention(xa, cos, sin), attention(xb, cos, sin)
    out.square().sum().backward()
    ref_out.square().sum().backward()
    results["attention_forward"] = max_diff(out, ref_out)
    results["attention_backward"] = max(grads_diff(sharded_attention, attention), max_diff(xa.grad, xb.grad))

    # A whole Llama block with sequence parallelism: input and output sharded along the sequence.
    args = get_model_spec("llama3").flavor("debug")
    torch.manual_seed(3)
    block = build_llama3_block(args, 0)
    block.init_weights()
    sharded_block = parallelize_module(copy.deepcopy(block), tp_mesh, decoder_block_plan(block, sequence_parallel=True))
    xs = torch.randn(2, seq, args.dim)
    cos, sin = torch.randn(seq, args.attn_head_dim), torch.randn(seq, args.attn_head_dim)
    xa = distribute_tensor(xs, tp_mesh, [Shard(1)]).to_local().clone().requires_grad_()
    xb = xs.clone().requires_grad_()
    out = DTensor.from_local(local(sharded_block(xa, cos, sin)), tp_mesh, [Shard(1)]).full_tensor()
    ref_out = block(xb, cos, sin)
    out.square().sum().backward()
    ref_out.square().sum().backward()
    results["sp_block_forward"] = max_diff(out, ref_out)
    ref_x_grad = distribute_tensor(xb.grad, tp_mesh, [Shard(1)]).to_local()
    results["sp_block_backward"] = max(grads_diff(sharded_block, block), max_diff(xa.grad, ref_x_grad))

    # A whole model with tied embeddings through the Llama 3 plan, with and without sequence and
    # loss parallelism: loss and every gradient against the unsharded model.
    tied = dataclasses.replace(args, dim=64, n_layers=2, vocab_size=128, tie_embeddings=True, max_seq_len=seq)
    torch.manual_seed(4)
    model = Llama3Model(tied)
    model.init_weights()
    tokens = torch.randint(0, tied.vocab_size, (2, seq + 1))
    ref_loss = cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:])
    ref_loss.backward()
    for sp, lp in ((True, True), (False, False)):
        sharded_model = copy.deepcopy(model)
        sharded_model.zero_grad(set_to_none=True)
        apply_decoder_tp(sharded_model, tp_mesh, sequence_parallel=sp, loss_parallel=lp)
        with loss_context(lp):
            loss = cross_entropy_loss(sharded_model(tokens[:, :-1]), tokens[:, 1:])
            loss.backward()
        tag = f"tied_model_sp{int(sp)}_lp{int(lp)}"
        results[f"{tag}_forward"] = max_diff(loss, ref_loss)
        results[f"{tag}_backward"] = grads_diff(sharded_model, model)
    return results


# ---------------------------------------------------------------- 2. layouts through the trainer


def single_process_init(config: Any) -> dict[str, torch.Tensor]:
    """What a single process initialises (the full model is tiny), by canonical parameter name.
    Layouts differ in their parallelism, compile and checkpointing keys, none of which changes the
    initial values, so each model, flavor, sequence length and seed is built once per process (the
    layout-invariant init draws every row from its own generator: seconds on 4 processes)."""
    return _single_process_init(config.model.name, config.model.flavor, config.training.seq_len, config.training.seed)


@functools.cache
def _single_process_init(model_name: str, flavor: str, seq_len: int, seed: int) -> dict[str, torch.Tensor]:
    config = load_config(
        "llama3_debug",
        [
            f"--model.name={model_name}",
            f"--model.flavor={flavor}",
            f"--training.seq_len={seq_len}",
            f"--training.seed={seed}",
        ],
    )
    spec = get_model_spec(model_name)
    args = dataclasses.replace(spec.flavor(flavor), max_seq_len=seq_len)
    with torch.device("meta"):
        model = spec.model_cls(args)
    ctx = ParallelContext(ParallelDims(1, 1, 1, 1, 1))
    model = parallelize_model(model, None, ctx, config, torch.device("cpu"), torch.float32)
    return {canonical_name(n): p.detach() for n, p in model.named_parameters()}


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of parameters + gradients + optimizer state held by this rank (local shards)."""

    def nbytes(t: torch.Tensor) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    total = sum(nbytes(p) for p in model.parameters())
    total += sum(nbytes(p.grad) for p in model.parameters() if p.grad is not None)
    for state in optimizer.state.values():
        total += sum(nbytes(v) for v in state.values() if isinstance(v, torch.Tensor))
    return total


def fill_grads(trainer: Any) -> None:
    """One more forward/backward (any tokens will do) so that gradients exist when the bytes are
    counted; after the final state was taken, so it changes nothing that is compared."""
    output = trainer.model(torch.randint(0, 256, (1, 32)))
    logits = output.logits if hasattr(output, "logits") else output
    local(logits).float().square().mean().backward()


def run_layout(name: str, overrides: list[str], dump: Path) -> dict[str, Any]:
    from titan_tpu.training.trainer import Trainer

    config = load_config("llama3_debug", [*BASE, *validation_run(dump), *overrides, f"--job.dump_folder={dump / name}"])
    trainer = Trainer(config)
    reference = single_process_init(config)
    init_diff = max(max_diff(p, reference[canonical_name(n)]) for n, p in trainer.model.named_parameters())
    run = train_and_capture(trainer)
    if dist.get_rank() == 0:
        run.save(dump / f"{name}.pt")
    result: dict[str, Any] = {"init_max_abs_diff": init_diff}
    if name == "fsdp4":
        fill_grads(trainer)
        mine = torch.tensor([state_bytes(trainer.model, trainer.optimizer)])
        everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine)
        result["state_bytes_per_rank"] = [int(b) for b in everyone]
    return result


def reference(dump: Path) -> tuple[RunResult, int]:
    """Single process, same config: the run and its state bytes."""
    from titan_tpu.training.trainer import Trainer

    config = load_config("llama3_debug", [*BASE, *validation_run(dump), f"--job.dump_folder={dump / 'single'}"])
    trainer = Trainer(config)
    run = train_and_capture(trainer)
    fill_grads(trainer)
    nbytes = state_bytes(trainer.model, trainer.optimizer)
    trainer.close()
    return run, nbytes


def main(out: Path) -> None:
    run_cases(
        out,
        [
            ("sharded_layers", sharded_layers),
            ("kernel_picks", kernel_picks),
            *(
                (name, functools.partial(run_layout, name, overrides, out.parent))
                for name, overrides in LAYOUTS.items()
            ),
        ],
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
