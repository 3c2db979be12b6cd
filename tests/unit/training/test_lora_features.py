"""LoRA with the rest of the trainer, one process: supervised fine-tuning with every block checkpointed
and compiled (torch.compile's graph capture and AOTAutograd, the aot_eager backend) and the batch
accumulated over two micro-batches computes what the plain eager run computes, and the compiled model still honours the switch that turns its adapters off; GRPO with a
KL reference trains the adapters only, its reference being the base (KL 0 while B is 0)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.support.parity import RunResult, train_and_capture
from tests.support.token_sum_reward import REWARDS
from titan_tpu.config import load_config
from titan_tpu.models.common.lora import adapters_disabled
from titan_tpu.training.trainer import Trainer

SMALL = "--model.overrides={ n_layers = 2, dim = 64, n_heads = 4, n_kv_heads = 2, head_dim = 16, ffn_hidden_dim = 128 }"
LORA = ["--lora.enable=true", "--lora.rank=4", "--lora.alpha=8"]
SFT = [
    SMALL,
    *LORA,
    "--model.attention_block=0",
    "--training.seq_len=64",
    "--training.global_batch_size=2",
    "--training.dtype=float32",
    "--training.steps=2",
    "--optimizer.lr=1e-2",
    "--lr_scheduler.warmup_steps=0",
    "--metrics.log_freq=1",
    "--metrics.plot_loss=false",
    "--sft.generated_examples=64",
    "--sft.generated_held_out=8",
    "--sft.eval_generations=0",
    "--validation.enable=false",
]


def sft_run(dump: Path, *more: str) -> tuple[Trainer, RunResult, dict[str, torch.Tensor]]:
    """The run, and the adapters' gradients of its last step."""
    trainer = Trainer(load_config("sft_qwen3_debug", [*SFT, f"--job.dump_folder={dump}", *more]))
    grads: dict[str, torch.Tensor] = {}

    def before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        grads.update({n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None})

    trainer.optimizer.register_step_pre_hook(before_step)
    return trainer, train_and_capture(trainer), grads


def canonical(name: str) -> str:
    return name.replace("._orig_mod", "").replace("._checkpoint_wrapped_module", "")


def test_checkpointed_compiled_accumulated_sft_computes_the_eager_run(tmp_path: Path, one_thread: None) -> None:
    """Catches a compiled or recomputed block that drops the adapter term (or computes it twice), an
    accumulation that does not average the micro-batches' adapter gradients, and a compiled graph
    that keeps the adapters on after `adapters_disabled` (a guard missing on the switch)."""
    eager_trainer, eager, eager_grads = sft_run(tmp_path / "eager")
    trainer, run, grads = sft_run(
        tmp_path / "compiled",
        "--activation_checkpoint.mode=full",
        "--compile.enable=true",
        "--compile.backend=aot_eager",  # dynamo's graphs and AOTAutograd's backward, without inductor's minutes
        "--training.local_batch_size=1",
    )
    assert run.steps == eager.steps == [1, 2]
    for loss, reference in zip(run.losses, eager.losses):
        assert abs(loss - reference) <= 1e-5 * abs(reference)
    grads = {canonical(n): g for n, g in grads.items()}
    assert grads.keys() == eager_grads.keys() and all(n.endswith(("lora_A", "lora_B")) for n in grads)
    for name, grad in eager_grads.items():
        assert float((grads[name] - grad).norm() / grad.norm()) < 1e-3, name
    # A micro-batch's shape, so the compiled blocks are not compiled again for another one.
    tokens = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        on, eager_on = trainer.model(tokens), eager_trainer.model(tokens)
        with adapters_disabled(trainer.model), adapters_disabled(eager_trainer.model):
            off, eager_off = trainer.model(tokens), eager_trainer.model(tokens)
    assert torch.allclose(on, eager_on, atol=1e-4) and torch.allclose(off, eager_off, atol=1e-5)
    assert not torch.allclose(on, off, atol=1e-3)  # the trained adapters change the logits
    for each in (trainer, eager_trainer):
        each.close()


def test_grpo_trains_the_adapters_against_the_base_as_reference(tmp_path: Path, one_thread: None) -> None:
    options = [
        SMALL,
        *LORA,
        REWARDS,
        "--model.attention_block=0",
        "--training.dtype=float32",
        "--training.steps=2",
        "--training.global_batch_size=16",
        "--rl.prompts_per_step=4",
        "--rl.group_size=4",
        "--rl.eval_prompts=4",
        "--rl.beta=0.1",
        "--optimizer.lr=1e-2",
        "--metrics.log_freq=1",
        "--metrics.plot_loss=false",
        f"--job.dump_folder={tmp_path}",
    ]
    trainer = Trainer(load_config("grpo_qwen3_debug", options))
    base = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    records = trainer.train()
    trainer.close()
    # Step 1's policy is the base (B = 0), which is the reference; step 2's has learnt.
    assert records[0].extras["kl"] == 0.0 and records[1].extras["kl"] > 0.0
    trained = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trained and all(n.endswith(("lora_A", "lora_B")) for n in trained)
    assert all(p.abs().max() > 0 for n, p in trained.items() if n.endswith("lora_B"))
    assert all(torch.equal(p, base[n]) for n, p in trainer.model.named_parameters() if n in base)
