"""Logits of our Llama 3 against transformers' LlamaForCausalLM with the same (random) weights."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from titan_tpu.models.common.rope import RopeScaling, rope_inv_freq
from titan_tpu.models.llama3.args import Llama3Args
from titan_tpu.models.llama3.model import Llama3Model
from titan_tpu.models.llama3.state_dict_adapter import LLAMA3_STATE_DICT_ADAPTER

# original_max_position is small so that the Llama 3.1 frequency scaling changes most frequencies, and
# the longest sequence runs well past it.
ROPE = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=64)
SEQ_LENS = (7, 64, 300)


def _args(tie_embeddings: bool) -> Llama3Args:
    return Llama3Args(
        dim=128,
        n_layers=3,
        n_heads=8,
        n_kv_heads=2,
        vocab_size=320,
        multiple_of=32,
        ffn_dim_multiplier=1.3,
        norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=ROPE,
        max_seq_len=512,
        tie_embeddings=tie_embeddings,
    )


def _hf_config(args: Llama3Args) -> LlamaConfig:
    assert args.rope_scaling is not None
    return LlamaConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.dim,
        intermediate_size=args.ffn_hidden_dim,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_kv_heads,
        max_position_embeddings=args.max_seq_len,
        rms_norm_eps=args.norm_eps,
        tie_word_embeddings=args.tie_embeddings,
        # The 4.x spelling (rope_theta + rope_scaling); 5.x folds it into rope_parameters itself.
        rope_theta=args.rope_theta,
        rope_scaling={
            "rope_type": "llama3",
            "factor": args.rope_scaling.factor,
            "low_freq_factor": args.rope_scaling.low_freq_factor,
            "high_freq_factor": args.rope_scaling.high_freq_factor,
            "original_max_position_embeddings": args.rope_scaling.original_max_position,
        },
        use_cache=False,
        attn_implementation="eager",
    )


def hf_to_titan(hf_state: dict[str, torch.Tensor], ours: torch.nn.Module) -> dict[str, torch.Tensor]:
    """HF LlamaForCausalLM weights under our names, through the adapter the checkpoint layer uses.
    No q/k permutation: both models use the half-rotation rope layout."""
    return {name: hf_state[LLAMA3_STATE_DICT_ADAPTER.hf_name(name)] for name in ours.state_dict()}


def _randomize(model: torch.nn.Module) -> None:
    """Weights far from HF's tiny default init, so the logits are O(1) and every mapping error shows."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.copy_(torch.randn_like(param) / param.shape[-1] ** 0.5)


def test_rope_scaling_is_exercised() -> None:
    """Guards the setup: with these shapes the Llama 3.1 scaling must change most frequencies."""
    args = _args(False)
    scaled = rope_inv_freq(args.attn_head_dim, args.rope_theta, ROPE)
    plain = rope_inv_freq(args.attn_head_dim, args.rope_theta, None)
    assert (scaled != plain).sum().item() >= len(plain) // 2


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_logits_match_transformers(tied: bool) -> None:
    torch.manual_seed(0)
    args = _args(tied)
    assert args.ffn_hidden_dim == 448  # int(1.3 * int(2 * 4 * 128 / 3)) = 443, rounded up to 32s
    hf = LlamaForCausalLM(_hf_config(args)).eval()
    assert hf.model.rotary_emb.rope_type == "llama3"
    _randomize(hf)

    with torch.device("meta"):
        ours = Llama3Model(args)
    ours.to_empty(device=torch.device("cpu"))
    ours.init_weights()
    ours.load_state_dict(hf_to_titan(hf.state_dict(), ours), strict=True)
    ours.eval()
    if tied:
        assert ours.output is None

    for seq_len in SEQ_LENS:
        tokens = torch.randint(0, args.vocab_size, (2, seq_len))
        with torch.no_grad():
            expected = hf(input_ids=tokens).logits
            actual = ours(tokens)
        assert actual.shape == expected.shape == (2, seq_len, args.vocab_size)
        diff = (actual - expected).abs().max().item()
        peak = expected.abs().max().item()
        print(f"tied={tied} seq_len={seq_len} max|logit|={peak:.2f} max|diff|={diff:.2e}")
        assert diff <= 1e-4, f"seq_len {seq_len}: max abs logit diff {diff}"
