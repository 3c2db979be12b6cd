"""Qwen 3 dense and MoE against transformers' Qwen3ForCausalLM / Qwen3MoeForCausalLM.

The HF model gets random O(1) weights, is written with `save_pretrained`, and the safetensors file is
read back through our adapter (`Qwen3StateDictAdapter.from_hf`) into our model; then logits, the MoE
load-balancing loss and the full training loss are compared in float32.
"""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from titan_tpu.checkpoint.hf_import import load_hf_weights
from titan_tpu.models.common.loss import IGNORE_INDEX
from titan_tpu.models.qwen3.args import Qwen3Args, Qwen3MoeArgs
from titan_tpu.models.qwen3.model import Qwen3Model, Qwen3MoeModel, moe_loss
from titan_tpu.models.qwen3.state_dict_adapter import QWEN3_STATE_DICT_ADAPTER

SEQ_LENS = (7, 64, 200)


def _dense_args(tied: bool) -> Qwen3Args:
    return Qwen3Args(
        dim=128,
        n_layers=3,
        n_heads=8,
        n_kv_heads=2,
        head_dim=32,
        vocab_size=320,
        ffn_hidden_dim=352,
        norm_eps=1e-6,
        rope_theta=1_000_000.0,
        max_seq_len=256,
        tie_embeddings=tied,
    )


def _moe_args(norm_topk_prob: bool) -> Qwen3MoeArgs:
    return Qwen3MoeArgs(
        dim=128,
        n_layers=3,
        n_heads=8,
        n_kv_heads=2,
        head_dim=32,
        vocab_size=320,
        ffn_hidden_dim=352,
        norm_eps=1e-6,
        rope_theta=1_000_000.0,
        max_seq_len=256,
        num_experts=8,
        top_k=3,
        moe_hidden_dim=64,
        norm_topk_prob=norm_topk_prob,
        router_aux_loss_coef=0.02,
    )


def _common_config(args: Qwen3Args) -> dict:
    return dict(
        vocab_size=args.vocab_size,
        hidden_size=args.dim,
        intermediate_size=args.ffn_hidden_dim,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=args.max_seq_len,
        rms_norm_eps=args.norm_eps,
        rope_theta=args.rope_theta,
        tie_word_embeddings=args.tie_embeddings,
        use_cache=False,
        attn_implementation="eager",
    )


def _randomize(model: torch.nn.Module) -> None:
    """Weights far from HF's tiny default init (its router starts at zero), so the logits are O(1),
    routing is decisive, and every mapping error shows."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.copy_(torch.randn_like(param) / param.shape[-1] ** 0.5)


def _load_through_adapter(folder: Path, args: Qwen3Args, model_cls: type[torch.nn.Module]) -> torch.nn.Module:
    hf_state = load_file(str(folder / "model.safetensors"))
    with torch.device("meta"):
        ours = model_cls(args)
    ours.to_empty(device=torch.device("cpu"))
    ours.init_weights()
    ours.load_state_dict(QWEN3_STATE_DICT_ADAPTER.from_hf(hf_state, args), strict=True)
    return ours.eval()


def _shifted_labels(tokens: torch.Tensor) -> torch.Tensor:
    """HF shifts labels inside its loss; our data pipeline hands the model already-shifted labels."""
    pad = torch.full_like(tokens[:, :1], IGNORE_INDEX)
    return torch.cat([tokens[:, 1:], pad], dim=1)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_dense_logits_match_transformers(tied: bool, tmp_path: Path) -> None:
    torch.manual_seed(0)
    args = _dense_args(tied)
    hf = Qwen3ForCausalLM(Qwen3Config(**_common_config(args))).eval()
    _randomize(hf)
    hf.save_pretrained(tmp_path)
    ours = _load_through_adapter(tmp_path, args, Qwen3Model)
    assert (ours.output is None) == tied
    # The checkpoint layer's loader (DCP over the safetensors files, names from the adapter) agrees.
    with torch.device("meta"):
        loaded = Qwen3Model(args)
    loaded.to_empty(device=torch.device("cpu"))
    load_hf_weights(loaded, tmp_path, QWEN3_STATE_DICT_ADAPTER, args)
    for name, tensor in ours.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name

    for seq_len in SEQ_LENS:
        tokens = torch.randint(0, args.vocab_size, (2, seq_len))
        with torch.no_grad():
            expected = hf(input_ids=tokens).logits
            actual = ours(tokens)
        diff = (actual - expected).abs().max().item()
        print(f"dense tied={tied} seq_len={seq_len} max|logit|={expected.abs().max():.2f} max|diff|={diff:.2e}")
        assert diff <= 1e-4, f"seq_len {seq_len}: max abs logit diff {diff}"


@pytest.mark.parametrize("norm_topk_prob", [True, False], ids=["renorm", "no_renorm"])
def test_moe_logits_and_aux_loss_match_transformers(norm_topk_prob: bool, tmp_path: Path) -> None:
    torch.manual_seed(0)
    args = _moe_args(norm_topk_prob)
    config = Qwen3MoeConfig(
        **_common_config(args),
        num_experts=args.num_experts,
        num_experts_per_tok=args.top_k,
        moe_intermediate_size=args.moe_hidden_dim,
        norm_topk_prob=args.norm_topk_prob,
        router_aux_loss_coef=args.router_aux_loss_coef,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )
    hf = Qwen3MoeForCausalLM(config).eval()
    _randomize(hf)
    hf.save_pretrained(tmp_path)
    ours = _load_through_adapter(tmp_path, args, Qwen3MoeModel)

    for seq_len in SEQ_LENS:
        tokens = torch.randint(0, args.vocab_size, (2, seq_len))
        with torch.no_grad():
            expected = hf(input_ids=tokens, labels=tokens, output_router_logits=True)
            actual = ours(tokens)
            our_loss = moe_loss(actual, _shifted_labels(tokens))
        logit_diff = (actual.logits - expected.logits).abs().max().item()
        aux_diff = (actual.aux_loss - expected.aux_loss).abs().item()
        loss_diff = (our_loss - expected.loss).abs().item()
        print(
            f"moe norm_topk_prob={norm_topk_prob} seq_len={seq_len} max|logit|="
            f"{expected.logits.abs().max():.2f} max|diff|={logit_diff:.2e} aux={expected.aux_loss:.6f} "
            f"aux diff={aux_diff:.2e} loss diff={loss_diff:.2e}"
        )
        assert logit_diff <= 1e-4, f"seq_len {seq_len}: max abs logit diff {logit_diff}"
        assert aux_diff <= 1e-5, f"seq_len {seq_len}: aux loss {actual.aux_loss} vs {expected.aux_loss}"
        assert loss_diff <= 1e-4, f"seq_len {seq_len}: loss {our_loss} vs {expected.loss}"
        assert actual.aux_loss_coef == config.router_aux_loss_coef

    # Gradients of the full training loss (cross-entropy + coef * aux), mapped back through the adapter
    # (transformers 5.x keeps experts fused in memory; from_hf reads that layout too).
    tokens = torch.randint(0, args.vocab_size, (2, 64))
    hf(input_ids=tokens, labels=tokens, output_router_logits=True).loss.backward()
    moe_loss(ours(tokens), _shifted_labels(tokens)).backward()
    hf_grads = QWEN3_STATE_DICT_ADAPTER.from_hf({n: p.grad for n, p in hf.named_parameters()}, args)
    worst = max(
        ((p.grad - hf_grads[n]).abs().max().item() / hf_grads[n].abs().max().item(), n)
        for n, p in ours.named_parameters()
    )
    print(f"moe norm_topk_prob={norm_topk_prob} gradients: worst max|diff| / max|grad| = {worst[0]:.2e} ({worst[1]})")
    assert worst[0] <= 1e-4, worst


def test_moe_export_round_trips_to_the_saved_file(tmp_path: Path) -> None:
    """to_hf writes exactly the per-expert keys and tensors transformers saved; from_hf inverts it, and
    it also reads transformers 5.x's in-memory fused expert layout; load_hf_weights reads the same."""
    torch.manual_seed(0)
    args = _moe_args(True)
    config = Qwen3MoeConfig(
        **_common_config(args),
        num_experts=args.num_experts,
        num_experts_per_tok=args.top_k,
        moe_intermediate_size=args.moe_hidden_dim,
        norm_topk_prob=True,
    )
    hf = Qwen3MoeForCausalLM(config)
    _randomize(hf)
    hf.save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    adapter = QWEN3_STATE_DICT_ADAPTER
    ours = adapter.from_hf(saved, args)
    exported = adapter.to_hf(ours)
    assert sorted(exported) == sorted(saved)
    for key, tensor in saved.items():
        assert torch.equal(exported[key], tensor), key
    fused = adapter.from_hf(hf.state_dict(), args)
    assert sorted(fused) == sorted(ours)
    for key, tensor in ours.items():
        assert torch.equal(fused[key], tensor), key
    # The checkpoint layer's loader (DCP over the safetensors files, experts stacked through the
    # adapter's hf_tensors) agrees.
    with torch.device("meta"):
        loaded = Qwen3MoeModel(args)
    loaded.to_empty(device=torch.device("cpu"))
    load_hf_weights(loaded, tmp_path, adapter, args)
    for key, tensor in ours.items():
        assert torch.equal(loaded.state_dict()[key], tensor), key
