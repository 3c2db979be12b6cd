"""Entry point: `torchrun train.py --config NAME [--section.key=value ...]` (or plain `python`)."""

from __future__ import annotations

import logging
import sys

from titan_tpu.device.tpu_runtime import skip_tpu_backend_without_chips

# Before anything imports torch: on a host without TPU device files, torch would load torch_tpu for
# nothing (titan_tpu/device/tpu_runtime.py says what it costs).
skip_tpu_backend_without_chips()

from titan_tpu.config import ConfigError, help_text, load_config, to_toml  # noqa: E402


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
    if "--help" in argv or "-h" in argv:
        print(help_text())
        return 0
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
    except (TrainingStopped, CollectiveTimeout) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
