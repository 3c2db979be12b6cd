"""Charts: scripts/plot.py and titan_tpu/metrics/plot.py draw the data they are given (a falling loss
is drawn falling, a flat one flat), read items seen from the records exactly, reject malformed input
with one line naming the file and line, and the run draws its own loss.png unless told not to."""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import titan_tpu.metrics.plot as plot
from tests.support.paths import REPO
from titan_tpu.config import load_config
from titan_tpu.training.trainer import Trainer

ROOT = REPO
_spec = importlib.util.spec_from_file_location("plot_script", ROOT / "scripts" / "plot.py")
assert _spec is not None and _spec.loader is not None
plot_script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plot_script)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TAB_BLUE = np.array([31, 119, 180])  # matplotlib's first line colour


def write_metrics(folder: Path, losses: list[float], log_freq: int = 10) -> Path:
    """A metrics.jsonl of records every `log_freq` steps, 1000 tokens/s per process, 0.5 s a step."""
    folder.mkdir(parents=True, exist_ok=True)
    steps = [1, *range(log_freq, log_freq * len(losses), log_freq)][: len(losses)]
    lines = [
        json.dumps({"step": step, "loss": loss, "tokens_per_sec": 1000.0, "step_time_s": 0.5, "mfu": None})
        for step, loss in zip(steps, losses)
    ]
    path = folder / "metrics.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def curve_rows(png: Path) -> tuple[int, int, int]:
    """(rows the line spans, its row at the left end, at the right end) in the left panel."""
    pixels = np.asarray(Image.open(png).convert("RGB")).astype(int)
    left = pixels[:, : pixels.shape[1] // 2]
    rows, cols = np.nonzero(np.abs(left - TAB_BLUE).sum(axis=2) < 30)
    assert rows.size > 0, "no line drawn"
    return rows.max() - rows.min(), rows[cols == cols.min()].mean(), rows[cols == cols.max()].mean()


def test_a_falling_loss_is_drawn_falling_and_a_flat_one_flat(tmp_path: Path) -> None:
    """Catches a blank or constant image, a chart that ignores the loss values (the flat curve is the
    negative control: same steps, same file format), and an upside-down axis."""
    falling = write_metrics(tmp_path / "falling", [6.0, 4.0, 3.0, 2.5, 2.2, 2.0])
    flat = write_metrics(tmp_path / "flat", [3.0] * 6)
    charts = []
    for source in (falling, flat):
        out = tmp_path / f"{source.parent.name}.png"
        assert plot_script.main([str(source), "--out", str(out)]) == 0
        assert out.read_bytes()[:8] == PNG_SIGNATURE
        charts.append(out)
    height = np.asarray(Image.open(charts[0])).shape[0]
    span, left_end, right_end = curve_rows(charts[0])
    assert span > 0.4 * height
    assert left_end < right_end  # image rows grow downwards: the loss falls from left to right
    flat_span, _, _ = curve_rows(charts[1])
    assert flat_span < 0.05 * height


def with_validation(path: Path, losses: dict[int, float]) -> Path:
    """The same records, with a held-out loss at the given steps (as [validation] adds them)."""
    records = [json.loads(line) for line in path.read_text().splitlines()]
    for record in records:
        if record["step"] in losses:
            record["validation/loss"] = losses[record["step"]]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_validation_loss_is_drawn_on_the_training_axes_with_a_legend(tmp_path: Path) -> None:
    """A flat training loss with held-out losses well above it: the chart spans both (the control is
    the same records without them, drawn flat), and the legend names both lines. Catches a chart that
    ignores validation/loss, or draws it without saying which line it is."""
    plain = write_metrics(tmp_path / "plain", [3.0] * 6)
    held_out = with_validation(write_metrics(tmp_path / "held_out", [3.0] * 6), {20: 5.0, 50: 4.5})
    spans = {}
    for source in (plain, held_out):
        out = plot.write_run_loss_chart(source.parent, processes=1)
        height = np.asarray(Image.open(out)).shape[0]
        spans[source.parent.name] = curve_rows(out)[0] / height
    assert spans["plain"] < 0.05 and spans["held_out"] > 0.4
    records = plot.read_metrics(held_out)
    single = plot.loss_figure([("held_out", records)], processes=1)
    assert [t.get_text() for t in single.axes[0].get_legend().get_texts()] == ["training", "validation"]
    assert "validation 4.500 at step 50" in single.get_suptitle()
    assert plot.loss_figure([("plain", plot.read_metrics(plain))]).axes[0].get_legend() is None
    both = plot.loss_figure([("a", records), ("b", plot.read_metrics(plain))])
    assert [t.get_text() for t in both.axes[0].get_legend().get_texts()] == ["a", "a validation", "b"]


def test_items_seen_are_rate_times_time_times_steps(tmp_path: Path) -> None:
    records = plot.read_metrics(write_metrics(tmp_path, [5.0, 4.0, 3.0]))
    # Steps 1, 10, 20 at 1000 tokens/s per process and 0.5 s a step: 500 tokens per step per process.
    assert plot.items_seen(records, processes=None) == [500.0, 5000.0, 10000.0]
    assert plot.items_seen(records, processes=4) == [2000.0, 20000.0, 40000.0]


def test_a_task_with_rates_of_its_own_counts_the_trainers_rate(tmp_path: Path) -> None:
    """GRPO's records carry train_ and rollout_tokens_per_sec after the trainer's tokens_per_sec; the
    chart once refused every GRPO run for having three rates."""
    record = {
        "step": 1,
        "loss": 0.5,
        "tokens_per_sec": 1000.0,
        "step_time_s": 0.5,
        "train_tokens_per_sec": 3000.0,
        "rollout_tokens_per_sec": 7.0,
    }
    (tmp_path / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    records = plot.read_metrics(tmp_path)
    assert plot.unit_of(records) == "tokens"
    assert plot.items_seen(records, processes=None) == [500.0]


def grpo_record(step: int, loss: float) -> dict:
    """A record as a GRPO run writes it: the trainer's fields (tokens_per_sec first, mfu None where no
    peak is known), then the task's own rates, rewards by name and the rollout's TFLOP/s and MFU."""
    return {
        "step": step,
        "loss": loss,
        "grad_norm": 0.4,
        "lr": 3e-5,
        "tokens_per_sec": 1000.0,
        "tflops": 0.02,
        "mfu": None,
        "memory_gib": 0.5,
        "step_time_s": 0.5,
        "kl": 0.001,
        "clip_fraction": 0.0,
        "train_tokens_per_sec": 3000.0,
        "reward_mean": 0.4,
        "reward_std": 0.2,
        "completion_length": 6.0,
        "rollout_tokens_per_sec": 1500.0,
        "rollout_tflops": 0.04,
        "rollout_mfu": 50.0,
        "reward/exact": 0.35,
        "reward/format": 0.5,
    }


def test_a_grpo_runs_records_draw_its_loss_chart(tmp_path: Path) -> None:
    """GRPO records (the task's rates, reward/NAME, rollout_tflops and rollout_mfu, a held-out accuracy
    at one step) draw the run's chart: its line spans the loss's range, falling, and the tokens axis
    comes from the trainer's rate. Catches a chart reader that rejects GRPO records (the run would end
    with "loss chart not drawn") or counts tokens from one of the task's rates."""
    losses = [0.3, 0.2, 0.12, 0.08, 0.05, 0.03]
    records = [grpo_record(step, loss) for step, loss in zip([1, 10, 20, 30, 40, 50], losses)]
    records[3]["heldout_accuracy"] = 0.5
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = plot.write_run_loss_chart(tmp_path, processes=1)
    assert out.read_bytes()[:8] == PNG_SIGNATURE
    span, left_end, right_end = curve_rows(out)
    assert span > 0.4 * np.asarray(Image.open(out)).shape[0] and left_end < right_end
    assert plot.items_seen(plot.read_metrics(tmp_path), processes=1)[-1] == 50 * 1000.0 * 0.5


def test_a_grpo_run_draws_its_loss_chart(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The chart at the end of a real (tiny) GRPO run: catches records the trainer writes for GRPO that
    the chart reader refuses, which the run only logs as a warning."""
    config = load_config(
        "grpo_qwen3_debug",
        [
            f"--job.dump_folder={tmp_path}",
            "--model.overrides={ n_layers = 1 }",
            "--training.steps=2",
            "--rl.prompts_per_step=2",
            "--rl.group_size=4",
            "--training.global_batch_size=8",
            "--rl.max_new_tokens=4",
            "--metrics.log_freq=1",
            "--metrics.eval_freq=0",
            "--training.dtype=float32",
        ],
    )
    trainer = Trainer(config)
    with caplog.at_level(logging.WARNING, logger="titan_tpu"):
        trainer.train()
    trainer.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert not [w for w in warnings if w.startswith("metrics:")]
    assert (tmp_path / "loss.png").read_bytes()[:8] == PNG_SIGNATURE
    assert "rollout_tokens_per_sec" in plot.read_metrics(tmp_path)[-1]


def test_a_resumed_run_that_repeats_steps_keeps_the_later_records(tmp_path: Path) -> None:
    path = write_metrics(tmp_path, [5.0, 4.0, 3.0])
    with open(path, "a") as f:  # resumed from step 10: step 20 logged again
        f.write(json.dumps({"step": 20, "loss": 2.0, "tokens_per_sec": 1000.0, "step_time_s": 0.5}) + "\n")
    records = plot.read_metrics(path)
    assert [(r["step"], r["loss"]) for r in records] == [(1, 5.0), (10, 4.0), (20, 2.0)]


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (
            '{"step": 1, "loss": 2.0, "tokens_per_sec": 1.0, "step_time_s": 1.0}\n{"step": 2, "loss"\n',
            "line 2: not a JSON record",
        ),
        (
            '{"step": 1, "loss": 2.0, "tokens_per_sec": 1.0, "step_time_s": 1.0}\n[1, 2]\n',
            "line 2: not a JSON record (a list)",
        ),
        ('\n{"step": 1, "grad_norm": 2.0}\n', "line 2: not a step record"),
    ],
)
def test_malformed_metrics_give_one_line_with_file_and_line(
    tmp_path: Path, content: str, expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text(content)
    assert plot_script.main([str(path), "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path} {expected}") and err.count("\n") == 1
    assert not (tmp_path / "x.png").exists()


def test_missing_file_and_empty_bench_are_one_line_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert plot_script.main([str(tmp_path / "nothere.jsonl"), "--out", str(tmp_path / "x.png")]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'nothere.jsonl'}: no such file\n"
    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps({"case": "a/ep2", "skipped": "ep 2 must divide dp_shard 1"}) + "\n")
    assert plot_script.main(["--bench", str(tmp_path), "--out", str(tmp_path / "b.png")]) == 2
    assert "every case was skipped or failed" in capsys.readouterr().err


def test_bench_chart_draws_measured_cases(tmp_path: Path) -> None:
    records = [
        {"case": "llama3_debug/1", "processes": 1, "tokens_per_sec_per_process": 6000.0, "mfu_percent": 50.0},
        {"case": "flux_debug/1", "processes": 1, "samples_per_sec_per_process": 120.0, "mfu_percent": None},
        {"case": "qwen3_moe_debug/fsdp2xep4", "processes": 2, "skipped": "ep 4 must divide dp_shard 2"},
    ]
    (tmp_path / "bench.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = plot.draw_bench_chart(plot.read_bench([tmp_path]), tmp_path / "bench.png")
    pixels = np.asarray(Image.open(out).convert("RGB")).astype(int)
    assert out.read_bytes()[:8] == PNG_SIGNATURE
    assert (np.abs(pixels - TAB_BLUE).sum(axis=2) < 30).sum() > 500  # the throughput bars are there


# One narrow layer: building and initialising the debug model's four layers is most of a run's time.
TINY_MODEL = [
    "--model.overrides.n_layers=1",
    "--model.overrides.dim=64",
    "--model.overrides.n_heads=2",
    "--model.overrides.n_kv_heads=2",
]


def tiny_run(tmp_path: Path, *overrides: str) -> Trainer:
    config = load_config(
        "llama3_debug",
        [
            f"--job.dump_folder={tmp_path}",
            "--training.seq_len=32",
            "--training.global_batch_size=2",
            "--training.steps=4",
            "--metrics.log_freq=2",
            *TINY_MODEL,
            *overrides,
        ],
    )
    return Trainer(config)


@pytest.mark.parametrize("plot_loss", [True, False])
def test_the_run_draws_its_loss_chart_when_asked(tmp_path: Path, plot_loss: bool) -> None:
    trainer = tiny_run(tmp_path, f"--metrics.plot_loss={str(plot_loss).lower()}")
    trainer.train()
    trainer.close()
    chart = tmp_path / "loss.png"
    assert chart.exists() == plot_loss
    if plot_loss:
        assert chart.read_bytes()[:8] == PNG_SIGNATURE
        # The tokens axis comes from the records: 4 steps of 2 x 32 tokens on one process, exactly.
        assert plot.items_seen(plot.read_metrics(tmp_path), processes=1)[-1] == pytest.approx(4 * 2 * 32)


def test_a_chart_that_cannot_be_drawn_does_not_fail_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*args: object, **kwargs: object) -> Path:
        raise RuntimeError("no fonts")

    monkeypatch.setattr(plot, "draw_loss_chart", broken)
    trainer = tiny_run(tmp_path)
    with caplog.at_level(logging.WARNING, logger="titan_tpu"):
        records = trainer.train()
    trainer.close()
    assert [r.step for r in records] == [1, 2, 4]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert [w for w in warnings if w.startswith("metrics:")] == ["metrics: loss chart not drawn (no fonts)"]
    assert not (tmp_path / "loss.png").exists()
