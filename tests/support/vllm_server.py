"""A real vLLM server for the engine tests: the engine's own environment (created once per machine by
the project, as a run creates it), a Hugging Face folder of the debug Qwen 3 written by our exporter,
and a server started from it. Tests that need a server of their own start one through the run."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from titan_tpu.checkpoint.hf_export import export_model_to_hf
from titan_tpu.generation.vllm.environment import engine_python
from titan_tpu.generation.vllm.server import ManagedServer, ServerSettings
from titan_tpu.models.qwen3.args import QWEN3_FLAVORS
from titan_tpu.models.qwen3.model import Qwen3Model
from titan_tpu.models.qwen3.state_dict_adapter import QWEN3_STATE_DICT_ADAPTER
from titan_tpu.tasks.grpo.config import RLConfig

REQUIREMENT = RLConfig().engine_requirement
# The tests' runs: the debug Qwen 3 in float32 (the equivalence criteria are float32's).
MAX_MODEL_LEN = 64


def qwen3_debug_folder(folder: Path, seed: int = 0, **overrides: int) -> Path:
    """A Hugging Face folder of the debug Qwen 3 with random weights (`overrides` change its sizes)."""
    args = dataclasses.replace(QWEN3_FLAVORS["debug"], max_seq_len=MAX_MODEL_LEN, **overrides)
    torch.manual_seed(seed)
    model = Qwen3Model(args)
    model.init_weights()
    export_model_to_hf(model, folder, QWEN3_STATE_DICT_ADAPTER, args)
    return folder


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The engine environment's interpreter, created on first use (minutes, once per machine)."""
    return engine_python("", REQUIREMENT)


@pytest.fixture(scope="session")
def vllm_url(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A server of the debug Qwen 3's shapes, float32, shared by the tests that give it as
    rl.engine_urls (each run pushes its own weights to it before it samples)."""
    work = tmp_path_factory.mktemp("vllm_server")
    server = ManagedServer(
        ServerSettings(
            python=vllm_python,
            model_folder=qwen3_debug_folder(work / "qwen3_debug"),
            dtype="float32",
            memory_share=0.1,
            tensor_parallel=1,
            max_model_len=MAX_MODEL_LEN,
            log=work / "engine.log",
            start_timeout=600,
            device_type="cpu",
        )
    )
    url = server.start()
    try:
        yield url
    finally:
        server.stop()
