"""Entry point: `torchrun train.py --config NAME [--section.key=value ...]` (or plain `python`).

`--dry-run --world N [--rank R ...]` sets the run up and takes one step as rank R of N simulated
ranks, in this one process, without chips (titan_tpu/dryrun).

`--import MODULE` (repeatable) imports a module of yours first, from the current folder or the Python
path, so that the task or model family it registers (`titan_tpu.tasks.registry.register_task`,
`titan_tpu.models.registry.register_model`) and its config sections can be named, set and listed by
`--help` like the shipped ones.
"""

from __future__ import annotations

import logging
import sys

from titan_tpu.device.tpu_runtime import skip_tpu_backend_without_chips

# Before anything imports torch: on a host without TPU device files, torch would load torch_tpu for
# nothing (titan_tpu/device/tpu_runtime.py says what it costs).
skip_tpu_backend_without_chips()

import importlib  # noqa: E402
import os  # noqa: E402

from titan_tpu.config import ConfigError, help_text, load_config, to_toml  # noqa: E402


def import_user_modules(argv: list[str]) -> list[str]:
    """Import every `--import MODULE` (or `--import=MODULE`) and return the other arguments."""
    rest: list[str] = []
    modules: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--import":
            if i + 1 >= len(argv):
                raise ConfigError("--import: missing value (a module of yours, e.g. my_tasks)")
            modules.append(argv[i + 1])
            i += 1
        elif arg.startswith("--import="):
            modules.append(arg.split("=", 1)[1])
        else:
            rest.append(arg)
        i += 1
    if modules and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    for module in modules:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name is None or not module.startswith(e.name):
                raise  # the module was found; something it imports was not: its traceback says where
            raise ConfigError(
                f"--import {module}: no module {e.name!r} in {os.getcwd()} or on the Python path"
            ) from None
    return rest


def parse_cli(argv: list[str]) -> tuple[str | None, bool, list[str]]:
    """Split out --config and --print-config; everything else is a --section.key override."""
    config_name: str | None = None
    print_only = False
    overrides: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config":
            if i + 1 >= len(argv):
                raise ConfigError("--config: missing value (a name in titan_tpu/train_configs/ or a path)")
            config_name = argv[i + 1]
            i += 1
        elif arg.startswith("--config="):
            config_name = arg.split("=", 1)[1]
        elif arg == "--print-config":
            print_only = True
        else:
            overrides.append(arg)
        i += 1
    return config_name, print_only, overrides


def main(argv: list[str]) -> int:
    try:
        argv = import_user_modules(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if "--help" in argv or "-h" in argv:
        print(help_text())
        return 0
    if "--dry-run" in argv:
        # The trainer's set-up and one step at a simulated world size, in this process (titan_tpu/dryrun).
        from titan_tpu.dryrun.__main__ import main as dry_run

        return dry_run([arg for arg in argv if arg != "--dry-run"])
    try:
        config_name, print_only, overrides = parse_cli(argv)
        config = load_config(config_name, overrides)
        # The registries import torch, so they are consulted only once the plain checks have passed;
        # logging is set up after it, so that libraries' import-time messages do not bury a config error.
        from titan_tpu.training.registered_names import check_registered_names

        names = check_registered_names(config)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if print_only:
        print(to_toml(config))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    from titan_tpu.distributed.comm_timeouts import CollectiveTimeout
    from titan_tpu.generation.vllm.errors import EngineFailed
    from titan_tpu.training.trainer import Trainer, TrainingStopped

    try:
        trainer = Trainer(config, names)
        try:
            trainer.train()
        finally:
            trainer.close()
    except ConfigError as e:  # checks that need the process count or the model (mesh, batch split)
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (TrainingStopped, CollectiveTimeout, EngineFailed) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
