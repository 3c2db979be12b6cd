"""Regenerate the planner tables of docs/planner.md (between `<!-- plan-tables:begin -->` and
`<!-- plan-tables:end -->`) from the planner itself, so no figure in them is typed by hand.

    .venv/bin/python scripts/plan_tables.py           # rewrite the block in docs/planner.md
    .venv/bin/python scripts/plan_tables.py --check   # exit 1 when that block is stale

Table 1: shipped configs on TPU v6e and TPU7x slices with their own layouts (the TOML's tp / ep, FSDP
over the rest; on several slices dp_replicate spans them), and what the dry run (titan_tpu/dryrun) said
of each at that device count, read from DRY_RUNS, which `scripts/bench_dryrun.py --tables` writes. Table 2: the planner beside MaxText's
published MFU (scripts/published_mfu.py), planned with the published slice, sequence length,
global batch and FSDP layout; rows whose layout titan_tpu cannot express (context parallelism) are
left out, and where the source states no layout or batch the config's own is used.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from titan_tpu.device.tpu_runtime import skip_tpu_backend_without_chips  # noqa: E402

skip_tpu_backend_without_chips()  # before anything imports torch (titan_tpu/device/tpu_runtime.py)

from published_mfu import PUBLISHED, PublishedResult  # noqa: E402

from titan_tpu.config import ConfigError, load_config  # noqa: E402
from titan_tpu.plan.chips import GIB, parse_chips  # noqa: E402
from titan_tpu.plan.planner import Plan, make_plan  # noqa: E402
from titan_tpu.training.registered_names import check_registered_names  # noqa: E402

# The page that holds the generated block. The tables moved from README.md to docs/planner.md; the name
# README stays, because tests/unit/plan/test_tables.py reads and monkeypatches `plan_tables.README`.
README = ROOT / "docs" / "planner.md"
BEGIN, END = "<!-- plan-tables:begin -->", "<!-- plan-tables:end -->"
# {"cpu", "date", "runs": {"config@chips": {"result": "stepped" or the rejection, "seconds"}}}.
DRY_RUNS = ROOT / "docs" / "benchmarks" / "dryrun_shipped.json"

# (config, chips): each model on one v6e and one TPU7x slice large enough for its layout.
SHIPPED: tuple[tuple[str, str], ...] = (
    ("llama3_8b", "v6e-64"),
    ("llama3_8b", "v7x-32"),
    ("llama3_70b", "v6e-256"),
    ("llama3_70b", "v7x-128"),
    ("llama3_405b", "v6e-1024"),
    ("llama3_405b", "v7x-512"),
    ("qwen3_8b", "v6e-64"),
    ("qwen3_8b", "v7x-32"),
    ("qwen3_32b", "v6e-128"),
    ("qwen3_32b", "v7x-64"),
    ("qwen3_moe_235b_a22b", "v6e-256"),
    ("qwen3_moe_235b_a22b", "v7x-128"),
    ("flux_dev", "v6e-64"),
    ("flux_dev", "v7x-32"),
)


def _plan(config_name: str, chips: str, overrides: list[str]) -> Plan:
    config = load_config(config_name, [*shipped_overrides(chips), *overrides])
    check_registered_names(config)
    return make_plan(config, parse_chips(chips))


def _cells(plan: Plan) -> str:
    fit = plan.fit
    memory = f"{fit.need / GIB:.1f} / {fit.usable / GIB:.1f}"
    return f"{'yes' if fit.fits else 'no'} | {memory} | {plan.step.step_s:.2f} s | {100 * plan.step.mfu:.0f}%"


def shipped_overrides(chips: str) -> list[str]:
    """A shipped config's overrides on `chips`: dp_replicate over the slices when there are several."""
    cluster = parse_chips(chips)
    return [f"--parallelism.dp_replicate={cluster.slices}"] if cluster.slices > 1 else []


def shipped_table() -> list[str]:
    dry_runs = json.loads(DRY_RUNS.read_text(encoding="utf-8"))["runs"] if DRY_RUNS.is_file() else {}
    lines = [
        "| config | chips | layout (devices) | fits | GiB per device (need / usable HBM) | step time | MFU | dry run |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for config_name, chips in SHIPPED:
        plan = _plan(config_name, chips, [])
        dry_run = dry_runs.get(f"{config_name}@{chips}", {}).get("result", "not run")
        lines.append(
            f"| `{config_name}` | {chips} | {plan.detail.layout.dims.describe()} | {_cells(plan)} | {dry_run} |"
        )
    return lines


def _published_overrides(result: PublishedResult) -> list[str] | None:
    """The published run as overrides, or None when titan_tpu has no such layout."""
    if "CP" in result.parallelism:
        return None
    overrides = [f"--training.seq_len={result.seq_len}"]
    if result.global_batch_tokens is not None:
        sequences = result.global_batch_tokens // result.seq_len
        overrides += [f"--training.global_batch_size={sequences}", "--training.local_batch_size=-1"]
    if result.parallelism.startswith("FSDP"):
        overrides += ["--parallelism.dp_shard=-1", "--parallelism.tp=1", "--parallelism.ep=1", "--parallelism.cp=1"]
    return overrides


def published_table() -> list[str]:
    lines = [
        "| config | chips | published layout | seq | MaxText MFU | planned layout | fits | GiB per device | "
        "step time | planned MFU |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for result in PUBLISHED:
        overrides = _published_overrides(result)
        if overrides is None:
            continue
        try:
            plan = _plan(result.model, result.chips, overrides)
        except ConfigError as error:  # e.g. a batch that does not divide over the devices
            lines.append(
                f"| `{result.model}` | {result.chips} | {result.parallelism} | {result.seq_len} | "
                f"{result.mfu_percent:.1f}% | not planned: {error} | | | | |"
            )
            continue
        lines.append(
            f"| `{result.model}` | {result.chips} | {result.parallelism} | {result.seq_len} | "
            f"[{result.mfu_percent:.1f}%]({result.source}) | {plan.detail.layout.dims.describe()} | {_cells(plan)} |"
        )
    return lines


def render() -> str:
    return "\n".join([BEGIN, *shipped_table(), "", *published_table(), END])


def readme_block(text: str) -> tuple[int, int]:
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"error: {README}: no {BEGIN} ... {END} block")
    return start, end + len(END)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the block in docs/planner.md differs")
    args = parser.parse_args(argv)
    text = README.read_text(encoding="utf-8")
    start, end = readme_block(text)
    block = render()
    if args.check:
        if text[start:end] != block:
            print(f"error: {README.name}: planner tables are stale; run scripts/plan_tables.py", file=sys.stderr)
            return 1
        return 0
    README.write_text(text[:start] + block + text[end:], encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
