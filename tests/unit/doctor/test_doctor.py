"""`python -m titan_tpu.doctor --quick` in one process on this CPU: the report's fields, its verdicts,
and the negative controls that make them fail (a perturbed attention kernel is `wrong` and the run
exits 1; a broken training reference is `wrong`). The 4-process run and the forced-slow collective:
tests/distributed/test_doctor_processes.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args

import pytest
import tomllib
import torch

from tests.support.one_thread import one_intra_op_thread
from tests.support.paths import REPO
from titan_tpu.device.select import Device
from titan_tpu.distributed.compile import available_backends
from titan_tpu.doctor import kernel_checks, training_check
from titan_tpu.doctor.__main__ import CHECKS, main
from titan_tpu.doctor.report import merge_ranks
from titan_tpu.doctor.rows import VERDICTS, Row, error_verdict, speed_verdict
from titan_tpu.doctor.sizes import QUICK
from titan_tpu.models.common.attention_kernels import SdpaAttention
from titan_tpu.models.qwen3.args import ExpertImpl
from titan_tpu.plan.calibration import load_calibration
from titan_tpu.plan.chips import parse_chips

ROOT = REPO


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One full --quick run (about 20 s here), its exit status, printed table and JSON report."""
    out = tmp_path_factory.mktemp("doctor") / "report.json"
    import contextlib
    import io

    printed = io.StringIO()
    with one_intra_op_thread(), contextlib.redirect_stdout(printed):
        status = main(["--quick", "--out", str(out)])
    return {"status": status, "table": printed.getvalue(), "report": json.loads(out.read_text()), "path": out}


def rows_of(report: dict[str, Any], check: str) -> dict[str, dict[str, Any]]:
    return {row["name"]: row for row in report["rows"] if row["check"] == check}


def test_quick_run_reports_every_check_with_a_verdict(quick_run: dict[str, Any]) -> None:
    """Bugs caught: a check left out of the run or the report, a row without a known verdict, a
    report that says nothing about the device or its dtype decision."""
    report = quick_run["report"]
    assert quick_run["status"] == 0, quick_run["table"]
    assert report["device"] == {"type": "cpu", "name": Device("cpu", 0).name(), "generation": "cpu"}
    assert report["world_size"] == 1 and report["sizes"] == "quick"
    groups = {row["check"] for row in report["rows"]}
    assert groups == {"device", "dtype", "matmul", "compile", "attention", "moe", "collective", "training"}
    assert all(row["verdict"] in VERDICTS and row["reason"] for row in report["rows"])
    assert report["exit_status"] == 0 and sum(report["verdicts"].values()) == len(report["rows"])
    assert report["compute_dtype"] == rows_of(report, "dtype")["compute dtype"]["detail"]
    # The table printed is the report's: one line per row, a header and the counts.
    assert len(quick_run["table"].splitlines()) == len(report["rows"]) + 3


def test_quick_run_verdicts_on_this_cpu(quick_run: dict[str, Any]) -> None:
    """What a CPU has and has not: splash attention, the TPU compile backend and collectives (one
    process) are unavailable with a reason; every kernel that exists agrees with its reference; the
    ten training steps agree with the CPU float32 reference. Bugs caught: a kernel that is checked
    against itself only (sdpa must be exact, the others not), unavailable things reported ok."""
    report = quick_run["report"]
    attention = rows_of(report, "attention")
    assert attention["splash"]["verdict"] == "unavailable" and "TPU" in attention["splash"]["reason"]
    assert attention["sdpa correctness"]["measured"] == 0.0
    assert 0 < attention["blocked:64 correctness"]["measured"] <= attention["blocked:64 correctness"]["expected"]
    for length in QUICK.attention_seq_lens:
        assert any(name.startswith(f"sdpa {length} tokens") for name in attention)
    # torch_tpu registers its dynamo backend wherever it is imported (other tests here import it);
    # a CPU run can name it, so it is `ok` once registered and `unavailable` with the reason before.
    tpu_backend = rows_of(report, "compile")["tpu"]
    assert tpu_backend["verdict"] == ("ok" if "tpu" in available_backends() else "unavailable")
    assert rows_of(report, "collective")["collectives"]["verdict"] == "unavailable"
    training = rows_of(report, "training")["llama3_debug 10 steps"]
    assert training["verdict"] == "ok" and training["measured"] <= training["expected"]
    matmul = report["measured"]["matmul_flops"]
    assert set(matmul) == {"bfloat16", "float32"} and all(value > 1e9 for value in matmul.values())


def test_every_expert_impl_has_a_line(quick_run: dict[str, Any]) -> None:
    """The impls come from the `ExpertImpl` type, so a new one is reported without a doctor change:
    either checked or unavailable. Bug caught: a hard-coded list that misses an impl."""
    moe = rows_of(quick_run["report"], "moe")
    for impl in get_args(ExpertImpl):
        if impl != "auto":
            assert f"{impl} correctness" in moe or moe[impl]["verdict"] == "unavailable", impl


def test_the_report_is_what_the_planner_reads(quick_run: dict[str, Any], tmp_path: Path) -> None:
    """The planner refuses this CPU's report for a TPU, and reads its figures once it names one
    (the same file format on both sides). Bug caught: the doctor and the planner drifting apart on
    the report's fields."""
    chip = parse_chips("v6e-8").chip
    with pytest.raises(ValueError, match="measured on"):
        load_calibration(str(quick_run["path"]), chip)
    renamed = dict(quick_run["report"], device={"type": "tpu", "name": "TPU v6e", "generation": "tpu v6e"})
    (tmp_path / "r.json").write_text(json.dumps(renamed))
    calibration = load_calibration(str(tmp_path / "r.json"), chip)
    assert calibration.matmul_flops == quick_run["report"]["measured"]["matmul_flops"]


@dataclass(frozen=True)
class PerturbedAttention:
    """SDPA's output 0.1% too large: ten times the float32 tolerance, invisible in a loss curve."""

    name: str = field(default="perturbed", init=False)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: Any = None) -> torch.Tensor:
        return SdpaAttention()(q, k, v, document_ids) * 1.001


def test_a_wrong_attention_kernel_is_reported_wrong_and_fails_the_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, one_thread: None
) -> None:
    """The negative control of the acceptance: a stand-in kernel that perturbs attention is `wrong`,
    is not timed, and the doctor exits 1."""
    original = kernel_checks.attention_candidates

    def with_perturbed(args: Any, shape: Any) -> dict[str, Any]:
        return {**original(args, shape), "perturbed": PerturbedAttention()}

    monkeypatch.setattr(kernel_checks, "attention_candidates", with_perturbed)
    assert main(["--quick", "--checks", "attention", "--out", str(tmp_path / "r.json")]) == 1
    report = json.loads((tmp_path / "r.json").read_text())
    attention = rows_of(report, "attention")
    assert attention["perturbed correctness"]["verdict"] == "wrong"
    assert attention["sdpa correctness"]["verdict"] == "ok"
    assert not any(name.startswith("perturbed ") and "tokens" in name for name in attention)
    assert report["exit_status"] == 1


def test_a_cpu_host_gets_the_quick_sizes_without_asking(tmp_path: Path, one_thread: None) -> None:
    """Bug caught: a newcomer's plain `python -m titan_tpu.doctor` on a CPU host measuring 32-head
    attention over 8k tokens (minutes per kernel, GB of scores) instead of the CPU sizes."""
    assert main(["--checks", "matmul", "--out", str(tmp_path / "r.json")]) == 0
    assert json.loads((tmp_path / "r.json").read_text())["sizes"] == QUICK.name


def test_training_against_a_different_reference_is_wrong(monkeypatch: pytest.MonkeyPatch, one_thread: None) -> None:
    """Negative control of the ten-step comparison: a reference at ten times the learning rate
    leaves the tolerance. Bug caught: a comparison that cannot fail (losses compared with
    themselves, or a tolerance too wide to mean anything)."""
    monkeypatch.setattr(training_check, "REFERENCE", (*training_check.REFERENCE, "--optimizer.lr=3e-2"))
    row = training_check.training_row(Device("cpu", 0), torch.bfloat16, QUICK, [])
    assert row.verdict == "wrong", row


def test_verdict_rules() -> None:
    """The thresholds as docs/doctor.md states them, nan included. Bug caught: a flipped comparison
    (fast called slow, a time judged as a rate)."""
    assert speed_verdict(0.6, 1.0)[0] == "ok" and speed_verdict(0.4, 1.0)[0] == "slow"
    assert speed_verdict(1.9, 1.0, higher_is_better=False)[0] == "ok"
    assert speed_verdict(2.1, 1.0, higher_is_better=False)[0] == "slow"
    assert speed_verdict(1.0, None)[0] == "ok"
    assert error_verdict(1e-5, 1e-4)[0] == "ok" and error_verdict(2e-4, 1e-4)[0] == "wrong"
    assert error_verdict(float("nan"), 1e-4)[0] == "wrong"


def test_ranks_merge_to_the_worst_verdict() -> None:
    """A slow device on rank 1 is not hidden by rank 0's ok. Bug caught: reporting rank 0 alone."""
    ok = Row("matmul", "bfloat16", 100.0, 100.0, "TFLOP/s", "ok", "fine")
    slow = Row("matmul", "bfloat16", 10.0, 100.0, "TFLOP/s", "slow", "throttled")
    merged = merge_ranks([[ok], [slow], [ok]])
    assert merged == [Row("matmul", "bfloat16", 10.0, 100.0, "TFLOP/s", "slow", "rank 1: throttled")]
    assert merge_ranks([[ok], [ok]]) == [ok]


@pytest.mark.parametrize("argv", [["--checks", "nope"], ["--checks", ""], ["--parallelism.tp=3"], ["--out"]])
def test_bad_options_answer_in_one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ")


def test_help_lists_every_check(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in CHECKS)


def test_console_script() -> None:
    """`titan-doctor` is installed with the package."""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["titan-doctor"] == "titan_tpu.doctor.__main__:cli"
