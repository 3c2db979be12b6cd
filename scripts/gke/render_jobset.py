"""Write the JobSet that trains a config on N GKE TPU slices, as YAML on stdout.

    python scripts/gke/render_jobset.py --accelerator tpu-v6e-slice --topology 4x4 --slices 2 \\
        --image IMAGE --config llama3_70b --dump-folder gs://BUCKET/run [--section.key=value ...] \\
        | kubectl apply -f -

Arguments it does not know are `--section.key=value` overrides for train.py. The image must hold the
repository (train.py in its working directory) with titan_tpu installed, so `titan-launch` is on
PATH. A gs:// dump folder is mounted with GKE's Cloud Storage FUSE CSI driver; the pods' service
account (--service-account) needs read and write access to the bucket.

GRPO on vLLM servers of its own: --rollout-accelerator asks for a rollout job of --rollout-replicas
servers, each on a single-host slice of --rollout-topology, running --rollout-image (vLLM for TPU)
from --rollout-model-folder (the run's initial Hugging Face folder, which the trainer starts from
too); the trainer is given their URLs and a weights folder under the dump folder (docs/gke.md,
"GRPO with a rollout slice").

Before printing anything it checks the trainer's command as train.py would, on the slices' devices
(one process each): the config and its overrides, the model, flavor and task names, the layout
against the device count and the global batch against the data-parallel degree. A mistake is one
`error: ...` line and exit status 2, not a pod failing on the TPUs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, NoReturn

import yaml

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from titan_tpu.device.tpu_runtime import skip_tpu_backend_without_chips  # noqa: E402

skip_tpu_backend_without_chips()  # before anything imports torch (titan_tpu/device/tpu_runtime.py)

from titan_tpu.config import ConfigError, TrainConfig, load_config  # noqa: E402
from titan_tpu.launch.jobset import (  # noqa: E402
    CONTAINER,
    REPLICATED_JOB,
    JobSetRequest,
    config_grace_period_s,
    render_jobset,
)
from titan_tpu.launch.rollout_job import RolloutRequest, rollout_shape  # noqa: E402
from titan_tpu.launch.slices import ACCELERATORS  # noqa: E402


class _OneLineParser(argparse.ArgumentParser):
    """argparse's errors as the one `error: ...` line every CLI here prints, exit status 2."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def _parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accelerator", required=True, help=f"one of: {', '.join(ACCELERATORS)}")
    parser.add_argument("--topology", required=True, help="the slice's chip grid, e.g. 4x4 or 2x2x2")
    parser.add_argument("--slices", type=int, default=1, help="number of slices (default 1)")
    parser.add_argument("--image", required=True, help="container image with the repository and titan_tpu")
    parser.add_argument("--config", required=True, help="train config name, e.g. llama3_70b")
    parser.add_argument("--dump-folder", required=True, help="gs://BUCKET/PATH or an absolute shared path")
    parser.add_argument("--name", default=None, help="JobSet name (default: the config name with '-')")
    parser.add_argument("--max-restarts", type=int, default=3, help="JobSet restarts of all pods (default 3)")
    parser.add_argument(
        "--launcher-restarts", type=int, default=3, help="titan-launch restarts within a pod (default 3)"
    )
    parser.add_argument(
        "--chips-per-host", type=int, default=None, help="for a v5e/v6e 2x4: 8 (one host) or 4 (two hosts)"
    )
    parser.add_argument("--service-account", default=None, help="Kubernetes service account of the pods")
    rollout = parser.add_argument_group("rollout job (GRPO on vLLM servers, one single-host slice each)")
    rollout.add_argument("--rollout-accelerator", default=None, help="asks for the rollout job; its slices' type")
    rollout.add_argument("--rollout-topology", default=None, help="a single-host topology, e.g. 2x2 or 2x4")
    rollout.add_argument("--rollout-replicas", type=int, default=1, help="servers, one slice each (default 1)")
    rollout.add_argument("--rollout-image", default=None, help="image with vLLM for TPU, e.g. vllm/vllm-tpu:TAG")
    rollout.add_argument(
        "--rollout-model-folder", default=None, help="the run's initial Hugging Face folder: gs://BUCKET/PATH or /path"
    )
    rollout.add_argument("--rollout-port", type=int, default=8000, help="the servers' port (default 8000)")
    rollout.add_argument(
        "--rollout-max-model-len", type=int, default=None, help="vLLM --max-model-len (default: training.seq_len)"
    )
    rollout.add_argument("--rollout-chips-per-host", type=int, default=None, help="as --chips-per-host")
    rollout.add_argument(
        "--rollout-server-arg",
        action="append",
        default=[],
        metavar="FLAG[=VALUE]",
        help="one more `vllm serve` argument, e.g. --rollout-server-arg=--max-num-seqs=512 (repeatable)",
    )
    return parser


_ROLLOUT_REQUIRED = ("rollout_topology", "rollout_image", "rollout_model_folder")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _rollout(parser: argparse.ArgumentParser, opts: argparse.Namespace) -> RolloutRequest | None:
    """The rollout request the --rollout-* flags make, or None; ConfigError names a missing or stray flag."""
    if opts.rollout_accelerator is None:
        given = [
            _flag(dest)
            for dest, value in vars(opts).items()
            if dest.startswith("rollout_") and value != parser.get_default(dest)
        ]
        if given:
            raise ConfigError(f"{given[0]} applies to a rollout job, which --rollout-accelerator asks for")
        return None
    missing = [_flag(dest) for dest in _ROLLOUT_REQUIRED if getattr(opts, dest) is None]
    if missing:
        raise ConfigError(f"a rollout job (--rollout-accelerator) needs {', '.join(missing)}")
    return RolloutRequest(
        accelerator=opts.rollout_accelerator,
        topology=opts.rollout_topology,
        replicas=opts.rollout_replicas,
        image=opts.rollout_image,
        model_folder=opts.rollout_model_folder,
        max_model_len=opts.rollout_max_model_len,
        port=opts.rollout_port,
        chips_per_host=opts.rollout_chips_per_host,
        server_args=tuple(opts.rollout_server_arg),
    )


def _trainer_arguments(manifest: dict[str, Any]) -> tuple[str, list[str]]:
    """(config, overrides) as the trainer's pods pass them to train.py, read from the manifest."""
    (job,) = [job for job in manifest["spec"]["replicatedJobs"] if job["name"] == REPLICATED_JOB]
    pod = job["template"]["spec"]["template"]["spec"]
    (container,) = [container for container in pod["containers"] if container["name"] == CONTAINER]
    command: list[str] = container["command"]
    _config_flag, config, *overrides = command[command.index("train.py") + 1 :]  # --config NAME ...
    return config, overrides


def _check_names(config: TrainConfig) -> str | None:
    """train.py's check of the model, flavor and task names; what could not be checked here, or None."""
    from titan_tpu.models.hf.config import HFConfig

    folder = config.section(HFConfig).config
    if config.model.name == "hf" and folder and not Path(folder).exists():
        # The hf family builds its arguments from that folder, which is on the pods' storage (a bucket).
        return f"the registered names (model hf's arguments come from hf.config {folder}, on the pods' storage)"
    from titan_tpu.training.registered_names import check_registered_names

    check_registered_names(config)
    return None


def check_trainer(manifest: dict[str, Any], processes: int, where: str) -> str | None:
    """What train.py checks before it touches a device, for the manifest's trainer command run as
    `processes` processes (`where` says what they run on): the config and its overrides, the
    registered names, the layout and the batch split. ConfigError names the first mistake; returns
    what could not be checked here, or None."""
    config_name, overrides = _trainer_arguments(manifest)
    config = load_config(config_name, overrides)
    unchecked = _check_names(config)
    # Both import torch, as the registries do: after the torch-free checks have passed.
    from titan_tpu.config.batch import split_global_batch
    from titan_tpu.distributed.parallel_dims import ParallelDims

    try:
        dims = ParallelDims.from_config(config.parallelism, processes)
        split_global_batch(config.training.global_batch_size, config.training.local_batch_size, dims.dp)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    return unchecked


def main(argv: list[str]) -> int:
    parser = _parser()
    opts, overrides = parser.parse_known_args(argv)
    try:
        rollout = _rollout(parser, opts)
        # The pods' terminationGracePeriodSeconds: the time the config gives a preempted run to save.
        grace_period_s = config_grace_period_s(opts.config, tuple(arg for arg in overrides if arg != "--"))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    request = JobSetRequest(
        name=opts.name or opts.config.replace("_", "-").lower(),
        accelerator=opts.accelerator,
        topology=opts.topology,
        slices=opts.slices,
        image=opts.image,
        config=opts.config,
        dump_folder=opts.dump_folder,
        overrides=tuple(arg for arg in overrides if arg != "--"),
        max_restarts=opts.max_restarts,
        launcher_restarts=opts.launcher_restarts,
        chips_per_host=opts.chips_per_host,
        service_account=opts.service_account,
        rollout=rollout,
        grace_period_s=grace_period_s,
    )
    try:
        manifest, shape = render_jobset(request)
        processes = request.slices * shape.devices
        where = f"{request.slices} x {shape.accelerator} {shape.topology} = {processes} devices, one process each"
        unchecked = check_trainer(manifest, processes, where)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"# {request.slices} x {shape.accelerator} {shape.topology}: {shape.hosts} host(s) of "
        f"{shape.chips_per_host} chips ({shape.machine_type}) per slice, {request.slices * shape.chips} chips"
    )
    if rollout is not None:
        served = rollout_shape(rollout, request.name)
        print(
            f"# rollout: {rollout.replicas} vLLM server(s), each on a {served.accelerator} {served.topology} "
            f"({served.chips} chips, {served.machine_type}, tensor parallel {served.devices})"
        )
    if unchecked is not None:
        print(f"# not checked here: {unchecked}")
    print(yaml.safe_dump(manifest, sort_keys=False), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
