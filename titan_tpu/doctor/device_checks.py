"""The device and how it was found, the dtype decision, matmul FLOP/s, the compile backends."""

from __future__ import annotations

import torch
from torch import nn

from titan_tpu.autotune.measure import tolerance
from titan_tpu.config.errors import ConfigError
from titan_tpu.device.dtype import dtype_name, native_bf16, resolve_compute_dtype
from titan_tpu.device.peak import device_generation, measure_matmul_flops, table_peak_flops
from titan_tpu.device.select import Device, accelerator_type, torch_tpu_version
from titan_tpu.distributed.compile import AUTO_BACKENDS, available_backends, compile_parts, resolve_backend
from titan_tpu.doctor.rows import Row, error_verdict, speed_verdict
from titan_tpu.doctor.sizes import Sizes
from titan_tpu.protocols.tunable import relative_error


def generation_of(device: Device) -> str:
    """The peak table's key for the device ("tpu v6e", "h100"), "cpu", or "unknown"."""
    if device.type == "cpu":
        return "cpu"
    return device_generation(device.name()) or "unknown"


def device_rows(device: Device, requested: str) -> list[Row]:
    found = accelerator_type()
    version = torch_tpu_version()
    how = (
        f"device.type = {requested!r}; torch.accelerator reports {found or 'no accelerator'}; "
        f"torch_tpu {version or 'not installed'}"
    )
    name = device.name()
    generation = generation_of(device)
    reason = "the peak table's entry for the device's name (device/peak.py)"
    if device.type == "cpu":
        reason = "a CPU: its peak is measured (matmul rows), not looked up"
    elif generation == "unknown":
        reason = f"'{name}' is not in the peak table (device/peak.py): no MFU, no planner figures"
    return [
        Row("device", "device", None, None, "", "ok", how, detail=f"{device.type} {name}"),
        Row("device", "generation", None, None, "", "ok", reason, detail=generation),
    ]


def dtype_row(device: Device) -> tuple[Row, torch.dtype]:
    dtype = resolve_compute_dtype("auto", device)
    native = native_bf16(device.type)
    reason = f"bf16 matmuls {'native' if native else 'emulated'} on {device.type}: 'auto' picks {dtype_name(dtype)}"
    return Row("dtype", "compute dtype", None, None, "", "ok", reason, detail=dtype_name(dtype)), dtype


def matmul_rows(device: Device, sizes: Sizes, compute_dtype: torch.dtype) -> list[Row]:
    """bf16 against the peak table on an accelerator. A CPU has no published figure (its peak for
    MFU is this very probe), so there bf16 is held against float32: native bf16 runs at least as
    fast (2x on an AVX512-BF16 EPYC), emulated bf16 at a fraction, and a bf16 decision whose matmuls
    run under half float32's speed is the wrong decision for this machine."""
    size = sizes.matmul_size(device.type)
    measured = {
        dtype: measure_matmul_flops(dtype, device.torch_device, size, 3, sizes.matmul_seconds)
        for dtype in (torch.bfloat16, torch.float32)
    }
    rows = []
    for dtype, flops in measured.items():
        name = f"{dtype_name(dtype)} {size}x{size}"
        expected: float | None = None
        if device.type != "cpu" and dtype == torch.bfloat16:
            expected = table_peak_flops(device.name())
            why = "against the data-sheet peak (device/peak.py)" if expected else "device not in the peak table"
        elif device.type == "cpu" and dtype == torch.bfloat16 and compute_dtype == torch.bfloat16:
            expected = measured[torch.float32]
            why = "against float32's rate: the dtype decision picked bf16, which must not be slower"
        elif device.type == "cpu":
            why = "no published figure for a CPU: this is the peak its MFU divides by"
        else:
            why = "no float32 peak in the table (float32 runs report no MFU on accelerators)"
        verdict, ratio = speed_verdict(flops, expected)
        reason = why if expected is None else f"{ratio} {why}"
        rows.append(
            Row("matmul", name, flops / 1e12, None if expected is None else expected / 1e12, "TFLOP/s", verdict, reason)
        )
    return rows


def compile_rows(device: Device, sizes: Sizes) -> list[Row]:
    """Each backend "auto" resolves to on some device, as `compile.backend` would take it here; with
    `sizes.compile_run`, the device's own backend also compiles a small MLP whose output must match
    eager's."""
    rows = []
    own = AUTO_BACKENDS.get(device.type, "inductor")
    for backend in sorted(set(AUTO_BACKENDS.values())):
        if backend not in available_backends():
            why = "not registered with torch._dynamo here"
            if backend == "tpu":
                why += " (torch_tpu registers it on TPU hosts)"
            rows.append(Row("compile", backend, None, None, "", "unavailable", why))
            continue
        try:
            resolve_backend(backend, device.type)
        except ConfigError as error:
            rows.append(Row("compile", backend, None, None, "", "unavailable", str(error)))
            continue
        if backend != own or not sizes.compile_run:
            reason = "registered with torch._dynamo" + ("" if backend == own else f" (not {device.type}'s 'auto')")
            rows.append(Row("compile", backend, None, None, "", "ok", reason))
            continue
        rows.append(_compile_run(device, backend))
    return rows


def _compile_run(device: Device, backend: str) -> Row:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)).to(device.torch_device)
    x = torch.randn(64, 256, device=device.torch_device)
    try:
        with torch.no_grad():
            want = mlp(x)
            got = compile_parts(mlp, backend)(x)  # whole (fullgraph), in the run's inductor cache
    except Exception as error:  # a backend that fails to compile is broken, whatever it raises
        return Row("compile", backend, None, None, "", "wrong", f"compiling a small MLP failed: {error}"[:200])
    rel_error = relative_error(got, want)
    verdict, reason = error_verdict(rel_error, tolerance(torch.float32))
    return Row(
        "compile",
        backend,
        rel_error,
        tolerance(torch.float32),
        "rel. error",
        verdict,
        f"compiled small MLP against eager: {reason}",
    )
