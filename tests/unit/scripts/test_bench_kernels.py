"""scripts/bench.py --kernels' table from fake runs: every candidate forced through its own config
override, live at once with auto, their steps interleaved round by round, medians compared.

Bugs caught: comparing auto against a candidate of another field, or against a mean or the last step
rather than the median (one step here is an outlier), ranking by raw medians that the machine's drift
between rounds decides, counting the warm-up steps, running the rounds
in one fixed order, keeping every field's runs alive at once (or never closing them), carrying one
auto run from field to field, forcing a field
that has a single candidate, forcing a candidate with the wrong override, and a noise column that
compares auto with some other candidate than its own pick."""

from __future__ import annotations

import statistics
from typing import Any

import pytest

from scripts import bench_kernels

SECONDS = {  # the attention override a run got -> its successive step times (warm-up first)
    None: [9.0, 1.00, 5.0, 0.98, 1.00],  # auto (picks blocked:64); its second timed step an outlier
    "--model.attention_block=0": [9.0, 2.0, 1.9, 2.1],
    "--model.attention_block=64": [9.0, 0.95, 9.0, 0.96],
}
ITEMS, FLOPS = 100, 1e9


class FakeRun:
    def __init__(self, events: list[Any], overrides: list[str]) -> None:
        self.forced = next((o for o in overrides if o.startswith("--model.attention_block")), None)
        self.events = events
        self.kernels = {"attention": "blocked:64", "loss_chunk_elements": "2^26"}
        self.kernel_candidates = {"attention": ["sdpa", "blocked:64"], "loss_chunk_elements": ["2^26"]}
        self.kernel_sources = {"attention": "measured in 1.0 s", "loss_chunk_elements": "only candidate"}
        self.items_per_step, self.flops_per_step = ITEMS, FLOPS
        self.steps = 0
        events.append(("open", self.forced))

    def step_seconds(self) -> float:
        self.events.append(("step", self.forced))
        self.steps += 1
        return SECONDS[self.forced][self.steps - 1]

    def peak_flops(self) -> float:
        return 4e9

    def close(self) -> None:
        self.events.append(("close", self.forced))


def test_the_table_interleaves_live_runs_and_compares_medians(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(bench_kernels, "native_dtypes", lambda: ["float32"])
    events: list[Any] = []
    assert bench_kernels.kernel_table("llama3_debug", 3, 1, [], lambda c, o: FakeRun(events, o)) == 0
    sdpa, block = "--model.attention_block=0", "--model.attention_block=64"
    steps = [forced for kind, forced in events if kind == "step"]
    # Auto warms up, then each forced run; then three rounds, each starting one run later.
    assert events[:2] == [("open", None), ("step", None)]
    assert steps == [None, sdpa, block, None, sdpa, block, sdpa, block, None, block, None, sdpa]
    # Every run of the field is closed after it. Nothing forces the single-candidate loss.
    assert events[-3:] == [("close", None), ("close", sdpa), ("close", block)]
    row = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| llama3_debug")]
    # Round medians 1.00, 5.0, 0.98 s (the middle round is slow for two runs). Steps against them:
    # auto 1, 1, 1; sdpa 2, 0.38, 2.14; blocked:64 0.95, 1.8, 0.98. Medians 1, 2, 0.98, times the
    # median round 1.00 s -> 100, 50, 102 items/s; MFU against 4e9.
    assert row == [
        "| llama3_debug | float32 | attention | sdpa 50 (12.5%), blocked:64 102 (25.5%) | blocked:64 "
        "| 100 (25.0%) | 98.0% | 98.0% |"
    ]


def test_a_dtype_on_the_command_line_is_the_only_one_measured(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(bench_kernels, "native_dtypes", lambda: ["float32", "bfloat16"])
    opened: list[list[str]] = []

    def open_run(config: str, overrides: list[str]) -> FakeRun:
        opened.append(overrides)
        return FakeRun([], overrides)

    assert bench_kernels.kernel_table("llama3_debug", 3, 1, ["--training.dtype=bfloat16"], open_run) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| llama3_debug")]
    assert [row.split(" | ")[1] for row in rows] == ["bfloat16"]
    # The last dtype on the command line wins, and the schedule covers the warm-up and the rounds.
    assert opened and all("--training.steps=4" in o for o in opened)


def test_a_device_without_a_known_peak_shows_no_mfu() -> None:
    run = FakeRun([], [])
    run.steps = 1
    timed, peak = bench_kernels.interleave({"auto": run}, 2, lambda: None)
    assert peak is None and timed["auto"].mfu(peak) == "no peak"


def test_every_run_of_every_field_has_trained_the_same_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """An MoE step's cost follows the routing, which changes as the model learns: an auto run carried
    over from the first field into the second would be compared after twice the training."""
    monkeypatch.setattr(bench_kernels, "native_dtypes", lambda: ["float32"])
    monkeypatch.setitem(SECONDS, None, [1.0] * 8)
    closed: list[int] = []

    class TwoFields(FakeRun):
        def __init__(self, events: list[Any], overrides: list[str]) -> None:
            super().__init__(events, overrides)
            self.kernel_candidates = {"attention": ["sdpa", "blocked:64"], "loss_chunk_elements": ["2^26", "2^18"]}
            self.kernel_sources = {"attention": "cached", "loss_chunk_elements": "cached"}

        def close(self) -> None:
            closed.append(self.steps)

    assert bench_kernels.kernel_table("llama3_debug", 3, 1, [], lambda c, o: TwoFields([], o)) == 0
    assert closed == [1 + 3] * 6  # auto and two candidates, for each of the two fields


def test_drift_between_rounds_does_not_rank_the_runs() -> None:
    """The machine slows down round by round (factors 1, 2, 3); run "b" is 5% slower than "a" but
    had one fast step (half its time) in the middle round. Raw medians would rank b twice as fast
    (1.05 s against 2.0 s); each step against its round's median ranks a first, by 5%."""

    class Fixed(FakeRun):
        def __init__(self, times: list[float]) -> None:
            super().__init__([], [])
            self.times = times

        def step_seconds(self) -> float:
            self.steps += 1
            return self.times[self.steps - 1]

    a, b = Fixed([1.0, 2.0, 3.0]), Fixed([1.05, 1.05, 3.15])
    timed, _ = bench_kernels.interleave({"a": a, "b": b}, 3, lambda: None)
    assert timed["a"].rate() / timed["b"].rate() == pytest.approx(1.05, rel=0.01)
    # Negative control: the raw medians of the same steps rank them the other way.
    assert statistics.median(timed["a"].seconds) > statistics.median(timed["b"].seconds)
