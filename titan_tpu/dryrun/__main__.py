"""`python -m titan_tpu.dryrun --config NAME --world N [--rank R ...] [--out FOLDER] [--section.key=value ...]`

Each asked rank (default: the first and the last) is set up and stepped in turn; its table is printed
and its JSON written to FOLDER (default: the config's job.dump_folder/dryrun). Exit status: 0 when
every rank got through, 1 when torch or the config's checks rejected the layout (one line says where
and why), 2 for bad input.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from titan_tpu.device.tpu_runtime import skip_tpu_backend_without_chips

skip_tpu_backend_without_chips()  # before anything imports torch (titan_tpu/device/tpu_runtime.py)

from titan_tpu.config import ConfigError, load_config  # noqa: E402
from titan_tpu.config.argv import take_option  # noqa: E402

USAGE = (
    "usage: python -m titan_tpu.dryrun --config NAME --world N [--rank R ...] [--out FOLDER] [--section.key=VALUE ...]\n"
    "  --world  the number of ranks to simulate (the chips the config is meant for)\n"
    "  --rank   a rank to set up and step (repeatable; default: 0 and N - 1)\n"
    "  --out    where each rank's JSON goes (default: the config's job.dump_folder/dryrun)"
)


def _positive(value: str, what: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"{what}: expected a positive integer, got {value!r}")
    return int(value)


def parse(argv: list[str]) -> tuple[str, int, list[int], str | None, list[str]]:
    argv = list(argv)
    config_name = take_option(argv, "--config")
    world_text = take_option(argv, "--world")
    out = take_option(argv, "--out")
    ranks_text: list[str] = []
    while (rank := take_option(argv, "--rank")) is not None:
        ranks_text.append(rank)
    if config_name is None or world_text is None:
        raise ConfigError("--config and --world are required\n" + USAGE)
    world = _positive(world_text, "--world")
    bad = [r for r in ranks_text if not r.isdigit() or int(r) >= world]
    if bad:
        raise ConfigError(f"--rank: expected ranks from 0 to {world - 1}, got {', '.join(bad)}")
    ranks = [int(r) for r in ranks_text] if ranks_text else sorted({0, world - 1})
    return config_name, world, ranks, out, argv


def main(argv: list[str]) -> int:
    if "--help" in argv or "-h" in argv:
        print(USAGE)
        return 0
    try:
        config_name, world, ranks, out, overrides = parse(argv)
        config = load_config(config_name, overrides)
        from titan_tpu.training.registered_names import check_registered_names

        check_registered_names(config)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    from titan_tpu.dryrun.report import table, write_report
    from titan_tpu.dryrun.run import LayoutRejected, dry_run_rank

    folder = Path(out) if out else Path(config.job.dump_folder) / "dryrun"
    for rank in ranks:
        try:
            report = dry_run_rank(config, config_name, world, rank)
        except ConfigError as e:
            print(f"error: {config_name} at {world} ranks: {e}", file=sys.stderr)
            return 1
        except LayoutRejected as e:
            print(f"rejected: {e}", file=sys.stderr)
            return 1
        print(table(report))
        print(f"  json: {write_report(report, folder)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
