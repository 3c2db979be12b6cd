"""Charts from runs and benchmarks, as PNG files.

    # loss against step and against tokens (or samples) seen; several runs are labelled by folder
    python scripts/plot.py outputs/llama3_debug/metrics.jsonl --out loss.png
    python scripts/plot.py outputs/run_a outputs/run_b --processes 4 --out compare.png

    # tokens/s (or samples/s) per process and MFU per case, from scripts/bench.py records
    python scripts/plot.py --bench bench_results/ --out bench.png

Throughput in a record is per process, so the items seen are per process unless --processes gives
the run's process count (a run draws its own <dump_folder>/loss.png with the right count).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from titan_tpu.config import ConfigError  # noqa: E402
from titan_tpu.metrics.plot import draw_bench_chart, draw_loss_chart, read_bench, read_metrics  # noqa: E402


def _run_label(path: Path) -> str:
    """The run's folder name: `outputs/llama3_debug/metrics.jsonl` and `outputs/llama3_debug` are both
    `llama3_debug`."""
    return path.name if path.is_dir() else path.resolve().parent.name


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "inputs", nargs="+", type=Path, help="metrics.jsonl files or run folders; with --bench, .jsonl files or folders"
    )
    parser.add_argument("--bench", action="store_true", help="the inputs are scripts/bench.py records")
    parser.add_argument("--out", type=Path, required=True, help="the PNG to write")
    parser.add_argument("--processes", type=int, default=None, help="the runs' process count, for items seen")
    args = parser.parse_args(argv)
    try:
        if args.processes is not None and args.processes < 1:
            raise ConfigError(f"--processes: must be >= 1, got {args.processes}")
        if args.bench:
            out = draw_bench_chart(read_bench(args.inputs), args.out)
        else:
            runs = [(_run_label(path), read_metrics(path)) for path in args.inputs]
            out = draw_loss_chart(runs, args.out, args.processes)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
