"""Per-process throughput under tensor parallelism: the processes of one tensor-parallel group train
on the same tokens, so each may claim only its share of them.

Bug caught: counting every token of the data-parallel group on each tp rank makes TP 2 x FSDP 2
report twice its share: the processes' tokens/s no longer add up to the global batch over the step
time, and its per-process TFLOP/s far exceeds FSDP 4's on the same model although its total
throughput is no higher.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from launch import torchrun  # noqa: E402

pytestmark = pytest.mark.slow


def test_tp_and_fsdp_report_comparable_per_process_flops(tmp_path: Path) -> None:
    out = tmp_path / "throughput.json"
    torchrun(4, HERE / "throughput_worker.py", str(out))
    results = json.loads(out.read_text())
    # Exact: the 4 processes together train one global batch (8 x 256 tokens) per step.
    for layout in results.values():
        assert 4 * layout["tokens_per_sec"] == pytest.approx(8 * 256 / layout["step_time_s"], rel=1e-6)
    tp, fsdp = results["tp2_fsdp2"]["tflops"], results["fsdp4"]["tflops"]
    assert 1 / 1.3 <= tp / fsdp <= 1.3, results
