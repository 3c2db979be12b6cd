"""A JobSet (jobset.x-k8s.io/v1alpha2) that trains on N GKE TPU slices, as plain dicts.

One replicated Job per slice (`replicas` = slices), each an Indexed Job with one pod per host of the
slice. Every pod runs the per-host launcher, which starts the training processes of its host:

    titan-launch --max-restarts K train.py --config NAME --job.dump_folder=DUMP [overrides]

For GRPO on vLLM servers of its own (`JobSetRequest.rollout`), a second replicated Job, listed first
and started first, runs one server per single-host slice (titan_tpu/launch/rollout_job.py); the
trainer's command then names them, and the JobSet completes when the trainer does.

What others supply, and so is not written here: JobSet makes the headless service that gives each
pod a stable hostname (`network.enableDNSHostnames`); Kubernetes sets JOB_COMPLETION_INDEX in an
Indexed Job; GKE's TPU webhook sets TPU_WORKER_ID and TPU_WORKER_HOSTNAMES on TPU pods, and the
MEGASCALE_* variables of a multi-slice JobSet (GKE's own multi-slice examples set none of them).
Setting them by hand would fight the webhook.

Preemption: a pod gets SIGTERM, then SIGKILL `terminationGracePeriodSeconds` later; the trainer's pods
get checkpoint.preemption_grace_s (`config_grace_period_s`), in which the training processes save
the step in progress and exit, and torchrun's agent waits as long for them
(TORCH_ELASTIC_SHUTDOWN_TIMEOUT) before it kills them.

Failures: a pod that fails fails its Job at once (`backoffLimit: 0`, `restartPolicy: Never`), and
the JobSet then recreates every Job, up to `failurePolicy.maxRestarts` times. Within a pod the
launcher restarts its process group first. Either way the run resumes from the newest complete
checkpoint in the dump folder, which therefore has to be shared storage: a `gs://` bucket mounted
with GKE's Cloud Storage FUSE CSI driver, or a path on a volume the image or cluster provides.

Sources: JobSet API (github.com/kubernetes-sigs/jobset, api/jobset/v1alpha2/jobset_types.go);
GKE multi-slice JobSets (exclusive-topology per node pool, host networking, backoffLimit 0):
https://cloud.google.com/tpu/docs/tpu-gke-multislice ;
Cloud Storage FUSE CSI driver (pod annotation, ephemeral CSI volume):
https://cloud.google.com/kubernetes-engine/docs/how-to/persistent-volumes/cloud-storage-fuse-csi-driver
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from titan_tpu.config import load_config
from titan_tpu.config.errors import ConfigError
from titan_tpu.launch import rollout_job
from titan_tpu.launch.rollout_job import RolloutRequest
from titan_tpu.launch.slices import (
    ACCELERATOR_LABEL,
    TOPOLOGY_LABEL,
    TPU_RESOURCE,
    SliceShape,
    multi_host_alternative,
    slice_shape,
)

API_VERSION = "jobset.x-k8s.io/v1alpha2"
REPLICATED_JOB = "slice"
CONTAINER = "train"
EXCLUSIVE_TOPOLOGY = "alpha.jobset.sigs.k8s.io/exclusive-topology"
LAUNCHER = "titan-launch"
GCS_MOUNT_ROOT = "/gcs"
# Checkpoints become visible by renaming their folder. On a bucket without hierarchical namespace
# Cloud Storage FUSE renames a folder only when it holds fewer objects than this limit (the default
# of 0 refuses every folder rename); a hierarchical-namespace bucket renames atomically.
GCS_MOUNT_OPTIONS = "implicit-dirs,rename-dir-limit=200000"

_NAME = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_OVERRIDE = re.compile(r"--[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+=.*", re.DOTALL)
_BUCKET = re.compile(r"[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]")
_DNS_LABEL_MAX = 63
# Set from other inputs; an override would silently disagree with them.
_OWNED_OVERRIDES = ("--job.dump_folder=",)
# Kubernetes' default terminationGracePeriodSeconds, and checkpoint.preemption_grace_s's.
DEFAULT_GRACE_PERIOD_S = 30


@dataclass(frozen=True)
class JobSetRequest:
    """What a user chooses; everything else in the manifest follows from it."""

    name: str
    accelerator: str
    topology: str
    slices: int
    image: str
    config: str
    dump_folder: str
    overrides: tuple[str, ...] = ()
    max_restarts: int = 3  # JobSet: recreations of every pod
    launcher_restarts: int = 3  # titan-launch: restarts of one pod's process group
    chips_per_host: int | None = None  # only for topologies GKE builds two ways (v5e/v6e 2x4)
    service_account: str | None = None  # a Kubernetes service account with access to the bucket
    rollout: RolloutRequest | None = None  # vLLM servers on slices of their own, for GRPO
    grace_period_s: int = DEFAULT_GRACE_PERIOD_S  # SIGTERM to SIGKILL: the config's checkpoint.preemption_grace_s


def config_grace_period_s(config: str, overrides: tuple[str, ...]) -> int:
    """checkpoint.preemption_grace_s of the trainer's config with the user's overrides."""
    return load_config(config, list(overrides)).checkpoint.preemption_grace_s


def _check(request: JobSetRequest, shape: SliceShape) -> None:
    if request.slices < 1:
        raise ConfigError(f"slices={request.slices}: expected a positive integer")
    if request.slices > 1 and not shape.multi_host:
        # GKE Multislice runs on multi-host node pools only (tpu-multislice page, "availability").
        alternative = multi_host_alternative(shape)
        hint = (
            f"use --chips-per-host {alternative} for the multi-host form of {shape.topology}"
            if alternative
            else "pick a topology with more than one host"
        )
        raise ConfigError(
            f"{request.slices} slices of {shape.accelerator} {shape.topology}: GKE runs multi-slice "
            f"jobs on multi-host slices only, and this one has 1 host; {hint}"
        )
    if request.grace_period_s < 1:
        raise ConfigError(f"grace_period_s={request.grace_period_s}: expected seconds >= 1")
    restarts = (("max_restarts", request.max_restarts), ("launcher_restarts", request.launcher_restarts))
    for field, value in restarts:
        if value < 0:
            raise ConfigError(f"{field}={value}: expected an integer >= 0")
    if not _NAME.fullmatch(request.name):
        raise ConfigError(f"name '{request.name}': expected lower-case letters, digits and '-', starting with a letter")
    # Pods are reached as <name>-<replicated job>-<job index>-<pod index>.<subdomain>; that first
    # part is a DNS label.
    longest = f"{request.name}-{REPLICATED_JOB}-{request.slices - 1}-{shape.hosts - 1}"
    if len(longest) > _DNS_LABEL_MAX:
        room = _DNS_LABEL_MAX - (len(longest) - len(request.name))
        raise ConfigError(
            f"name '{request.name}' is too long: pod hostnames such as '{longest}' must fit in "
            f"{_DNS_LABEL_MAX} characters, so the name may have at most {room}"
        )
    if not request.image or any(ch.isspace() for ch in request.image):
        raise ConfigError(f"image '{request.image}': expected a container image reference without spaces")
    if not request.config or any(ch.isspace() for ch in request.config):
        raise ConfigError(f"config '{request.config}': expected a config name such as llama3_8b")
    for override in request.overrides:
        if not _OVERRIDE.fullmatch(override):
            raise ConfigError(f"override '{override}': expected --section.key=value")
        if override.startswith(_OWNED_OVERRIDES):
            raise ConfigError(f"override '{override}': the dump folder comes from --dump-folder")
        refused = rollout_job.owned_override(override) if request.rollout is not None else None
        if refused is not None:
            raise ConfigError(refused)


def _storage(folder: str, what: str) -> tuple[str, str | None]:
    """(the folder as the pods see it, the bucket to mount for it or None)."""
    if folder.startswith("gs://"):
        bucket, _, path = folder[len("gs://") :].partition("/")
        if not _BUCKET.fullmatch(bucket):
            raise ConfigError(f"{what} '{folder}': '{bucket}' is not a Cloud Storage bucket name")
        return f"{GCS_MOUNT_ROOT}/{bucket}/{path.strip('/')}".rstrip("/"), bucket
    if not folder.startswith("/"):
        raise ConfigError(f"{what} '{folder}': expected gs://BUCKET/PATH or an absolute path on shared storage")
    return folder, None


def launcher_command(request: JobSetRequest, pod_dump_folder: str, owned: list[str] | None = None) -> list[str]:
    """The trainer pods' command; `owned` are the overrides the renderer sets besides the dump folder."""
    return [
        LAUNCHER,
        "--max-restarts",
        str(request.launcher_restarts),
        "train.py",
        "--config",
        request.config,
        f"--job.dump_folder={pod_dump_folder}",
        *(owned or []),
        *request.overrides,
    ]


def _with_storage(spec: dict[str, Any], mounts: list[tuple[str, str]], service_account: str | None) -> dict[str, Any]:
    """A pod template from `spec`, its one container mounting each (volume name, bucket) at /gcs/<bucket>."""
    if service_account is not None:
        spec["serviceAccountName"] = service_account
    if not mounts:
        return {"spec": spec}
    (container,) = spec["containers"]
    container["volumeMounts"] = [{"name": name, "mountPath": f"{GCS_MOUNT_ROOT}/{bucket}"} for name, bucket in mounts]
    spec["volumes"] = [
        {
            "name": name,
            "csi": {
                "driver": "gcsfuse.csi.storage.gke.io",
                "volumeAttributes": {"bucketName": bucket, "mountOptions": GCS_MOUNT_OPTIONS},
            },
        }
        for name, bucket in mounts
    ]
    # The annotation asks GKE to add the Cloud Storage FUSE sidecar that serves the volumes.
    return {"metadata": {"annotations": {"gke-gcsfuse/volumes": "true"}}, "spec": spec}


def _trainer_pod_template(
    request: JobSetRequest, shape: SliceShape, command: list[str], mounts: list[tuple[str, str]]
) -> dict[str, Any]:
    chips = {TPU_RESOURCE: shape.chips_per_host}
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": request.image,
        "command": command,
        # torchrun's agent gives the training processes this long to save and exit after SIGTERM.
        "env": [{"name": "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "value": str(request.grace_period_s)}],
        "resources": {"requests": dict(chips), "limits": dict(chips)},
    }
    spec: dict[str, Any] = {
        "restartPolicy": "Never",  # the Job fails at once and the JobSet restarts every pod
        "terminationGracePeriodSeconds": request.grace_period_s,
        "nodeSelector": {ACCELERATOR_LABEL: shape.accelerator, TOPOLOGY_LABEL: shape.topology},
        "containers": [container],
    }
    if request.slices > 1:
        # GKE's multi-slice JobSets run on the host's network, which carries the traffic between
        # slices (DCN); the DNS policy keeps cluster names resolvable from the host network.
        spec["hostNetwork"] = True
        spec["dnsPolicy"] = "ClusterFirstWithHostNet"
    return _with_storage(spec, mounts, request.service_account)


def _rollout_job(
    request: JobSetRequest,
    rollout: RolloutRequest,
    shape: SliceShape,
    pod_model: str,
    max_model_len: int,
    mounts: list[tuple[str, str]],
) -> dict[str, Any]:
    command = rollout_job.server_command(rollout, shape, pod_model, max_model_len)
    # The same mounts as the trainer's: the servers read the model folder and every weight push.
    template = _with_storage(rollout_job.server_pod_spec(rollout, shape, command), mounts, request.service_account)
    return {
        "name": rollout_job.ROLLOUT_JOB,
        "replicas": rollout.replicas,
        "template": {"spec": rollout_job.server_job_spec(template)},
    }


def render_jobset(request: JobSetRequest) -> tuple[dict[str, Any], SliceShape]:
    """The JobSet manifest for `request`, and the trainer's slice shape it was built for."""
    shape = slice_shape(request.accelerator, request.topology, request.chips_per_host)
    _check(request, shape)
    pod_dump, dump_bucket = _storage(request.dump_folder, "dump folder")
    mounts = [("dump", dump_bucket)] if dump_bucket is not None else []
    owned: list[str] = []
    rollout = request.rollout
    rollout_spec = None
    if rollout is not None:
        rollout_shape = rollout_job.rollout_shape(rollout, request.name)
        pod_model, model_bucket = _storage(rollout.model_folder, "rollout model folder")
        if model_bucket is not None and model_bucket != dump_bucket:
            mounts.append(("model", model_bucket))
        seq_len = rollout_job.trainer_seq_len(request.config, request.overrides)
        max_model_len = seq_len if rollout.max_model_len is None else rollout.max_model_len
        if max_model_len < seq_len:
            raise ConfigError(
                f"rollout max_model_len={max_model_len} is below the config's training.seq_len {seq_len}: the "
                "trainer refuses servers that cannot hold a whole prompt and completion"
            )
        urls = rollout_job.engine_urls(rollout, request.name, request.name)
        owned = rollout_job.trainer_overrides(urls, pod_model, pod_dump)
        rollout_spec = _rollout_job(request, rollout, rollout_shape, pod_model, max_model_len, mounts)
    job_spec = {
        "completionMode": "Indexed",  # JOB_COMPLETION_INDEX numbers the hosts of a slice
        "parallelism": shape.hosts,
        "completions": shape.hosts,
        "backoffLimit": 0,
        "template": _trainer_pod_template(request, shape, launcher_command(request, pod_dump, owned), mounts),
    }
    job_template: dict[str, Any] = {}
    if request.slices > 1:
        # One trainer slice per node pool: without it two Jobs could share a slice's nodes. Set on the
        # trainer's replicated Job only: on the JobSet it would also give every single-host rollout
        # server a node pool of its own.
        job_template["metadata"] = {"annotations": {EXCLUSIVE_TOPOLOGY: "cloud.google.com/gke-nodepool"}}
    job_template["spec"] = job_spec
    trainer = {"name": REPLICATED_JOB, "replicas": request.slices, "template": job_template}
    spec: dict[str, Any] = {"failurePolicy": {"maxRestarts": request.max_restarts}}
    if rollout_spec is not None:
        # The servers first: the trainer's Jobs are created once every server answers /health. JobSet
        # 0.8 deprecates startupPolicy for `dependsOn`, which older controllers reject; InOrder runs
        # on both. The servers never exit, so the JobSet completes when the trainer's Jobs do.
        spec["startupPolicy"] = {"startupPolicyOrder": "InOrder"}
        spec["successPolicy"] = {"operator": "All", "targetReplicatedJobs": [REPLICATED_JOB]}
    spec["network"] = {"enableDNSHostnames": True, "subdomain": request.name}
    spec["replicatedJobs"] = [trainer] if rollout_spec is None else [rollout_spec, trainer]
    manifest = {"apiVersion": API_VERSION, "kind": "JobSet", "metadata": {"name": request.name}, "spec": spec}
    return manifest, shape
