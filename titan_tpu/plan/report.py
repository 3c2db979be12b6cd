"""A plan as text: the layout, memory per device against HBM, step time and MFU."""

from __future__ import annotations

import dataclasses

from titan_tpu.plan.chips import GIB
from titan_tpu.plan.memory import HBM_RESERVE
from titan_tpu.plan.planner import Plan, full_finetuning_memory
from titan_tpu.plan.roofline import (
    ALL_REDUCE,
    ALL_TO_ALL,
    COLLECTIVE_EFFICIENCY,
    GATHER_SCATTER,
    assumed_bus_bandwidth,
    compute_flops,
)
from titan_tpu.plan.search import Candidate


def gib(value: float) -> str:
    return f"{value / GIB:.2f} GiB"


def fit_line(plan: Plan) -> str:
    fit = plan.fit
    if fit.fits:
        return f"fits: {gib(fit.need)} of {gib(fit.usable)} usable, {gib(fit.margin)} headroom"
    return f"does not fit: needs {gib(fit.need)} of {gib(fit.usable)} usable, {gib(-fit.margin)} over"


def render(plan: Plan) -> str:
    config, cluster, detail, step = plan.config, plan.cluster, plan.detail, plan.step
    layout, memory = detail.layout, detail.memory
    dims, chip = layout.dims, cluster.chip
    dtype = "bfloat16" if layout.precision.compute_bytes == 2 else "float32"
    unit = detail.workload.unit
    items_per_s = config.training.global_batch_size * detail.workload.items_per_sample / dims.world_size / step.step_s
    cp_term = " + CP" if dims.cp_enabled else ""  # context parallelism's exposed K/V gathers
    pipeline = layout.pipeline
    pp_line = []
    if pipeline is not None:
        pp_line = [
            f"pipeline   {pipeline.schedule}, {pipeline.n_stages} stages of {len(pipeline.stage_layers[0])} layers, "
            f"{pipeline.microbatches} micro-batches; memory of pp rank {detail.pp_rank} (the most loaded)"
        ]
    host_line = []
    if memory.host:
        host_line = [f"  host memory   {gib(memory.host)}   (FSDP CPU offload's state; not checked against host RAM)"]
    overlapped = "max(compute" + (" x bubble" if pipeline is not None else "") + ", FSDP, HSDP"
    overlapped += ", host link)" if step.host_link_s else ")"
    exposed = cp_term + (" + P2P" if pipeline is not None else "") + (" + host" if step.host_s else "")
    lora = config.lora.enable
    lines = [
        f"model      {config.model.name} {config.model.flavor}: {detail.census.total / 1e9:.2f}B parameters, "
        f"{detail.census.n_blocks} blocks",
        *_lora_lines(plan),
        f"cluster    {cluster.name}: {cluster.chips} chips, {cluster.devices} devices, {cluster.slices} slice(s) "
        f"of {cluster.devices_per_slice} devices; {gib(cluster.hbm_bytes_per_device)} HBM and "
        f"{cluster.peak_flops_per_device / 1e12:.0f} TFLOP/s bf16 per device",
        *_calibration_lines(plan),
        f"layout     {dims.describe()}; micro-batch {layout.micro_batch} x {detail.workload.tokens_per_sample} tokens, "
        f"{layout.grad_accum} micro-batch(es) per step; {dtype}; activation checkpointing "
        f"{config.activation_checkpoint.mode}",
        *pp_line,
        "",
        "memory per device",
        f"  parameters    {gib(memory.parameters)}   "
        f"({'the adapted linears in the compute dtype, the rest float32' if lora else 'float32'}, sharded)",
        f"  gradients     {gib(memory.gradients)}   (float32, sharded{'; the adapters only' if lora else ''})",
        f"  optimizer     {gib(memory.optimizer)}   (AdamW: two float32 moments{' of the adapters' if lora else ''})",
        f"  activations   {gib(memory.activations)}   (peak of one micro-batch; {gib(detail.activations.kept)} "
        "kept into backward)",
        f"  buffers       {gib(memory.buffers)}   (gathered parameters and unsharded gradients in flight)",
        f"  total         {gib(memory.total)}",
        f"  {fit_line(plan)} (HBM less {HBM_RESERVE:.0%} reserve)",
        *host_line,
        *_full_finetuning_lines(plan),
        "",
        f"step time (roofline; compute at {plan.compute_efficiency:.0%} of peak, collectives at "
        f"{COLLECTIVE_EFFICIENCY:.0%} of {chip.fast_link} / {chip.slow_link} bandwidth)",
        f"  compute       {step.compute_s:.3f} s"
        + (
            f" x {step.bubble:.3f} pipeline bubble = {step.compute_s * step.bubble:.3f} s"
            if pipeline is not None
            else ""
        ),
        f"  FSDP          {step.fsdp_s:.3f} s   (overlapped with compute)",
        f"  HSDP          {step.hsdp_s:.3f} s   (overlapped with compute)",
        f"  TP            {step.tp_s:.3f} s   (exposed)",
        f"  EP            {step.ep_s:.3f} s   (exposed)",
        *([f"  CP            {step.cp_s:.3f} s   (exposed)"] if dims.cp_enabled else []),
        *([f"  P2P           {step.p2p_s:.3f} s   (exposed: stage boundaries)"] if pipeline is not None else []),
        *([f"  host link     {step.host_link_s:.3f} s   (overlapped: offload copies)"] if step.host_link_s else []),
        *(
            [f"  host          {step.host_s:.3f} s   (exposed: host optimizer step, offloaded activations back)"]
            if step.host_s
            else []
        ),
        f"  step          {step.step_s:.3f} s = {overlapped} + TP + EP{exposed}",
        f"  throughput    {items_per_s:,.0f} {unit}/s per device",
        f"  MFU           {100 * step.mfu:.1f}%",
    ]
    return "\n".join(lines)


def _lora_lines(plan: Plan) -> list[str]:
    """What a LoRA run trains: its adapters against the whole model."""
    lora, census = plan.config.lora, plan.detail.census
    if not lora.enable:
        return []
    trained = sum(p.numel for p in census.trained)
    return [
        f"lora       rank {lora.rank}, alpha {lora.alpha:g}, {', '.join(lora.target_modules)}: {trained / 1e6:.1f}M of "
        f"{census.total / 1e9:.2f}B parameters trained ({100 * trained / census.total:.2f}%); the base frozen, without "
        "gradients or optimizer state"
    ]


def _full_finetuning_lines(plan: Plan) -> list[str]:
    """A LoRA plan's memory beside the same run's with every parameter trained."""
    if not plan.config.lora.enable:
        return []
    full, memory = full_finetuning_memory(plan.config, plan.cluster.devices), plan.detail.memory
    return [
        f"  full fine-tuning on this layout: parameters {gib(full.parameters)}, gradients {gib(full.gradients)}, "
        f"optimizer {gib(full.optimizer)}, total {gib(full.total)} ({gib(full.total - memory.total)} more than LoRA)"
    ]


def _calibration_lines(plan: Plan) -> list[str]:
    """What a doctor report changed: its measured figures beside the vendor's they replace."""
    cluster, calibration = plan.cluster, plan.cluster.calibration
    if calibration is None:
        return []
    vendor = dataclasses.replace(cluster, calibration=None)
    precision = plan.detail.layout.precision
    matmuls, table = compute_flops(cluster, precision) / 1e12, vendor.peak_flops_per_device / 1e12
    figures = [f"matmuls {matmuls:.1f} TFLOP/s (table: {table:.0f})"]
    for fast, link in ((True, cluster.chip.fast_link), (False, cluster.chip.slow_link)):
        for name, kinds in (
            ("all-gather/reduce-scatter", GATHER_SCATTER),
            ("all-reduce", ALL_REDUCE),
            ("all-to-all", ALL_TO_ALL),
        ):
            measured = calibration.bus_bytes_per_s.get("fast" if fast else "slow", {})
            if any(kind in measured for kind in kinds):
                used, planned = assumed_bus_bandwidth(cluster, fast, kinds), assumed_bus_bandwidth(vendor, fast, kinds)
                figures.append(f"{link} {name} {used / 1e9:.1f} GB/s (vendor: {planned / 1e9:.1f})")
    return [f"calibrated from {calibration.source} (measured on {calibration.device}): " + "; ".join(figures)]


def _layout_line(plan: Plan) -> str:
    config, layout = plan.config, plan.detail.layout
    ac = config.activation_checkpoint
    checkpointing = ac.mode if ac.mode != "selective" else f"selective {ac.selective_option}"
    if ac.offload:
        checkpointing += " + offload"
    reduce = config.parallelism.fsdp_reduce_dtype if layout.precision.compute_bytes == 2 else "float32"
    schedule = f" {layout.pipeline.schedule}" if layout.pipeline is not None else ""
    fsdp_offload = "; FSDP CPU offload" if config.parallelism.fsdp_cpu_offload else ""
    return (
        f"{layout.dims.describe()}{schedule}; micro-batch {layout.micro_batch} x {layout.grad_accum}; checkpointing "
        f"{checkpointing}; reduce {reduce}{fsdp_offload}"
    )


def render_search(fitting: list[Candidate], closest: Candidate | None, top: int, tried: str) -> str:
    """The best `top` fitting layouts with their overrides; or, when none fits, the closest one and
    where its memory goes. `tried` names what was searched (model on cluster)."""
    if fitting:
        lines = [f"{len(fitting)} layouts fit ({tried}); the best {min(top, len(fitting))} by estimated MFU:"]
        for rank, candidate in enumerate(fitting[:top], 1):
            plan = candidate.plan
            lines += [
                f"{rank}. MFU {100 * plan.step.mfu:.1f}%, step {plan.step.step_s:.3f} s, "
                f"{gib(plan.fit.need)} of {gib(plan.fit.usable)}: {_layout_line(plan)}",
                "   " + " ".join(candidate.overrides),
            ]
        return "\n".join(lines)
    if closest is None:
        return f"no layout the trainer accepts ({tried})"
    plan = closest.plan
    memory = plan.detail.memory
    terms = {
        "parameters": memory.parameters,
        "gradients": memory.gradients,
        "optimizer": memory.optimizer,
        "activations": memory.activations,
        "buffers": memory.buffers,
    }
    largest = max(terms, key=terms.__getitem__)
    return "\n".join(
        [
            f"no layout fits ({tried}); the closest is {gib(-plan.fit.margin)} over: {_layout_line(plan)}",
            "   " + " ".join(closest.overrides),
            "   "
            + ", ".join(f"{name} {gib(value)}" for name, value in terms.items())
            + f" = {gib(memory.total)} against {gib(plan.fit.usable)} usable; the largest is {largest}",
        ]
    )
