"""The rollout job beside the trainer (titan_tpu/launch/rollout_job.py): the two-job manifest against
the JobSet and Kubernetes schemas, the trainer's engine keys against the servers the manifest runs,
the servers' command, environment and storage, the start and end order, bad requests, and the CLI.
"""

from __future__ import annotations

import copy
import importlib.util
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.support.jobset_manifest import (
    KUBERNETES_VERSION,
    check_jobset,
    pod_of,
    replicated_job,
    validate_manifest,
)
from tests.support.paths import REPO
from titan_tpu.config import load_config
from titan_tpu.config.errors import ConfigError
from titan_tpu.launch.jobset import JobSetRequest, render_jobset
from titan_tpu.launch.rollout_job import RolloutRequest
from titan_tpu.tasks.grpo.config import RLConfig

ROLLOUT = RolloutRequest(
    accelerator="tpu-v6e-slice",
    topology="2x2",
    replicas=3,
    image="vllm/vllm-tpu:test",
    model_folder="gs://models/qwen/Qwen3-8B",
)


def _request(rollout: RolloutRequest | None = ROLLOUT, **changes: Any) -> JobSetRequest:
    base: dict[str, Any] = dict(
        name="grpo-8b",
        accelerator="tpu-v6e-slice",
        topology="4x4",
        slices=2,
        image="us-docker.pkg.dev/project/repo/titan:1",
        config="grpo_qwen3_8b",
        dump_folder="gs://runs-bucket/grpo/8b",
        overrides=("--training.steps=100",),
        rollout=rollout,
    )
    base.update(changes)
    return JobSetRequest(**base)


def _rollout(**changes: Any) -> RolloutRequest:
    fields = dict(ROLLOUT.__dict__)
    fields.update(changes)
    return RolloutRequest(**fields)


def _trainer(manifest: dict[str, Any]) -> dict[str, Any]:
    return pod_of(replicated_job(manifest, "slice"))["spec"]


def _server(manifest: dict[str, Any]) -> dict[str, Any]:
    return pod_of(replicated_job(manifest, "rollout"))["spec"]


def _value(command: list[str], key: str) -> str:
    (value,) = [arg.split("=", 1)[1] for arg in command if arg.startswith(f"--{key}=")]
    return value


def _flag(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


V6E_TRAINER_V6E_SERVERS = _request()
# One trainer slice, servers of another type, every folder a plain shared path (no bucket).
TPU7X_TRAINER_V5E_SERVERS = _request(
    name="grpo-moe",
    accelerator="tpu7x",
    topology="2x2x2",
    slices=1,
    config="grpo_qwen3_moe_30b_a3b",
    dump_folder="/mnt/shared/grpo",
    overrides=(),
    rollout=_rollout(accelerator="tpu-v5-lite-podslice", topology="2x4", replicas=1, model_folder="/mnt/models/moe"),
)


@pytest.mark.parametrize(
    "request_", [V6E_TRAINER_V6E_SERVERS, TPU7X_TRAINER_V5E_SERVERS], ids=["v6e+v6e-2x2-x3", "tpu7x+v5e-2x4"]
)
def test_two_job_manifest_validates_against_jobset_and_kubernetes_schemas(request_: JobSetRequest) -> None:
    """Catches a misspelled or mistyped field in the new parts: the JobSet's startupPolicy and
    successPolicy (the written-down v1alpha2 schema, enums included), the servers' Job, and their Pod
    (env, ports, readinessProbe, resources, volumes), which strict Kubernetes schemas check; and a
    success policy naming a replicated Job that does not exist (the JobSet would never complete)."""
    manifest, _ = render_jobset(request_)
    validate_manifest(manifest)
    names = [job["name"] for job in manifest["spec"]["replicatedJobs"]]
    assert names == ["rollout", "slice"]
    assert set(manifest["spec"]["successPolicy"]["targetReplicatedJobs"]) <= set(names)
    assert yaml.safe_load(yaml.safe_dump(manifest, sort_keys=False)) == manifest


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda m: m["spec"]["startupPolicy"].__setitem__("startupPolicyOrder", "Inorder"),
        lambda m: m["spec"]["successPolicy"].__setitem__("operator", "all"),
        lambda m: m["spec"]["successPolicy"].__setitem__("targetReplicatedJob", ["slice"]),
        lambda m: m["spec"].__setitem__("startupPolicies", m["spec"].pop("startupPolicy")),
    ],
    ids=["order-misspelled", "operator-lower-case", "misspelled-targets", "misspelled-startupPolicy"],
)
def test_jobset_schema_rejects_corrupted_policies(corrupt: Any) -> None:
    """Negative control: the schema's new entries must fail a wrong enum value or a misspelled key,
    or the validation test above passes anything in them."""
    manifest, _ = render_jobset(V6E_TRAINER_V6E_SERVERS)
    corrupt(manifest)
    with pytest.raises(jsonschema.ValidationError):
        check_jobset(manifest)


def test_kubernetes_schema_rejects_a_corrupted_server_pod() -> None:
    """Negative control for the servers' pod: a probe field misspelled fails the strict check."""
    manifest, _ = render_jobset(V6E_TRAINER_V6E_SERVERS)
    pod = copy.deepcopy(pod_of(replicated_job(manifest, "rollout")))
    pod["spec"]["containers"][0]["readinessProbe"]["httpGet"]["paht"] = "/health"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, KUBERNETES_VERSION, strict=True)


def test_trainer_command_names_every_server_and_the_weights_folder() -> None:
    """The trainer's rl.engine_urls, read back by the config loader train.py uses, list one URL per
    server, each the stable hostname JobSet gives that server's pod (<jobset>-<replicated job>-<job
    index>-<pod index>.<subdomain>) and the port it serves on. Catches a server left out (an off-by-one
    over the replicas), a hostname the manifest does not create (wrong job name, subdomain or pod
    index), a wrong port, a list train.py cannot parse, and a weights folder off the shared storage."""
    manifest, _ = render_jobset(V6E_TRAINER_V6E_SERVERS)
    (container,) = _trainer(manifest)["containers"]
    command = container["command"]
    rollout = replicated_job(manifest, "rollout")
    subdomain = manifest["spec"]["network"]["subdomain"]
    server_job = rollout["template"]["spec"]
    assert (server_job["completionMode"], server_job["parallelism"]) == ("Indexed", 1)  # pod index 0 only
    port = _server(manifest)["containers"][0]["ports"][0]["containerPort"]
    expected = [f"http://grpo-8b-{rollout['name']}-{i}-0.{subdomain}:{port}" for i in range(rollout["replicas"])]
    assert len(expected) == 3

    engine_keys = [arg for arg in command if arg.startswith(("--rl.engine=", "--rl.engine_urls="))]
    loaded = load_config("grpo_qwen3_8b", engine_keys).section(RLConfig)
    assert (loaded.engine, loaded.engine_urls) == ("vllm", expected)

    dump = _value(command, "job.dump_folder")
    assert dump == "/gcs/runs-bucket/grpo/8b"
    assert _value(command, "rl.engine_weights_folder") == f"{dump}/engine_weights"
    assert _value(command, "checkpoint.initial_load_path") == "/gcs/models/qwen/Qwen3-8B"
    # The user's overrides still come last, unchanged.
    assert command[-1] == "--training.steps=100"


def test_servers_get_dev_mode_the_same_mounts_and_their_slice() -> None:
    """The servers' pod. Catches a server without VLLM_SERVER_DEV_MODE (every weight push would get
    404 from /pause and /collective_rpc), a server that does not mount the bucket the trainer writes
    the weights to at the same path (the reload would find no folder), the wrong model path, a
    tensor-parallel size other than the slice's chips, a max model length below the trainer's
    training.seq_len (the trainer refuses the server), and a readiness probe on another port."""
    manifest, _ = render_jobset(V6E_TRAINER_V6E_SERVERS)
    server = _server(manifest)
    trainer = _trainer(manifest)
    (container,) = server["containers"]
    assert {"name": "VLLM_SERVER_DEV_MODE", "value": "1"} in container["env"]

    weights = _value(trainer["containers"][0]["command"], "rl.engine_weights_folder")
    model = _value(trainer["containers"][0]["command"], "checkpoint.initial_load_path")
    for pod in (server, trainer):
        (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if weights.startswith(m["mountPath"] + "/")]
        (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        assert volume["csi"]["volumeAttributes"]["bucketName"] == "runs-bucket"
        assert any(model.startswith(m["mountPath"] + "/") for m in pod["containers"][0]["volumeMounts"])
    assert server["volumes"] == trainer["volumes"]
    assert pod_of(replicated_job(manifest, "rollout"))["metadata"]["annotations"] == {"gke-gcsfuse/volumes": "true"}

    command = container["command"]
    assert command[:3] == ["vllm", "serve", "/gcs/models/qwen/Qwen3-8B"]
    assert _flag(command, "--served-model-name") == "policy"
    assert "--skip-tokenizer-init" in command
    assert _flag(command, "--tensor-parallel-size") == "4"  # v6e 2x2: 4 chips on one host
    assert _flag(command, "--max-model-len") == "1024"  # grpo_qwen3_8b's training.seq_len
    assert _flag(command, "--port") == "8000"
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": 8000}
    assert container["resources"]["limits"] == {"google.com/tpu": 4}
    assert server["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": "tpu-v6e-slice",
        "cloud.google.com/gke-tpu-topology": "2x2",
    }
    assert replicated_job(manifest, "rollout")["replicas"] == 3


def test_servers_start_first_and_the_trainer_ends_the_jobset() -> None:
    """Catches the trainer started before the servers answer (its first connection fails and the
    JobSet restarts), a JobSet that never completes because it waits for servers that never exit, and
    node-pool exclusivity set on the whole JobSet, which would ask for a node pool per server."""
    manifest, _ = render_jobset(V6E_TRAINER_V6E_SERVERS)
    spec = manifest["spec"]
    assert spec["startupPolicy"] == {"startupPolicyOrder": "InOrder"}
    assert spec["replicatedJobs"][0]["name"] == "rollout"  # InOrder starts them as listed
    assert spec["successPolicy"] == {"operator": "All", "targetReplicatedJobs": ["slice"]}
    assert "annotations" not in manifest["metadata"]
    assert "metadata" not in replicated_job(manifest, "rollout")["template"]
    trainer_annotations = replicated_job(manifest, "slice")["template"]["metadata"]["annotations"]
    assert trainer_annotations == {"alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"}


def test_plain_paths_and_a_shared_bucket_mount_once() -> None:
    """Plain shared paths mount nothing; a model folder in the dump's own bucket adds no second volume
    (a duplicate volume name would be rejected by the API server, which the schemas do not see)."""
    manifest, _ = render_jobset(TPU7X_TRAINER_V5E_SERVERS)
    server = _server(manifest)
    assert "volumes" not in server and "annotations" not in pod_of(replicated_job(manifest, "rollout"))["metadata"]
    assert server["containers"][0]["command"][2] == "/mnt/models/moe"
    assert _flag(server["containers"][0]["command"], "--tensor-parallel-size") == "8"  # v5e 2x4 on one host

    same_bucket = _request(rollout=_rollout(model_folder="gs://runs-bucket/models/Qwen3-8B"))
    manifest, _ = render_jobset(same_bucket)
    assert [v["name"] for v in _server(manifest)["volumes"]] == ["dump"]
    assert [v["name"] for v in _trainer(manifest)["volumes"]] == ["dump"]


@pytest.mark.parametrize(
    ("accelerator", "topology", "tp"),
    [("tpu-v5p-slice", "2x2x1", "4"), ("tpu7x", "2x2x1", "8"), ("tpu-v6e-slice", "1x1", "1")],
)
def test_tensor_parallel_size_counts_the_slices_devices(accelerator: str, topology: str, tp: str) -> None:
    """The server splits over every device of its slice while the pod asks GKE for chips. Catches a
    tensor-parallel size of 4 on an Ironwood 2x2x1, whose 4 chips show 8 devices (vLLM would leave
    half of each chip idle), and a chip request other than the host's."""
    manifest, _ = render_jobset(_request(rollout=_rollout(accelerator=accelerator, topology=topology)))
    (container,) = _server(manifest)["containers"]
    assert _flag(container["command"], "--tensor-parallel-size") == tp
    chips = 1 if topology == "1x1" else 4
    assert container["resources"]["limits"] == {"google.com/tpu": chips}


def test_without_a_rollout_job_engine_overrides_pass_through() -> None:
    """The refusal below applies only when the renderer sets the keys: a user's own servers in
    rl.engine_urls still reach the trainer unchanged, and the manifest has one replicated Job."""
    override = '--rl.engine_urls=["http://my-vllm:8000"]'
    manifest, _ = render_jobset(_request(rollout=None, overrides=("--rl.engine=vllm", override)))
    assert [job["name"] for job in manifest["spec"]["replicatedJobs"]] == ["slice"]
    assert "startupPolicy" not in manifest["spec"] and "successPolicy" not in manifest["spec"]
    assert _trainer(manifest)["containers"][0]["command"][-1] == override


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            dict(rollout=_rollout(topology="4x4")),
            r"rollout topology tpu-v6e-slice 4x4 has 4 hosts: vLLM spans .* only through Ray.*"
            r"single-host topology: 1x1 \(1 chip\), 2x2 \(4 chips\), 2x4 \(8 chips\)$",
        ),
        (dict(rollout=_rollout(topology="2x4", chips_per_host=4)), r"2x4 has 2 hosts: .*2x4 \(8 chips\)$"),
        (
            dict(rollout=_rollout(accelerator="tpu-v5p-slice", topology="2x2x2")),
            r"has 2 hosts: .*single-host topology: 2x2x1 \(4 chips\)$",
        ),
        (dict(rollout=_rollout(accelerator="tpu-v9")), r"^rollout accelerator 'tpu-v9' is not a GKE TPU"),
        (dict(rollout=_rollout(model_folder="")), r"^rollout model folder: required; .*gs://BUCKET/PATH"),
        (dict(rollout=_rollout(model_folder="models/8b")), r"rollout model folder 'models/8b': expected gs://"),
        (
            dict(overrides=('--rl.engine_urls=["http://elsewhere:8000"]',)),
            r"^override '--rl.engine_urls=.*': the renderer lists the rollout job's servers",
        ),
        (dict(overrides=("--rl.engine_weights_folder=/tmp/w",)), r"the renderer sets rl.engine_weights_folder$"),
        (dict(overrides=("--rl.engine=builtin",)), r"the renderer sets rl.engine$"),
        (dict(overrides=("--checkpoint.initial_load_path=/x",)), r"start from --rollout-model-folder"),
        (dict(rollout=_rollout(replicas=0)), r"rollout replicas=0: expected a positive integer"),
        (dict(rollout=_rollout(port=0)), r"rollout port 0: expected a TCP port in 1\.\.65535"),
        (
            dict(rollout=_rollout(server_args=("--tensor-parallel-size=8",))),
            r"rollout server argument '--tensor-parallel-size=8': the renderer sets it",
        ),
        (
            dict(rollout=_rollout(max_model_len=512)),
            r"rollout max_model_len=512 is below the config's training.seq_len 1024",
        ),
        (dict(config="llama3_debug"), r"config 'llama3_debug' trains task 'auto': a rollout job serves GRPO's"),
        (dict(name="a" * 52, slices=1), r"their hostnames such as 'a+-rollout-2-0' must fit in 63"),
    ],
    ids=[
        "multi-host-topology",
        "multi-host-form-of-2x4",
        "multi-host-v5p",
        "unknown-accelerator",
        "missing-model-folder",
        "relative-model-folder",
        "override-engine-urls",
        "override-weights-folder",
        "override-engine",
        "override-initial-load-path",
        "no-replicas",
        "port-0",
        "owned-server-flag",
        "max-model-len-below-seq-len",
        "not-a-grpo-config",
        "hostname-too-long",
    ],
)
def test_bad_rollout_requests_fail_with_one_line(changes: dict[str, Any], message: str) -> None:
    """Each would render servers GKE cannot place or vLLM cannot run (a multi-host slice without Ray,
    no model to start from), or a trainer that disagrees with them (URLs, weights folder, engine or
    initial weights set twice, a server shorter than a training sequence), or servers for a run that
    samples none."""
    with pytest.raises(ConfigError, match=message) as caught:
        render_jobset(_request(**changes))
    assert "\n" not in str(caught.value)


def _cli() -> Any:
    spec = importlib.util.spec_from_file_location("render_jobset", REPO / "scripts/gke/render_jobset.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_CLI_BASE = [
    "--accelerator",
    "tpu-v6e-slice",
    "--topology",
    "2x4",
    "--image",
    "img:1",
    "--config",
    "grpo_qwen3_8b",
    "--dump-folder",
    "gs://my-bucket/run",
]


def test_cli_renders_the_rollout_job(capsys: pytest.CaptureFixture[str]) -> None:
    """Catches a --rollout-* flag that does not reach the manifest (replicas, port, max model length,
    extra server arguments) and a summary line that misstates the servers' slice."""
    argv = [
        *_CLI_BASE,
        "--rollout-accelerator",
        "tpu-v6e-slice",
        "--rollout-topology",
        "2x4",
        "--rollout-replicas",
        "2",
        "--rollout-image",
        "vllm/vllm-tpu:test",
        "--rollout-model-folder",
        "gs://my-bucket/Qwen3-8B",
        "--rollout-port",
        "8100",
        "--rollout-max-model-len",
        "2048",
        "--rollout-server-arg=--max-num-seqs=512",
        "--training.steps=10",
    ]
    assert _cli().main(argv) == 0
    printed = capsys.readouterr().out
    assert (
        "# rollout: 2 vLLM server(s), each on a tpu-v6e-slice 2x4 (8 chips, ct6e-standard-8t, tensor parallel 8)"
        in (printed)
    )
    manifest = yaml.safe_load(printed)
    validate_manifest(manifest)
    rollout = replicated_job(manifest, "rollout")
    command = pod_of(rollout)["spec"]["containers"][0]["command"]
    assert rollout["replicas"] == 2
    assert (_flag(command, "--port"), _flag(command, "--max-model-len")) == ("8100", "2048")
    assert command[-1] == "--max-num-seqs=512"
    trainer_command = _trainer(manifest)["containers"][0]["command"]
    assert ":8100" in _value(trainer_command, "rl.engine_urls") and trainer_command[-1] == "--training.steps=10"


@pytest.mark.parametrize(
    ("extra", "line"),
    [
        (
            ["--rollout-accelerator", "tpu-v6e-slice", "--rollout-topology", "2x2", "--rollout-image", "v:1"],
            "error: a rollout job (--rollout-accelerator) needs --rollout-model-folder",
        ),
        (
            ["--rollout-replicas", "2"],
            "error: --rollout-replicas applies to a rollout job, which --rollout-accelerator",
        ),
    ],
    ids=["missing-model-folder", "rollout-flag-without-accelerator"],
)
def test_cli_rollout_errors_are_one_line(capsys: pytest.CaptureFixture[str], extra: list[str], line: str) -> None:
    """Catches a rollout job rendered without the folder its servers start from, and --rollout-* flags
    silently ignored because the rollout job was never asked for."""
    assert _cli().main([*_CLI_BASE, *extra]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (printed,) = captured.err.splitlines()
    assert printed.startswith(line)
