"""GRPO on the vLLM engine, against a real vLLM server in its own environment (the project creates it
on first use, once per machine; tests/support/vllm_server.py).

Bugs caught: a weight push that does not reach the server (it samples from old weights), token ids or
log-probabilities that are not the ones it sampled, a sampling thread that trains on data older than
rl.max_staleness or trains a step twice, and bad input that starts a run instead of one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.paths import REPO
from tests.support.token_sum_reward import REWARDS
from tests.support.vllm_server import qwen3_debug_folder, vllm_python, vllm_url  # noqa: F401 (fixtures)
from titan_tpu.config import ConfigError, load_config
from titan_tpu.generation.builtin import BuiltinEngine
from titan_tpu.generation.logprobs import token_logps
from titan_tpu.generation.vllm.client import ServerClient
from titan_tpu.generation.vllm.engine import VllmEngine
from titan_tpu.models.common.decode_step import DECODER_DECODING
from titan_tpu.protocols.rollout import SamplingParams
from titan_tpu.training.trainer import Trainer

pytestmark = [pytest.mark.slow, pytest.mark.engine]

# One optimizer step per rollout (16 completions, a global batch of 16), float32, and a large lr, so
# that the weights move visibly between two pushes.
SMALL = [
    "--training.dtype=float32",
    "--training.seq_len=32",
    "--rl.prompts_per_step=4",
    "--rl.group_size=4",
    "--training.global_batch_size=16",
    "--rl.max_new_tokens=8",
    "--metrics.log_freq=1",
    "--metrics.eval_freq=0",
    "--optimizer.lr=1e-2",
    REWARDS,
]
HELD_OUT = 16


def engine_run(tmp_path: Path, url: str, *extra: str, vocab_size: int = 512) -> Trainer:
    folder = tmp_path / "initial"
    if not folder.exists():
        qwen3_debug_folder(folder, vocab_size=vocab_size)
    overrides = [
        *SMALL,
        "--rl.engine=vllm",
        f"--rl.engine_urls={url}",
        f"--checkpoint.initial_load_path={folder}",
        f"--job.dump_folder={tmp_path / 'run'}",
        *extra,
    ]
    return Trainer(load_config("grpo_qwen3_debug", overrides))


def agreement(
    engine: VllmEngine, policy: torch.nn.Module, prompts: list[list[int]], stops: tuple[int, ...]
) -> tuple[int, float]:
    """(held-out prompts on which vLLM's greedy tokens equal the builtin sampler's on `policy`, the
    mean per-token k3 KL of the trainer's log-probs from vLLM's on vLLM's tokens)."""
    greedy = SamplingParams(8, temperature=0.0, stop_ids=stops)
    theirs = engine.generate(prompts, greedy)
    builtin = BuiltinEngine(DECODER_DECODING, 0, torch.device("cpu"), lambda group: True)
    builtin.load_weights(policy, 0)
    ours = builtin.generate(prompts, greedy)
    equal = sum(a == b for a, b in zip(theirs.tokens, ours.tokens))
    kl, count = 0.0, 0
    with torch.no_grad():
        for prompt, tokens, engine_logps in zip(prompts, theirs.tokens, theirs.logps):
            trainer = token_logps(policy, torch.tensor([prompt + tokens]))[0, len(prompt) - 1 :]
            log_ratio = trainer - engine_logps
            kl += float((torch.exp(log_ratio) - 1 - log_ratio).sum())
            count += len(tokens)
    return equal, kl / count


def synced_agreement(tmp_path: Path, url: str, skip_version: int | None) -> list[tuple[int, float]]:
    """Five steps of a run, checked right after each push; `skip_version`: that push is left out."""
    trainer = engine_run(tmp_path, url, "--training.steps=5")
    try:
        task = trainer.task
        engine = task.source.rollout_engine
        assert isinstance(engine, VllmEngine)
        prompts = [p.ids for p in task.prompts.held_out[:HELD_OUT]]
        push = engine.load_weights
        checks: list[tuple[int, float]] = []

        def push_and_check(policy: torch.nn.Module, version: int) -> None:
            if version != skip_version:
                push(policy, version)
            checks.append(agreement(engine, policy, prompts, task.params.stop_ids))

        engine.load_weights = push_and_check  # type: ignore[method-assign]
        for _ in range(5):
            trainer.train_step()
    finally:
        trainer.close()
    return checks


def test_after_every_push_the_engine_decodes_what_the_trainer_would(tmp_path: Path, vllm_url: str) -> None:  # noqa: F811
    checks = synced_agreement(tmp_path / "synced", vllm_url, skip_version=None)
    assert len(checks) == 5
    for equal, kl in checks:
        assert equal >= 15 and kl < 1e-3, checks
    # Negative control: the push before the third rollout left out, the engine samples from the
    # weights of two steps before, and the check sees it.
    skipped = synced_agreement(tmp_path / "skipped", vllm_url, skip_version=2)
    equal, kl = skipped[2]
    assert equal < 15 or kl >= 1e-3, skipped


def test_sampling_ahead_trains_every_step_once_within_the_staleness(tmp_path: Path, vllm_url: str) -> None:  # noqa: F811
    trainer = engine_run(tmp_path, vllm_url, "--training.steps=6", "--rl.max_staleness=1", "--rl.is_correction=true")
    try:
        trainer.train()
    finally:
        trainer.close()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    staleness = [r["rollout/staleness"] for r in steps]
    # One step per rollout: a rollout sampled one ahead is one step old, never more.
    assert max(staleness) == 1 and min(staleness) == 0, staleness
    assert all("rollout/trainer_wait_seconds" in r and 0 <= r["rollout/is_truncated"] <= 1 for r in steps)


def test_bad_engine_settings_are_one_line(tmp_path: Path, vllm_url: str) -> None:  # noqa: F811
    closed = "http://127.0.0.1:9"  # the discard port: nothing answers
    with pytest.raises(ConfigError, match=r"^engine: http://127.0.0.1:9/v1/models: .*is a vLLM server running there"):
        engine_run(tmp_path / "closed", closed)
    with pytest.raises(ConfigError, match=r"^rl.engine = 'vllm' starts a server from checkpoint.initial_load_path"):
        Trainer(load_config("grpo_qwen3_debug", [*SMALL, "--rl.engine=vllm", f"--job.dump_folder={tmp_path}"]))
    # A model of another vocabulary: refused at start-up, before a push of other shapes (which kills
    # vLLM's engine core) reaches the server; the server still serves afterwards.
    with pytest.raises(
        ConfigError,
        match=r"^engine: the server at .* serves .*, whose vocab_size is 512 where this run's model has 384",
    ):
        engine_run(tmp_path / "vocab", vllm_url, "--model.overrides.vocab_size=384", vocab_size=384)
    assert ServerClient(vllm_url, 10).healthy()


def test_a_family_vllm_cannot_serve_is_refused(tmp_path: Path, vllm_python: Path) -> None:  # noqa: F811
    overrides = [
        "--model.name=hf",
        "--hf.architecture=BioGptForCausalLM",
        "--training.task=grpo",
        "--rl.engine=vllm",
        f"--rl.engine_python={vllm_python}",
        f"--checkpoint.initial_load_path={tmp_path}",
        *SMALL,
        f"--job.dump_folder={tmp_path / 'run'}",
    ]
    with pytest.raises(ConfigError, match=r"^rl.engine = 'vllm': vLLM \(.*\) has no model class for BioGptForCausalLM"):
        Trainer(load_config("grpo_qwen3_debug", overrides))


def test_an_engine_that_never_answers_stops_the_run_in_one_line(tmp_path: Path) -> None:
    """A stand-in engine environment whose vLLM has the model class but whose server never answers:
    exit 2 within the start-up timeout."""
    python = tmp_path / "python"
    python.write_text('#!/bin/sh\n[ "$1" = "-c" ] && exit 0\nexec sleep 600\n')
    python.chmod(0o755)
    folder = qwen3_debug_folder(tmp_path / "initial")
    command = [
        sys.executable,
        "train.py",
        "--config",
        "grpo_qwen3_debug",
        *SMALL,
        "--rl.engine=vllm",
        f"--rl.engine_python={python}",
        "--rl.engine_start_timeout=5",
        f"--checkpoint.initial_load_path={folder}",
        f"--job.dump_folder={tmp_path / 'run'}",
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and len(errors) == 1, done.stderr[-2000:]
    assert "did not answer within rl.engine_start_timeout = 5 s" in errors[0] and "engine.log" in errors[0]


def test_a_killed_engine_is_started_again_and_every_step_trains_once(tmp_path: Path) -> None:
    """kill -9 of the server this run started, twice: once between two steps (the next push finds it
    gone), once in the middle of a rollout (its requests find it gone). The run finishes, each step
    trained once, its checkpoints complete, the server started again twice with the last weights, and
    no process of a killed server left behind."""
    folder = qwen3_debug_folder(tmp_path / "initial")
    overrides = [
        *SMALL,
        "--rl.engine=vllm",
        f"--checkpoint.initial_load_path={folder}",
        f"--job.dump_folder={tmp_path / 'run'}",
        "--training.steps=4",
        "--checkpoint.enable=true",
        "--checkpoint.interval=2",
    ]
    trainer = Trainer(load_config("grpo_qwen3_debug", overrides))
    try:
        engine = trainer.task.source.rollout_engine
        assert isinstance(engine, VllmEngine) and engine.managed is not None
        managed = engine.managed

        killed: list[int] = []

        def kill_server() -> None:
            assert managed.process is not None
            killed.append(managed.process.pid)  # the leader of the server's process group
            os.kill(managed.process.pid, signal.SIGKILL)

        push, request, rollouts = engine.load_weights, engine.request, [0]

        def push_after_a_kill(policy: torch.nn.Module, version: int) -> None:
            if version == 2:  # before the third rollout, between steps 2 and 3
                kill_server()
            push(policy, version)

        def requests_after_a_kill(*args: Any) -> Any:
            rollouts[0] += 1
            if rollouts[0] == 4:  # the fourth rollout's requests find the server gone
                kill_server()
            return request(*args)

        engine.load_weights = push_after_a_kill  # type: ignore[method-assign]
        engine.request = requests_after_a_kill  # type: ignore[method-assign]
        trainer.train()
        restarts = engine.restarts_done
        assert managed.process is not None
        last_group = managed.process.pid
    finally:
        trainer.close()
    assert restarts == 2
    # The killed servers' engine cores and workers went with them (left running, each kept its KV
    # cache's memory), and so did the last server at the end of the run.
    for group in [*killed, last_group]:
        with pytest.raises(ProcessLookupError):
            os.killpg(group, 0)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]
    complete = sorted(p.name for p in (tmp_path / "run" / "checkpoint").iterdir() if (p / "manifest.json").is_file())
    assert complete == ["step-2", "step-4"]


def test_an_hf_family_model_trains_on_the_engine(tmp_path: Path, vllm_url: str) -> None:  # noqa: F811
    """transformers' Qwen 3 through the hf family, built from a folder of the debug Qwen 3's shapes,
    sampled by the shared server after its weights were pushed there under transformers' names; the
    pushes go to the folder rl.engine_weights_folder names, and at the end only they are removed
    from it (bug caught: the engine's clean-up deleting a shared folder the user chose)."""
    folder = qwen3_debug_folder(tmp_path / "initial")
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "keep.txt").write_text("the user's")
    overrides = [
        *SMALL,
        "--model.name=hf",
        "--model.flavor=config",
        f"--hf.config={folder}",
        "--rl.engine=vllm",
        f"--rl.engine_urls={vllm_url}",
        f"--checkpoint.initial_load_path={folder}",
        f"--job.dump_folder={tmp_path / 'run'}",
        f"--rl.engine_weights_folder={shared}",
        "--training.steps=2",
    ]
    trainer = Trainer(load_config("grpo_qwen3_debug", overrides))
    try:
        trainer.train()
        assert [p.name for p in shared.glob("version-*")] == ["version-1"]  # each push replaces the last
    finally:
        trainer.close()
    assert [p.name for p in shared.iterdir()] == ["keep.txt"]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["rollout/engine_kl"] < 1e-3 and r["sync/bytes"] > 0 for r in steps)
