"""GRPO on a vLLM engine, synchronous against sampling ahead (`rl.max_staleness = 1`): the recipe's
GRPO phase twice, from the same SFT model, with the engine and the trainer each held to a core of its own.

    .venv/bin/python scripts/bench_grpo_overlap.py --recipe OUT [--steps 100] [--out DIR]

OUT is a finished `scripts/recipes/sft_then_grpo.py --out OUT` run: its generated data, tokenizer
and SFT export (`OUT/sft_hf`) are used as they are, and the GRPO phase is the recipe's own config
(`scripts/recipes/sft_then_grpo.py`'s), with `rl.engine = "vllm"` pointed at one server. Two processes:
the server (vLLM's processes, started here from the SFT folder, all on core 0, its OpenMP threads
bound there) and the trainer (this process, on core 1, one thread). The same server serves both
modes; each run pushes the SFT weights to it before its first rollout. Each mode is one
uninterrupted `Trainer.train()`, timed from its first step to its last; after it, held-out accuracy
of its export as the recipe measures it.

Prints one JSON line per mode (wall seconds, seconds per step, the trainer's wait for rollouts per
step and as a share of its step in steady state, the engine's idle seconds, held-out accuracy) and
the ratio synchronous / sampling ahead. With one core each, the most overlap can give is the
trainer's and the engine's work running side by side instead of one after the other.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from titan_tpu.device.tpu_runtime import skip_tpu_backend_without_chips  # noqa: E402

skip_tpu_backend_without_chips()  # before anything imports torch (titan_tpu/device/tpu_runtime.py)

import torch  # noqa: E402

from scripts.recipes.sft_then_grpo import configs, run_phase  # noqa: E402
from titan_tpu.generation.vllm.environment import engine_python  # noqa: E402
from titan_tpu.generation.vllm.server import ManagedServer, ServerSettings  # noqa: E402
from titan_tpu.tasks.grpo.config import RLConfig  # noqa: E402
from titan_tpu.tasks.grpo.recipe_eval import evaluate_export  # noqa: E402
from titan_tpu.tasks.grpo.word_problem_data import RecipeData  # noqa: E402

ENGINE_CORE, TRAINER_CORE = 0, 1
IDLE = "rollout/engine_idle_seconds"
STEADY_AFTER = 10  # steps: the first record holds the first rollout, which nothing overlaps


def recipe_data(recipe: Path) -> RecipeData:
    data = recipe / "data"
    files = ("pretraining.jsonl", "sft.jsonl", "grpo_prompts.jsonl", "held_out.jsonl")
    missing = [name for name in (*files, "tokenizer") if not (data / name).exists()]
    if missing or not (recipe / "sft_hf" / "config.json").is_file():
        raise SystemExit(f"error: --recipe {recipe}: not a finished sft_then_grpo.py run (missing data or sft_hf)")
    return RecipeData(*(data / name for name in files), data / "tokenizer")


def start_engine(folder: Path, log: Path) -> ManagedServer:
    """The server on ENGINE_CORE: its processes inherit this process's affinity, and vLLM binds its
    worker's OpenMP threads to the core VLLM_CPU_OMP_THREADS_BIND names."""
    os.sched_setaffinity(0, {ENGINE_CORE})
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(ENGINE_CORE)
    server = ManagedServer(
        ServerSettings(
            python=engine_python("", RLConfig().engine_requirement),
            model_folder=folder,
            dtype="float32",
            memory_share=0.1,
            tensor_parallel=1,
            max_model_len=96,  # the recipe's GRPO training.seq_len
            log=log,
            start_timeout=600,
            device_type="cpu",
        )
    )
    server.start()
    return server


@dataclass(frozen=True)
class ModeResult:
    max_staleness: int
    steps: int
    wall_seconds: float
    steady_step_seconds: float  # the median step after STEADY_AFTER
    steady_wait_seconds: float  # per step after STEADY_AFTER, the trainer waiting for rollouts (synchronous: sampling)
    steady_wait_share: float  # of those steps' time
    engine_idle_seconds: float | None  # sampling ahead: the engine waiting for the trainer, in all
    heldout_accuracy: float


def run_mode(staleness: int, recipe: Path, data: RecipeData, url: str, steps: int, out: Path) -> ModeResult:
    phase_args = SimpleNamespace(out=recipe, grpo_steps=steps, max_new_tokens=32, eval_prompts=256)
    phase_args.pretrain_steps = phase_args.sft_steps = 1  # unused: only the GRPO phase runs here
    dump = out / f"staleness_{staleness}"
    extra = [
        "--rl.engine=vllm",
        f"--rl.engine_urls={url}",
        f"--rl.max_staleness={staleness}",
        f"--job.dump_folder={dump}",
        "--metrics.log_freq=1",
    ]
    config = configs(phase_args, data, extra)["grpo"]
    start = time.perf_counter()
    folder = run_phase(f"grpo_staleness_{staleness}", config, out).folder
    wall = time.perf_counter() - start
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    steps_done = [r for r in records if "loss" in r]
    steady = steps_done[STEADY_AFTER:]
    step_seconds = [r["step_time_s"] for r in steady]
    # A step that took its batch from an earlier rollout has no rollout figures: it waited for none.
    waits = [r.get("rollout/trainer_wait_seconds", r.get("rollout/sample_seconds", 0.0)) for r in steady]
    return ModeResult(
        max_staleness=staleness,
        steps=len(steps_done),
        wall_seconds=round(wall, 1),
        steady_step_seconds=round(statistics.median(step_seconds), 3),
        steady_wait_seconds=round(sum(waits) / len(waits), 3),
        steady_wait_share=round(sum(waits) / sum(step_seconds), 3),
        engine_idle_seconds=next(
            (r[IDLE] for r in reversed(steps_done) if IDLE in r), None
        ),  # a running total, logged with each rollout
        heldout_accuracy=round(evaluate_export(folder, config).accuracy, 4),
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", type=Path, required=True, help="a finished sft_then_grpo.py --out folder")
    parser.add_argument("--steps", type=int, default=100, help="GRPO steps per mode (the recipe's default)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench_grpo_overlap"))
    opts = parser.parse_args(argv)
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("error: this benchmark holds the engine and the trainer to a core each; it needs 2 cores")
    if opts.out.exists() and any(opts.out.iterdir()):
        raise SystemExit(f"error: --out {opts.out} exists and is not empty; pick a new folder")
    opts.out.mkdir(parents=True, exist_ok=True)
    data = recipe_data(opts.recipe)
    server = start_engine(opts.recipe / "sft_hf", opts.out / "engine.log")
    try:
        os.sched_setaffinity(0, {TRAINER_CORE})
        torch.set_num_threads(1)
        results = [run_mode(staleness, opts.recipe, data, server.url, opts.steps, opts.out) for staleness in (0, 1)]
    finally:
        server.stop()
    for result in results:
        print(json.dumps(asdict(result)), flush=True)
    sync, ahead = results
    cores = {"engine": ENGINE_CORE, "trainer": TRAINER_CORE}
    print(json.dumps({"cpu_cores": cores, "sync_over_ahead": round(sync.wall_seconds / ahead.wall_seconds, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
