"""The fused mHC projection's backward products: g_x and g_phi.

Legend: N tokens (B*T flattened), S streams, D model dim, C = S*D, P logits a token (PP: padded
to a power of two >= 16); g_raw [N, P] is the gradient of the raw logits x @ phi^T.

- `grad_x`: g_x = g_raw @ phi + the RMS term (+ the mix in's h g_y, + mix out's residual-path
  g_x), written once; exact fp32 FMAs, or three bf16 dots of split operands on bf16 streams.
  With PHI it also forms g_phi's partials from the same x tiles (`phi_in_grad_x`).
- `grad_phi`: g_phi = g_raw^T @ x as partials over blocks of tokens (when grad_x did not).
torch sums the partials in a fixed order (no atomics).
"""

from __future__ import annotations

import torch
from torch import Tensor

from birkhoff.kernels.common import INTERPRET, cdiv, tl, triton
from birkhoff.kernels.fused_op import traceable
from birkhoff.kernels.mhc.configs import Launch, launch, padded_logits
from birkhoff.kernels.mhc.phi import dot_bf16, projection_phi, split3


@triton.jit
def grad_x(
    graw_ptr,
    phi_ptr,
    x_ptr,
    coef_ptr,
    gx_ptr,
    gy_ptr,
    h_ptr,
    gr_ptr,
    gphi_ptr,
    N,
    C,
    D,
    S,
    TOKENS,
    P: tl.constexpr,
    PP: tl.constexpr,
    PREC: tl.constexpr,
    MIX: tl.constexpr,
    RES: tl.constexpr,
    WHOLE: tl.constexpr,
    PHI: tl.constexpr,
    BN: tl.constexpr,
    BC: tl.constexpr,
    EMU: tl.constexpr,
):
    """g_x = g_raw @ phi + coef * x (+ h[j] g_y for the mix in y = sum_j h[j] x_j when MIX;
    column c is stream j = c // D; + g_r, the streams' gradient from the residual path of mix
    out, when RES) over BC columns of TOKENS tokens, BN at a time, written once in the dtype of
    x. The product has only P terms: PREC "fma" runs them as exact fp32 FMAs (phi fp32 [P, C]),
    one term a loop step; "bf16x3" (bf16 x, whose g_x is written in bf16) as the three largest
    products of g_raw and phi split into bf16 terms (~2^-15 relative; phi as `phi_pad_t`'s
    three terms [3, C, PP]), one [BN, PP] x [PP, BC] tensor-core dot each, phi's tiles loaded
    once per program. PHI (bf16x3 only): also grad_phi's partial g_phi = g_raw^T x over the
    program's tokens and columns, from the x tiles it reads anyway (`grad_phi`'s arithmetic:
    three exact bf16 dots of x as stored and g_raw's terms), into gphi [N / TOKENS, PP, C]."""
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    q = tl.arange(0, PP)
    c_ok = c < C
    args = (graw_ptr, phi_ptr, x_ptr, coef_ptr, gx_ptr, gy_ptr, h_ptr, gr_ptr, N, C, D, S, c, q)
    if PREC == "fma":  # one block of BN tokens a program (a loop around it costs registers)
        _grad_x_rows(
            tl.program_id(0) * BN,
            *args,
            0.0,
            0.0,
            0.0,
            P,
            PREC,
            MIX,
            RES,
            WHOLE,
            False,
            BN,
            BC,
            EMU,
        )
    else:
        tile = phi_ptr + q[:, None] + c[None, :] * PP
        phi_hi = tl.load(tile, mask=c_ok[None, :], other=0.0)
        phi_mid = tl.load(tile + C * PP, mask=c_ok[None, :], other=0.0)
        acc = tl.zeros([BC, PP], dtype=tl.float32)
        start = tl.program_id(0) * TOKENS
        for n0 in range(start, tl.minimum(start + TOKENS, N), BN):
            acc = _grad_x_rows(
                n0, *args, phi_hi, phi_mid, acc, P, PREC, MIX, RES, WHOLE, PHI, BN, BC, EMU
            )
        if PHI:
            part = gphi_ptr + tl.program_id(0).to(tl.int64) * PP * C
            tl.store(part + q[None, :] * C + c[:, None], acc, mask=c_ok[:, None])


@triton.jit
def _grad_x_rows(
    n0,
    graw_ptr,
    phi_ptr,
    x_ptr,
    coef_ptr,
    gx_ptr,
    gy_ptr,
    h_ptr,
    gr_ptr,
    N,
    C,
    D,
    S,
    c,
    q,
    phi_hi,
    phi_mid,
    acc,
    P: tl.constexpr,
    PREC: tl.constexpr,
    MIX: tl.constexpr,
    RES: tl.constexpr,
    WHOLE: tl.constexpr,
    PHI: tl.constexpr,
    BN: tl.constexpr,
    BC: tl.constexpr,
    EMU: tl.constexpr,
):
    """grad_x's BN tokens from n0 over its columns c; returns acc + their g_raw^T x if PHI."""
    n = n0 + tl.arange(0, BN)
    n_ok = n < N
    n64 = n.to(tl.int64)
    c_ok = c < C
    ok = n_ok[:, None] & c_ok[None, :]
    offs = n64[:, None] * C + c[None, :]
    coef = tl.load(coef_ptr + n, mask=n_ok, other=0.0)
    xv = tl.load(x_ptr + offs, mask=ok, other=0.0)
    g = coef[:, None] * xv.to(tl.float32)
    if RES:
        g += tl.load(gr_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    if PREC == "fma":
        for p in range(P):  # a runtime loop: unrolled, its loads would all be hoisted
            g_p = tl.load(graw_ptr + n64 * P + p, mask=n_ok, other=0.0)
            g += g_p[:, None] * tl.load(phi_ptr + p * C + c, mask=c_ok, other=0.0)[None, :]
    else:
        g_raw = tl.load(
            graw_ptr + n64[:, None] * P + q[None, :],
            mask=n_ok[:, None] & (q < P)[None, :],
            other=0.0,
        )
        g_hi, g_mid, g_lo = split3(g_raw)
        g = dot_bf16(g_hi, phi_hi, g, EMU)
        g = dot_bf16(g_hi, phi_mid, g, EMU)
        g = dot_bf16(g_mid, phi_hi, g, EMU)
        if PHI:
            x_t = tl.trans(xv)
            acc = dot_bf16(x_t, g_hi, acc, EMU)
            acc = dot_bf16(x_t, g_mid, acc, EMU)
            acc = dot_bf16(x_t, g_lo, acc, EMU)
    if MIX:
        if WHOLE:  # BC divides D: the tile's columns all lie in stream c // D
            h = tl.load(h_ptr + n64 * S + tl.program_id(1) * BC // D, mask=n_ok, other=0.0)[:, None]
        else:
            h = tl.load(h_ptr + n64[:, None] * S + (c // D)[None, :], mask=ok, other=0.0)
        gy = tl.load(gy_ptr + n64[:, None] * D + (c % D)[None, :], mask=ok, other=0.0)
        g += h * gy.to(tl.float32)
    tl.store(gx_ptr + offs, g.to(gx_ptr.dtype.element_ty), mask=ok)
    return acc


@triton.jit
def grad_phi(
    graw_ptr,
    x_ptr,
    gphi_ptr,
    N,
    C,
    TOKENS,
    P: tl.constexpr,
    PP: tl.constexpr,
    SPLIT: tl.constexpr,
    PREC: tl.constexpr,
    TRANS: tl.constexpr,
    BN: tl.constexpr,
    BC: tl.constexpr,
    EMU: tl.constexpr,
):
    """This program's partial g_phi = g_raw^T @ x over its TOKENS tokens and BC columns, a
    [PP, BC] block of gphi [N / TOKENS, PP, C] (the caller sums the blocks in a fixed order, so
    g_phi is deterministic). SPLIT (bf16 x): g_raw is the sum of three bf16 terms (24
    significant bits, as fp32), each a bf16 tensor-core dot with x as stored, whose products are
    exact and accumulate in fp32; otherwise x in fp32 and a PREC dot. TRANS: the product as
    g_phi^T = x^T @ g_raw ([BC, PP], x's columns the dot's rows, for wider tensor-core tiles)."""
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    p = tl.arange(0, PP)
    acc = tl.zeros([BC, PP] if TRANS else [PP, BC], dtype=tl.float32)
    start = tl.program_id(0) * TOKENS
    for n0 in range(start, tl.minimum(start + TOKENS, N), BN):
        n = n0 + tl.arange(0, BN)
        n_ok = n < N
        n64 = n.to(tl.int64)
        g = tl.load(
            graw_ptr + n64[:, None] * P + p[None, :],
            mask=n_ok[:, None] & (p < P)[None, :],
            other=0.0,
        )
        xv = tl.load(
            x_ptr + n64[:, None] * C + c[None, :], mask=n_ok[:, None] & (c < C)[None, :], other=0.0
        )
        if TRANS:
            x_t = tl.trans(xv)
            if SPLIT:
                terms = split3(g)
                for t in tl.static_range(3):
                    acc = dot_bf16(x_t, terms[t], acc, EMU)
            else:
                acc = tl.dot(x_t.to(tl.float32), g, acc, input_precision=PREC)
        else:
            g_t = tl.trans(g)
            if SPLIT:
                terms = split3(g_t)
                for t in tl.static_range(3):
                    acc = dot_bf16(terms[t], xv, acc, EMU)
            else:
                acc = tl.dot(g_t, xv.to(tl.float32), acc, input_precision=PREC)
    part = gphi_ptr + tl.program_id(0).to(tl.int64) * PP * C
    if TRANS:
        tl.store(part + p[None, :] * C + c[:, None], acc, mask=(c < C)[:, None])
    else:
        tl.store(part + p[:, None] * C + c[None, :], acc, mask=(c < C)[None, :])


def phi_in_grad_x(cfg: Launch, x_BTSD: Tensor, PP: int) -> bool:
    """Whether grad_x (launched with `cfg`) computes g_phi in its pass over x, so grad_phi does
    not run: CONFIG's PHI, on its bf16x3 path (bf16 streams), up to 32 padded logits (a
    sublayer at S <= 4, the output contraction; a sublayer at S = 8 has 128, where its
    [BC, 128] accumulator and g_raw's third term spill)."""
    bf16 = cfg["PREC"] == "bf16x3" and x_BTSD.dtype == torch.bfloat16
    return bool(cfg.get("PHI", False)) and bf16 and PP <= 32


def projection_grads(
    g_raw: Tensor,
    phi_PC: Tensor,
    x_BTSD: Tensor,
    coef_BT: Tensor,
    g_x: Tensor,
    g_y: Tensor | None,
    pre: Tensor,
    g_r: Tensor | None,
) -> Tensor:
    """g_phi [P, C] in phi's dtype; writes g_x (the projection's and the RMS term's, + h g_y
    with a mix in's g_y, + g_r, mix out's residual-path gradient) in one pass."""
    (S, D), N, P = x_BTSD.shape[-2:], coef_BT.numel(), g_raw.shape[-1]
    C, PP = S * D, padded_logits(P)
    mix, res = g_y is not None, g_r is not None
    cfg = launch("grad_x", x_BTSD, S)
    tokens = int(cfg.pop("TOKENS", cfg["BN"]))
    if cfg["PREC"] == "fma":  # one block of BN tokens a program (the kernel's fma branch)
        tokens = int(cfg["BN"])
    grid = (cdiv(N, tokens), cdiv(C, int(cfg["BC"])))
    bf16x3 = cfg["PREC"] == "bf16x3"
    phi = projection_phi(phi_PC, 3) if bf16x3 else phi_PC.float().contiguous()
    with_phi = phi_in_grad_x(cfg, x_BTSD, PP)
    cfg.pop("PHI", None)
    partials = g_raw.new_empty((grid[0], PP, C) if with_phi else (1,))
    traceable(grad_x)[grid](
        g_raw,
        phi,
        x_BTSD,
        coef_BT,
        g_x,
        g_raw if g_y is None else g_y,
        pre,
        g_raw if g_r is None else g_r,
        partials,
        N,
        C,
        D,
        S,
        tokens,
        P=P,
        PP=PP,
        MIX=mix,
        RES=res,
        WHOLE=D % int(cfg["BC"]) == 0,
        PHI=with_phi,
        EMU=INTERPRET,
        **cfg,
    )
    if not with_phi:
        cfg = launch("grad_phi", x_BTSD, S)
        tokens = int(cfg.pop("TOKENS"))
        partials = g_raw.new_empty((cdiv(N, tokens), PP, C))  # g_phi per block of tokens
        traceable(grad_phi)[(partials.shape[0], cdiv(C, int(cfg["BC"])))](
            g_raw,
            x_BTSD,
            partials,
            N,
            C,
            tokens,
            P=P,
            PP=PP,
            SPLIT=x_BTSD.dtype == torch.bfloat16,
            EMU=INTERPRET,
            **cfg,
        )
    return partials.sum(0)[:P].to(phi_PC.dtype)
