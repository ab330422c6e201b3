"""mHC: manifold-constrained hyper-connections (arXiv 2512.24880).

Legend: B batch, T tokens, S streams, D model dim, P = S*S + 2S coefficient logits.

The residual is widened to S streams x_BTSD. Around each sublayer F (attention, MLP):
    y_k = H_post[k] * F(sum_j H_pre[j] x_j) + sum_j H_res[j, k] x_j
with per-token coefficients computed from the streams themselves:
    x' = RMSNorm(flatten(x))                       (no weight: phi absorbs it)
    [pre | post | res] = alpha * (x' @ phi^T) + bias   (one projection, P logits, this order)
    H_pre = sigmoid(pre) + 1e-6, H_post = 2 sigmoid(post), H_res = Sinkhorn(res as S x S).
H_res is applied transposed (column k collects into stream k), as in the reference layout.

Design choices:
- Coefficients and Sinkhorn run in >= fp32 with autocast disabled: Sinkhorn in bf16 is unstable.
  fp64 inputs stay fp64 so gradcheck and the CPU reference tests are exact.
- The static bias starts each sublayer close to a plain residual: b_pre = +3 on the sublayer's
  home stream and -3 elsewhere, b_post = 0, b_res = 6I - 3 (Sinkhorn diagonal ~0.993).
  Zero biases would start from maximal mixing (H_res uniform).
- S = 1 uses `PlainResidual` (x + F(x)), so the model reduces exactly to a pre-norm transformer.
- Streams are expanded once at the input and contracted once at the output by
  `StreamContraction` (sigmoid weights like H_pre, no Sinkhorn). Left out: fused kernels.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from birkhoff.config import ModelConfig
from birkhoff.model.layers import _compute_dtype, rms_norm

PRE_EPS = 1e-6


def sinkhorn(logits_SS: Tensor, iters: int, eps: float = 1e-6) -> Tensor:
    """Sinkhorn-Knopp on exp(logits) over the last two dims: alternate row, column normalisation.

    Columns are normalised last, so column sums are exact and row sums converge (~1e-3 after
    20 iterations for typical logits). Subtracting the max first changes nothing mathematically
    (a global scale cancels in the first row normalisation) and avoids overflow.
    """
    m = torch.exp(logits_SS - logits_SS.amax(dim=(-2, -1), keepdim=True))
    for _ in range(iters):
        m = m / (m.sum(dim=-1, keepdim=True) + eps)
        m = m / (m.sum(dim=-2, keepdim=True) + eps)
    return m


def init_bias(num_streams: int, home: int) -> Tensor:
    """Static bias [pre | post | res] that starts a sublayer close to a plain residual."""
    S = num_streams
    pre = torch.full((S,), -3.0)
    pre[home % S] = 3.0
    post = torch.zeros(S)
    res = 6.0 * torch.eye(S) - 3.0
    return torch.cat((pre, post, res.flatten()))


def mhc_coefficients(
    x_BTSD: Tensor, phi_PC: Tensor, alpha_3: Tensor, bias_P: Tensor, *, iters: int, norm_eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """(H_pre [B,T,S], H_post [B,T,S], H_res [B,T,S,S]) in >= fp32 (C = S*D)."""
    B, T, S, D = x_BTSD.shape
    dtype = _compute_dtype(x_BTSD.dtype)
    with torch.autocast(device_type=x_BTSD.device.type, enabled=False):
        flat_BTC = rms_norm(x_BTSD.reshape(B, T, S * D).to(dtype), None, norm_eps)
        logits_BTP = flat_BTC @ phi_PC.to(dtype).t()
        alpha, bias = alpha_3.to(dtype), bias_P.to(dtype)
        pre, post, res = logits_BTP.split([S, S, S * S], dim=-1)
        b_pre, b_post, b_res = bias.split([S, S, S * S])
        h_pre = torch.sigmoid(alpha[0] * pre + b_pre) + PRE_EPS
        h_post = 2.0 * torch.sigmoid(alpha[1] * post + b_post)
        h_res = sinkhorn((alpha[2] * res + b_res).view(B, T, S, S), iters)
    return h_pre, h_post, h_res


def mix_in(x_BTSD: Tensor, h_pre_BTS: Tensor) -> Tensor:
    """Sublayer input: sum_j H_pre[j] x_j -> [B,T,D]."""
    return torch.einsum("btj,btjd->btd", h_pre_BTS.to(x_BTSD.dtype), x_BTSD)


def mix_out(x_BTSD: Tensor, f_BTD: Tensor, h_post_BTS: Tensor, h_res_BTSS: Tensor) -> Tensor:
    """y_k = H_post[k] F + sum_j H_res[j, k] x_j -> [B,T,S,D]."""
    dtype = x_BTSD.dtype
    residual_BTSD = torch.einsum("btjk,btjd->btkd", h_res_BTSS.to(dtype), x_BTSD)
    return residual_BTSD + h_post_BTS.to(dtype)[..., None] * f_BTD[:, :, None, :]


class HyperConnection(nn.Module):
    """The mHC wrapper of one sublayer: computes coefficients, mixes in, runs F, mixes out."""

    def __init__(self, dim: int, num_streams: int, *, home: int, iters: int, norm_eps: float):
        super().__init__()
        S = num_streams
        self.iters, self.norm_eps = iters, norm_eps
        self.phi = nn.Parameter(torch.randn(S * S + 2 * S, S * dim) / math.sqrt(S * dim))
        self.alpha = nn.Parameter(torch.full((3,), 0.01))
        self.bias = nn.Parameter(init_bias(S, home))

    def coefficients(self, x_BTSD: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return mhc_coefficients(
            x_BTSD, self.phi, self.alpha, self.bias, iters=self.iters, norm_eps=self.norm_eps
        )

    def forward(self, x_BTSD: Tensor, sublayer: Callable[[Tensor], Tensor]) -> Tensor:
        h_pre, h_post, h_res = self.coefficients(x_BTSD)
        f_BTD = sublayer(mix_in(x_BTSD, h_pre))
        return mix_out(x_BTSD, f_BTD, h_post, h_res)


class PlainResidual(nn.Module):
    """S = 1: x + F(x), exactly the pre-norm transformer residual."""

    def forward(self, x_BTSD: Tensor, sublayer: Callable[[Tensor], Tensor]) -> Tensor:
        return plain_residual(x_BTSD, sublayer)


def build_hyper_connection(cfg: ModelConfig, *, home: int) -> nn.Module:
    if cfg.num_streams == 1:
        return PlainResidual()
    return HyperConnection(
        cfg.dim, cfg.num_streams, home=home, iters=cfg.sinkhorn_iters, norm_eps=cfg.norm_eps
    )


def expand_streams(x_BTD: Tensor, num_streams: int) -> Tensor:
    """Widen the residual once at the input by repeating the embedding on every stream."""
    return x_BTD[:, :, None, :].expand(-1, -1, num_streams, -1)


def contraction_weights(
    x_BTSD: Tensor, phi_SC: Tensor, alpha_1: Tensor, bias_S: Tensor, *, norm_eps: float
) -> Tensor:
    """Sigmoid weights [B,T,S] of the output contraction, computed in >= fp32."""
    B, T, S, D = x_BTSD.shape
    dtype = _compute_dtype(x_BTSD.dtype)
    with torch.autocast(device_type=x_BTSD.device.type, enabled=False):
        flat_BTC = rms_norm(x_BTSD.reshape(B, T, S * D).to(dtype), None, norm_eps)
        logits_BTS = alpha_1.to(dtype) * (flat_BTC @ phi_SC.to(dtype).t()) + bias_S.to(dtype)
        return torch.sigmoid(logits_BTS) + PRE_EPS


class StreamContraction(nn.Module):
    """Learned output head: sum_s w_s x_s with pre-style sigmoid weights (no Sinkhorn)."""

    def __init__(self, dim: int, num_streams: int, *, norm_eps: float) -> None:
        super().__init__()
        S = num_streams
        self.norm_eps = norm_eps
        self.phi = nn.Parameter(torch.randn(S, S * dim) / math.sqrt(S * dim))
        self.alpha = nn.Parameter(torch.full((1,), 0.01))
        self.bias = nn.Parameter(init_bias(S, home=0)[:S].clone())

    def forward(self, x_BTSD: Tensor) -> Tensor:
        w_BTS = contraction_weights(x_BTSD, self.phi, self.alpha, self.bias, norm_eps=self.norm_eps)
        return contract(x_BTSD, w_BTS)


class SqueezeStreams(nn.Module):
    """S = 1: the single stream is the hidden state."""

    def forward(self, x_BTSD: Tensor) -> Tensor:
        return single_stream(x_BTSD)


def build_contraction(dim: int, num_streams: int, *, norm_eps: float) -> nn.Module:
    if num_streams == 1:
        return SqueezeStreams()
    return StreamContraction(dim, num_streams, norm_eps=norm_eps)


# Pure functions the trainer's modules above and the engine's forward both call, so a fused
# kernel replaces each op in one place.


def plain_residual(x_BTSD: Tensor, sublayer: Callable[[Tensor], Tensor]) -> Tensor:
    """S = 1: x + F(x) on the single stream, exactly the pre-norm transformer residual."""
    return x_BTSD + sublayer(x_BTSD[:, :, 0])[:, :, None, :]


def contract(x_BTSD: Tensor, w_BTS: Tensor) -> Tensor:
    """Output contraction sum_s w_s x_s -> [B,T,D], with w from `contraction_weights`."""
    return torch.einsum("bts,btsd->btd", w_BTS.to(x_BTSD.dtype), x_BTSD)


def single_stream(x_BTSD: Tensor) -> Tensor:
    """S = 1: the output contraction is the single stream itself -> [B,T,D]."""
    return x_BTSD[:, :, 0]
