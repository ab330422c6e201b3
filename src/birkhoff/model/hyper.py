"""mHC: manifold-constrained hyper-connections (arXiv 2512.24880).

Legend: B batch, T tokens, S streams, D model dim, P = S*S + 2S coefficient logits.

Around each sublayer F the S residual streams mix as
    y_k = H_post[k] * F(sum_j H_pre[j] x_j) + sum_j H_res[j, k] x_j
with per-token coefficients from one projection of the RMS-normed streams (docs/mhc.md has the
formulas, the bias initialisation and the precision rules). The functions here are the eager
reference; `fused_ops` is the one place that picks the fused Triton ops instead, from a
`kernels` choice the caller makes ("auto" | "eager" | "triton": the trainer's
`TrainConfig.kernels`, applied to a model by `apply_kernels`; the engine's `kernels`).
S = 1 uses `PlainResidual` (x + F(x)): exactly a pre-norm transformer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import ModuleType
from typing import TypeVar

import torch
from torch import Tensor, nn

from birkhoff.config import KERNELS, Kernels, ModelConfig
from birkhoff.kernels import mhc, use_fused
from birkhoff.model.layers import _compute_dtype, rms_norm

MHC_EPS = 1e-6  # DeepSeek-V4's hc_eps; ModelConfig.mhc_eps
ModuleT = TypeVar("ModuleT", bound=nn.Module)


def fused_ops(x: Tensor, kernels: str) -> ModuleType | None:
    """The fused mHC ops (`birkhoff.kernels.mhc`) where `kernels` picks them for x
    (`birkhoff.kernels.use_fused`), else None: the eager reference below runs."""
    if not use_fused(x, kernels):
        return None
    return mhc


def sinkhorn(logits_SS: Tensor, iters: int, eps: float = MHC_EPS) -> Tensor:
    """Sinkhorn-Knopp over the last two dims as DeepSeek-V4 publishes it.

    Row softmax, + eps on every entry, column normalisation, then (iters - 1) x (row, column)
    normalisation, eps in every denominator. Columns are normalised last, so column sums are
    exact and row sums converge (~1e-3 after 20 iterations for typical logits).

    The normalisations run with the matrix entries leading ([S, S, N], N = every leading index,
    `SinkhornSteps`): each sum and division is then a few ops on contiguous length-N vectors
    instead of ops over many S-wide rows, much faster on CPU (docs/mhc.md), and
    a sum over S entries adds them in order, as the row-major form does for S <= 4 (equal to
    the last bit there; for larger S the two may round differently).
    """
    S = logits_SS.shape[-1]
    m_NSS = (torch.softmax(logits_SS, dim=-1) + eps).reshape(-1, S, S)
    if torch.is_grad_enabled() and m_NSS.requires_grad:
        out_NSS = SinkhornSteps.apply(m_NSS, iters, eps)
    else:
        out_NSS = SinkhornSteps.forward(None, m_NSS, iters, eps)
    return out_NSS.view(logits_SS.shape)


class SinkhornSteps(torch.autograd.Function):
    """The 2 * iters - 1 alternating normalisations of `sinkhorn` on [N,S,S] (entries of m > 0).

    Step i divides m by d = (sum of m over its axis) + eps: the column axis (dim 0 of the
    [S, S, N] layout) for even i, the row axis for odd i. The backward of r = m / d,
        dm = g / d - sum_axis(g * (r / d)),
    is autograd's for the same ops (div's two gradients, the sum's broadcast) written out, in
    the same [S, S, N] layout, so it equals what autograd would compute to the last bit.
    """

    @staticmethod
    def forward(ctx: object, m_NSS: Tensor, iters: int, eps: float) -> Tensor:
        m_SSN = m_NSS.permute(1, 2, 0).contiguous()  # entries leading
        saved: list[Tensor] = []
        for i in range(2 * iters - 1):
            d_SSN = m_SSN.sum(dim=i % 2, keepdim=True) + eps  # column sums first
            m_SSN = m_SSN / d_SSN
            saved += [m_SSN, d_SSN]
        if ctx is not None:
            ctx.save_for_backward(*saved)  # type: ignore[attr-defined]
        return m_SSN.permute(2, 0, 1).contiguous()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: object, g_NSS: Tensor) -> tuple[Tensor, None, None]:
        saved = ctx.saved_tensors  # type: ignore[attr-defined]
        g_SSN = g_NSS.permute(1, 2, 0).contiguous()
        for i in reversed(range(len(saved) // 2)):
            r_SSN, d_SSN = saved[2 * i], saved[2 * i + 1]
            g_d = (g_SSN * (r_SSN / d_SSN)).sum(dim=i % 2, keepdim=True)
            g_SSN = g_SSN / d_SSN - g_d
        return g_SSN.permute(2, 0, 1).contiguous(), None, None


def init_bias(num_streams: int, home: int) -> Tensor:
    """Static bias [pre | post | res] that starts a sublayer close to a plain residual."""
    S = num_streams
    pre = torch.full((S,), -3.0)
    pre[home % S] = 3.0
    post = torch.zeros(S)
    res = 6.0 * torch.eye(S) - 3.0
    return torch.cat((pre, post, res.flatten()))


def mhc_coefficients(
    x_BTSD: Tensor,
    phi_PC: Tensor,
    alpha_3: Tensor,
    bias_P: Tensor,
    *,
    iters: int,
    norm_eps: float,
    eps: float = MHC_EPS,
    kernels: str = "auto",
) -> tuple[Tensor, Tensor, Tensor]:
    """(H_pre [B,T,S], H_post [B,T,S], H_res [B,T,S,S]) in >= fp32 (C = S*D)."""
    if (ops := fused_ops(x_BTSD, kernels)) is not None:
        return ops.mhc_coefficients(
            x_BTSD, phi_PC, alpha_3, bias_P, iters=iters, norm_eps=norm_eps, eps=eps
        )
    B, T, S, D = x_BTSD.shape
    dtype = _compute_dtype(x_BTSD.dtype)
    with torch.autocast(device_type=x_BTSD.device.type, enabled=False):
        flat_BTC = rms_norm(x_BTSD.reshape(B, T, S * D).to(dtype), None, norm_eps)
        logits_BTP = flat_BTC @ phi_PC.to(dtype).t()
        alpha, bias = alpha_3.to(dtype), bias_P.to(dtype)
        pre, post, res = logits_BTP.split([S, S, S * S], dim=-1)
        b_pre, b_post, b_res = bias.split([S, S, S * S])
        h_pre = torch.sigmoid(alpha[0] * pre + b_pre) + eps
        h_post = 2.0 * torch.sigmoid(alpha[1] * post + b_post)
        h_res = sinkhorn((alpha[2] * res + b_res).view(B, T, S, S), iters, eps)
    return h_pre, h_post, h_res


def mix_in(x_BTSD: Tensor, h_pre_BTS: Tensor, *, kernels: str = "auto") -> Tensor:
    """Sublayer input: sum_j H_pre[j] x_j -> [B,T,D], summed in >= fp32, cast to x's dtype."""
    if (ops := fused_ops(x_BTSD, kernels)) is not None:
        return ops.mix_in(x_BTSD, h_pre_BTS)
    dtype = _compute_dtype(x_BTSD.dtype)
    with torch.autocast(device_type=x_BTSD.device.type, enabled=False):
        # a product and a sum over S, as DeepSeek-V4's reference writes it: its gradients then
        # agree to the last bit too (an einsum's backward reduces over D in another order)
        y_BTD = (h_pre_BTS.to(dtype)[..., None] * x_BTSD.to(dtype)).sum(dim=2)
    return y_BTD.to(x_BTSD.dtype)


def coefficients_and_mix_in(
    x_BTSD: Tensor,
    phi_PC: Tensor,
    alpha_3: Tensor,
    bias_P: Tensor,
    *,
    iters: int,
    norm_eps: float,
    eps: float = MHC_EPS,
    kernels: str = "auto",
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(sum_j H_pre[j] x_j [B,T,D], H_pre, H_post, H_res): `mhc_coefficients`, then `mix_in`.

    The fused path runs both as one op, whose backward writes the streams' gradient once.
    """
    if (ops := fused_ops(x_BTSD, kernels)) is not None:
        return ops.coefficients_and_mix_in(
            x_BTSD, phi_PC, alpha_3, bias_P, iters=iters, norm_eps=norm_eps, eps=eps
        )
    h_pre, h_post, h_res = mhc_coefficients(
        x_BTSD, phi_PC, alpha_3, bias_P, iters=iters, norm_eps=norm_eps, eps=eps, kernels=kernels
    )
    return mix_in(x_BTSD, h_pre, kernels=kernels), h_pre, h_post, h_res


def mix_out(
    x_BTSD: Tensor,
    f_BTD: Tensor,
    h_post_BTS: Tensor,
    h_res_BTSS: Tensor,
    *,
    kernels: str = "auto",
) -> Tensor:
    """y_k = H_post[k] F + sum_j H_res[j, k] x_j -> [B,T,S,D], in >= fp32, cast once.

    The output dtype is promote(x, F) (an fp32 residual stays fp32 under bf16 autocast).
    """
    if (ops := fused_ops(x_BTSD, kernels)) is not None:
        return ops.mix_out(x_BTSD, f_BTD, h_post_BTS, h_res_BTSS)
    out = torch.promote_types(x_BTSD.dtype, f_BTD.dtype)
    dtype = _compute_dtype(out)
    with torch.autocast(device_type=x_BTSD.device.type, enabled=False):
        # contiguous: the first sublayer's streams are the expanded embedding, whose zero
        # stride sends the CPU bmm down a loop of one small matmul per token (same values)
        x_BTSD = x_BTSD.to(dtype).contiguous()
        residual_BTSD = torch.einsum("btjk,btjd->btkd", h_res_BTSS.to(dtype), x_BTSD)
        y_BTSD = residual_BTSD + h_post_BTS.to(dtype)[..., None] * f_BTD.to(dtype)[:, :, None, :]
    return y_BTSD.to(out)


def hyper_connection(
    x_BTSD: Tensor,
    phi_PC: Tensor,
    alpha_3: Tensor,
    bias_P: Tensor,
    sublayer: Callable[[Tensor], Tensor],
    *,
    iters: int,
    norm_eps: float,
    eps: float = MHC_EPS,
    kernels: str = "auto",
) -> Tensor:
    """One mHC-wrapped sublayer: y_k = H_post[k] F(sum_j H_pre[j] x_j) + sum_j H_res[j, k] x_j.

    `coefficients_and_mix_in`, F, `mix_out`. The fused path hands mix out's gradient of the
    streams to the coefficient op's backward, which writes x's gradient once for all of it.
    """
    if (ops := fused_ops(x_BTSD, kernels)) is not None:
        # x_BTSD becomes the op's view of the (once made contiguous) streams
        y_BTD, _, h_post, h_res, x_BTSD = ops.coefficients_and_mix_in_streams(
            x_BTSD, phi_PC, alpha_3, bias_P, iters=iters, norm_eps=norm_eps, eps=eps
        )
        return ops.mix_out(x_BTSD, sublayer(y_BTD), h_post, h_res)
    y_BTD, _, h_post, h_res = coefficients_and_mix_in(
        x_BTSD, phi_PC, alpha_3, bias_P, iters=iters, norm_eps=norm_eps, eps=eps, kernels=kernels
    )
    return mix_out(x_BTSD, sublayer(y_BTD), h_post, h_res, kernels=kernels)


class HyperConnection(nn.Module):
    """The mHC wrapper of one sublayer: computes coefficients, mixes in, runs F, mixes out."""

    def __init__(
        self,
        dim: int,
        num_streams: int,
        *,
        home: int,
        iters: int,
        norm_eps: float,
        eps: float = MHC_EPS,
        kernels: str = "auto",
    ) -> None:
        super().__init__()
        S = num_streams
        self.iters, self.norm_eps, self.eps, self.kernels = iters, norm_eps, eps, kernels
        self.phi = nn.Parameter(torch.randn(S * S + 2 * S, S * dim) / math.sqrt(S * dim))
        self.alpha = nn.Parameter(torch.full((3,), 0.01))
        self.bias = nn.Parameter(init_bias(S, home))

    def forward(self, x_BTSD: Tensor, sublayer: Callable[[Tensor], Tensor]) -> Tensor:
        return hyper_connection(
            x_BTSD,
            self.phi,
            self.alpha,
            self.bias,
            sublayer,
            iters=self.iters,
            norm_eps=self.norm_eps,
            eps=self.eps,
            kernels=self.kernels,
        )


class PlainResidual(nn.Module):
    """S = 1: x + F(x), exactly the pre-norm transformer residual."""

    def forward(self, x_BTSD: Tensor, sublayer: Callable[[Tensor], Tensor]) -> Tensor:
        return plain_residual(x_BTSD, sublayer)


def build_hyper_connection(cfg: ModelConfig, *, home: int) -> nn.Module:
    if cfg.num_streams == 1:
        return PlainResidual()
    return HyperConnection(
        cfg.dim,
        cfg.num_streams,
        home=home,
        iters=cfg.sinkhorn_iters,
        norm_eps=cfg.norm_eps,
        eps=cfg.mhc_eps,
    )


def expand_streams(x_BTD: Tensor, num_streams: int) -> Tensor:
    """Widen the residual once at the input by repeating the embedding on every stream."""
    return x_BTD[:, :, None, :].expand(-1, -1, num_streams, -1)


def contraction_weights(
    x_BTSD: Tensor,
    phi_SC: Tensor,
    alpha_1: Tensor,
    bias_S: Tensor,
    *,
    norm_eps: float,
    eps: float = MHC_EPS,
    kernels: str = "auto",
) -> Tensor:
    """Sigmoid weights [B,T,S] of the output contraction, computed in >= fp32."""
    if (ops := fused_ops(x_BTSD, kernels)) is not None:
        return ops.contraction_weights(x_BTSD, phi_SC, alpha_1, bias_S, norm_eps=norm_eps, eps=eps)
    B, T, S, D = x_BTSD.shape
    dtype = _compute_dtype(x_BTSD.dtype)
    with torch.autocast(device_type=x_BTSD.device.type, enabled=False):
        flat_BTC = rms_norm(x_BTSD.reshape(B, T, S * D).to(dtype), None, norm_eps)
        logits_BTS = alpha_1.to(dtype) * (flat_BTC @ phi_SC.to(dtype).t()) + bias_S.to(dtype)
        return torch.sigmoid(logits_BTS) + eps


def contract(
    x_BTSD: Tensor,
    phi_SC: Tensor,
    alpha_1: Tensor,
    bias_S: Tensor,
    *,
    norm_eps: float,
    eps: float = MHC_EPS,
    kernels: str = "auto",
) -> Tensor:
    """Output contraction sum_s w_s x_s -> [B,T,D]: `contraction_weights`, then `mix_in` (the
    fused path runs both as one op)."""
    if (ops := fused_ops(x_BTSD, kernels)) is not None:
        return ops.contract(x_BTSD, phi_SC, alpha_1, bias_S, norm_eps=norm_eps, eps=eps)
    w_BTS = contraction_weights(
        x_BTSD, phi_SC, alpha_1, bias_S, norm_eps=norm_eps, eps=eps, kernels=kernels
    )
    return mix_in(x_BTSD, w_BTS, kernels=kernels)


class StreamContraction(nn.Module):
    """Learned output head: sum_s w_s x_s with pre-style sigmoid weights (no Sinkhorn)."""

    def __init__(
        self,
        dim: int,
        num_streams: int,
        *,
        norm_eps: float,
        eps: float = MHC_EPS,
        kernels: str = "auto",
    ) -> None:
        super().__init__()
        S = num_streams
        self.norm_eps, self.eps, self.kernels = norm_eps, eps, kernels
        self.phi = nn.Parameter(torch.randn(S, S * dim) / math.sqrt(S * dim))
        self.alpha = nn.Parameter(torch.full((1,), 0.01))
        self.bias = nn.Parameter(init_bias(S, home=0)[:S].clone())

    def forward(self, x_BTSD: Tensor) -> Tensor:
        return contract(
            x_BTSD,
            self.phi,
            self.alpha,
            self.bias,
            norm_eps=self.norm_eps,
            eps=self.eps,
            kernels=self.kernels,
        )


class SqueezeStreams(nn.Module):
    """S = 1: the single stream is the hidden state."""

    def forward(self, x_BTSD: Tensor) -> Tensor:
        return single_stream(x_BTSD)


def build_contraction(cfg: ModelConfig) -> nn.Module:
    """The output contraction of the main model or of one MTP depth (S = 1: the single stream)."""
    if cfg.num_streams == 1:
        return SqueezeStreams()
    return StreamContraction(cfg.dim, cfg.num_streams, norm_eps=cfg.norm_eps, eps=cfg.mhc_eps)


def apply_kernels(model: ModuleT, kernels: Kernels) -> ModuleT:
    """Run every mHC module of `model` (its hyper-connections and contractions) on `kernels`, a
    runtime choice applied from outside the model as recompute is; returns `model`."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels={kernels!r} is invalid: must be one of {KERNELS}")
    for module in model.modules():
        if isinstance(module, HyperConnection | StreamContraction):
            module.kernels = kernels
    return model


# Pure functions the trainer's modules above and the engine's forward both call, so a fused
# kernel replaces each op in one place.


def plain_residual(x_BTSD: Tensor, sublayer: Callable[[Tensor], Tensor]) -> Tensor:
    """S = 1: x + F(x) on the single stream, exactly the pre-norm transformer residual."""
    return x_BTSD + sublayer(x_BTSD[:, :, 0])[:, :, None, :]


def single_stream(x_BTSD: Tensor) -> Tensor:
    """S = 1: the output contraction is the single stream itself -> [B,T,D]."""
    return x_BTSD[:, :, 0]
