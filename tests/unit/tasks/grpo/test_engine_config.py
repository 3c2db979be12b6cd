"""The [rl] engine keys checked at load time, without a server.

Bugs caught: a vLLM-only key (a weights folder, a staleness, a memory share, the importance-sampling
correction) accepted with the builtin
sampler, where it would do nothing; a negative staleness or a URL without a scheme reaching the run."""

from __future__ import annotations

import pytest

from titan_tpu.config import ConfigError, load_config
from titan_tpu.tasks.grpo.config import RLConfig
from titan_tpu.tasks.grpo.config_checks import VLLM_ONLY


@pytest.mark.parametrize(
    "override",
    [
        "--rl.engine_weights_folder=/mnt/shared/weights",
        "--rl.max_staleness=1",
        "--rl.engine_urls=['http://127.0.0.1:8000']",
        "--rl.engine_memory=0.3",
        "--rl.sync_every=2",
        "--rl.is_correction=true",
    ],
)
def test_a_vllm_key_with_the_builtin_engine_is_refused(override: str) -> None:
    key = override.removeprefix("--").split("=")[0]
    with pytest.raises(ConfigError, match=rf"^{key}: applies to rl.engine = 'vllm'"):
        load_config("grpo_qwen3_debug", [override])
    load_config("grpo_qwen3_debug", ["--rl.engine=vllm", override])  # the same value is fine on the engine


def test_every_vllm_only_key_is_a_field_and_its_default_passes() -> None:
    rl = load_config("grpo_qwen3_debug", []).section(RLConfig)
    assert all(hasattr(rl, key) for key in VLLM_ONLY)  # a renamed key would not be checked


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("--rl.max_staleness=-1", r"^rl.max_staleness: must be >= 0"),
        ("--rl.engine_urls=['127.0.0.1:8000']", r"^rl.engine_urls: '127.0.0.1:8000' is not an http"),
        ("--rl.is_cap=0.5", r"^rl.is_cap: must be >= 1"),
    ],
)
def test_bad_engine_values_are_one_line(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config("grpo_qwen3_debug", ["--rl.engine=vllm", override])
