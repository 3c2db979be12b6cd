"""Llama 3: flavors, meta build, initialisation, shapes and the shard-friendly attention."""

import dataclasses
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.support.paths import REPO
from titan_tpu.models.common.attention import Attention
from titan_tpu.models.common.loss import IGNORE_INDEX, cross_entropy_loss
from titan_tpu.models.common.rope import RotaryEmbedding
from titan_tpu.models.llama3.args import LLAMA3_FLAVORS, Llama3Args
from titan_tpu.models.llama3.flops import llama3_param_count
from titan_tpu.models.llama3.model import Llama3Model
from titan_tpu.models.registry import get_model_spec

REPO_ROOT = REPO

# Published sizes (Meta model cards / HF configs); 100M is our own benchmark flavor.
PUBLISHED_PARAMS = {"100M": 100.7e6, "1B": 1.24e9, "3B": 3.21e9, "8B": 8.03e9, "70B": 70.6e9, "405B": 405.9e9}
PUBLISHED_FFN = {"100M": 2048, "1B": 8192, "3B": 8192, "8B": 14336, "70B": 28672, "405B": 53248}


def _materialize(args: Llama3Args, seed: int = 0) -> Llama3Model:
    with torch.device("meta"):
        model = Llama3Model(args)
    model.to_empty(device=torch.device("cpu"))
    torch.manual_seed(seed)
    model.init_weights()
    return model


@pytest.mark.parametrize("flavor", list(LLAMA3_FLAVORS))
def test_every_flavor_builds_on_meta(flavor: str) -> None:
    args = LLAMA3_FLAVORS[flavor]
    with torch.device("meta"):
        model = Llama3Model(args)
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params == llama3_param_count(args)
    assert all(p.is_meta for p in model.parameters())
    assert list(model.layers) == [str(i) for i in range(args.n_layers)]
    if flavor in PUBLISHED_PARAMS:
        assert n_params == pytest.approx(PUBLISHED_PARAMS[flavor], rel=5e-3)
        assert args.ffn_hidden_dim == PUBLISHED_FFN[flavor]
        assert model.layers["0"].feed_forward.w1.weight.shape == (args.ffn_hidden_dim, args.dim)


def test_published_shapes() -> None:
    assert LLAMA3_FLAVORS["8B"].attn_head_dim == 128
    assert LLAMA3_FLAVORS["405B"].attn_head_dim == 128
    assert LLAMA3_FLAVORS["3B"].attn_head_dim == 128
    for name in ("1B", "3B"):
        scaling = LLAMA3_FLAVORS[name].rope_scaling
        assert LLAMA3_FLAVORS[name].tie_embeddings and scaling is not None and scaling.factor == 32.0
    for name in ("8B", "70B", "405B"):
        scaling = LLAMA3_FLAVORS[name].rope_scaling
        assert not LLAMA3_FLAVORS[name].tie_embeddings and scaling is not None and scaling.factor == 8.0
    assert LLAMA3_FLAVORS["debug"].vocab_size >= 512


def test_405b_meta_build_is_cheap() -> None:
    """Built in a fresh process so the RSS growth is the build's alone."""
    script = textwrap.dedent(
        """
        import json, time
        import torch
        from titan_tpu.models.llama3.args import LLAMA3_FLAVORS
        from titan_tpu.models.llama3.model import Llama3Model
        from titan_tpu.device.memory import peak_rss_gib, reset_peak_rss
        reset_peak_rss()  # the high-water mark becomes this process's resident size (where /proc allows)
        before = peak_rss_gib()
        start = time.perf_counter()
        with torch.device("meta"):
            model = Llama3Model(LLAMA3_FLAVORS["405B"])
        seconds = time.perf_counter() - start
        n = sum(p.numel() for p in model.parameters())
        growth_mb = (peak_rss_gib() - before) * 1024
        print(json.dumps({"seconds": seconds, "growth_mb": growth_mb, "params": n}))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=True
    )
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    print(f"405B meta build: {measured}")
    assert measured["seconds"] < 30
    assert measured["growth_mb"] < 2048
    assert measured["params"] == llama3_param_count(LLAMA3_FLAVORS["405B"])


def test_meta_build_then_init_gives_a_valid_model() -> None:
    args = LLAMA3_FLAVORS["debug"]
    model = _materialize(args)
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    # The rotary tables after to_empty are garbage until init_weights recomputes them.
    fresh = RotaryEmbedding(args.attn_head_dim, args.max_seq_len, args.rope_theta, args.rope_scaling)
    torch.testing.assert_close(model.rope.cos, fresh.cos, rtol=0, atol=0)
    torch.testing.assert_close(model.rope.sin, fresh.sin, rtol=0, atol=0)
    tokens = torch.randint(0, args.vocab_size, (2, 32))
    logits = model(tokens)
    assert logits.shape == (2, 32, args.vocab_size)
    assert torch.isfinite(logits).all()
    # Unit-scale head on a unit-RMS input: the loss starts near ln(vocab), not far above it.
    loss = cross_entropy_loss(logits, tokens)
    assert abs(loss.item() - torch.log(torch.tensor(float(args.vocab_size))).item()) < 1.5


def test_init_follows_the_convention() -> None:
    model = _materialize(LLAMA3_FLAVORS["debug"])
    assert model.tok_embeddings.weight.std().item() == pytest.approx(0.02, rel=0.05)
    last = model.layers[str(model.args.n_layers - 1)]
    assert last.attention.wo.weight.std().item() < model.layers["0"].attention.wo.weight.std().item()
    assert torch.equal(last.attention_norm.weight, torch.ones_like(last.attention_norm.weight))
    assert "rope.cos" not in model.state_dict()


def test_init_is_deterministic_given_the_seed() -> None:
    args = LLAMA3_FLAVORS["debug"]
    first, second, other = _materialize(args, 3), _materialize(args, 3), _materialize(args, 4)
    states = first.state_dict(), second.state_dict(), other.state_dict()
    for name, a in states[0].items():
        assert torch.equal(a, states[1][name]), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(a, states[2][name]), name


def test_tied_embeddings_have_no_output_layer() -> None:
    args = dataclasses.replace(LLAMA3_FLAVORS["debug"], tie_embeddings=True)
    model = _materialize(args)
    assert model.output is None
    assert "output.weight" not in model.state_dict()
    tokens = torch.randint(0, args.vocab_size, (1, 8))
    expected = torch.nn.functional.linear(model.norm(_hidden(model, tokens)), model.tok_embeddings.weight)
    torch.testing.assert_close(model(tokens), expected)


def _hidden(model: Llama3Model, tokens: torch.Tensor) -> torch.Tensor:
    h = model.tok_embeddings(tokens)
    cos, sin = model.rope(tokens.shape[1])
    for layer in model.layers.values():
        h = layer(h, cos, sin)
    return h


def test_attention_runs_on_a_head_shard() -> None:
    """Tensor parallelism gives each rank some heads (wq/wk/wv rows, wo columns) and sums the wo outputs.

    Doing that by hand with two shards must reproduce the full layer, which only works because the
    forward reads the head count off the projected tensors.
    """
    torch.manual_seed(0)
    dim, n_heads, n_kv_heads, head_dim, tp = 64, 8, 4, 16, 2
    full = Attention(dim, n_heads, n_kv_heads, head_dim, qk_norm=True, norm_eps=1e-6)
    full.init_weights(0.02)
    rope = RotaryEmbedding(head_dim, 16, 10000.0, None)
    x = torch.randn(2, 16, dim)
    cos, sin = rope(16)
    q_rows, kv_rows = n_heads * head_dim // tp, n_kv_heads * head_dim // tp
    total = torch.zeros_like(x)
    for rank in range(tp):
        shard = Attention(dim, n_heads, n_kv_heads, head_dim, qk_norm=True, norm_eps=1e-6)
        with torch.no_grad():
            shard.wq.weight = torch.nn.Parameter(full.wq.weight[rank * q_rows : (rank + 1) * q_rows])
            shard.wk.weight = torch.nn.Parameter(full.wk.weight[rank * kv_rows : (rank + 1) * kv_rows])
            shard.wv.weight = torch.nn.Parameter(full.wv.weight[rank * kv_rows : (rank + 1) * kv_rows])
            shard.wo.weight = torch.nn.Parameter(full.wo.weight[:, rank * q_rows : (rank + 1) * q_rows])
        total = total + shard(x, cos, sin)
    torch.testing.assert_close(total, full(x, cos, sin), rtol=1e-5, atol=1e-5)


def test_sequence_longer_than_max_seq_len_is_refused() -> None:
    args = dataclasses.replace(LLAMA3_FLAVORS["debug"], max_seq_len=16)
    model = Llama3Model(args)
    with pytest.raises(ValueError, match="exceeds the model's max_seq_len 16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_loss_ignores_masked_labels() -> None:
    logits = torch.randn(2, 5, 11)
    labels = torch.randint(0, 11, (2, 5))
    masked = labels.clone()
    masked[:, :2] = IGNORE_INDEX
    expected = torch.nn.functional.cross_entropy(logits[:, 2:].reshape(-1, 11), labels[:, 2:].reshape(-1))
    torch.testing.assert_close(cross_entropy_loss(logits, masked), expected)
    assert get_model_spec("llama3").loss_fn is cross_entropy_loss


def test_debug_model_learns() -> None:
    """A few AdamW steps on one batch must cut the loss: gradients reach every parameter."""
    args = LLAMA3_FLAVORS["debug"]
    model = _materialize(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, args.vocab_size, (2, 33))
    losses = []
    for _ in range(8):
        loss = cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(p.grad is not None for p in model.parameters())
    assert losses[-1] < 0.7 * losses[0], losses


def test_unknown_flavor_lists_the_valid_ones() -> None:
    spec = get_model_spec("llama3")
    with pytest.raises(ValueError) as info:
        spec.flavor("7B")
    message = str(info.value)
    assert message.startswith("unknown flavor '7B' for model 'llama3'; ")
    assert message.endswith("valid: debug, 100M, 1B, 3B, 8B, 70B, 405B")
    with pytest.raises(ValueError, match="did you mean '8B'"):
        spec.flavor("8b")
    assert spec.flavor("8B") is LLAMA3_FLAVORS["8B"]


def test_args_are_validated() -> None:
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        Llama3Args(n_heads=32, n_kv_heads=6)
    with pytest.raises(ValueError, match="divisible by n_heads"):
        Llama3Args(dim=100, n_heads=8)
    assert Llama3Args(dim=100, n_heads=8, n_kv_heads=8, head_dim=16).attn_head_dim == 16
