"""Multi-turn GRPO under FSDP 2 (2 CPU processes, gloo) against 1 process: the same episodes, token for
token (the model's mask, rewards, turns and how each ended included), in the rollout sampled after an
update, and the same run (each step's loss and gradient norm, the final parameters and AdamW moments)
within parity.py's float32 tolerances.

Bugs caught: episodes seeded by their place in a rank's batch instead of their row (other tokens on
another layout), a rank that stops calling the engine when its own episodes end while another rank's
go on (the FSDP gather of the next turn would hang), a mask or a token normaliser that counts the
environment's tokens on one layout and not the other, rewards not shared between ranks before the
group advantages."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.distributed import grpo_episodes_worker as worker
from tests.support.launch import torchrun
from tests.support.parity import RunResult, assert_parity

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("grpo_episodes")
    worker.write_records(out / "records.jsonl")
    torchrun(2, HERE / "grpo_episodes_worker.py", str(out), timeout=600)
    single, single_episodes = worker.reference(out)
    return {
        "fsdp2": RunResult.load(out / "fsdp2.pt"),
        "fsdp2_episodes": json.loads((out / "episodes.json").read_text()),
        "single": single,
        "single_episodes": {str(row): episode for row, episode in single_episodes.items()},
    }


def test_fsdp2_runs_the_same_episodes(runs: dict[str, Any]) -> None:
    single, sharded = runs["single_episodes"], runs["fsdp2_episodes"]
    assert sorted(sharded, key=int) == [str(r) for r in range(16)] == sorted(single, key=int)
    assert sharded == single
    # The episodes are what the test means them to be: several turns, environment tokens between them
    # (outside the mask) and rewards that differ within a group.
    assert max(e["turns"] for e in single.values()) == 2
    assert any(not all(e["trained"]) for e in single.values())
    assert len({e["reward"] for e in single.values()}) > 2


def test_fsdp2_trains_like_one_process(runs: dict[str, Any]) -> None:
    assert runs["single"].steps == runs["fsdp2"].steps == list(range(1, worker.STEPS + 1))
    assert_parity(runs["fsdp2"], runs["single"], "fsdp2 multi-turn GRPO")
