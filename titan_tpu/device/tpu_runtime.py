"""Keep the TPU runtime from searching for chips on hosts that have none.

With torch_tpu installed, `import torch` loads it, and the first device query (torch.accelerator, or
the autograd engine at the first backward pass) starts libtpu. On a host that is not a Cloud TPU VM,
libtpu then asks the GCE metadata server for the TPU environment, 30 tries per key: measured here,
one tiny backward pass took 2 minutes, and a test suite stalls. Where no TPU device file exists
(`/dev/accel*` on v4/v5e, `/dev/vfio/<group>` on v5p/v6e/v7), the metadata lookup cannot find a chip
either, so it is switched off (`TPU_SKIP_MDS_QUERY`) and libtpu answers "no device" at once. A value
the user set is kept; a TPU VM or GKE TPU pod, which has the device files, is left alone.
"""

from __future__ import annotations

import glob
import os

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
