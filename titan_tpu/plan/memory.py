"""Bytes one device holds during a training step, by kind.

What the trainer stores (titan_tpu/distributed/fsdp.py, titan_tpu/optim.py):

- parameters: float32, always. FSDP's mixed precision gathers them in the compute dtype for each
  block's forward and backward, so the stored sharded float32 copy *is* the master copy; there is no
  second one.
- gradients: float32, the parameters' shape (FSDP reduces in `fsdp_reduce_dtype` and hands back the
  sharded gradient in the parameters' dtype).
- optimizer: AdamW's two float32 moments per parameter element, plus one float32 step count per
  parameter tensor.
- with LoRA (`lora.enable`): the frozen base has neither gradients nor optimizer state, and the
  adapted linears' frozen weights are stored in the compute dtype (bf16: half the bytes), the rest of
  it in float32; the adapters have both (census.py counts them as the trainer places them).
- activations: `activations.py`, for one micro-batch.
- buffers: what is gathered for compute. Under FSDP: the root's parameters (embeddings, final norm,
  head stay gathered through forward and backward, like the last block), the last block's (kept for
  backward), two blocks in flight (the one computing and the prefetched next one), all in the compute
  dtype, and one block's unsharded gradients (its trained parameters') in the reduce dtype awaiting
  their reduce-scatter; each at FSDP2's padded size (census.py `gathered_numel`).
  A single device under bf16 autocast keeps a bf16 copy of every float32 weight for the forward
  (autocast caches its casts of parameters); in float32 nothing is copied.

With FSDP CPU offload (`parallelism.fsdp_cpu_offload`) the parameters, gradients and optimizer state
are in host memory (`host`), not in HBM; the buffers and activations stay (host_offload.py). Under
pipeline parallelism the buffers are pipeline.py's.

The device fits when the sum stays under its HBM less `HBM_RESERVE` (runtime, compiler scratch and
allocator fragmentation).
"""

from __future__ import annotations

from dataclasses import dataclass

from titan_tpu.plan.activations import FLOAT32, ActivationEstimate
from titan_tpu.plan.census import ROOT, Census

ADAM_MOMENTS = 2
STEP_COUNT_BYTES = 4
# Share of HBM left for the runtime, compiler scratch space and allocator fragmentation.
HBM_RESERVE = 0.10


@dataclass(frozen=True)
class Precision:
    compute_bytes: int  # 2 for bfloat16, 4 for float32
    reduce_bytes: int  # FSDP gradient reduction dtype


@dataclass(frozen=True)
class MemoryEstimate:
    parameters: int
    gradients: int
    optimizer: int
    activations: int  # peak over forward + backward
    buffers: int
    host: int = 0  # bytes in host memory: the state, under FSDP CPU offload

    @property
    def state(self) -> int:
        """Parameters + gradients + optimizer: what persists across steps."""
        return self.parameters + self.gradients + self.optimizer

    @property
    def total(self) -> int:
        return self.state + self.activations + self.buffers


def state_bytes(census: Census, compute_bytes: int = FLOAT32) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer) bytes on the most loaded device: every parameter is stored
    (in float32, or in the compute dtype), only the trained ones (all but a LoRA run's frozen base)
    have gradients and AdamW state."""
    trained = census.trained
    local_trained = sum(p.local_numel for p in trained)
    optimizer = ADAM_MOMENTS * FLOAT32 * local_trained + STEP_COUNT_BYTES * len(trained)
    parameters = sum(p.local_numel * (compute_bytes if p.in_compute_dtype else FLOAT32) for p in census.params)
    return parameters, FLOAT32 * local_trained, optimizer


def buffer_bytes(census: Census, precision: Precision, sharded: bool) -> int:
    if not sharded:  # autocast's copies of the float32 weights
        copied = sum(p.local_numel for p in census.params if not p.in_compute_dtype)
        return copied * precision.compute_bytes if precision.compute_bytes < FLOAT32 else 0
    gathered: dict[str, int] = {}  # FSDP unit -> elements it gathers; a block's experts come with it
    reduced: dict[str, int] = {}  # FSDP unit -> gradient elements it reduce-scatters (trained ones)
    for param in census.params:
        block = param.unit.removesuffix(".experts")
        gathered[block] = gathered.get(block, 0) + param.gathered_numel
        reduced[block] = reduced.get(block, 0) + (param.gathered_numel if param.trainable else 0)
    root = gathered.pop(ROOT, 0)
    reduced.pop(ROOT, None)
    blocks = list(gathered.values())
    widest = max(blocks, default=0)
    last = blocks[-1] if blocks else 0
    return (root + last + 2 * widest) * precision.compute_bytes + max(
        reduced.values(), default=0
    ) * precision.reduce_bytes


def estimate_memory(
    census: Census,
    activations: ActivationEstimate,
    precision: Precision,
    sharded: bool,
    buffers: int | None = None,
    offloaded: bool = False,
) -> MemoryEstimate:
    """`buffers` replaces `buffer_bytes` (pipeline stages gather differently); `offloaded` moves the
    state to host memory (FSDP CPU offload, which applies only when FSDP does)."""
    parameters, gradients, optimizer = state_bytes(census, precision.compute_bytes)
    gathered = buffer_bytes(census, precision, sharded) if buffers is None else buffers
    if offloaded and sharded:
        return MemoryEstimate(0, 0, 0, activations.peak, gathered, parameters + gradients + optimizer)
    return MemoryEstimate(parameters, gradients, optimizer, activations.peak, gathered)


@dataclass(frozen=True)
class Fit:
    usable: int  # HBM bytes after the reserve
    need: int

    @property
    def fits(self) -> bool:
        return self.need <= self.usable

    @property
    def margin(self) -> int:
        """Headroom (positive) or shortfall (negative), bytes."""
        return self.usable - self.need


def check_fit(memory: MemoryEstimate, hbm_bytes: float) -> Fit:
    return Fit(int(hbm_bytes * (1 - HBM_RESERVE)), memory.total)
