"""The tiled GEMM under `linear_mix_out` (mix out as a GEMM epilogue): tile order, dot, launch.

Legend: N token rows, Z a GEMM's output columns; `inner` its reduction length.

A [N, Z] GEMM over [BM, BN] output tiles, reduced in BK steps into fp32 accumulators. Programs
run in groups of GROUP_M token blocks over every column block, so the W tiles and the streams'
tiles a group reads stay in L2. fp32 operands take exact "ieee" dots (torch's default fp32
matmul, and what the CPU tests compare with); bf16/fp16 take tensor cores. The Triton
interpreter (3.9) computes bf16 dots wrongly, so under it (EMU) a dot runs in fp32 on the same
bf16 values. (Mix in + RMSNorm is no GEMM prologue: `mix_norm_linear` says why.)
"""

from __future__ import annotations

import torch

from birkhoff.kernels.common import INTERPRET, cdiv, pow2, tl, triton
from birkhoff.kernels.mhc.configs import CONFIG, Launch


@triton.jit
def gemm_tile(N, Z, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """(rows [BM], columns [BN]) of this program's output tile, in grouped order."""
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(N, BM), tl.cdiv(Z, BN)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    return pid_m * BM + tl.arange(0, BM), pid_n * BN + tl.arange(0, BN)


@triton.jit
def dot_acc(a, b, acc, IEEE: tl.constexpr, EMU: tl.constexpr):
    """acc + a @ b in fp32 (a and b of one dtype): exact fp32 products if IEEE."""
    if EMU:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def load_wt(w_ptr, cols, col_ok, k, inner):
    """The [BK, BN] tile W^T[k, cols] of a row-major W [Z, inner]."""
    ok = (k < inner)[:, None] & col_ok[None, :]
    return tl.load(w_ptr + cols.to(tl.int64)[None, :] * inner + k[:, None], mask=ok, other=0.0)


def gemm_launch(N: int, Z: int, inner: int, dtype: torch.dtype) -> tuple[tuple[int], Launch]:
    """(grid, launch parameters) of a folded GEMM: CONFIG["fold_gemm"] (fp32: "_fp32"), its
    tiles shrunk to the problem (>= 16, what tl.dot needs), IEEE and EMU set."""
    fp32 = dtype == torch.float32
    cfg = dict(CONFIG["fold_gemm_fp32" if fp32 else "fold_gemm"])
    cfg["BM"] = min(int(cfg["BM"]), max(16, pow2(N)))
    cfg["BN"] = min(int(cfg["BN"]), max(16, pow2(Z)))
    cfg["BK"] = min(int(cfg["BK"]), max(16, pow2(inner)))
    cfg.update(IEEE=fp32, EMU=INTERPRET)
    return (cdiv(N, int(cfg["BM"])) * cdiv(Z, int(cfg["BN"])),), cfg
