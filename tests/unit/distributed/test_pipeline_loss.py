"""The pipeline's loss normalisation, on one process (a 1-rank gloo group, one stage, 2 micro-batches):
the schedule's loss and gradients equal one forward and backward over the whole batch, also when
the micro-batches hold different numbers of counted labels (labels = -100 are not counted)."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from titan_tpu.distributed.parallel_dims import ParallelContext, ParallelDims
from titan_tpu.distributed.pipeline import IGNORE_INDEX, PipelineRunner
from titan_tpu.distributed.pipeline_plan import PipelinePlan
from titan_tpu.models.common.loss import cross_entropy_loss
from titan_tpu.models.registry import get_model_spec


def test_micro_batches_weigh_by_their_counted_labels(tmp_path: Path) -> None:
    """Catches a loss averaged per micro-batch (each weighing 1 / n): here micro-batch 0 counts half
    the labels of micro-batch 1, so the mean of the two means is not the batch's mean (the control)."""
    spec = get_model_spec("llama3")
    args = dataclasses.replace(spec.flavor("debug"), dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16)
    torch.manual_seed(0)
    model = spec.model_cls(args)
    model.init_weights()
    reference = copy.deepcopy(model)
    tokens = torch.randint(0, args.vocab_size, (4, 16))
    labels = torch.randint(0, args.vocab_size, (4, 16))
    labels[:2, :8] = IGNORE_INDEX  # micro-batch 0 (rows 0-1) counts 16 labels, micro-batch 1 counts 32

    expected = cross_entropy_loss(reference(tokens), labels)
    expected.backward()
    means = [cross_entropy_loss(reference(tokens[i : i + 2]), labels[i : i + 2]) for i in (0, 2)]
    assert abs(float(sum(means).detach() / 2 - expected.detach())) > 1e-3  # the control: equal weights would be wrong

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        pp_mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("pp",))
        ctx = ParallelContext(ParallelDims(1, 1, 1, 1, 1), {"pp": pp_mesh})
        plan = PipelinePlan("GPipe", pp=1, stage_layers=((0, 1),), microbatches=2)
        runner = PipelineRunner([(0, model)], plan, ctx, torch.device("cpu"), cross_entropy_loss)
        loss = runner.step(tokens, labels)
    finally:
        dist.destroy_process_group()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-6, atol=0)
    grads = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, grads[name].grad, rtol=1e-5, atol=1e-7, msg=name)
