"""Training throughput of the hf family against our own Llama 3 and against transformers' own loop,
at the llama3_debug shape, in this one process.

    python scripts/bench_hf.py [--steps 20] [--warmup 3] [--section.key=value ...]

Three runners train the same shape (width 256, 4 layers, 8 heads with 4 kv heads, SwiGLU 768,
vocabulary 512) on batches of training.global_batch_size x training.seq_len tokens, in the run's
compute dtype (training.dtype, auto by default):
- llama3: `train.py --config llama3_debug`'s Trainer (our model);
- hf: the same Trainer with `[model] name = "hf"`, `[hf] architecture = "LlamaForCausalLM"` at that shape;
- transformers: `LlamaForCausalLM` of the same config in a plain loop (forward with labels, backward,
  gradient clipping at training.max_norm, AdamW), under CPU autocast where the run computes in
  bfloat16 (what transformers' Trainer does with bf16 = true).
The runners take turns a step at a time after their warm-up steps, so a shared CPU's drift favours
none. Prints one JSON line per runner (median step time, tokens/s) and the ratios hf / llama3 (the
hf issue asks for at least 0.8) and hf / transformers (more than 1), each the median of the
per-round ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from titan_tpu.device.tpu_runtime import skip_tpu_backend_without_chips  # noqa: E402

skip_tpu_backend_without_chips()  # before anything imports torch (titan_tpu/device/tpu_runtime.py)

import torch  # noqa: E402

from scripts.bench import TimedTrainer  # noqa: E402

# LlamaForCausalLM at llama3_debug's shape (titan_tpu/models/llama3/args.py). head_dim is a field of its own
# in LlamaConfig (128 from the 8B defaults), not derived again from a new width: it is set too.
LLAMA_DEBUG_SHAPE = (
    "{ hidden_size = 256, num_hidden_layers = 4, num_attention_heads = 8, num_key_value_heads = 4, "
    "head_dim = 32, intermediate_size = 768, vocab_size = 512 }"
)


def transformers_loop(trainer: TimedTrainer) -> Callable[[], float]:
    """One step of transformers' own model in a plain loop, on the hf run's config and batch shape."""
    from titan_tpu.models.hf.model import build_hf_model

    run = trainer.trainer
    config = run.config
    args = run.model_args
    torch.manual_seed(0)
    model = build_hf_model(args)
    model.train()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.optimizer.lr, weight_decay=config.optimizer.weight_decay
    )
    batch = torch.randint(
        0,
        args.vocab_size,
        (config.training.global_batch_size, config.training.seq_len),
        generator=torch.Generator().manual_seed(0),
    )
    autocast = run.compute_dtype == torch.bfloat16

    def step() -> float:
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.training.max_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    return step


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    opts, overrides = parser.parse_known_args(argv)
    total = opts.steps + opts.warmup
    common = [f"--training.steps={total}", "--metrics.log_freq=1000", *overrides]
    ours = TimedTrainer("llama3_debug", common)
    hf = TimedTrainer(
        "llama3_debug",
        [
            *common,
            "--model.name=hf",
            "--hf.architecture=LlamaForCausalLM",
            "--model.flavor=config",
            f"--model.overrides={LLAMA_DEBUG_SHAPE}",
        ],
    )
    # The same shape, or the comparison means nothing (a config field left at its default once made
    # hf's attention 4x as wide): the same parameter count.
    counts = [sum(p.numel() for p in t.trainer.model.parameters()) for t in (ours, hf)]
    if counts[0] != counts[1]:
        raise SystemExit(f"error: llama3 has {counts[0]} parameters and the hf model {counts[1]}; not the same shape")
    theirs = transformers_loop(hf)
    runners: dict[str, Callable[[], float]] = {
        "llama3": ours.step_seconds,
        "hf": hf.step_seconds,
        "transformers": theirs,
    }
    times: dict[str, list[float]] = {name: [] for name in runners}
    try:
        for round_index in range(total):
            order = list(runners) if round_index % 2 == 0 else list(runners)[::-1]
            for name in order:
                seconds = runners[name]()
                if round_index >= opts.warmup:
                    times[name].append(seconds)
    finally:
        ours.close()
        hf.close()
    tokens = hf.items_per_step
    for name, seconds in times.items():
        median = statistics.median(seconds)
        print(
            json.dumps({"runner": name, "median_step_s": round(median, 4), "tokens_per_sec": round(tokens / median, 1)})
        )
    ratio_llama3 = statistics.median(o / h for h, o in zip(times["hf"], times["llama3"]))
    ratio_transformers = statistics.median(t / h for h, t in zip(times["hf"], times["transformers"]))
    print(
        json.dumps(
            {
                "dtype": str(hf.trainer.compute_dtype).removeprefix("torch."),
                "threads": torch.get_num_threads(),
                "tokens_per_step": tokens,
                "steps": opts.steps,
                "hf_over_llama3": round(ratio_llama3, 3),
                "hf_over_transformers": round(ratio_transformers, 3),
                "kernels_llama3": ours.kernels,
                "kernels_hf": hf.kernels,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
