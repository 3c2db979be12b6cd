"""Forward + backward speed and memory of the causal attention kernels, one fresh process per case.

    .venv/bin/python scripts/bench_attention.py --seq 256 1024 2048 --dtype float32 bfloat16
    .venv/bin/python scripts/bench_attention.py --model --seq 2048 --batch 2   # a whole small Llama

Per case it prints the median wall time and process CPU time (all threads; steadier than wall time on
a shared machine) of a forward + backward, the bytes autograd keeps for backward (exact, from
saved-tensor hooks) and the process's peak resident memory above what it held before the first step.
`--model` times a Llama-style decoder (dim = heads * head_dim, SwiGLU, byte vocabulary) instead of
the bare kernel and reports tokens/s. Name the CPU flags beside any number you quote: bf16 is
emulated on CPUs without AVX512-BF16/AMX.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titan_tpu.device.tpu_runtime import skip_tpu_backend_without_chips  # noqa: E402

skip_tpu_backend_without_chips()  # before anything imports torch (titan_tpu/device/tpu_runtime.py)

import torch  # noqa: E402

from titan_tpu.device.dtype import DTYPES  # noqa: E402
from titan_tpu.device.memory import peak_rss_gib  # noqa: E402
from titan_tpu.models.common.attention_kernels import attention_kernel  # noqa: E402


def _saved_bytes(step: StepFn) -> int:
    sizes: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        sizes.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step(backward=False)
    return sum(sizes)


class StepFn:
    """One forward (+ backward) of the case being measured."""

    def __init__(self, args: argparse.Namespace) -> None:
        torch.manual_seed(0)
        dtype = DTYPES[args.dtype]
        kernel = attention_kernel(args.kernel)
        self.tokens = args.batch * args.seq
        if args.model:
            from titan_tpu.models.llama3.args import Llama3Args
            from titan_tpu.models.llama3.model import Llama3Model

            model_args = Llama3Args(
                dim=args.heads * args.head_dim,
                n_layers=args.layers,
                n_heads=args.heads,
                n_kv_heads=args.kv_heads,
                vocab_size=512,
                multiple_of=256,
                ffn_dim_multiplier=None,
                rope_scaling=None,
                max_seq_len=args.seq,
                attention=kernel,
            )
            model = Llama3Model(model_args)
            model.init_weights()
            self.model = model.to(dtype)
            self.inputs = torch.randint(0, 512, (args.batch, args.seq))
        else:
            shape = (args.batch, args.heads, args.seq, args.head_dim)
            kv_shape = (args.batch, args.kv_heads, args.seq, args.head_dim)
            self.q = torch.randn(shape, dtype=dtype, requires_grad=True)
            self.k = torch.randn(kv_shape, dtype=dtype, requires_grad=True)
            self.v = torch.randn(kv_shape, dtype=dtype, requires_grad=True)
            self.kernel = kernel

    def __call__(self, backward: bool = True) -> None:
        if hasattr(self, "model"):
            out = self.model(self.inputs).float().logsumexp(-1).mean()
        else:
            out = self.kernel(self.q, self.k, self.v).float().square().mean()
        if backward:
            out.backward()


def run_case(args: argparse.Namespace) -> dict[str, float | str | int]:
    step = StepFn(args)
    saved = _saved_bytes(step)
    baseline = peak_rss_gib()
    wall, cpu = [], []
    for _ in range(args.warmup + args.reps):
        wall_start, cpu_start = time.perf_counter(), time.process_time()
        step()
        wall.append(time.perf_counter() - wall_start)
        cpu.append(time.process_time() - cpu_start)
    median_wall, median_cpu = statistics.median(wall[args.warmup :]), statistics.median(cpu[args.warmup :])
    return {
        "kernel": args.kernel,
        "dtype": args.dtype,
        "seq": args.seq,
        "batch": args.batch,
        "wall_ms": round(median_wall * 1e3, 1),
        "cpu_ms": round(median_cpu * 1e3, 1),
        "tokens_per_s": round(step.tokens / median_wall),
        "saved_MiB": round(saved / 2**20, 1),
        "peak_rss_above_start_MiB": round((peak_rss_gib() - baseline) * 2**10, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, nargs="+", default=[256, 1024, 2048])
    parser.add_argument("--dtype", nargs="+", default=["float32"], choices=list(DTYPES))
    parser.add_argument("--kernel", nargs="+", default=["sdpa", "blocked:128"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--model", action="store_true", help="time a whole decoder, not the bare kernel")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        args.seq, args.dtype, args.kernel = args.seq[0], args.dtype[0], args.kernel[0]
        print(json.dumps(run_case(args)))
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    # Each case in its own process, so one case's peak memory does not hide the next one's.
    common = [
        f"--{name}={getattr(args, name.replace('-', '_'))}"
        for name in ("batch", "heads", "kv-heads", "head-dim", "layers", "warmup", "reps")
    ]
    for dtype in args.dtype:
        for seq in args.seq:
            for kernel in args.kernel:
                cmd = [
                    sys.executable,
                    __file__,
                    "--one",
                    f"--seq={seq}",
                    f"--dtype={dtype}",
                    f"--kernel={kernel}",
                    *common,
                    *(["--model"] if args.model else []),
                ]
                result = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
                lines = result.stdout.strip().splitlines()
                print(lines[-1] if result.returncode == 0 and lines else f"{cmd}: {result.stderr[-500:]}", flush=True)


if __name__ == "__main__":
    main()
