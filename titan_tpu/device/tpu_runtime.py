"""Keep torch_tpu and the TPU runtime from starting on hosts that cannot have a TPU.

Where no TPU device file exists (`/dev/accel*` on v4/v5e, `/dev/vfio/<group>` on v5p/v6e/v7), no chip
can be seen, so two start-up costs buy nothing there:

- With torch_tpu installed, `import torch` loads it through torch's backend entry point: about 5 s
  of CPU and several log lines in every process. `TORCH_DEVICE_BACKEND_AUTOLOAD=0` switches that
  off; torch reads it once, while it is imported, so the entry points and the test set-up call
  `skip_tpu_backend_without_chips` before anything imports torch (this module and the
  `titan_tpu.device` package import no torch for that reason). Processes they start inherit it.
- When torch_tpu is loaded anyway (the user asked for it, or a test imports it), the first device
  query starts libtpu, which then asks the GCE metadata server for the TPU environment, 30 tries per
  key: measured here, one tiny backward pass took 2 minutes. `TPU_SKIP_MDS_QUERY` switches that off,
  and libtpu answers "no device" at once.

A value the user set is kept; a TPU VM or GKE TPU pod, which has the device files, is left alone, so
`device.type = "auto"` finds its chips.
"""

from __future__ import annotations

import glob
import os

AUTOLOAD_VARIABLE = "TORCH_DEVICE_BACKEND_AUTOLOAD"
SKIP_METADATA_VARIABLE = "TPU_SKIP_MDS_QUERY"
TPU_DEVICE_FILES = ("/dev/accel[0-9]*", "/dev/vfio/[0-9]*")


def host_has_tpu_device_files() -> bool:
    return any(glob.glob(pattern) for pattern in TPU_DEVICE_FILES)


def skip_tpu_metadata_lookup_without_chips() -> bool:
    """Switch libtpu's metadata lookup off on a host without TPU device files; True when it did.
    Must run before the first device query of the process (libtpu reads it once, at start-up)."""
    if host_has_tpu_device_files() or SKIP_METADATA_VARIABLE in os.environ:
        return False
    os.environ[SKIP_METADATA_VARIABLE] = "1"
    return True


def skip_tpu_backend_without_chips() -> bool:
    """On a host without TPU device files, keep `import torch` from loading torch_tpu (and libtpu
    from the metadata lookup); True when it switched the autoload off. Must run before torch is
    imported; the user's own `TORCH_DEVICE_BACKEND_AUTOLOAD` wins."""
    skip_tpu_metadata_lookup_without_chips()
    if host_has_tpu_device_files() or AUTOLOAD_VARIABLE in os.environ:
        return False
    os.environ[AUTOLOAD_VARIABLE] = "0"
    return True
