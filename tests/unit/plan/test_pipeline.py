"""The planner's pipeline (titan_tpu/plan/pipeline.py) and FSDP CPU offload (host_offload.py) terms,
worked by hand on Llama 3 debug (4 layers, dim 256, vocab 512, 256 tokens, global batch 8)."""

from __future__ import annotations

import pytest
from torch.distributed.pipelining.schedules import _get_warmup_ops

from titan_tpu.config import load_config
from titan_tpu.config.sections import ActivationCheckpointConfig
from titan_tpu.models.common.decoder_activations import dense_decoder_activations
from titan_tpu.plan.activations import Geometry, estimate_activations, lm_head_bytes
from titan_tpu.plan.census import build_on_meta
from titan_tpu.plan.chips import parse_chips
from titan_tpu.plan.host_offload import HOST_ADAM_ELEMENTS_PER_S, host_link_bytes_per_s
from titan_tpu.plan.pipeline import in_flight_chunks
from titan_tpu.plan.pipeline_bubble import step_time_factor
from titan_tpu.plan.planner import make_plan, plan_memory
from titan_tpu.plan.roofline import COLLECTIVE_EFFICIENCY

PP2 = ["--parallelism.pp=2", "--training.local_batch_size=-1", "--training.dtype=float32"]


def _stage_elements(rank: int) -> tuple[int, int]:
    """(elements, tensors) pp rank `rank` of 2 holds, counted from the model's names by hand:
    layers 0-1 and the embedding on rank 0, layers 2-3, the norm and the head on rank 1."""
    model, _ = build_on_meta(load_config("llama3_debug", []))
    mine = []
    for name, param in model.named_parameters():
        if name.startswith("layers."):
            ours = (int(name.split(".")[1]) < 2) == (rank == 0)
        else:
            ours = name.startswith("tok_embeddings") == (rank == 0)
        if ours:
            mine.append(param.numel())
    return sum(mine), len(mine)


@pytest.mark.parametrize("rank", [0, 1])
def test_each_pp_rank_holds_its_stage_sharded_over_dp_shard(rank: int) -> None:
    """Catches the whole model counted on every pp rank, the embedding or head on the wrong rank, and
    a stage not sharded over dp_shard."""
    elements, tensors = _stage_elements(rank)
    memory = plan_memory(load_config("llama3_debug", [*PP2, "--parallelism.dp_shard=1"]), 2, pp_rank=rank).memory
    assert memory.parameters == 4 * elements
    assert memory.optimizer == 8 * elements + 4 * tensors
    sharded = plan_memory(load_config("llama3_debug", [*PP2, "--parallelism.dp_shard=2"]), 4, pp_rank=rank).memory
    assert sharded.parameters == pytest.approx(2 * elements, rel=0.01)  # FSDP pads uneven shards
    # Under FSDP the schedule holds the stage gathered and its gradients unsharded all step (float32 here).
    assert sharded.buffers == 8 * elements


def test_in_flight_chunks_follow_the_schedules() -> None:
    """GPipe keeps every micro-batch, 1F1B at most p - r; interleaved as torch's own warmup count
    (torch.distributed.pipelining's `_get_warmup_ops`) plus the forward before the first backward.
    Catches a count that drifts from the schedule torch runs."""
    assert in_flight_chunks("GPipe", 4, 8, 1, 0) == 8
    assert [in_flight_chunks("1F1B", 4, 8, 1, r) for r in range(4)] == [4, 3, 2, 1]
    assert in_flight_chunks("1F1B", 4, 2, 1, 0) == 2
    for p, m, r in [(2, 4, 0), (2, 4, 1), (4, 8, 0), (4, 16, 2), (4, 4, 3)]:
        per_round = m // max(1, m // p)
        warmup = _get_warmup_ops(r, 2, per_round, p, m)
        assert in_flight_chunks("Interleaved1F1B", p, m, 2, r) == min(warmup + 1, 2 * m)


def test_rank_0_activations_are_its_chunks_in_flight() -> None:
    """PP 2, 1F1B, 4 micro-batches of 2 samples: rank 0 keeps two chunks of its 2 layers, the
    peak being one kept plus one at its backward; GPipe keeps all four. Catches the whole local
    batch counted as one micro-batch, or every layer of the model on the rank."""
    config = load_config("llama3_debug", [*PP2, "--parallelism.pp_microbatches=4"])
    memory = plan_memory(config, 2, pp_rank=0)
    model, args = build_on_meta(config)
    g = Geometry(micro_batch=2, tokens_per_sample=256, act_bytes=4)
    chunk = estimate_activations(dense_decoder_activations(args, g), 2, g, ActivationCheckpointConfig())
    assert memory.layout.micro_batch == 2 and memory.layout.grad_accum == 4
    assert memory.activations.peak == chunk.kept + chunk.peak
    gpipe = plan_memory(
        load_config("llama3_debug", [*PP2, "--parallelism.pp_microbatches=4", "--parallelism.pp_schedule=GPipe"]),
        2,
        pp_rank=0,
    )
    assert gpipe.activations.peak == 3 * chunk.kept + chunk.peak
    last = plan_memory(config, 2, pp_rank=1)
    with_head = estimate_activations(
        dense_decoder_activations(args, g),
        2,
        g,
        ActivationCheckpointConfig(),
        lm_head_bytes(args.vocab_size, args.dim, g),
    )
    assert last.activations.peak == with_head.peak


def test_pipeline_step_time_is_compute_times_the_bubble_plus_the_sends() -> None:
    """bf16 on v6e-4, PP 2 x FSDP 2, 1F1B with 2 micro-batches of 2 samples: compute x (2 + 1) / 2,
    and 2 x 2 sends of 2 x 256 x 256 bf16 activations over ICI, exposed; one gradient reduction
    per step, not one per micro-batch."""
    config = load_config("llama3_debug", ["--parallelism.pp=2", "--training.local_batch_size=-1"])
    cluster = parse_chips("v6e-4")
    plan = make_plan(config, cluster)
    assert plan.step.bubble == step_time_factor("1F1B", 2, 2, 1) == 1.5
    ici = cluster.fast_bytes_per_s_per_device() * COLLECTIVE_EFFICIENCY
    assert plan.step.p2p_s == pytest.approx(2 * 2 * 2 * 256 * 256 * 2 / ici)
    step = plan.step
    overlapped = max(step.compute_s * 1.5, step.fsdp_s, step.hsdp_s)
    assert step.step_s == pytest.approx(overlapped + step.tp_s + step.ep_s + step.p2p_s)
    # Reducing per micro-batch, as without pp, would move more.
    assert plan.detail.layout.grad_accum == 2


def test_fsdp_cpu_offload_moves_the_state_to_the_host_and_charges_the_link_and_the_host_step() -> None:
    """FSDP 4 on v6e-4: parameters, gradients and AdamW state leave HBM for host memory; each step
    copies the float32 shard in twice per micro-batch (forward and backward gathers) and the
    gradient shard out once per micro-batch, over the host link (overlapped), and steps AdamW on
    the host (exposed). Catches offloaded state still counted in HBM, and offload charged nothing."""
    cluster = parse_chips("v6e-4")
    base = make_plan(load_config("llama3_debug", ["--parallelism.dp_shard=4"]), cluster)
    offloaded = make_plan(
        load_config("llama3_debug", ["--parallelism.dp_shard=4", "--parallelism.fsdp_cpu_offload=true"]), cluster
    )
    memory, before = offloaded.detail.memory, base.detail.memory
    assert memory.parameters == memory.gradients == memory.optimizer == 0
    assert memory.host == before.state
    assert memory.total == before.total - before.state
    local, accum = offloaded.detail.local.local, offloaded.detail.layout.grad_accum
    assert offloaded.step.host_link_s == pytest.approx(4 * local * (2 * accum + accum) / host_link_bytes_per_s(cluster))
    assert offloaded.step.host_s == pytest.approx(local / HOST_ADAM_ELEMENTS_PER_S)
    assert offloaded.step.step_s > base.step.step_s


def test_activation_offload_is_charged_out_overlapped_and_back_exposed() -> None:
    """Full checkpointing with offload, FSDP 4: each block's input (256 x 2 bytes a token, bf16)
    goes out in forward and back in backward over the host link. Catches offload charged nothing."""
    cluster = parse_chips("v6e-4")
    overrides = ["--parallelism.dp_shard=4", "--activation_checkpoint.mode=full"]
    plan = make_plan(load_config("llama3_debug", [*overrides, "--activation_checkpoint.offload=true"]), cluster)
    moved = 4 * 256 * 2 * 256 * 2  # blocks x micro-batch of 2 x 256 tokens x dim x bf16 bytes
    assert plan.detail.offloaded_per_microbatch == moved
    assert plan.step.host_s == pytest.approx(moved / host_link_bytes_per_s(cluster))
    assert make_plan(load_config("llama3_debug", overrides), cluster).step.host_s == 0


def test_pipeline_with_context_parallelism_sends_the_cp_ranks_part_of_the_rows() -> None:
    """PP 2 x CP 2 on v6e-4, bf16: 2 micro-batches of 4 samples, each stage passing on its cp rank's
    128 of the 256 tokens. Catches whole rows counted."""
    cluster = parse_chips("v6e-4")
    config = load_config("llama3_debug", ["--parallelism.pp=2", "--training.local_batch_size=-1", "--parallelism.cp=2"])
    plan = make_plan(config, cluster)
    ici = cluster.fast_bytes_per_s_per_device() * COLLECTIVE_EFFICIENCY
    assert plan.detail.layout.micro_batch == 4
    assert plan.step.p2p_s == pytest.approx(2 * 2 * 4 * 128 * 256 * 2 / ici)
