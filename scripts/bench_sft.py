"""Fine-tuning throughput against pretraining on the same model, sequence length and batch: packed,
document-masked SFT rows (`sft_qwen3_debug`) and packed pretraining text (`qwen3_debug`), tokens/s
of each, alternated `--repeats` times in this one process so that both see the same machine.

    python scripts/bench_sft.py [--steps 40] [--warmup 5] [--repeats 3] [--section.key=value ...]

SFT counts the tokens of its examples (not the padding at a row's end), pretraining every token; the
overrides apply to both runs. Prints one JSON line per run, then the median ratio SFT / pretraining
of tokens/s and of MFU (the fine-tuning issue asks for at least 0.9). Each run's MFU is against the
matmul peak probed right after it, so its ratio survives more of a shared machine's drift.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from titan_tpu.device.tpu_runtime import skip_tpu_backend_without_chips  # noqa: E402

skip_tpu_backend_without_chips()  # before anything imports torch (titan_tpu/device/tpu_runtime.py)

from scripts.bench import measure  # noqa: E402
from titan_tpu.config import load_config  # noqa: E402

SFT, PRETRAINING = "sft_qwen3_debug", "qwen3_debug"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    opts, overrides = parser.parse_known_args(argv)
    sft = load_config(SFT, overrides).training
    # The same shapes and dtype for both; no evaluation inside the timed steps.
    shared = [
        f"--training.seq_len={sft.seq_len}",
        f"--training.global_batch_size={sft.global_batch_size}",
        f"--training.local_batch_size={sft.local_batch_size}",
        f"--training.dtype={sft.dtype}",
        "--metrics.eval_freq=0",
        "--checkpoint.enable=false",
        *overrides,
    ]
    rates: dict[str, list[float]] = {SFT: [], PRETRAINING: []}
    mfus: dict[str, list[float]] = {SFT: [], PRETRAINING: []}
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(opts.repeats):
            for name in (SFT, PRETRAINING):
                extra = ["--validation.enable=false"] if name == SFT else []
                folder = f"--job.dump_folder={Path(scratch) / f'{name}-{repeat}'}"
                record = measure(name, opts.steps, opts.warmup, [*shared, *extra, folder])
                assert record is not None  # one process: it is the writer
                print(json.dumps(record), flush=True)
                rates[name].append(float(record["tokens_per_sec_per_process"]))  # type: ignore[arg-type]
                mfu = record["mfu_percent"]  # None where the device has no known peak
                mfus[name].append(math.nan if mfu is None else float(mfu))  # type: ignore[arg-type]
    ratios = [s / p for s, p in zip(rates[SFT], rates[PRETRAINING])]
    mfu_ratios = [s / p for s, p in zip(mfus[SFT], mfus[PRETRAINING])]
    print(
        json.dumps(
            {
                "sft_tokens_per_sec": rates[SFT],
                "pretraining_tokens_per_sec": rates[PRETRAINING],
                "sft_over_pretraining": [round(r, 3) for r in ratios],
                "median_ratio": round(statistics.median(ratios), 3),
                "sft_mfu": mfus[SFT],
                "pretraining_mfu": mfus[PRETRAINING],
                "median_mfu_ratio": round(statistics.median(mfu_ratios), 3),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
