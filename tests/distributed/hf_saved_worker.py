"""Worker for test_hf_saved_folders.py: `torchrun --nproc-per-node 2 hf_saved_worker.py OUT`. For each
case (a published MoE family and a layout) a real `Trainer` starts from the folder transformers saved
for that family (OUT's folder/folders/<model_type>, tests/support/hf_saved.py) through
`checkpoint.initial_load_path`, and trains `layout_run`'s fp32 steps (8 here); rank 0 saves the run
as OUT's folder/<case>.pt, and every case records how far the loaded weights (gathered) are from
the tensors transformers' `from_pretrained` holds. `reference(dump, case)` is the single-process run.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.distributed.parallel_worker import layout_run  # noqa: E402
from tests.distributed.worker_cases import run_cases  # noqa: E402
from tests.support.parity import RunResult, train_and_capture  # noqa: E402
from titan_tpu.checkpoint import hf_import  # noqa: E402
from titan_tpu.config import load_config  # noqa: E402

STEPS = 8
MODEL_TYPES = ("mixtral", "olmoe", "qwen3_moe", "qwen2_moe")
LAYOUTS = {"fsdp2": ["--parallelism.dp_shard=2"], "ep2": ["--parallelism.ep=2", "--parallelism.dp_shard=2"]}
CASES: dict[str, tuple[str, list[str]]] = {
    f"{model_type}_{layout}": (model_type, arguments)
    for model_type in MODEL_TYPES
    for layout, arguments in LAYOUTS.items()
}
# The negative control: Mixtral under ep 2 with each rank reading its shard's blocks as if the shard
# began at the first expert (both ranks load experts 0..1), which the load check must tell apart.
BROKEN = {"mixtral_ep2_blocks_from_zero": "mixtral_ep2"}


def folder(dump: Path, model_type: str) -> Path:
    return dump / "folders" / model_type


def run_arguments(case: str, dump: Path) -> list[str]:
    model_type, _ = CASES[case]
    return [
        *layout_run("hf", global_batch_size=4),
        f"--training.steps={STEPS}",
        "--model.name=hf",
        "--model.flavor=config",
        f"--hf.config={folder(dump, model_type)}",
        f"--checkpoint.initial_load_path={folder(dump, model_type)}",
        f"--job.dump_folder={dump / case}",
    ]


@contextlib.contextmanager
def blocks_from_zero() -> Iterator[None]:
    real = hf_import.local_block

    def from_zero(value: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]] | None:
        block = real(value)
        return None if block is None else (block[0], (0,) * block[0].dim())

    with mock.patch.object(hf_import, "local_block", from_zero):
        yield


def loaded_diff(model: torch.nn.Module, saved: Path) -> float:
    """The largest difference between the loaded weights and transformers' own load of `saved`."""
    from transformers import AutoModelForCausalLM

    theirs = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).state_dict()
    worst = 0.0
    for name, value in model.state_dict().items():
        full = value.full_tensor() if isinstance(value, DTensor) else value
        expected = theirs[name.split("hf.", 1)[1].replace("._checkpoint_wrapped_module", "")]
        worst = max(worst, (full.detach().float() - expected).abs().max().item())
    return worst


def run_case(case: str, dump: Path, broken: str | None = None) -> dict[str, Any]:
    from titan_tpu.training.trainer import Trainer

    arguments = [*run_arguments(case, dump), *CASES[case][1]]
    if broken is not None:
        arguments.append(f"--job.dump_folder={dump / broken}")
    with blocks_from_zero() if broken is not None else contextlib.nullcontext():
        trainer = Trainer(load_config("llama3_debug", arguments))
    diff = loaded_diff(trainer.model, folder(dump, CASES[case][0]))
    run = train_and_capture(trainer)
    if dist.get_rank() == 0:
        run.save(dump / f"{broken or case}.pt")
    # No trainer.close(): it destroys the process group the launch's next case runs in.
    return {"loaded_max_abs_diff": diff}


def reference(dump: Path, case: str) -> RunResult:
    from titan_tpu.training.trainer import Trainer

    arguments = [*run_arguments(case, dump), f"--job.dump_folder={dump / 'single' / case}"]
    trainer = Trainer(load_config("llama3_debug", arguments))
    run = train_and_capture(trainer)
    trainer.close()
    return run


def main(out: Path) -> None:
    cases = [(case, functools.partial(run_case, case, out.parent)) for case in CASES]
    cases += [(name, functools.partial(run_case, case, out.parent, name)) for name, case in BROKEN.items()]
    run_cases(out, cases)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
