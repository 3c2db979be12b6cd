"""The loop every multi-part torchrun worker runs: one gloo process group for all its parts, each part
timed, and one JSON file from rank 0 with each part's result and `timings_s` (the test prints them).

A worker runs several parts in one launch because starting 4 processes and their group costs more
than most parts do. The group is freed, and the garbage collected, before the interpreter exits: left
to its final collection, a gloo thread can still be releasing a finished collective's tensor then,
and aborts the process after every part has passed.
"""

from __future__ import annotations

import gc
import json
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from titan_tpu.distributed import process_group


def run_cases(out: Path, cases: Iterable[tuple[str, Callable[[], Any]]]) -> None:
    """Run each (name, part) on every rank in order; rank 0 writes {name: result, "timings_s":
    {name: seconds}} to `out`. A part that returns nothing is recorded as null."""
    process_group.init_process_group("gloo", process_group.process_info())
    results: dict[str, Any] = {"timings_s": {}}
    for name, part in cases:
        start = time.perf_counter()
        results[name] = part()
        results["timings_s"][name] = round(time.perf_counter() - start, 1)
    if not dist.is_initialized() or dist.get_rank() == 0:
        out.write_text(json.dumps(results, indent=1))
    process_group.destroy_process_group()
    gc.collect()
