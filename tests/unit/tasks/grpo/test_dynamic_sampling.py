"""Dynamic sampling (rl.dynamic_sampling, titan_tpu/tasks/grpo/draws.py): a group whose rewards all tie
is never trained, more prompts are drawn (and counted) until the batch is full, rl.max_draws bounds
the draws, data-parallel ranks train the rows their places in the batch give them whoever sampled
them, and a resumed run draws exactly what the uninterrupted one draws.

The drawer's tests use a fake engine whose completion of a row names the draw and row that sampled it,
and rewards that tie exactly for the prompts marked so; two data-parallel ranks are two threads that
exchange their sums and rows through a barrier, as the all-reduce and all-gather would.

Bugs caught: a tied group kept (or a varied one dropped), a kept group's rows trained with another
draw's completions, prompts drawn but not counted or not consumed (a resume would draw them again),
an unbounded loop on rewards that never vary, a rank training rows it did not receive."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from tests.support.grpo_record_runs import run_on_records, stopped_after
from titan_tpu.generation.vllm.engine import VllmEngine
from titan_tpu.protocols.rollout import Rollout
from titan_tpu.tasks.grpo import draws as draws_module
from titan_tpu.tasks.grpo.config import RLConfig
from titan_tpu.tasks.grpo.draws import DynamicSamplingShort, RolloutBatch, RolloutDrawer, RolloutPosition
from titan_tpu.tasks.grpo.producer import Sampled
from titan_tpu.tasks.grpo.prompts import Prompt, PromptStream
from titan_tpu.tasks.grpo.sampling import RolloutSource

GROUP, PER_STEP = 2, 4
ROWS = GROUP * PER_STEP
# Prompt k's group ties when TIES[k]; the stream's seeded order shuffles them.
TIES = [k % 3 != 1 for k in range(30)]


def prompts() -> list[Prompt]:
    return [Prompt(f"p{k}", [k], {"tie": TIES[k]}, f"prompt {k}") for k in range(len(TIES))]


class FakeSource:
    """Samples the rows `mine` of draw `index`: row r's completion is [index, r]."""

    def __init__(self, stream: PromptStream, mine: list[int]) -> None:
        self.stream, self.mine = stream, mine

    def rollout(self, model: Any, index: int, version: int, params: Any) -> tuple[Sampled, float]:
        sampled = Sampled(index=index, prompts=self.stream.at(index * PER_STEP, PER_STEP), version=version)
        sampled.completions = {r: [index, r] for r in self.mine}
        sampled.logps = {r: torch.tensor([-float(index), -float(r)]) for r in self.mine}
        return sampled, 0.0


def score(sampled: Sampled, mine: list[int]) -> dict[str, list[float]]:
    """A tied group's rewards are all 0.5; another's are 0 and 1."""
    rewards = [0.5 if sampled.prompts[r // GROUP].record["tie"] else float(r % GROUP) for r in mine]
    return {"reward": rewards, "length": [2.0] * len(mine), "tokens": [2.0] * len(mine)}


def drawer(
    mine: list[int] | None = None, sum_ranks: Any = lambda t: t, group: Any = None, **rl: Any
) -> tuple[RolloutDrawer, RolloutPosition]:
    mine = list(range(ROWS)) if mine is None else mine
    config = RLConfig(group_size=GROUP, prompts_per_step=PER_STEP, **rl)
    stream = PromptStream(prompts(), seed=0)
    position = RolloutPosition(stream, PER_STEP)
    source = FakeSource(stream, mine)
    made = RolloutDrawer(config, source, position, lambda s: score(s, mine), sum_ranks, group)  # type: ignore[arg-type]
    return made, position


def next_batch(made: RolloutDrawer) -> RolloutBatch:
    return made.next_batch(None, version=0, params=None)  # type: ignore[arg-type]


def test_tied_groups_are_dropped_and_more_prompts_drawn() -> None:
    made, position = drawer(dynamic_sampling=True, max_draws=10)
    order = PromptStream(prompts(), seed=0).at(0, 40)  # the stream as an uninterrupted run sees it
    batch = next_batch(made)
    rewards = batch.table["reward"].view(-1, GROUP)
    assert (rewards.amax(1) > rewards.amin(1)).all()  # no tied group in what is trained
    varied = [k for k, p in enumerate(order) if not p.record["tie"]]
    assert [p.ids for p in batch.prompts] == [order[k].ids for k in varied[:PER_STEP]]  # the first varied, in order
    draws = len(batch.draws)
    assert draws == varied[PER_STEP - 1] // PER_STEP + 1 > 1  # drawn until the fourth varied group
    assert position.stream.position == draws * PER_STEP and position.rollouts == 1  # every drawn prompt consumed
    # Each row trains the completion its own draw sampled for it.
    for j, k in enumerate(varied[:PER_STEP]):
        for i in range(GROUP):
            assert batch.completions[j * GROUP + i] == [k // PER_STEP, (k % PER_STEP) * GROUP + i]
            assert batch.logps[j * GROUP + i].tolist() == [-(k // PER_STEP), -((k % PER_STEP) * GROUP + i)]
    # The next batch starts after the last draw: the rest of it (past the four kept groups) is dropped.
    second = next_batch(made)
    assert second.draws[0].sampled.index == draws
    assert [p.ids for p in second.prompts] == [order[k].ids for k in varied if k >= draws * PER_STEP][:PER_STEP]


def test_without_dynamic_sampling_the_batch_is_one_draw_ties_included() -> None:
    made, position = drawer()
    batch = next_batch(made)
    assert len(batch.draws) == 1 and position.stream.position == PER_STEP
    assert batch.completions == batch.draws[0].sampled.completions
    tied = batch.table["reward"].view(-1, GROUP)
    assert (tied.amax(1) == tied.amin(1)).any()  # this stream's first draw has a tied group, kept


def test_the_draws_are_bounded() -> None:
    global TIES
    saved, TIES = TIES, [True] * len(TIES)  # rewards that never vary
    try:
        made, position = drawer(dynamic_sampling=True, max_draws=3)
        with pytest.raises(DynamicSamplingShort, match=r"rl\.dynamic_sampling: 3 draws \(rl\.max_draws\)") as error:
            next_batch(made)
    finally:
        TIES = saved
    assert "\n" not in str(error.value) and "found 0 of the 4 groups" in str(error.value)
    assert position.stream.position == 3 * PER_STEP and position.rollouts == 0


class Exchange:
    """What an all-reduce and an all-gather do for `world` ranks, with one thread per rank."""

    def __init__(self, world: int) -> None:
        self.barrier = threading.Barrier(world)
        self.slots: list[Any] = [None] * world

    def everyone(self, rank: int, value: Any) -> list[Any]:
        self.slots[rank] = value
        self.barrier.wait()
        values = list(self.slots)
        self.barrier.wait()
        return values


def test_two_ranks_train_the_rows_one_rank_does(monkeypatch: pytest.MonkeyPatch) -> None:
    exchange = Exchange(2)

    def gather(local: dict, group: Any) -> dict:
        if group is None:  # the one-rank run
            return local
        merged: dict = {}
        for rows in exchange.everyone(group, local):
            merged.update(rows)
        return merged

    monkeypatch.setattr(draws_module, "gather_rows", gather)
    alone = next_batch(drawer(dynamic_sampling=True)[0])
    results: dict[int, RolloutBatch] = {}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        mine = list(range(r * ROWS // 2, (r + 1) * ROWS // 2))  # rollout.rank_rows with one mini-batch
        made, _ = drawer(mine, lambda t: sum(exchange.everyone(r, t)), r, dynamic_sampling=True)
        try:
            results[r] = next_batch(made)
        except BaseException as error:  # raised again in the test's thread
            errors.append(error)
            exchange.barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors
    assert len(alone.draws) > 1  # rows did move between ranks
    for r, batch in results.items():
        assert torch.equal(batch.table["reward"], alone.table["reward"])  # every rank keeps the same groups
        mine = list(range(r * ROWS // 2, (r + 1) * ROWS // 2))
        assert batch.completions == {row: alone.completions[row] for row in mine}
        assert all(torch.equal(batch.logps[row], alone.logps[row]) for row in mine)


def test_an_old_checkpoint_without_the_rollout_count_resumes() -> None:
    stream = PromptStream(prompts(), seed=0)
    position = RolloutPosition(stream, PER_STEP)
    position.load_state_dict({**stream.state_dict(), "position": 12})  # saved before dynamic sampling
    assert (position.rollouts, position.draw) == (3, 3)
    position.rollouts = 2  # with dynamic sampling the two differ, and both are saved
    again = RolloutPosition(PromptStream(prompts(), seed=0), PER_STEP)
    again.load_state_dict(position.state_dict())
    assert (again.rollouts, again.stream.position) == (2, 12)


class RecordingEngine(VllmEngine):
    """A vLLM engine without a server: row completions from their seeds, pushes recorded."""

    def __init__(self) -> None:
        self.pushes: list[int] = []
        self.asked: list[int] = []  # the seeds of every request, in the order they came

    def load_weights(self, policy: Any, version: int) -> None:
        self.pushes.append(version)

    def request(self, prompts: Any, params: Any, seeds: Any = None) -> Rollout:
        self.asked += list(seeds)
        tokens = [[seed % 5, seed % 3] for seed in seeds]
        return Rollout(tokens, [torch.zeros(2) for _ in tokens], [True] * len(tokens))

    def recover_if_failed(self, failure: str | None) -> bool:
        assert failure is None
        return False

    def close(self) -> None:
        pass


def test_the_asynchronous_producer_draws_what_synchronous_sampling_draws() -> None:
    """rl.max_staleness > 0: the sampling thread samples draws ahead, by their place in the stream, and
    the batches are the synchronous run's; every draw's weights are at most max_staleness batches old."""
    steps_per_rollout = 2

    def batches(staleness: int) -> tuple[list[RolloutBatch], RecordingEngine]:
        config = RLConfig(
            group_size=GROUP, prompts_per_step=PER_STEP, engine="vllm", max_staleness=staleness, dynamic_sampling=True
        )
        stream = PromptStream(prompts(), seed=0)
        position = RolloutPosition(stream, PER_STEP)
        ctx = SimpleNamespace(config=SimpleNamespace(training=SimpleNamespace(seed=0)), is_writer=True)
        source = RolloutSource(ctx, config, stream, ROWS)  # type: ignore[arg-type]
        engine = RecordingEngine()
        source.rollout_engine, source.mine = engine, list(range(ROWS))

        def varied(sampled: Sampled) -> dict[str, list[float]]:  # ties where the two tokens agree
            rewards = [float(sampled.completions[r][0] == sampled.completions[r][1]) for r in range(ROWS)]
            return {"reward": rewards, "length": [2.0] * ROWS, "tokens": [2.0] * ROWS}

        made = RolloutDrawer(config, source, position, varied, lambda t: t, None)
        out = [made.next_batch(nn.Linear(1, 1), k * steps_per_rollout, None) for k in range(3)]  # type: ignore[arg-type]
        source.close()
        return out, engine

    synchronous, _ = batches(0)
    ahead, engine = batches(2)
    assert sum(len(b.draws) for b in synchronous) > 3  # groups were dropped and drawn again
    for one, other in zip(synchronous, ahead):
        assert [d.sampled.index for d in one.draws] == [d.sampled.index for d in other.draws]
        assert one.completions == other.completions
        assert torch.equal(one.table["reward"], other.table["reward"])
    for k, batch in enumerate(ahead):
        assert all(k * steps_per_rollout - d.sampled.version <= 2 * steps_per_rollout for d in batch.draws)
    assert engine.pushes == [0, 2, 4]


# ---------------------------------------------------------------------------- a run, resumed

REWARD_MODULE = """
calls = []

def quarter(prompts, completions, records):
    calls.append(list(prompts))
    return [float(sum(c.encode("utf-8", "replace")) % 4 == 0) for c in completions]
"""
COMPARED = ("loss", "grad_norm", "reward_mean", "prompts_drawn", "tied_groups", "completion_length")


def _run(tmp_path: Path, dump: Path, steps: int) -> tuple[int, dict[int, dict], list[list[str]]]:
    # A small lr: at 1e-2 the random policy collapses to one answer within steps, and every group ties.
    return run_on_records(
        tmp_path, dump, steps, "dynamic_reward:quarter", "--optimizer.lr=1e-4", "--rl.dynamic_sampling=true"
    )


@pytest.mark.usefixtures("one_thread")
def test_a_run_trains_no_tied_group_and_resumes_exactly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "dynamic_reward.py").write_text(REWARD_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    from titan_tpu.tasks.grpo import task as task_module

    trained: list[torch.Tensor] = []
    real = task_module.rollout_advantages

    def recording(rewards: torch.Tensor, *args: Any) -> torch.Tensor:
        trained.append(rewards.clone())
        return real(rewards, *args)

    monkeypatch.setattr(task_module, "rollout_advantages", recording)
    _, straight, straight_draws = _run(tmp_path, tmp_path / "a", steps=4)
    assert len(trained) == 4  # one rollout batch per step
    for rewards in trained:
        grouped = rewards.view(-1, 4)
        assert (grouped.amax(1) > grouped.amin(1)).all(), "a group whose rewards all tie was trained"
    drawn = [straight[s]["prompts_drawn"] for s in range(1, 5)]
    assert all(n >= 2 for n in drawn) and any(n > 2 for n in drawn), drawn  # more drawn, and counted
    assert len(straight_draws) == sum(drawn) / 2  # one reward call per draw of two prompts
    assert any(straight[s]["tied_groups"] > 0 for s in range(1, 5))
    stopped_after(tmp_path / "a", tmp_path / "b", step=2)
    start, resumed, resumed_draws = _run(tmp_path, tmp_path / "b", steps=4)
    assert start == 2 and sorted(resumed) == [3, 4]
    drawn_before = int(sum(drawn[:2]) / 2)
    assert resumed_draws == straight_draws[drawn_before:]  # the draws after the checkpoint, no more, no less
    for step in (3, 4):
        for key in COMPARED:
            assert resumed[step][key] == straight[step][key], f"step {step} {key}"
