"""The checkpoint on CUDA: RNG replay, bf16 autocast, memory against torch.utils.checkpoint.

Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as tuc
from torch import Tensor, nn

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from birkhoff.recompute import checkpoint  # noqa: E402


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return x + F.dropout(self.down(F.gelu(self.up(x))), p=0.1, training=True)


def step(kind: str, blocks: nn.ModuleList, x0: Tensor) -> tuple[Tensor, list[Tensor], int]:
    blocks.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch.manual_seed(0)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        h = x0 * 1.0
        for block in blocks:
            if kind == "none":
                h = block(h)
            elif kind == "torch":
                h = tuc.checkpoint(block, h, use_reentrant=False)
            else:
                h = checkpoint(block, h, reclaim=kind)
        loss = h.float().square().mean()
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    return loss.detach(), [p.grad.clone() for p in blocks.parameters()], peak


def test_cuda_parity_and_peak() -> None:
    torch.manual_seed(0)
    blocks = nn.ModuleList(Block(512) for _ in range(6)).cuda()
    x0 = torch.randn(8, 512, 512, device="cuda", requires_grad=True)
    ref_loss, ref_grads, _ = step("none", blocks, x0)
    _, _, torch_peak = step("torch", blocks, x0)
    for kind in ("never", "safe"):
        loss, grads, peak = step(kind, blocks, x0)
        assert torch.equal(loss, ref_loss), kind
        for g, r in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(g, r, rtol=0, atol=0)
        # "safe" lets go of the inputs after the rerun, torch after the checkpoint's last node
        limit = torch_peak if kind == "safe" else 1.01 * torch_peak
        assert peak <= limit, (kind, peak, torch_peak)
