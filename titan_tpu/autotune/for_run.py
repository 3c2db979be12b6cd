"""The kernels of one training run: what the config forces, and the rest measured (`choose.py`)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

from titan_tpu.autotune.cache import KernelCache, cache_folder
from titan_tpu.autotune.choose import KernelChoice, choose_kernels, fallback_kernels
from titan_tpu.config import ConfigError, TrainConfig
from titan_tpu.device import Device
from titan_tpu.protocols.tunable import KernelShape, Tunable

logger = logging.getLogger(__name__)


def choose_run_kernels(
    tunables: Sequence[Tunable],
    args: Any,
    shape: KernelShape,
    device: Device,
    config: TrainConfig,
    log: bool,
    measure: bool = True,
) -> tuple[Any, list[KernelChoice]]:
    """`args` with every kernel the config leaves to "auto" measured at this rank's shapes (or read
    from the cache), the same on every rank, and the choices; `log`: this rank writes their lines.
    `measure=False` takes each tunable's fallback without a collective (the dry run).
    A chosen kernel that runs a device op gets the op beside it (`Tunable.bind_device_op`); one the
    config forces on a device without its op is a ConfigError."""
    # The experts' ragged matmul is the device's too; None off TPU, where ragged_dot is no candidate.
    shape = dataclasses.replace(shape, ragged_dot_op=device.ragged_dot_op())
    if device.type == "tpu" and shape.splash_op is None:
        # torch_tpu's splash kernel is a Pallas kernel and needs jax, which the tpu extra leaves out.
        logger.warning("attention: splash needs jax (pip install jax); not a candidate")
    # Once before measuring, so that a forced kernel this device cannot run costs no measurement;
    # once after, for the kernels measurement chose.
    args = _bind_device_ops(tunables, args, shape)
    if not measure:
        args, choices = fallback_kernels(tunables, args, shape)
    else:
        args, choices = choose_kernels(
            tunables,
            args,
            shape,
            device.name(),
            deterministic=config.training.deterministic,
            cache=KernelCache(cache_folder()),
            synchronize=device.synchronize,
        )
    args = _bind_device_ops(tunables, args, shape)
    if log:
        for choice in choices:
            logger.info(choice.describe())
    return args, choices


def _bind_device_ops(tunables: Sequence[Tunable], args: Any, shape: KernelShape) -> Any:
    for tunable in tunables:
        if tunable.bind_device_op is not None:
            try:
                args = tunable.bind_device_op(args, shape)
            except ValueError as e:
                raise ConfigError(str(e)) from None
    return args
