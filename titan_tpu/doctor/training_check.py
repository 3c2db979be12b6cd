"""Ten steps of the debug model (llama3_debug) on the device against the same ten steps on the CPU
in float32, on the same layout.

Both runs read the same data and start from the same weights (the init is seeded and the same for
every layout), and use the same kernels (SDPA, one loss chunk budget), so only the device and its
dtype differ. Tolerance, the largest relative difference of a step's loss:

- float32 on the device: 1e-3. The same arithmetic in another order (other kernels, another
  reduction tree) differs by about 1e-6 per step; ten AdamW steps amplify that, but by far less than
  1e-3 (two float32 runs on this CPU agree exactly). A real bug (a wrong kernel, a dropped gradient
  shard, a mis-scaled loss) moves the loss by percents.
- bfloat16 on the device: 3e-2. bf16 keeps 8 bits of mantissa (2^-8 ~ 4e-3 per rounding); the
  losses of a bf16 run drift from float32's by tenths of a percent over ten steps (0.08% at
  --quick sizes, 0.33% at the default ones, on an AVX512-BF16 EPYC); 3% leaves room for another
  device's rounding without letting a broken step through (a reference at ten times the learning
  rate is 14% off by the tenth step).
"""

from __future__ import annotations

import tempfile

import torch

from titan_tpu.config import ConfigError, load_config
from titan_tpu.device.dtype import dtype_name
from titan_tpu.device.select import Device
from titan_tpu.doctor.rows import Row, error_verdict
from titan_tpu.doctor.sizes import Sizes
from titan_tpu.training.trainer import Trainer

STEPS = 10
CONFIG = "llama3_debug"
# Pinned kernels (no start-up measurement; both runs the same) and nothing written but the config.
COMMON = (
    f"--training.steps={STEPS}",
    "--metrics.log_freq=1",
    "--metrics.plot_loss=false",
    "--model.attention_block=0",
    "--model.overrides.loss_chunk_elements=67108864",
)
# How the reference runs. A module-level tuple, so a test can break the reference (a negative control
# for the comparison).
REFERENCE = ("--device.type=cpu", "--training.dtype=float32")
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 3e-2}


def _losses(overrides: list[str]) -> list[float]:
    with tempfile.TemporaryDirectory(prefix="titan-doctor-") as folder:
        trainer = Trainer(load_config(CONFIG, [*overrides, f"--job.dump_folder={folder}"]))
        return [record.loss for record in trainer.train()]


def training_row(device: Device, dtype: torch.dtype, sizes: Sizes, overrides: list[str]) -> Row:
    """Every rank calls it (the runs are distributed as training is). `overrides`: the doctor's
    train.py-style options (the layout), applied to both runs."""
    base = [*COMMON, *sizes.training_overrides, *overrides]
    name = f"{CONFIG} {STEPS} steps"
    try:
        on_device = _losses([*base, f"--device.type={device.type}", "--training.dtype=auto"])
        reference = _losses([*base, *REFERENCE])
    except ConfigError as error:
        return Row("training", name, None, None, "", "unavailable", f"this layout does not train it: {error}")
    differences = [abs(a - b) / abs(b) for a, b in zip(on_device, reference)]
    rel_error = max(differences) if len(on_device) == len(reference) == STEPS else float("inf")
    verdict, reason = error_verdict(rel_error, TOLERANCE[dtype])
    return Row(
        "training",
        name,
        rel_error,
        TOLERANCE[dtype],
        "rel. error",
        verdict,
        f"losses on {device.type} in {dtype_name(dtype)} against the CPU in float32, largest step "
        f"difference: {reason}; "
        f"last loss {on_device[-1]:.4f} vs {reference[-1]:.4f}",
    )
