"""`scripts/bench.py --kernels`: a config's training throughput with each kernel candidate forced in
turn, beside what "auto" picked, for every dtype the machine computes natively.

    python scripts/bench.py --kernels --config llama3_debug --steps 10 --repeats 3

Each run is a fresh Trainer in this process, timed like bench.py's single-run mode. A shared CPU's
speed drifts by 10-20% over minutes, more than the kernels differ, so the runs are interleaved
(auto, every candidate, then again) `repeats` times and the medians compared. One JSON line per run,
then a Markdown table: per dtype and kernel field, every candidate's median tokens/s and MFU, auto's
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
    for dtype in native_dtypes():
        base = ["--metrics.log_freq=1000000", *overrides, f"--training.dtype={dtype}"]
        first = _run(measure, config, steps, warmup, base, None)
        rate_key = next(k for k in first if k.endswith("_per_sec_per_process"))
        forced = {(f, name): [*base, override_of[f](name)] for f, names in first["kernel_candidates"].items()
                  for name in names}  # fmt: skip
        runs: dict[Any, list[dict[str, Any]]] = {"auto": [first], **{key: [] for key in forced}}
        for repeat in range(repeats):
            if repeat > 0:
                runs["auto"].append(_run(measure, config, steps, warmup, base, None))
            for key, run_overrides in forced.items():
                runs[key].append(_run(measure, config, steps, warmup, run_overrides, dict([key])))
        rate = {key: statistics.median(r[rate_key] for r in records) for key, records in runs.items()}
        mfu = {key: statistics.median(r["mfu_percent"] or 0.0 for r in records) for key, records in runs.items()}
        for field in first["kernel_candidates"]:
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
