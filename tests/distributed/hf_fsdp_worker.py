"""Worker for the hf family's layout tests: `torchrun --nproc-per-node 4 hf_fsdp_worker.py OUT`.
For each case (an architecture and a layout) a real `Trainer` trains STEPS fp32 steps (`layout_run`)
of that architecture at the debug sizes through `[model] name = "hf"`, and rank 0 saves the run
(per-step losses and gradient norms, the full final state) as OUT's folder/<case>.pt, with how far
each freshly initialised weight was from a single-process initialisation in OUT (JSON).
`reference(dump, case)` is the single-process run of a case, run by the test.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.distributed.parallel_worker import layout_run, max_diff  # noqa: E402
from tests.distributed.worker_cases import run_cases  # noqa: E402
from tests.support.parity import RunResult, train_and_capture  # noqa: E402
from titan_tpu.config import load_config  # noqa: E402
from titan_tpu.distributed.parallel_dims import ParallelContext, ParallelDims  # noqa: E402
from titan_tpu.distributed.parallelize import parallelize_model  # noqa: E402
from titan_tpu.distributed.sharded_init import canonical_name  # noqa: E402
from titan_tpu.models.hf import parallelize as hf_parallelize  # noqa: E402
from titan_tpu.models.registry import get_model_spec  # noqa: E402

# case -> (architecture, layout). The six kinds, each under FSDP 4 and under TP 2 x FSDP 2 by
# the model's own TP plan: Mistral (sliding window; FSDP with every block checkpointed), Gemma 2
# (soft-capping, a tied head split by the vocabulary) and Gemma 3 (per-head q/k norms), Phi-3
# (fused projections gathered), OLMo 2 (norms over the whole projection), GPT-NeoX (parallel
# residual, a vocabulary-split embedding), Mixtral (replicated experts beside split attention);
# DeepSeek V3 (latent attention: its joint projection's rope part reaches the heads unsplit, so its
# gradient is summed over tp) under TP 2 x FSDP 2; Gemma 2 also under HSDP 2 x 2; ModernBERT-decoder (truncated-normal init, which torch redraws per
# shard) and HunYuan V4 (its init fills a slice of a copy, which DTensor has no rule for; small
# parameters are initialised whole, titan_tpu/distributed/sharded_init.py) under FSDP 4; Mixtral with its experts split over ep 2 inside FSDP 4; Mixtral under TP 2 x EP 2 (attention split over tp, experts over ep and replicated over tp).
# Mixtral under plain FSDP and OLMoE under EP start from folders transformers saved in
# test_hf_saved_folders.py (2 processes), so they are not repeated here.
# Steps per case: what the cases check (an init, a tied head, FSDP units, a plan's layouts, a gradient's
# scale) shows from the first step on, and twenty cases on four processes are the tier's longest launch.
STEPS = 4
FSDP4 = ["--parallelism.dp_shard=4"]
TP2_FSDP2 = ["--parallelism.tp=2", "--parallelism.dp_shard=2"]
EP2_FSDP4 = ["--parallelism.ep=2", "--parallelism.dp_shard=4"]
TP2_EP2 = ["--parallelism.tp=2", "--parallelism.dp_shard=2", "--parallelism.ep=2"]
CASES: dict[str, tuple[str, list[str]]] = {
    "mistral_fsdp4_ac": ("MistralForCausalLM", ["--parallelism.dp_shard=4", "--activation_checkpoint.mode=full"]),
    "gemma2_hsdp2x2": ("Gemma2ForCausalLM", ["--parallelism.dp_replicate=2", "--parallelism.dp_shard=2"]),
    "modernbert_decoder_fsdp4": ("ModernBertDecoderForCausalLM", FSDP4),
    "hyv4_fsdp4": ("HYV4ForCausalLM", FSDP4),
    "gemma2_fsdp4": ("Gemma2ForCausalLM", FSDP4),
    "phi3_fsdp4": ("Phi3ForCausalLM", FSDP4),
    "olmo2_fsdp4": ("Olmo2ForCausalLM", FSDP4),
    "gptneox_fsdp4": ("GPTNeoXForCausalLM", FSDP4),
    "mistral_tp2_fsdp2": ("MistralForCausalLM", TP2_FSDP2),
    "gemma2_tp2_fsdp2": ("Gemma2ForCausalLM", TP2_FSDP2),
    "gemma3_tp2_fsdp2": ("Gemma3ForCausalLM", TP2_FSDP2),
    "phi3_tp2_fsdp2": ("Phi3ForCausalLM", TP2_FSDP2),
    "olmo2_tp2_fsdp2": ("Olmo2ForCausalLM", TP2_FSDP2),
    "gptneox_tp2_fsdp2": ("GPTNeoXForCausalLM", TP2_FSDP2),
    "mixtral_tp2_fsdp2": ("MixtralForCausalLM", TP2_FSDP2),
    "deepseek_v3_tp2_fsdp2": ("DeepseekV3ForCausalLM", TP2_FSDP2),
    "mixtral_ep2_fsdp4": ("MixtralForCausalLM", EP2_FSDP4),
    "mixtral_tp2_ep2": ("MixtralForCausalLM", TP2_EP2),
}
# Negative controls, each a case above with one piece of gradient bookkeeping broken, which the test
# must tell apart (broken case -> (its case, a name its failures must mention)): Gemma 3's per-head
# q/k norms' gradients not summed over the tp group (each rank's covers only its heads); Mixtral's
# expert gradients under EP without the 1/ep (each sums all ep ranks' tokens).
BROKEN: dict[str, tuple[str, str]] = {
    "gemma3_tp2_fsdp2_unsummed_qk_norm": ("gemma3_tp2_fsdp2", "_norm"),
    "mixtral_ep2_fsdp4_unscaled_experts": ("mixtral_ep2_fsdp4", "experts"),
}


@contextlib.contextmanager
def broken(case: str) -> Iterator[None]:
    """The breakage of BROKEN[case], while the model is built and trained."""
    if case == "gemma3_tp2_fsdp2_unsummed_qk_norm":
        original = hf_parallelize.LocalReplicate.__init__

        def unsummed(self: Any, partial_grads: bool = False) -> None:
            original(self, partial_grads=False)

        with mock.patch.object(hf_parallelize.LocalReplicate, "__init__", unsummed):
            yield
    else:
        unscaled = types.SimpleNamespace(apply=lambda tensor, scale: tensor)
        with mock.patch.object(hf_parallelize, "ScaleGrad", unscaled):
            yield


def run_arguments(case: str, dump: Path) -> list[str]:
    architecture, _ = CASES[case]
    return [
        *layout_run("hf", global_batch_size=4, steps=STEPS),
        "--model.name=hf",
        f"--hf.architecture={architecture}",
        "--model.flavor=debug",
        f"--job.dump_folder={dump / case}",
    ]


def single_process_init(config: Any) -> dict[str, torch.Tensor]:
    """The weights one process initialises for this config, by canonical name."""
    spec = get_model_spec("hf")
    args = dataclasses.replace(spec.args_for(config), max_seq_len=config.training.seq_len)
    with torch.device("meta"):
        model = spec.model_cls(args)
    ctx = ParallelContext(ParallelDims(1, 1, 1, 1, 1))
    model = parallelize_model(model, None, ctx, config, torch.device("cpu"), torch.float32)
    return {canonical_name(n): p.detach() for n, p in model.named_parameters()}


def run_case(case: str, dump: Path) -> dict[str, Any]:
    from titan_tpu.training.trainer import Trainer

    config = load_config("llama3_debug", [*run_arguments(case, dump), *CASES[case][1]])
    trainer = Trainer(config)
    return save_run(trainer, case, config, dump)


def run_broken_case(case: str, dump: Path) -> dict[str, Any]:
    """BROKEN[case]'s run of its case with its breakage."""
    from titan_tpu.training.trainer import Trainer

    base = BROKEN[case][0]
    config = load_config(
        "llama3_debug", [*run_arguments(base, dump), *CASES[base][1], f"--job.dump_folder={dump / case}"]
    )
    with broken(case):
        return save_run(Trainer(config), case, config, dump)


def save_run(trainer: Any, case: str, config: Any, dump: Path) -> dict[str, Any]:
    reference = single_process_init(config)
    init_diff = max(max_diff(p, reference[canonical_name(n)]) for n, p in trainer.model.named_parameters())
    run = train_and_capture(trainer)
    if dist.get_rank() == 0:
        run.save(dump / f"{case}.pt")
    # No trainer.close(): it destroys the process group the launch's next case runs in.
    return {"init_max_abs_diff": init_diff}


def reference(dump: Path, case: str) -> RunResult:
    from titan_tpu.training.trainer import Trainer

    trainer = Trainer(load_config("llama3_debug", run_arguments(case, dump / "single")))
    run = train_and_capture(trainer)
    trainer.close()
    return run


def main(out: Path) -> None:
    cases = [(case, functools.partial(run_case, case, out.parent)) for case in CASES]
    broken = [(case, functools.partial(run_broken_case, case, out.parent)) for case in BROKEN]
    run_cases(out, cases + broken)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
