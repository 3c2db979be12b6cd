"""scripts/gke/render_jobset.py checks the trainer's command as train.py would before it prints a
manifest: one `error: ...` line, exit status 2 and nothing on stdout, instead of a JobSet that fails
once its pods run on the TPUs.

Bugs caught: a config that does not exist, a misspelled override or flavor, a layout or batch that
does not divide over the slices' devices, each rendered as valid YAML with exit 0; the layout checked
against chips where the TPU runtime counts devices (two per Ironwood chip) or against one slice of
several; a valid request refused; a Hugging Face folder on the pods' storage refused because this
machine cannot read it.
"""

from __future__ import annotations

import sys

import pytest
import yaml

from tests.support.paths import REPO

sys.path.insert(0, str(REPO))

from scripts.gke.render_jobset import main  # noqa: E402

# Two v6e 4x4 slices: 32 chips, one device and one training process each.
V6E_TWO_SLICES = [
    "--accelerator",
    "tpu-v6e-slice",
    "--topology",
    "4x4",
    "--slices",
    "2",
    "--image",
    "img:1",
    "--dump-folder",
    "gs://my-bucket/run",
]


def _error_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # nothing for kubectl to apply
    (line,) = captured.err.splitlines()
    assert line.startswith("error: ")
    return line


def _manifest(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[str, dict]:
    assert main(argv) == 0
    printed = capsys.readouterr().out
    return printed, yaml.safe_load(printed)


def test_an_unknown_config_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    line = _error_line(capsys, [*V6E_TWO_SLICES, "--config", "llama3_7b"])
    assert "--config llama3_7b: no such file or config" in line and "did you mean 'llama3_70b'" in line


def test_an_unknown_key_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    line = _error_line(capsys, [*V6E_TWO_SLICES, "--config", "llama3_70b", "--parallelism.tpp=4"])
    assert "parallelism.tpp: unknown key in [parallelism]; did you mean 'tp'?" in line


def test_an_unknown_flavor_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """The registries' check (titan_tpu/training/registered_names.py), as train.py runs it."""
    line = _error_line(capsys, [*V6E_TWO_SLICES, "--config", "llama3_70b", "--model.flavor=80B"])
    assert "model.flavor: unknown flavor '80B'" in line and "did you mean '8B'?" in line


def test_a_layout_that_does_not_fit_the_slices_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """tp = 3 on 2 x 16 chips: ParallelDims' arithmetic, for all slices' processes."""
    line = _error_line(capsys, [*V6E_TWO_SLICES, "--config", "llama3_70b", "--parallelism.tp=3"])
    assert line == (
        "error: 2 x tpu-v6e-slice 4x4 = 32 devices, one process each: parallelism: dp_replicate 1 x tp 3 = 3 "
        "does not divide the 32 processes started, so dp_shard = -1 has no value; pick degrees whose product is 32"
    )


def test_a_batch_that_does_not_split_over_data_parallel_ranks_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    line = _error_line(capsys, [*V6E_TWO_SLICES, "--config", "llama3_70b", "--training.global_batch_size=48"])
    assert "training.global_batch_size 48 is not divisible by local_batch_size 1 x data-parallel degree 32" in line


def test_ironwood_runs_a_process_per_device_two_per_chip(capsys: pytest.CaptureFixture[str]) -> None:
    """tpu7x 2x2x2 is 8 chips and 16 devices: dp_shard 8 leaves half of them idle; 16 fits."""
    argv = ["--accelerator", "tpu7x", "--topology", "2x2x2", "--image", "img:1", "--config", "llama3_70b"]
    argv += ["--dump-folder", "/mnt/shared/run", "--training.global_batch_size=64"]
    line = _error_line(capsys, [*argv, "--parallelism.dp_shard=8"])
    assert "1 x tpu7x 2x2x2 = 16 devices" in line and "= 8, but 16 processes were started" in line
    _manifest(capsys, [*argv, "--parallelism.dp_shard=16"])


def test_a_valid_request_still_renders(capsys: pytest.CaptureFixture[str]) -> None:
    printed, manifest = _manifest(
        capsys, [*V6E_TWO_SLICES, "--config", "llama3_70b", "--parallelism.tp=4", "--training.steps=10"]
    )
    assert printed.startswith("# 2 x tpu-v6e-slice 4x4:") and "# not checked here" not in printed
    assert manifest["spec"]["replicatedJobs"][0]["replicas"] == 2


def test_a_hugging_face_folder_on_the_pods_storage_is_left_to_the_pods(capsys: pytest.CaptureFixture[str]) -> None:
    """The hf family reads its sizes from hf.config, which only the pods can read (a mounted
    bucket); the layout is still checked, and the output says what was not."""
    hf = ["--config", "hf_mistral_7b", "--hf.architecture=", "--hf.config=/gcs/my-bucket/Mistral-7B"]
    printed, _ = _manifest(capsys, [*V6E_TWO_SLICES, *hf])
    assert "# not checked here: the registered names (model hf's arguments come from hf.config " in printed
    line = _error_line(capsys, [*V6E_TWO_SLICES, *hf, "--parallelism.tp=3"])
    assert "dp_replicate 1 x tp 3 = 3 does not divide the 32 processes" in line
