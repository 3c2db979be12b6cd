"""The dry run (titan_tpu/dryrun) at the world sizes our large configs target: how long each takes
and how much memory, and what it measured against what the planner says.

    python scripts/bench_dryrun.py [--only NAME ...] [--out FOLDER]

Each case is `python -m titan_tpu.dryrun --config NAME --world N --rank 0` in its own process, so its
time and peak memory are its own (the dry run's JSON holds them). Then, in this process, its rank-0
bytes are compared with the planner's for the same config and device count:

- state: the parameter, gradient and AdamW bytes rank 0 holds after the step;
- FSDP: the bytes of one micro-batch's all-gathers and reduce-scatters over the FSDP axes, against
  the planner with and without its padding term (FSDP2 pads every shard to the largest; a planner
  without the term is the negative control, and should miss wherever shards are uneven).

Last, the planner's best layout (`--search`) for each config's slice is dry-run at that size: the
search must never propose a layout that torch rejects. The 8,192-rank cases override the global batch
to one sample per data-parallel rank: the shipped one does not split over that many.

`--tables` instead dry-runs every row of the planner's table of shipped configs
(scripts/plan_tables.py) and writes what each said to its record, docs/benchmarks/dryrun_shipped.json,
which the table's "dry run" column reads.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pytest  # noqa: E402  (its MonkeyPatch, for the planner without the padding term)

from scripts.plan_tables import DRY_RUNS, SHIPPED, shipped_overrides  # noqa: E402
from titan_tpu.config import load_config  # noqa: E402
from titan_tpu.device import Device  # noqa: E402
from titan_tpu.plan.census import ParamShare  # noqa: E402
from titan_tpu.plan.chips import parse_chips  # noqa: E402
from titan_tpu.plan.memory import state_bytes  # noqa: E402
from titan_tpu.plan.planner import make_plan  # noqa: E402
from titan_tpu.plan.roofline import COMPUTE_EFFICIENCY, fsdp_traffic  # noqa: E402
from titan_tpu.plan.search import search  # noqa: E402

# (config, chips the planner prices it on, overrides); v7x-4096 is 8,192 devices (two per chip).
CASES = {
    "llama3_70b@64": ("llama3_70b", "v6e-64", ()),
    "llama3_405b@256": ("llama3_405b", "v6e-256", ()),
    "qwen3_moe_235b_a22b@256": ("qwen3_moe_235b_a22b", "v6e-256", ()),
    "llama3_70b@8192": ("llama3_70b", "v7x-4096", ("--training.global_batch_size=8192",)),
    "llama3_405b@8192": ("llama3_405b", "v7x-4096", ("--training.global_batch_size=2048",)),
    "qwen3_moe_235b_a22b@8192": ("qwen3_moe_235b_a22b", "v7x-4096", ("--training.global_batch_size=8192",)),
}
# What a shipped config reads from disk at set-up and a dry run has no copy of: FLUX.1's frozen
# encoders and its image folder. The dry run simulates the trained transformer; these stand in.
STAND_INS = {
    "flux_dev": (
        "--flux.dataset=generated",
        "--flux.data_path=",
        "--flux.autoencoder=random",
        "--flux.t5_encoder=random",
        "--flux.clip_encoder=random",
    ),
}
SEARCHED = {"llama3_70b": "v6e-64", "llama3_405b": "v6e-256", "qwen3_moe_235b_a22b": "v6e-256"}
FSDP_AXES = ("dp_shard", "dp_shard_cp", "dp_shard_mod_ep")
GIB = 2**30


def dry_run(name: str, world: int, overrides: tuple[str, ...], out: Path) -> tuple[dict[str, Any] | None, float, str]:
    """(rank 0's report, wall seconds, the rejection line or "") of one case in its own process."""
    command = [sys.executable, "-m", "titan_tpu.dryrun", "--config", name, "--world", str(world), "--rank", "0"]
    start = time.perf_counter()
    result = subprocess.run([*command, "--out", str(out), *overrides], cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        return None, wall, (result.stderr.strip().splitlines() or ["?"])[-1]
    return json.loads((out / f"world-{world}-rank-0.json").read_text()), wall, ""


def planned_fsdp(name: str, chips: str, overrides: tuple[str, ...]) -> tuple[int, int]:
    """(all-gather bytes, reduce-scatter bytes) of one micro-batch, as the planner has them."""
    plan = make_plan(load_config(name, list(overrides)), parse_chips(chips))
    units = fsdp_traffic(plan.detail.local, plan.shape, plan.detail.layout.precision).values()
    accum = plan.shape.grad_accum
    return sum(u.gathered_bytes for u in units) // accum, sum(u.reduced_bytes for u in units) // accum


def measured_fsdp(report: dict[str, Any]) -> tuple[int, int]:
    rows = [row for row in report["collectives"] if row["axis"] in FSDP_AXES]
    return (
        sum(row["bytes"] for row in rows if row["kind"] == "all_gather"),
        sum(row["bytes"] for row in rows if row["kind"] == "reduce_scatter"),
    )


def _same(measured: int, planned: int) -> str:
    return "equal" if measured == planned else f"differ by {100 * (planned - measured) / measured:+.2f}%"


def check(case: str, report: dict[str, Any], wall: float) -> None:
    name, chips, overrides = CASES[case]
    config = load_config(name, list(overrides))
    detail = make_plan(config, parse_chips(chips)).detail
    state = state_bytes(detail.local)
    offloaded = report["state_where"] == "host"
    # On the device: the step's live tensors (less the gradients FSDP offloads), and in a later step
    # also the parameters and optimizer state, unless offloaded.
    device = report["step_peak_bytes"] - (report["gradient_bytes"] if offloaded else 0)
    if not offloaded:
        device += report["parameter_bytes"] + report["optimizer_bytes"]
    measured_state = (report["parameter_bytes"], report["gradient_bytes"], report["optimizer_bytes"])
    gathered, reduced = measured_fsdp(report)
    with_padding = planned_fsdp(name, chips, overrides)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ParamShare, "gathered_numel", property(lambda share: share.tp_numel))
        without_padding = planned_fsdp(name, chips, overrides)
    print(
        f"{case}: {report['layout']}\n"
        f"  {wall:.0f} s in all (set-up {report['setup_s']:.0f} s, step {report['step_s']:.0f} s), "
        f"peak {report['peak_rss_gib']:.2f} GiB; {report['uneven_shards']} of {report['parameters']} parameters "
        f"sharded unevenly, {report['empty_shards']} empty on rank 0\n"
        f"  state (parameters, gradients, optimizer) GiB: dry run "
        f"{', '.join(f'{b / GIB:.4f}' for b in measured_state)}; planner {', '.join(f'{b / GIB:.4f}' for b in state)}"
        f" ({'equal' if measured_state == state else 'differ'})\n"
        f"  device memory GiB: dry run {device / GIB:.2f} (live fake tensors), planner "
        f"{detail.memory.total / GIB:.2f} (planner / dry run {detail.memory.total / device:.3f})\n"
        f"  FSDP all-gather {gathered / GIB:.3f} GiB: planner {_same(gathered, with_padding[0])}, without padding "
        f"{_same(gathered, without_padding[0])}; reduce-scatter {reduced / GIB:.3f} GiB: planner "
        f"{_same(reduced, with_padding[1])}, without padding {_same(reduced, without_padding[1])}"
    )


def searched(out: Path) -> None:
    for name, chips in SEARCHED.items():
        config = load_config(name, [])
        ranked, _ = search(config, parse_chips(chips), COMPUTE_EFFICIENCY)
        if not ranked:
            print(f"search {name} on {chips}: nothing fits")
            continue
        best = ranked[0]
        report, wall, rejected = dry_run(name, parse_chips(chips).devices, best.overrides, out / f"search-{name}")
        verdict = f"rejected: {rejected}" if report is None else f"set up and stepped in {wall:.0f} s"
        print(f"search {name} on {chips}: best {' '.join(best.overrides)} -> {verdict}")


def tables(out: Path, only: list[str]) -> None:
    """Dry-run each shipped (config, chips) row (those of the configs in `only`, when given) and
    record the outcome, its CPU and date, for the planner's table; the other rows' records stay."""
    record = json.loads(DRY_RUNS.read_text(encoding="utf-8")) if DRY_RUNS.is_file() else {"runs": {}}
    cpu, date = Device("cpu", 0).name(), str(datetime.date.today())
    for name, chips in SHIPPED:
        if only and name not in only:
            continue
        world = parse_chips(chips).devices
        stand_ins = STAND_INS.get(name, ())
        overrides = (*shipped_overrides(chips), *stand_ins)
        report, wall, rejected = dry_run(name, world, overrides, out / f"{name}@{chips}")
        result = rejected if report is None else "stepped" + (" (stand-in encoders and data)" if stand_ins else "")
        record["runs"][f"{name}@{chips}"] = {"result": result, "seconds": f"{wall:.0f}", "cpu": cpu, "date": date}
        print(f"{name} on {chips} ({world} ranks): {result} in {wall:.0f} s", flush=True)
    DRY_RUNS.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", choices=list(CASES), help="these cases (default: all)")
    parser.add_argument("--no-search", action="store_true", help="skip dry-running the search's best layouts")
    parser.add_argument("--tables", action="store_true", help="dry-run the planner table's rows and record them")
    parser.add_argument("--configs", nargs="*", help="with --tables: only these configs' rows")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder)
        if args.tables:
            tables(out, args.configs or [])
            return 0
        for case in args.only or list(CASES):
            name, chips, overrides = CASES[case]
            world = parse_chips(chips).devices
            report, wall, rejected = dry_run(name, world, overrides, out / case)
            if report is None:
                print(f"{case}: rejected after {wall:.0f} s: {rejected}")
                continue
            check(case, report, wall)
        if not args.no_search:
            searched(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
