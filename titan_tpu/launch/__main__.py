"""`titan-launch [options] train.py --config NAME [--section.key=value ...]`: torchrun for this host.

Launcher options come first, then the training script and its arguments, passed on verbatim (as
with torchrun). In a GKE TPU pod (or an xpk workload) the launcher reads where the host sits in
the job from the variables GKE sets, waits for the rendezvous host's name to resolve, lets
TorchTPU set its launch variables, and runs torchrun with one rendezvous for all hosts, each host at
the node rank TorchTPU gives it (titan_tpu.launch.command says why).
Without those variables it runs the same torchrun command for this machine alone.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import signal
import sys
from collections.abc import Callable
from types import FrameType

from titan_tpu.config.errors import ConfigError
from titan_tpu.device.tpu_runtime import skip_tpu_backend_without_chips
from titan_tpu.launch.command import LaunchOptions, rendezvous_port, torchrun_argv
from titan_tpu.launch.dns import HostNotResolved, wait_for_host
from titan_tpu.launch.environment import read_placement, torch_tpu_node_rank

# Named outright: run as `python -m titan_tpu.launch`, this module's __name__ is "__main__".
logger = logging.getLogger("titan_tpu.launch")

DEFAULT_DNS_TIMEOUT_S = 300.0


def _nproc(text: str) -> int | None:
    if text == "auto":
        return None
    return _at_least(1)(text)


def _at_least(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            allowed = f"from {minimum} to {maximum}" if maximum is not None else f">= {minimum}"
            raise argparse.ArgumentTypeError(f"expected an integer {allowed}, got {value}")
        return value

    return parse


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {text}")
    return value


def parse_args(argv: list[str]) -> LaunchOptions:
    parser = argparse.ArgumentParser(
        prog="titan-launch",
        description="Start torchrun on this host: one GKE TPU host of a multi-host job, or this machine.",
        allow_abbrev=False,
    )
    parser.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        type=_nproc,
        default=None,
        metavar="N|auto",
        help="processes on this host (default auto: one per TPU device or GPU, one on a CPU host)",
    )
    parser.add_argument(
        "--max-restarts",
        "--max_restarts",
        type=_at_least(0),
        default=0,
        metavar="K",
        help="restarts after a training process fails (every host restarts with it, from the newest checkpoint)",
    )
    parser.add_argument(
        "--rdzv-port",
        "--rdzv_port",
        type=_at_least(0, 65535),
        default=None,
        metavar="P",
        help="rendezvous port on the first host (default 29400 with several hosts, any free port on one)",
    )
    parser.add_argument(
        "--dns-timeout",
        "--dns_timeout",
        type=_seconds,
        default=DEFAULT_DNS_TIMEOUT_S,
        metavar="S",
        help=f"seconds to wait for the rendezvous host's name to resolve (default {DEFAULT_DNS_TIMEOUT_S:g})",
    )
    parser.add_argument("script", help="the training script, e.g. train.py")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments, passed on verbatim")
    args = parser.parse_args(argv)
    return LaunchOptions(
        nproc_per_node=args.nproc_per_node,
        max_restarts=args.max_restarts,
        rdzv_port=args.rdzv_port,
        dns_timeout_s=args.dns_timeout,
        script=args.script,
        script_args=tuple(args.script_args),
    )


def prepare(options: LaunchOptions) -> list[str]:
    """Everything before torchrun starts: placement, process count, DNS wait, TorchTPU's variables and
    this host's rank. Returns torchrun's arguments."""
    placement = read_placement(os.environ)
    # torch (through the device layer) is imported only once the variables have been checked.
    from titan_tpu.launch import devices

    accelerator = devices.visible_accelerator()
    nproc = options.nproc_per_node or devices.processes_per_host(accelerator)
    rendezvous_port(placement, options.rdzv_port)  # a bad port fails before the DNS wait
    logger.info("launch: %s", placement.describe())
    wait_for_host(placement.first_host, options.dns_timeout_s)
    node_rank = placement.node_rank
    if accelerator == "tpu":
        try:
            devices.set_tpu_launch_env(placement, nproc)
        except ValueError as error:
            raise ConfigError(f"torch.tpu.distributed.set_tpu_launch_env: {error}") from None
        # Global rank r must sit on the host TorchTPU gave slice-builder address r.
        node_rank = torch_tpu_node_rank(placement, os.environ)
        if node_rank != placement.node_rank:
            logger.info(
                "launch: TorchTPU places this host at node rank %d (host list: %d)", node_rank, placement.node_rank
            )
    return torchrun_argv(placement, options, nproc, node_rank)


def run_torchrun(argv: list[str]) -> int:
    """torchrun runs in this process rather than as a child: in a container the launcher is PID 1
    and receives the pod's SIGTERM, which torchrun's agent turns into an orderly stop of its
    workers (a parent process would have to forward it by hand), the variables TorchTPU set in
    this process reach the workers unchanged, and the rendezvous backend registered here is the
    one torchrun finds."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    from titan_tpu.launch import rendezvous

    rendezvous.register()
    logger.info("launch: torchrun %s", shlex.join(argv))
    try:
        torchrun_main(argv)
    except ChildFailedError:
        return 1  # torchrun has printed which process failed, and how, once it ran out of restarts
    except SignalException as stopped:
        # The agent sent the signal on to the training processes, which save the step in progress and
        # exit (titan_tpu/training/preemption.py), waited for them (TORCH_ELASTIC_SHUTDOWN_TIMEOUT
        # seconds, default 30, then SIGKILL), and restarts nothing: the JobSet or a person restarts.
        logger.warning(
            "launch: %s: the training processes were sent it to save and stop; not restarting them",
            stopped.sigval.name,
        )
        return 128 + int(stopped.sigval)
    return 0


def launch(argv: list[str]) -> int:
    """The launcher's exit status: 0 when training finished, 1 when it failed, 2 on bad input,
    128 + N when signal N (SIGTERM: 143) stopped it."""
    options = parse_args(argv)
    try:
        torchrun_args = prepare(options)
    except (ConfigError, HostNotResolved) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2 if isinstance(error, ConfigError) else 1
    return run_torchrun(torchrun_args)


def _stop_before_training(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def main() -> None:
    # Before anything imports torch: on a host without TPU device files, torch would load torch_tpu
    # for nothing, here and in every worker, which inherits the setting.
    skip_tpu_backend_without_chips()
    # As a container's first process the launcher would ignore a SIGTERM it has no handler for (the
    # pod would wait out its grace period) until torchrun's agent installs its own as the training
    # processes start; nothing is running yet, so this one just ends the launcher.
    signal.signal(signal.SIGTERM, _stop_before_training)
    # The launcher's own lines at INFO; libraries that log at import time stay at WARNING, and
    # torchrun's agent keeps its own level (LOGLEVEL), at which it reports failures and restarts.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("titan_tpu").setLevel(logging.INFO)
    sys.exit(launch(sys.argv[1:]))


if __name__ == "__main__":
    main()
