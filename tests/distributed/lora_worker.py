"""Worker for the LoRA layout test: `torchrun --nproc-per-node 4 lora_worker.py OUT.json`.

Parts, in one launch:
- `layer`: an adapted column-wise then row-wise pair (an MLP's up and down projections) sharded over
  the 4 ranks by torch's styles, its factors placed (titan_tpu/lora/placement.py), with and without
  sequence parallelism, against the same layers on one device: outputs, the input's gradient and
  every factor's gradient.
- three LoRA runs of a real `Trainer` (a 2-layer debug Qwen 3, and transformers' Mistral through the
  hf family, float32, 3 steps at a learning rate that makes B non-zero from step 1): HSDP 2 x 2 (FSDP 2
  inside each replica) and TP 2 x FSDP 2 with sequence parallelism, and the hf family under TP 2 x
  FSDP 2. Each saves its `RunResult` and every step's adapter gradients (after clipping, before the
  optimizer step) to OUT's folder.
- the negative control: TP 2 x FSDP 2 whose adapters are drawn per shard from the global generator
  (as `reset_adapter()` alone does) instead of by the layout-invariant init; one step.

`reference()` runs the single processes the test compares with.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard  # noqa: E402
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: E402

from tests.distributed.worker_cases import run_cases  # noqa: E402
from tests.support.launch import fixed_kernels  # noqa: E402
from tests.support.parity import train_and_capture  # noqa: E402
from titan_tpu.config import load_config  # noqa: E402
from titan_tpu.distributed.sharded_init import canonical_name  # noqa: E402
from titan_tpu.lora.placement import place_factors  # noqa: E402
from titan_tpu.models.common.lora import LoRALinear, lora_layers  # noqa: E402

STEPS = 3
LORA = ["--lora.enable", "--lora.rank=4", "--lora.alpha=8"]
COMMON = [
    "--training.seq_len=32",
    "--training.global_batch_size=4",
    "--training.dtype=float32",
    f"--training.steps={STEPS}",
    "--optimizer.lr=1e-2",
    "--lr_scheduler.warmup_steps=1",
    "--metrics.log_freq=1",
    "--data.shuffle_buffer=16",
    *LORA,
]
QWEN3 = [
    "qwen3_debug",
    *fixed_kernels("qwen3_debug"),
    "--model.overrides={ n_layers = 2, dim = 64, n_heads = 4, n_kv_heads = 2, head_dim = 16, ffn_hidden_dim = 128 }",
]
MISTRAL = ["hf_mistral_debug", "--model.attention_block=0"]
TP2_FSDP2 = ["--parallelism.tp=2", "--parallelism.dp_shard=2"]
LAYOUTS: dict[str, tuple[list[str], list[str]]] = {
    "hsdp2x2": (QWEN3, ["--parallelism.dp_replicate=2", "--parallelism.dp_shard=2"]),
    "tp2_fsdp2": (QWEN3, TP2_FSDP2),
    "hf_tp2_fsdp2": (MISTRAL, TP2_FSDP2),
}


def trainer_for(model: list[str], overrides: list[str], dump: Path) -> Any:
    from titan_tpu.training.trainer import Trainer

    name, *options = model
    return Trainer(load_config(name, [*options, *COMMON, *overrides, f"--job.dump_folder={dump}"]))


def capture_adapter_grads(trainer: Any) -> dict[int, dict[str, torch.Tensor]]:
    """Every step's adapter gradients as the optimizer sees them (full tensors, by canonical name)."""
    grads: dict[int, dict[str, torch.Tensor]] = {}

    def before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        step = len(grads) + 1
        grads[step] = {}
        for name, param in trainer.model.named_parameters():
            if param.grad is not None:
                grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
                grads[step][canonical_name(name)] = grad.detach().to("cpu", copy=True)

    trainer.optimizer.register_step_pre_hook(before_step)
    return grads


def train(trainer: Any) -> dict[str, Any]:
    grads = capture_adapter_grads(trainer)
    run = train_and_capture(trainer)
    return {"run": run.__dict__, "grads": grads}


def run_layout(name: str, dump: Path) -> None:
    model, overrides = LAYOUTS[name]
    captured = train(trainer_for(model, overrides, dump / name))
    if dist.get_rank() == 0:
        torch.save(captured, dump / f"{name}.pt")


def run_drawn_per_shard(dump: Path) -> None:
    """The negative control: after the run's init, every adapter re-drawn by reset_adapter() on its
    shards from the global generator, as an init that ignores the layout would leave them."""
    model, overrides = LAYOUTS["tp2_fsdp2"]
    trainer = trainer_for(model, [*overrides, "--training.steps=1"], dump / "drawn_per_shard")
    torch.manual_seed(0)
    for _, layer in lora_layers(trainer.model):
        layer.reset_adapter()
    captured = train(trainer)
    if dist.get_rank() == 0:
        torch.save(captured, dump / "drawn_per_shard.pt")


def reference(dump: Path) -> dict[str, dict[str, Any]]:
    """One process per model: the runs each layout must match."""
    runs = {}
    for name, model in (("qwen3", QWEN3), ("mistral", MISTRAL)):
        trainer = trainer_for(model, [], dump / f"single_{name}")
        runs[name] = train(trainer)
        trainer.close()
    return runs


def mlp(generator: torch.Generator) -> nn.ModuleDict:
    """A column-wise then row-wise pair with non-zero factors (as after training)."""
    up = LoRALinear.wrapping(nn.Linear(8, 16), rank=4, alpha=8.0, dropout=0.0)
    down = LoRALinear.wrapping(nn.Linear(16, 8), rank=4, alpha=8.0, dropout=0.0)
    layers = nn.ModuleDict({"up": up, "down": down})
    with torch.no_grad():
        for param in layers.parameters():
            param.copy_(torch.randn(param.shape, generator=generator))
    return layers


def forward_backward(layers: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    x = x.detach().requires_grad_(True)
    out = layers["down"](torch.relu(layers["up"](x)))
    out.pow(2).sum().backward()
    grads = {"input": x.grad}
    for name, param in layers.named_parameters():
        if param.grad is not None:
            grads[name] = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
    return out, grads


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def layer_part() -> dict[str, float]:
    """|sharded - one device| / |one device| of the output and every gradient, per case."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    x = torch.randn(2, 8, 8, generator=torch.Generator().manual_seed(1))
    single_out, single_grads = forward_backward(mlp(torch.Generator().manual_seed(0)), x)
    differences: dict[str, float] = {}
    for case, sequence_parallel in (("tp4", False), ("tp4_sequence_parallel", True)):
        layers = mlp(torch.Generator().manual_seed(0))
        residual = Shard(1) if sequence_parallel else Replicate()
        plan = {
            "up": ColwiseParallel(input_layouts=residual),
            "down": RowwiseParallel(output_layouts=residual),
        }
        parallelize_module(layers, mesh, plan)
        place_factors(layers)
        local_x = x.chunk(mesh.size(), dim=1)[mesh.get_local_rank()] if sequence_parallel else x
        out, grads = forward_backward(layers, local_x)
        if sequence_parallel:  # the rank's slice of the sequence: gather it back, and the input gradient
            out = DTensor.from_local(out, mesh, [Shard(1)]).full_tensor()
            grads["input"] = DTensor.from_local(grads["input"], mesh, [Shard(1)]).full_tensor()
        differences[f"{case}/output"] = relative(out, single_out)
        for name, grad in grads.items():
            differences[f"{case}/grad/{name}"] = relative(grad, single_grads[name])
    return differences


def main(out: Path) -> None:
    dump = out.parent
    run_cases(
        out,
        [
            ("layer", layer_part),
            *((name, functools.partial(run_layout, name, dump)) for name in LAYOUTS),
            ("drawn_per_shard", functools.partial(run_drawn_per_shard, dump)),
        ],
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
