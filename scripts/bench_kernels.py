"""`scripts/bench.py --kernels`: a config's training throughput with each kernel candidate forced in
turn, beside what "auto" picked, for every dtype the machine computes natively (or the one
`--training.dtype=D` names).

    python scripts/bench.py --kernels --config llama3_debug --steps 10 --repeats 3

Each run is a fresh Trainer in this process, timed like bench.py's single-run mode. A shared CPU's
speed drifts by 10-20% over minutes, more than the kernels differ, so the runs are interleaved
(auto, every candidate, then again, each round starting one run later) `repeats` times after one
uncounted run, and the medians compared. One JSON line per run, then a Markdown table: per dtype and kernel field, every candidate's median tokens/s and MFU, auto's
pick, and auto's medians as a share of the fastest forced candidate's. The MFU ratio is the one that
survives drift: each run's MFU is against a matmul peak probed in the same process right after its
timed steps, so a run that met a slower machine is judged against a slower peak.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from typing import Any

Measure = Callable[[str, int, int, list[str]], "dict[str, Any] | None"]


def native_dtypes() -> list[str]:
    from titan_tpu.device import native_bf16, resolve_device_type

    return ["float32", "bfloat16"] if native_bf16(resolve_device_type("auto")) else ["float32"]


def _run(measure: Measure, config: str, steps: int, warmup: int, overrides: list[str], label: Any) -> dict[str, Any]:
    record = measure(config, steps, warmup, overrides)
    assert record is not None, "one process: this rank writes"
    print(json.dumps({"forced": label, **record}), flush=True)
    return record


def kernel_table(config: str, steps: int, warmup: int, repeats: int, overrides: list[str], measure: Measure) -> int:
    from titan_tpu import models
    from titan_tpu.config import load_config

    spec = models.get_model_spec(load_config(config, overrides).model.name)
    override_of = {t.field: t.config_override for t in spec.tunables}
    rows: list[str] = []
    # A dtype the command forces is the one measured; else every dtype the machine computes natively.
    forced_dtypes = [o.split("=", 1)[1] for o in overrides if o.startswith("--training.dtype=")]
    for dtype in forced_dtypes[-1:] or native_dtypes():
        base = ["--metrics.log_freq=1000000", *overrides, f"--training.dtype={dtype}"]
        # Learns the candidates, and is not counted: a process's first run pays one-time costs
        # (allocator, thread pool, the measurement itself) that no forced run would pay.
        first = _run(measure, config, steps, warmup, base, "auto (not counted)")
        rate_key = next(k for k in first if k.endswith("_per_sec_per_process"))
        # Fields with one candidate (or forced by the overrides) have nothing to compare.
        measured = {f: names for f, names in first["kernel_candidates"].items() if len(names) > 1}
        forced = {(f, name): [*base, override_of[f](name)] for f, names in measured.items() for name in names}
        order: list[Any] = ["auto", *forced]
        runs: dict[Any, list[dict[str, Any]]] = {key: [] for key in order}
        for repeat in range(repeats):
            # Each round starts one run later, so no configuration always meets the same moment
            # of the machine's drift.
            shift = repeat % len(order)
            for key in order[shift:] + order[:shift]:
                run_overrides, label = (base, None) if key == "auto" else (forced[key], dict([key]))
                runs[key].append(_run(measure, config, steps, warmup, run_overrides, label))
        rate = {key: statistics.median(r[rate_key] for r in records) for key, records in runs.items()}
        mfu = {key: statistics.median(r["mfu_percent"] or 0.0 for r in records) for key, records in runs.items()}
        for field in measured:
            mine = [key for key in forced if key[0] == field]
            cells = ", ".join(f"{name} {rate[(field, name)]:.0f} ({mfu[(field, name)]:.1f}%)" for _, name in mine)
            rows.append(
                f"| {config} | {dtype} | {field} | {cells} | {first['kernels'][field]} "
                f"| {rate['auto']:.0f} ({mfu['auto']:.1f}%) | {100 * rate['auto'] / max(rate[k] for k in mine):.0f}% "
                f"| {100 * mfu['auto'] / max(mfu[k] for k in mine):.0f}% |"
            )
    print(f"\n{repeats} interleaved repeats of {steps} steps each, medians:")
    print(f"| config | dtype | kernel | forced: {rate_key} (MFU) | auto picks | auto | auto / fastest "
          "| auto / fastest, by MFU |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 0
