"""GRPO's rollout engines, as `[rl] engine` asks: the builtin sampler on the trainer's own modules, or
vLLM servers (started here from checkpoint.initial_load_path, or the user's at rl.engine_urls) with
the trainer's weights pushed to them."""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from titan_tpu.config import ConfigError
from titan_tpu.device import dtype_name
from titan_tpu.generation.builtin import BuiltinEngine
from titan_tpu.generation.vllm.client import ServedModel, ServerClient, ServerRefused
from titan_tpu.generation.vllm.engine import VllmEngine, weights_folder_for
from titan_tpu.generation.vllm.environment import engine_python
from titan_tpu.generation.vllm.errors import EngineError
from titan_tpu.generation.vllm.served_model import served_model_check
from titan_tpu.generation.vllm.server import ManagedServer, ServerSettings
from titan_tpu.lora.merge import export_merged_to_hf
from titan_tpu.protocols.rollout import RolloutEngine, SamplingParams
from titan_tpu.protocols.state_dict_adapter import StateDictAdapter
from titan_tpu.tasks.base import TaskContext
from titan_tpu.tasks.grpo.config import RLConfig

logger = logging.getLogger(__name__)

# Asks the engine environment's vLLM whether it has a model class for an architecture: exit 0 or 3.
SUPPORTS_ARCHITECTURE = (
    "import sys; from vllm.model_executor.models.registry import ModelRegistry; "
    "sys.exit(0 if sys.argv[1] in ModelRegistry.get_supported_archs() else 3)"
)


def rollout_engines(
    ctx: TaskContext,
    rl: RLConfig,
    args: Any,
    pad_id: int,
    reshard_after: Callable[[nn.Module], bool],
    lockstep: dist.ProcessGroup | None,
) -> tuple[RolloutEngine, RolloutEngine]:
    """(the rollouts' engine, held-out evaluation's engine). Evaluation decodes each rank's share in
    one batch with the builtin engine (ranks in lockstep may hold different numbers of prompts, and
    rl.rollout_buckets would give them different numbers of batches); a vLLM engine serves both."""
    if rl.engine == "vllm":
        engine = vllm_engine(ctx, rl, args)
        return engine, engine
    decoding = ctx.spec.capabilities.decoding
    assert decoding is not None  # require_decoding checked it with the model's arguments
    device = ctx.device
    return (
        BuiltinEngine(decoding, pad_id, device, reshard_after, rl.rollout_buckets, lockstep),
        BuiltinEngine(decoding, pad_id, device, reshard_after, 1, lockstep),
    )


def check_vllm_engine(ctx: TaskContext, rl: RLConfig, args: Any) -> None:
    """What the vLLM engine needs, checked before the model is built or its weights read: the family's
    Hugging Face adapter and, for a server this run starts, the initial folder to start it from and a
    vLLM that has a model class for the architecture (asked in the engine's own environment, which is
    created now if it is not there)."""
    adapter = ctx.spec.state_dict_adapter
    if adapter is None:
        raise ConfigError(
            f"rl.engine = 'vllm': model {ctx.spec.name} has no Hugging Face adapter to hand vLLM its weights"
        )
    if rl.engine_urls:
        return
    if not ctx.config.checkpoint.initial_load_path:
        raise ConfigError(
            "rl.engine = 'vllm' starts a server from checkpoint.initial_load_path (a Hugging Face folder of "
            "the run's initial weights); set it, or give a running server in rl.engine_urls"
        )
    if ctx.is_writer:
        python = engine_python(rl.engine_python, rl.engine_requirement)
        _require_architecture(python, str(adapter.to_hf_config(args)["architectures"][0]), ctx.spec.name)


def vllm_engine(ctx: TaskContext, rl: RLConfig, args: Any) -> VllmEngine:
    """The engine over rl.engine_urls, or over a server this run starts (rank 0) from the initial
    folder; `check_vllm_engine` has run."""
    config = ctx.config
    adapter = ctx.spec.state_dict_adapter
    assert adapter is not None
    hf_config = adapter.to_hf_config(args)
    # The run's initial folder holds its tokenizer, which a user's server must share.
    initial = Path(config.checkpoint.initial_load_path) if config.checkpoint.initial_load_path else None
    managed = None
    if not rl.engine_urls and ctx.is_writer:
        managed = ManagedServer(
            ServerSettings(
                python=engine_python(rl.engine_python, rl.engine_requirement),
                model_folder=Path(config.checkpoint.initial_load_path),
                dtype=dtype_name(ctx.compute_dtype),
                memory_share=rl.engine_memory,
                tensor_parallel=rl.engine_tp,
                max_model_len=config.training.seq_len,
                log=ctx.dump_folder / "engine.log",
                start_timeout=rl.engine_start_timeout,
                device_type=ctx.device.type,
            )
        )
    engine = VllmEngine(
        urls=rl.engine_urls,
        managed=managed,
        export=lambda model, folder: export_for_engine(model, folder, adapter, args, dtype_name(ctx.compute_dtype)),
        weights_folder=weights_folder_for(ctx.dump_folder, rl.engine_weights_folder),
        request_timeout=rl.engine_request_timeout,
        restarts=rl.engine_restarts,
        check_served=served_model_check(hf_config, initial, _accepts_token(hf_config["vocab_size"] - 1)),
    )
    if engine.max_model_len < config.training.seq_len:
        engine.close()
        raise EngineError(
            f"rl.engine_urls: the server's max_model_len {engine.max_model_len} is below training.seq_len "
            f"{config.training.seq_len}"
        )
    logger.info(f"engine: {engine.describe()}")
    return engine


def _require_architecture(python: Path, architecture: str, family: str) -> None:
    try:
        done = subprocess.run(
            [str(python), "-c", SUPPORTS_ARCHITECTURE, architecture], capture_output=True, text=True, timeout=300
        )
    except subprocess.TimeoutExpired:
        raise EngineError(f"engine: {python} took over 300 s to import vLLM") from None
    if done.returncode == 3:
        raise ConfigError(f"rl.engine = 'vllm': vLLM ({python}) has no model class for {architecture} (model {family})")
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise EngineError(f"engine: {python} cannot import vLLM ({last})")


def _accepts_token(token: int) -> Callable[[ServedModel], bool]:
    """Whether a server takes a prompt of `token` (a server of a smaller vocabulary answers 400)."""

    def probe(model: ServedModel) -> bool:
        try:
            ServerClient(model.url, 60.0).complete(model.name, [token], SamplingParams(1, temperature=0.0), None)
        except ServerRefused as refused:
            return refused.status >= 500
        return True

    return probe


def export_for_engine(model: nn.Module, folder: Path, adapter: StateDictAdapter, args: Any, dtype: str) -> None:
    """The weights a push hands the servers: the model as a Hugging Face folder, a LoRA run's adapters
    merged into its base. vLLM could also take the adapters alone (its LoRA requests), but the merged
    folder keeps one path for every run: the server started from the base folder reloads weights in
    place as after a full fine-tuning step, and needs no LoRA settings of its own."""
    export_merged_to_hf(model, folder, adapter, args, dtype=dtype)
