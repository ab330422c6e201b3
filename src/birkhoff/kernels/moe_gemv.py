"""MoE decode for a few token rows: routing, then gather-and-gemv over the picked experts only
(`birkhoff::moe_route`, `birkhoff::moe_experts`).

Legend: X token rows (a chunk's positions flattened), D model dim, E experts, F expert hidden
(2F: gate and up rows fused), FS the shared experts' hidden width.

A routed expert costs what a dense gemv of its size costs: its [2F, D] and [D, F] rows are
streamed once for all rows that picked it, no padding to every expert, no sort, no host sync,
static shapes (CUDA-graph capturable). Three launches a layer: routing (a program a row), up
(a program per (expert, F tile) and per shared F tile; unpicked experts return at once) and down
(a program per D tile: the gated sum over the picked experts plus the shared expert, in fp32,
rounded once). Block-fp8 stacks are decoded in registers. Details: docs/moe.md. Many rows stay
with the grouped GEMMs (`serves`). Left out: expert-parallel layouts, router fused into up.
"""

from __future__ import annotations

import torch
from torch import Tensor

from birkhoff.kernels.common import cdiv, check_inputs, pow2, tl, triton


@triton.jit
def moe_route_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    idx_ptr,
    gates_ptr,
    D,
    E,
    route_scale,
    TOP_K: tl.constexpr,
    EB: tl.constexpr,
    BK: tl.constexpr,
):
    """Row program_id(0): idx[row, :TOP_K] and gates[row, :TOP_K] (module docstring)."""
    row = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, EB)
    e_ok = e < E
    acc = tl.zeros([EB], dtype=tl.float32)
    for k0 in range(0, D, BK):
        k = k0 + tl.arange(0, BK)
        k_ok = k < D
        x = tl.load(x_ptr + row * D + k, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(
            w_ptr + e[:, None] * D + k[None, :], mask=e_ok[:, None] & k_ok[None, :], other=0.0
        ).to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
    scores = tl.sigmoid(acc)
    rank = scores + tl.load(b_ptr + e, mask=e_ok, other=0.0).to(tl.float32)
    rank = tl.where(e_ok, rank, float("-inf"))
    slot = tl.full([EB], -1, dtype=tl.int32)  # the slot an expert was picked for, -1: none
    for j in tl.static_range(TOP_K):
        best = tl.argmax(rank, axis=0)
        tl.store(idx_ptr + row * TOP_K + j, best.to(tl.int64))
        slot = tl.where(e == best, j, slot)
        rank = tl.where(e == best, float("-inf"), rank)
    total = tl.sum(tl.where(slot >= 0, scores, 0.0), axis=0)
    for j in tl.static_range(TOP_K):
        gate = tl.sum(tl.where(slot == j, scores, 0.0), axis=0) / total * route_scale
        tl.store(gates_ptr + row * TOP_K + j, gate)


@triton.jit
def _picked(idx_ptr, e, X, TOP_K: tl.constexpr, XB: tl.constexpr, KB: tl.constexpr):
    """[XB, KB] mask of the (row, slot) pairs routed to expert `e`."""
    r = tl.arange(0, XB)
    j = tl.arange(0, KB)
    ok = (r[:, None] < X) & (j[None, :] < TOP_K)
    ids = tl.load(idx_ptr + r[:, None] * TOP_K + j[None, :], mask=ok, other=-1)
    return ok & (ids == e)


@triton.jit
def moe_up_kernel(
    x_ptr,
    idx_ptr,
    w_ptr,
    s_ptr,
    sw_ptr,
    ss_ptr,
    h_ptr,
    X,
    D,
    E,
    F,
    FS,
    HW,
    stride_we,
    stride_se,
    stride_sr,
    stride_ssr,
    TOP_K: tl.constexpr,
    XB: tl.constexpr,
    KB: tl.constexpr,
    BF: tl.constexpr,
    BK: tl.constexpr,
    SB: tl.constexpr,
    SCALED: tl.constexpr,
):
    """h[row, slot * F + f] = silu(gate_f) * up_f of the slot's expert; h[row, TOP_K * F + f]
    the same of the shared experts (FS > 0). Rows of h are HW = TOP_K * F + FS wide."""
    pid = tl.program_id(0)
    tiles = tl.cdiv(F, BF)
    r = tl.arange(0, XB)
    j = tl.arange(0, KB)
    if pid < E * tiles:  # a routed expert's tile
        e = pid // tiles
        f = (pid % tiles) * BF + tl.arange(0, BF)
        sel = _picked(idx_ptr, e, X, TOP_K, XB, KB)
        rows_ok = tl.max(sel.to(tl.int32), axis=1) > 0
        slot = tl.sum(tl.where(sel, j[None, :], 0), axis=1)
        width = F
        w_rows = w_ptr + tl.cast(e, tl.int64) * stride_we
        scales = s_ptr + tl.cast(e, tl.int64) * stride_se
        stride_s = stride_sr
        h_cols = slot[:, None] * F + f[None, :]
    else:  # the shared experts' tile
        f = (pid - E * tiles) * BF + tl.arange(0, BF)
        rows_ok = r < X
        width = FS
        w_rows = sw_ptr
        scales = ss_ptr
        stride_s = stride_ssr
        h_cols = TOP_K * F + f[None, :] + 0 * r[:, None]
    f_ok = f < width
    if tl.max(rows_ok.to(tl.int32), axis=0) > 0:  # an expert no row picked reads nothing
        gate = tl.zeros([XB, BF], dtype=tl.float32)
        up = tl.zeros([XB, BF], dtype=tl.float32)
        for k0 in range(0, D, BK):
            k = k0 + tl.arange(0, BK)
            k_ok = k < D
            xm = rows_ok[:, None] & k_ok[None, :]
            x = tl.load(x_ptr + r[:, None] * D + k[None, :], mask=xm, other=0.0).to(tl.float32)
            wm = f_ok[:, None] & k_ok[None, :]
            wg = tl.load(w_rows + f[:, None].to(tl.int64) * D + k[None, :], mask=wm, other=0.0)
            wu = tl.load(
                w_rows + (f[:, None] + width).to(tl.int64) * D + k[None, :], mask=wm, other=0.0
            )
            wg = wg.to(tl.float32)
            wu = wu.to(tl.float32)
            if SCALED:  # weight = code * its block's fp32 scale
                sc = scales + (k // SB)[None, :]
                wg *= tl.load(sc + (f // SB)[:, None] * stride_s, mask=wm, other=0.0)
                wu *= tl.load(sc + ((f + width) // SB)[:, None] * stride_s, mask=wm, other=0.0)
            gate += tl.sum(x[:, None, :] * wg[None, :, :], axis=2)
            up += tl.sum(x[:, None, :] * wu[None, :, :], axis=2)
        h = gate * tl.sigmoid(gate) * up
        out = h_ptr + r[:, None] * HW + h_cols
        tl.store(out, h.to(h_ptr.dtype.element_ty), mask=rows_ok[:, None] & f_ok[None, :])


@triton.jit
def _down_part(
    h_ptr,
    w_rows,
    scales,
    stride_s,
    r,
    rows_ok,
    h_col0,
    d,
    d_ok,
    width,
    HW,
    SB: tl.constexpr,
    SCALED: tl.constexpr,
    XB: tl.constexpr,
    BD: tl.constexpr,
    BF: tl.constexpr,
):
    """sum_f W[d, f] h[row, h_col0[row] + f] for one down matrix W [D, width]: [XB, BD] fp32."""
    acc = tl.zeros([XB, BD], dtype=tl.float32)
    for f0 in range(0, width, BF):
        f = f0 + tl.arange(0, BF)
        f_ok = f < width
        hm = rows_ok[:, None] & f_ok[None, :]
        h = tl.load(h_ptr + r[:, None] * HW + h_col0[:, None] + f[None, :], mask=hm, other=0.0)
        wm = d_ok[:, None] & f_ok[None, :]
        w = tl.load(w_rows + d[:, None].to(tl.int64) * width + f[None, :], mask=wm, other=0.0)
        w = w.to(tl.float32)
        if SCALED:
            w *= tl.load(
                scales + (d // SB)[:, None] * stride_s + (f // SB)[None, :], mask=wm, other=0.0
            )
        acc += tl.sum(h.to(tl.float32)[:, None, :] * w[None, :, :], axis=2)
    return acc


@triton.jit
def moe_down_kernel(
    h_ptr,
    idx_ptr,
    gates_ptr,
    w_ptr,
    s_ptr,
    sw_ptr,
    ss_ptr,
    y_ptr,
    X,
    D,
    E,
    F,
    FS,
    HW,
    stride_we,
    stride_se,
    stride_sr,
    stride_ssr,
    TOP_K: tl.constexpr,
    XB: tl.constexpr,
    KB: tl.constexpr,
    BD: tl.constexpr,
    BF: tl.constexpr,
    SB: tl.constexpr,
    SCALED: tl.constexpr,
):
    """y[row, d] = sum_slot gate * (W_down[expert] h[row, slot]) + W_shared_down h[row, shared]."""
    d = tl.program_id(0) * BD + tl.arange(0, BD)
    d_ok = d < D
    r = tl.arange(0, XB)
    j = tl.arange(0, KB)
    acc = tl.zeros([XB, BD], dtype=tl.float32)
    for e in range(E):
        sel = _picked(idx_ptr, e, X, TOP_K, XB, KB)
        if tl.max(tl.max(sel.to(tl.int32), axis=1), axis=0) > 0:
            rows_ok = tl.max(sel.to(tl.int32), axis=1) > 0
            slot = tl.sum(tl.where(sel, j[None, :], 0), axis=1)
            gm = (r[:, None] < X) & (j[None, :] < TOP_K)
            g = tl.load(gates_ptr + r[:, None] * TOP_K + j[None, :], mask=gm, other=0.0)
            gate = tl.sum(tl.where(sel, g, 0.0), axis=1)
            part = _down_part(
                h_ptr,
                w_ptr + tl.cast(e, tl.int64) * stride_we,
                s_ptr + tl.cast(e, tl.int64) * stride_se,
                stride_sr,
                r,
                rows_ok,
                slot * F,
                d,
                d_ok,
                F,
                HW,
                SB,
                SCALED,
                XB,
                BD,
                BF,
            )
            acc += part * gate[:, None]
    if FS > 0:
        rows_ok = r < X
        acc += _down_part(
            h_ptr,
            sw_ptr,
            ss_ptr,
            stride_ssr,
            r,
            rows_ok,
            TOP_K * F + 0 * r,
            d,
            d_ok,
            FS,
            HW,
            SB,
            SCALED,
            XB,
            BD,
            BF,
        )
    out = y_ptr + r[:, None] * D + d[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=(r < X)[:, None] & d_ok[None, :])


MAX_ROWS = 8
# launch shapes (BF / BD: output features a program; BK / BF: the reduction tile, shrunk with
# the rows so a [rows, out, reduction] product stays ~4K elements a program)
CONFIG = {
    "up": dict(BF=4, BK=1024, num_warps=2),
    "down": dict(BD=4, BF=1024, num_warps=2),
    "route": dict(BK=256, num_warps=4),
}


def serves(rows: int) -> bool:
    """Whether gather-and-gemv is the MoE path for `rows` token rows (else the grouped GEMMs)."""
    return 1 <= rows <= MAX_ROWS


def _reduction_tile(limit: int, rows: int, out: int, size: int) -> int:
    return max(16, min(limit, pow2(size), pow2(max(4096 // (pow2(rows) * out), 16))))


@torch.library.custom_op("birkhoff::moe_route", mutates_args=())
def moe_route(
    x: Tensor, weight: Tensor, bias: Tensor, top_k: int, route_scale: float
) -> tuple[Tensor, Tensor]:
    """(expert ids [X, top_k] int64, gates [X, top_k] fp32) of rows x [X, D] for the router
    weight [E, D] and selection bias [E] (fp32 both): `model.moe.select_experts` of
    `router_scores`, gates times route_scale."""
    check_inputs(x, weight, bias)
    X, D = x.shape
    E = weight.shape[0]
    if weight.shape != (E, D) or bias.shape != (E,) or not 1 <= top_k <= E:
        raise ValueError(
            f"moe_route: x {tuple(x.shape)}, router {tuple(weight.shape)}, bias "
            f"{tuple(bias.shape)}, top_k {top_k}: expected [X, D], [E, D], [E], 1 <= top_k <= E"
        )
    idx = torch.empty(X, top_k, dtype=torch.int64, device=x.device)
    gates = torch.empty(X, top_k, dtype=torch.float32, device=x.device)
    cfg = CONFIG["route"]
    bk = max(16, min(cfg["BK"], pow2(D)))
    moe_route_kernel[(X,)](
        x.contiguous(),
        weight.contiguous(),
        bias.contiguous(),
        idx,
        gates,
        D,
        E,
        float(route_scale),
        TOP_K=top_k,
        EB=pow2(E),
        BK=bk,
        num_warps=cfg["num_warps"],
    )
    return idx, gates


@moe_route.register_fake
def _(x, weight, bias, top_k, route_scale):  # type: ignore[no-untyped-def]
    shape = (x.shape[0], top_k)
    return (x.new_empty(shape, dtype=torch.int64), x.new_empty(shape, dtype=torch.float32))


def _check_scales(name: str, w: Tensor, s: Tensor | None, block: int) -> None:
    fp8 = w.dtype == torch.float8_e4m3fn
    if fp8 != (s is not None):
        raise ValueError(
            f"moe_experts: {name} of {w.dtype} with scale_inv "
            f"{'given' if s is not None else 'missing'}"
        )
    grid = (*w.shape[:-2], cdiv(w.shape[-2], block), cdiv(w.shape[-1], block))
    if s is not None and (tuple(s.shape) != grid or s.dtype != torch.float32):
        raise ValueError(
            f"moe_experts: {name} scale_inv {tuple(s.shape)} {s.dtype}, expected {grid} float32"
        )


def _check_experts(
    x: Tensor,
    idx: Tensor,
    gates: Tensor,
    w_gate_up: Tensor,
    w_down: Tensor,
    shared_gate_up: Tensor | None,
    shared_down: Tensor | None,
) -> None:
    X, D = x.shape
    E, F2, _ = w_gate_up.shape
    if not 1 <= X <= MAX_ROWS:
        raise ValueError(f"moe_experts: {X} rows, serves 1 to {MAX_ROWS}")
    if w_gate_up.shape != (E, F2, D) or F2 % 2 or w_down.shape != (E, D, F2 // 2):
        raise ValueError(
            f"moe_experts: x {tuple(x.shape)}, w_gate_up {tuple(w_gate_up.shape)}, w_down "
            f"{tuple(w_down.shape)}: expected [X, D], [E, 2F, D], [E, D, F]"
        )
    if idx.shape != gates.shape or idx.shape[0] != X or idx.dtype != torch.int64:
        raise ValueError(
            f"moe_experts: ids {tuple(idx.shape)} {idx.dtype}, gates "
            f"{tuple(gates.shape)}: expected [X, top_k] int64 both"
        )
    if (shared_gate_up is None) != (shared_down is None):
        raise ValueError("moe_experts: shared_gate_up and shared_down come together")
    if shared_gate_up is not None and shared_down is not None:
        FS = shared_gate_up.shape[0] // 2
        if shared_gate_up.shape != (2 * FS, D) or shared_down.shape != (D, FS):
            raise ValueError(
                f"moe_experts: shared {tuple(shared_gate_up.shape)} / "
                f"{tuple(shared_down.shape)}, expected [2FS, {D}] / [{D}, FS]"
            )
    for w in (w_gate_up, w_down, shared_gate_up, shared_down):
        if w is not None and (w.device != x.device or not w.is_contiguous()):
            raise ValueError(f"moe_experts: weights must be contiguous on {x.device}")
        if w is not None and w.dtype not in (x.dtype, torch.float8_e4m3fn):
            raise ValueError(f"moe_experts: weight {w.dtype} for x {x.dtype}")


def _check_all_scales(
    w_gate_up: Tensor,
    w_down: Tensor,
    shared_gate_up: Tensor | None,
    shared_down: Tensor | None,
    scales: list[Tensor],
    block: int,
) -> None:
    names = ("w_gate_up", "w_down", "shared_gate_up", "shared_down")
    weights = [
        (n, w)
        for n, w in zip(names, (w_gate_up, w_down, shared_gate_up, shared_down), strict=True)
        if w is not None
    ]
    if scales and len(scales) != len(weights):
        raise ValueError(f"moe_experts: {len(scales)} scales for {len(weights)} weights")
    for i, (name, w) in enumerate(weights):
        _check_scales(name, w, scales[i] if scales else None, block)


@torch.library.custom_op("birkhoff::moe_experts", mutates_args=())
def moe_experts(
    x: Tensor,
    idx: Tensor,
    gates: Tensor,
    w_gate_up: Tensor,
    w_down: Tensor,
    scales: list[Tensor],
    shared_gate_up: Tensor | None = None,
    shared_down: Tensor | None = None,
    block: int = 128,
) -> Tensor:
    """sum_slot gates * SwiGLU_expert(x) + SwiGLU_shared(x) for rows x [X, D], expert ids and
    gates [X, top_k], stacks w_gate_up [E, 2F, D] / w_down [E, D, F] and optional shared
    [2FS, D] / [D, FS]; `scales`: none (weights in x's dtype), or the block-fp8 codes' fp32
    scales, one per weight in the order w_gate_up, w_down, shared (stacks: [E, r / block,
    c / block]). The result [X, D] in x's dtype."""
    check_inputs(x, gates)
    _check_experts(x, idx, gates, w_gate_up, w_down, shared_gate_up, shared_down)
    _check_all_scales(w_gate_up, w_down, shared_gate_up, shared_down, scales, block)
    scaled = len(scales) > 0
    X, D = x.shape
    E, F2, _ = w_gate_up.shape
    F, top_k = F2 // 2, idx.shape[1]
    FS = 0 if shared_gate_up is None else shared_gate_up.shape[0] // 2
    h = x.new_empty(X, top_k * F + FS)
    y = x.new_empty(X, D)
    # stand-ins where a tensor is absent (never read): the same dtype as the tensor it stands
    # for, as a kernel branch merges the two pointers
    s_gu, s_d = (scales[0], scales[1]) if scaled else (x, x)
    ss_gu, ss_d = (scales[2], scales[3]) if scaled and FS else (s_gu, s_d)
    sw_gu = shared_gate_up if shared_gate_up is not None else w_gate_up
    sw_d = shared_down if shared_down is not None else w_down
    up, down = CONFIG["up"], CONFIG["down"]
    x, idx, gates = x.contiguous(), idx.contiguous(), gates.contiguous()
    sizes = (X, D, E, F, FS, top_k * F + FS)
    common = dict(SB=block, SCALED=scaled, TOP_K=top_k, XB=pow2(X), KB=pow2(top_k))
    moe_up_kernel[(E * cdiv(F, up["BF"]) + cdiv(FS, up["BF"]),)](
        *(x, idx, w_gate_up, s_gu, sw_gu, ss_gu, h, *sizes),
        *(w_gate_up.stride(0), s_gu.stride(0), s_gu.stride(-2), ss_gu.stride(0)),
        BF=up["BF"],
        BK=_reduction_tile(up["BK"], X, up["BF"], D),
        num_warps=up["num_warps"],
        **common,
    )
    moe_down_kernel[(cdiv(D, down["BD"]),)](
        *(h, idx, gates, w_down, s_d, sw_d, ss_d, y, *sizes),
        *(w_down.stride(0), s_d.stride(0), s_d.stride(-2), ss_d.stride(0)),
        BD=down["BD"],
        BF=_reduction_tile(down["BF"], X, down["BD"], max(F, FS)),
        num_warps=down["num_warps"],
        **common,
    )
    return y


@moe_experts.register_fake
def _(x, idx, gates, w_gate_up, w_down, scales, shared_gate_up=None, shared_down=None, block=128):  # type: ignore[no-untyped-def]
    return x.new_empty(x.shape)
