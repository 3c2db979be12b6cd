"""Activation offload (`[activation_checkpoint] offload`): what each checkpointed block keeps for
backward goes to host memory and comes back unchanged. On this CPU host nothing needs moving, so the
copies are forced (`in_host_memory` answers False) and run through the same hooks a device would."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import titan_tpu.distributed.activation_offload as offload
from titan_tpu.config import ConfigError, load_config
from titan_tpu.training.trainer import Trainer

RUN = [
    "--training.dtype=float32",
    "--training.steps=1",
    "--metrics.plot_loss=false",
    "--activation_checkpoint.mode=full",
]


def gradients(tmp_path: Path, *overrides: str) -> tuple[float, dict[str, torch.Tensor]]:
    trainer = Trainer(load_config("llama3_debug", [f"--job.dump_folder={tmp_path}", *RUN, *overrides]))
    try:
        loss, _ = trainer.forward_backward()
        grads = {name: p.grad.detach().clone() for name, p in trainer.model.named_parameters()}
    finally:
        trainer.close()
    return float(loss), grads


def copies(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """Force the host copies on this CPU and record the shape of every tensor copied."""
    shapes: list[tuple[int, ...]] = []
    original = offload.OnHost.__init__

    def recording(self: offload.OnHost, tensor: torch.Tensor) -> None:
        shapes.append(tuple(tensor.shape))
        original(self, tensor)

    monkeypatch.setattr(offload, "in_host_memory", lambda tensor: False)
    monkeypatch.setattr(offload.OnHost, "__init__", recording)
    return shapes


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_offloaded_blocks_give_the_same_gradients(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compiled: bool
) -> None:
    """Forced copies: the loss and every gradient equal those without offload, bit for bit, and what
    was copied is each block's input (4 blocks x [batch, seq, dim]): no parameter, no rotary table. Catches a restore that returns another tensor (the negative control: zeros), a saved
    tensor copied twice or left out, and parameters or shared tables moved."""
    compile_flag = f"--compile.enable={str(compiled).lower()}"
    loss, grads = gradients(tmp_path / "plain", compile_flag)
    shapes = copies(monkeypatch)
    offloaded_loss, offloaded = gradients(tmp_path / "offload", compile_flag, "--activation_checkpoint.offload=true")
    assert offloaded_loss == loss
    assert grads.keys() == offloaded.keys()
    for name, grad in grads.items():
        assert torch.equal(offloaded[name], grad), name
    block_input = (8, 256, 256)
    assert shapes.count(block_input) == 4
    # Compiled, a checkpointed graph also keeps the generator state it replays (5056 bytes); nothing
    # else, and nothing of a parameter's or a rotary table's size.
    others = [shape for shape in shapes if shape != block_input]
    assert others == [] if not compiled else all(shape == (5056,) for shape in others)
    # Negative control: a restore that hands back zeros for the activations changes the gradients.
    restore = offload.OnHost.restore
    monkeypatch.setattr(
        offload.OnHost,
        "restore",
        lambda self: torch.zeros_like(self.host) if self.host.is_floating_point() else restore(self),
    )
    _, broken = gradients(tmp_path / "broken", compile_flag, "--activation_checkpoint.offload=true")
    assert any(not torch.equal(broken[name], grad) for name, grad in grads.items())


def test_on_a_cpu_host_the_hooks_run_and_copy_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Catches hooks that are never installed (no forward runs under them) and copies on a host where
    the tensors are in host memory already."""
    entered = []
    pack_for = offload._pack_for
    monkeypatch.setattr(offload, "_pack_for", lambda shared: entered.append(1) or pack_for(shared))
    monkeypatch.setattr(offload.OnHost, "__init__", lambda self, tensor: pytest.fail("copied on a CPU host"))
    gradients(tmp_path, "--activation_checkpoint.offload=true")
    assert len(entered) == 4  # one forward of each of the 4 blocks


def test_offload_without_checkpointing_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"activation_checkpoint.offload: .*mode = full or selective"):
        load_config("llama3_debug", ["--activation_checkpoint.offload=true"])
