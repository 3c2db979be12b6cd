"""`torchrun --nproc-per-node 4 checkpoint_layouts_worker.py WORK`: the multi-process half of the
resharding tests and of the expert-parallel Hugging Face import, in one launch (starting 4 processes
costs more than the work done in them).

Takes from WORK: `fsdp4/` and `ep2_fsdp2/` (each holding the step-2 checkpoint of a one-process run),
`hf_moe/` (a `Qwen3MoeForCausalLM.save_pretrained` folder) and `tokens.pt`. Runs, one after the other on
the same 4 processes:

    fsdp4         llama3 FSDP 4 loads step 2, trains 3-4, saves 3 and 4
    tp2_fsdp2     llama3 TP 2 x FSDP 2 loads fsdp4's step 3, trains 4
    ep2_fsdp2     qwen3_moe EP 2 x FSDP 2 loads step 2, trains 3-4, saves 3 and 4
    hf_ep2_fsdp2  qwen3_moe EP 2 x FSDP 2 takes its weights from hf_moe/: logits of the tokens, every
                  safetensors read per rank, each rank's block of the experts; exports to hf_export/

Rank 0 writes WORK/result.json and WORK/hf_logits.pt.
"""

from __future__ import annotations

import gc
import json
import shutil
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_model_state_dict  # noqa: E402

from titan_tpu.checkpoint.hf import local_block  # noqa: E402
from titan_tpu.checkpoint.hf_export import export_model_to_hf  # noqa: E402
from titan_tpu.config import load_config  # noqa: E402
from titan_tpu.distributed import process_group  # noqa: E402
from titan_tpu.trainer import Trainer  # noqa: E402

LLAMA, MOE = "llama3_debug", "qwen3_moe_debug"
ARGS = [
    "--training.seq_len=32",
    "--training.global_batch_size=4",
    "--training.dtype=float32",
    "--training.steps=4",
    "--metrics.log_freq=1",
    "--data.shuffle_buffer=16",
    "--checkpoint.enable=true",
    "--checkpoint.interval=1",
    "--checkpoint.keep_latest_k=0",
]
FSDP4 = ["--parallelism.dp_shard=4"]
TP2_FSDP2 = ["--parallelism.tp=2", "--parallelism.dp_shard=2"]
EP2_FSDP2 = ["--parallelism.ep=2", "--parallelism.dp_shard=4"]
EXPERTS = "layers.0.feed_forward.experts.w1"

READS: list[tuple[str, list[int], list[int]]] = []
_process = HuggingFaceStorageReader._process_read_request


def _recording(self, f, req, planner):  # type: ignore[no-untyped-def]
    READS.append((req.storage_index.fqn, [int(n) for n in req.storage_offsets], [int(n) for n in req.lengths]))
    return _process(self, f, req, planner)


HuggingFaceStorageReader._process_read_request = _recording  # type: ignore[method-assign]


def train(config: str, dump: Path, *layout: str) -> dict[int, float]:
    trainer = Trainer(load_config(config, [*ARGS, f"--job.dump_folder={dump}", *layout]))
    return {r.step: r.loss for r in trainer.train()}


def copy_step(source: Path, step: int, dump: Path) -> None:
    if dist.get_rank() == 0:
        (dump / "checkpoint").mkdir(parents=True)
        shutil.copytree(source / "checkpoint" / f"step-{step}", dump / "checkpoint" / f"step-{step}")
    dist.barrier()


def hf_import_export(work: Path) -> tuple[dict[str, Any], torch.Tensor]:
    overrides = [
        *ARGS,
        f"--job.dump_folder={work / 'hf_run'}",
        f"--checkpoint.initial_load_path={work / 'hf_moe'}",
        "--checkpoint.enable=false",
        *EP2_FSDP2,
    ]
    READS.clear()
    trainer = Trainer(load_config(MOE, overrides))
    reads = list(READS)
    block = local_block(get_model_state_dict(trainer.model)[EXPERTS])
    assert block is not None
    local, offsets = block
    tokens = torch.load(work / "tokens.pt", weights_only=True)
    with torch.no_grad():
        logits = trainer.model(tokens).logits
    export_model_to_hf(trainer.model, work / "hf_export", trainer.spec.state_dict_adapter, trainer.model_args)
    mine = {"reads": reads, "expert_block": [list(offsets), list(local.shape)]}
    return mine, logits


def main(work: Path) -> None:
    process_group.init_process_group("gloo", process_group.process_info())
    result: dict[str, Any] = {}
    result["fsdp4"] = train(LLAMA, work / "fsdp4", *FSDP4)
    copy_step(work / "fsdp4", 3, work / "tp2_fsdp2")
    result["tp2_fsdp2"] = train(LLAMA, work / "tp2_fsdp2", *TP2_FSDP2)
    result["ep2_fsdp2"] = train(MOE, work / "ep2_fsdp2", *EP2_FSDP2)
    mine, logits = hf_import_export(work)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    result["hf_ep2_fsdp2"] = everyone
    if dist.get_rank() == 0:
        torch.save(logits, work / "hf_logits.pt")
        (work / "result.json").write_text(json.dumps(result))
    process_group.destroy_process_group()
    # Free the process groups before the interpreter exits: left to its final garbage collection, a
    # gloo thread can still be releasing a finished collective's tensor then, and aborts the process.
    gc.collect()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
