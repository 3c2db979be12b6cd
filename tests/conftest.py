"""Test-wide set-up.

torch_tpu (installed with the `tpu` extra) starts libtpu at the first device query or backward pass;
on a machine without TPUs libtpu would spend minutes asking a cloud metadata server for chips. The
device layer switches that lookup off for runs; the tests do the same before anything touches a
device (the environment is inherited by the multi-process tests' workers).
"""

from titan_tpu.device.tpu_runtime import skip_tpu_metadata_lookup_without_chips

skip_tpu_metadata_lookup_without_chips()
