"""A DPO run's first batch against TRL's DPOTrainer on the same records and weights, in float64: the
same token ids for every prompt and completion, the same rows and completion mask, then the same loss,
rewards, accuracy, margins and log-probabilities.

TRL's side is a real `DPOTrainer` (its own dataset preparation, collator and `_compute_loss`) around
transformers' Qwen3ForCausalLM; its fused log-probability head (`add_fused_lm_head`, which runs in
float32 whatever the model's dtype) is swapped for the same per-token quantities computed from the
model's float64 logits, after checking that the two agree to float32 precision. Ours is the trainer's DPO task as a run
builds it (records file, the checkpoint folder's tokenizer and published Qwen 3 chat template,
checkpoint.initial_load_path as the reference). Two checkpoint folders hold the same debug-sized
model with different random weights: A, the reference and initial weights, and B, the policy (ours
loaded into the trainer's model after it is built, TRL's passed as `model`), so the policy is not its
reference and the log-ratios are far from 0. The weights are float32 values, exact in both models'
float64.

Bugs caught: a prompt/completion split, an eos, a template rendering or a completion mask that
differs from TRL's; a reference that is not the initial load; any formula or sign in the objective
(test_dpo_trl_loss.py compares each loss type alone, on given log-probabilities).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
trl = pytest.importorskip("trl")

from tests.support.chat_fixtures import checkpoint_folder  # noqa: E402
from tests.support.launch import fixed_kernels  # noqa: E402
from titan_tpu.checkpoint.hf_export import export_model_to_hf  # noqa: E402
from titan_tpu.config import load_config  # noqa: E402
from titan_tpu.data.chat_tokenizer import tokenizer_export_files  # noqa: E402
from titan_tpu.models.registry import get_model_spec  # noqa: E402
from titan_tpu.tasks.dpo.task import PAIR_METRICS, DpoTask  # noqa: E402
from titan_tpu.training.trainer import Trainer  # noqa: E402

SEQ_LEN = 96
SHAPE = "{ n_layers = 2, dim = 64, n_heads = 4, n_kv_heads = 2, head_dim = 16, ffn_hidden_dim = 128, vocab_size = 640 }"
QUESTIONS = [
    ("What is two plus two?", "Four.", "Five."),
    ("Name a prime number larger than ten.", "Thirteen is prime.", "Twelve."),
    ("Answer briefly: is the fox quick?", "The quick brown fox.", "No, it is a lazy dog that jumps over it."),
    ("Thank you!", "You are welcome.", "#### \\boxed{42}"),
]
RECORDS = {
    "conversational": [
        {
            "prompt": [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": q}],
            "chosen": [{"role": "assistant", "content": good}],
            "rejected": [{"role": "assistant", "content": bad}],
        }
        for q, good, bad in QUESTIONS
    ],
    "text": [{"prompt": q, "chosen": " " + good, "rejected": " " + bad} for q, good, bad in QUESTIONS],
}
CASES = [  # (records, TRL loss types and weights, label smoothing, ours, beta)
    ("conversational", ["sigmoid"], [1.0], 0.0, "sigmoid", 0.1),
    ("text", ["ipo"], [1.0], 0.0, "ipo", 0.5),
    ("conversational", ["robust"], [1.0], 0.1, "robust", 0.1),
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Checkpoint folders A (reference) and B (policy): our debug-sized Qwen 3 with two seeds' random
    weights, exported with the published Qwen 3 template and a small tokenizer; B's model too."""
    root = tmp_path_factory.mktemp("dpo_parity")
    tokenizer = tokenizer_export_files(str(checkpoint_folder(root / "tokenizer", "qwen3")))
    config = load_config("dpo_qwen3_debug", [f"--model.overrides={SHAPE}", f"--training.seq_len={SEQ_LEN}"])
    spec = get_model_spec("qwen3")
    args = spec.args_for(config)
    made: dict[str, Any] = {}
    for name, seed in (("A", 1), ("B", 2)):
        torch.manual_seed(seed)
        model = spec.model_cls(args)
        model.init_weights()
        with torch.no_grad():  # O(1) logits, so that log-probabilities and their differences are large
            model.output.weight.mul_(4.0)
        export_model_to_hf(model, root / name, spec.state_dict_adapter, args, extra_files=tokenizer)
        made[name] = root / name
        made[f"{name}_model"] = model
    return made


def exact_head(model: Any) -> None:
    """`model(..., labels=..., fused_lm_head=True)` as TRL's fused head answers it (per-token
    log-probabilities, entropy, mean logit, top-1 hit; 0 where the label is ignored), from the model's
    own logits in their dtype instead of the head's float32 tiles."""
    forward = type(model).forward

    def exact(*args: Any, fused_lm_head: bool = False, labels: torch.Tensor | None = None, **kwargs: Any) -> Any:
        output = forward(model, *args, **kwargs)
        if not fused_lm_head:
            return output
        assert labels is not None
        logits, targets = output.logits[:, :-1], labels[:, 1:]
        scored = targets != -100
        logps = logits.log_softmax(dim=-1)

        def scored_only(values: torch.Tensor) -> torch.Tensor:
            return values.masked_fill(~scored, 0)

        return SimpleNamespace(
            log_probs=scored_only(logps.gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)),
            entropy=scored_only(-(logps.exp() * logps).sum(dim=-1)),
            mean_logits=scored_only(logits.mean(dim=-1)),
            is_top1=(logits.argmax(dim=-1) == targets) & scored,
        )

    model.forward = exact


def trl_first_batch(
    folders: dict[str, Any],
    kind: str,
    loss_types: list[str],
    weights: list[float],
    smoothing: float,
    beta: float,
    out: Path,
) -> tuple[dict[str, Any], dict[str, float], Any]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(folders["A"])

    def model(name: str) -> Any:
        return transformers.AutoModelForCausalLM.from_pretrained(folders[name], dtype=torch.float64)

    args = trl.DPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=len(QUESTIONS),
        max_length=SEQ_LEN,
        beta=beta,
        loss_type=loss_types,
        loss_weights=weights,
        label_smoothing=smoothing,
        bf16=False,
        use_cpu=True,
        report_to="none",
    )
    trainer = trl.DPOTrainer(
        model=model("B"),
        ref_model=model("A"),
        args=args,
        train_dataset=datasets.Dataset.from_list(RECORDS[kind]),
        processing_class=tokenizer,
    )
    rows = [trainer.train_dataset[i] for i in range(len(QUESTIONS))]
    inputs = trainer.data_collator(rows)
    trainer.model.train()
    labels = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, -100)
    with torch.no_grad():
        fused = trainer.model(**inputs_for_model(inputs), labels=labels, fused_lm_head=True).log_probs
    for model in (trainer.model, trainer.ref_model):
        exact_head(model)
    with torch.no_grad():
        exact = trainer.model(**inputs_for_model(inputs), labels=labels, fused_lm_head=True).log_probs
    assert fused.dtype == torch.float32 and torch.allclose(fused.double(), exact, rtol=1e-5, atol=1e-5)
    loss = trainer._compute_loss(trainer.model, inputs, return_outputs=False)
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return inputs, {"loss": float(loss.detach()), **{k: metrics[k] for k in PAIR_METRICS}}, rows


def inputs_for_model(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"], "use_cache": False}  # type: ignore[dict-item]


def our_first_batch(
    folders: dict[str, Any], kind: str, loss_type: str, smoothing: float, beta: float, out: Path
) -> tuple[Any, dict[str, float], Any]:
    records = out / "records.jsonl"
    records.write_text("".join(json.dumps(r) + "\n" for r in RECORDS[kind]))
    overrides = [
        *fixed_kernels("dpo_qwen3_debug"),
        f"--model.overrides={SHAPE}",
        f"--training.seq_len={SEQ_LEN}",
        f"--training.global_batch_size={len(QUESTIONS)}",
        "--training.dtype=float32",
        f"--job.dump_folder={out / 'run'}",
        "--dpo.dataset=data",
        "--data.source=files",
        f"--data.path={records}",
        f"--data.tokenizer={folders['A']}",
        "--data.shuffle=false",
        f"--checkpoint.initial_load_path={folders['A']}",
        "--validation.enable=false",
        f"--dpo.loss_type={loss_type}",
        f"--dpo.beta={beta}",
        f"--dpo.label_smoothing={smoothing}",
    ]
    trainer = Trainer(load_config("dpo_qwen3_debug", overrides))
    task = trainer.task
    assert isinstance(task, DpoTask)
    trainer.model.load_state_dict(folders["B_model"].state_dict())
    trainer.model.double()
    assert task.reference is not None and task.reference.model is not None
    task.reference.model.double()
    batch = task.next_batch(trainer.model)
    loss = task.loss(trainer.model, batch).loss
    metrics = task.step_metrics()
    # Negative control: the reference's log-probabilities of other sequences (each row's neighbour's).
    assert batch.reference_logps is not None
    batch.reference_logps = batch.reference_logps.roll(1)
    metrics["mispaired loss"] = float(task.loss(trainer.model, batch).loss.detach())
    batch.reference_logps = batch.reference_logps.roll(-1)
    encoder = task.encoding.encoder
    pairs = [encoder.encode(record, "r") for record in RECORDS[kind]]
    trainer.close()
    return batch, {"loss": float(loss.detach()), **metrics}, pairs


@pytest.mark.parametrize(("kind", "loss_types", "weights", "smoothing", "ours", "beta"), CASES)
def test_the_first_batch_scores_as_in_trls_dpo_trainer(
    folders: dict[str, Any],
    tmp_path: Path,
    kind: str,
    loss_types: list[str],
    weights: list[float],
    smoothing: float,
    ours: str,
    beta: float,
) -> None:
    inputs, theirs, rows = trl_first_batch(folders, kind, loss_types, weights, smoothing, beta, tmp_path / "trl")
    (tmp_path / "ours").mkdir()
    batch, mine, pairs = our_first_batch(folders, kind, ours, smoothing, beta, tmp_path / "ours")
    # The same ids for every prompt and completion, the same rows and completion mask.
    assert [(p.prompt, p.chosen, p.rejected) for p in pairs] == [
        (r["prompt_ids"], r["chosen_ids"], r["rejected_ids"]) for r in rows
    ]
    real = inputs["attention_mask"].bool()
    assert batch.tokens.shape == inputs["input_ids"].shape
    assert torch.equal(batch.tokens[real], inputs["input_ids"][real])
    assert torch.equal(batch.scored, inputs["completion_mask"][:, 1:].bool())
    # The same numbers: the policy is not its reference, and pairs are both won and lost.
    assert abs(theirs["rewards/margins"]) > 0.05 and 0.0 < theirs["rewards/accuracies"] < 1.0, theirs
    # Both models compute their norms (ours also the rotation) in float32 whatever the dtype, which
    # bounds the agreement: measured up to 7e-7 relative and 1.1e-6 absolute (on a loss of 9.2).
    for key, value in theirs.items():
        assert mine[key] == pytest.approx(value, rel=1e-6, abs=1e-6), key
    assert abs(mine["mispaired loss"] - theirs["loss"]) > 1e-3
