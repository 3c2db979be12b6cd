"""Test-wide set-up.

torch_tpu (installed with the `tpu` extra) is loaded by every `import torch` and starts libtpu at the
first device query or backward pass. On a machine without TPU device files neither can find a chip:
the load costs each test process and worker about 5 s, and libtpu would spend minutes asking a cloud
metadata server for chips. So, before anything here imports torch, both are switched off on such a
machine, as the entry points do (the multi-process tests' workers inherit the environment). Tests of
torch_tpu itself import it explicitly. On a TPU host nothing changes.
"""

import os
import tempfile

from titan_tpu.autotune.cache import CACHE_ENV
from titan_tpu.device.tpu_runtime import skip_tpu_backend_without_chips

skip_tpu_backend_without_chips()

# Measured kernel choices (titan_tpu/autotune/) go to a folder of this session's own, inherited by the
# multi-process tests' workers: the suite neither reads nor fills the user's cache.
os.environ[CACHE_ENV] = tempfile.mkdtemp(prefix="titan_tpu_kernels_")

from collections.abc import Iterator  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture
def one_thread() -> Iterator[None]:
    """The test trains in this process on one intra-op thread; see tests/support/one_thread.py."""
    from tests.support.one_thread import one_intra_op_thread  # here, so collecting torch-free tests loads no torch

    with one_intra_op_thread():
        yield


@pytest.fixture
def fake_world() -> Iterator[int]:
    """A 16-process world in which this process is rank 5 (collectives are no-ops): meshes built
    without processes."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=16)
    try:
        yield 5
    finally:
        dist.destroy_process_group()
