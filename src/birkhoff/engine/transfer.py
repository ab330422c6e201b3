"""Host lists to device tensors, and device results back, without waiting for other work.

`torch.tensor(values, device="cuda")` copies from pageable memory and then synchronises the
stream, so every small index list a decode step builds (rows, positions, lengths) would make the
host wait until all queued GPU work has finished: the device then idles while the host prepares
the next step. Staging the list in pinned memory and copying with `non_blocking=True` keeps the
copy in stream order without a wait; torch's pinned-memory allocator keeps the staging block
alive until the copy has run. On the CPU this is the plain `torch.tensor`.

The other way, `Tensor.tolist()` copies in stream order too: called after the next step has been
queued, it waits for that step as well, and the device then idles while the host does the
bookkeeping of the step it read. `to_host` queues the copy into pinned memory right behind the
work that produced the tensor and records an event; `HostCopy.tolist()` waits for that event
only.
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


def copy_to(dst: Tensor, values: Sequence[Any]) -> None:
    """Queue `values` (a (nested) list of dst's shape) into `dst` without a host-device sync:
    one transfer where `to_device` then `copy_` would be two."""
    staged = torch.as_tensor(values, dtype=dst.dtype)
    dst.copy_(staged.pin_memory() if dst.is_cuda else staged, non_blocking=True)


class HostCopy:
    """A device tensor's values on their way to pinned host memory; `tolist()` waits for them
    (and for the work queued before them), not for anything queued later."""

    def __init__(self, t: Tensor) -> None:
        if t.device.type != "cuda":  # a copy too: t may be a buffer the next step rewrites
            self.host, self.done = t.clone(), None
            return
        self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self.host.copy_(t, non_blocking=True)
        self.done = torch.cuda.Event()
        self.done.record()

    def tolist(self) -> Any:
        if self.done is not None:
            self.done.synchronize()
        return self.host.tolist()


def to_host(t: Tensor) -> HostCopy:
    """Queue `t`'s copy to the host now; read it later with `.tolist()`."""
    return HostCopy(t)
