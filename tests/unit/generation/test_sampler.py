"""The KV-cached sampler against plain uncached decoding, and its per-row randomness."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from titan_tpu.generation import sampler
from titan_tpu.generation.sampler import (
    generate,
    generate_by_length,
    length_buckets,
    pick_tokens,
    row_uniforms,
)
from titan_tpu.models.common.decode_step import DECODER_DECODING
from titan_tpu.models.common.kv_cache import KVCache
from titan_tpu.models.qwen3.args import QWEN3_FLAVORS
from titan_tpu.models.qwen3.model import Qwen3Model
from titan_tpu.protocols.model_spec import Decoding
from titan_tpu.protocols.rollout import SamplingParams

PAD = 0
PROMPTS = [[5, 9, 23, 7, 11], [42, 8], [100, 3, 17], [64]]


def tiny_model() -> Qwen3Model:
    torch.manual_seed(0)
    args = dataclasses.replace(
        QWEN3_FLAVORS["debug"],
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        ffn_hidden_dim=128,
        vocab_size=128,
        max_seq_len=64,
    )
    model = Qwen3Model(args)
    model.init_weights()
    # A larger init than the training default, so the greedy choice is decided by clear margins
    # and depends on every earlier token (a near-uniform model would repeat one token).
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    return model.eval()


def greedy_stopping_at_the_second_token(model: Qwen3Model) -> SamplingParams:
    """Greedy decoding of PROMPTS with stop tokens that end every row by its 2nd token."""
    free = generate(model, DECODER_DECODING, PROMPTS, SamplingParams(12, temperature=0.0), PAD, torch.device("cpu"))
    stops = tuple({int(free.tokens[i, 1]) for i in range(len(PROMPTS))})
    return SamplingParams(12, temperature=0.0, stop_ids=stops)


@torch.no_grad()
def uncached_greedy(model: Qwen3Model, prompt: list[int], steps: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(steps):
        tokens.append(int(model(torch.tensor([tokens]))[0, -1].argmax()))
    return tokens[len(prompt) :]


def test_cached_greedy_equals_uncached_greedy() -> None:
    model = tiny_model()
    params = SamplingParams(max_new_tokens=12, temperature=0.0)
    got = generate(model, DECODER_DECODING, PROMPTS, params, pad_id=PAD, device=torch.device("cpu"))
    expected = [uncached_greedy(model, p, 12) for p in PROMPTS]
    assert got.tokens.tolist() == expected
    assert got.mask.all()
    # Negative control: the same prompts as if the left padding were real tokens. The sampler's
    # output must differ from that for a padded row, or the comparison could not see a padding leak.
    width = max(len(p) for p in PROMPTS)
    leaky = [uncached_greedy(model, [PAD] * (width - len(p)) + p, 12) for p in PROMPTS]
    assert any(leaky[i] != expected[i] for i in range(len(PROMPTS)) if len(PROMPTS[i]) < width)


def test_stop_tokens_end_a_row_and_mask_the_rest() -> None:
    model = tiny_model()
    free = generate(
        model, DECODER_DECODING, PROMPTS, SamplingParams(max_new_tokens=12, temperature=0.0), PAD, torch.device("cpu")
    )
    stop = int(free.tokens[1, 3])  # the 4th token of row 1 becomes a stop token
    params = SamplingParams(max_new_tokens=12, temperature=0.0, stop_ids=(stop,))
    got = generate(model, DECODER_DECODING, PROMPTS, params, PAD, torch.device("cpu"))
    row = got.tokens[1].tolist()
    first = row.index(stop)
    assert first <= 3 and bool(got.stopped[1])
    assert got.mask[1, : first + 1].all() and not got.mask[1, first + 1 :].any()
    assert all(t == PAD for t in row[first + 1 :])
    assert got.lists()[1] == row[: first + 1]


def test_a_rows_sample_does_not_depend_on_its_batch() -> None:
    model = tiny_model()
    params = SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.9)
    seeds = [11, 12, 13, 14]
    together = generate(
        model, DECODER_DECODING, PROMPTS, params, PAD, torch.device("cpu"), uniforms=row_uniforms(seeds, 10)
    )
    alone = generate(
        model, DECODER_DECODING, PROMPTS[2:3], params, PAD, torch.device("cpu"), uniforms=row_uniforms(seeds[2:3], 10)
    )
    assert together.lists()[2] == alone.lists()[0]
    # Negative control: another seed for that row gives another completion.
    other = generate(
        model, DECODER_DECODING, PROMPTS[2:3], params, PAD, torch.device("cpu"), uniforms=row_uniforms([99], 10)
    )
    assert other.lists()[0] != alone.lists()[0]


def test_inverse_cdf_follows_the_top_p_nucleus() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    logits = probs.log()[None].expand(2000, 4)
    u = (torch.arange(2000, dtype=torch.float64) + 0.5) / 2000  # evenly spread uniforms
    picks = pick_tokens(logits, SamplingParams(max_new_tokens=1, temperature=1.0, top_p=0.75), u)
    counts = torch.bincount(picks, minlength=4).double() / 2000
    # The nucleus for top_p 0.75 is {0, 1} (0.5 falls short, 0.5 + 0.3 reaches it): renormalised 5/8, 3/8.
    assert counts.tolist() == pytest.approx([0.625, 0.375, 0.0, 0.0], abs=1e-3)
    full = pick_tokens(logits, SamplingParams(max_new_tokens=1, temperature=1.0, top_p=1.0), u)
    assert (torch.bincount(full, minlength=4).double() / 2000).tolist() == pytest.approx(probs.tolist(), abs=1e-3)
    # top_p 1 skips the sort: the frequencies follow the distribution in any vocabulary order.
    shuffled = probs[[3, 1, 0, 2]]
    picks = pick_tokens(shuffled.log()[None].expand(2000, 4), SamplingParams(1, temperature=1.0, top_p=1.0), u)
    assert (torch.bincount(picks, minlength=4).double() / 2000).tolist() == pytest.approx(shuffled.tolist(), abs=1e-3)


def test_the_moe_model_decodes_the_same_tokens_cached_and_uncached() -> None:
    """Qwen 3 MoE through the KV cache (GRPO on qwen3_moe_*): the cached greedy tokens equal those of
    the plain training forward re-run on the whole sequence at every step."""
    from titan_tpu.models.qwen3.args import QWEN3_MOE_FLAVORS
    from titan_tpu.models.qwen3.model import Qwen3MoeModel

    torch.manual_seed(0)
    args = dataclasses.replace(QWEN3_MOE_FLAVORS["debug_moe"], n_layers=2, vocab_size=128, max_seq_len=64)
    model = Qwen3MoeModel(args)
    model.init_weights()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.3)
    model.eval()

    @torch.no_grad()
    def uncached(prompt: list[int], steps: int) -> list[int]:
        tokens = list(prompt)
        for _ in range(steps):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
        return tokens[len(prompt) :]

    got = generate(
        model, DECODER_DECODING, PROMPTS, SamplingParams(max_new_tokens=10, temperature=0.0), PAD, torch.device("cpu")
    )
    expected = [uncached(p, 10) for p in PROMPTS]
    assert got.tokens.tolist() == expected
    # Negative control: the prompts as if their left padding were real tokens decode otherwise, so a
    # padding leak through the cache or the router would show.
    width = max(len(p) for p in PROMPTS)
    leaky = [uncached([PAD] * (width - len(p)) + p, 10) for p in PROMPTS]
    assert any(leaky[i] != expected[i] for i in range(len(PROMPTS)) if len(PROMPTS[i]) < width)


def test_a_repeated_prompt_is_prefilled_once_and_each_copy_samples_as_if_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """GRPO asks for every prompt group_size times: the prefill runs on the distinct prompts only, and
    each copy, with its own random numbers, samples what it samples alone (tokens and log-probs).
    Catches a copy given another prompt's cache rows or logits, and a prefill of every copy."""
    model = tiny_model()
    prompts = [PROMPTS[1], PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[0], PROMPTS[1]]
    seeds = list(range(20, 20 + len(prompts)))
    params = SamplingParams(10, temperature=1.0)
    cpu = torch.device("cpu")
    prefill_rows: list[int] = []
    hook = model.register_forward_pre_hook(lambda module, args: prefill_rows.append(args[0].shape[0]) or None)
    shared = generate(model, DECODER_DECODING, prompts, params, PAD, cpu, uniforms=row_uniforms(seeds, 10))
    hook.remove()
    assert prefill_rows[0] == 3, prefill_rows
    for row, (prompt, seed) in enumerate(zip(prompts, seeds)):
        alone = generate(model, DECODER_DECODING, [prompt], params, PAD, cpu, uniforms=row_uniforms([seed], 10))
        assert shared.lists()[row] == alone.lists()[0], row
        torch.testing.assert_close(shared.logp_lists()[row], alone.logp_lists()[0], rtol=0, atol=1e-5)

    # Negative control: copies pointed at the wrong distinct prompt sample other completions.
    def shifted(prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
        distinct, copies = real(prompts)
        return distinct, [(k + 1) % len(distinct) for k in copies]

    real = sampler.distinct_prompts
    monkeypatch.setattr(sampler, "distinct_prompts", shifted)
    wrong = generate(model, DECODER_DECODING, prompts, params, PAD, cpu, uniforms=row_uniforms(seeds, 10))
    assert wrong.lists() != shared.lists()


def test_dropping_finished_rows_from_the_batch_changes_no_completion(monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode batch shrinks as rows stop (sampler.COMPACT_BELOW); every row's tokens, with its own
    random numbers, are those of decoding the whole batch to the end."""

    monkeypatch.setattr(sampler, "STOP_CHECK_EVERY", 1)  # a chance to compact after every token
    model = tiny_model()
    prompts = [[5 + i, 9, 23 + i] for i in range(8)]
    free = generate(
        model,
        DECODER_DECODING,
        prompts,
        SamplingParams(12, temperature=1.0),
        PAD,
        torch.device("cpu"),
        uniforms=row_uniforms(list(range(8)), 12),
    )
    # Stop on tokens some rows sample early: rows finish at different steps.
    stops = tuple({int(free.tokens[i, 2 + i % 5]) for i in range(0, 8, 2)})
    params = SamplingParams(12, temperature=1.0, stop_ids=stops)
    results = {}
    for share in (0.0, 1.0):  # never compact; compact at every step where a row has finished
        monkeypatch.setattr(sampler, "COMPACT_BELOW", share)
        got = generate(
            model,
            DECODER_DECODING,
            prompts,
            params,
            PAD,
            torch.device("cpu"),
            uniforms=row_uniforms(list(range(8)), 12),
        )
        results[share] = (got.lists(), got.stopped.tolist())
    assert results[1.0] == results[0.0]
    lengths = {len(ids) for ids in results[0.0][0]}
    assert len(lengths) > 1 and any(results[0.0][1]), "rows must stop at different steps for this to test anything"


def test_a_rank_in_lockstep_decodes_until_every_rank_has_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under expert parallelism every forward exchanges tokens with the other ranks of the ep group,
    which sample other prompts: a rank whose rows have all stopped must keep running forwards (on at
    least one row) until the group's all-reduce says every rank has stopped, and its completions must
    not change. The other rank is simulated: the all-reduce reports it still decoding for 9 checks.
    Bugs caught: a rank leaving the decode loop on its own decision (the others then wait in an
    all-to-all for ever), the batch compacted to no rows, padding steps leaking into a completion."""

    monkeypatch.setattr(sampler, "STOP_CHECK_EVERY", 1)  # the counts below are per token
    model = tiny_model()
    params = greedy_stopping_at_the_second_token(model)
    batches: list[int] = []
    # Every cached forward (the prefill, each decode step, through the modules or the fused decoder)
    # records its tokens' slots in the cache first.
    advance = KVCache.advance
    monkeypatch.setattr(
        KVCache,
        "advance",
        lambda cache, start, tokens, mask: (batches.append(tokens.shape[0]), advance(cache, start, tokens, mask))[1],
    )
    alone = generate(model, DECODER_DECODING, PROMPTS, params, PAD, torch.device("cpu"))
    alone_forwards = len(batches)
    batches.clear()
    other_rank_running = iter([1] * 9)

    def all_reduce(tensor: torch.Tensor, op: object, group: object) -> None:
        tensor.copy_(torch.maximum(tensor, torch.tensor([next(other_rank_running, 0)], dtype=tensor.dtype)))

    monkeypatch.setattr(sampler.dist, "all_reduce", all_reduce)
    locked = generate(model, DECODER_DECODING, PROMPTS, params, PAD, torch.device("cpu"), lockstep=object())  # type: ignore[arg-type]
    assert alone_forwards == 2, "every row must stop at its 2nd token for the forward counts below"
    assert len(batches) == 1 + 9 and min(batches) > 0  # the prefill, then one step per check the other rank ran
    assert locked.lists() == alone.lists() and locked.stopped.tolist() == alone.stopped.tolist()
    assert not locked.mask[:, 2:].any() and (locked.tokens[:, 2:] == PAD).all()


def test_the_host_looks_at_the_stopped_rows_every_few_tokens_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """On an accelerator each look at which rows stopped waits for the device, so it happens every
    STOP_CHECK_EVERY tokens; rows stopped in between decode padding, and the completions (tokens,
    masks, trimmed length) are those of looking after every token. Bugs caught: a look per token, a
    padding step leaking into a completion, the completions not trimmed to the last real token."""

    model = tiny_model()
    params = greedy_stopping_at_the_second_token(model)
    looks: list[int] = []
    all_stopped = sampler._all_stopped
    monkeypatch.setattr(
        sampler, "_all_stopped", lambda stopped, group: (looks.append(1), all_stopped(stopped, group))[1]
    )
    results = {}
    for every in (1, 4):
        monkeypatch.setattr(sampler, "STOP_CHECK_EVERY", every)
        looks.clear()
        got = generate(model, DECODER_DECODING, PROMPTS, params, PAD, torch.device("cpu"))
        results[every] = (got.tokens.tolist(), got.mask.tolist(), got.stopped.tolist(), len(looks))
    assert results[1][3] == 2 and results[4][3] == 1  # stopped at token 2: looked at tokens 1, 2 / at token 4
    assert results[4][:3] == results[1][:3] and len(results[1][0][0]) == 2


def test_the_sampled_log_probs_are_a_training_forwards(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each generated token's recorded log-probability equals the log-softmax of a plain forward over
    the unpadded prompt and completion (fp32, 1e-5), on left-padded prompts of other lengths, at
    temperature 0.7 with top-p, rows stopping at different steps and the batch compacted; 0 off the
    mask. Catches log-probs of the tempered or top-p distribution (the negative control), one step
    off, another row's after compaction, or left padding leaking into them."""

    monkeypatch.setattr(sampler, "STOP_CHECK_EVERY", 1)
    monkeypatch.setattr(sampler, "COMPACT_BELOW", 1.0)
    model = tiny_model()
    prompts = [[5 + i, 9, 23 + i, 7][: 1 + i % 4] for i in range(8)]
    params = SamplingParams(10, temperature=0.7, top_p=0.9)
    free = generate(
        model, DECODER_DECODING, prompts, params, PAD, torch.device("cpu"), uniforms=row_uniforms(list(range(8)), 10)
    )
    stops = tuple({int(free.tokens[i, 2 + i % 5]) for i in range(0, 8, 2)})
    params = dataclasses.replace(params, stop_ids=stops)
    got = generate(
        model, DECODER_DECODING, prompts, params, PAD, torch.device("cpu"), uniforms=row_uniforms(list(range(8)), 10)
    )
    assert len({len(ids) for ids in got.lists()}) > 1, "rows must stop at different steps for this to test anything"
    assert (got.logps[~got.mask] == 0).all()
    tempered = []
    for prompt, ids, logps in zip(prompts, got.lists(), got.logp_lists()):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ids]))[0, len(prompt) - 1 : -1].float()
        expected = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(ids)[:, None]).squeeze(-1)
        torch.testing.assert_close(logps, expected, rtol=1e-5, atol=1e-5)
        tempered.append(torch.log_softmax(logits / 0.7, dim=-1).gather(-1, torch.tensor(ids)[:, None]).squeeze(-1))
    # Negative control: the tempered distribution's log-probs are not within the tolerance.
    assert any(not torch.allclose(t, g, rtol=1e-5, atol=1e-5) for t, g in zip(tempered, got.logp_lists()))


def test_compiled_blocks_decode_the_same_tokens_and_stop_recompiling(monkeypatch: pytest.MonkeyPatch) -> None:
    """With its blocks compiled as `compile.enable` compiles them (inductor), the sampler draws the
    same tokens with the same log-probs (fp32, 1e-5) as eager, rows stopping and the batch shrinking
    on the way; after a rollout of other sizes, a third compiles nothing more. Catches a compiled
    decode step that mishandles the cache or its mask (other tokens) and shapes specialised per
    step or per batch (a compilation per token: the second call's count)."""
    import copy

    from torch._dynamo.utils import counters

    from titan_tpu.distributed.compile import apply_compile
    from titan_tpu.distributed.parallelize import block_containers

    monkeypatch.setattr(sampler, "STOP_CHECK_EVERY", 1)
    monkeypatch.setattr(sampler, "COMPACT_BELOW", 1.0)
    model = tiny_model()
    compiled = copy.deepcopy(model)
    apply_compile(block_containers(compiled), "inductor")
    prompts = [[5 + i, 9, 23 + i, 7][: 1 + i % 4] for i in range(8)]
    free = generate(
        model,
        DECODER_DECODING,
        prompts,
        SamplingParams(10),
        PAD,
        torch.device("cpu"),
        uniforms=row_uniforms(list(range(8)), 10),
    )
    params = SamplingParams(10, stop_ids=tuple({int(free.tokens[i, 2 + i % 5]) for i in range(0, 8, 2)}))
    eager = generate(
        model, DECODER_DECODING, prompts, params, PAD, torch.device("cpu"), uniforms=row_uniforms(list(range(8)), 10)
    )
    torch._dynamo.reset()
    counters.clear()
    got = generate(
        compiled, DECODER_DECODING, prompts, params, PAD, torch.device("cpu"), uniforms=row_uniforms(list(range(8)), 10)
    )
    assert len({len(ids) for ids in eager.lists()}) > 1, "rows must stop at different steps for this to test anything"
    assert got.lists() == eager.lists()
    torch.testing.assert_close(got.logps, eager.logps, rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] >= 2  # the prompt and the decode step: the blocks ran compiled
    # Other prompt widths and batch sizes: compiled once more with those sizes dynamic, then never again.
    for width, rows in ((6, 6), (3, 5)):
        others = [[3, 1, 4, 1, 5, 9][: 1 + i % width] for i in range(rows)]
        before = counters["stats"]["unique_graphs"]
        generate(
            compiled,
            DECODER_DECODING,
            others,
            params,
            PAD,
            torch.device("cpu"),
            uniforms=row_uniforms(list(range(rows)), 10),
        )
    assert counters["stats"]["unique_graphs"] == before


def test_length_buckets_sort_rows_by_prompt_length_in_runs_of_equal_size() -> None:
    lengths = [5, 2, 9, 2, 7]
    assert length_buckets(lengths, 1) == [[1, 3, 0, 4, 2]]
    assert length_buckets(lengths, 2) == [[1, 3], [0, 4, 2]]
    assert length_buckets(lengths, 9) == [[1], [3], [0], [4], [2]]  # never an empty batch


@pytest.mark.parametrize("buckets", [2, 3])
def test_sampling_in_length_buckets_changes_no_completion(buckets: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Catches rows put back in the wrong order, a bucket padded to every prompt's longest, and the
    uniforms, log-probs or stop flags of one row given to another."""
    model = tiny_model()
    prompts = PROMPTS + [[7, 1, 2, 3, 4, 5, 6], [9, 9]]
    free = generate(model, DECODER_DECODING, prompts, SamplingParams(10, temperature=0.0), PAD, torch.device("cpu"))
    # Row 0 stops at its 3rd token; the rows of other buckets run on, so the batches' widths differ.
    params = SamplingParams(10, temperature=1.0, top_p=0.9, stop_ids=(int(free.tokens[0, 2]),))
    uniforms = row_uniforms(list(range(20, 20 + len(prompts))), 10)
    one = generate(model, DECODER_DECODING, prompts, params, PAD, torch.device("cpu"), uniforms=uniforms)
    widths: list[int] = []
    real_generate = sampler.generate

    def recording_generate(
        model: torch.nn.Module, decoding: Decoding, asked: list[list[int]], *args: object
    ) -> sampler.Completions:
        widths.append(max(len(p) for p in asked))
        return real_generate(model, decoding, asked, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(sampler, "generate", recording_generate)
    split = generate_by_length(model, DECODER_DECODING, prompts, params, PAD, torch.device("cpu"), buckets, uniforms)
    assert split.lists() == one.lists() and split.stopped.tolist() == one.stopped.tolist()
    torch.testing.assert_close(split.logps, one.logps, rtol=0, atol=1e-5)
    assert split.mask.shape == one.mask.shape and split.mask.tolist() == one.mask.tolist()
    # Each batch is padded to its own longest prompt only: the shortest prompts' batch to 2 tokens.
    assert len(widths) == buckets and widths[0] == 2 and widths[-1] == 7
    # Negative control: the same rows under other uniforms are other completions, so a mix-up shows.
    other = generate_by_length(
        model, DECODER_DECODING, prompts, params, PAD, torch.device("cpu"), buckets, uniforms.roll(1, 0)
    )
    assert other.lists() != one.lists()
