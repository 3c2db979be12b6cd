"""A decoder family the planner has never heard of, registered here with a TP plan of its own, is
planned correctly: the planner's per-device parameter count equals the hand count and the shards a
real tensor-parallel layout of it holds (two ranks of a fake process group in this one process).

The family differs from every shipped one where a planner that restates the shipped plans would
go wrong: a GELU MLP with biases (`feed_forward.up` / `.down`, names no shipped plan has; a
column-wise bias is split, a row-wise one replicated) and a vocabulary-sharded head. Bugs caught:
a planner that reads a fixed list of module paths instead of the family's plan (it replicates the
MLP: shown below to miss the count), or gets a style's split dimension or a bias wrong.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel
from torch.testing._internal.distributed.fake_pg import FakeStore

from titan_tpu.config import catalogue, load_config
from titan_tpu.distributed.parallel_dims import ParallelDims
from titan_tpu.models.common.decoder import DecoderLM, decoder_block
from titan_tpu.models.common.decoder_activations import FeedForwardActivations, decoder_block_activations
from titan_tpu.models.common.decoder_args import DecoderArgs
from titan_tpu.models.common.flops import decoder_flops_per_token
from titan_tpu.models.common.parallelize import DecoderTPPlan, attention_block_plan
from titan_tpu.models.common.transformer import TransformerBlock
from titan_tpu.models.registry import register_model
from titan_tpu.plan.census import census
from titan_tpu.plan.planner import plan_memory
from titan_tpu.protocols.model_spec import ModelSpec, PlannerHooks
from titan_tpu.protocols.planning import ActivationGeometry, BlockActivations

TP = 2


@dataclass(frozen=True)
class ToyArgs(DecoderArgs):
    mlp_hidden_dim: int = 96


class GeluMLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden_dim)
        self.down = nn.Linear(hidden_dim, dim)

    def init_weights(self, out_init_std: float) -> None:
        nn.init.normal_(self.up.weight, std=0.02)
        nn.init.normal_(self.down.weight, std=out_init_std)
        nn.init.zeros_(self.up.bias)
        nn.init.zeros_(self.down.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class ToyModel(DecoderLM):
    def __init__(self, args: ToyArgs) -> None:
        blocks = [decoder_block(args, i, GeluMLP(args.dim, args.mlp_hidden_dim)) for i in range(args.n_layers)]
        super().__init__(args, blocks)


def toy_block_plan(block: TransformerBlock, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    plan = attention_block_plan(block, sequence_parallel)
    plan["feed_forward.up"] = ColwiseParallel()
    plan["feed_forward.down"] = RowwiseParallel(output_layouts=Shard(1) if sequence_parallel else Replicate())
    if sequence_parallel:
        plan["feed_forward"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return plan


TOY_TP = DecoderTPPlan(block_plan=toy_block_plan)


def toy_block_activations(args: ToyArgs, g: ActivationGeometry) -> BlockActivations:
    hidden = args.mlp_hidden_dim * g.act_bytes / g.tp
    return decoder_block_activations(args, g, FeedForwardActivations(2 * hidden, hidden, hidden))


def toy_flops_per_token(args: ToyArgs, seq_len: int) -> float:
    return decoder_flops_per_token(args, 2 * args.dim * args.mlp_hidden_dim, seq_len)


ARGS = ToyArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, mlp_hidden_dim=96, max_seq_len=64)
SPEC = ModelSpec(
    name="toy_decoder",
    model_cls=ToyModel,
    flavors={"tiny": ARGS},
    flops_per_token=toy_flops_per_token,
    planning=PlannerHooks(tp_plan=TOY_TP, block_activations=toy_block_activations),
)


def hand_count_per_device(args: ToyArgs, tp: int) -> int:
    """What each of tp ranks holds: every matrix and the up bias split, norms and the down bias whole."""
    d, f, q, kv = args.dim, args.mlp_hidden_dim, args.n_heads * args.attn_head_dim, args.n_kv_heads * args.attn_head_dim
    attention = (d * q + 2 * d * kv + q * d) // tp
    mlp = (d * f + f + f * d) // tp + d
    block = attention + mlp + 2 * d
    return 2 * args.vocab_size * d // tp + d + args.n_layers * block


@pytest.fixture
def toy_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    """The family registered for this test only (in a copy of the catalogue's table), as a user's own
    package would register it."""
    monkeypatch.setattr(catalogue, "FAMILIES", dict(catalogue.FAMILIES))
    register_model(SPEC)


def toy_config(*extra: str):  # noqa: ANN201 (a TrainConfig)
    return load_config("llama3_debug", ["--model.name=toy_decoder", "--model.flavor=tiny", *extra])


def sharded_local_numel(sequence_parallel: bool) -> int:
    """Elements rank 0 holds after the family's plan is applied on a tp mesh of TP fake ranks."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=TP)
    try:
        mesh = init_device_mesh("cpu", (TP,))
        model = ToyModel(ARGS)
        TOY_TP.apply(model, mesh, sequence_parallel, loss_parallel=False)
        return sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_a_new_family_is_planned_by_its_own_tp_plan(toy_registered: None, sequence_parallel: bool) -> None:
    config = toy_config(f"--parallelism.sequence_parallel={str(sequence_parallel).lower()}")
    planned = census(config, ParallelDims(1, 1, TP, 1, TP))
    whole = census(config, ParallelDims(1, 1, 1, 1, 1))
    assert whole.total == sum(p.numel() for p in ToyModel(ARGS).parameters())
    assert planned.local == hand_count_per_device(ARGS, TP) == sharded_local_numel(sequence_parallel)
    # The negative control: the planner's old fixed list of Llama-layout paths leaves the MLP
    # unsplit, which the same comparison rejects.
    mlp = sum(p.numel for p in whole.params if ".feed_forward." in p.name)
    mlp_local = sum(p.local_numel for p in planned.params if ".feed_forward." in p.name)
    assert planned.local - mlp_local + mlp != hand_count_per_device(ARGS, TP)


def test_the_whole_plan_runs_for_a_new_family(toy_registered: None) -> None:
    """Memory and activations come from the family's hooks too: tp halves what the blocks keep."""
    single = plan_memory(toy_config("--training.global_batch_size=2"), 1)
    split = plan_memory(toy_config("--training.global_batch_size=2", f"--parallelism.tp={TP}"), TP)
    assert single.memory.parameters == 4 * single.census.total
    assert 0 < split.activations.kept < single.activations.kept
