"""The lines a person reads: the start-up line, `step N/T` with the time left on each step line, the
last line's totals, the note under a step line, and sampled text shortened to a line."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from titan_tpu.config.sections import MetricsConfig
from titan_tpu.metrics.console import ConsoleView, count, duration, sample_lines, shortened
from titan_tpu.metrics.logger import MetricsLogger, StepRecord
from titan_tpu.metrics.run_summary import RunReport, RunStart


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def start(tmp_path: Path, steps: int = 100, first_step: int = 1, processes: int = 1) -> RunStart:
    return RunStart(
        model="llama3 debug (Llama3Model)",
        parameters=3_412_096,
        layout="dp_replicate 1 x dp_shard 2 x tp 1",
        processes=processes,
        dtype="bfloat16",
        data="the corpus",
        steps=steps,
        first_step=first_step,
        dump_folder=tmp_path,
        checkpoint_folder=tmp_path / "checkpoint",
    )


def record(step: int, loss: float = 2.5, items_per_sec: float = 100.0, step_time_s: float = 0.5, **kw) -> StepRecord:
    return StepRecord(
        step=step,
        loss=loss,
        grad_norm=1.0,
        lr=1e-3,
        unit="tokens",
        items_per_sec=items_per_sec,
        tflops=0.1,
        mfu=None,
        memory_gib=0.5,
        step_time_s=step_time_s,
        **kw,
    )


def test_the_time_left_is_the_mean_step_time_since_the_first_record() -> None:
    """Step 1 took 50 s (compilation), later steps 2 s each: the time left counts 2 s per step to go
    and nothing of the first step's 50 s. Catches a mean over the whole run (which would say 338 s
    at step 21, not 158 s), a count of the steps done instead of those left, and an eta on the last
    line, where nothing is left."""
    clock = FakeClock()
    report = RunReport(start(Path("out")), clock=clock)
    clock.now += 50.0
    assert report.eta_s(1) is None  # nothing to average yet
    clock.now += 20.0
    assert report.eta_s(11) == pytest.approx(2.0 * 89)
    clock.now += 20.0
    assert report.eta_s(21) == pytest.approx(2.0 * 79)
    clock.now += 158.0
    assert report.eta_s(100) is None


def test_the_step_line_reads_step_n_of_t_and_the_time_left() -> None:
    line = record(10, total_steps=200, eta_s=125.0).console_line()
    assert line.startswith("step  10/200 | loss   2.5000 |") and line.endswith("0.500 s/step | eta 2m05s")
    assert record(3).console_line().startswith("step      3 | loss")  # a record without a total
    assert [duration(s) for s in (0.4, 42, 185, 7620, 190_000)] == ["0s", "42s", "3m05s", "2h07m", "2d04h"]
    assert [count(n) for n in (999, 3_412_096, 8.03e9)] == ["999", "3.41M", "8.03B"]


def test_a_view_picks_the_tasks_values_and_a_brief_line_drops_the_device_columns() -> None:
    extras = {"reward_mean": 0.25, "kl": 0.01, "reward/exact": 0.2}
    full = record(4, extras=extras).console_line()
    assert "reward_mean 0.25" in full and "reward/exact 0.2" in full and "grad_norm" in full
    view = ConsoleView(shown=(("reward_mean", "reward"), ("absent", "never")), brief=True)
    brief = record(4, extras=extras, console=view, total_steps=8, eta_s=3.0).console_line()
    assert brief == "step 4/8 | loss   2.5000 | reward 0.25 | tok/s     100.0 |  0.500 s/step | eta 3s"


def test_the_note_is_a_line_of_its_own_under_the_step_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    sink = MetricsLogger(MetricsConfig(), tmp_path, is_writer=True, run_config={})
    with caplog.at_level(logging.INFO, logger="titan_tpu"):
        sink.log(record(1, console=ConsoleView(note="why the loss is 0")))
        sink.log(record(2))
    sink.close()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 and lines[0].startswith("step      1 |") and lines[1] == "step 1: why the loss is 0"
    assert "why" not in (tmp_path / "metrics.jsonl").read_text()


def test_the_start_line_names_a_resumed_and_a_finished_run(tmp_path: Path) -> None:
    line = start(tmp_path, processes=2).line()
    assert line == (
        "run: model llama3 debug (Llama3Model), 3.41M parameters | 2 processes (dp_replicate 1 x dp_shard 2 x tp 1) | "
        f"bfloat16 | data: the corpus | 100 steps | outputs in {tmp_path}"
    )
    assert "| steps 41-100 of 100 (resumed) |" in start(tmp_path, first_step=41).line()
    assert "| already at step 100 of 100: nothing to train |" in start(tmp_path, first_step=101).line()


def test_the_last_line_adds_up_the_run(tmp_path: Path) -> None:
    """30 steps on 2 processes at 100 tokens/s per process and 0.5 s a step: 3,000 tokens, whatever
    the records' spacing. Catches a total that counts each record's window as one step, or one
    process's tokens only, and an output listed that is not there."""
    clock = FakeClock()
    report = RunReport(start(tmp_path, steps=30, processes=2), clock=clock)
    records = [record(1, loss=6.0), record(10), record(20), record(30, loss=2.4206)]
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "checkpoint").mkdir()
    clock.now += 65.0
    line = report.final_line(30, records, tmp_path / "loss.png")
    assert line == (
        "done: 30 steps in 1m05s | 3,000 tokens, 100.0 tokens/s per process | final loss 2.4206 | "
        f"outputs in {tmp_path}: metrics.jsonl, checkpoint/, loss.png"
    )
    resumed = RunReport(start(tmp_path, steps=30, first_step=11), clock=clock)
    stopped = resumed.final_line(12, [record(12, step_time_s=1.0)], chart=None)
    assert stopped.startswith("stopped at step 12 of 30: 2 steps in 0s | 200 tokens, 100.0 tokens/s per process |")
    assert stopped.endswith(": metrics.jsonl, checkpoint/")


def test_sampled_text_is_one_line_cut_at_the_end_that_matters() -> None:
    assert shortened("12+34=\n", 20, "start") == "'12+34=\\n'"
    assert shortened("a" * 30 + "What is 2+2?\n", 16, "end") == "...'aaWhat is 2+2?\\n'"
    assert shortened("4\n" + "x" * 50, 8, "start") == "'4\\nxxxxx'..."
    lines = sample_lines("step 2: a sample:", [("prompt", "2+2=", "end"), ("completion", "4\n", "start")])
    assert lines == ["step 2: a sample:", "  prompt:     '2+2='", "  completion: '4\\n'"]
