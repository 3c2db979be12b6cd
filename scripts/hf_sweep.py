"""The blind test of the hf family: every causal-LM class of the installed transformers, built at tiny
sizes from its own config class (`[model] name = "hf"`, flavor "debug"), through each step that
applies to it, and the table in docs/hf_models.md.

    python scripts/hf_sweep.py [--only MistralForCausalLM,...] [--out docs/hf_models.md] [--timeout 120]

Per architecture, on this CPU in float32:
1. build: its config class at the debug sizes (titan_tpu/models/hf/args.py), built on `meta`;
   then transformers' own model of that config is saved by `save_pretrained`, a folder in the
   checkpoint format the Hub publishes, which the load and export steps start from
   (scripts/hf_folder_checks.py);
2. load: our model of the folder's config (`hf.config`, flavor "config") loaded from the folder as a
   run loads it holds exactly the tensors transformers' `from_pretrained` holds, logits within 1e-5;
3. parity: materialised and initialised as a run does, loss and every gradient on 2 x 24 tokens
   against transformers' own model with the same weights, both in eval mode so that dropout draws
   nothing (loss 1e-5 relative, each gradient 1e-4 of its largest element);
4. train: 3 AdamW steps (lr 1e-3) on one batch, the loss falling;
5. export: our export of the loaded model holds the saved folder's tensors under its names, and
   loads in the class's `from_pretrained` and in our family to the same logits (1e-5);
6. fsdp2: where one process could compare with transformers at all (3. ran), on 2 processes (one
   torchrun launch per 12 architectures, gloo) the model parallelised by the run's own path (FSDP
   per decoder layer and the root) gives transformers' loss and gradients (as 3.);
7. tp2: the same on 2 processes with tensor parallelism 2 by the model's own transformers TP plan
   (titan_tpu/models/hf/parallelize.py); it applies to the architectures whose plan splits their decoder
   layers ("n/a" otherwise).

Scope is decided from the class and its config before anything runs, and printed with the reason:
decoder halves of encoder-decoder models, encoders run as decoders, models with state-space,
recurrent, convolutional or linear-attention layers, and the text part of multimodal models are out
of scope (their rows are still run and shown); the total is over the rest, the decoder-only
transformers. A step that fails records its error's first line; an architecture that exceeds
--timeout seconds records that.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from titan_tpu.device.tpu_runtime import skip_tpu_backend_without_chips  # noqa: E402

skip_tpu_backend_without_chips()  # before anything imports torch (titan_tpu/device/tpu_runtime.py)

import torch  # noqa: E402

SEQ = 24
STEPS = ("build", "load", "parity", "train", "export", "fsdp2", "tp2")
# Model types whose causal-LM class is the decoder of an encoder-decoder model, or an encoder (BERT
# and its relatives, XLNet's permutation LM) run with a causal mask: not decoder-only transformers.
ENCODER_FAMILIES = {
    "bert",
    "bert-generation",
    "big_bird",
    "camembert",
    "data2vec-text",
    "electra",
    "ernie",
    "megatron-bert",
    "rembert",
    "roc_bert",
    "roformer",
    "roberta",
    "roberta-prelayernorm",
    "xlm",
    "xlm-roberta",
    "xlm-roberta-xl",
    "xlnet",
    "xmod",
    "reformer",
}
# Model types whose layers are recurrent (not attention) though their configs name no state size.
RECURRENT_FAMILIES = {"xlstm", "rwkv"}
# Config keys only models with state-space, recurrent, convolutional or linear-attention layers carry.
NON_ATTENTION_KEYS = (
    "ssm_state_size",
    "state_size",
    "mamba_d_state",
    "mamba_n_heads",
    "d_state",
    "lru_width",
    "conv_L_cache",
    "linear_conv_kernel_dim",
    "linear_num_value_heads",
    "block_types",
    "attn_type_list",
    "rnn_width",
)


def is_attention_layer(kind: str) -> bool:
    """A layer type that is softmax attention (full, sliding, chunked, indexed), not linear attention."""
    return kind.endswith("attention") and not kind.startswith("linear")


def scope(architecture: str, config: Any) -> str:
    """ "" for a decoder-only transformer, else why not."""
    model_type = getattr(config, "model_type", "")
    if getattr(config, "is_encoder_decoder", False) or "decoder_layers" in config.to_dict():
        return "decoder of an encoder-decoder model"
    if model_type in ENCODER_FAMILIES:
        return "encoder run as a decoder"
    if model_type in RECURRENT_FAMILIES or any(key in config.to_dict() for key in NON_ATTENTION_KEYS):
        return "state-space, recurrent or linear-attention layers"
    layer_types = getattr(config, "layer_types", None)
    others = (
        sorted({str(kind) for kind in layer_types if not is_attention_layer(str(kind))})
        if isinstance(layer_types, list)
        else []
    )
    if others:
        return f"non-attention layers ({', '.join(others)})"
    if architecture.endswith("ForConditionalGeneration") or any(
        k in config.to_dict() for k in ("vision_config", "audio_config")
    ):
        return "text part of a multimodal model"
    return ""


def architecture_scope(architecture: str) -> str:
    """`scope` of an architecture from its config class's own defaults: the architecture's, not the
    debug sizes' (a config those sizes leave invalid, Mamba 2's, still says what its layers are)."""
    from titan_tpu.models.hf.args import model_class

    try:
        config = model_class(architecture, "--only").config_class()
    except Exception:  # noqa: BLE001 - a config class whose defaults do not build: by its name only
        return "text part of a multimodal model" if architecture.endswith("ForConditionalGeneration") else ""
    return scope(architecture, config)


class Timeout(BaseException):
    """Not an Exception: the per-step `except Exception` must not swallow it and go on."""


@contextmanager
def time_limit(seconds: int) -> Iterator[None]:
    def expire(signum: int, frame: Any) -> None:
        raise Timeout(f"over {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def first_line(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip().splitlines()[0]
    return text[:160]


def config_of(architecture: str) -> Any:
    from titan_tpu.config import load_config

    return load_config(
        "llama3_debug",
        ["--model.name=hf", f"--hf.architecture={architecture}", "--model.flavor=debug", f"--training.seq_len={SEQ}"],
    )


def batch(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, SEQ + 1), generator=torch.Generator().manual_seed(0))


def check_one(architecture: str) -> dict[str, Any]:
    """Steps 1-4 in this process; each value "ok", or why not."""
    from scripts import hf_folder_checks as folders
    from scripts import hf_parity as parity
    from titan_tpu.models.hf.args import hf_args
    from titan_tpu.models.hf.flops import hf_param_count
    from titan_tpu.models.hf.model import HFCausalLM

    row: dict[str, Any] = {"architecture": architecture}
    row["scope"] = architecture_scope(architecture)
    args = hf_args(config_of(architecture))
    with torch.device("meta"):
        HFCausalLM(args)
    row["params"] = hf_param_count(args).total
    row["build"] = "ok"
    tokens = batch(args.vocab_size)

    def step(name: str, run: Callable[[], str]) -> None:
        try:
            row[name] = run()
        except Exception as error:  # noqa: BLE001 - the sweep records every failure and goes on
            row[name] = first_line(error)

    def check_parity() -> str:
        result = parity.against_transformers(parity.built_like_a_run(args, SEQ), tokens)
        if not result.within():
            return f"loss {result.loss_rel:.1e}, {result.worst_grad} {result.worst_grad_rel:.1e}, missing {list(result.missing_grads)[:2]}"
        return "ok"

    def check_training() -> str:
        model = parity.built_like_a_run(args, SEQ)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for _ in range(3):
            loss, _ = parity.loss_and_grads(model, model, tokens)
            optimizer.step()
            losses.append(float(loss))
        return "ok" if losses[-1] < losses[0] else f"loss {losses[0]:.4f} -> {losses[-1]:.4f}"

    with tempfile.TemporaryDirectory() as temporary:
        saved = folders.save_transformers_folder(args, Path(temporary) / "saved")
        loaded: list[Any] = []

        def check_load() -> str:
            verdict, model = folders.check_load(saved, architecture, tokens, SEQ)
            loaded.append(model)
            return verdict

        def check_export() -> str:
            if not loaded or loaded[0] is None:
                return "not run: the load failed"
            return folders.check_export(loaded[0], saved, Path(temporary) / "export", tokens, SEQ)

        step("load", check_load)
        step("parity", check_parity)
        step("train", check_training)
        step("export", check_export)
    return row


def cpu_name() -> str:
    """The CPU's model name and its bf16 flags, from /proc/cpuinfo (the machine type elsewhere)."""
    import platform

    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine()
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    bf16 = [flag for flag in ("avx512_bf16", "amx_bf16") if flag in flags] or ["no native bf16"]
    return f"{name or platform.machine()} ({', '.join(bf16)})"


def applies(row: dict[str, Any], step: str) -> bool:
    """tp2 does not apply to a model without a TP plan for its layers; every other step always does
    (one that did not run because an earlier one failed counts as failed)."""
    return not str(row.get(step, "")).startswith("n/a")


def render(rows: list[dict[str, Any]], seconds: float) -> str:
    import transformers

    in_scope = [r for r in rows if not r["scope"]]
    passed = [r for r in in_scope if all(r.get(s) == "ok" for s in STEPS if applies(r, s))]
    with_plan = [r for r in in_scope if applies(r, "tp2")]
    lines = [
        "# Hugging Face models through the hf family",
        "",
        "Written by `python scripts/hf_sweep.py` (one run, its defaults); do not edit by hand.",
        "",
        f"- transformers {transformers.__version__}, torch {torch.__version__}, on {cpu_name()}"
        f" ({torch.get_num_threads()} threads), float32, {seconds / 60:.1f} min.",
        f"- Causal-LM classes: {len(rows)}; decoder-only transformers (in scope): {len(in_scope)}; out of scope: "
        f"{len(rows) - len(in_scope)} (reason in the table).",
        f"- In scope passing every step that applies (build, load, parity, train, export, fsdp2, and tp2 where "
        f"transformers has a TP plan for the layers): **{len(passed)} of {len(in_scope)} "
        f"({100 * len(passed) / max(len(in_scope), 1):.1f}%)**.",
        f"- tp2 applies to {len(with_plan)} of the in-scope architectures and passes for "
        f"{sum(r.get('tp2') == 'ok' for r in with_plan)}.",
        "",
        "| architecture | scope | params | build | load | parity | train | export | fsdp2 | tp2 |",
        "| --- | --- | ---: | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        cells = [r.get(step, "-") for step in STEPS]
        lines.append(
            f"| {r['architecture']} | {r['scope'] or 'in scope'} | {r.get('params', '-')} | "
            + " | ".join(str(c).replace("|", "/") for c in cells)
            + " |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="comma-separated class names (default: every causal LM)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "hf_models.md")
    parser.add_argument("--timeout", type=int, default=120, help="seconds per architecture and step group")
    opts = parser.parse_args(argv)
    import logging

    import transformers

    from scripts import hf_sweep_layouts as layouts
    from titan_tpu.models.hf.args import causal_lm_classes

    transformers.logging.set_verbosity_error()
    logging.getLogger("titan_tpu").setLevel(logging.WARNING)
    start = time.perf_counter()
    architectures = opts.only.split(",") if opts.only else sorted(causal_lm_classes())
    rows: list[dict[str, Any]] = []
    for architecture in architectures:
        began = time.perf_counter()
        try:
            with time_limit(opts.timeout):
                row = check_one(architecture)
        except (Exception, Timeout) as error:  # noqa: BLE001
            row = {"architecture": architecture, "scope": "", "build": first_line(error)}
            if not isinstance(error, Timeout):
                traceback.print_exc(limit=1)
            row["scope"] = architecture_scope(architecture)
        rows.append(row)
        print(json.dumps({**row, "seconds": round(time.perf_counter() - began, 1)}), flush=True)
    # FSDP 2 is compared with transformers' own model: it applies where one process could run that
    # comparison at all (a model too slow or too large for it there would be so on every rank).
    comparable = [
        r["architecture"] for r in rows if r.get("parity") == "ok" or str(r.get("parity", "")).startswith("loss ")
    ]
    # Each of the 2 ranks holds three copies (ours whole, transformers', ours sharded).
    too_big = {r["architecture"] for r in rows if r.get("params", 0) > layouts.LAYOUT_MAX_PARAMS}
    for layout in layouts.LAYOUTS:
        verdicts = (
            layouts.run_layout(layout, [a for a in comparable if a not in too_big], opts.timeout) if comparable else {}
        )
        verdicts.update(
            {
                a: f"not run: over {layouts.LAYOUT_MAX_PARAMS // 10**6}M parameters at debug sizes"
                for a in too_big
                if a in comparable
            }
        )
        for row in rows:
            row[layout] = verdicts.get(row["architecture"], "-")
    opts.out.write_text(render(rows, time.perf_counter() - start))
    summary = render(rows, time.perf_counter() - start).splitlines()[4:8]
    print("\n".join(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
