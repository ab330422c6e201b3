"""The leak pattern (tensors stashed on a module attribute during recompute) and the census.

The census reports the stash and names its holder; "safe" leaves it intact (the module may read
it), only the unconditional free destroys it under its holder.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from birkhoff.recompute import PeakLiveBytes, census, checkpoint, track_saved_storages


class Stasher(nn.Module):
    """Keeps its latest input on an attribute, like MoE layers that cache dispatched tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8, dtype=torch.float64)
        self.cache: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        self.cache = x  # in the rerun this is an alias of the checkpoint's input storage
        return torch.tanh(self.proj(x))


@pytest.mark.parametrize(("reclaim", "leaked"), [("never", 4096), ("safe", 4096), ("always", 0)])
def test_census_sees_the_stash(reclaim: str, leaked: int) -> None:
    module = Stasher()
    inp = torch.randn(64, 8, dtype=torch.float64, requires_grad=True)
    with track_saved_storages():
        h = inp * 2.0  # [64, 8] fp64 = 4096 bytes, allocated by the forward
        out = checkpoint(module, h, reclaim=reclaim, name="stasher")
        loss = out.sum()
    loss.backward()
    del h, out, loss
    assert module.cache is not None  # the stray reference is still there ...
    found = census(model=module)
    assert found.live_bytes == leaked  # ... it holds the input's storage ...
    assert found.holders == ({"cache": 4096} if leaked else {})  # ... and is named
    if reclaim == "safe":
        assert torch.equal(module.cache, inp.detach() * 2.0)  # and still reads what it held


def test_census_counts_live_forward_storages() -> None:
    leaf = torch.ones(100, requires_grad=True)  # not allocated by the forward: not counted
    with track_saved_storages():
        a = leaf * 2.0  # 400 bytes, kept
        b = a * 3.0  # 400 bytes, dropped below
        s = (a * a).sum()  # MulBackward0 saves `a` (twice): one pending storage
    assert census().pending_storages == 1
    s.backward()
    assert census().pending_storages == 0
    del b
    c = census()
    assert (c.live_bytes, c.live_storages) == (400 + 4, 2)  # a and s
    del s
    a.untyped_storage().resize_(0)
    assert census().live_bytes == 0


def test_peak_live_bytes_sees_frees() -> None:
    with PeakLiveBytes() as tracker:
        a = torch.ones(1000)  # 4000 bytes
        b = a * 2.0  # 8000 live
        del a
        c = b + 1.0  # 8000 live (a died first)
        b.untyped_storage().resize_(0)
        d = c * 1.0  # 8000 live (b freed)
    assert tracker.peak_bytes == 8000
    assert tracker.live_bytes() == 8000
    del c, d
    assert tracker.live_bytes() == 0
