"""Peak FLOP/s of a device, the denominator of MFU.

Accelerators come from a table of published dense (no sparsity) bf16 figures per device, looked up
by the name the runtime reports. A CPU's peak depends on its cores, threads and BLAS build, so it is
measured: the best of a few windows of large square matmuls, in each dtype the run computes in (a
bf16 run on the CPU also runs float32 parts: norms, softmax, the loss), with the threads the ranks
use. One process per host probes while the others on that host wait, so the probe has the cores to
itself and every rank of a host divides by the same number. An accelerator the table does not know,
or a float32 run on an accelerator, gets no peak: MFU is reported as missing, never guessed.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from titan_tpu.device.select import Device

# Dense bf16 FLOP/s per device the framework addresses, from the vendors' data sheets. Names as
# the runtimes report them (torch_tpu: "TPU v6e"; CUDA: "NVIDIA H100 PCIe"), matched as lowercase
# substrings in order, so a more specific name comes before a more general one.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    # v7 exposes each of its two TensorCores as its own device: half the chip's 2307 TFLOP/s.
    ("tpu v7", 2307e12 / 2),
    ("tpu v6e", 918e12),
    ("tpu v5p", 459e12),  # v4 and v5p fuse their two cores into one device (megacore)
    ("tpu v5e", 197e12),
    ("tpu v4", 275e12),
    ("b200", 2250e12),
    ("h200", 989e12),
    ("h100 pcie", 756e12),
    ("h100 nvl", 835e12),
    ("h100", 989e12),
    ("a100", 312e12),
)

# Square matmuls of this size reach the BLAS plateau on CPUs from laptops to servers while one
# still takes well under a second in fp32.
PROBE_SIZE = 1024


def device_generation(device_name: str) -> str | None:
    """The table's key for a device name ("tpu v6e" for "TPU v6e lite"), or None: what a doctor
    report and the planner's chip are matched by."""
    lowered = device_name.lower()
    return next((key for key, _ in PEAK_BF16_FLOPS if key in lowered), None)


def table_peak_flops(device_name: str) -> float | None:
    key = device_generation(device_name)
    return None if key is None else dict(PEAK_BF16_FLOPS)[key]


def measure_matmul_flops(
    dtype: torch.dtype,
    device: torch.device = torch.device("cpu"),
    size: int = PROBE_SIZE,
    windows: int = 5,
    seconds: float = 0.2,
) -> float:
    """FLOP/s of repeated square matmuls with the current thread count.

    The best of several windows: a peak is what the hardware can do, and the best window is the
    one least disturbed by other work on the machine.
    """
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    torch.mm(a, b)  # warm-up: the first call picks kernels and touches memory
    best = 0.0
    for _ in range(windows):
        _wait_for(device)
        iterations = 0
        start = time.perf_counter()
        while True:
            torch.mm(a, b)
            iterations += 1
            _wait_for(device)
            if (elapsed := time.perf_counter() - start) >= seconds:
                break
        best = max(best, 2 * size**3 * iterations / elapsed)
    return best


def _wait_for(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


# The best CPU peak this process has measured, per run dtype and thread count.
_measured: dict[tuple[torch.dtype, int], float] = {}


def cpu_peak_flops(dtype: torch.dtype, fresh: bool = False) -> float:
    """The CPU peak for a run in `dtype`, with this process's threads: the best of its dtypes.

    Probed once per process for each dtype and thread count (a process that builds several
    Trainers, a test session or a notebook, pays the 1-2 s once); `fresh` probes again and returns
    that reading (a benchmark setting steps against the machine of the moment). The value kept is
    the best reading so far: a probe disturbed by other work reads low, never high.
    """
    key = (dtype, torch.get_num_threads())
    if fresh or key not in _measured:
        reading = max(measure_matmul_flops(probe_dtype) for probe_dtype in {dtype, torch.float32})
        _measured[key] = max(reading, _measured.get(key, 0.0))
        if fresh:
            return reading
    return _measured[key]


def peak_covering(peak: float | None, achieved: float, device_type: str, dtype: torch.dtype) -> float | None:
    """The peak to divide `achieved` FLOP/s by. A CPU probe that ran while other processes held the
    cores reads low, so a window that beats it triggers a new probe (this process's threads) and the
    better of the two is kept. A run still above the new peak has wrong FLOP accounting, and its MFU
    above 100% is left visible rather than clipped."""
    if peak is None or device_type != "cpu" or achieved <= peak:
        return peak
    return max(peak, cpu_peak_flops(dtype, fresh=True))


def host_peak_flops(device: Device, dtype: torch.dtype, fresh: bool = False) -> float | None:
    """Peak FLOP/s of one device for a run that computes in `dtype`; None when unknown. On the CPU,
    `fresh` probes again rather than reusing this process's best reading (`cpu_peak_flops`).

    On the CPU with torch.distributed initialised this is a collective: every rank must call it.
    """
    if device.type != "cpu":
        # The table lists bf16 tensor-core peaks; an fp32 run against them would report a
        # meaningless MFU, and fp32 peaks on TPU depend on the matmul precision mode.
        return table_peak_flops(device.name()) if dtype == torch.bfloat16 else None
    return once_per_host(lambda: cpu_peak_flops(dtype, fresh))


def once_per_host(probe: Callable[[], float]) -> float:
    """`probe()` as measured on this host with this rank's thread count.

    Single process: just probes. Under torch.distributed the lowest rank of each host probes, once
    for each thread count the ranks of its host use, while the others wait in the collective that
    then shares the numbers; ranks on different hosts probe at the same time.
    """
    threads = torch.get_num_threads()
    if not (dist.is_available() and dist.is_initialized()):
        return probe()
    host = socket.gethostname()
    members: list[tuple[str, int]] = [("", 0)] * dist.get_world_size()
    dist.all_gather_object(members, (host, threads))
    rank = dist.get_rank()
    prober = min(r for r, (member_host, _) in enumerate(members) if member_host == host)
    measured: dict[int, float] = {}
    if rank == prober:
        for count in sorted({t for member_host, t in members if member_host == host}):
            torch.set_num_threads(count)
            measured[count] = probe()
        torch.set_num_threads(threads)
    shared: list[tuple[str, dict[int, float]] | None] = [None] * len(members)
    dist.all_gather_object(shared, (host, measured) if rank == prober else None)
    return next(entry[1][threads] for entry in shared if entry is not None and entry[0] == host)
