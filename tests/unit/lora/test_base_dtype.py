"""The adapted linears' frozen base stored in the run's compute dtype (titan_tpu/lora/apply.py
`base_dtype`): half the bytes under bf16, and the same numbers as a float32 base cast at each forward.

Bugs caught: a bf16 base that changes the run (a cast that rounds differently from autocast's, or a
parameter stored lower that autocast would not have cast: norms, embeddings); adapters stored in bf16
(their updates would round away); an FSDP group refusing the mix of bf16 frozen and float32 trained
parameters."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from unittest import mock

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from tests.unit.training.test_lora_training import RUN, base  # noqa: F401  # base: the fixture
from titan_tpu.config import load_config
from titan_tpu.config.sections import LoRAConfig
from titan_tpu.distributed.parallelize import block_containers
from titan_tpu.lora import apply
from titan_tpu.lora.apply import apply_lora
from titan_tpu.models.common.lora import LoRALinear, lora_layers
from titan_tpu.models.registry import get_model_spec
from titan_tpu.training.trainer import Trainer

LORA = LoRAConfig(enable=True, rank=4, alpha=8.0)


def meta_model() -> nn.Module:
    spec = get_model_spec("qwen3")
    args = dataclasses.replace(spec.flavors["debug"], n_layers=2, max_seq_len=32)
    with torch.device("meta"):
        return spec.model_cls(args)


def test_only_the_adapted_linears_frozen_weights_take_the_compute_dtype() -> None:
    model = meta_model()
    targets = apply_lora(model, LORA, block_containers(model), "qwen3 debug", base_dtype=torch.bfloat16)
    adapted = {f"{path}.weight" for path in targets}
    for name, param in model.named_parameters():
        if name in adapted:
            assert param.dtype == torch.bfloat16 and not param.requires_grad, name
        else:  # adapters, norms, embeddings, head
            assert param.dtype == torch.float32, name
    assert all(layer.lora_A.requires_grad and layer.lora_B.requires_grad for _, layer in lora_layers(model))


def _bf16_run(dump: Path, base_folder: Path) -> tuple[list[float], dict[str, torch.Tensor]]:
    options = [*RUN, "--training.dtype=bfloat16", "--training.steps=2", "--checkpoint.enable=false"]
    options += [f"--job.dump_folder={dump}", f"--checkpoint.initial_load_path={base_folder}"]
    trainer = Trainer(load_config("qwen3_debug", options))
    try:
        losses = [float(trainer.train_step()[0]) for _ in range(2)]
        # The adapters after two updates: their gradients decided them (the optimizer drops the grads).
        trained = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
        dtypes = {layer.weight.dtype for _, layer in lora_layers(trainer.model)}
        return losses, {**trained, "_dtypes": torch.tensor([d == torch.bfloat16 for d in dtypes])}
    finally:
        trainer.close()


def test_a_bf16_base_trains_exactly_as_a_float32_base_under_autocast(base: Path, tmp_path: Path) -> None:  # noqa: F811
    """One process under bf16 autocast, the base read from a folder: the losses of two steps and the
    adapters they trained equal, bit for bit, those of the same run whose base stays float32 (the
    negative control is the dtype check: that run's adapted weights are float32)."""
    stored, stored_state = _bf16_run(tmp_path / "bf16", base)
    original = apply.apply_lora

    def float32_base(*args: object, **kwargs: object) -> list[str]:
        return original(*args, **{**kwargs, "base_dtype": None})  # type: ignore[arg-type]

    with mock.patch("titan_tpu.training.trainer.apply_lora", float32_base):
        cast, cast_state = _bf16_run(tmp_path / "fp32", base)
    assert bool(stored_state.pop("_dtypes").all()) and not bool(cast_state.pop("_dtypes").any())
    assert stored == cast
    assert stored_state.keys() == cast_state.keys() and all(n.endswith(("lora_A", "lora_B")) for n in stored_state)
    for name, value in stored_state.items():
        assert torch.equal(value, cast_state[name]), name


def test_fsdp_takes_a_group_of_bf16_frozen_and_float32_trained_parameters(fake_world: int) -> None:
    """FSDP2 wants one dtype among a group's trained parameters only; with bf16 mixed precision the
    frozen bf16 weights are gathered as they are and the adapters still get float32 gradients."""
    layer = LoRALinear.wrapping(nn.Linear(32, 32, bias=False), rank=4, alpha=8.0, dropout=0.0)
    apply.store_frozen_in(layer, torch.bfloat16)
    layer.reset_adapter()
    nn.init.normal_(layer.lora_B)
    mesh = init_device_mesh("cpu", (16,))
    fully_shard(layer, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    layer(torch.randn(3, 32)).float().sum().backward()
    assert layer.weight.dtype == torch.bfloat16 and layer.weight.grad is None
    assert layer.lora_A.grad is not None and layer.lora_A.grad.dtype == torch.float32
