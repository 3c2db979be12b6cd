"""Worker of tests/distributed/test_doctor_processes.py: the doctor twice in one 4-process launch (dp_shard 2 x
tp 2), as it runs under torchrun: plainly, then with the all-reduce slowed by an injected delay.

argv: OUT_DIR. Writes OUT_DIR/plain.json and OUT_DIR/slowed.json (rank 0) and each run's exit status
to OUT_DIR/status.<run>.rank<r>.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from titan_tpu.doctor import collective_checks
from titan_tpu.doctor.__main__ import main

LAYOUT = ["--parallelism.tp=2"]
# Per call: 1 MiB collectives take milliseconds over gloo here, so each slowed call is tens of times
# slower than its siblings, far past the CPU's line (a tenth of the median).
DELAY_S = 0.2
SLOWED = "all_reduce"


Run = Callable[[dist.ProcessGroup], None]


def delayed(prepare: Callable[..., Run]) -> Callable[..., Run]:
    def prepare_slowly(elements: int, n: int, device: torch.device) -> Run:
        run = prepare(elements, n, device)

        def run_slowly(group: dist.ProcessGroup) -> None:
            time.sleep(DELAY_S)
            run(group)

        return run_slowly

    return prepare_slowly


def run(out: Path, name: str, checks: str) -> None:
    status = main(["--quick", "--checks", checks, "--out", str(out / f"{name}.json"), *LAYOUT])
    (out / f"status.{name}.rank{dist.get_rank()}").write_text(str(status))


if __name__ == "__main__":
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")  # the doctor joins it and leaves it up for the second run
    run(out, "plain", "matmul,collectives,training")
    collective_checks.COLLECTIVES = tuple(
        dataclasses.replace(c, prepare=delayed(c.prepare)) if c.name == SLOWED else c
        for c in collective_checks.COLLECTIVES
    )
    run(out, "slowed", "collectives")
    dist.destroy_process_group()
