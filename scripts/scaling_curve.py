"""Scaling on paper, from the measured traffic: each model's shipped config dry-run (titan_tpu/dryrun)
at growing TPU v7x world sizes, its recorded collectives priced on the planner's link model
(scripts/scaling_traffic.py) and put beside the planner's compute time under the planner's overlap
rule (`StepEstimate.step_s`); printed as a markdown table, drawn as per-chip throughput relative to
the smallest size.

    .venv/bin/python scripts/scaling_curve.py                    # everything: 3 models x 5 sizes
    .venv/bin/python scripts/scaling_curve.py --sizes 64,256 --models llama3_70b --out /tmp/curve.png

Sizes are devices (simulated ranks); a v7x chip runs two, so 8192 devices are `v7x-4096`. Each config
runs as shipped, except that where its global batch does not split over the data-parallel ranks it
is raised to the next multiple that does (the table says where). Only rank 0 is dry-run.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from titan_tpu.device.tpu_runtime import skip_tpu_backend_without_chips  # noqa: E402

skip_tpu_backend_without_chips()  # before anything imports torch (titan_tpu/device/tpu_runtime.py)

from scripts.scaling_traffic import step_seconds  # noqa: E402
from titan_tpu.config import ConfigError, load_config  # noqa: E402
from titan_tpu.distributed.parallel_dims import ParallelDims  # noqa: E402
from titan_tpu.dryrun.run import LayoutRejected, dry_run_rank  # noqa: E402
from titan_tpu.plan.chips import Cluster, parse_chips  # noqa: E402
from titan_tpu.plan.planner import Plan, make_plan  # noqa: E402
from titan_tpu.plan.roofline import StepEstimate  # noqa: E402
from titan_tpu.training.registered_names import check_registered_names  # noqa: E402

MODELS = ("llama3_70b", "llama3_405b", "qwen3_moe_235b_a22b")
SIZES = (64, 256, 1024, 4096, 8192)
CHIP = "v7x"  # one family for the whole curve: a slice holds up to 9,216 chips, so every size is one slice
OUT = ROOT / "docs" / "scaling_dryrun.png"


@dataclass(frozen=True)
class Point:
    model: str
    plan: Plan
    batch_raised: bool  # the shipped global batch did not split over this size's data-parallel ranks
    measured: StepEstimate  # the planner's, with the communication of the dry run's traffic
    dry_run_s: float

    @property
    def chips(self) -> int:
        return self.plan.cluster.chips

    @property
    def tokens_per_chip_s(self) -> float:
        config = self.plan.config
        tokens = config.training.global_batch_size * self.plan.detail.workload.items_per_sample
        return tokens / self.measured.step_s / self.chips


def cluster_of(devices: int) -> Cluster:
    per_chip = parse_chips(f"{CHIP}-1").devices
    cluster = parse_chips(f"{CHIP}-{devices // per_chip}")
    if cluster.devices != devices:
        raise ConfigError(f"{devices} devices are not whole {CHIP} chips of {per_chip} devices each")
    return cluster


def batch_overrides(model: str, devices: int) -> list[str]:
    """The global batch raised to the next multiple of a step's samples over the data-parallel
    ranks where the shipped one does not split; nothing where it does."""
    shipped = load_config(model, [])
    training = shipped.training
    dp = ParallelDims.from_config(shipped.parallelism, devices).dp
    per_step = dp * max(training.local_batch_size, 1)  # local -1: one sample per rank at least
    if training.global_batch_size % per_step == 0:
        return []
    raised = -(-training.global_batch_size // per_step) * per_step
    return [f"--training.global_batch_size={raised}"]


def measure(model: str, devices: int) -> Point:
    cluster = cluster_of(devices)
    overrides = batch_overrides(model, devices)
    config = load_config(model, overrides)
    check_registered_names(config)
    plan = make_plan(config, cluster)
    start = time.perf_counter()
    report = dry_run_rank(config, model, devices, 0)
    took = time.perf_counter() - start
    measured = dataclasses.replace(plan.step, **step_seconds(report.collectives, plan.shape, cluster))
    print(f"{model} at {devices} devices ({cluster.name}): dry run {took:.1f} s", file=sys.stderr, flush=True)
    return Point(model, plan, bool(overrides), measured, took)


def efficiencies(points: list[Point]) -> dict[tuple[str, int], float]:
    """Per-chip throughput at each size over that at the model's smallest size, in %."""
    base: dict[str, float] = {}
    for point in sorted(points, key=lambda p: p.chips):
        base.setdefault(point.model, point.tokens_per_chip_s)
    return {(p.model, p.chips): 100 * p.tokens_per_chip_s / base[p.model] for p in points}


def bound_by(step: StepEstimate) -> str:
    """Which of the overlapped terms of `StepEstimate.step_s` the step waits for."""
    overlapped = {
        "compute": step.compute_s * step.bubble,
        "FSDP": step.fsdp_s,
        "HSDP": step.hsdp_s,
        "host link": step.host_link_s,
    }
    return max(overlapped, key=lambda name: overlapped[name])


def table(points: list[Point]) -> str:
    relative = efficiencies(points)
    lines = [
        "| model | devices | chips | layout | global batch | micro-batches | dry run | compute | host link | FSDP | TP "
        "| EP | CP | host | bound by | step (measured traffic) | step (planner) | difference | MFU | tokens/s per chip "
        "| scaling efficiency |",
        "|" + " --- |" * 21,
    ]
    for p in points:
        m, plan = p.measured, p.plan
        batch = f"{plan.config.training.global_batch_size}{' (raised)' if p.batch_raised else ''}"
        cells = [
            f"`{p.model}`",
            str(plan.cluster.devices),
            plan.cluster.name,
            plan.detail.layout.dims.describe(),
            batch,
            str(plan.shape.grad_accum),
            f"{p.dry_run_s:.0f} s",
            *(
                f"{s:.2f} s"
                for s in (m.compute_s * m.bubble, m.host_link_s, m.fsdp_s, m.tp_s, m.ep_s, m.cp_s, m.host_s)
            ),
            bound_by(m),
            f"{m.step_s:.2f} s",
            f"{plan.step.step_s:.2f} s",
            f"{100 * (m.step_s / plan.step.step_s - 1):+.3f}%",
            f"{100 * m.mfu:.1f}%",
            f"{p.tokens_per_chip_s:,.0f}",
            f"{relative[p.model, p.chips]:.1f}%",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


NOTES = (
    "Communication from the dry run of rank 0 (one micro-batch, repeated for the step's micro-batches), "
    "priced on the planner's link model; compute, host link and host (FSDP CPU offload's copies and host "
    "optimizer step) and the overlap rule are the planner's: step = max(compute, FSDP, HSDP, host link) + TP "
    "+ EP + CP + P2P + host; 'bound by' names the largest of the overlapped terms, 'difference' is the "
    "step from measured traffic against the planner's own.",
    "The optimizer step's collectives (gradient-norm all-reduces, a few scalars) are counted once per "
    "micro-batch with the rest.",
    "(raised): the shipped global batch does not split over that many data-parallel ranks; raised to the "
    "next multiple that does, so the tokens per step grow with the chips from there.",
    "Scaling efficiency: tokens/s per chip over that of the model's smallest size here.",
)


def draw(points: list[Point], out: Path) -> Path:
    # The object API and the Agg canvas: no display, no pyplot state (as titan_tpu/metrics/plot.py).
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    relative = efficiencies(points)
    figure = Figure(figsize=(7, 4.5), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots()
    chips = sorted({p.chips for p in points})
    for model in dict.fromkeys(p.model for p in points):
        mine = sorted((p for p in points if p.model == model), key=lambda p: p.chips)
        axes.plot([p.chips for p in mine], [relative[model, p.chips] for p in mine], marker="o", label=model)
    axes.axhline(100, color="gray", linestyle="--", label="linear")
    axes.set_xscale("log", base=2)
    axes.set_xticks(chips, [str(c) for c in chips])
    axes.set_xlabel(f"TPU {CHIP} chips (2 devices each)")
    axes.set_ylabel(f"tokens/s per chip, % of {chips[0]} chips")
    axes.set_title("Scaling on paper: dry-run traffic on the planner's link model")
    axes.set_ylim(0, max(110, *relative.values()) + 5)  # the linear line clear of the top edge
    axes.grid(alpha=0.3)
    axes.legend()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=100)
    return out


def _names(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="devices, comma-separated")
    parser.add_argument("--models", default=",".join(MODELS), help="config names, comma-separated")
    parser.add_argument("--out", type=Path, default=OUT, help=f"the PNG to write (default {OUT.relative_to(ROOT)})")
    args = parser.parse_args(argv)
    try:
        sizes = [int(size) for size in _names(args.sizes)]
        points = [measure(model, size) for model in _names(args.models) for size in sizes]
    except (ConfigError, LayoutRejected, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(table(points))
    print()
    print("\n".join(f"- {note}" for note in NOTES))
    print(f"\nwrote {draw(points, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
