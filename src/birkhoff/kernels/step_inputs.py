"""A step's chunk inputs as fused forward-only custom ops (`birkhoff::chunk_inputs`, and a
draft depth's `birkhoff::depth_inputs`).

Legend: A rows of the step, T positions a row, B cache rows, N cache positions, K2 rope angles
a token, S streams, D model dim, V vocab.

Eagerly (`engine.step.step_chunk`) a chunk is a handful of small launches: positions, the valid
mask, the slots, two rope table gathers and the tokens' index. `chunk_inputs` writes the same
values in one launch (integer arithmetic, loads and stores: bit for bit). A draft depth also
reads h_{k-1} from its stream buffer, embeds its tokens, normalises both and concatenates them
(the MTP merge before its projection) and finds its last position: `depth_inputs` does all of
it in one launch. The eager ops stay the reference and the CPU path; no host sync, so both run
inside the engine's CUDA graphs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from birkhoff.kernels.common import check_device, check_inputs, pow2, tl, triton
from birkhoff.kernels.sample import check_tokens


@triton.jit
def chunk_inputs_kernel(
    start_ptr,
    end_ptr,
    live_ptr,
    rows_ptr,
    tokens_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    valid_ptr,
    cos_out_ptr,
    sin_out_ptr,
    token_out_ptr,
    T,
    K2,
    stride_tokens,
    trash,
    shift,
    HAS_START: tl.constexpr,
    HAS_END: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
):
    a = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BT + tl.arange(0, BT)
    t_ok = t < T
    p = t.to(tl.int64)
    if HAS_START:
        p += tl.load(start_ptr + a).to(tl.int64)
    valid = (tl.load(live_ptr + a) != 0) & t_ok
    if HAS_END:
        valid = valid & (p < tl.load(end_ptr + a).to(tl.int64))
    slot = tl.where(valid, p, trash)
    row = tl.load(rows_ptr + a).to(tl.int64)
    out = a * T + t
    tl.store(pos_ptr + out, slot, mask=t_ok)
    tl.store(valid_ptr + out, valid, mask=t_ok)
    token = tl.load(
        tokens_ptr + row * stride_tokens + tl.where(valid, p + shift, trash), mask=t_ok, other=0
    )
    tl.store(token_out_ptr + out, token, mask=t_ok)
    j = tl.arange(0, BK)
    ok = t_ok[:, None] & (j < K2)[None, :]
    src = slot[:, None] * K2 + j[None, :]
    dst = out.to(tl.int64)[:, None] * K2 + j[None, :]
    tl.store(cos_out_ptr + dst, tl.load(cos_ptr + src, mask=ok, other=0.0), mask=ok)
    tl.store(sin_out_ptr + dst, tl.load(sin_ptr + src, mask=ok, other=0.0), mask=ok)


POSITIONS = 16  # positions a program, at most


def check_chunk(
    op: str,
    start_A: Tensor | None,
    end_A: Tensor | None,
    live_A: Tensor,
    rows_A: Tensor,
    tokens_BN: Tensor,
    cos_NK2: Tensor,
    sin_NK2: Tensor,
    trash: int,
    T: int,
) -> None:
    """Raise ValueError unless these are a chunk's inputs (`chunk_inputs`' contract)."""
    check_device(live_A)
    A = live_A.shape[0]
    named = (("start", start_A), ("end", end_A), ("rows", rows_A), ("live", live_A))
    for name, t in named:
        if t is not None and (t.shape != (A,) or (name != "live" and t.dtype != torch.long)):
            raise ValueError(
                f"{op}: {name} must be {A} entries"
                f"{'' if name == 'live' else ' of int64'}, got "
                f"{t.dtype}{tuple(t.shape)}"
            )
    if cos_NK2.dim() != 2 or sin_NK2.shape != cos_NK2.shape:
        raise ValueError(
            f"{op}: rope tables {tuple(cos_NK2.shape)} / "
            f"{tuple(sin_NK2.shape)} must be one [N, K2] shape"
        )
    check_tokens(op, tokens_BN, trash, cos_NK2.shape[0])
    if T < 1:
        raise ValueError(f"{op}: T = {T} positions, need >= 1")


@torch.library.custom_op("birkhoff::chunk_inputs", mutates_args=())
def chunk_inputs(
    start_A: Tensor | None,
    end_A: Tensor | None,
    live_A: Tensor,
    rows_A: Tensor,
    tokens_BN: Tensor,
    cos_NK2: Tensor,
    sin_NK2: Tensor,
    trash: int,
    T: int,
    shift: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(slots [A, T] int64, valid [A, T] bool, cos and sin [A, T, K2], tokens [A, T] int64) of
    positions p = start + t (start 0 where None) of cache rows `rows_A`: valid where live != 0
    and p < end (no bound where None); the slot is p where valid, else `trash`; cos, sin: the
    tables' rows at the slots; tokens: tokens_BN[row, p + shift] where valid, else the trash
    slot's. start, end and rows int64 [A]; live any integer or bool [A]."""
    check_chunk(
        "chunk_inputs", start_A, end_A, live_A, rows_A, tokens_BN, cos_NK2, sin_NK2, trash, T
    )
    A, outs = (
        live_A.shape[0],
        _fake(start_A, end_A, live_A, rows_A, tokens_BN, cos_NK2, sin_NK2, trash, T, shift),
    )
    if A:
        K2, BT = cos_NK2.shape[1], min(POSITIONS, pow2(T))
        chunk_inputs_kernel[(A, -(-T // BT))](
            live_A if start_A is None else start_A.contiguous(),
            live_A if end_A is None else end_A.contiguous(),
            live_A.contiguous(),
            rows_A.contiguous(),
            tokens_BN,
            cos_NK2.contiguous(),
            sin_NK2.contiguous(),
            *outs,
            T,
            K2,
            tokens_BN.stride(0),
            trash,
            shift,
            HAS_START=start_A is not None,
            HAS_END=end_A is not None,
            BT=BT,
            BK=max(2, pow2(K2)),
            num_warps=2,
        )
    return outs


@chunk_inputs.register_fake
def _fake(start_A, end_A, live_A, rows_A, tokens_BN, cos_NK2, sin_NK2, trash, T, shift):  # type: ignore[no-untyped-def]  # noqa: E501
    A, K2 = live_A.shape[0], cos_NK2.shape[1]
    slots = rows_A.new_empty((A, T), dtype=torch.long)
    valid = torch.empty_like(slots, dtype=torch.bool)
    angles = [cos_NK2.new_empty((A, T, K2)) for _ in range(2)]
    return slots, valid, *angles, torch.empty_like(slots)


@triton.jit
def depth_inputs_kernel(
    start_ptr,
    end_ptr,
    live_ptr,
    rows_ptr,
    tokens_ptr,
    cos_ptr,
    sin_ptr,
    h_ptr,
    embed_ptr,
    h_norm_ptr,
    e_norm_ptr,
    pos_ptr,
    valid_ptr,
    cos_out_ptr,
    sin_out_ptr,
    merge_ptr,
    last_ptr,
    T,
    K2,
    S,
    D,
    stride_tokens,
    stride_h_row,
    stride_h_slot,
    stride_embed,
    trash,
    shift,
    eps,
    HAS_START: tl.constexpr,
    BK: tl.constexpr,
    BD: tl.constexpr,
):
    """One position a program: its chunk entries, then the MTP merge's input there: RMSNorm of
    each stream of h_{k-1} at the slot and of the embedding of the token (one copy a stream),
    in fp32 as `model.layers.rms_norm` computes them."""
    a = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1)
    start = tl.load(start_ptr + a).to(tl.int64) if HAS_START else a * 0
    end = tl.load(end_ptr + a).to(tl.int64)
    p = start + t
    valid = (tl.load(live_ptr + a) != 0) & (p < end)
    slot = tl.where(valid, p, trash)
    row = tl.load(rows_ptr + a).to(tl.int64)
    out = a * T + t
    tl.store(pos_ptr + out, slot)
    tl.store(valid_ptr + out, valid)
    if t == 0:  # the chunk offset of position end - 1
        tl.store(last_ptr + a, tl.minimum(tl.maximum(end - 1 - start, 0), T - 1))
    j = tl.arange(0, BK)
    ok = j < K2
    tl.store(cos_out_ptr + out * K2 + j, tl.load(cos_ptr + slot * K2 + j, mask=ok), mask=ok)
    tl.store(sin_out_ptr + out * K2 + j, tl.load(sin_ptr + slot * K2 + j, mask=ok), mask=ok)
    token = tl.load(tokens_ptr + row * stride_tokens + tl.where(valid, p + shift, trash))
    d = tl.arange(0, BD)
    d_ok = d < D
    e = tl.load(embed_ptr + token.to(tl.int64) * stride_embed + d, mask=d_ok, other=0.0)
    e = e.to(tl.float32)
    e = e * tl.rsqrt(tl.sum(e * e, axis=0) / D + eps)
    e = (e * tl.load(e_norm_ptr + d, mask=d_ok, other=0.0).to(tl.float32)).to(
        merge_ptr.dtype.element_ty
    )
    w_h = tl.load(h_norm_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
    src = h_ptr + row * stride_h_row + slot * stride_h_slot
    dst = merge_ptr + out * S * 2 * D
    for s in range(S):
        x = tl.load(src + s * D + d, mask=d_ok, other=0.0).to(tl.float32)
        x = x * tl.rsqrt(tl.sum(x * x, axis=0) / D + eps) * w_h
        tl.store(dst + s * 2 * D + d, x.to(merge_ptr.dtype.element_ty), mask=d_ok)
        tl.store(dst + s * 2 * D + D + d, e, mask=d_ok)


def check_merge(
    h_BNSD: Tensor, embed_VD: Tensor, hidden_norm_D: Tensor, embed_norm_D: Tensor, trash: int
) -> None:
    """Raise ValueError unless these are an MTP merge's inputs (`depth_inputs`' contract)."""
    check_inputs(h_BNSD, embed_VD, hidden_norm_D, embed_norm_D)
    if h_BNSD.dim() != 4 or embed_VD.dim() != 2:
        raise ValueError(
            f"depth_inputs: streams {tuple(h_BNSD.shape)} must be [B, N, S, D] and the "
            f"embedding {tuple(embed_VD.shape)} [V, D]"
        )
    N, D = h_BNSD.shape[1], h_BNSD.shape[3]
    if h_BNSD.stride(3) != 1 or h_BNSD.stride(2) != D or trash >= N:
        raise ValueError(
            f"depth_inputs: streams {tuple(h_BNSD.shape)} must hold {trash + 1} slots of "
            f"contiguous [S, D] states, strides {h_BNSD.stride()}"
        )
    if embed_VD.shape[1] != D or embed_VD.stride(1) != 1 or embed_VD.dtype != h_BNSD.dtype:
        raise ValueError(
            f"depth_inputs: embedding {embed_VD.dtype}{tuple(embed_VD.shape)} for streams of "
            f"{h_BNSD.dtype} [.., {D}] (rows must be contiguous)"
        )
    if hidden_norm_D.shape != (D,) or embed_norm_D.shape != (D,):
        raise ValueError(f"depth_inputs: norm weights must be [{D}]")


@torch.library.custom_op("birkhoff::depth_inputs", mutates_args=())
def depth_inputs(
    start_A: Tensor | None,
    end_A: Tensor,
    live_A: Tensor,
    rows_A: Tensor,
    tokens_BN: Tensor,
    cos_NK2: Tensor,
    sin_NK2: Tensor,
    h_BNSD: Tensor,
    embed_VD: Tensor,
    hidden_norm_D: Tensor,
    embed_norm_D: Tensor,
    eps: float,
    trash: int,
    T: int,
    shift: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """A draft depth's inputs in one launch: `chunk_inputs`' slots, valid mask, cos and sin
    (bounded by `end`), the MTP merge's input [A, T, S, 2D] (per stream RMSNorm(h) * hidden_norm
    of h_BNSD[row, slot], then RMSNorm(Emb(token)) * embed_norm, token = tokens_BN[row, p +
    shift] where valid, else the trash slot's: `model.mtp.mtp_merge` before its projection) and
    the offset of position end - 1 in the chunk ([A] int64, clamped to 0..T-1)."""
    check_chunk(
        "depth_inputs", start_A, end_A, live_A, rows_A, tokens_BN, cos_NK2, sin_NK2, trash, T
    )
    check_merge(h_BNSD, embed_VD, hidden_norm_D, embed_norm_D, trash)
    outs = _depth_fake(
        start_A,
        end_A,
        live_A,
        rows_A,
        tokens_BN,
        cos_NK2,
        sin_NK2,
        h_BNSD,
        embed_VD,
        hidden_norm_D,
        embed_norm_D,
        eps,
        trash,
        T,
        shift,
    )
    (A, K2), (S, D) = (live_A.shape[0], cos_NK2.shape[1]), h_BNSD.shape[2:]
    if A:
        depth_inputs_kernel[(A, T)](
            live_A if start_A is None else start_A.contiguous(),
            end_A.contiguous(),
            live_A.contiguous(),
            rows_A.contiguous(),
            tokens_BN,
            cos_NK2.contiguous(),
            sin_NK2.contiguous(),
            h_BNSD,
            embed_VD,
            hidden_norm_D.contiguous(),
            embed_norm_D.contiguous(),
            *outs,
            T,
            K2,
            S,
            D,
            tokens_BN.stride(0),
            h_BNSD.stride(0),
            h_BNSD.stride(1),
            embed_VD.stride(0),
            trash,
            shift,
            eps,
            HAS_START=start_A is not None,
            BK=max(2, pow2(K2)),
            BD=max(16, pow2(D)),
            num_warps=4,
        )
    return outs


@depth_inputs.register_fake
def _depth_fake(start_A, end_A, live_A, rows_A, tokens_BN, cos_NK2, sin_NK2, h_BNSD, *rest):  # type: ignore[no-untyped-def]  # noqa: E501
    T = rest[-2]
    slots, valid, cos, sin, _ = _fake(
        start_A, end_A, live_A, rows_A, tokens_BN, cos_NK2, sin_NK2, 0, T, 0
    )
    A, (S, D) = live_A.shape[0], h_BNSD.shape[2:]
    merge = h_BNSD.new_empty((A, T, S, 2 * D))
    return slots, valid, cos, sin, merge, torch.empty_like(slots[:, 0])
