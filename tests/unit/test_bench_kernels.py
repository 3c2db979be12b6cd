"""scripts/bench.py --kernels' table from fake runs: every candidate forced through its own config
override, medians over the interleaved repeats, auto's median against the fastest candidate's.

Bugs caught: comparing auto against a candidate of another field, or against the last run rather
than the median (one repeat here is an outlier), counting the first (warm-up) run, running the rounds
in one fixed order, forcing a field that has a single candidate, and a candidate forced with the
wrong override."""

from __future__ import annotations

from typing import Any

import pytest

from scripts import bench_kernels

RATES = {  # the override a run got -> tokens/s of its successive repeats
    None: [999.0, 100.0, 100.0, 98.0],  # the first run is the uncounted one
    "--model.attention_block=0": [50.0, 52.0, 51.0],
    "--model.attention_block=64": [104.0, 10.0, 104.0],
}


def fake_measure(calls: list[Any]) -> Any:
    def measure(config: str, steps: int, warmup: int, overrides: list[str]) -> dict[str, Any]:
        forced = next((o for o in overrides if o.startswith("--model.attention_block")), None)
        seen = sum(1 for c in calls if c == forced)
        calls.append(forced)
        return {
            "tokens_per_sec_per_process": RATES[forced][seen],
            "mfu_percent": RATES[forced][seen] / 4,
            "kernels": {"attention": "blocked:64"},
            "kernel_candidates": {"attention": ["sdpa", "blocked:64"], "loss_chunk_elements": ["2^26"]},
        }

    return measure


def test_the_table_compares_auto_with_the_fastest_forced_median(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(bench_kernels, "native_dtypes", lambda: ["float32"])
    calls: list[Any] = []
    assert bench_kernels.kernel_table("llama3_debug", 1, 0, 3, [], fake_measure(calls)) == 0
    sdpa, block = "--model.attention_block=0", "--model.attention_block=64"
    # One uncounted run, then three rounds, each starting one run later; nothing forces the loss.
    assert calls == [None, None, sdpa, block, sdpa, block, None, block, None, sdpa]
    row = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| llama3_debug")]
    assert row == [
        "| llama3_debug | float32 | attention | sdpa 51 (12.8%), blocked:64 104 (26.0%) | blocked:64 "
        "| 100 (25.0%) | 96% | 96% |"
    ]


def test_a_dtype_on_the_command_line_is_the_only_one_measured(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(bench_kernels, "native_dtypes", lambda: ["float32", "bfloat16"])
    assert bench_kernels.kernel_table("llama3_debug", 1, 0, 3, ["--training.dtype=bfloat16"], fake_measure([])) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| llama3_debug")]
    assert [row.split(" | ")[1] for row in rows] == ["bfloat16"]
