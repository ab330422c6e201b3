"""Host lists to device tensors without waiting for the device.

`torch.tensor(values, device="cuda")` copies from pageable memory and then synchronises the
stream, so every small index list a decode step builds (rows, positions, lengths) would make the
host wait until all queued GPU work has finished: the device then idles while the host prepares
the next step. Staging the list in pinned memory and copying with `non_blocking=True` keeps the
copy in stream order without a wait; torch's pinned-memory allocator keeps the staging block
alive until the copy has run. On the CPU this is the plain `torch.tensor`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor


def to_device(
    values: Sequence[Any] | Tensor,
    device: torch.device,
    dtype: torch.dtype = torch.long,
) -> Tensor:
    """`values` (a (nested) list, or a CPU tensor) as a `dtype` tensor on `device`, queued without a
    host-device sync."""
    if device.type != "cuda":
        return torch.as_tensor(values, dtype=dtype, device=device)
    staged = torch.as_tensor(values, dtype=dtype).pin_memory()
    return staged.to(device, non_blocking=True)
