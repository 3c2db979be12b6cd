"""`python -m titan_tpu.plan --config NAME --chips NAME-COUNT [--efficiency F] [--calibration REPORT.json] [--search [--top N]] [--section.key=value ...]`

Prints whether the run fits in each device's HBM, by how much, and its estimated step time and MFU;
with --search, the layouts that fit ranked by estimated MFU, each as train.py overrides (search.py).
The overrides are train.py's, loaded by the same `load_config`. Bad input: one line, exit status 2.
"""

from __future__ import annotations

import sys

from titan_tpu.device.tpu_runtime import skip_tpu_backend_without_chips

skip_tpu_backend_without_chips()  # before anything imports torch (titan_tpu/device/tpu_runtime.py)

from titan_tpu.config import ConfigError, load_config  # noqa: E402
from titan_tpu.config.argv import take_option  # noqa: E402
from titan_tpu.plan.calibration import load_calibration  # noqa: E402
from titan_tpu.plan.chips import calibrated, parse_chips, valid_chip_names  # noqa: E402
from titan_tpu.plan.roofline import COMPUTE_EFFICIENCY  # noqa: E402

USAGE = (
    "usage: python -m titan_tpu.plan --config NAME --chips NAME-COUNT [--efficiency F] [--calibration REPORT.json] "
    "[--search [--top N]] [--section.key=VALUE ...]\n"
    f"  --chips       one of {valid_chip_names()}; e.g. v6e-256, v5p-128, h100-8\n"
    f"  --efficiency  fraction of peak FLOP/s the matmuls sustain (default {COMPUTE_EFFICIENCY})\n"
    "  --calibration a report of python -m titan_tpu.doctor run on that chip: its measured matmul FLOP/s\n"
    "                and collective bandwidths replace the vendor figures\n"
    "  --search      try every layout (pp and its schedule, cp, dp_replicate, tp, ep, micro-batch, checkpointing,\n"
    "                activation offload, FSDP CPU offload, reduce dtype)\n"
    "                and print the best that fit as overrides; --top N of them (default 5)"
)


def main(argv: list[str]) -> int:
    if "--help" in argv or "-h" in argv:
        print(USAGE)
        return 0
    argv = list(argv)
    try:
        config_name = take_option(argv, "--config")
        chips = take_option(argv, "--chips")
        efficiency_text = take_option(argv, "--efficiency")
        top_text = take_option(argv, "--top")
        calibration = take_option(argv, "--calibration")
        searching = "--search" in argv
        if searching:
            argv.remove("--search")
        top = 5 if top_text is None else int(top_text)
        if top < 1:
            raise ConfigError(f"--top: must be >= 1, got {top_text}")
        if config_name is None or chips is None:
            raise ConfigError("--config and --chips are required (see --help)")
        cluster = parse_chips(chips)
        if calibration is not None:
            cluster = calibrated(cluster, load_calibration(calibration, cluster.chip))
        efficiency = COMPUTE_EFFICIENCY if efficiency_text is None else float(efficiency_text)
        if not 0 < efficiency <= 1:
            raise ConfigError(f"--efficiency: must be in (0, 1], got {efficiency_text}")
        config = load_config(config_name, argv)
        from titan_tpu.plan.planner import make_plan
        from titan_tpu.training.registered_names import check_registered_names

        check_registered_names(config)
        from titan_tpu.plan.report import render, render_search

        if searching:
            from titan_tpu.plan.search import search

            fitting, closest = search(config, cluster, efficiency)
            print(render_search(fitting, closest, top, f"{config.model.name} {config.model.flavor} on {cluster.name}"))
        else:
            print(render(make_plan(config, cluster, efficiency)))
    except ValueError as e:  # ConfigError, and a --efficiency or --top that is not a number
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
