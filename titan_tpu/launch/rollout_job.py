"""The rollout job of a GRPO JobSet: vLLM servers beside the trainer, each on a single-host TPU slice.

GRPO with `rl.engine = "vllm"` samples on servers it reaches over HTTP (`rl.engine_urls`) and pushes
the trainer's weights to them as a Hugging Face folder that every server reloads in place (paused,
`reload_weights` over `/collective_rpc`, prefix cache reset, resumed). On TPU, vLLM runs from its own
image (its TPU stack cannot share an environment with the trainer's torch-tpu), so the servers are
pods of their own: one replicated Job, one Job per server, one pod per Job, each running

    vllm serve MODEL --served-model-name policy --skip-tokenizer-init --tensor-parallel-size DEVICES ...

with VLLM_SERVER_DEV_MODE=1, which opens those admin endpoints. The trainer writes each push under
the run's dump folder and the servers read it there, so both mount the same storage at the same path.

Only single-host slices: vLLM spans the hosts of a multi-host TPU slice through Ray, which nothing
here sets up.

Sources: vLLM's server flags (vllm/engine/arg_utils.py, vllm/entrypoints/openai/cli_args.py);
readiness through GET /health, which vLLM's OpenAI server answers once the engine is up.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from titan_tpu.config import load_config
from titan_tpu.config.errors import ConfigError
from titan_tpu.launch.slices import (
    ACCELERATOR_LABEL,
    ACCELERATORS,
    TOPOLOGY_LABEL,
    TPU_RESOURCE,
    SliceShape,
    slice_shape,
)

ROLLOUT_JOB = "rollout"
SERVER_CONTAINER = "vllm"
SERVED_MODEL = "policy"
WEIGHTS_SUBFOLDER = "engine_weights"
# vLLM serves /pause, /resume, /reset_prefix_cache and /collective_rpc only in its development mode.
DEV_MODE_ENV = {"name": "VLLM_SERVER_DEV_MODE", "value": "1"}
# Server flags the renderer sets from the request; given again they would contradict it.
_OWNED_SERVER_FLAGS = (
    "--served-model-name",
    "--skip-tokenizer-init",
    "--tensor-parallel-size",
    "-tp",
    "--host",
    "--port",
    "--max-model-len",
    "--model",
)
# Trainer keys the renderer sets when it renders a rollout job, and where their values come from.
_OWNED_TRAINER_KEYS = {
    "rl.engine": "the rollout job's servers are vLLM ones (rl.engine = 'vllm')",
    "rl.engine_urls": "the renderer lists the rollout job's servers in rl.engine_urls",
    "rl.engine_weights_folder": "the weight pushes go under the dump folder, which the servers mount too",
    "checkpoint.initial_load_path": "the servers and the trainer start from --rollout-model-folder",
}
_DNS_LABEL_MAX = 63


@dataclass(frozen=True)
class RolloutRequest:
    """The rollout servers a user asks for; their command and the trainer's engine keys follow from it."""

    accelerator: str
    topology: str
    replicas: int  # servers, one slice each
    image: str  # an image with vLLM for TPU on PATH, e.g. vllm/vllm-tpu
    model_folder: str  # the run's initial Hugging Face folder: gs://BUCKET/PATH or an absolute path
    max_model_len: int | None = None  # None: the trainer's training.seq_len
    port: int = 8000
    chips_per_host: int | None = None  # only for topologies GKE builds two ways (v5e/v6e 2x4)
    server_args: tuple[str, ...] = ()  # more `vllm serve` flags, e.g. ("--max-num-seqs=512",)


def single_host_topologies(accelerator: str) -> list[str]:
    """The topologies of `accelerator` that GKE builds as one host, smallest first, with their chips."""
    found: list[str] = []
    for layout in ACCELERATORS[accelerator].layouts:
        for topology in layout.topologies:
            chips = math.prod(int(side) for side in topology.split("x"))
            entry = f"{topology} ({chips} chip{'s' if chips > 1 else ''})"
            if chips == layout.chips_per_host and entry not in found:
                found.append(entry)
    return found


def rollout_shape(request: RolloutRequest, jobset_name: str) -> SliceShape:
    """The slice of one server; ConfigError (one line, naming what is allowed) for a request that
    would not run."""
    try:
        shape = slice_shape(request.accelerator, request.topology, request.chips_per_host)
    except ConfigError as error:
        raise ConfigError(f"rollout {error}") from None
    if shape.multi_host:
        raise ConfigError(
            f"rollout topology {shape.accelerator} {shape.topology} has {shape.hosts} hosts: vLLM spans the "
            "hosts of a multi-host TPU slice only through Ray, which the renderer does not set up; pick a "
            f"single-host topology: {', '.join(single_host_topologies(shape.accelerator))}"
        )
    if request.replicas < 1:
        raise ConfigError(f"rollout replicas={request.replicas}: expected a positive integer (servers)")
    if not 1 <= request.port <= 65535:
        raise ConfigError(f"rollout port {request.port}: expected a TCP port in 1..65535")
    if request.max_model_len is not None and request.max_model_len < 1:
        raise ConfigError(f"rollout max_model_len={request.max_model_len}: expected a positive integer")
    if not request.image or any(ch.isspace() for ch in request.image):
        raise ConfigError(f"rollout image '{request.image}': expected a container image reference without spaces")
    if not request.model_folder:
        raise ConfigError(
            "rollout model folder: required; the Hugging Face folder the servers and the trainer start "
            "from (checkpoint.initial_load_path), as gs://BUCKET/PATH or an absolute path"
        )
    for arg in request.server_args:
        if arg.split("=", 1)[0] in _OWNED_SERVER_FLAGS:
            raise ConfigError(
                f"rollout server argument '{arg}': the renderer sets it (model, name, host, port, "
                "tensor parallelism from the slice, max model length)"
            )
    longest = f"{jobset_name}-{ROLLOUT_JOB}-{request.replicas - 1}-0"
    if len(longest) > _DNS_LABEL_MAX:
        raise ConfigError(
            f"name '{jobset_name}' is too long for {request.replicas} rollout servers: their hostnames such as "
            f"'{longest}' must fit in {_DNS_LABEL_MAX} characters"
        )
    return shape


def owned_override(override: str) -> str | None:
    """Why the renderer refuses a trainer override (`--section.key=value`) beside a rollout job, or None."""
    key = override[2:].split("=", 1)[0]
    reason = _OWNED_TRAINER_KEYS.get(key)
    return None if reason is None else f"override '{override}': {reason}; the renderer sets {key}"


def engine_urls(request: RolloutRequest, jobset_name: str, subdomain: str) -> list[str]:
    """Each server by its stable JobSet hostname, <jobset>-<replicated job>-<job index>-<pod index>."""
    return [f"http://{jobset_name}-{ROLLOUT_JOB}-{i}-0.{subdomain}:{request.port}" for i in range(request.replicas)]


def trainer_overrides(urls: list[str], pod_model_folder: str, pod_dump_folder: str) -> list[str]:
    """The trainer's engine keys: these servers, and a weights folder the servers read too."""
    return [
        f"--checkpoint.initial_load_path={pod_model_folder}",
        "--rl.engine=vllm",
        f"--rl.engine_urls={json.dumps(urls, separators=(',', ':'))}",  # a TOML array of strings
        f"--rl.engine_weights_folder={pod_dump_folder}/{WEIGHTS_SUBFOLDER}",
    ]


def server_command(request: RolloutRequest, shape: SliceShape, pod_model_folder: str, max_model_len: int) -> list[str]:
    return [
        "vllm",
        "serve",
        pod_model_folder,
        "--served-model-name",
        SERVED_MODEL,
        "--skip-tokenizer-init",  # token ids in and out: the trainer tokenizes
        "--host",
        "0.0.0.0",
        "--port",
        str(request.port),
        # Every device of the slice (a chip; half a chip on TPU7x): weights and KV cache split over them.
        "--tensor-parallel-size",
        str(shape.devices),
        "--max-model-len",
        str(max_model_len),
        *request.server_args,
    ]


def server_pod_spec(request: RolloutRequest, shape: SliceShape, command: list[str]) -> dict[str, Any]:
    """One server's pod spec, without its storage (the JobSet adds the same mounts as the trainer's)."""
    chips = {TPU_RESOURCE: shape.chips}
    container: dict[str, Any] = {
        "name": SERVER_CONTAINER,
        "image": request.image,
        "command": command,
        "env": [dict(DEV_MODE_ENV)],
        "ports": [{"name": "http", "containerPort": request.port}],
        # Ready once the model is loaded and compiled; the trainer starts only when every server is.
        "readinessProbe": {"httpGet": {"path": "/health", "port": request.port}, "periodSeconds": 10},
        "resources": {"requests": dict(chips), "limits": dict(chips)},
    }
    return {
        "restartPolicy": "Never",  # a server that dies fails its Job, and the JobSet restarts every pod
        "nodeSelector": {ACCELERATOR_LABEL: shape.accelerator, TOPOLOGY_LABEL: shape.topology},
        "containers": [container],
    }


def server_job_spec(pod_template: dict[str, Any]) -> dict[str, Any]:
    return {
        # Indexed, so that the pod gets the hostname <job>-0 that the trainer's URLs name.
        "completionMode": "Indexed",
        "parallelism": 1,
        "completions": 1,
        "backoffLimit": 0,
        "template": pod_template,
    }


def trainer_seq_len(config: str, overrides: tuple[str, ...]) -> int:
    """training.seq_len of the trainer's config with the user's overrides; ConfigError when the config
    does not train GRPO (nothing else reads rollouts)."""
    loaded = load_config(config, list(overrides))
    if loaded.training.task != "grpo":
        raise ConfigError(
            f"config '{config}' trains task '{loaded.training.task}': a rollout job serves GRPO's rollouts "
            "(training.task = 'grpo')"
        )
    return loaded.training.seq_len
