"""The measured kernel choice (titan_tpu/autotune/), with fake timings: what it picks, what it
refuses, what it caches, and the real attention and expert candidates checked against float32.

Bugs these catch: picking by order or by the first candidate rather than by time; trusting a fast
but wrong kernel; measuring again although the cache holds the answer (or trusting a stale or
corrupt cache); deterministic runs whose kernels depend on a timing; candidates timed one after
another, so that a machine slowing midway favours the first; the "auto" placeholder left in a model
that then runs.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
import torch

from tests.support.kernel_fakes import SHAPE, FakeArgs, FakeClock, FakeKernel, fake_tunable
from titan_tpu.autotune.cache import FILE_NAME, KernelCache
from titan_tpu.autotune.choose import KernelChoice, choose_kernels
from titan_tpu.autotune.measure import BUDGET_S, MAX_ROUNDS, MIN_ROUNDS
from titan_tpu.models.common.attention_kernels import AutoAttention, SdpaAttention, attention_kernel
from titan_tpu.models.common.attention_tunable import ATTENTION
from titan_tpu.models.llama3.args import LLAMA3_FLAVORS
from titan_tpu.models.qwen3.args import QWEN3_MOE_FLAVORS
from titan_tpu.models.qwen3.experts_tunable import EXPERTS
from titan_tpu.protocols.tunable import KernelShape


def choose(kernels: dict[str, FakeKernel], clock: FakeClock, cache: KernelCache | None = None, **kw):
    return choose_kernels(
        [fake_tunable(kernels, clock)],
        FakeArgs(),
        SHAPE,
        "fake cpu",
        deterministic=False,
        cache=cache,
        timer=clock,
        **kw,
    )


@pytest.mark.parametrize("slow", ["a", "b"])
def test_the_slow_candidate_is_not_picked(slow: str) -> None:
    kernels = {"a": FakeKernel(0.001), "b": FakeKernel(0.001)}
    kernels[slow] = FakeKernel(0.009)
    args, [choice] = choose(kernels, FakeClock())
    fast = "b" if slow == "a" else "a"
    assert args.kernel == kernels[fast] and choice.pick == fast
    assert choice.times_ms[slow] == pytest.approx(9.0) and choice.times_ms[fast] == pytest.approx(1.0)


def test_a_wrong_candidate_is_refused_even_if_fastest(caplog: pytest.LogCaptureFixture) -> None:
    kernels = {"ref": FakeKernel(0.005), "wrong": FakeKernel(0.001, error=1e-2), "close": FakeKernel(0.003, error=1e-6)}
    with caplog.at_level(logging.WARNING):
        args, [choice] = choose(kernels, FakeClock())
    assert choice.pick == "close" and choice.times_ms["wrong"] is None
    assert "candidate wrong refused (error 0.01 > 0.0001)" in caplog.text
    # Negative control: the same kernel within tolerance is the pick.
    kernels["wrong"] = FakeKernel(0.001, error=1e-6)
    assert choose(kernels, FakeClock())[1][0].pick == "wrong"


def test_a_second_run_reads_the_cache_and_measures_nothing(tmp_path: Path) -> None:
    kernels = {"a": FakeKernel(0.004), "b": FakeKernel(0.002)}
    first = choose(kernels, FakeClock(), KernelCache(tmp_path))[1][0]
    assert first.pick == "b" and first.source.startswith("measured")
    clock = FakeClock()
    args, [second] = choose(kernels, clock, KernelCache(tmp_path))
    assert (second.pick, second.source, clock.reads, clock.now) == ("b", "cached", 0, 0.0)
    assert args.kernel == kernels["b"]
    # Another shape, or the same computed under autocast, is another key: measured, and added.
    bf16 = dataclasses.replace(SHAPE, dtype=torch.bfloat16)
    others = [dataclasses.replace(SHAPE, seq_len=16), bf16, dataclasses.replace(bf16, autocast=True)]
    for entries, other in enumerate(others):
        clock = FakeClock()
        choose_kernels(
            [fake_tunable(kernels, clock)],
            FakeArgs(),
            other,
            "fake cpu",
            deterministic=False,
            cache=KernelCache(tmp_path),
            timer=clock,
        )
        assert clock.reads > 0 and len(json.loads((tmp_path / FILE_NAME).read_text())) == 2 + entries


def test_a_cached_pick_that_is_no_longer_a_candidate_is_measured_again(tmp_path: Path) -> None:
    choose({"a": FakeKernel(0.004), "b": FakeKernel(0.002)}, FakeClock(), KernelCache(tmp_path))
    clock = FakeClock()
    [choice] = choose({"a": FakeKernel(0.004), "c": FakeKernel(0.001)}, clock, KernelCache(tmp_path))[1]
    assert choice.pick == "c" and clock.reads > 0


@pytest.mark.parametrize("text", ["{not json", '{"k": {"pick": 3}}', "[1, 2]", "\udcff"])
def test_a_corrupt_cache_is_ignored_with_one_line_and_kept_aside(
    tmp_path: Path, text: str, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / FILE_NAME).write_text(text, errors="surrogateescape")
    with caplog.at_level(logging.WARNING):
        cache = KernelCache(tmp_path)
        [choice] = choose({"a": FakeKernel(0.004), "b": FakeKernel(0.002)}, FakeClock(), cache)[1]
    assert choice.source.startswith("measured") and choice.pick == "b"
    assert len(caplog.records) == 1 and "ignored" in caplog.text and "measuring again" in caplog.text
    [aside] = tmp_path.glob(f"{FILE_NAME}.unreadable-*")
    assert aside.read_bytes() == text.encode(errors="surrogateescape")
    assert json.loads((tmp_path / FILE_NAME).read_text())  # the new table


def test_deterministic_runs_take_the_fallback_without_timing() -> None:
    clock = FakeClock()
    kernels = {"a": FakeKernel(0.009), "b": FakeKernel(0.001)}
    args, [choice] = choose_kernels(
        [fake_tunable(kernels, clock)], FakeArgs(), SHAPE, "fake cpu", deterministic=True, cache=None, timer=clock
    )
    assert (choice.pick, choice.source, clock.reads) == ("a", "deterministic", 0)


def test_a_forced_field_and_a_single_candidate_are_not_measured() -> None:
    clock = FakeClock()
    forced = FakeArgs(kernel="b")
    args, choices = choose_kernels(
        [fake_tunable({"a": FakeKernel(1.0)}, clock)], forced, SHAPE, "x", deterministic=False, cache=None, timer=clock
    )
    # The log still says what runs, and why.
    assert choices == [KernelChoice("kernel", "b", "forced by the config", {})]
    assert args is forced and clock.reads == 0
    args, [choice] = choose({"only": FakeKernel(1.0)}, clock)
    assert choice.source == "only candidate" and clock.reads == 0


def test_the_auto_placeholder_fails_if_a_model_ever_runs_it() -> None:
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="never replaced"):
        AutoAttention()(q, q, q)
    assert attention_kernel("auto") == AutoAttention()


def test_attention_candidates_agree_with_float32_and_a_perturbed_one_is_refused(monkeypatch) -> None:
    args = dataclasses.replace(LLAMA3_FLAVORS["debug"], attention=AutoAttention())
    shape = KernelShape(torch.device("cpu"), torch.float32, batch=1, seq_len=256)
    candidates = ATTENTION.candidates(args, shape)
    assert list(candidates) == ["sdpa", "blocked:64", "blocked:128"]
    from titan_tpu.autotune.measure import check

    assert check(ATTENTION, args, shape, candidates) == {}
    shape16 = dataclasses.replace(shape, dtype=torch.bfloat16)
    assert check(ATTENTION, args, shape16, candidates) == {}

    def perturbed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return SdpaAttention()(q, k, v) * 1.05

    refused = check(ATTENTION, args, shape16, {**candidates, "perturbed": perturbed})
    assert list(refused) == ["perturbed"]


@pytest.mark.parametrize("autocast", [False, True])
def test_expert_candidates_agree_with_the_loop(autocast: bool) -> None:
    """Also as one bf16 process computes them: float32 weights and inputs under autocast."""
    args = QWEN3_MOE_FLAVORS["debug_moe"]
    from titan_tpu.autotune.measure import check

    for dtype in (torch.float32, torch.bfloat16):
        shape = KernelShape(
            torch.device("cpu"), dtype, batch=1, seq_len=64, autocast=autocast and dtype != torch.float32
        )
        candidates = EXPERTS.candidates(args, shape)
        assert ("grouped_mm" in candidates) == (dtype == torch.bfloat16)
        assert check(EXPERTS, args, shape, candidates) == {}


def test_a_machine_that_slows_down_midway_does_not_pick_the_candidate_timed_first() -> None:
    """b is 10% faster, but each kernel run costs 5% more than the last (a neighbour starting up).
    Timed one candidate after the other, a's runs would all come before b's and a would win; timed
    round-robin, b wins."""
    clock = FakeClock(slowdown=1.05)
    [choice] = choose({"a": FakeKernel(0.0010), "b": FakeKernel(0.0009)}, clock)[1]
    assert choice.pick == "b"


def test_a_hopeless_candidate_is_timed_once() -> None:
    """Its warm-up alone is over HOPELESS times the best so far; a merely slower one is timed fully."""
    clock = FakeClock()
    [choice] = choose({"a": FakeKernel(0.001), "b": FakeKernel(0.010)}, clock)[1]
    assert choice.pick == "a" and choice.times_ms["b"] == pytest.approx(10.0)
    # a: its warm-up and MAX_ROUNDS timed runs (40 ms in all, under the budget), 2 reads each; b: its warm-up.
    assert clock.reads == 2 * (1 + MAX_ROUNDS) + 2
    clock = FakeClock()
    choose({"a": FakeKernel(0.001), "b": FakeKernel(0.003)}, clock)
    assert clock.reads == 2 * 2 * (1 + MAX_ROUNDS)


def test_rounds_run_until_the_budget_once_the_minimum_is_timed() -> None:
    """Short kernels get more rounds (the noise of one run is ~30% on a shared CPU), long ones the
    minimum: bugs caught are a fixed round count, or a budget that stops before MIN_ROUNDS."""
    # Two candidates of equal cost: a round costs twice the cost; 0.1 s -> 8 rounds reach 1.6 s > 1.5 s.
    assert BUDGET_S == 1.5
    for cost, rounds in ((0.1, 8), (1.0, MIN_ROUNDS), (0.001, MAX_ROUNDS)):
        clock = FakeClock()
        choose({"a": FakeKernel(cost), "b": FakeKernel(cost)}, clock)
        # Less the correctness check (the reference, then each candidate) and the two warm-ups.
        assert (clock.runs - 3 - 2) / 2 == rounds, cost


def test_an_autocast_run_is_measured_under_autocast_with_its_inputs_dtype() -> None:
    from titan_tpu.autotune.measure import in_run_precision

    seen: list[tuple[torch.dtype, bool]] = []
    tunable = fake_tunable({"a": FakeKernel(0.0)}, FakeClock())
    workload = tunable.workload

    def recording(args, shape):
        run = workload(args, shape)
        return lambda value, dtype: seen.append((dtype, torch.is_autocast_enabled("cpu"))) or run(value, dtype)

    bf16 = dataclasses.replace(SHAPE, dtype=torch.bfloat16)
    for float32_inputs in (False, True):
        t = dataclasses.replace(tunable, workload=recording, float32_inputs_under_autocast=float32_inputs)
        in_run_precision(t, FakeArgs(), bf16)(FakeKernel(0.0))
        in_run_precision(t, FakeArgs(), dataclasses.replace(bf16, autocast=True))(FakeKernel(0.0))
    assert seen == [(torch.bfloat16, False), (torch.bfloat16, True), (torch.bfloat16, False), (torch.float32, True)]
