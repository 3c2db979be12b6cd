"""Qwen 3 dense and MoE: flavors and published sizes, meta build, expert implementations, router and
load-balancing loss, registry entries and the HF adapter's names."""

import dataclasses
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.support.paths import REPO
from titan_tpu.config.loader import CONFIG_DIR
from titan_tpu.models.common.loss import cross_entropy_loss
from titan_tpu.models.qwen3.args import QWEN3_FLAVORS, QWEN3_MOE_FLAVORS, Qwen3Args, Qwen3MoeArgs
from titan_tpu.models.qwen3.flops import qwen3_param_count
from titan_tpu.models.qwen3.model import MoEOutput, Qwen3Model, Qwen3MoeModel, moe_loss
from titan_tpu.models.qwen3.moe import GroupedExperts, MoEFeedForward, load_balancing_loss
from titan_tpu.models.qwen3.state_dict_adapter import QWEN3_STATE_DICT_ADAPTER
from titan_tpu.models.registry import get_model_spec

REPO_ROOT = REPO

# Published totals (Qwen model cards: 8.2B, 32.8B, 30.5B, 235B) and exact config-derived counts.
PUBLISHED_TOTAL = {"8B": 8.19e9, "32B": 32.8e9, "30B-A3B": 30.5e9, "235B-A22B": 235e9}
EXACT_TOTAL = {
    "0.6B": 596_049_920,
    "1.7B": 1_720_574_976,
    "4B": 4_022_468_096,
    "8B": 8_190_735_360,
    "14B": 14_768_307_200,
    "32B": 32_762_123_264,
    "30B-A3B": 30_532_122_624,
    "235B-A22B": 235_093_634_560,
}
# Activated parameters per token (router + top-k experts + attention + norms + embeddings + head).
# The model cards round these to 3.3B and 22B; the exact counts are 1.6% and 0.9% above.
EXACT_ACTIVE = {"30B-A3B": 3_353_032_704, "235B-A22B": 22_190_763_520}
PUBLISHED_ACTIVE = {"30B-A3B": 3.3e9, "235B-A22B": 22e9}


def _materialize(args: Qwen3Args, seed: int = 0) -> torch.nn.Module:
    cls = Qwen3MoeModel if isinstance(args, Qwen3MoeArgs) else Qwen3Model
    with torch.device("meta"):
        model = cls(args)
    model.to_empty(device=torch.device("cpu"))
    torch.manual_seed(seed)
    model.init_weights()
    return model


@pytest.mark.parametrize("flavor", [*QWEN3_FLAVORS, *QWEN3_MOE_FLAVORS])
def test_every_flavor_builds_on_meta_with_the_published_size(flavor: str) -> None:
    args = {**QWEN3_FLAVORS, **QWEN3_MOE_FLAVORS}[flavor]
    cls = Qwen3MoeModel if isinstance(args, Qwen3MoeArgs) else Qwen3Model
    with torch.device("meta"):
        model = cls(args)
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params == qwen3_param_count(args)
    assert all(p.is_meta for p in model.parameters())
    if flavor in EXACT_TOTAL:
        assert n_params == EXACT_TOTAL[flavor]
    if flavor in PUBLISHED_TOTAL:
        assert n_params == pytest.approx(PUBLISHED_TOTAL[flavor], rel=5e-3)
    if flavor in EXACT_ACTIVE:
        active = qwen3_param_count(args, active=True)
        assert active == EXACT_ACTIVE[flavor]
        # Within the rounding of the published figure (2 significant digits).
        assert active == pytest.approx(PUBLISHED_ACTIVE[flavor], rel=0.02)
    if flavor != "debug" and flavor != "debug_moe":
        assert (args.vocab_size, args.head_dim, args.rope_theta, args.norm_eps) == (151936, 128, 1e6, 1e-6)
    assert args.tie_embeddings == (flavor in ("0.6B", "1.7B", "4B"))


def test_moe_flavors_have_the_published_routing() -> None:
    a3b, a22b = QWEN3_MOE_FLAVORS["30B-A3B"], QWEN3_MOE_FLAVORS["235B-A22B"]
    assert (a3b.num_experts, a3b.top_k, a3b.moe_hidden_dim, a3b.n_layers, a3b.dim) == (128, 8, 768, 48, 2048)
    assert (a22b.num_experts, a22b.top_k, a22b.moe_hidden_dim, a22b.n_layers, a22b.dim) == (128, 8, 1536, 94, 4096)
    for args in (a3b, a22b):
        assert args.norm_topk_prob and args.router_aux_loss_coef == 0.001 and args.n_kv_heads == 4
    assert QWEN3_MOE_FLAVORS["debug_moe"].vocab_size >= 258


def test_235b_meta_build_is_cheap() -> None:
    script = textwrap.dedent(
        """
        import json, time, torch
        from titan_tpu.models.qwen3.args import QWEN3_MOE_FLAVORS
        from titan_tpu.models.qwen3.model import Qwen3MoeModel
        from titan_tpu.device.memory import peak_rss_gib
        start = time.perf_counter()
        with torch.device("meta"):
            model = Qwen3MoeModel(QWEN3_MOE_FLAVORS["235B-A22B"])
        # The kernel's high-water mark of this process's own memory. Not getrusage's ru_maxrss: it
        # keeps the peak of the memory a spawned process started from, here the whole pytest process.
        print(json.dumps({"seconds": time.perf_counter() - start, "peak_mb": peak_rss_gib() * 1024,
                          "params": sum(p.numel() for p in model.parameters())}))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=True
    )
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    assert measured["params"] == EXACT_TOTAL["235B-A22B"]
    assert measured["seconds"] < 30 and measured["peak_mb"] < 2048


def _grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("impl", ["padded_bmm", "grouped_mm", "auto"])
def test_expert_implementations_match_the_reference_loop(impl: str) -> None:
    """Same function, forward and backward, including experts that get no tokens."""
    torch.manual_seed(0)
    reference = GroupedExperts(dim=32, hidden_dim=48, num_experts=6, impl="loop")
    reference.init_weights(0.02)
    other = GroupedExperts(dim=32, hidden_dim=48, num_experts=6, impl=impl)
    other.load_state_dict(reference.state_dict())
    counts = torch.tensor([5, 0, 9, 1, 0, 17])
    x = torch.randn(int(counts.sum()), 32)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = reference(xa, counts), other(xb, counts)
    g = torch.randn_like(ya)
    (ya * g).sum().backward()
    (yb * g).sum().backward()
    torch.testing.assert_close(yb, ya, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(xb.grad, xa.grad, rtol=1e-5, atol=1e-6)
    for name, grad in _grads(reference).items():
        torch.testing.assert_close(_grads(other)[name], grad, rtol=1e-5, atol=1e-6)


def test_moe_layer_matches_a_dense_per_token_computation() -> None:
    """y_t = sum over the token's top-k experts of weight * SwiGLU_e(x_t), written out naively."""
    torch.manual_seed(0)
    moe = MoEFeedForward(dim=16, hidden_dim=32, num_experts=4, top_k=2, norm_topk_prob=True, impl="auto")
    moe.init_weights(0.02)
    with torch.no_grad():
        moe.router.gate.weight.normal_()
    x = torch.randn(2, 7, 16)
    y, stats = moe(x)
    flat = x.reshape(-1, 16)
    probs = torch.softmax(flat @ moe.router.gate.weight.T, dim=-1)
    top, idx = probs.topk(2, dim=-1)
    top = top / top.sum(-1, keepdim=True)
    expected = torch.zeros_like(flat)
    e = moe.experts
    for t in range(flat.shape[0]):
        for k in range(2):
            j = idx[t, k]
            h = torch.nn.functional.silu(e.w1[j] @ flat[t]) * (e.w3[j] @ flat[t])
            expected[t] += top[t, k] * (e.w2[j] @ h)
    torch.testing.assert_close(y.reshape(-1, 16), expected, rtol=1e-5, atol=1e-6)
    assert stats.n_tokens == 14 and stats.counts.sum() == 28
    torch.testing.assert_close(stats.prob_sums, probs.sum(0))


def test_aux_loss_gradient_equals_plain_autograd() -> None:
    """The injected load-balancing gradient equals autograd through the straightforward formula."""
    args = dataclasses.replace(QWEN3_MOE_FLAVORS["debug_moe"], n_layers=3, router_aux_loss_coef=0.5)
    model = _materialize(args)
    tokens = torch.randint(0, args.vocab_size, (2, 17))
    loss = moe_loss(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    ours = _grads(model)
    model.zero_grad()

    # Same model, the aux loss built from the layers' statistics with autograd all the way.
    h = model.tok_embeddings(tokens[:, :-1])
    cos, sin = model.rope(16)
    stats = []
    for layer in model.layers.values():
        h, layer_stats = layer(h, cos, sin)
        stats.append(layer_stats)
    aux = load_balancing_loss(stats, args.num_experts)
    plain = cross_entropy_loss(model.logits(h), tokens[:, 1:]) + args.router_aux_loss_coef * aux
    plain.backward()
    torch.testing.assert_close(loss, plain)
    for name, grad in _grads(model).items():
        torch.testing.assert_close(ours[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    assert ours["layers.0.feed_forward.router.gate.weight"].abs().sum() > 0


def test_moe_output_and_loss() -> None:
    args = QWEN3_MOE_FLAVORS["debug_moe"]
    model = _materialize(args)
    tokens = torch.randint(0, args.vocab_size, (2, 33))
    out = model(tokens[:, :-1])
    assert isinstance(out, MoEOutput) and out.logits.shape == (2, 32, args.vocab_size)
    # Near-uniform routing at init: the loss is close to its balanced value, top_k.
    assert out.aux_loss.item() == pytest.approx(args.top_k, rel=0.1)
    expected = cross_entropy_loss(out.logits, tokens[:, 1:]) + args.router_aux_loss_coef * out.aux_loss
    torch.testing.assert_close(moe_loss(out, tokens[:, 1:]), expected)
    with torch.no_grad():
        assert not model(tokens[:, :-1]).aux_loss.requires_grad


def test_global_batch_balancing_hook() -> None:
    """With the statistics summed over data-parallel ranks, the aux loss is the one of the whole
    batch, and each rank's injected gradient is the derivative of the sum of all ranks' losses (every
    rank holds the same aux term), which data parallelism then averages. Here the other rank is a
    fixed set of statistics."""
    args = dataclasses.replace(QWEN3_MOE_FLAVORS["debug_moe"], n_layers=2, router_aux_loss_coef=1.0)
    model = _materialize(args)
    tokens = torch.randint(0, args.vocab_size, (2, 16))
    torch.manual_seed(1)
    other = torch.stack([torch.randint(0, 20, (args.num_experts,)).float(), torch.rand(args.num_experts) * 8])
    other[0] *= 2 * 32 * args.top_k / other[0].sum()  # the other rank's 32 tokens, top_k picks each
    model.sum_router_stats = lambda t: (t + other, 2)
    out = model(tokens)
    out.aux_loss.backward()
    injected = {n: g for n, g in _grads(model).items() if "router" in n}
    model.zero_grad()

    h = model.tok_embeddings(tokens)
    cos, sin = model.rope(16)
    stats = []
    for layer in model.layers.values():
        h, layer_stats = layer(h, cos, sin)
        stats.append(layer_stats)
    counts = torch.stack([s.counts for s in stats]).sum(0) + other[0]
    prob_sums = torch.stack([s.prob_sums for s in stats]).sum(0) + other[1]
    rows = 2 * sum(s.n_tokens for s in stats)
    global_aux = args.num_experts * torch.sum((counts / rows) * (prob_sums / rows))
    torch.testing.assert_close(out.aux_loss, global_aux)
    (2 * global_aux).backward()  # both ranks' losses hold it
    for name, grad in _grads(model).items():
        if "router" in name:
            torch.testing.assert_close(injected[name], grad, rtol=1e-5, atol=1e-8, msg=name)


@pytest.mark.parametrize("flavor", ["debug", "debug_moe"])
def test_debug_models_learn(flavor: str) -> None:
    args = {**QWEN3_FLAVORS, **QWEN3_MOE_FLAVORS}[flavor]
    model = _materialize(args)
    spec = get_model_spec("qwen3_moe" if flavor == "debug_moe" else "qwen3")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, args.vocab_size, (2, 33))
    losses = []
    for _ in range(8):
        loss = spec.loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(p.grad is not None for p in model.parameters())
    assert losses[-1] < 0.7 * losses[0], losses


def test_tied_small_flavor_has_no_head_and_qk_norms() -> None:
    args = dataclasses.replace(QWEN3_FLAVORS["debug"], tie_embeddings=True)
    model = _materialize(args)
    assert model.output is None and "output.weight" not in model.state_dict()
    attention = model.layers["0"].attention
    assert attention.q_norm is not None and attention.q_norm.weight.shape == (args.head_dim,)


def test_registry_specs() -> None:
    dense, moe = get_model_spec("qwen3"), get_model_spec("qwen3_moe")
    assert dense.model_cls is Qwen3Model and moe.model_cls is Qwen3MoeModel
    assert dense.loss_fn is cross_entropy_loss and moe.loss_fn is moe_loss
    assert dense.parallelize is not None and moe.parallelize is not None
    assert dense.state_dict_adapter is moe.state_dict_adapter is QWEN3_STATE_DICT_ADAPTER
    assert list(dense.flavors) == ["debug", "0.6B", "1.7B", "4B", "8B", "14B", "32B"]
    assert list(moe.flavors) == ["debug_moe", "30B-A3B", "235B-A22B"]
    with pytest.raises(ValueError, match="did you mean '30B-A3B'"):
        moe.flavor("30b-a3b")


def test_adapter_names_round_trip_and_fail_loudly() -> None:
    adapter = QWEN3_STATE_DICT_ADAPTER
    for args in (QWEN3_FLAVORS["debug"], QWEN3_MOE_FLAVORS["debug_moe"]):
        model = _materialize(args)
        hf = adapter.to_hf(model.state_dict())
        assert "model.layers.0.self_attn.q_norm.weight" in hf
        if isinstance(args, Qwen3MoeArgs):
            assert "model.layers.0.mlp.gate.weight" in hf
            assert hf["model.layers.0.mlp.experts.7.down_proj.weight"].shape == (args.dim, args.moe_hidden_dim)
            assert hf["model.layers.0.mlp.experts.0.gate_proj.weight"].shape == (args.moe_hidden_dim, args.dim)
        back = adapter.from_hf(hf, args)
        assert set(back) == set(model.state_dict())
        for name, tensor in model.state_dict().items():
            assert torch.equal(back[name], tensor), name
            names = adapter.hf_names(name, getattr(args, "num_experts", 1))
            assert all(n in hf for n in names)
            if len(names) == 1:  # one-to-one names round-trip through the Llama-style interface
                assert adapter.our_name(adapter.hf_name(name)) == name
            else:
                assert [adapter.our_name_and_index(n) for n in names] == [(name, k) for k in range(len(names))]
        with pytest.raises(KeyError, match="'model.layers.0.mlp.bogus' has no Qwen 3 counterpart"):
            adapter.from_hf({**hf, "model.layers.0.mlp.bogus": torch.zeros(1)})
    moe_args = QWEN3_MOE_FLAVORS["debug_moe"]
    with pytest.raises(KeyError, match="use hf_names"):
        adapter.hf_name("layers.0.feed_forward.experts.w1")
    with pytest.raises(KeyError, match="expert 3 of the stacked Qwen 3 parameter 'layers.1.feed_forward.experts.w3'"):
        adapter.our_name("model.layers.1.mlp.experts.3.up_proj.weight")
    hf = adapter.to_hf(_materialize(moe_args).state_dict())
    del hf["model.layers.1.mlp.experts.3.up_proj.weight"]
    with pytest.raises(KeyError, match="7 of 8 experts for 'layers.1.feed_forward.experts.w3'"):
        adapter.from_hf(hf, moe_args)


def test_adapter_config_round_trips_and_is_checked() -> None:
    from transformers import AutoConfig

    adapter = QWEN3_STATE_DICT_ADAPTER
    for args in (QWEN3_FLAVORS["8B"], QWEN3_FLAVORS["0.6B"], QWEN3_MOE_FLAVORS["30B-A3B"]):
        config = adapter.to_hf_config(args)
        assert adapter.check_hf_config(config, args) == []
        hf = AutoConfig.for_model(**config)
        assert hf.hidden_size == args.dim and hf.head_dim == args.head_dim
        # What transformers 5.x itself writes (rope_parameters, num_local_experts) also passes.
        assert adapter.check_hf_config(hf.to_dict(), args) == []
        if isinstance(args, Qwen3MoeArgs):
            assert (hf.num_experts, hf.num_experts_per_tok, hf.moe_intermediate_size) == (128, 8, 768)
    wrong = {**adapter.to_hf_config(QWEN3_MOE_FLAVORS["30B-A3B"]), "num_experts": 64, "head_dim": 64}
    problems = adapter.check_hf_config(wrong, QWEN3_MOE_FLAVORS["30B-A3B"])
    assert "num_experts is 64, the flavor has 128" in problems and "head_dim is 64, the flavor has 128" in problems
    assert adapter.check_hf_config(adapter.to_hf_config(QWEN3_FLAVORS["8B"]), QWEN3_FLAVORS["14B"])


def test_args_are_validated() -> None:
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        Qwen3Args(n_heads=32, n_kv_heads=6)
    with pytest.raises(ValueError, match="top_k must be in"):
        Qwen3MoeArgs(num_experts=4, top_k=5)
    with pytest.raises(TypeError, match="needs Qwen3MoeArgs"):
        Qwen3MoeModel(QWEN3_FLAVORS["debug"])


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("qwen3_*.toml")), ids=lambda p: p.stem)
def test_shipped_configs_name_a_flavor_and_a_valid_layout(path: Path) -> None:
    from titan_tpu.config import load_config
    from titan_tpu.distributed.expert_parallel import validate_expert_parallel
    from titan_tpu.distributed.parallel_dims import ParallelDims

    config = load_config(str(path), [])
    args = get_model_spec(config.model.name).flavor(config.model.flavor)
    assert args.vocab_size >= 258  # the byte tokenizer the configs ship with
    parallelism = config.parallelism
    world = parallelism.tp * parallelism.ep * 4  # some world size the layout is meant for
    dims = ParallelDims.from_config(parallelism, world)
    if isinstance(args, Qwen3MoeArgs):
        validate_expert_parallel(dims, args.num_experts)
    else:
        assert parallelism.ep == 1
    assert args.n_heads % parallelism.tp == 0 and args.n_kv_heads % parallelism.tp == 0
    expected = {"qwen3_debug": "debug", "qwen3_moe_debug": "debug_moe"}.get(path.stem)
    if expected:
        assert config.model.flavor == expected and config.training.seq_len <= args.max_seq_len
