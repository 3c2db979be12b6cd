"""One intra-op thread for a test that trains in its own process, and the process left as found.

On a busy 2-core machine OpenMP threads spin against each other (a 20-step debug run takes a minute
instead of a second); torchrun workers get one thread too (tests/support/launch.py), so in-process
runs compared with theirs do the same arithmetic. The Trainer turns deterministic algorithms on for
the whole process, which would slow or change every later test in it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def one_intra_op_thread() -> Iterator[None]:
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
