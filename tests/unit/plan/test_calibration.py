"""`python -m titan_tpu.plan --calibration REPORT.json`: a doctor report's measured matmul FLOP/s and
collective bandwidths replace the vendor figures in the roofline, and a report measured on other
hardware is refused with one line.

Bugs caught: a calibration that is read but not used (the estimate unchanged), one applied to the
wrong term (compute scaled by a bandwidth), a collective figure derated twice, and a CPU's or another
generation's figures silently planning a TPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from titan_tpu.config import ConfigError, load_config
from titan_tpu.plan.__main__ import main
from titan_tpu.plan.calibration import REPORT_FORMAT, load_calibration
from titan_tpu.plan.chips import calibrated, parse_chips
from titan_tpu.plan.planner import make_plan
from titan_tpu.plan.roofline import COLLECTIVE_EFFICIENCY

CONFIG, CHIPS = "llama3_8b", "v6e-8"
OVERRIDES = ["--parallelism.dp_shard=4", "--parallelism.cp=1", "--parallelism.tp=2"]


def write_report(path: Path, device: str, matmul: float, bus: float) -> Path:
    """A report as the doctor writes it (titan_tpu/doctor/report.py), reduced to what the planner reads."""
    kinds = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
    path.write_text(
        json.dumps(
            {
                "format": REPORT_FORMAT,
                "version": 1,
                "device": {"type": "tpu", "name": device, "generation": ""},
                "measured": {
                    "matmul_flops": {"bfloat16": matmul},
                    "bus_bytes_per_s": {"fast": dict.fromkeys(kinds, bus), "slow": {}},
                },
            }
        )
    )
    return path


def test_measured_figures_replace_the_vendor_ones(tmp_path: Path) -> None:
    """Half the table's peak doubles the compute time; a quarter of the vendor's derated ICI figure
    quadruples the exposed tensor-parallel time; MFU still divides by the table's peak."""
    cluster = parse_chips(CHIPS)
    config = load_config(CONFIG, OVERRIDES)
    vendor_bus = cluster.fast_bytes_per_s_per_device() * COLLECTIVE_EFFICIENCY
    report = write_report(tmp_path / "r.json", "TPU v6e", cluster.peak_flops_per_device / 2, vendor_bus / 4)
    plain = make_plan(config, cluster)
    measured = make_plan(config, calibrated(cluster, load_calibration(str(report), cluster.chip)))
    assert measured.step.compute_s == pytest.approx(2 * plain.step.compute_s)
    assert measured.step.tp_s == pytest.approx(4 * plain.step.tp_s)
    assert measured.step.fsdp_s == pytest.approx(4 * plain.step.fsdp_s)
    assert measured.step.peak_flops == plain.step.peak_flops
    # Negative control: a report at exactly the vendor's figures changes nothing.
    same = write_report(tmp_path / "same.json", "TPU v6e", cluster.peak_flops_per_device, vendor_bus)
    unchanged = make_plan(config, calibrated(cluster, load_calibration(str(same), cluster.chip)))
    assert unchanged.step.step_s == pytest.approx(plain.step.step_s)


def test_the_plan_says_it_used_the_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cluster = parse_chips(CHIPS)
    report = write_report(tmp_path / "r.json", "TPU v6e", cluster.peak_flops_per_device / 2, 100e9)
    assert main(["--config", CONFIG, "--chips", CHIPS, "--calibration", str(report), *OVERRIDES]) == 0
    out = capsys.readouterr().out
    assert f"calibrated from {report} (measured on TPU v6e)" in out
    assert "ICI all-gather/reduce-scatter 100.0 GB/s" in out
    assert main(["--config", CONFIG, "--chips", CHIPS, *OVERRIDES]) == 0
    assert "calibrated" not in capsys.readouterr().out


@pytest.mark.parametrize("device", ["AMD EPYC", "TPU v5 lite", "TPU v5e", "NVIDIA H100 80GB HBM3"])
def test_a_report_for_other_hardware_is_refused_in_one_line(
    device: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = write_report(tmp_path / "r.json", device, 1e14, 1e11)
    assert main(["--config", CONFIG, "--chips", CHIPS, "--calibration", str(report), *OVERRIDES]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"measured on '{device}'" in err and "v6e" in err


@pytest.mark.parametrize(
    "content", ["not json", json.dumps({"format": "other"}), json.dumps({"format": REPORT_FORMAT})]
)
def test_an_unreadable_report_is_refused_in_one_line(content: str, tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=r"^--calibration .*cannot be used"):
        load_calibration(str(path), parse_chips(CHIPS).chip)
