"""Training throughput of a config: one JSON line with tokens/s (or samples/s), TFLOP/s, MFU and peak memory.

    python scripts/bench.py --config llama3_debug --steps 20 [--section.key=value ...]
    python scripts/bench.py --config llama3_debug --nproc 1,2,4 --parallelism.dp_shard=-1

The peak behind MFU is the device's table entry, or on a CPU a matmul probe run in this same process
just before the timed steps, so MFU compares like with like. With --nproc, the script re-launches
itself under torchrun for each process count and adds the scaling efficiency (tokens/s per process
relative to one process).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from titan_tpu.config import ConfigError, load_config  # noqa: E402


def measure(config_name: str, steps: int, warmup: int, overrides: list[str]) -> dict[str, object] | None:
    """Time `steps` optimizer steps after `warmup` untimed ones; returns the record on rank 0."""
    import torch

    from titan_tpu.device import host_peak_flops
    from titan_tpu.trainer import Trainer

    config = load_config(config_name, [f"--training.steps={steps + warmup}", *overrides])
    trainer = Trainer(config)
    try:
        for _ in range(warmup):
            trainer.train_step()
        trainer.device.synchronize()
        trainer.device.reset_peak_memory()
        items = 0
        start = time.perf_counter()
        for _ in range(steps):
            loss, _, step_items = trainer.train_step()
            items += step_items
        trainer.device.synchronize()
        elapsed = time.perf_counter() - start
        # Re-measure the peak now, under the same threads and memory state as the timed steps.
        peak = host_peak_flops(trainer.device, trainer.compute_dtype)
        items_per_sec, flops_per_sec = trainer.rates(items, elapsed)
        unit = trainer.task.unit
        record = {
            "config": config_name,
            "model": f"{config.model.name}/{config.model.flavor}",
            "processes": trainer.process.world_size,
            "device": trainer.device.name(),
            "dtype": config.training.dtype,
            "threads": torch.get_num_threads(),
            "steps": steps,
            f"{unit}_per_sec_per_process": round(items_per_sec, 1),
            "tflops_per_process": round(flops_per_sec / 1e12, 4),
            "peak_tflops": round(peak / 1e12, 4) if peak else None,
            "mfu_percent": round(100 * flops_per_sec / peak, 2) if peak else None,
            "peak_memory_gib": round(trainer.device.peak_memory_gib(), 3),
            "step_time_s": round(elapsed / steps, 4),
            "final_loss": round(float(loss), 4),
        }
        return record if trainer.is_writer else None
    finally:
        trainer.metrics.close()
        trainer.close()


def scaling(config_name: str, counts: list[int], passthrough: list[str]) -> None:
    """Run this script under torchrun for each process count; print each line, then the efficiency."""
    results = []
    for count in counts:
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={count}",
            __file__, "--config", config_name, *passthrough,
        ]
        # Each process gets an equal share of the cores, as on a multi-chip host.
        env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // count)))
        output = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
        record = json.loads(output.strip().splitlines()[-1])
        print(json.dumps(record), flush=True)
        results.append(record)
    rate = next(key for key in results[0] if key.endswith("_per_sec_per_process"))
    base = results[0][rate] * results[0]["processes"]
    summary = {
        "scaling": {str(r["processes"]): round(r[rate] * r["processes"] / base, 3) for r in results},
        "meaning": f"total {rate.removesuffix('_per_sec_per_process')}/s relative to the first process count",
    }
    print(json.dumps(summary))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--config", default="llama3_debug")
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--nproc", default="", help="comma-separated process counts, e.g. 1,2,4")
    args, overrides = parser.parse_known_args()
    try:
        if args.nproc:
            passthrough = [f"--steps={args.steps}", f"--warmup={args.warmup}", *overrides]
            scaling(args.config, [int(n) for n in args.nproc.split(",")], passthrough)
            return 0
        record = measure(args.config, args.steps, args.warmup, ["--metrics.log_freq=1000000", *overrides])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if record is not None:
        print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
