"""What pipeline parallelism costs: PP 2 x FSDP 2 against FSDP 4 on 4 processes, beside the bubble
the planner predicts for it (titan_tpu/plan/pipeline_bubble.py).

    python scripts/bench_pipeline.py [--config llama3_debug] [--layers 12] [--schedule 1F1B]
        [--microbatches 4] [--global-batch 16] [--steps 8] [--warmup 2] [--repeats 3]

Both layouts train the config's model with `--layers` decoder layers on the same global batch, so
they do the same work per optimizer step: FSDP 4 runs each rank's share in one pass; PP 2 x FSDP 2
splits the layers into two stages and each data-parallel rank's share into `--microbatches`
micro-batches. Each case is scripts/bench.py in its own 4 processes (under torchrun, one thread each),
the two layouts alternating, every other repeat in reverse order. Prints one JSON line per case, then
the median over the repeats of each repeat's FSDP 4 rate / PP rate (the slowdown pipelining cost) and
the planner's step-time factor (m + (p - 1) / v) / m: pipelining loses no more than the bubble when
the slowdown is at most that factor.

On a CPU the processes share cores: a rank waiting in the bubble gives its core to the others, which
hides part of the bubble, and 4 processes on fewer cores slow both layouts alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.bench import launch  # noqa: E402
from titan_tpu.plan.pipeline_bubble import bubble_fraction, stages_per_rank, step_time_factor  # noqa: E402

PP = 2
PROCESSES = 4
LAYOUTS = {
    "fsdp4": ["--parallelism.dp_shard=4"],
    "pp2xfsdp2": [f"--parallelism.pp={PP}", "--parallelism.dp_shard=2"],
}


def _run(config: str, layout: str, args: argparse.Namespace, repeat: int) -> dict[str, object]:
    overrides = [
        f"--model.overrides.n_layers={args.layers}",
        f"--training.global_batch_size={args.global_batch}",
        f"--parallelism.pp_schedule={args.schedule}",
        f"--parallelism.pp_microbatches={args.microbatches}",
        f"--job.dump_folder={args.out / f'{layout}_{repeat}'}",
        *LAYOUTS[layout],
    ]
    result = launch(config, PROCESSES, [f"--steps={args.steps}", f"--warmup={args.warmup}", *overrides])
    if result.returncode != 0:
        raise SystemExit(f"{layout} failed (exit code {result.returncode}):\n{result.stderr[-3000:]}")
    record = json.loads(result.stdout.strip().splitlines()[-1])
    return {"layout": layout, "repeat": repeat, **record}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--config", default="llama3_debug")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--schedule", default="1F1B")
    parser.add_argument("--microbatches", type=int, default=4, help="pp_microbatches of the pipelined layout")
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8, help="timed optimizer steps per case")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench_results/pipeline"))
    args = parser.parse_args()

    slowdowns = []
    for repeat in range(args.repeats):
        order = list(LAYOUTS) if repeat % 2 == 0 else list(reversed(LAYOUTS))
        records = {layout: _run(args.config, layout, args, repeat) for layout in order}
        for layout in order:
            print(json.dumps(records[layout]), flush=True)
        rate = next(key for key in records["fsdp4"] if key.endswith("_per_sec_per_process"))
        slowdowns.append(float(records["fsdp4"][rate]) / float(records["pp2xfsdp2"][rate]))  # type: ignore[arg-type]
    per_rank = stages_per_rank(args.schedule)
    predicted = step_time_factor(args.schedule, PP, args.microbatches, per_rank)
    slowdown = statistics.median(slowdowns)
    print(
        json.dumps(
            {
                "slowdown_pp_vs_fsdp": round(slowdown, 3),
                "per_repeat": [round(s, 3) for s in slowdowns],
                "predicted_step_time_factor": round(predicted, 3),
                "predicted_idle_share": round(bubble_fraction(args.schedule, PP, args.microbatches, per_rank), 3),
                "within_predicted_bubble": slowdown <= predicted,
                "meaning": f"FSDP {PROCESSES} rate / PP {PP} x FSDP {PROCESSES // PP} rate; at most the factor means "
                f"pipelining lost no more than the bubble ({args.schedule}, {args.microbatches} micro-batches)",
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
