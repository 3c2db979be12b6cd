"""Steps 6 and 7 of the hf family's sweep (scripts/hf_sweep.py): each architecture parallelised by the
run's own path on 2 processes (FSDP 2, or TP 2 by transformers' own plan for the model) against
transformers' own model's loss and gradients. The sweep launches this file with torchrun, a dozen
architectures per launch:

    torchrun --standalone --nproc-per-node=2 scripts/hf_sweep_layouts.py LAYOUT LIST.json OUT.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from scripts.hf_sweep import SEQ, batch, first_line  # noqa: E402  (it sets up the TPU runtime first)

# The 2-process layouts: step name -> (parallelism arguments, ParallelDims' degrees).
LAYOUTS: dict[str, tuple[list[str], tuple[int, int, int, int, int]]] = {
    "fsdp2": (["--parallelism.dp_shard=2"], (1, 2, 1, 1, 2)),
    "tp2": (["--parallelism.dp_shard=1", "--parallelism.tp=2"], (1, 1, 2, 1, 2)),
}
NO_TP_PLAN = "n/a: no TP plan for its layers in transformers"


def layout_worker(layout: str, listing: Path, out: Path) -> None:
    """Step 5 or 6 on every rank of a 2-process launch: each architecture through parallelize_model
    in `layout` (the family's own parallelize, as a run calls it), against transformers' own model
    (each rank builds it whole); rank 0 writes the verdicts."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from scripts import hf_parity as parity
    from titan_tpu.config import load_config
    from titan_tpu.distributed import process_group
    from titan_tpu.distributed.parallel_dims import ParallelContext, ParallelDims
    from titan_tpu.distributed.parallelize import parallelize_model
    from titan_tpu.models.hf.args import hf_args
    from titan_tpu.models.hf.model import HFCausalLM
    from titan_tpu.models.hf.parallelize import tp_plan_for
    from titan_tpu.models.hf.spec import HF_SPEC

    process_group.init_process_group("gloo", process_group.process_info())
    layout_arguments, degrees = LAYOUTS[layout]
    dims = ParallelDims(*degrees)
    ctx = ParallelContext(dims, dims.build_meshes("cpu"), sequence_parallel=False)
    verdicts: dict[str, str] = {}
    for architecture in json.loads(listing.read_text()):
        if dist.get_rank() == 0:
            print(f"{layout}: {architecture}", flush=True)
        try:
            config = load_config(
                "llama3_debug",
                [
                    "--model.name=hf",
                    f"--hf.architecture={architecture}",
                    "--model.flavor=debug",
                    f"--training.seq_len={SEQ}",
                    "--training.dtype=float32",
                    *layout_arguments,
                ],
            )
            args = hf_args(config)
            reference = parity.built_like_a_run(args, SEQ)
            tokens = batch(args.vocab_size)
            twin = parity.transformers_twin(reference).eval()  # no dropout: see parity.against_transformers
            theirs = parity.loss_and_grads(twin, lambda ids, twin=twin: twin(input_ids=ids).logits, tokens)
            with torch.device("meta"):
                model = HFCausalLM(reference.args)
            if dims.tp_enabled and not has_tp_plan(model, tp_plan_for):
                verdicts[architecture] = NO_TP_PLAN
                continue
            model = parallelize_model(
                model, HF_SPEC.parallelize, ctx, config, torch.device("cpu"), torch.float32
            ).eval()
            loss, grads = parity.loss_and_grads(model, model, tokens)
            full = {name: g.full_tensor() if isinstance(g, DTensor) else g for name, g in grads.items()}
            result = parity.parity((loss, full), theirs)
            verdicts[architecture] = (
                "ok"
                if result.within()
                else (f"loss {result.loss_rel:.1e}, {result.worst_grad} {result.worst_grad_rel:.1e}")
            )
        except Exception as error:  # noqa: BLE001 - both ranks fail alike (same code, same inputs)
            verdicts[architecture] = first_line(error)
        finally:
            dist.barrier()
    if dist.get_rank() == 0:
        out.write_text(json.dumps(verdicts))
    process_group.destroy_process_group()


def has_tp_plan(model: Any, tp_plan_for: Callable[[Any, int], Any]) -> bool:
    """Whether transformers' plan splits the model's decoder layers (other refusals of the plan are
    failures of the step, not reasons it does not apply)."""
    from titan_tpu.config import ConfigError

    try:
        tp_plan_for(model, 2)
    except ConfigError as error:
        return "has no tensor-parallel plan" not in str(error)
    return True


# Architectures per 2-process launch: a launch that dies (a rank killed for memory, a crash in
# native code) loses only its own, which are then run one launch each to find which one it was.
LAUNCH_CHUNK = 12
# Larger debug-size models (a multimodal model's vision and audio towers) are not run on 2 ranks.
LAYOUT_MAX_PARAMS = 100_000_000


def run_layout(layout: str, architectures: list[str], timeout: int) -> dict[str, str]:
    verdicts: dict[str, str] = {}
    for start in range(0, len(architectures), LAUNCH_CHUNK):
        chunk = architectures[start : start + LAUNCH_CHUNK]
        found = launch_layout(layout, chunk, timeout)
        if found is None and len(chunk) > 1:
            found = {}
            for architecture in chunk:
                found.update(
                    launch_layout(layout, [architecture], timeout) or {architecture: "the 2-process launch failed"}
                )
        verdicts.update(found or {a: "the 2-process launch failed" for a in chunk})
    return verdicts


def launch_layout(layout: str, architectures: list[str], timeout: int) -> dict[str, str] | None:
    """One launch of `layout_worker` over `architectures`: its verdicts, or None when it died."""
    with tempfile.TemporaryDirectory() as folder:
        listing, out = Path(folder) / "list.json", Path(folder) / "verdicts.json"
        listing.write_text(json.dumps(architectures))
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            str(Path(__file__).resolve()),
            layout,
            str(listing),
            str(out),
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        try:
            done = subprocess.run(
                command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout * len(architectures)
            )
        except subprocess.TimeoutExpired:
            return None
        if done.returncode != 0 or not out.exists():
            return None
        return json.loads(out.read_text())


if __name__ == "__main__":
    layout_worker(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
