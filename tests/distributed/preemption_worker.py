"""`titan-launch --nproc-per-node 2 preemption_worker.py WORK`: the training side of
test_preemption.py, in one launch (the Llama 3 debug model, FSDP 2, float32, deterministic).

Every start of a training process appends its TORCHELASTIC_RESTART_COUNT to WORK/starts-R.txt (a
restarted attempt would add a line). Then, on one gloo group:

    resume    an uninterrupted run of 6 steps (states captured after steps 2 and 3); the same run with
              SIGTERM sent to rank 1 only, in the middle of step 3, which both ranks must end with a
              checkpoint of step 3; a trainer that resumes from it and trains steps 4-6. Rank 0 writes
              WORK/resume.pt and WORK/results.json.
    external  a long run that rank 0 marks (WORK/training) once step 2 is done; the test then sends
              SIGTERM to the launcher, which must pass it on. Each rank writes WORK/external-R.json
              with the step and signal it stopped at, and exits with the Preempted status.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.support.launch import DETERMINISTIC_DEBUG_RUN, fixed_kernels  # noqa: E402
from tests.support.parity import capture_states, full_state, train_and_capture  # noqa: E402
from titan_tpu.config import load_config  # noqa: E402
from titan_tpu.distributed import process_group  # noqa: E402
from titan_tpu.training.preemption import Preempted  # noqa: E402
from titan_tpu.training.trainer import Trainer  # noqa: E402

CONFIG = DETERMINISTIC_DEBUG_RUN[1]
ARGS = [
    *DETERMINISTIC_DEBUG_RUN[2:],
    *fixed_kernels(CONFIG),
    "--parallelism.dp_shard=2",
    "--checkpoint.enable=true",
    "--checkpoint.interval=1000",  # no save but the preemption's
    "--checkpoint.keep_latest_k=0",
]
STEPS = 6
STOP = 3  # rank 1 receives SIGTERM during this step
EXTERNAL_STEPS = 2000  # far more than the test lets it train


def rank() -> int:
    return dist.get_rank()


def trainer_for(dump: Path, steps: int) -> Trainer:
    return Trainer(load_config(CONFIG, [*ARGS, f"--training.steps={steps}", f"--job.dump_folder={dump}"]))


def during_step(trainer: Trainer, step: int, action: Any) -> None:
    """Run `action()` during step `step`, after its backward and before its optimizer step."""
    forward_backward = trainer.forward_backward

    def with_action() -> tuple[torch.Tensor, int]:
        result = forward_backward()
        if trainer.step == step - 1:
            action()
        return result

    trainer.forward_backward = with_action  # type: ignore[method-assign]


def resume(work: Path) -> dict[str, Any]:
    straight = trainer_for(work / "straight", STEPS)
    captured = capture_states(straight, (STOP - 1, STOP))
    uninterrupted = train_and_capture(straight)

    preempted = trainer_for(work / "preempted", STEPS)
    if rank() == 1:
        during_step(preempted, STOP, lambda: os.kill(os.getpid(), signal.SIGTERM))
    stop: list[Any] | None = None
    try:
        preempted.train()
    except Preempted as stopped:
        stop = [stopped.signum, stopped.step, str(stopped.checkpoint)]
    stops: list[Any] = [None, None]
    dist.all_gather_object(stops, stop)

    resumed = trainer_for(work / "preempted", STEPS)
    start = resumed.step
    loaded = full_state(resumed.model, resumed.optimizer)
    after = train_and_capture(resumed)
    if rank() == 0:
        runs = {"uninterrupted": uninterrupted.__dict__, "resumed": after.__dict__}
        torch.save({"captured": captured, "loaded": loaded, **runs}, work / "resume.pt")
    return {"stops": stops, "resumed_from": start}


def external(work: Path) -> int:
    trainer = trainer_for(work / "external", EXTERNAL_STEPS)
    if rank() == 0:
        during_step(trainer, 3, lambda: (work / "training").touch())
    try:
        trainer.train()
    except Preempted as stopped:
        (work / f"external-{rank()}.json").write_text(json.dumps({"signum": stopped.signum, "step": stopped.step}))
        return int(stopped.code)  # type: ignore[arg-type]
    return 0


def main(work: Path) -> int:
    with (work / f"starts-{os.environ['RANK']}.txt").open("a") as starts:
        starts.write(os.environ.get("TORCHELASTIC_RESTART_COUNT", "?") + "\n")
    process_group.init_process_group("gloo", process_group.process_info())
    begin = time.perf_counter()
    results = resume(work)
    results["timings_s"] = {"resume": round(time.perf_counter() - begin, 1)}
    if rank() == 0:
        (work / "results.json").write_text(json.dumps(results, indent=1))
    status = external(work)
    # Freed before the interpreter exits: tests/distributed/worker_cases.py says why.
    process_group.destroy_process_group()
    gc.collect()
    return status


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
