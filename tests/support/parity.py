"""The one comparison every multi-process parity test makes, and the capture it compares.

A run is captured as its per-step loss and gradient norm and its full training state (every
parameter, both AdamW moments and AdamW's step count, each gathered to a full tensor and keyed by
the parameter's canonical name), so that two runs on different layouts compare tensor by tensor.

Why more than the loss: AdamW divides each tensor's update by the running RMS of its own gradient,
so a constant mis-scaling of one group of gradients (a forgotten 1/ep, a doubled accumulation)
leaves the updates, hence the loss, almost unchanged. The gradient norm sees the mis-scaling at
every step and the moments carry it (exp_avg by the factor, exp_avg_sq by its square).

A state tensor's difference is |a - b| / |b| (L2 norms over the tensor): a few elements whose
gradients nearly cancel get ±lr-sized Adam updates from rounding alone, and an element-wise maximum
would report them rather than the tensor. Tolerances: see `Tolerance`.

A run with `[validation]` also carries its held-out loss at each step that evaluated, compared at the
loss's tolerance: the same held-out rows whatever the layout give the same number.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from titan_tpu.distributed.sharded_init import canonical_name

ADAM_STATE = ("exp_avg", "exp_avg_sq", "step")
KINDS = ("param", *ADAM_STATE)


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """Relative tolerances for float32 runs of at most 11 steps (lr 3e-3, warmup 2, clipping at 1).

    Layouts differ only in the order of floating-point sums (~1e-7 per reduction). Measured against
    one process (Llama 3 and Qwen 3 MoE debug, 11 layouts of 10 steps and two resharding chains of
    11): loss <= 2.7e-6; gradient norm <= 5.5e-5, most of it the one-process norm's own error (its
    float32 sum of squares over whole tensors is off by up to 2.5e-5 against float64 from step 5 on;
    sharded layouts sum shorter runs; through the clipping coefficient the same factor reaches every
    exp_avg); parameters <= 7e-5 (MoE: a token whose top-2 experts nearly tie may switch experts;
    <= 1.1e-5 in the dense runs); AdamW moments <= 1.8e-4 (exp_avg_sq squares the gradient's
    difference). Each tolerance is 3.6x to 7x the largest measured value. A gradient group
    mis-scaled by 2 moves the gradient norm by 1.5e-2 to 4.5e-2 at every step, the group's moments
    by 1.0 and 2.9 and the parameters by 1.3e-2: far outside.
    """

    loss: float = 1e-5
    grad_norm: float = 2e-4
    param: float = 5e-4
    moments: float = 1e-3


EXACT = Tolerance(loss=0.0, grad_norm=0.0, param=0.0, moments=0.0)
DEFAULT = Tolerance()


@dataclasses.dataclass
class RunResult:
    steps: list[int]
    losses: list[float]
    grad_norms: list[float]
    state: dict[str, torch.Tensor]  # after the last step; see full_state()
    validation_losses: dict[int, float] = dataclasses.field(default_factory=dict)  # step -> validation/loss

    def at(self, step: int, state: dict[str, torch.Tensor]) -> RunResult:
        """This run's records up to `step`, with `state` (captured after `step`) as its end state."""
        keep = [i for i, s in enumerate(self.steps) if s <= step]
        return RunResult(
            [self.steps[i] for i in keep],
            [self.losses[i] for i in keep],
            [self.grad_norms[i] for i in keep],
            state,
            {s: v for s, v in self.validation_losses.items() if s <= step},
        )

    def save(self, path: Path) -> None:
        torch.save(dataclasses.asdict(self), path)

    @classmethod
    def load(cls, path: Path) -> RunResult:
        return cls(**torch.load(path, weights_only=True))


def _full(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()  # a collective: every rank gathers the same tensors in order
    return tensor.to("cpu", copy=True)


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """`{kind}/{canonical name}` -> full tensor for every parameter and its AdamW state (absent
    before the first step). Every rank must call it at the same point."""
    state: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        key = canonical_name(name)
        state[f"param/{key}"] = _full(param)
        for kind, value in optimizer.state.get(param, {}).items():
            state[f"{kind}/{key}"] = _full(value)
    return state


def optimizer_step_count(optimizer: torch.optim.Optimizer) -> int:
    counts = {int(s["step"]) for s in optimizer.state.values()}
    if len(counts) != 1:
        raise AssertionError(f"parameters disagree on AdamW's step count: {sorted(counts)}")
    return counts.pop()


def capture_states(trainer: Any, steps: Iterable[int]) -> dict[int, dict[str, torch.Tensor]]:
    """Fill the returned dict with full_state() after each optimizer step whose count is in `steps`
    (AdamW's own count, so a resumed run counts on from its checkpoint)."""
    wanted, captured = set(steps), {}

    def after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        step = optimizer_step_count(optimizer)
        if step in wanted:
            captured[step] = full_state(trainer.model, optimizer)

    trainer.optimizer.register_step_post_hook(after_step)
    return captured


def train_and_capture(trainer: Any) -> RunResult:
    """Train to the end (metrics.log_freq must be 1) and gather the final state."""
    records = trainer.train()
    steps = [r.step for r in records]
    if steps != list(range(steps[0], steps[0] + len(steps))):
        raise AssertionError(f"a record for every step is needed (metrics.log_freq = 1); got steps {steps}")
    validation = {r.step: r.extras["validation/loss"] for r in records if "validation/loss" in r.extras}
    return RunResult(
        steps,
        [r.loss for r in records],
        [r.grad_norm for r in records],
        full_state(trainer.model, trainer.optimizer),
        validation,
    )


@dataclasses.dataclass
class ParityReport:
    """Largest relative difference per quantity and every breach of the tolerance."""

    max_diff: dict[str, float]
    failures: list[str]
    per_tensor: dict[str, float] = dataclasses.field(default_factory=dict)  # state key -> difference

    @property
    def ok(self) -> bool:
        return not self.failures

    def summary(self) -> str:
        return ", ".join(f"{k} {v:.1e}" for k, v in self.max_diff.items())


def _relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def compare_states(
    state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], tol: Tolerance = DEFAULT
) -> ParityReport:
    failures: list[str] = []
    if state.keys() != reference.keys():
        missing, extra = sorted(reference.keys() - state.keys()), sorted(state.keys() - reference.keys())
        failures.append(f"state keys differ: missing {missing[:5]}, unexpected {extra[:5]}")
    worst = {kind: 0.0 for kind in KINDS}
    limits = {"param": tol.param, "exp_avg": tol.moments, "exp_avg_sq": tol.moments, "step": 0.0}
    per_tensor: dict[str, float] = {}
    for key in sorted(state.keys() & reference.keys()):
        kind = key.split("/", 1)[0]
        a, b = state[key].double(), reference[key].double()
        if a.shape != b.shape:
            failures.append(f"{key}: shape {tuple(a.shape)} != {tuple(b.shape)}")
            continue
        if kind == "step":
            diff = float((a - b).abs().max())  # counts: any difference is a failure
        else:
            diff = float((a - b).norm()) / max(float(b.norm()), 1e-30)
        worst[kind] = max(worst[kind], diff)
        per_tensor[key] = diff
        if diff > limits[kind]:
            failures.append(f"{key}: difference {diff:.2e} > {limits[kind]:.0e}")
    return ParityReport(worst, failures, per_tensor)


def compare(run: RunResult, reference: RunResult, tol: Tolerance = DEFAULT) -> ParityReport:
    """Every step of `run` against the same step of `reference`, then the end states."""
    failures: list[str] = []
    if run.steps[-1] != reference.steps[-1]:
        failures.append(f"runs end at different steps: {run.steps[-1]} vs {reference.steps[-1]}")
    by_step = {s: (loss, norm) for s, loss, norm in zip(reference.steps, reference.losses, reference.grad_norms)}
    worst = {"loss": 0.0, "grad_norm": 0.0}
    for step, loss, norm in zip(run.steps, run.losses, run.grad_norms):
        if step not in by_step:
            failures.append(f"step {step}: not in the reference run")
            continue
        for what, value, expected, limit in (
            ("loss", loss, by_step[step][0], tol.loss),
            ("grad_norm", norm, by_step[step][1], tol.grad_norm),
        ):
            diff = _relative(value, expected)
            worst[what] = max(worst[what], diff)
            if diff > limit:
                failures.append(f"step {step} {what}: {value!r} vs {expected!r} (relative {diff:.2e} > {limit:.0e})")
    if run.validation_losses or reference.validation_losses:
        worst["validation_loss"], validation_failures = _compare_validation(run, reference, tol)
        failures += validation_failures
    states = compare_states(run.state, reference.state, tol)
    return ParityReport({**worst, **states.max_diff}, failures + states.failures, states.per_tensor)


def _compare_validation(run: RunResult, reference: RunResult, tol: Tolerance) -> tuple[float, list[str]]:
    """The held-out losses at the run's steps: evaluated at the same steps, each within the loss's
    tolerance. Returns the largest relative difference and the breaches."""
    expected = {s: v for s, v in reference.validation_losses.items() if s in set(run.steps)}
    failures = []
    if run.validation_losses.keys() != expected.keys():
        failures.append(f"validation at steps {sorted(run.validation_losses)}, the reference at {sorted(expected)}")
    worst = 0.0
    for step in sorted(run.validation_losses.keys() & expected.keys()):
        value = run.validation_losses[step]
        diff = _relative(value, expected[step])
        worst = max(worst, diff)
        if diff > tol.loss:
            failures.append(
                f"step {step} validation/loss: {value!r} vs {expected[step]!r} (relative {diff:.2e} > {tol.loss:.0e})"
            )
    return worst, failures


def assert_parity(run: RunResult, reference: RunResult, label: str, tol: Tolerance = DEFAULT) -> None:
    """What every parity test asserts: compare(), its summary printed under `label`, and the first
    breaches as the failure message."""
    report = compare(run, reference, tol)
    print(f"\n{label}: max relative differences over steps {run.steps[0]}-{run.steps[-1]}: {report.summary()}")
    assert report.ok, (label, report.failures[:10])


def assert_checkpoint_chain(
    segments: list[tuple[str, dict[str, torch.Tensor], RunResult]],
    links: Iterable[int],
    single: RunResult,
    captured: dict[int, dict[str, torch.Tensor]],
    label: str,
) -> None:
    """A checkpoint moved through layouts: segment i (a layout's name, the state it loaded at step
    links[i], the steps it ran after) must have loaded exactly what the one before it saved (the
    one-process run's state first) and continue like the uninterrupted one-process run `single`,
    whose states at the saved steps are `captured`."""
    links = list(links)
    saved_state, saved_by = captured[links[0]], "1 process"
    for (name, loaded, run), step in zip(segments, links):
        steps = {int(v) for k, v in loaded.items() if k.startswith("step/")}
        assert steps == {step}, f"{saved_by} -> {name}: AdamW step counts {steps} after loading step {step}"
        load_report = compare_states(loaded, saved_state, EXACT)
        assert load_report.ok, (f"{saved_by} -> {name}", load_report.failures[:10])
        end = run.steps[-1]
        assert run.steps == list(range(step + 1, step + 4)), run.steps
        reference = single.at(end, captured[end]) if end in captured else single
        what = f"{label}{saved_by} -> {name} (loaded state bitwise equal) against the uninterrupted run"
        assert_parity(run, reference, what)
        saved_state, saved_by = run.state, name


def assert_matches_single_process(
    run: RunResult, single: RunResult, steps: int, label: str, tol: Tolerance = DEFAULT
) -> None:
    """A multi-process layout against the one-process run of the same config: the same `steps`
    steps from the start, within tolerance, and a reference that did train."""
    assert run.steps == single.steps == list(range(1, steps + 1)), (run.steps, single.steps)
    assert_parity(run, single, label, tol)
    assert single.losses[-1] < single.losses[0], single.losses
