"""Worker for the sharded LoRA export test: `torchrun --nproc-per-node 2 lora_export_worker.py BASE OUT`.

For each layout (FSDP 2, TP 2) a real `Trainer` trains LoRA adapters (rank 4, alpha 8) on the Qwen 3
debug flavor read from the Hugging Face folder BASE for 2 fp32 steps; then every rank calls the PEFT
and the merged export of the sharded model (rank 0 writes OUT's <layout>/peft and <layout>/merged),
and rank 0 saves the whole state gathered by torch's own full-state-dict path (<layout>/state.pt),
from which the test exports again in one process, and the sharded model's logits of the tokens
beside BASE (<layout>/logits.pt), which transformers with the exported adapters must reproduce.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from tests.distributed.worker_cases import run_cases  # noqa: E402
from tests.support.launch import fixed_kernels  # noqa: E402
from titan_tpu.config import load_config  # noqa: E402

RUN = [
    *fixed_kernels("qwen3_debug"),
    "--lora.enable=true",
    "--lora.rank=4",
    "--lora.alpha=8",
    "--training.steps=2",
    "--training.seq_len=32",
    "--training.global_batch_size=2",
    "--training.dtype=float32",
    "--optimizer.lr=0.01",
    "--lr_scheduler.warmup_steps=0",
]
LAYOUTS = {"fsdp2": ["--parallelism.dp_shard=2"], "tp2": ["--parallelism.tp=2", "--parallelism.dp_shard=1"]}


def run_layout(name: str, overrides: list[str], base: Path, out: Path) -> dict:
    from titan_tpu.lora.merge import export_merged_to_hf
    from titan_tpu.lora.peft_export import export_peft_adapter
    from titan_tpu.training.trainer import Trainer

    folder = out / name
    options = [*RUN, *overrides, f"--job.dump_folder={folder / 'run'}", f"--checkpoint.initial_load_path={base}"]
    # No trainer.close(): it destroys the process group the launch's next case runs in.
    trainer = Trainer(load_config("qwen3_debug", options))
    trainer.train()
    model, adapter, args = trainer.model, trainer.spec.state_dict_adapter, trainer.model_args
    export_peft_adapter(model, folder / "peft", adapter, args, base_model=str(base))
    export_merged_to_hf(model, folder / "merged", adapter, args)
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    model.eval()
    with torch.no_grad():
        logits = model(torch.load(base.parent / "tokens.pt", weights_only=True))
    if isinstance(logits, DTensor):  # a vocabulary-parallel head's
        logits = logits.full_tensor()
    if dist.get_rank() == 0:
        torch.save(state, folder / "state.pt")
        torch.save(logits, folder / "logits.pt")
    return {}


def main(base: Path, out: Path) -> None:
    run_cases(
        out / "results.json",
        [(name, functools.partial(run_layout, name, overrides, base, out)) for name, overrides in LAYOUTS.items()],
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
