"""Our preference objective against TRL's `DPOTrainer._compute_loss` on identical log-probabilities, in
float64.

TRL's loss method takes a model and a collated batch; its model here is a stand-in whose fused-head
output carries given per-token log-probabilities (what `add_fused_lm_head` returns: 0 where the label
is ignored), and the reference's are given as precomputed sums (`precompute_ref_log_probs`), so
everything after the forward (sums, log-ratios, each loss type, rewards, accuracies, margins) is TRL's
own code. A trainer is not constructed (that needs a model and a dataset; test_dpo_trl_trainer.py
does, with a real model); the attributes `_compute_loss` reads are set as its __init__ sets them.

Pairs compared (TRL -> ours):
- loss_type sigmoid                       -> sigmoid
- sigmoid + robust with loss_weights 2(1 - eps), -(1 - 2 eps) and label_smoothing eps
                                          -> sigmoid with label_smoothing eps (cDPO: TRL 1.16 has no
                                             single loss type for it, and this weighted sum of two of
                                             its loss types is exactly it)
- robust with label_smoothing eps         -> robust
- ipo (log-ratios averaged per completion token) -> ipo
- hinge                                   -> hinge
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

trl_dpo = pytest.importorskip("trl.trainer.dpo_trainer")

from tests.support.trl_accelerator import OneProcessAccelerator  # noqa: E402
from titan_tpu.tasks.dpo.loss import preference_loss  # noqa: E402
from titan_tpu.tasks.dpo.task import PAIR_METRICS  # noqa: E402

PAIRS, WIDTH = 8, 9
EPS = 0.2
CASES = {  # ours (loss type, label smoothing) -> TRL (loss types, their weights, label smoothing)
    "sigmoid": (("sigmoid", 0.0), (["sigmoid"], [1.0], 0.0)),
    "cdpo": (("sigmoid", EPS), (["sigmoid", "robust"], [2 * (1 - EPS), -(1 - 2 * EPS)], EPS)),
    "robust": (("robust", EPS), (["robust"], [1.0], EPS)),
    "ipo": (("ipo", 0.0), (["ipo"], [1.0], 0.0)),
    "hinge": (("hinge", 0.0), (["hinge"], [1.0], 0.0)),
}


class _FusedHead(nn.Module):
    """Returns the given per-token log-probabilities as `add_fused_lm_head`'s output does."""

    def __init__(self, per_token: torch.Tensor) -> None:
        super().__init__()
        self.per_token = per_token

    def forward(self, labels: torch.Tensor, **kwargs: Any) -> SimpleNamespace:
        scored = labels[:, 1:] != -100
        zeros = torch.zeros_like(self.per_token)
        return SimpleNamespace(
            log_probs=torch.where(scored, self.per_token, 0.0),
            entropy=zeros,
            mean_logits=zeros,
            is_top1=torch.zeros_like(scored),
        )


def trl_terms(
    batch: dict[str, torch.Tensor], per_token: torch.Tensor, trl_case: tuple, beta: float
) -> dict[str, float]:
    loss_types, weights, smoothing = trl_case
    trainer = trl_dpo.DPOTrainer.__new__(trl_dpo.DPOTrainer)
    model = _FusedHead(per_token)
    trainer.__dict__.update(
        model=model,
        beta=beta,
        loss_types=loss_types,
        loss_weights=weights,
        label_smoothing=smoothing,
        ld_alpha=None,
        f_divergence_type="reverse_kl",
        use_weighting=False,
        precompute_ref_logps=True,
        aux_loss_enabled=False,
        accelerator=OneProcessAccelerator(),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )
    inputs = {
        "input_ids": batch["input_ids"],
        "attention_mask": batch["attention_mask"],
        "completion_mask": batch["completion_mask"],
        "ref_chosen_logps": batch["ref"][:PAIRS],
        "ref_rejected_logps": batch["ref"][PAIRS:],
    }
    loss = trainer._compute_loss(model, inputs, return_outputs=False)
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    # Our record's names: one that TRL does not log fails here.
    return {"loss": float(loss), **{k: metrics[k] for k in PAIR_METRICS}}


def our_terms(batch: dict[str, torch.Tensor], per_token: torch.Tensor, ours: tuple, beta: float) -> dict[str, float]:
    loss_type, smoothing = ours
    scored = batch["completion_mask"][:, 1:].bool()
    logps = torch.where(scored, per_token, 0.0).sum(dim=1)
    counts = batch["completion_mask"].sum(dim=1).double()
    terms = preference_loss(
        logps[:PAIRS],
        logps[PAIRS:],
        batch["ref"][:PAIRS],
        batch["ref"][PAIRS:],
        counts[:PAIRS],
        counts[PAIRS:],
        loss_type=loss_type,
        beta=beta,
        label_smoothing=smoothing,
    )
    values = {
        "rewards/chosen": terms.chosen_rewards,
        "rewards/rejected": terms.rejected_rewards,
        "rewards/accuracies": terms.accurate,
        "rewards/margins": terms.chosen_rewards - terms.rejected_rewards,
        "logps/chosen": logps[:PAIRS],
        "logps/rejected": logps[PAIRS:],
    }
    return {"loss": float(terms.loss), **{k: float(v.mean()) for k, v in values.items()}}


def make_batch(seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """PAIRS pairs as TRL's collator lays them out: [chosen rows; rejected rows], right-padded; each
    pair's two rows share a prompt; completions of 1 to 5 tokens. Per-token log-probabilities drawn so
    that some pairs are won and some lost."""
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(1, 4, (PAIRS,), generator=gen).repeat(2)
    completions = torch.randint(1, 6, (2 * PAIRS,), generator=gen)
    ends = prompts + completions
    positions = torch.arange(WIDTH)[None, :]
    completion_mask = ((positions >= prompts[:, None]) & (positions < ends[:, None])).long()
    per_token = -torch.rand(2 * PAIRS, WIDTH - 1, generator=gen, dtype=torch.float64) * 3
    ref_tokens = per_token + 0.8 * torch.randn(2 * PAIRS, WIDTH - 1, generator=gen, dtype=torch.float64)
    ref = torch.where(completion_mask[:, 1:].bool(), ref_tokens, 0.0).sum(dim=1)
    batch = {
        "input_ids": torch.randint(0, 50, (2 * PAIRS, WIDTH), generator=gen),
        "attention_mask": (positions < ends[:, None]).long(),
        "completion_mask": completion_mask,
        "ref": ref,
    }
    return batch, per_token


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_our_loss_and_metrics_equal_trls(case: str, beta: float) -> None:
    batch, per_token = make_batch(seed=len(case) + int(10 * beta))
    ours, theirs = CASES[case]
    mine, trl = our_terms(batch, per_token, ours, beta), trl_terms(batch, per_token, theirs, beta)
    assert 0.0 < trl["rewards/accuracies"] < 1.0  # some pairs won, some lost: the comparison means something
    for key, value in trl.items():
        assert mine[key] == pytest.approx(value, rel=1e-6, abs=1e-12), key


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_wrong_beta_or_swapped_reference_misses_trl(case: str) -> None:
    """Negative controls: the comparison above tells beta 0.1 from 0.12, and the chosen reference
    log-probabilities from the rejected ones."""
    batch, per_token = make_batch(seed=3)
    ours, theirs = CASES[case]
    trl = trl_terms(batch, per_token, theirs, beta=0.1)
    assert our_terms(batch, per_token, ours, beta=0.12)["loss"] != pytest.approx(trl["loss"], rel=1e-6)
    swapped = {**batch, "ref": batch["ref"].roll(PAIRS)}
    assert our_terms(swapped, per_token, ours, beta=0.1)["loss"] != pytest.approx(trl["loss"], rel=1e-6)


def test_trls_sigmoid_loss_ignores_label_smoothing() -> None:
    """Why cDPO is compared with a weighted sum: TRL 1.16's 'sigmoid' gives the same loss with and
    without label_smoothing (it reads it for 'robust' and others only), where ours does not ignore it."""
    batch, per_token = make_batch(seed=5)
    plain = trl_terms(batch, per_token, (["sigmoid"], [1.0], 0.0), beta=0.1)["loss"]
    assert trl_terms(batch, per_token, (["sigmoid"], [1.0], EPS), beta=0.1)["loss"] == plain
    assert our_terms(batch, per_token, ("sigmoid", EPS), beta=0.1)["loss"] != pytest.approx(plain, rel=1e-3)
