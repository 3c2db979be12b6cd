"""scripts/bench.py --matrix: layouts parse into parallelism degrees and process counts (and typos are
one-line errors), a case the degrees cannot run is skipped with the library's reason before any
process starts, and one tiny case runs end to end into one JSON line per case."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import REPO
from titan_tpu.config import ConfigError
from titan_tpu.metrics.plot import draw_bench_chart, read_bench

ROOT = REPO
BENCH = ROOT / "scripts" / "bench.py"
# One narrow layer and short sequences: the case's own start-up is most of the test's time.
TINY_CASE = [
    "--training.seq_len=32",
    "--training.global_batch_size=2",
    "--model.overrides.n_layers=1",
    "--model.overrides.dim=64",
    "--model.overrides.n_heads=2",
    "--model.overrides.n_kv_heads=2",
]
_spec = importlib.util.spec_from_file_location("bench_script", BENCH)
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_script"] = bench  # dataclasses look their module up there
_spec.loader.exec_module(bench)


@pytest.mark.parametrize(
    ("text", "degrees", "processes"),
    [
        ("1", {"dp_replicate": 1, "dp_shard": 1, "tp": 1, "ep": 1, "cp": 1, "pp": 1}, 1),
        ("fsdp4", {"dp_replicate": 1, "dp_shard": 4, "tp": 1, "ep": 1, "cp": 1, "pp": 1}, 4),
        ("tp2xfsdp2", {"dp_replicate": 1, "dp_shard": 2, "tp": 2, "ep": 1, "cp": 1, "pp": 1}, 4),
        # ep is carved from fsdp
        ("fsdp4xep2", {"dp_replicate": 1, "dp_shard": 4, "tp": 1, "ep": 2, "cp": 1, "pp": 1}, 4),
        ("dp2xfsdp2xtp2", {"dp_replicate": 2, "dp_shard": 2, "tp": 2, "ep": 1, "cp": 1, "pp": 1}, 8),
        ("pp2xfsdp2", {"dp_replicate": 1, "dp_shard": 2, "tp": 1, "ep": 1, "cp": 1, "pp": 2}, 4),
        ("cp2xfsdp2", {"dp_replicate": 1, "dp_shard": 2, "tp": 1, "ep": 1, "cp": 2, "pp": 1}, 4),
    ],
)
def test_layouts_parse_into_degrees_and_process_counts(text: str, degrees: dict[str, int], processes: int) -> None:
    layout = bench.parse_layout(text)
    assert layout.degrees() == degrees
    assert layout.processes == processes
    assert layout.overrides() == [f"--parallelism.{key}={value}" for key, value in degrees.items()]


@pytest.mark.parametrize("text", ["fsdp", "fsdp0", "gpu4", "tp2xtp2", "tp2*fsdp2", "2", "fsdp02"])
def test_a_malformed_layout_is_one_error_naming_it(text: str) -> None:
    with pytest.raises(ConfigError, match=rf"--layouts: '{text.replace('*', '[*]')}' is not a layout; write axes"):
        bench.parse_layout(text)


def test_cases_the_degrees_cannot_run_are_skipped_with_the_reason() -> None:
    """ep must divide dp_shard: fsdp2xep4 has no layout; tp2xfsdp2 and fsdp4xep2 do (the model-level
    rules, ep against the experts, are left to the case's own run)."""
    problem = bench.case_problem("qwen3_moe_debug", bench.parse_layout("fsdp2xep4"), [])
    assert problem is not None and "ep 4 must divide dp_shard 2" in problem
    assert bench.case_problem("qwen3_moe_debug", bench.parse_layout("fsdp4xep2"), []) is None
    assert bench.case_problem("llama3_debug", bench.parse_layout("tp2xfsdp2"), []) is None
    assert bench.case_problem("llama3_debug", bench.parse_layout("pp2xfsdp2"), []) is None


def test_matrix_runs_a_case_and_skips_another_into_one_jsonl(tmp_path: Path) -> None:
    """One tiny single-process case measured in its own process, one skipped without starting any;
    both become lines of <out>/bench.jsonl that the benchmark chart reads."""
    out = tmp_path / "results"
    command = [
        sys.executable,
        str(BENCH),
        "--matrix",
        "llama3_debug",
        "--layouts",
        "1,fsdp2xep4",
        "--steps",
        "1",
        "--warmup",
        "0",
        "--out",
        str(out),
        *TINY_CASE,
    ]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1")
    )
    assert result.returncode == 0, result.stderr[-2000:]
    measured, skipped = [json.loads(line) for line in (out / "bench.jsonl").read_text().splitlines()]
    assert measured["case"] == "llama3_debug/1" and measured["layout"] == "1"
    assert measured["processes"] == 1 and measured["steps"] == 1
    assert measured["tokens_per_sec_per_process"] > 0 and measured["model"] == "llama3/debug"
    assert (out / "runs" / "llama3_debug_1" / "config.toml").is_file()  # the case's resolved config
    assert skipped["case"] == "llama3_debug/fsdp2xep4" and skipped["processes"] == 2
    assert "ep 4 must divide dp_shard 2" in skipped["skipped"]
    assert result.stdout.splitlines()[-2:] == [json.dumps(measured), json.dumps(skipped)]
    assert draw_bench_chart(read_bench([out]), tmp_path / "bench.png").is_file()


def test_a_misspelled_config_stops_the_matrix_before_any_case(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "argv", ["bench.py", "--matrix", "llama3_debgu", "--layouts", "1", "--out", str(tmp_path)])
    assert bench.main() == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "llama3_debgu" in err and err.count("\n") == 1
    assert not (tmp_path / "bench.jsonl").exists()
