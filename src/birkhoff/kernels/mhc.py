"""Fused mHC ops: torch library ops around the Triton kernels, with autograd.

Legend: B batch, T tokens (any leading shape works), S streams, D model dim, C = S*D,
P coefficient logits.

Public functions mirror the eager ones in `birkhoff.model.hyper` (same arguments, same outputs):
`mhc_coefficients`, `coefficients_and_mix_in`, `contraction_weights`, `contract`, and (from
`mhc_mix`) `mix_in`, `mix_out`. Each runs a `torch.library.triton_op` (`birkhoff::mhc_*`,
`ops.FusedOp`) with `register_autograd`, so torch.compile traces into it without a graph break
and its backward is such an op too; eager code calls them through FusedOp's direct entry.
Tensors the backward needs go through `ctx.save_for_backward` (saved-tensor hooks see them).
The engine's forward-only sublayer entry is `mhc_entry`.

Design choices:
- The projection raw = x @ phi^T (P = 24 at S = 4) runs in the same pass over x as the RMS (on
  the unnormalised streams: the RMS scale is a per-token scalar applied to the logits), on
  tensor cores at ~fp32 accuracy (`mhc_triton`: bf16x3, tf32x3 or ieee by dtype), split over
  column blocks (`coeff_proj`, partial sums) so that decode's few tokens fill the GPU too;
  `coeff_tail` sums the splits in a fixed order and runs the per-token rest. Only x in its own
  dtype is saved, never an fp32 copy. The backward reads x once more on bf16 streams with up
  to 32 padded logits (a sublayer at S <= 4, the output contraction): `grad_x` writes g_x =
  g_raw phi + the RMS term and, from the same x tiles, g_phi = g_raw^T x as partials over
  `CONFIG["grad_x"]["TOKENS"]` tokens (`PHI`, `phi_in_grad_x`); otherwise twice, `grad_phi`
  reducing g_phi over `CONFIG["grad_phi"]["TOKENS"]` tokens. torch sums the partials in a
  fixed order (no atomics).
- One op can also mix in (y = sum_j H_pre[j] x_j, `coefficients_and_mix_in`, `contract`): its
  backward folds g_y into g_H_pre and adds H_pre g_y to grad_x's g_x, so x's gradient from the
  coefficients and the mix in is written once.
- `coefficients_and_mix_in_streams` also returns x, as a view from the same autograd node (a
  `torch.autograd.Function` around the op: a custom op's outputs may not alias its inputs);
  the mix out that reads it sends its g_x to that node, and grad_x adds it too, so x's gradient
  from a whole sublayer is one kernel's write, with no autograd add.
- Launch parameters: `mhc_configs.CONFIG`, read at every call (no `triton.autotune`, whose
  first call syncs inside a graph capture or compiled region).
- Coefficients come out in fp32 (Sinkhorn in bf16 is unstable); the mixes accumulate in fp32
  and cast once to the output dtype (mix_in: the dtype of x; mix_out: promote(x, f)).
- Inputs are made contiguous, except a phi in `served_phi`'s layout (the engine's). fp64 is
  rejected (the kernels compute in fp32). On CPU they run only under the Triton interpreter.
"""

from __future__ import annotations

import torch
from torch import Tensor

from birkhoff.kernels import mhc_grad_triton as G
from birkhoff.kernels import mhc_triton as K
from birkhoff.kernels.mhc_configs import CONFIG, Launch
from birkhoff.kernels.mhc_mix import (
    INTERPRET,
    cdiv,
    check_inputs,
    mix_in,
    mix_in_into,
    mix_in_weight_grad,
    mix_out,
    pad_streams,
    pow2,
)
from birkhoff.kernels.mhc_phi import is_served, padded_logits, projection_phi, served_phi
from birkhoff.kernels.ops import FusedOp, traceable

__all__ = [
    "check_inputs", "coefficients_and_mix_in", "coefficients_and_mix_in_streams", "contract",
    "contraction_weights", "mhc_coefficients", "mix_in", "mix_out", "served_phi",
]  # fmt: skip

# ---- coefficients (+ Sinkhorn) -------------------------------------------------------------


def _pads(S: int, P: int) -> tuple[int, int]:
    """(SP, PP): S padded to a power of two >= 2, P to a power of two >= 16 (tl.dot)."""
    return pad_streams(S), padded_logits(P)


def _launch(name: str, x: Tensor | None = None, S: int = 4) -> Launch:
    """CONFIG[name] (its "_fp32" entry for fp32 streams) for S streams, tuned at S = 4: for
    S > 4 the coefficient kernels' token block shrinks (their Sinkhorn state is BN x SP x SP,
    the projection BN x PP), and so do grad_phi's blocks (accumulator PP x BC, g_raw BN x PP)
    and the columns of coeff_proj's and grad_x's dots (phi tiles PP x BC)."""
    fp32 = x is not None and x.dtype == torch.float32 and f"{name}_fp32" in CONFIG
    cfg = dict(CONFIG[f"{name}_fp32" if fp32 else name])
    if name.startswith("coeff"):
        cfg["BN"] = max(16, int(cfg["BN"]) * 16 // max(16, pad_streams(S) ** 2))
    if name in ("grad_phi", "coeff_proj") or (name == "grad_x" and cfg["PREC"] == "bf16x3"):
        shrink = max(32, _pads(S, S * S + 2 * S)[1]) // 32
        cfg["BC"] = max(16, int(cfg["BC"]) // shrink)
        if name == "grad_phi":
            cfg["BN"] = max(16, int(cfg["BN"]) // shrink)
    return cfg


def phi_in_grad_x(cfg: Launch, x_BTSD: Tensor, PP: int) -> bool:
    """Whether grad_x (launched with `cfg`) computes g_phi in its pass over x, so grad_phi does
    not run: CONFIG's PHI, on its bf16x3 path (bf16 streams), up to 32 padded logits (a
    sublayer at S <= 4, the output contraction; a sublayer at S = 8 has 128, where its
    [BC, 128] accumulator and g_raw's third term spill)."""
    bf16 = cfg["PREC"] == "bf16x3" and x_BTSD.dtype == torch.bfloat16
    return bool(cfg.get("PHI", False)) and bf16 and PP <= 32


def _token_block(cfg: Launch, N: int) -> int:
    """CONFIG's BN tokens per program, cut to the few tokens of a decode call (>= 16 rows, what
    tl.dot needs)."""
    return min(int(cfg["BN"]), max(16, pow2(N)))


def _tail_block(cfg: Launch, N: int, SP: int) -> int:
    """coeff_tail's tokens per program: CONFIG's BN for training, down to one for decode (no
    tl.dot), so a decode call gets ~TAIL_PROGRAMS with fewer warps each."""
    bn = min(int(cfg["BN"]), pow2(cdiv(N, TAIL_PROGRAMS)))
    cfg["BN"], cfg["num_warps"] = bn, max(1, min(int(cfg["num_warps"]), bn * SP * SP // 128))
    return bn


TAIL_PROGRAMS = 128
TAIL_ELEMENTS = 4096  # coeff_tail's [KB, BN, PP] load of projection partials, at most


def _splits_per_load(splits: int, bn: int, PP: int) -> int:
    """KB: projection splits a [KB, BN, PP] load of the tail reads (TAIL_ELEMENTS at most)."""
    return min(pow2(splits), max(1, TAIL_ELEMENTS // (bn * PP)))


def _projection(x_BTSD: Tensor, phi_PC: Tensor, N: int, PP: int) -> tuple[Tensor, Tensor, int]:
    """coeff_proj's partial (projection [splits, N, PP], sum of squares [splits, N], splits):
    the columns are split until the grid has about CONFIG's PROGRAMS programs. PREC "bf16x3"
    needs bf16 streams and phi's bf16 terms; fp16 streams and a served phi take "tf32x3"."""
    C = x_BTSD.shape[-2] * x_BTSD.shape[-1]
    cfg = _launch("coeff_proj", x_BTSD, x_BTSD.shape[-2])
    if cfg["PREC"] == "bf16x3" and (x_BTSD.dtype != torch.bfloat16 or is_served(phi_PC)):
        cfg["PREC"] = "tf32x3"
    bn = _token_block(cfg, N)
    bc, blocks = int(cfg.pop("BC")), cdiv(N, bn)
    splits = max(1, min(cdiv(C, bc), int(cfg.pop("PROGRAMS")) // blocks))
    chunk = cdiv(cdiv(C, splits), bc) * bc
    splits = cdiv(C, chunk)
    part = x_BTSD.new_empty((splits, N, PP), dtype=torch.float32)
    sq = x_BTSD.new_empty((splits, N), dtype=torch.float32)
    cfg["BN"] = bn
    phi_t = projection_phi(phi_PC, 3 if cfg["PREC"] == "bf16x3" else 1)
    traceable(K.coeff_proj)[(blocks, splits)](
        x_BTSD, phi_t, part, sq, N, C, chunk, PP=PP, BC=bc, EMU=INTERPRET, **cfg
    )  # fmt: skip
    return part, sq, splits


def _coefficients_impl(
    x_BTSD: Tensor, phi_PC: Tensor, alpha: Tensor, bias_P: Tensor,
    iters: int, with_res: bool, with_mix: bool, norm_eps: float, eps: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """(H_pre, H_post, H_res, y = sum_j H_pre[j] x_j if with_mix, raw logits, rstd); the last two
    are saved for the backward."""
    pre, post, res, y_BTD, raw_BTP, rstd = _coefficients_fake(x_BTSD, phi_PC, with_res, with_mix)
    S, D = x_BTSD.shape[-2:]
    N, C, P = rstd.numel(), S * D, phi_PC.shape[0]
    (SP, PP), cfg = _pads(S, P), _launch("coeff_tail", x_BTSD, S)
    if N:
        part, sq, splits = _projection(x_BTSD, phi_PC, N, PP)
        bn = _tail_block(cfg, N, SP)
        kb = _splits_per_load(splits, bn, PP)
        traceable(K.coeff_tail)[(cdiv(N, bn),)](
            part, sq, raw_BTP, alpha, bias_P, pre, post, res, rstd,
            N, C, splits, norm_eps, eps, iters, S=S, SP=SP, P=P, PP=PP, WITH_RES=with_res, KB=kb,
            **cfg,
        )  # fmt: skip
    if N and with_mix:
        mix_in_into(y_BTD, x_BTSD, pre)
    return pre, post, res, y_BTD, raw_BTP, rstd


def _output_specs(
    x_BTSD: Tensor, phi_PC: Tensor, with_res: bool, with_mix: bool
) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of the coefficient op's outputs: fp32 but y (H_post, H_res, y of shape [0]
    when not computed)."""
    lead, (S, D), f32 = tuple(x_BTSD.shape[:-2]), x_BTSD.shape[-2:], torch.float32
    return [
        ((*lead, S), f32),
        ((*lead, S) if with_res else (0,), f32),
        ((*lead, S, S) if with_res else (0,), f32),
        ((*lead, D) if with_mix else (0,), x_BTSD.dtype),
        ((*lead, phi_PC.shape[0]), f32),
        (lead, f32),
    ]


def _coefficients_fake(
    x_BTSD: Tensor, phi_PC: Tensor, with_res: bool, with_mix: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Empty outputs (`_output_specs`)."""
    specs = _output_specs(x_BTSD, phi_PC, with_res, with_mix)
    return tuple(x_BTSD.new_empty(shape, dtype=dtype) for shape, dtype in specs)  # type: ignore[return-value]


def _coefficients_fake_op(x_BTSD, phi_PC, alpha, bias_P, iters, with_res, with_mix, norm_eps, eps):  # type: ignore[no-untyped-def]
    return _coefficients_fake(x_BTSD, phi_PC, with_res, with_mix)


_coefficients_op = FusedOp("mhc_coefficients", _coefficients_impl, _coefficients_fake_op)


def _coefficients_bwd_impl(
    g_pre: Tensor, g_post: Tensor, g_res: Tensor, g_y: Tensor, g_r: Tensor, x_BTSD: Tensor,
    phi_PC: Tensor, pre: Tensor, raw_BTP: Tensor, rstd_BT: Tensor, alpha: Tensor, bias_P: Tensor,
    iters: int, with_res: bool, eps: float,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """(g_x, g_phi, g_a: the gradient of the pre-activations alpha z + b). g_y: the gradient of
    the mix in (shape [0] if the op did not mix in); g_pre of shape [0] with a mix in: H_pre's
    gradient is the mix in's term alone; g_r: x's gradient from mix out's residual
    path (shape [0] if not handed over). Both join the one write of g_x."""
    if g_r.numel() and g_r.shape != x_BTSD.shape:
        raise ValueError(f"g_r has shape {tuple(g_r.shape)}, x {tuple(x_BTSD.shape)}")
    S, D = x_BTSD.shape[-2:]
    N, C, P = rstd_BT.numel(), S * D, phi_PC.shape[0]
    g_raw, g_a = torch.empty_like(raw_BTP), torch.empty_like(raw_BTP)
    coef_BT = torch.empty_like(rstd_BT)
    g_x = torch.empty_like(x_BTSD)
    if not N:
        return g_x, torch.zeros_like(phi_PC), g_a
    mix, res = g_y.numel() > 0, g_r.numel() > 0
    if mix:  # H_pre also reached the loss through y: g_pre += <g_y, x_j> (g_pre [0]: zero)
        g_mix = mix_in_weight_grad(g_y, x_BTSD, pre)
        g_pre = g_pre + g_mix if g_pre.numel() else g_mix
    (SP, PP), cfg = _pads(S, P), _launch("coeff_bwd", x_BTSD, S)
    scratch = raw_BTP.new_empty((N, 2 * iters, SP) if with_res else (1,))  # Sinkhorn denominators
    traceable(K.coeff_bwd)[(cdiv(N, int(cfg["BN"])),)](
        raw_BTP, rstd_BT, alpha, bias_P, g_pre, g_post, g_res, g_a, g_raw, coef_BT, scratch,
        N, C, eps, iters, S=S, SP=SP, P=P, WITH_RES=with_res, **cfg,
    )  # fmt: skip
    cfg = _launch("grad_x", x_BTSD, S)
    tokens = int(cfg.pop("TOKENS", cfg["BN"]))
    if cfg["PREC"] == "fma":  # one block of BN tokens a program (the kernel's fma branch)
        tokens = int(cfg["BN"])
    grid = (cdiv(N, tokens), cdiv(C, int(cfg["BC"])))
    bf16x3 = cfg["PREC"] == "bf16x3"
    phi = projection_phi(phi_PC, 3) if bf16x3 else phi_PC.float().contiguous()
    with_phi = phi_in_grad_x(cfg, x_BTSD, PP)
    cfg.pop("PHI", None)
    partials = g_raw.new_empty((grid[0], PP, C) if with_phi else (1,))
    traceable(G.grad_x)[grid](
        g_raw, phi, x_BTSD, coef_BT, g_x, g_y if mix else g_raw, pre, g_r if res else g_raw,
        partials, N, C, D, S, tokens, P=P, PP=PP, MIX=mix, RES=res,
        WHOLE=D % int(cfg["BC"]) == 0, PHI=with_phi, EMU=INTERPRET, **cfg,
    )  # fmt: skip
    if not with_phi:
        cfg = _launch("grad_phi", x_BTSD, S)
        tokens = int(cfg.pop("TOKENS"))
        partials = g_raw.new_empty((cdiv(N, tokens), PP, C))  # g_phi per block of tokens
        traceable(G.grad_phi)[(partials.shape[0], cdiv(C, int(cfg["BC"])))](
            g_raw, x_BTSD, partials, N, C, tokens, P=P, PP=PP,
            SPLIT=x_BTSD.dtype == torch.bfloat16, EMU=INTERPRET, **cfg,
        )  # fmt: skip
    g_phi = partials.sum(0)[:P].to(phi_PC.dtype)
    return g_x, g_phi, g_a


def _coefficients_bwd_fake(g_pre, g_post, g_res, g_y, g_r, x_BTSD, phi_PC, pre, raw_BTP, *_):  # type: ignore[no-untyped-def]  # noqa: E501
    return torch.empty_like(x_BTSD), torch.empty_like(phi_PC), torch.empty_like(raw_BTP)


_coefficients_bwd_op = FusedOp(
    "mhc_coefficients_bwd", _coefficients_bwd_impl, _coefficients_bwd_fake
)


def _save(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    x_BTSD, phi_PC, alpha, bias_P, iters, with_res, with_mix, _norm_eps, eps = inputs
    pre, _, _, _, raw_BTP, rstd_BT = output
    ctx.save_for_backward(x_BTSD, phi_PC, pre, raw_BTP, rstd_BT, alpha, bias_P)
    ctx.hyper = (iters, with_res, with_mix, eps)


def _coefficients_setup(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    _save(ctx, inputs, output)
    ctx.mark_non_differentiable(*output[4:])  # raw logits, rstd


def _coefficients_grads(ctx, g_pre, g_post, g_res, g_y, g_r):  # type: ignore[no-untyped-def]
    """(g_x, g_phi, g_alpha, g_bias) from the outputs' gradients (None: zero) and what `_save`
    kept; g_r: x's gradient from mix out's residual path, added into g_x (None: nothing)."""
    x_BTSD, phi_PC, pre, raw_BTP, rstd_BT, alpha, bias_P = ctx.saved_tensors
    iters, with_res, with_mix, eps = ctx.hyper
    specs = _output_specs(x_BTSD, phi_PC, with_res, with_mix)
    if g_pre is None and with_mix and g_y is not None:
        # H_pre's gradient from the mix in alone needs no zeros to add to (shape [0]: the
        # backward takes the mix in's term as all of it)
        g_pre = x_BTSD.new_empty((0,), dtype=torch.float32)
    # an output without a gradient contributes zero
    g_pre, g_post, g_res, g_y = (
        g.contiguous() if g is not None else x_BTSD.new_zeros(shape, dtype=dtype)
        for g, (shape, dtype) in zip((g_pre, g_post, g_res, g_y), specs[:4], strict=True)
    )
    g_r = x_BTSD.new_empty((0,)) if g_r is None else g_r.contiguous()
    g_x, g_phi, g_a = _coefficients_bwd_op(
        g_pre, g_post, g_res, g_y, g_r, x_BTSD, phi_PC, pre, raw_BTP, rstd_BT, alpha, bias_P,
        iters, with_res, eps,
    )  # fmt: skip
    # alpha scales each slice of z = raw * rstd: g_alpha[i] = sum over tokens and slice of g_a z.
    P, S = raw_BTP.shape[-1], x_BTSD.shape[-2]
    gz_P = (g_a * raw_BTP * rstd_BT[..., None]).reshape(-1, P).sum(0)
    sizes = [S, S, S * S] if with_res else [S]
    g_alpha = torch.stack([part.sum() for part in gz_P.split(sizes)])
    return g_x, g_phi, g_alpha, g_a.reshape(-1, P).sum(0)


def _coefficients_backward(ctx, g_pre, g_post, g_res, g_y, _g_raw, _g_rstd):  # type: ignore[no-untyped-def]
    grads = _coefficients_grads(ctx, g_pre, g_post, g_res, g_y, None)
    return *grads, None, None, None, None, None


_coefficients_op.register_autograd(_coefficients_backward, setup_context=_coefficients_setup)


class _CoefficientsMixInStreams(torch.autograd.Function):
    """The coefficient op with the mix in, whose node also gives x back, as a view (a custom
    op's outputs may not alias its inputs, and a copy would cost more than the add it saves).
    A mix out that reads this view sends its g_x here, into the op's one write of g_x."""

    @staticmethod
    def forward(ctx, x_BTSD, phi_PC, alpha, bias_P, iters, norm_eps, eps):  # type: ignore[no-untyped-def]
        inputs = (x_BTSD, phi_PC, alpha, bias_P, iters, True, True, norm_eps, eps)
        pre, post, res, y_BTD, raw_BTP, rstd_BT = _coefficients_op(*inputs)
        _save(ctx, inputs, (pre, post, res, y_BTD, raw_BTP, rstd_BT))
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no zeros
        return y_BTD, pre, post, res, x_BTSD.view_as(x_BTSD)

    @staticmethod
    def backward(ctx, g_y, g_pre, g_post, g_res, g_r):  # type: ignore[no-untyped-def]
        return *_coefficients_grads(ctx, g_pre, g_post, g_res, g_y, g_r), None, None, None


def _op_inputs(
    x_BTSD: Tensor, phi_PC: Tensor, alpha: Tensor, bias_P: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The coefficient op's tensor inputs as its kernels read them: checked, contiguous (phi
    also in `served_phi`'s layout), alpha and bias in fp32."""
    check_inputs(x_BTSD, phi_PC)
    return (
        x_BTSD.contiguous(), phi_PC if is_served(phi_PC) else phi_PC.contiguous(),
        alpha.float().contiguous(), bias_P.float().contiguous(),
    )  # fmt: skip


def _coefficients(
    x_BTSD: Tensor, phi_PC: Tensor, alpha: Tensor, bias_P: Tensor, iters: int, with_res: bool,
    with_mix: bool, norm_eps: float, eps: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    inputs = _op_inputs(x_BTSD, phi_PC, alpha, bias_P)
    pre, post, res, y, _, _ = _coefficients_op(*inputs, iters, with_res, with_mix, norm_eps, eps)
    return pre, post, res, y


def mhc_coefficients(
    x_BTSD: Tensor, phi_PC: Tensor, alpha_3: Tensor, bias_P: Tensor, *,
    iters: int, norm_eps: float, eps: float,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Fused (H_pre [B,T,S], H_post [B,T,S], H_res [B,T,S,S]) in fp32."""
    pre, post, res, _ = _coefficients(x_BTSD, phi_PC, alpha_3, bias_P, iters, True, False,
                                      norm_eps, eps)  # fmt: skip
    return pre, post, res


def coefficients_and_mix_in(
    x_BTSD: Tensor, phi_PC: Tensor, alpha_3: Tensor, bias_P: Tensor, *,
    iters: int, norm_eps: float, eps: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """Fused (sum_j H_pre[j] x_j [B,T,D], H_pre, H_post, H_res) as one op: its backward writes
    g_x once for the coefficients and the mix in (one [B,T,S,D] write and add fewer)."""
    pre, post, res, y = _coefficients(x_BTSD, phi_PC, alpha_3, bias_P, iters, True, True,
                                      norm_eps, eps)  # fmt: skip
    return y, pre, post, res


def coefficients_and_mix_in_streams(
    x_BTSD: Tensor, phi_PC: Tensor, alpha_3: Tensor, bias_P: Tensor, *,
    iters: int, norm_eps: float, eps: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """`coefficients_and_mix_in` and the streams again, [B,T,S,D], for `mix_out` to read: a view
    of x from the same autograd node, so the op's backward adds mix out's g_x (H_res g_y) into
    its one write of g_x, and autograd sums no gradients for x."""
    inputs = _op_inputs(x_BTSD, phi_PC, alpha_3, bias_P)
    return _CoefficientsMixInStreams.apply(*inputs, iters, norm_eps, eps)  # type: ignore[no-any-return]


def contraction_weights(
    x_BTSD: Tensor, phi_SC: Tensor, alpha_1: Tensor, bias_S: Tensor, *, norm_eps: float, eps: float
) -> Tensor:
    """Fused sigmoid weights [B,T,S] of the output contraction (the H_pre path alone)."""
    return _coefficients(x_BTSD, phi_SC, alpha_1, bias_S, 0, False, False, norm_eps, eps)[0]


def contract(
    x_BTSD: Tensor, phi_SC: Tensor, alpha_1: Tensor, bias_S: Tensor, *, norm_eps: float, eps: float
) -> Tensor:
    """Fused output contraction sum_s w_s x_s [B,T,D] (weights and sum as one op)."""
    return _coefficients(x_BTSD, phi_SC, alpha_1, bias_S, 0, False, True, norm_eps, eps)[3]
