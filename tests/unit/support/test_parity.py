"""The parity comparison itself (parity.py), in one process: it passes identical runs and rounding
below its tolerances, and fails each kind of damage the multi-process tests rely on it to catch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.support.parity import DEFAULT, EXACT, RunResult, compare, compare_states, full_state  # noqa: E402


def trained_state(steps: int = 2) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        model(torch.randn(4, 8)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return full_state(model, optimizer)


def run_with(
    state: dict[str, torch.Tensor],
    losses: list[float] | None = None,
    norms: list[float] | None = None,
    validation: dict[int, float] | None = None,
) -> RunResult:
    validation = {2: 2.7, 3: 2.2} if validation is None else validation
    return RunResult([1, 2, 3], losses or [3.0, 2.5, 2.0], norms or [1.5, 1.2, 0.9], state, validation)


def test_full_state_holds_parameters_and_adamw_state() -> None:
    state = trained_state()
    kinds = {key.split("/")[0] for key in state}
    assert kinds == {"param", "exp_avg", "exp_avg_sq", "step"}
    assert all(float(v) == 2 for k, v in state.items() if k.startswith("step/"))


def test_identical_runs_and_rounding_pass() -> None:
    state = trained_state()
    assert compare(run_with(state), run_with(state)).ok
    assert compare_states(state, state, EXACT).ok
    # Rounding well inside the tolerances: 1e-7 relative on the state, 1e-6 on loss and norm.
    rounded = {k: v if k.startswith("step/") else v * (1 + 1e-7) for k, v in state.items()}
    near = run_with(rounded, [3.0 * (1 + 1e-6), 2.5, 2.0], [1.5, 1.2 * (1 - 1e-6), 0.9], {2: 2.7 * (1 + 1e-6), 3: 2.2})
    report = compare(near, run_with(state))
    assert report.ok, report.failures
    assert not compare_states(rounded, state, EXACT).ok  # exact means exact


@pytest.mark.parametrize(
    "damage",
    [
        "grad_norm_doubled_at_one_step",
        "loss_off_by_1e-4",
        "exp_avg_doubled_in_one_tensor",
        "exp_avg_sq_quadrupled_in_one_tensor",
        "param_off_by_1e-3",
        "step_count_off_by_one",
        "optimizer_state_missing",
        "parameter_missing",
        "validation_loss_off_by_1e-4",
        "validation_missing_at_a_step",
    ],
)
def test_each_kind_of_damage_fails(damage: str) -> None:
    state = trained_state()
    reference = run_with(state)
    weight = "0.weight"
    losses, norms, bad = list(reference.losses), list(reference.grad_norms), dict(state)
    validation = dict(reference.validation_losses)
    if damage == "grad_norm_doubled_at_one_step":
        norms[1] *= 2
    elif damage == "loss_off_by_1e-4":
        losses[2] *= 1 + 1e-4
    elif damage == "exp_avg_doubled_in_one_tensor":
        bad[f"exp_avg/{weight}"] = state[f"exp_avg/{weight}"] * 2
    elif damage == "exp_avg_sq_quadrupled_in_one_tensor":
        bad[f"exp_avg_sq/{weight}"] = state[f"exp_avg_sq/{weight}"] * 4
    elif damage == "param_off_by_1e-3":
        bad[f"param/{weight}"] = state[f"param/{weight}"] * (1 + 1e-3)
    elif damage == "step_count_off_by_one":
        bad[f"step/{weight}"] = state[f"step/{weight}"] + 1
    elif damage == "optimizer_state_missing":
        bad = {k: v for k, v in state.items() if k.startswith("param/")}
    elif damage == "parameter_missing":
        bad = {k: v for k, v in state.items() if not k.endswith("1.bias")}
    elif damage == "validation_loss_off_by_1e-4":
        validation[3] *= 1 + 1e-4
    elif damage == "validation_missing_at_a_step":
        del validation[2]
    report = compare(run_with(bad, losses, norms, validation), reference, DEFAULT)
    assert not report.ok
    print(f"{damage}: {report.failures[0]}")


def test_a_run_must_end_where_the_reference_does() -> None:
    state = trained_state()
    short = RunResult([1, 2], [3.0, 2.5], [1.5, 1.2], state, {2: 2.7})
    assert not compare(short, run_with(state)).ok
    assert compare(short, run_with(state).at(2, state)).ok
