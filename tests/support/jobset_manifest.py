"""Checking a rendered JobSet: its JobSet fields against the v1alpha2 API, each replicated Job's Job
and Pod against the Kubernetes schemas (kubernetes-validate, strict: unknown fields fail).

The JobSet schema below is written down from the JobSet API's Go types
(kubernetes-sigs/jobset, api/jobset/v1alpha2/jobset_types.go), for the fields the renderer uses:
their types, the required ones, their enums, and no keys outside the API. A replicated Job's
`template` is a batch/v1 JobTemplateSpec, which the Kubernetes schemas check instead.
"""

from __future__ import annotations

from typing import Any

import jsonschema
import kubernetes_validate

# Ironwood (TPU7x) needs GKE 1.34 or later, so the manifest has to hold for that Kubernetes.
KUBERNETES_VERSION = "1.34"

_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_NON_NEGATIVE = {"type": "integer", "minimum": 0}
_STRINGS = {"type": "array", "items": {"type": "string"}}
JOBSET_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "jobset.x-k8s.io/v1alpha2"},
        "kind": {"const": "JobSet"},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "additionalProperties": False,
            "properties": {"name": {"type": "string"}, "labels": _STRING_MAP, "annotations": _STRING_MAP},
        },
        "spec": {
            "type": "object",
            "required": ["replicatedJobs"],
            "additionalProperties": False,
            "properties": {
                "replicatedJobs": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["name", "template"],
                        "additionalProperties": False,
                        "properties": {
                            "name": {"type": "string"},
                            "groupName": {"type": "string"},
                            "replicas": {"type": "integer", "minimum": 1},
                            "template": {"type": "object"},  # batch/v1 JobTemplateSpec: checked below
                        },
                    },
                },
                "network": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "enableDNSHostnames": {"type": "boolean"},
                        "subdomain": {"type": "string"},
                        "publishNotReadyAddresses": {"type": "boolean"},
                    },
                },
                "failurePolicy": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "maxRestarts": _NON_NEGATIVE,
                        "restartStrategy": {"enum": ["Recreate", "BlockingRecreate", "InPlaceRestart"]},
                        "rules": {"type": "array"},
                    },
                },
                "successPolicy": {
                    "type": "object",
                    "required": ["operator"],
                    "additionalProperties": False,
                    "properties": {"operator": {"enum": ["All", "Any"]}, "targetReplicatedJobs": _STRINGS},
                },
                "startupPolicy": {
                    "type": "object",
                    "required": ["startupPolicyOrder"],
                    "additionalProperties": False,
                    "properties": {"startupPolicyOrder": {"enum": ["AnyOrder", "InOrder"]}},
                },
                "suspend": {"type": "boolean"},
                "ttlSecondsAfterFinished": _NON_NEGATIVE,
            },
        },
    },
}


def replicated_job(manifest: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [job for job in manifest["spec"]["replicatedJobs"] if job["name"] == name]
    return found


def job_of(replicated: dict[str, Any]) -> dict[str, Any]:
    """A replicated Job's template as the batch/v1 Job the controller creates from it."""
    template = replicated["template"]
    metadata = {"name": "job", **template.get("metadata", {})}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": metadata, "spec": template["spec"]}


def pod_of(replicated: dict[str, Any]) -> dict[str, Any]:
    """A replicated Job's pod template as a v1 Pod."""
    template = replicated["template"]["spec"]["template"]
    metadata = {"name": "pod", **template.get("metadata", {})}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": template["spec"]}


def check_jobset(manifest: dict[str, Any]) -> None:
    jsonschema.Draft202012Validator(JOBSET_SCHEMA).validate(manifest)


def validate_manifest(manifest: dict[str, Any]) -> None:
    """The JobSet schema, then every replicated Job's Job and Pod against the strict Kubernetes ones."""
    check_jobset(manifest)
    for replicated in manifest["spec"]["replicatedJobs"]:
        kubernetes_validate.validate(job_of(replicated), KUBERNETES_VERSION, strict=True)
        kubernetes_validate.validate(pod_of(replicated), KUBERNETES_VERSION, strict=True)
