"""Training throughput of a config: one JSON line with tokens/s (or samples/s), TFLOP/s, MFU and peak memory.

    python scripts/bench.py --config llama3_debug --steps 20 [--section.key=value ...]
    python scripts/bench.py --config llama3_debug --nproc 1,2,4 --parallelism.dp_shard=-1
    python scripts/bench.py --matrix llama3_debug,qwen3_moe_debug --layouts 1,fsdp2,tp2xfsdp2,fsdp4xep2 \
        --steps 10 --out bench_results/

The peak behind MFU is the device's table entry, or on a CPU a matmul probe run in this same process
after every timed step: MFU is the median over the steps of each step's FLOP/s against the probe
beside it, so a shared CPU's drift between minutes does not set a whole run against one lucky or
unlucky probe. Tokens/s and TFLOP/s are over the timed steps alone (the probes excluded). With
--nproc, the script re-launches itself under torchrun for each process count and adds the scaling
efficiency (tokens/s per process relative to one process).

--matrix runs every (config x layout) case, each in its own process(es), and writes one JSON line per
case to <out>/bench.jsonl as it finishes (one file to plot and compare, in the format of metrics.jsonl;
a matrix stopped midway keeps the cases it finished). A layout names the degrees of the parallelism
axes joined by "x": dp (dp_replicate), fsdp (dp_shard), tp, ep (carved from fsdp), cp, pp, e.g.
fsdp4, tp2xfsdp2, fsdp4xep2, pp2xfsdp2; "1" is one process. Its process count is
dp x fsdp x tp x cp x pp. A case the config
cannot run (an ep that does not divide the experts, tp on a model without a tensor-parallel plan) is
recorded as skipped with the reason; a case that crashes as failed, with its log in <out>/logs/.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from titan_tpu.device.tpu_runtime import skip_tpu_backend_without_chips  # noqa: E402

skip_tpu_backend_without_chips()  # before anything imports torch (titan_tpu/device/tpu_runtime.py)

from scripts.bench_kernels import kernel_table  # noqa: E402
from titan_tpu.config import ConfigError, load_config  # noqa: E402


def measure(config_name: str, steps: int, warmup: int, overrides: list[str]) -> dict[str, object] | None:
    """Time `steps` optimizer steps after `warmup` untimed ones; returns the record on rank 0."""
    import torch

    from titan_tpu.device import host_peak_flops
    from titan_tpu.training.record_window import mean_over_data_parallel
    from titan_tpu.training.trainer import Trainer

    config = load_config(config_name, [f"--training.steps={steps + warmup}", *overrides])
    trainer = Trainer(config)
    try:
        start = time.perf_counter()
        for _ in range(warmup):
            trainer.train_step()
        trainer.device.synchronize()
        warmup_s = time.perf_counter() - start  # with compile.enable, mostly compiling
        trainer.device.reset_peak_memory()
        items, seconds, peaks, mfus = 0, [], [], []
        for _ in range(steps):
            start = time.perf_counter()
            loss, _, step_items = trainer.train_step()
            trainer.device.synchronize()
            seconds.append(time.perf_counter() - start)
            items += step_items
            # The peak probed right after each step (the device's table entry on accelerators), under
            # the same threads and memory state: a shared CPU's speed drifts by 10-20% over minutes,
            # so each step is set against the probe beside it, and MFU is the median of those.
            peaks.append(host_peak_flops(trainer.device, trainer.compute_dtype, fresh=True))
            if peaks[-1]:
                mfus.append(100 * trainer.rates(step_items, seconds[-1])[1] / peaks[-1])
        elapsed = sum(seconds)
        peak = statistics.median(peaks) if all(peaks) else None
        items_per_sec, flops_per_sec = trainer.rates(items, elapsed)
        unit = trainer.task.unit
        # Every rank takes part (a collective): under pp the writer (rank 0) holds the first stage,
        # which computes no loss, and gets the last stage's through the sum over stages.
        (final_loss,) = mean_over_data_parallel([loss], trainer.parallel)
        record = {
            "config": config_name,
            "model": f"{config.model.name}/{config.model.flavor}",
            "processes": trainer.process.world_size,
            "device": trainer.device.name(),
            "dtype": trainer.resolved.compute_dtype,
            "threads": torch.get_num_threads(),
            "steps": steps,
            f"{unit}_per_sec_per_process": round(items_per_sec, 1),
            "tflops_per_process": round(flops_per_sec / 1e12, 4),
            "peak_tflops": round(peak / 1e12, 4) if peak else None,
            "mfu_percent": round(statistics.median(mfus), 2) if peak else None,
            "peak_memory_gib": round(trainer.device.peak_memory_gib(), 3),
            "step_time_s": round(elapsed / steps, 4),
            "warmup_s": round(warmup_s, 2),
            "final_loss": round(final_loss, 4),  # the mean over data-parallel ranks
            # What each "auto" kernel became, and among which candidates (titan_tpu/autotune/).
            "kernels": {choice.field: choice.pick for choice in trainer.kernels},
            "kernel_candidates": {choice.field: list(choice.times_ms) for choice in trainer.kernels},
            "kernel_sources": {choice.field: choice.source for choice in trainer.kernels},
        }
        return record if trainer.is_writer else None
    finally:
        trainer.metrics.close()
        trainer.close()


class TimedTrainer:
    """A Trainer stepped one timed optimizer step at a time (`--kernels`, scripts/bench_kernels.py)."""

    def __init__(self, config_name: str, overrides: list[str]) -> None:
        from titan_tpu.training.trainer import Trainer

        self.trainer = Trainer(load_config(config_name, overrides))
        self.kernels = {choice.field: choice.pick for choice in self.trainer.kernels}
        self.kernel_candidates = {choice.field: list(choice.times_ms) for choice in self.trainer.kernels}
        self.kernel_sources = {choice.field: choice.source for choice in self.trainer.kernels}
        self.items_per_step = 0
        self.flops_per_step = 0.0

    def step_seconds(self) -> float:
        device = self.trainer.device
        device.synchronize()
        start = time.perf_counter()
        _, _, self.items_per_step = self.trainer.train_step()
        device.synchronize()
        seconds = time.perf_counter() - start
        self.flops_per_step = self.trainer.rates(self.items_per_step, 1.0)[1]
        return seconds

    def peak_flops(self) -> float | None:
        """The device's peak for this run's dtype; on a CPU, probed now (titan_tpu/device/peak.py)."""
        from titan_tpu.device import host_peak_flops

        return host_peak_flops(self.trainer.device, self.trainer.compute_dtype, fresh=True)

    def close(self) -> None:
        self.trainer.metrics.close()
        self.trainer.close()


def launch(
    config_name: str, processes: int, passthrough: list[str], timeout: float | None = None
) -> subprocess.CompletedProcess[str]:
    """This script's single-run mode in `processes` processes (under torchrun when more than one)."""
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
    command = [*(run if processes > 1 else [sys.executable]), __file__, "--config", config_name, *passthrough]
    # Each process gets an equal share of the cores, as on a multi-chip host.
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // processes)))
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)


def scaling(config_name: str, counts: list[int], passthrough: list[str]) -> None:
    """Run this script for each process count; print each line, then the efficiency."""
    results = []
    for count in counts:
        result = launch(config_name, count, passthrough)
        result.check_returncode()
        record = json.loads(result.stdout.strip().splitlines()[-1])
        print(json.dumps(record), flush=True)
        results.append(record)
    rate = next(key for key in results[0] if key.endswith("_per_sec_per_process"))
    base = results[0][rate] * results[0]["processes"]
    summary = {
        "scaling": {str(r["processes"]): round(r[rate] * r["processes"] / base, 3) for r in results},
        "meaning": f"total {rate.removesuffix('_per_sec_per_process')}/s relative to the first process count",
    }
    print(json.dumps(summary))


# Layout axis names -> [parallelism] keys.
AXES = {"dp": "dp_replicate", "fsdp": "dp_shard", "tp": "tp", "ep": "ep", "cp": "cp", "pp": "pp"}
LAYOUT_HELP = (
    "axes with degrees joined by 'x' (dp = dp_replicate, fsdp = dp_shard, tp, ep, cp, pp), e.g. fsdp4, "
    "tp2xfsdp2, fsdp4xep2, pp2xfsdp2; or 1 for one process"
)
RESULTS_FILE = "bench.jsonl"


@dataclass(frozen=True)
class Layout:
    """One parallelism layout of the matrix: every degree is set, so a config's own [parallelism]
    degrees never leak into a case."""

    name: str
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    ep: int = 1
    cp: int = 1
    pp: int = 1

    @property
    def processes(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.cp * self.pp  # ep is carved out of dp_shard

    def degrees(self) -> dict[str, int]:
        return {key: getattr(self, key) for key in AXES.values()}

    def overrides(self) -> list[str]:
        return [f"--parallelism.{key}={value}" for key, value in self.degrees().items()]


def parse_layout(text: str) -> Layout:
    if text == "1":
        return Layout("1")
    degrees: dict[str, int] = {}
    for part in text.split("x"):
        match = re.fullmatch(r"(dp|fsdp|tp|ep|cp|pp)([1-9][0-9]*)", part)
        if match is None or AXES[match[1]] in degrees:
            raise ConfigError(f"--layouts: '{text}' is not a layout; write {LAYOUT_HELP}")
        degrees[AXES[match[1]]] = int(match[2])
    return Layout(text, **degrees)


def parse_layouts(text: str) -> list[Layout]:
    return [parse_layout(item.strip()) for item in text.split(",") if item.strip()]


def case_problem(config_name: str, layout: Layout, passthrough: list[str]) -> str | None:
    """Why the case cannot run, when the config and the degrees alone tell (no process is started);
    rules that need the model built (ep against the experts, tp against the heads, a model without a
    tensor-parallel plan) are reported by the case's own run."""
    from titan_tpu.distributed.parallel_dims import ParallelDims

    try:
        config = load_config(config_name, [*layout.overrides(), *passthrough])
        ParallelDims.from_config(config.parallelism, layout.processes)
    except ConfigError as e:
        return str(e)
    return None


def run_case(config_name: str, layout: Layout, args: argparse.Namespace, overrides: list[str]) -> dict[str, object]:
    """One case's record: measured, skipped (with the reason) or failed (with its log)."""
    case = f"{config_name}/{layout.name}"
    header: dict[str, object] = {
        "case": case,
        "config": config_name,
        "layout": layout.name,
        "parallelism": layout.degrees(),
        "processes": layout.processes,
    }
    # Each case writes its resolved config beside the results instead of into the config's outputs.
    passthrough = [*layout.overrides(), f"--job.dump_folder={args.out / 'runs' / case.replace('/', '_')}", *overrides]
    problem = case_problem(config_name, layout, passthrough)
    if problem is not None:
        return {**header, "skipped": problem}
    try:
        result = launch(
            config_name,
            layout.processes,
            [f"--steps={args.steps}", f"--warmup={args.warmup}", *passthrough],
            timeout=args.case_timeout,
        )
    except subprocess.TimeoutExpired:
        return {**header, "failed": f"no result within --case-timeout {args.case_timeout:.0f} s"}
    if result.returncode == 0:
        return {**header, **json.loads(result.stdout.strip().splitlines()[-1])}
    # A ConfigError in any process is printed as `error: ...` and means the config cannot run the case.
    errors = [line.removeprefix("error: ") for line in result.stderr.splitlines() if line.startswith("error: ")]
    if errors:
        return {**header, "skipped": errors[0]}
    log = args.out / "logs" / f"{case.replace('/', '_')}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(result.stdout + result.stderr, encoding="utf-8")
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    last = next((line for line in reversed(lines) if "Error" in line), lines[-1] if lines else "no output")
    return {**header, "failed": f"exit code {result.returncode}: {last.strip()} (log: {log})"}


def matrix(args: argparse.Namespace, overrides: list[str]) -> int:
    """Every (config x layout) case, one JSON line each to stdout and <out>/bench.jsonl."""
    configs = [name.strip() for name in args.matrix.split(",") if name.strip()]
    layouts = parse_layouts(args.layouts or "1")
    from titan_tpu.training.registered_names import check_registered_names

    for name in configs:
        # A misspelled config, override, model or task name stops here, before any case runs.
        check_registered_names(load_config(name, overrides))
    args.out.mkdir(parents=True, exist_ok=True)
    failed = 0
    with open(args.out / RESULTS_FILE, "w", encoding="utf-8") as results:
        for name in configs:
            for layout in layouts:
                record = run_case(name, layout, args, overrides)
                failed += "failed" in record
                line = json.dumps(record)
                results.write(line + "\n")
                results.flush()
                print(line, flush=True)
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--config", default="llama3_debug")
    parser.add_argument("--steps", type=int, default=20, help="timed steps (--kernels: interleaved rounds)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--nproc", default="", help="comma-separated process counts, e.g. 1,2,4")
    parser.add_argument("--matrix", default="", help="comma-separated configs, run for every layout")
    parser.add_argument("--layouts", default="", help=f"comma-separated layouts for --matrix: {LAYOUT_HELP}")
    parser.add_argument("--out", type=Path, default=Path("bench_results"), help="--matrix writes <out>/bench.jsonl")
    parser.add_argument("--kernels", action="store_true", help="every kernel candidate forced in turn, beside auto")
    parser.add_argument("--case-timeout", type=float, default=3600.0, help="seconds one --matrix case may take")
    args, overrides = parser.parse_known_args()
    try:
        if args.layouts and not args.matrix:
            raise ConfigError("--layouts: only with --matrix CONFIGS")
        if args.matrix:
            return matrix(args, overrides)
        if args.kernels:
            return kernel_table(args.config, args.steps, args.warmup, overrides, TimedTrainer)
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
