"""A JobSet (jobset.x-k8s.io/v1alpha2) that trains on N GKE TPU slices, as plain dicts.

One replicated Job per slice (`replicas` = slices), each an Indexed Job with one pod per host of the
slice. Every pod runs the per-host launcher, which starts the training processes of its host:

    titan-launch --max-restarts K train.py --config NAME --job.dump_folder=DUMP [overrides]

What others supply, and so is not written here: JobSet makes the headless service that gives each
pod a stable hostname (`network.enableDNSHostnames`); Kubernetes sets JOB_COMPLETION_INDEX in an
Indexed Job; GKE's TPU webhook sets TPU_WORKER_ID and TPU_WORKER_HOSTNAMES on TPU pods, and the
MEGASCALE_* variables of a multi-slice JobSet (GKE's own multi-slice examples set none of them).
Setting them by hand would fight the webhook.

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

from titan_tpu.config.errors import ConfigError
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


def _dump_storage(dump_folder: str) -> tuple[str, str | None]:
    """(the folder as the pod sees it, the bucket to mount there or None)."""
    if dump_folder.startswith("gs://"):
        bucket, _, path = dump_folder[len("gs://") :].partition("/")
        if not _BUCKET.fullmatch(bucket):
            raise ConfigError(f"dump folder '{dump_folder}': '{bucket}' is not a Cloud Storage bucket name")
        return f"{GCS_MOUNT_ROOT}/{bucket}/{path.strip('/')}".rstrip("/"), bucket
    if not dump_folder.startswith("/"):
        raise ConfigError(
            f"dump folder '{dump_folder}': expected gs://BUCKET/PATH or an absolute path on shared storage"
        )
    return dump_folder, None


def launcher_command(request: JobSetRequest, pod_dump_folder: str) -> list[str]:
    return [
        LAUNCHER,
        "--max-restarts",
        str(request.launcher_restarts),
        "train.py",
        "--config",
        request.config,
        f"--job.dump_folder={pod_dump_folder}",
        *request.overrides,
    ]


def _pod_template(request: JobSetRequest, shape: SliceShape) -> dict[str, Any]:
    pod_dump, bucket = _dump_storage(request.dump_folder)
    chips = {TPU_RESOURCE: shape.chips_per_host}
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": request.image,
        "command": launcher_command(request, pod_dump),
        "resources": {"requests": dict(chips), "limits": dict(chips)},
    }
    spec: dict[str, Any] = {
        "restartPolicy": "Never",  # the Job fails at once and the JobSet restarts every pod
        "nodeSelector": {ACCELERATOR_LABEL: shape.accelerator, TOPOLOGY_LABEL: shape.topology},
        "containers": [container],
    }
    if request.slices > 1:
        # GKE's multi-slice JobSets run on the host's network, which carries the traffic between
        # slices (DCN); the DNS policy keeps cluster names resolvable from the host network.
        spec["hostNetwork"] = True
        spec["dnsPolicy"] = "ClusterFirstWithHostNet"
    if request.service_account is not None:
        spec["serviceAccountName"] = request.service_account
    if bucket is None:
        return {"spec": spec}
    container["volumeMounts"] = [{"name": "dump", "mountPath": f"{GCS_MOUNT_ROOT}/{bucket}"}]
    attributes = {"bucketName": bucket, "mountOptions": GCS_MOUNT_OPTIONS}
    csi = {"driver": "gcsfuse.csi.storage.gke.io", "volumeAttributes": attributes}
    spec["volumes"] = [{"name": "dump", "csi": csi}]
    # The annotation asks GKE to add the Cloud Storage FUSE sidecar that serves the volume.
    return {"metadata": {"annotations": {"gke-gcsfuse/volumes": "true"}}, "spec": spec}


def render_jobset(request: JobSetRequest) -> tuple[dict[str, Any], SliceShape]:
    """The JobSet manifest for `request`, and the slice shape it was built for."""
    shape = slice_shape(request.accelerator, request.topology, request.chips_per_host)
    _check(request, shape)
    metadata: dict[str, Any] = {"name": request.name}
    if request.slices > 1:
        # One slice per node pool: without it two Jobs could share a slice's nodes.
        metadata["annotations"] = {EXCLUSIVE_TOPOLOGY: "cloud.google.com/gke-nodepool"}
    job_spec = {
        "completionMode": "Indexed",  # JOB_COMPLETION_INDEX numbers the hosts of a slice
        "parallelism": shape.hosts,
        "completions": shape.hosts,
        "backoffLimit": 0,
        "template": _pod_template(request, shape),
    }
    manifest = {
        "apiVersion": API_VERSION,
        "kind": "JobSet",
        "metadata": metadata,
        "spec": {
            "failurePolicy": {"maxRestarts": request.max_restarts},
            "network": {"enableDNSHostnames": True, "subdomain": request.name},
            "replicatedJobs": [{"name": REPLICATED_JOB, "replicas": request.slices, "template": {"spec": job_spec}}],
        },
    }
    return manifest, shape
