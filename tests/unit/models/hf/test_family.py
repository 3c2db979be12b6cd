"""The hf family on one process: built on `meta` and materialised the way a run does it, it computes
what transformers' own model with the same weights computes (logits, loss and every gradient), for
architectures that each carry one of the known traps: a sliding window (Mistral), soft-capping and
tied embeddings (Gemma 2), fused projections (Phi-3), norms after the sublayers (OLMo 2), a parallel
residual with partial rotary (GPT-NeoX) and a mixture of experts (Mixtral)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from scripts import hf_parity as parity
from tests.support.paths import REPO
from titan_tpu.config import ConfigError, load_config
from titan_tpu.models.hf.flops import hf_flops_per_token, hf_param_count
from titan_tpu.models.hf.model import HFCausalLM
from titan_tpu.models.registry import get_model_spec

ARCHITECTURES = [
    "MistralForCausalLM",
    "Gemma2ForCausalLM",
    "Phi3ForCausalLM",
    "Olmo2ForCausalLM",
    "GPTNeoXForCausalLM",
    "MixtralForCausalLM",
]
SEQ = 24


def hf_args(model: Any) -> Any:
    """The hf family's arguments as a run gets them: bad input is a ConfigError."""
    return get_model_spec("hf").args_for(model)


def config_of(*overrides: str) -> Any:
    return load_config("llama3_debug", ["--model.name=hf", *overrides])


def built_like_a_run(architecture: str, *overrides: str, seed: int = 0) -> HFCausalLM:
    args = hf_args(config_of(f"--hf.architecture={architecture}", "--model.flavor=debug", *overrides))
    return parity.built_like_a_run(args, SEQ, seed)


def compare(model: HFCausalLM, reference: torch.nn.Module, tokens: torch.Tensor) -> None:
    ours = parity.loss_and_grads(model, model, tokens)
    theirs = parity.loss_and_grads(reference, lambda t: reference(input_ids=t).logits, tokens)
    result = parity.parity(ours, theirs)
    assert result.within(loss_rel=1e-5, grad_rel=1e-4), result


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_the_model_computes_what_transformers_computes_with_the_same_weights(architecture: str) -> None:
    """Catches rotary tables left as to_empty's garbage (they are not in the state dict), a tied head
    untied by to_empty (its gradient then splits in two), a parameter our init never draws, and a loss
    normalised differently from the reference's mean over tokens."""
    model = built_like_a_run(architecture)
    reference = parity.transformers_twin(model)
    tokens = torch.randint(0, model.args.vocab_size, (2, SEQ + 1), generator=torch.Generator().manual_seed(1))
    compare(model, reference, tokens)
    if model.args.tie_embeddings:
        assert model.hf.get_output_embeddings().weight is model.hf.get_input_embeddings().weight


def test_a_rotary_table_left_as_allocated_fails_the_comparison() -> None:
    """Negative control: the comparison sees the rotary tables, the buffer to_empty leaves garbage."""
    model = built_like_a_run("MistralForCausalLM")
    reference = parity.transformers_twin(model)
    with torch.no_grad():
        model.hf.model.rotary_emb.inv_freq.mul_(1.01)
    tokens = torch.randint(0, model.args.vocab_size, (2, SEQ + 1), generator=torch.Generator().manual_seed(1))
    with pytest.raises(AssertionError):
        compare(model, reference, tokens)


def test_init_draws_every_parameter_like_transformers_does() -> None:
    """transformers' own init (normal at initializer_range, norms at one), not zeros or garbage."""
    model = built_like_a_run("MistralForCausalLM")
    std = model.args.config.initializer_range
    q = model.hf.model.layers[0].self_attn.q_proj.weight
    assert q.std().item() == pytest.approx(std, rel=0.1)
    assert torch.equal(model.hf.model.norm.weight, torch.ones_like(model.hf.model.norm.weight))


def test_decoder_layers_are_the_units_of_fsdp_and_checkpointing() -> None:
    model = built_like_a_run("Gemma2ForCausalLM")
    assert model.layers_path == "model.layers"
    assert model.block_containers()[0] is model.hf.model.layers and model.n_blocks == 2


# Architecture -> keys each layer attends to at 64 and at 4096 tokens with a 128-token window where
# the config has one: Mistral slides on every layer, Gemma 2 on every other one, Mixtral on none.
WINDOWED = {
    "MistralForCausalLM": ["--model.overrides={ sliding_window = 128 }"],
    "Gemma2ForCausalLM": ["--model.overrides={ sliding_window = 128 }"],
    "MixtralForCausalLM": [],
}
KEYS_PER_LAYER = {
    "MistralForCausalLM": [(64, 128), (64, 128)],
    "Gemma2ForCausalLM": [(64, 128), (64, 4096)],
    "MixtralForCausalLM": [(64, 4096), (64, 4096)],
}


@pytest.mark.parametrize("architecture", list(WINDOWED))
def test_params_and_flops_count_the_built_model(architecture: str) -> None:
    """The count is the built model's; FLOPs use the active parameters (top_k of the experts, the
    head also when tied) and charge a sliding window's layers its width, not the sequence."""
    model = built_like_a_run(architecture, *WINDOWED[architecture])
    count = hf_param_count(model.args)
    assert count.total == sum(p.numel() for p in model.parameters())
    config = model.args.config
    embedding = config.vocab_size * config.hidden_size
    tied = embedding if model.args.tie_embeddings else 0
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    if experts:
        active_experts = experts * config.num_experts_per_tok // config.num_local_experts
        assert count.active_non_embedding == count.total - embedding - experts + active_experts
    else:
        assert count.active_non_embedding == count.total - embedding + tied
    per_key = 3 * 4 * config.num_attention_heads * (getattr(config, "head_dim", None) or 16)
    short = 3 * 2 * count.active_non_embedding + per_key * sum(s for s, _ in KEYS_PER_LAYER[architecture])
    long = 3 * 2 * count.active_non_embedding + per_key * sum(keys for _, keys in KEYS_PER_LAYER[architecture])
    assert hf_flops_per_token(model.args, 64) == pytest.approx(short)
    assert hf_flops_per_token(model.args, 4096) == pytest.approx(long)


def test_folder_config_values_are_kept_and_overrides_checked(tmp_path: Any) -> None:
    """A folder's config (rope_theta here) is what the model gets; a field the config lacks, a folder
    without config.json, remote code, a class that is not a causal LM and a folder with flavor 'debug'
    (which shrank the folder's model in silence) are one-line refusals."""
    rope = '{ rope_parameters = { rope_type = "default", rope_theta = 12345.0 } }'
    model = built_like_a_run("MistralForCausalLM", f"--model.overrides={rope}")
    model.hf.save_pretrained(tmp_path / "folder")
    args = hf_args(config_of(f"--hf.config={tmp_path / 'folder'}", "--model.flavor=config"))
    assert args.config.rope_parameters["rope_theta"] == 12345.0 and args.architecture == "MistralForCausalLM"
    assert args.config.hidden_size == 64  # the folder's size, not the class default
    # The base config's flavor 'debug' would shrink the folder's model: refused, naming the fix.
    with pytest.raises(
        ConfigError, match=r"^model.flavor: 'debug' would shrink hf.config's model .* model.flavor = 'config'"
    ):
        hf_args(config_of(f"--hf.config={tmp_path / 'folder'}"))
    with pytest.raises(ConfigError, match=r"model.overrides.rope_theta: MistralConfig has no field"):
        hf_args(config_of("--hf.architecture=MistralForCausalLM", "--model.overrides={ rope_theta = 1.0 }"))
    with pytest.raises(ConfigError, match=r"model.overrides.hiden_size: .*did you mean 'hidden_size'"):
        hf_args(config_of("--hf.architecture=MistralForCausalLM", "--model.overrides={ hiden_size = 8 }"))
    with pytest.raises(ConfigError, match=r"hf.config: .*config.json does not exist"):
        hf_args(config_of(f"--hf.config={tmp_path}", "--model.flavor=config"))
    with pytest.raises(ConfigError, match="did you mean 'MistralForCausalLM'"):
        hf_args(config_of("--hf.architecture=MistralForCasualLM"))
    with pytest.raises(ConfigError, match="not a causal language model"):
        hf_args(config_of("--hf.architecture=BertModel"))
    (tmp_path / "remote").mkdir()
    (tmp_path / "remote" / "config.json").write_text(
        '{"architectures": ["X"], "auto_map": {"AutoModelForCausalLM": "m.X"}}'
    )
    with pytest.raises(ConfigError, match="trust_remote_code"):
        hf_args(config_of(f"--hf.config={tmp_path / 'remote'}", "--model.flavor=config"))
    with pytest.raises(ConfigError, match="exactly one of hf.config"):
        config_of()
    with pytest.raises(ConfigError, match=r"^\[hf\] applies to model.name = 'hf', not 'llama3'; remove its keys"):
        load_config("llama3_debug", ["--hf.architecture=MistralForCausalLM"])
    with pytest.raises(ConfigError, match=r"model.hf_architecture: moved to hf.architecture; set that instead"):
        load_config("llama3_debug", ["--model.name=hf", "--model.hf_architecture=MistralForCausalLM"])


def test_the_registry_builds_hf_args_from_the_model_section() -> None:
    spec = get_model_spec("hf")
    args = spec.args_for(config_of("--hf.architecture=Qwen3ForCausalLM", "--model.flavor=debug"))
    assert args.config.num_hidden_layers == 2 and args.vocab_size == 512
    assert spec.override_value(args, "hidden_size") == 64
    big = spec.args_for(config_of("--hf.architecture=Qwen3ForCausalLM", "--model.flavor=config"))
    assert big.config.hidden_size == type(big.config)().hidden_size  # the config class's own default


def test_a_reference_built_from_garbage_weights_differs() -> None:
    """Negative control for the parity: a model whose weights are drawn again is not equal."""
    model = built_like_a_run("Phi3ForCausalLM")
    reference = parity.transformers_twin(model)
    with torch.no_grad():
        reference.model.layers[0].self_attn.qkv_proj.weight.normal_(0, 0.02)
    tokens = torch.randint(0, model.args.vocab_size, (2, SEQ + 1), generator=torch.Generator().manual_seed(1))
    with pytest.raises(AssertionError):
        compare(model, reference, tokens)


def test_debug_sizes_keep_a_config_consistent() -> None:
    """Per-layer lists follow the smaller layer count (Mellum's mlp_layer_types has 28 entries by
    default, which transformers refuses against 2 layers), special-token ids stay inside the smaller
    vocabulary (Phi-3 pads with 32000), partial rotary fits the smaller heads (GPT-J's rotary_dim)."""
    mellum = hf_args(config_of("--hf.architecture=MellumForCausalLM", "--model.flavor=debug")).config
    assert len(mellum.mlp_layer_types) == mellum.num_hidden_layers == 2
    type(mellum).from_dict(mellum.to_dict())  # transformers' own validation of the whole config
    phi3 = hf_args(config_of("--hf.architecture=Phi3ForCausalLM", "--model.flavor=debug")).config
    assert phi3.pad_token_id < phi3.vocab_size
    gptj = hf_args(config_of("--hf.architecture=GPTJForCausalLM", "--model.flavor=debug")).config
    assert gptj.rotary_dim <= gptj.n_embd // gptj.n_head


def debug_config(architecture: str) -> Any:
    return hf_args(config_of(f"--hf.architecture={architecture}", "--model.flavor=debug")).config


def test_debug_sizes_reach_composite_and_heterogeneous_configs() -> None:
    """A composite config keeps its sizes in its text part (Fuyu's vocab_size is only there: an
    AttributeError before); a heterogeneous one (Gemma 4's per-layer head_dim) refuses a global read
    of a per-layer field while its overrides are on (AmbiguousGlobalPerLayerAttributeError before), and
    once shrunk must not get full-size overrides back when its class rebuilds it (a 512-wide head on
    the last layer, which the class makes full attention, so the saved config built another model)."""
    fuyu = hf_args(config_of("--hf.architecture=FuyuForCausalLM", "--model.flavor=debug"))
    assert fuyu.vocab_size == fuyu.config.text_config.vocab_size == 512 and fuyu.dim == 64
    gemma4 = debug_config("Gemma4ForCausalLM")
    assert gemma4.layer_types == ["sliding_attention", "full_attention"]
    assert all(layer.head_dim == 16 for layer in gemma4.per_layer_config)
    again = type(gemma4).from_dict(gemma4.to_dict())
    assert [layer.head_dim for layer in again.per_layer_config] == [16, 16]
    assert hf_flops_per_token(hf_args(config_of("--hf.architecture=Gemma4ForCausalLM", "--model.flavor=debug")), 64) > 0


def test_debug_sizes_follow_per_layer_sizes_and_counts_of_layers() -> None:
    """Gemma 3n gives intermediate_size per layer (an int broke its MLP) and shares the keys of its
    last 15 of 35 layers (15 of 2 failed its validation), and its per-layer input table is a size
    (262144 x 256 per layer made the debug model 134M parameters); Dory's input, recurrent and output
    layers split its stack (8 + 20 + 8 of 36 against 2 layers failed validation); Kolibri's
    index_layers are layer indices, kept where the smaller stack has them."""
    gemma3n = debug_config("Gemma3nForCausalLM")
    assert gemma3n.intermediate_size == [128, 128] and gemma3n.num_kv_shared_layers == 1
    assert gemma3n.vocab_size_per_layer_input == 512
    dory = debug_config("DoryForCausalLM")
    assert (dory.n_input_layers, dory.n_recurrent_layers, dory.n_output_layers) == (1, 1, 1)
    assert dory.num_hidden_layers == len(dory.layer_types) == 3
    kolibri = debug_config("Kolibri1_1ForCausalLM")
    assert all(i < kolibri.num_hidden_layers for i in kolibri.index_layers)
    # A size of 0 switches its part off and stays 0 (a Gemma 4 assistant's text config requires it).
    assert debug_config("Gemma4UnifiedForCausalLM").num_kv_shared_layers == 0


def test_debug_sizes_reach_every_stack_and_derived_sizes() -> None:
    """BLT is four stacks (patcher, local encoder and decoder, global transformer) in sub-configs and
    no text part: only its own fields were shrunk, 4.6 billion parameters at "debug" (the sweep
    timed out); LongCat derives qk_head_dim only when unset, so it kept 192 against 16 + 8; HRM
    kept 16 layers per stack."""
    blt = debug_config("BltForCausalLM")
    for stack in (blt.patcher_config, blt.encoder_config, blt.decoder_config, blt.global_config):
        assert stack.num_hidden_layers == 2 and stack.hidden_size == 64
    assert blt.encoder_config.hidden_size_global == blt.global_config.hidden_size
    args = hf_args(config_of("--hf.architecture=BltForCausalLM", "--model.flavor=debug"))
    assert hf_param_count(args).total < 2_000_000
    longcat = debug_config("LongcatFlashForCausalLM")
    assert longcat.qk_head_dim == longcat.qk_nope_head_dim + longcat.qk_rope_head_dim == 24
    # HRM derives num_layers_per_stack from num_hidden_layers, then inflates the latter to one cache
    # slot per attention call (layers x H_cycles x (L_cycles + 1)); a kept 16 per stack overran it.
    hrm = debug_config("HrmTextForCausalLM")
    assert hrm.num_layers_per_stack == 2
    assert hrm.num_hidden_layers == 2 * hrm.H_cycles * (hrm.L_cycles + 1)


def test_a_model_with_one_embedding_per_codebook_is_counted() -> None:
    """MusicGen embeds each audio codebook with its own table and has a head per codebook (a list of
    them, which has no .weight: the count raised); the debug batch's rows are its codebooks' streams."""
    model = built_like_a_run("MusicgenForCausalLM")
    count = hf_param_count(model.args)
    tables = sum(p.numel() for p in model.hf.get_input_embeddings().parameters())
    assert count.total == sum(p.numel() for p in model.parameters())
    assert count.active_non_embedding == count.total - tables
    tokens = torch.randint(0, model.args.vocab_size, (2, SEQ + 1), generator=torch.Generator().manual_seed(1))
    result = parity.against_transformers(model, tokens)  # eval mode both: MusicGen has dropout
    assert result.within(), result


def test_decoder_layers_are_found_where_the_class_names_no_unsplit_modules() -> None:
    """BioGPT's _no_split_modules is empty: its layers are the list of one class as long as the
    config's layer count."""
    model = built_like_a_run("BioGptForCausalLM")
    assert model.layers_path == "biogpt.layers" and model.n_blocks == 2


JAMBA = r"^{key}: model hf cannot be sampled by the builtin sampler \(JambaForCausalLM has linear_attention layers.*\); {remedy}"


@pytest.mark.parametrize(
    ("config", "overrides", "message"),
    [
        (
            "grpo_qwen3_debug",
            ["--hf.architecture=JambaForCausalLM"],
            JAMBA.format(key="rl.engine = 'builtin'", remedy=r"set rl.engine = 'vllm'"),
        ),
        (
            "sft_qwen3_debug",
            ["--hf.architecture=JambaForCausalLM", "--sft.packing=false"],
            JAMBA.format(key="sft.eval_generations", remedy=r"set it to 0"),
        ),
        # Packed SFT rows need document ids (it used to fail at step 1, advising data.document_mask).
        (
            "sft_qwen3_debug",
            ["--hf.architecture=Qwen3ForCausalLM"],
            r"^sft.packing: model hf attends across packed examples .*; set sft.packing = false",
        ),
        ("llama3_debug", ["--data.document_mask=true"], "data.document_mask: model hf attends across packed documents"),
    ],
)
def test_what_the_family_cannot_do_yet_is_refused_at_start(
    config: str, overrides: list[str], message: str, tmp_path: Any
) -> None:
    """One line before anything is built, instead of an error at the first decode or forward: a class
    whose layers keep a state transformers' KV cache does not hold is not sampled by ours (GRPO then
    samples it with the vLLM engine)."""
    from titan_tpu.training.trainer import Trainer

    hf = [
        "--model.name=hf",
        *(["--hf.architecture=Qwen3ForCausalLM"] if not any(o.startswith("--hf.") for o in overrides) else []),
        "--model.flavor=debug",
        "--model.overrides={ vocab_size = 1024 }",
        f"--job.dump_folder={tmp_path}",
    ]
    with pytest.raises(ConfigError, match=message):
        Trainer(load_config(config, [*hf, *overrides]))


def test_the_planner_plans_an_hf_config_from_the_command_line() -> None:
    """`python -m titan_tpu.plan` on a shipped hf config prints a plan (it used to refuse the family:
    no activation estimate). Its numbers are tested against the native twin in test_hf_planning.py."""
    import subprocess
    import sys

    root = REPO
    done = subprocess.run(
        [sys.executable, "-m", "titan_tpu.plan", "--config", "hf_mistral_debug", "--chips", "v6e-8"],
        cwd=root,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "hf debug" in done.stdout and "fits:" in done.stdout and "MFU" in done.stdout, done.stdout


def test_the_sweep_scopes_an_architecture_by_its_config_class() -> None:
    """Scope is the architecture's: Mamba 2's config fails its own validation at the debug sizes, and
    the sweep's fallback then counted it as an in-scope decoder-only transformer."""
    from scripts.hf_sweep import architecture_scope

    assert architecture_scope("Mamba2ForCausalLM") == "state-space, recurrent or linear-attention layers"
    assert architecture_scope("XLNetLMHeadModel") == "encoder run as a decoder"
    assert architecture_scope("MistralForCausalLM") == ""
