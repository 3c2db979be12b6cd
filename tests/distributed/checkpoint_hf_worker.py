"""`torchrun --nproc-per-node 2 checkpoint_hf_worker.py HF_FOLDER TOKENS OUT`: a Trainer under FSDP 2
takes its initial weights from a Hugging Face folder, computes logits for TOKENS, and exports itself
to OUT/export. Every read of the safetensors files is recorded (tensor, slice shape) per rank.
Rank 0 writes OUT/result.json and OUT/logits.pt."""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader  # noqa: E402

from titan_tpu.checkpoint.hf_export import export_model_to_hf  # noqa: E402
from titan_tpu.config import load_config  # noqa: E402
from titan_tpu.training.trainer import Trainer  # noqa: E402

READS: list[tuple[str, list[int]]] = []
_process = HuggingFaceStorageReader._process_read_request


def _recording(self, f, req, planner):  # type: ignore[no-untyped-def]
    READS.append((req.storage_index.fqn, [int(n) for n in req.lengths]))
    return _process(self, f, req, planner)


HuggingFaceStorageReader._process_read_request = _recording  # type: ignore[method-assign]


def main() -> None:
    hf_folder, tokens_path, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    config = load_config(
        "llama3_debug",
        [
            f"--job.dump_folder={out / 'run'}",
            f"--checkpoint.initial_load_path={hf_folder}",
            "--training.seq_len=64",
            "--training.dtype=float32",
            "--training.global_batch_size=2",
            "--parallelism.dp_shard=2",
        ],
    )
    trainer = Trainer(config)
    tokens = torch.load(tokens_path, weights_only=True)
    with torch.no_grad():
        logits = trainer.model(tokens)
    adapter, args = trainer.spec.state_dict_adapter, trainer.spec.flavor("debug")
    export_model_to_hf(trainer.model, out / "export", adapter, args)
    reads: list = [None] * dist.get_world_size()
    dist.all_gather_object(reads, READS)
    if dist.get_rank() == 0:
        torch.save(logits.detach().cpu(), out / "logits.pt")
        (out / "result.json").write_text(json.dumps({"reads": reads}))
    trainer.close()
    # Free the process groups now: left to the garbage collection at interpreter exit, a gloo thread
    # can still be releasing a finished all-gather's tensor then, and aborts the process.
    del trainer
    gc.collect()


if __name__ == "__main__":
    main()
