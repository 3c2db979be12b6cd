"""`python -m titan_tpu.doctor [--quick] [--out FILE] [--checks NAMES] [--section.key=VALUE ...]`, or `titan-doctor`.

Run it as training runs: plain for one device, under `torchrun -m titan_tpu.doctor` or
`titan-launch <this file>` (the launcher takes a script path) for a host or a slice. The `--section.key=VALUE` options are train.py's, applied to the debug config the training
check runs (`llama3_debug`): `--parallelism.*` lays out the mesh whose axes the collectives are
measured over, `--device.type` picks the device. Rank 0 prints the table and writes the JSON report.
Exit status: 0 when no line is wrong, 1 when one is, 2 for bad input (one line).
"""

from __future__ import annotations

import sys

from titan_tpu.device.tpu_runtime import skip_tpu_backend_without_chips

skip_tpu_backend_without_chips()  # before anything imports torch (titan_tpu/device/tpu_runtime.py)

from pathlib import Path  # noqa: E402

import torch.distributed as dist  # noqa: E402

from titan_tpu.config import ConfigError, TrainConfig, load_config  # noqa: E402
from titan_tpu.config.argv import take_option  # noqa: E402
from titan_tpu.device.select import Device, select_device  # noqa: E402
from titan_tpu.distributed import process_group  # noqa: E402
from titan_tpu.distributed.parallel_dims import ParallelDims  # noqa: E402
from titan_tpu.doctor import collective_checks, device_checks, kernel_checks, training_check  # noqa: E402
from titan_tpu.doctor.report import RunFacts, exit_status, merge_ranks, render_table, write_report  # noqa: E402
from titan_tpu.doctor.rows import Row  # noqa: E402
from titan_tpu.doctor.sizes import DEFAULT, QUICK, Sizes  # noqa: E402

DEFAULT_OUT = "doctor_report.json"
# The checks, in the order they run; the device and its dtype decision always come first.
CHECKS = ("matmul", "compile", "attention", "moe", "collectives", "training")
USAGE = (
    "usage: python -m titan_tpu.doctor [--quick] [--out FILE] [--checks NAMES] [--section.key=VALUE ...]\n"
    "  --quick    CPU-sized measurements (seconds each) instead of accelerator-sized ones; always on a CPU\n"
    f"  --out      the JSON report (default ./{DEFAULT_OUT}); rank 0 writes it\n"
    f"  --checks   comma-separated subset of {', '.join(CHECKS)} (default all)\n"
    "  --section.key=VALUE  train.py's overrides of the debug config: --parallelism.tp=2 ... lays out\n"
    "             the mesh the collectives run over, --device.type the device"
)


def _parse_checks(text: str | None) -> tuple[str, ...]:
    if text is None:
        return CHECKS
    chosen = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in chosen if name not in CHECKS]
    if unknown or not chosen:
        what = ", ".join(unknown) or "empty list"
        raise ConfigError(f"--checks {text}: unknown {what}; choose from {', '.join(CHECKS)}")
    return chosen


def run_checks(
    device: Device, dims: ParallelDims, sizes: Sizes, checks: tuple[str, ...], config: TrainConfig, overrides: list[str]
) -> list[Row]:
    """This rank's rows. Every rank runs every check: each measures its own device, and the
    collectives and the training run need them all."""
    rows = device_checks.device_rows(device, config.device.type)
    dtype_row, dtype = device_checks.dtype_row(device)
    rows.append(dtype_row)
    if "matmul" in checks:
        rows += device_checks.matmul_rows(device, sizes, dtype)
    if "compile" in checks:
        rows += device_checks.compile_rows(device, sizes)
    if "attention" in checks:
        rows += kernel_checks.attention_rows(device, sizes, dtype)
    if "moe" in checks:
        rows += kernel_checks.moe_rows(device, sizes, dtype)
    if "collectives" in checks:
        rows += collective_checks.collective_rows(dims, device, sizes)
    if "training" in checks:
        rows.append(training_check.training_row(device, dtype, sizes, overrides))
    return rows


def main(argv: list[str]) -> int:
    if "--help" in argv or "-h" in argv:
        print(USAGE)
        return 0
    argv = list(argv)
    try:
        quick = "--quick" in argv
        if quick:
            argv.remove("--quick")
        out = Path(take_option(argv, "--out") or DEFAULT_OUT)
        checks = _parse_checks(take_option(argv, "--checks"))
        config = load_config(training_check.CONFIG, argv)
        info = process_group.process_info()
        dims = ParallelDims.from_config(config.parallelism, info.world_size)
        device = select_device(config.device.type, info.local_rank)
    except ValueError as error:  # ConfigError
        print(f"error: {error}", file=sys.stderr)
        return 2
    joined = not dist.is_initialized()  # a caller's own group is left as it was found
    process_group.init_process_group(device.backend, info)
    # On a CPU the accelerator sizes (32 heads x 8k tokens of attention, a 128-expert layer) take
    # minutes per kernel and several GB of scores in the blocked kernels: a CPU host gets the quick ones.
    sizes = QUICK if quick or device.type == "cpu" else DEFAULT
    rows = run_checks(device, dims, sizes, checks, config, argv)
    rows_per_rank: list[list[Row]] = [rows]
    if dist.is_initialized():
        rows_per_rank = [[] for _ in range(info.world_size)]
        dist.all_gather_object(rows_per_rank, rows)
    merged = merge_ranks(rows_per_rank)
    if info.rank == 0:
        names, degrees = dims.mesh_axes()
        dtype = next(row.detail for row in merged if row.check == "dtype")
        facts = RunFacts(
            device.type,
            device.name(),
            device_checks.generation_of(device),
            dtype,
            info.world_size,
            dict(zip(names, degrees)),
            sizes.name,
        )
        write_report(out, merged, facts)
        print(render_table(merged))
        print(f"report: {out}")
    if joined:
        process_group.destroy_process_group()
    return exit_status(merged)


def cli() -> None:
    sys.exit(main(sys.argv[1:]))


if __name__ == "__main__":
    cli()
