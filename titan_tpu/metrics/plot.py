"""Charts as PNG files: the loss of one or several runs (their `metrics.jsonl`) against the step and
against the items seen, and benchmark records (`scripts/bench.py`) as throughput and MFU bars.

The run draws `<dump_folder>/loss.png` at its end with `write_run_loss_chart`; `scripts/plot.py` draws
the same chart for any runs, and the benchmark chart. Figures are made with matplotlib's object API
and its Agg canvas, never pyplot: no display, and no backend switched under a caller's feet.
matplotlib is imported only when a chart is drawn (it costs most of a second), not with the trainer.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from titan_tpu.config.errors import ConfigError
from titan_tpu.metrics.logger import METRICS_FILE

LOSS_CHART = "loss.png"
VALIDATION_LOSS = "validation/loss"  # the held-out loss a record carries when [validation] ran
RATE_SUFFIX = "_per_sec"  # a step record's throughput key: tokens_per_sec, samples_per_sec
BENCH_RATE_SUFFIX = "_per_sec_per_process"  # a benchmark record's


def read_jsonl(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """(line number, JSON object) for each line of a JSON-lines file (blank lines skipped); a
    ConfigError names the file and line of the first one that is not an object."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot be read ({e})") from None
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            raise ConfigError(f"{path} line {number}: not a JSON record ({e})") from None
        if not isinstance(record, dict):
            raise ConfigError(f"{path} line {number}: not a JSON record (a {type(record).__name__})")
        records.append((number, record))
    return records


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """A run's step records ordered by step. A resumed run appends to the same file and may repeat
    steps an earlier attempt logged after its last checkpoint: the later record of a step wins."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    by_step: dict[int, dict[str, Any]] = {}
    for number, record in read_jsonl(path):
        rate = _rate_key(record)
        if not all(_is_number(record.get(key)) for key in ("step", "loss", "step_time_s", rate)):
            raise ConfigError(
                f"{path} line {number}: not a step record (needs numbers step, loss, step_time_s and a "
                f"<unit>{RATE_SUFFIX}; has {sorted(record)})"
            )
        by_step[int(record["step"])] = record
    if not by_step:
        raise ConfigError(f"{path}: no step records")
    return [by_step[step] for step in sorted(by_step)]


def _rate_key(record: dict[str, Any]) -> str:
    """The trainer's throughput key of a step record: the first `<unit>_per_sec`, since a task's own
    rates come after it (GRPO adds train_tokens_per_sec and rollout_tokens_per_sec); "" if none."""
    return next((key for key in record if key.endswith(RATE_SUFFIX)), "")


def unit_of(records: Sequence[dict[str, Any]]) -> str:
    """What the run counts ("tokens", "samples"), from its throughput key."""
    return _rate_key(records[0]).removesuffix(RATE_SUFFIX)


def items_seen(records: Sequence[dict[str, Any]], processes: int | None) -> list[float]:
    """Cumulative items trained on at each record. A record's throughput is per process over the
    steps since the previous record, so rate x step time x steps is one process's share of them;
    times the process count it is the run's total (exact when every rank trains on as many items,
    as language-model and FLUX batches do). Without a process count it stays per process."""
    rate_key = f"{unit_of(records)}{RATE_SUFFIX}"
    seen, total, previous_step = [], 0.0, 0
    for record in records:
        steps = record["step"] - previous_step
        total += record[rate_key] * record["step_time_s"] * steps * (processes or 1)
        seen.append(total)
        previous_step = record["step"]
    return seen


def _figure(width: float, height: float) -> Any:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def draw_loss_chart(runs: Sequence[tuple[str, list[dict[str, Any]]]], out: Path, processes: int | None = None) -> Path:
    """Loss against step (left) and against items seen (right), one line per `(label, records)`;
    where records carry a held-out loss, it is drawn dashed in its run's colour on the same axes."""
    figure = loss_figure(runs, processes)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=100)
    return out


def loss_figure(runs: Sequence[tuple[str, list[dict[str, Any]]]], processes: int | None = None) -> Any:
    """The matplotlib Figure `draw_loss_chart` saves."""
    from matplotlib.ticker import EngFormatter, MaxNLocator

    units = sorted({unit_of(records) for _, records in runs})
    if len(units) > 1:
        raise ConfigError(f"the runs count different items ({', '.join(units)}); plot them separately")
    unit = units[0]
    figure = _figure(10, 4)
    by_step, by_items = figure.subplots(1, 2)
    validated = False
    for label, records in runs:
        losses = [r["loss"] for r in records]
        seen = items_seen(records, processes)
        # A single run's lines are named by what they are; several runs' by the run.
        train_label = label if len(runs) > 1 else "training"
        (line,) = by_step.plot([r["step"] for r in records], losses, marker=".", label=train_label)
        by_items.plot(seen, losses, marker=".", label=train_label, color=line.get_color())
        held_out = [(r, x) for r, x in zip(records, seen) if _is_number(r.get(VALIDATION_LOSS))]
        if held_out:
            validated = True
            values = [r[VALIDATION_LOSS] for r, _ in held_out]
            style = {"marker": "o", "linestyle": "--", "color": line.get_color()}
            name = f"{label} validation" if len(runs) > 1 else "validation"
            by_step.plot([r["step"] for r, _ in held_out], values, label=name, **style)
            by_items.plot([x for _, x in held_out], values, label=name, **style)
    by_step.set_xlabel("step")
    by_step.xaxis.set_major_locator(MaxNLocator(integer=True))
    if processes is None:
        seen_label = f"{unit} seen per process"
    else:
        seen_label = f"{unit} seen" + (f" (all {processes} processes)" if processes > 1 else "")
    by_items.set_xlabel(seen_label)
    by_items.xaxis.set_major_formatter(EngFormatter())  # 400k, not 400000 crowding its neighbours
    for axes in (by_step, by_items):
        axes.set_ylabel("loss")
        axes.grid(alpha=0.3)
    if len(runs) > 1 or validated:
        by_step.legend()
    if len(runs) == 1:
        figure.suptitle(_run_title(*runs[0]))
    return figure


def _run_title(label: str, records: list[dict[str, Any]]) -> str:
    first, last = records[0], records[-1]
    title = f"{label}: loss {first['loss']:.3f} at step {first['step']} -> {last['loss']:.3f} at step {last['step']}"
    held_out = [r for r in records if _is_number(r.get(VALIDATION_LOSS))]
    if held_out:
        title += f"; validation {held_out[-1][VALIDATION_LOSS]:.3f} at step {held_out[-1]['step']}"
    return title


def write_run_loss_chart(dump_folder: Path, processes: int) -> Path:
    """`<dump_folder>/loss.png` from the run's own `metrics.jsonl`."""
    dump_folder = Path(dump_folder)
    records = read_metrics(dump_folder / METRICS_FILE)
    return draw_loss_chart([(dump_folder.name, records)], dump_folder / LOSS_CHART, processes)


def read_bench(paths: Sequence[Path]) -> list[dict[str, Any]]:
    """Benchmark records from JSON-lines files, or every `*.jsonl` in a folder."""
    files: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            found = sorted(path.glob("*.jsonl"))
            if not found:
                raise ConfigError(f"{path}: no *.jsonl benchmark files")
            files += found
        else:
            files.append(path)
    records = []
    for file in files:
        for number, record in read_jsonl(file):
            measured = any(key.endswith(BENCH_RATE_SUFFIX) for key in record)
            if not measured and "skipped" not in record and "failed" not in record:
                raise ConfigError(
                    f"{file} line {number}: not a benchmark record (needs <unit>{BENCH_RATE_SUFFIX}, "
                    f"'skipped' or 'failed'; has {sorted(record)})"
                )
            records.append(record)
    return records


def case_name(record: dict[str, Any]) -> str:
    """The matrix's case name, or for a single run its config and process count."""
    return str(record.get("case") or f"{record.get('config')} x{record.get('processes')}")


def draw_bench_chart(records: Sequence[dict[str, Any]], out: Path) -> Path:
    """Per measured case: throughput per process (left, labelled with its unit) and MFU (right).
    Skipped and failed cases are listed under the chart, not drawn."""
    measured = [r for r in records if "skipped" not in r and "failed" not in r]
    if not measured:
        raise ConfigError("no measured benchmark records (every case was skipped or failed)")
    names = [case_name(r) for r in measured]
    rates, units = [], []
    for record in measured:
        key = next(key for key in record if key.endswith(BENCH_RATE_SUFFIX))
        rates.append(record[key])
        units.append(key.removesuffix(BENCH_RATE_SUFFIX))
    mfu = [r.get("mfu_percent") for r in measured]
    figure = _figure(max(6.0, 1.1 * len(measured) + 3), 4.5)
    throughput, utilisation = figure.subplots(1, 2)
    positions = range(len(measured))
    throughput.bar(positions, rates, color="tab:blue")
    for x, rate, unit in zip(positions, rates, units):
        throughput.annotate(f"{rate:.0f} {unit}/s", (x, rate), ha="center", va="bottom", fontsize=7)
    # FLUX counts samples, language models tokens: a log axis keeps both readable side by side.
    if min(rates) > 0 and max(rates) / min(rates) > 100:
        throughput.set_yscale("log")
    throughput.set_ylabel("items/s per process")
    utilisation.bar(positions, [m if m is not None else 0.0 for m in mfu], color="tab:orange")
    for x, value in zip(positions, mfu):
        text = f"{value:.1f}%" if value is not None else "n/a"
        utilisation.annotate(text, (x, value or 0.0), ha="center", va="bottom", fontsize=7)
    utilisation.set_ylabel("MFU (%)")
    for axes in (throughput, utilisation):
        axes.set_xticks(list(positions), names, rotation=45, ha="right", fontsize=7)
        axes.grid(axis="y", alpha=0.3)
    left_out = [f"{case_name(r)}: {r.get('skipped') or r.get('failed')}" for r in records if r not in measured]
    if left_out:
        figure.suptitle(f"not measured: {'; '.join(left_out)}"[:200], fontsize=7)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=100)
    return out
