"""Where the traced steps' time went: self time per op from a `[profiling]` Chrome trace.

    python scripts/trace_summary.py outputs/llama3_debug/profile_traces/rank0_steps3-4.json [--top 25]

A trace nests ranges (an op inside a module's range inside the step's `train_step N` range); an op's
self time is its duration minus the durations of the ranges directly inside it, so self times add up
to the traced time without counting anything twice. The step range's own self time is the time no op
covers (Python between ops). Prints the traced steps with their durations, then the ops with the
largest self time: milliseconds per step and share of the steps' time.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from titan_tpu.device.tpu_runtime import skip_tpu_backend_without_chips  # noqa: E402

skip_tpu_backend_without_chips()  # before anything imports torch (titan_tpu/device/tpu_runtime.py)

from titan_tpu.metrics.profiler import STEP_RANGE  # noqa: E402

# Host-side ranges: ops, and the record_function ranges around them (steps, modules, the optimizer).
HOST_CATEGORIES = ("cpu_op", "user_annotation")
# What the steps' own self time is: no op covers it.
BETWEEN_OPS = "(between ops: Python)"


def self_times(events: list[dict[str, Any]]) -> dict[str, float]:
    """Op name -> summed self time (the trace's unit, microseconds) over the complete ("X") host
    events, nesting resolved per thread."""
    by_thread: dict[tuple[Any, Any], list[dict[str, Any]]] = defaultdict(list)
    for event in events:
        if event.get("ph") == "X" and event.get("cat") in HOST_CATEGORIES:
            by_thread[(event["pid"], event["tid"])].append(event)
    totals: dict[str, float] = defaultdict(float)
    for thread_events in by_thread.values():
        # Parents first: at one start time the longer range holds the shorter.
        thread_events.sort(key=lambda e: (e["ts"], -e["dur"]))
        open_ranges: list[dict[str, Any]] = []
        for event in thread_events:
            while open_ranges and open_ranges[-1]["ts"] + open_ranges[-1]["dur"] <= event["ts"]:
                open_ranges.pop()
            if open_ranges:
                parent = open_ranges[-1]["name"]
                totals[BETWEEN_OPS if parent.startswith(f"{STEP_RANGE} ") else parent] -= event["dur"]
            name = BETWEEN_OPS if event["name"].startswith(f"{STEP_RANGE} ") else event["name"]
            totals[name] += event["dur"]
            open_ranges.append(event)
    return dict(totals)


def summary(trace: dict[str, Any], top: int) -> list[str]:
    events = trace["traceEvents"]
    steps = [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith(f"{STEP_RANGE} ")]
    if not steps:
        raise ValueError(f"no '{STEP_RANGE} N' ranges: not a trace of titan_tpu's [profiling]")
    traced = sum(step["dur"] for step in steps)
    lines = [f"{step['name']}: {step['dur'] / 1e3:.1f} ms" for step in steps]
    lines.append(f"{'op':<60} {'ms/step':>10} {'share':>7}")
    ranked = sorted(self_times(events).items(), key=lambda item: -item[1])[:top]
    for name, micros in ranked:
        label = name if len(name) <= 60 else name[:57] + "..."
        lines.append(f"{label:<60} {micros / 1e3 / len(steps):>10.2f} {100 * micros / traced:>6.1f}%")
    return lines


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", type=Path)
    parser.add_argument("--top", type=int, default=25)
    opts = parser.parse_args(argv)
    try:
        trace = json.loads(opts.trace.read_text())
        lines = summary(trace, opts.top)
    except (OSError, ValueError, KeyError) as error:
        print(f"trace_summary: {opts.trace}: {error}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
