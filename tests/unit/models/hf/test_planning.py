"""The planner plans an hf model like its native twin: Qwen 3 (dense and MoE) exported to a
Hugging Face folder and built by transformers through `[model] name = "hf"` gets the same parameter
census (whole and per device), the same activation estimate and the same memory under FSDP, TP and
EP as the native family, and the same routed FLOPs.

Bugs caught: an activation count that misses the per-head q/k norms or misreads the MLP's width; a
TP plan the planner does not read (the per-device count under tp then differs: the negative control
below); experts the census does not split over ep; a dense hf model searched over ep; a tp that the
trainer refuses (kv heads it does not divide) planned anyway.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from titan_tpu.config import ConfigError, load_config
from titan_tpu.models.hf.parallelize import HFTensorParallelPlan
from titan_tpu.models.registry import get_model_spec
from titan_tpu.plan.chips import parse_chips
from titan_tpu.plan.planner import MemoryPlan, plan_memory
from titan_tpu.plan.search import search

SEQ = ["--training.seq_len=256"]
LAYOUTS = {
    "fsdp4": ["--parallelism.dp_shard=4"],
    "tp2_fsdp2": ["--parallelism.dp_shard=2", "--parallelism.tp=2"],
    "ep2_fsdp4": ["--parallelism.dp_shard=4", "--parallelism.ep=2"],
}
CASES = [
    ("qwen3_debug", "fsdp4"),
    ("qwen3_debug", "tp2_fsdp2"),
    ("qwen3_moe_debug", "fsdp4"),
    ("qwen3_moe_debug", "tp2_fsdp2"),
    ("qwen3_moe_debug", "ep2_fsdp4"),
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each native config's model as a Hugging Face config folder (its exported config.json)."""
    made = {}
    for name in {case for case, _ in CASES}:
        config = load_config(name, SEQ)
        spec = get_model_spec(config.model.name)
        folder = tmp_path_factory.mktemp(name)
        (folder / "config.json").write_text(json.dumps(spec.state_dict_adapter.to_hf_config(spec.args_for(config))))
        made[name] = folder
    return made


def plans(name: str, layout: str, folder: Path) -> tuple[MemoryPlan, MemoryPlan]:
    native = plan_memory(load_config(name, [*SEQ, *LAYOUTS[layout]]), 4)
    hf_overrides = ["--model.name=hf", "--model.flavor=config", f"--hf.config={folder}"]
    return native, plan_memory(load_config(name, [*SEQ, *hf_overrides, *LAYOUTS[layout]]), 4)


@pytest.mark.parametrize(("name", "layout"), CASES)
def test_hf_twin_plans_like_native(name: str, layout: str, folders: dict[str, Path]) -> None:
    native, hf = plans(name, layout, folders[name])
    assert (hf.census.total, hf.census.local) == (native.census.total, native.census.local)
    assert hf.activations == native.activations
    # The buffers differ by a few bytes: FSDP pads transformers' fused [E, 2F, d] expert weights
    # and our separate [E, F, d] ones to the shard count differently.
    assert hf.memory.total == pytest.approx(native.memory.total, rel=1e-6, abs=64)


def test_hf_routed_flops_equal_native(folders: dict[str, Path]) -> None:
    native, hf = plans("qwen3_moe_debug", "fsdp4", folders["qwen3_moe_debug"])
    native_routing = get_model_spec("qwen3_moe").planning.expert_routing(native.census.args)
    hf_routing = get_model_spec("hf").planning.expert_routing(hf.census.args)
    assert hf_routing == native_routing


def test_unread_tp_plan_misses_the_count(folders: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: with the hf TP plan read as empty, every weight is counted whole on each tp
    rank, and the comparison above fails."""
    monkeypatch.setattr(HFTensorParallelPlan, "styles", lambda self, *args: {})
    native, hf = plans("qwen3_debug", "tp2_fsdp2", folders["qwen3_debug"])
    assert hf.census.local > native.census.local


def test_hf_layouts_the_trainer_refuses(folders: dict[str, Path]) -> None:
    hf = ["--model.name=hf", "--model.flavor=config", f"--hf.config={folders['qwen3_debug']}"]
    # qwen3_debug has 4 kv heads: tp 8 splits none of them whole.
    with pytest.raises(ConfigError, match="does not divide .*num_key_value_heads"):
        plan_memory(load_config("qwen3_debug", [*SEQ, *hf, "--parallelism.tp=8", "--parallelism.dp_shard=1"]), 8)
    with pytest.raises(ConfigError, match="parallelism.ep = 2: .*no expert-parallel plan"):
        plan_memory(load_config("qwen3_debug", [*SEQ, *hf, "--parallelism.dp_shard=4", "--parallelism.ep=2"]), 4)


def test_search_over_a_dense_hf_model_keeps_ep_1(folders: dict[str, Path]) -> None:
    hf = ["--model.name=hf", "--model.flavor=config", f"--hf.config={folders['qwen3_debug']}"]
    fitting, _ = search(
        load_config("qwen3_debug", [*SEQ, *hf, "--training.global_batch_size=8"]), parse_chips("v5p-8"), 0.75
    )
    assert fitting
    assert all("--parallelism.ep=1" in candidate.overrides for candidate in fitting)
    assert any("--parallelism.tp=2" in candidate.overrides for candidate in fitting)
