"""Memory and time of the language-model loss: the chunked cross-entropy against F.cross_entropy on
logits upcast to float32 (the loss before chunking).

    python scripts/bench_cross_entropy.py [--tokens 1024] [--vocab 128256] [--repeats 3]

For bf16 and float32 logits of [tokens, vocab] it prints, per loss: the bytes the loss keeps from
forward into backward and its peak over forward + backward (a live-tensor tally of what the loss
creates, the one the planner tests use; the logits and their gradient's accumulation into `.grad`
are what a training step has anyway, the gradient is counted), each also per token, and the median
wall time of one forward + backward. Bytes grow linearly with tokens except the chunked loss's one
float32 chunk, so the per-token figures scale to a full 8192-token sequence.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "tests"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from titan_tpu.device.tpu_runtime import skip_tpu_backend_without_chips  # noqa: E402

skip_tpu_backend_without_chips()  # before anything imports torch (titan_tpu/device/tpu_runtime.py)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from plan_measure import LiveTensorPeak  # noqa: E402

from titan_tpu.models.common.chunked_cross_entropy import chunk_tokens, chunked_cross_entropy  # noqa: E402
from titan_tpu.models.common.loss import IGNORE_INDEX  # noqa: E402


def upcast_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX)


def chunked_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return chunked_cross_entropy(logits, labels, IGNORE_INDEX)


def memory(loss_fn: Any, logits: torch.Tensor, labels: torch.Tensor) -> tuple[int, int]:
    leaf = logits.detach().requires_grad_()
    with LiveTensorPeak([leaf, labels]) as tally:
        loss = loss_fn(leaf, labels)
        kept = tally.live
        loss.backward()
    return kept, tally.peak


def seconds(loss_fn: Any, logits: torch.Tensor, labels: torch.Tensor, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):  # the first call warms up the allocator
        leaf = logits.detach().requires_grad_()
        start = time.perf_counter()
        loss_fn(leaf, labels).backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    generator = torch.Generator().manual_seed(0)
    labels = torch.randint(0, args.vocab, (args.tokens,), generator=generator)
    print(
        f"logits [{args.tokens}, {args.vocab}], {chunk_tokens(args.vocab)} tokens per chunk, "
        f"{torch.get_num_threads()} threads"
    )
    for dtype in (torch.bfloat16, torch.float32):
        logits = torch.randn(args.tokens, args.vocab, generator=generator).to(dtype)
        for name, loss_fn in (("upcast F.cross_entropy", upcast_loss), ("chunked", chunked_loss)):
            kept, peak = memory(loss_fn, logits, labels)
            took = seconds(loss_fn, logits, labels, args.repeats)
            print(
                f"{str(dtype).removeprefix('torch.'):>8} {name:<22} kept {kept / 2**20:9.1f} MiB "
                f"({kept / args.tokens:9.1f} B/token)  peak {peak / 2**20:9.1f} MiB "
                f"({peak / args.tokens:9.1f} B/token)  fwd+bwd {took * 1e3:8.1f} ms"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
