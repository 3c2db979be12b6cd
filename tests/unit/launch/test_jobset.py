"""The JobSet manifest: its JobSet fields against the v1alpha2 API, its Job and Pod against the
Kubernetes schemas (tests/support/jobset_manifest.py), its numbers, its command, and the CLI that
prints it.
"""

from __future__ import annotations

import copy
import importlib.util
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.support.jobset_manifest import KUBERNETES_VERSION, check_jobset, pod_of, validate_manifest
from tests.support.paths import REPO
from titan_tpu.config.errors import ConfigError
from titan_tpu.launch.jobset import JobSetRequest, render_jobset


def _request(**changes: Any) -> JobSetRequest:
    base = dict(
        name="llama3-70b",
        accelerator="tpu-v6e-slice",
        topology="4x4",
        slices=2,
        image="us-docker.pkg.dev/project/repo/titan:1",
        config="llama3_70b",
        dump_folder="gs://my-bucket/runs/70b",
        overrides=("--training.steps=1000", "--parallelism.tp=4"),
        max_restarts=5,
        launcher_restarts=2,
    )
    base.update(changes)
    return JobSetRequest(**base)  # type: ignore[arg-type]


V6E_TWO_SLICES = _request()
TPU7X_ONE_SLICE = _request(
    name="qwen3-debug",
    accelerator="tpu7x",
    topology="2x2x2",
    slices=1,
    config="qwen3_debug",
    dump_folder="/mnt/shared/qwen3",
    overrides=(),
)


def _pod(manifest: dict[str, Any]) -> dict[str, Any]:
    return pod_of(manifest["spec"]["replicatedJobs"][0])


@pytest.mark.parametrize("request_", [V6E_TWO_SLICES, TPU7X_ONE_SLICE], ids=["v6e-4x4-x2", "tpu7x-2x2x2-x1"])
def test_manifest_validates_against_jobset_and_kubernetes_schemas(request_: JobSetRequest) -> None:
    """Catches a misspelled or mistyped field anywhere in the manifest: in the JobSet part (the
    written-down v1alpha2 schema), in the Job (completionMode, parallelism, backoffLimit) and in the
    Pod (nodeSelector, resources, volumes, hostNetwork), which strict Kubernetes schemas check."""
    manifest, _ = render_jobset(request_)
    validate_manifest(manifest)
    # What kubectl receives is the YAML the CLI prints; it must read back as the same manifest.
    assert yaml.safe_load(yaml.safe_dump(manifest, sort_keys=False)) == manifest


def test_v6e_two_slices_numbers_and_command() -> None:
    """4x4 v6e = 16 chips = 4 hosts of 4; 2 slices = 2 Jobs. Catches a wrong host count (pods that
    never schedule or a slice half used), a chip request other than the host's, a missing multi-slice
    setting, and a launcher command the launcher does not parse."""
    manifest, shape = render_jobset(V6E_TWO_SLICES)
    assert (shape.chips, shape.hosts, shape.chips_per_host) == (16, 4, 4)
    replicated = manifest["spec"]["replicatedJobs"][0]
    assert replicated["replicas"] == 2
    job = replicated["template"]["spec"]
    assert (job["completionMode"], job["parallelism"], job["completions"], job["backoffLimit"]) == (
        "Indexed",
        4,
        4,
        0,
    )
    pod = job["template"]["spec"]
    assert pod["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": "tpu-v6e-slice",
        "cloud.google.com/gke-tpu-topology": "4x4",
    }
    (container,) = pod["containers"]
    assert container["resources"] == {"requests": {"google.com/tpu": 4}, "limits": {"google.com/tpu": 4}}
    assert container["command"] == [
        "titan-launch",
        "--max-restarts",
        "2",
        "train.py",
        "--config",
        "llama3_70b",
        "--job.dump_folder=/gcs/my-bucket/runs/70b",
        "--training.steps=1000",
        "--parallelism.tp=4",
    ]
    assert pod["restartPolicy"] == "Never"
    assert (pod["hostNetwork"], pod["dnsPolicy"]) == (True, "ClusterFirstWithHostNet")
    # One slice per node pool, asked on the slices' replicated Job (the JobSet holds no other).
    assert replicated["template"]["metadata"]["annotations"] == {
        "alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"
    }
    assert "annotations" not in manifest["metadata"]
    assert manifest["spec"]["failurePolicy"] == {"maxRestarts": 5}
    assert manifest["spec"]["network"] == {"enableDNSHostnames": True, "subdomain": "llama3-70b"}
    # The bucket is mounted where the command's dump folder points.
    assert container["volumeMounts"] == [{"name": "dump", "mountPath": "/gcs/my-bucket"}]
    assert pod["volumes"][0]["csi"]["volumeAttributes"]["bucketName"] == "my-bucket"
    assert job["template"]["metadata"]["annotations"] == {"gke-gcsfuse/volumes": "true"}


def test_tpu7x_one_slice_numbers() -> None:
    """2x2x2 TPU7x = 8 chips = 2 hosts of 4, one Job; a single slice needs neither the node-pool
    exclusivity nor the host network, and a plain path mounts nothing."""
    manifest, shape = render_jobset(TPU7X_ONE_SLICE)
    assert (shape.chips, shape.hosts, shape.chips_per_host) == (8, 2, 4)
    replicated = manifest["spec"]["replicatedJobs"][0]
    job = replicated["template"]["spec"]
    assert (replicated["replicas"], job["parallelism"], job["completions"]) == (1, 2, 2)
    pod = job["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"] == {"google.com/tpu": 4}
    assert pod["containers"][0]["command"][-1] == "--job.dump_folder=/mnt/shared/qwen3"
    assert "annotations" not in manifest["metadata"] and "metadata" not in replicated["template"]
    assert "hostNetwork" not in pod and "volumes" not in pod


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda m: m["spec"].__setitem__("replicatedJob", m["spec"].pop("replicatedJobs")),
        lambda m: m["spec"]["replicatedJobs"][0].__setitem__("replicas", "2"),
        lambda m: m["spec"]["failurePolicy"].__setitem__("maxRestart", 3),
        lambda m: m["spec"]["network"].__setitem__("enableDNSHostnames", "true"),
    ],
    ids=["misspelled-replicatedJobs", "replicas-as-string", "misspelled-maxRestarts", "flag-as-string"],
)
def test_jobset_schema_rejects_a_corrupted_manifest(corrupt: Any) -> None:
    """Negative control: the written-down schema must fail a misspelled key or a wrong type,
    or the check above passes anything."""
    manifest, _ = render_jobset(V6E_TWO_SLICES)
    corrupt(manifest)
    with pytest.raises(jsonschema.ValidationError):
        check_jobset(manifest)


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda c: c["resources"]["limits"].__setitem__("google.com/tpu", [4]),
        lambda c: c.__setitem__("imagePullPolicyy", "Always"),
        lambda c: c.__setitem__("command", "titan-launch train.py"),
    ],
    ids=["tpu-quantity-as-list", "unknown-field", "command-as-string"],
)
def test_kubernetes_schema_rejects_a_corrupted_pod(corrupt: Any) -> None:
    """Negative control for the strict Kubernetes check. Its Quantity schema checks the type only (a
    string or a number; the text "four" passes), so the bad quantity here is a list; the chip count
    itself is checked by the numbers tests."""
    manifest, _ = render_jobset(V6E_TWO_SLICES)
    pod = copy.deepcopy(_pod(manifest))
    corrupt(pod["spec"]["containers"][0])
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(topology="2x4"), r"multi-slice jobs on multi-host slices only.*--chips-per-host 4"),
        (dict(slices=0), r"slices=0: expected a positive integer"),
        (dict(name="Llama_70B"), r"name 'Llama_70B': expected lower-case"),
        (dict(name="a" * 60), r"must fit in 63 characters, so the name may have at most 53"),
        (dict(dump_folder="runs/70b"), r"expected gs://BUCKET/PATH or an absolute path"),
        (dict(overrides=("training.steps=5",)), r"override 'training.steps=5': expected --section.key=value"),
        (dict(overrides=("--job.dump_folder=/tmp",)), r"the dump folder comes from --dump-folder"),
        (dict(max_restarts=-1), r"max_restarts=-1: expected an integer >= 0"),
    ],
)
def test_bad_requests_fail_with_one_line(changes: dict[str, Any], message: str) -> None:
    """Each of these would render a manifest that GKE rejects or that runs wrongly: a single-host
    slice in a multi-slice job, pod hostnames longer than a DNS label, a dump folder no pod shares,
    an override train.py cannot parse, or one that contradicts the dump folder."""
    with pytest.raises(ConfigError, match=message) as caught:
        render_jobset(_request(**changes))
    assert "\n" not in str(caught.value)


def test_v6e_2x4_multi_host_form_renders_two_slices() -> None:
    """The hint above works: 2x4 as two 4-chip hosts is multi-host, so two slices render."""
    manifest, shape = render_jobset(_request(topology="2x4", chips_per_host=4))
    assert (shape.hosts, shape.chips_per_host) == (2, 4)
    assert manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["parallelism"] == 2


def _cli() -> Any:
    spec = importlib.util.spec_from_file_location("render_jobset", REPO / "scripts/gke/render_jobset.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_prints_the_manifest(capsys: pytest.CaptureFixture[str]) -> None:
    """Catches a flag that does not reach the manifest, overrides that are dropped, or output that
    kubectl cannot read."""
    argv = [
        "--accelerator",
        "tpu-v6e-slice",
        "--topology",
        "4x4",
        "--slices",
        "2",
        "--image",
        "img:1",
        "--config",
        "llama3_70b",
        "--dump-folder",
        "gs://my-bucket/run",
        "--max-restarts",
        "7",
        "--training.steps=10",
    ]
    assert _cli().main(argv) == 0
    printed = capsys.readouterr().out
    manifest = yaml.safe_load(printed)
    assert manifest["metadata"]["name"] == "llama3-70b"
    assert manifest["spec"]["failurePolicy"]["maxRestarts"] == 7
    assert manifest["spec"]["replicatedJobs"][0]["replicas"] == 2
    command = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[-2:] == ["--job.dump_folder=/gcs/my-bucket/run", "--training.steps=10"]


def test_cli_bad_topology_is_one_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "--accelerator",
        "tpu-v6e-slice",
        "--topology",
        "2x2x2",
        "--image",
        "img:1",
        "--config",
        "llama3_70b",
        "--dump-folder",
        "gs://my-bucket/run",
    ]
    assert _cli().main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert line.startswith("error: topology '2x2x2' is not a 2D topology") and "4x4" in line
