"""`scripts/bench.py --kernels`: a config's training throughput with each kernel candidate forced in
turn, beside what "auto" picked, for every dtype the machine computes natively.

    python scripts/bench.py --kernels --config llama3_debug --steps 10

Each run is a fresh Trainer in this process, timed like bench.py's single-run mode. One JSON line per
run, then a Markdown table: per dtype and kernel field, every candidate's tokens/s, auto's pick and
its tokens/s as a share of the fastest forced candidate's.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

Measure = Callable[[str, int, int, list[str]], "dict[str, Any] | None"]


def native_dtypes() -> list[str]:
    from titan_tpu.device import native_bf16, resolve_device_type

    return ["float32", "bfloat16"] if native_bf16(resolve_device_type("auto")) else ["float32"]


def kernel_table(config: str, steps: int, warmup: int, overrides: list[str], measure: Measure) -> int:
    from titan_tpu import models
    from titan_tpu.config import load_config

    spec = models.get_model_spec(load_config(config, overrides).model.name)
    forced_by_field = {t.field: t.config_override for t in spec.tunables}
    quiet = ["--metrics.log_freq=1000000", *overrides]
    rows: list[str] = []
    for dtype in native_dtypes():
        base = [*quiet, f"--training.dtype={dtype}"]
        auto = measure(config, steps, warmup, base)
        assert auto is not None, "single process: this rank writes"
        print(json.dumps({"forced": None, **auto}), flush=True)
        rate_key = next(k for k in auto if k.endswith("_per_sec_per_process"))
        for field, candidates in auto["kernel_candidates"].items():
            rates: dict[str, float] = {}
            for name in candidates:
                forced = measure(config, steps, warmup, [*base, forced_by_field[field](name)])
                assert forced is not None
                print(json.dumps({"forced": {field: name}, **forced}), flush=True)
                rates[name] = forced[rate_key]
            pick, best = auto["kernels"][field], max(rates.values())
            cells = ", ".join(f"{name} {rate:.0f}" for name, rate in rates.items())
            rows.append(
                f"| {config} | {dtype} | {field} | {cells} | {pick} | {auto[rate_key]:.0f} "
                f"| {100 * auto[rate_key] / best:.0f}% |"
            )
    print(f"\n| config | dtype | kernel | forced: {rate_key} | auto picks | auto | auto / fastest |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 0
