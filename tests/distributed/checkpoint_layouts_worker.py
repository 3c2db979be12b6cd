"""`torchrun --nproc-per-node 4 checkpoint_layouts_worker.py WORK`: the multi-process half of the
resharding, async-checkpoint and Hugging Face tests, in one launch (starting 4 processes costs more
than the work done in them).

Takes from WORK: `{llama,moe}_single/` (each holding the step-2 checkpoint of an uninterrupted
one-process run), `hf_llama/` and `hf_moe/` (`save_pretrained` folders) and `tokens_{llama,moe}.pt`.
Runs, one after the other on the same 4 processes:

    fsdp4         llama3 FSDP 4 loads step 2, trains 3-5, saves 5
    tp2_fsdp2     llama3 TP 2 x FSDP 2 loads fsdp4's step 5, trains 6-8, saves 8
    ep2_fsdp2     qwen3_moe EP 2 x FSDP 2 loads step 2, trains 3-5, saves 5
    tp2_ep2       qwen3_moe TP 2 x EP 2 loads ep2_fsdp2's step 5, trains 6-8, saves 8
    async_fsdp4   llama3 FSDP 4 from scratch, steps 1-4, saving 2 and 4 asynchronously; then loads
                  each of them into a fresh trainer
    hf_tp2_fsdp2  llama3 TP 2 x FSDP 2 takes its weights from hf_llama/: logits, reads per rank, export
    hf_ep2_fsdp2  qwen3_moe EP 2 x FSDP 2 the same from hf_moe/, with each rank's block of the experts

Each resumed segment keeps the state it loaded (gathered, before any step) and its run
(parity.RunResult). Rank 0 writes WORK/<name>.pt, WORK/result.json and WORK/hf_logits_<name>.pt.
"""

from __future__ import annotations

import functools
import shutil
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_model_state_dict  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from tests.distributed.worker_cases import run_cases  # noqa: E402
from tests.support.launch import fixed_kernels  # noqa: E402
from tests.support.parity import capture_states, full_state, train_and_capture  # noqa: E402
from titan_tpu.checkpoint.hf_export import export_model_to_hf  # noqa: E402
from titan_tpu.checkpoint.hf_import import local_block  # noqa: E402
from titan_tpu.config import load_config  # noqa: E402
from titan_tpu.training.trainer import Trainer  # noqa: E402

LLAMA, MOE = "llama3_debug", "qwen3_moe_debug"
# A constant learning rate after 2 warmup steps: a run told to stop at step 5 then takes exactly
# the first 5 steps of one told to stop at 11, so every segment has an uninterrupted twin.
ARGS = [
    "--training.seq_len=32",
    "--training.global_batch_size=4",
    "--training.dtype=float32",
    "--metrics.log_freq=1",
    "--data.shuffle_buffer=16",
    "--lr_scheduler.warmup_steps=2",
    "--lr_scheduler.decay_type=constant",
    "--checkpoint.enable=true",
    "--checkpoint.interval=1000",  # only the last step of a segment
    "--checkpoint.keep_latest_k=0",
]
LINKS = (2, 5, 8)  # a checkpoint at each is loaded by the next layout
STEPS = 11
FSDP4 = ["--parallelism.dp_shard=4"]
TP2_FSDP2 = ["--parallelism.tp=2", "--parallelism.dp_shard=2"]
EP2_FSDP2 = ["--parallelism.ep=2", "--parallelism.dp_shard=4"]
TP2_EP2 = ["--parallelism.tp=2", "--parallelism.dp_shard=2", "--parallelism.ep=2"]
# (config, [(segment, layout), (segment, layout)]): the 4-process links of each chain, in order;
# the first loads the one-process run's step-2 checkpoint from WORK/<chain>_single.
CHAINS = {
    "llama": (LLAMA, [("fsdp4", FSDP4), ("tp2_fsdp2", TP2_FSDP2)]),
    "moe": (MOE, [("ep2_fsdp2", EP2_FSDP2), ("tp2_ep2", TP2_EP2)]),
}
ASYNC_STEPS = (2, 4)
HF_RUNS = {"hf_tp2_fsdp2": (LLAMA, "llama", TP2_FSDP2), "hf_ep2_fsdp2": (MOE, "moe", EP2_FSDP2)}
EXPERTS = "layers.0.feed_forward.experts.w1"

READS: list[tuple[str, list[int], list[int]]] = []
_process = HuggingFaceStorageReader._process_read_request


def _recording(self, f, req, planner):  # type: ignore[no-untyped-def]
    READS.append((req.storage_index.fqn, [int(n) for n in req.storage_offsets], [int(n) for n in req.lengths]))
    return _process(self, f, req, planner)


HuggingFaceStorageReader._process_read_request = _recording  # type: ignore[method-assign]


def is_writer() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def trainer_for(config: str, dump: Path, stop: int, *extra: str) -> Trainer:
    return Trainer(
        load_config(
            config,
            [
                *ARGS,
                *fixed_kernels(config),
                f"--training.steps={stop}",
                f"--job.dump_folder={dump}",
                *extra,
            ],
        )
    )


def resume(config: str, source: Path, step: int, stop: int, dump: Path, *layout: str) -> tuple[Trainer, dict]:
    """A trainer on `layout` that loads `source`'s step-`step` checkpoint, and its loaded state
    gathered to full tensors before any step."""
    if is_writer():
        (dump / "checkpoint").mkdir(parents=True)
        shutil.copytree(source / "checkpoint" / f"step-{step}", dump / "checkpoint" / f"step-{step}")
    if dist.is_initialized():
        dist.barrier()
    trainer = trainer_for(config, dump, stop, *layout)
    assert trainer.step == step, (trainer.step, step)
    return trainer, full_state(trainer.model, trainer.optimizer)


def chain(work: Path, tag: str) -> None:
    config, links = CHAINS[tag]
    source = work / f"{tag}_single"
    for (name, layout), step, stop in zip(links, LINKS, LINKS[1:]):
        trainer, loaded = resume(config, source, step, stop, work / name, *layout)
        run = train_and_capture(trainer)
        if is_writer():
            torch.save({"loaded": loaded, "run": run.__dict__}, work / f"{name}.pt")
        source = work / name


def async_checkpoints(work: Path) -> None:
    """Saves of steps 2 and 4 written in the background by 4 processes while training goes on, each
    then loaded into a fresh trainer: the loaded state must be the state at the step saved."""
    dump = work / "async_fsdp4"
    trainer = trainer_for(
        LLAMA, dump, ASYNC_STEPS[-1], *FSDP4, "--checkpoint.async_mode=async", f"--checkpoint.interval={ASYNC_STEPS[0]}"
    )
    captured = capture_states(trainer, ASYNC_STEPS)
    run = train_and_capture(trainer)
    loaded = {}
    for step in ASYNC_STEPS:
        fresh = trainer_for(LLAMA, dump, ASYNC_STEPS[-1], *FSDP4, f"--checkpoint.load_step={step}")
        assert fresh.step == step, (fresh.step, step)
        loaded[step] = full_state(fresh.model, fresh.optimizer)
    if is_writer():
        torch.save({"captured": captured, "loaded": loaded, "run": run.__dict__}, work / "async_fsdp4.pt")


def hf_import_export(work: Path, name: str) -> dict[str, Any]:
    config, tag, layout = HF_RUNS[name]
    READS.clear()
    trainer = Trainer(
        load_config(
            config,
            [
                *ARGS,
                *fixed_kernels(config),
                "--training.steps=1",
                "--checkpoint.enable=false",
                f"--job.dump_folder={work / name}",
                f"--checkpoint.initial_load_path={work / f'hf_{tag}'}",
                *layout,
            ],
        )
    )
    mine: dict[str, Any] = {"reads": list(READS)}
    if tag == "moe":
        block = local_block(get_model_state_dict(trainer.model)[EXPERTS])
        assert block is not None
        local, offsets = block
        mine["expert_block"] = [list(offsets), list(local.shape)]
    tokens = torch.load(work / f"tokens_{tag}.pt", weights_only=True)
    with torch.no_grad():
        output = trainer.model(tokens)
    logits = output.logits if hasattr(output, "logits") else output
    logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
    export_model_to_hf(trainer.model, work / f"{name}_export", trainer.spec.state_dict_adapter, trainer.model_args)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if is_writer():
        torch.save(logits.detach(), work / f"hf_logits_{name}.pt")
    return {"ranks": everyone}


def main(work: Path) -> None:
    run_cases(
        work / "result.json",
        [
            *((f"{tag}_chain", functools.partial(chain, work, tag)) for tag in CHAINS),
            ("async_fsdp4", functools.partial(async_checkpoints, work)),
            *((name, functools.partial(hf_import_export, work, name)) for name in HF_RUNS),
        ],
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
