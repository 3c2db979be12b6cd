"""Which dtype a hand-written kernel computes in when autocast may be on.

Autocast casts the inputs of the ops on its lists; a kernel of our own (an autograd Function, a
grouped matmul) is on none of them, so it asks here and casts its inputs itself.
"""

from __future__ import annotations

import torch


def autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """Autocast's dtype on x's device type when autocast is on there, else None."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None
