"""How long a checkpoint save blocks training: synchronous vs async (`checkpoint.async_mode = "async"`).

    python scripts/bench_checkpoint.py [--dim 1024 --layers 8 --vocab 32000] [--repeats 3] [--folder DIR]

One process, a Llama 3 of the given shape with a real AdamW state (one step taken). For each mode it
times, over `--repeats` saves, how long the save call blocks the step that makes it (for sync: the whole
save; for async: staging a CPU copy and starting the background write), and for async also when the
write + commit is done and how long a training step takes while it runs. Prints one
line per measurement and the ratio the issue asks for: async blocked time / sync save time (<= 1/3).
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from titan_tpu.device.tpu_runtime import skip_tpu_backend_without_chips  # noqa: E402

skip_tpu_backend_without_chips()  # before anything imports torch (titan_tpu/device/tpu_runtime.py)

import torch  # noqa: E402

from titan_tpu.checkpoint import CheckpointManager  # noqa: E402
from titan_tpu.config.sections import CheckpointConfig, LRSchedulerConfig, OptimizerConfig  # noqa: E402
from titan_tpu.models.common.loss import cross_entropy_loss  # noqa: E402
from titan_tpu.models.llama3.args import LLAMA3_FLAVORS  # noqa: E402
from titan_tpu.models.llama3.model import Llama3Model  # noqa: E402
from titan_tpu.optim import build_lr_scheduler, build_optimizer  # noqa: E402


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--folder", type=Path, default=None, help="where to write (default: a temp dir)")
    opts = parser.parse_args(argv)

    args = dataclasses.replace(
        LLAMA3_FLAVORS["debug"],
        dim=opts.dim,
        n_layers=opts.layers,
        n_heads=max(1, opts.dim // 64),
        n_kv_heads=max(1, opts.dim // 128),
        vocab_size=opts.vocab,
        max_seq_len=opts.seq_len,
    )
    with torch.device("meta"):
        model = Llama3Model(args)
    model.to_empty(device="cpu")
    model.init_weights()
    optimizer = build_optimizer(model, OptimizerConfig())
    scheduler = build_lr_scheduler(optimizer, LRSchedulerConfig(), 1000)
    tokens = torch.randint(0, args.vocab_size, (opts.batch, opts.seq_len + 1))

    def train_step() -> None:
        loss = cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()

    train_step()  # AdamW state exists from here on
    params = sum(p.numel() for p in model.parameters())
    state_gb = params * 4 * 3 / 1e9  # weights + two AdamW moments, fp32
    print(f"model: {params / 1e6:.1f}M parameters; saved state ~{state_gb:.2f} GB (weights + AdamW moments)")
    plain = []
    for _ in range(opts.repeats):
        start = time.perf_counter()
        train_step()
        plain.append(time.perf_counter() - start)
    step_s = statistics.median(plain)
    print(f"training step alone: {step_s:.3f} s (median of {opts.repeats})")

    folder = opts.folder or Path(tempfile.mkdtemp(prefix="bench_checkpoint_"))
    results: dict[str, float] = {}
    try:
        for mode in ("disabled", "async"):
            cfg = CheckpointConfig(enable=True, interval=1, keep_latest_k=1, async_mode=mode)
            manager = CheckpointManager(cfg, folder / mode, model=model, optimizer=optimizer, lr_scheduler=scheduler)
            blocked, background, steps_during = [], [], []
            for step in range(1, opts.repeats + 1):
                train_step()
                # What the loop's maybe_save() costs the step that starts the save.
                start = time.perf_counter()
                manager.save(step)
                blocked.append(time.perf_counter() - start)
                if mode == "async":
                    # Training goes on while the save is written; then wait for the commit.
                    during = time.perf_counter()
                    train_step()
                    steps_during.append(time.perf_counter() - during)
                    manager.wait()
                    background.append(time.perf_counter() - start)
            manager.close()
            results[mode] = statistics.median(blocked)
            name = "sync " if mode == "disabled" else "async"
            line = f"{name} save: the step that starts it is blocked {results[mode]:.3f} s"
            if mode == "async":
                line += (
                    f"; written + committed {statistics.median(background):.3f} s after the save started; "
                    f"a step during the background write took {statistics.median(steps_during):.3f} s"
                )
            print(line + f" (median of {opts.repeats})")
    finally:
        if opts.folder is None:
            shutil.rmtree(folder, ignore_errors=True)
    ratio = results["async"] / results["disabled"]
    verdict = "ok" if ratio <= 1 / 3 else "ABOVE the 1/3 target"
    print(f"async blocked / sync save = {ratio:.3f} ({verdict}; target <= 0.333)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
