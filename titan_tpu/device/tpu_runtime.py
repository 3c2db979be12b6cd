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

Processes that import torch before any project code runs (torchrun's agent, which passes its
environment on to the workers; a user's own script) are reached by a startup hook: a `.pth` file in
the environment's site-packages, whose one line Python's `site` runs at every interpreter start and
which calls `skip_tpu_backend_without_chips`. scripts/_venv.sh installs it (`install_startup_hook`);
the line does nothing once titan_tpu is uninstalled.
"""

from __future__ import annotations

import glob
import os

AUTOLOAD_VARIABLE = "TORCH_DEVICE_BACKEND_AUTOLOAD"
SKIP_METADATA_VARIABLE = "TPU_SKIP_MDS_QUERY"
TPU_DEVICE_FILES = ("/dev/accel[0-9]*", "/dev/vfio/[0-9]*")
# Sorted after setuptools' `__editable__.*.pth`, so that an editable install's finder is in place.
STARTUP_HOOK_FILE = "titan_tpu_startup.pth"
# `site` runs a .pth line that starts with "import"; it must stay one line.
STARTUP_HOOK_LINE = (
    "import importlib.util; importlib.util.find_spec('titan_tpu') is not None and "
    "__import__('titan_tpu.device.tpu_runtime').device.tpu_runtime.skip_tpu_backend_without_chips()"
)


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


def install_startup_hook(site_packages: str | None = None) -> str:
    """Write the startup hook into `site_packages` (default: this interpreter's); returns its path."""
    import sysconfig  # here: every interpreter start imports this module, and only the set-up calls this

    path = os.path.join(site_packages or sysconfig.get_path("purelib"), STARTUP_HOOK_FILE)
    with open(path, "w", encoding="utf-8") as hook:
        hook.write(STARTUP_HOOK_LINE + "\n")
    return path
