"""Token log-probabilities through the lm_head, chunked over tokens: the [B,T,V] logits of a batch
never exist at once, in forward or backward.

Legend: B batch, T tokens, D model dim, V vocab; X positions of the batch flattened
(B*T), U positions of a chunk.

    z = (h W^T) / temperature,   logp = z[target] - logsumexp(z),   argmax = argmax(z)

`token_logprobs` is the one place the trainer turns hidden states into token scores (the main
head's logprobs, every MTP depth's loss, teacher-forced accuracy): a fused linear + log-softmax
in torch that keeps per token only the logsumexp, the target's logprob and the argmax, and
recomputes each chunk's logits in backward. `logprob_path(unchunked=True)` selects the plain
autograd path, the reference. Memory and numerics under autocast: docs/grpo.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

CHUNK_LOGITS = 1 << 25  # logits a chunk holds by default (128 MiB in fp32): 682 tokens at V=49,152


class HeadScores(NamedTuple):
    logp: Tensor  # [B,T] log softmax(z)[target], fp32 (fp64 for fp64 inputs)
    argmax: Tensor  # [B,T] int64: the head's most likely token (first index on ties), no gradient


class _Path(NamedTuple):
    chunk_tokens: int | None  # None: CHUNK_LOGITS // V
    unchunked: bool


_PATH: ContextVar[_Path | None] = ContextVar("logprob_path", default=None)


@contextmanager
def logprob_path(*, chunk_tokens: int | None = None, unchunked: bool = False) -> Iterator[None]:
    """Inside, `token_logprobs` calls that name no chunk size take `chunk_tokens` tokens a chunk
    (None: by vocabulary), or run the plain unchunked path where `unchunked`."""
    if chunk_tokens is not None and chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} is invalid: must be >= 1 or None")
    token = _PATH.set(_Path(chunk_tokens, unchunked))
    try:
        yield
    finally:
        _PATH.reset(token)


def compute_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    """The matmul's dtype: the autocast dtype for autocast-eligible inputs (what `F.linear` would
    run in), else the inputs' common dtype."""
    device = hidden.device.type
    eligible = (torch.float32, torch.float16, torch.bfloat16)
    if torch.is_autocast_enabled(device) and {hidden.dtype, weight.dtype} <= set(eligible):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(hidden.dtype, weight.dtype)


def check_head_inputs(hidden_BTD: Tensor, weight_VD: Tensor, targets_BT: Tensor, t: float) -> None:
    if weight_VD.dim() != 2 or hidden_BTD.shape[-1:] != weight_VD.shape[1:]:
        raise ValueError(
            f"token_logprobs: hidden [..., D] {tuple(hidden_BTD.shape)} does not "
            f"match the head weight [V, D] {tuple(weight_VD.shape)}"
        )
    ids = (torch.int64, torch.int32)
    if targets_BT.shape != hidden_BTD.shape[:-1] or targets_BT.dtype not in ids:
        raise ValueError(
            f"token_logprobs: targets must be int64/int32 of shape "
            f"{tuple(hidden_BTD.shape[:-1])}, got {targets_BT.dtype}"
            f"{tuple(targets_BT.shape)}"
        )
    if not (math.isfinite(t) and t > 0):
        raise ValueError(f"token_logprobs: temperature={t} must be finite and > 0")


def token_logprobs(
    hidden_BTD: Tensor,
    weight_VD: Tensor,
    targets_BT: Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
) -> HeadScores:
    """log softmax(h W^T / temperature)[target] and the argmax of every position ([B,T]; any
    leading dims), through `chunk_tokens` positions at a time (default: `logprob_path`'s, else
    CHUNK_LOGITS // V)."""
    check_head_inputs(hidden_BTD, weight_VD, targets_BT, temperature)
    path = _PATH.get() or _Path(None, False)
    dtype = compute_dtype(hidden_BTD, weight_VD)
    if path.unchunked:
        return unchunked_logprobs(hidden_BTD, weight_VD, targets_BT, temperature, dtype)
    chunk = chunk_tokens or path.chunk_tokens or max(1, CHUNK_LOGITS // weight_VD.shape[0])
    if chunk < 1:
        raise ValueError(f"chunk_tokens={chunk} is invalid: must be >= 1")
    lead = targets_BT.shape
    h_XD = hidden_BTD.reshape(-1, hidden_BTD.shape[-1])  # X = B*T positions
    logp_X, argmax_X = _ChunkedLogprobs.apply(
        h_XD, weight_VD, targets_BT.reshape(-1).long(), temperature, chunk, dtype
    )
    return HeadScores(logp_X.view(lead), argmax_X.view(lead))


def unchunked_logprobs(
    hidden_BTD: Tensor,
    weight_VD: Tensor,
    targets_BT: Tensor,
    temperature: float,
    dtype: torch.dtype,
) -> HeadScores:
    """The plain path: [B,T,V] logits in `dtype`, log-softmax in >= fp32, autograd throughout."""
    acc = torch.promote_types(dtype, torch.float32)
    logits_BTV = F.linear(hidden_BTD.to(dtype), weight_VD.to(dtype))
    logp_BTV = torch.log_softmax(logits_BTV.to(acc) / temperature, dim=-1)
    logp_BT = logp_BTV.gather(-1, targets_BT.long()[..., None]).squeeze(-1)
    return HeadScores(logp_BT, logits_BTV.detach().argmax(dim=-1))


def _chunk_logits(h_UD: Tensor, w_VD: Tensor, dtype: torch.dtype, temperature: float) -> Tensor:
    """z [U,V] in >= fp32: the chunk's logits in `dtype` (rounded as F.linear's), tempered."""
    z_UV = (h_UD.to(dtype) @ w_VD.T).to(torch.promote_types(dtype, torch.float32))
    return z_UV if temperature == 1.0 else z_UV.div_(temperature)


class _ChunkedLogprobs(torch.autograd.Function):
    """(logp [X], argmax [X]) of positions h [X,D]; see the module docstring."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        h_XD: Tensor,
        weight_VD: Tensor,
        targets_X: Tensor,
        temperature: float,
        chunk: int,
        dtype: torch.dtype,
    ) -> tuple[Tensor, Tensor]:
        X, acc = h_XD.shape[0], torch.promote_types(dtype, torch.float32)
        logp_X = h_XD.new_empty(X, dtype=acc)
        lse_X = torch.empty_like(logp_X)
        argmax_X = torch.empty(X, dtype=torch.long, device=h_XD.device)
        with torch.autocast(h_XD.device.type, enabled=False):
            w_VD = weight_VD.to(dtype)
            for s in range(0, X, chunk):
                z_UV = _chunk_logits(h_XD[s : s + chunk], w_VD, dtype, temperature)
                lse_U = torch.logsumexp(z_UV, dim=-1)
                target_U = z_UV.gather(-1, targets_X[s : s + chunk, None]).squeeze(-1)
                logp_X[s : s + chunk] = target_U - lse_U
                lse_X[s : s + chunk] = lse_U
                argmax_X[s : s + chunk] = z_UV.argmax(dim=-1)
        ctx.save_for_backward(h_XD, weight_VD, targets_X, lse_X)
        ctx.temperature, ctx.chunk, ctx.dtype = temperature, chunk, dtype
        ctx.mark_non_differentiable(argmax_X)
        return logp_X, argmax_X

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_logp_X: Tensor, _grad_argmax: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        h_XD, weight_VD, targets_X, lse_X = ctx.saved_tensors
        t, chunk, dtype = ctx.temperature, ctx.chunk, ctx.dtype
        need_h, need_w = ctx.needs_input_grad[:2]
        acc = torch.promote_types(dtype, torch.float32)
        grad_h_XD = torch.empty_like(h_XD) if need_h else None
        grad_w_VD = torch.zeros(weight_VD.shape, dtype=acc, device=h_XD.device) if need_w else None
        g_X1 = (grad_logp_X.to(acc) / t)[:, None]
        with torch.autocast(h_XD.device.type, enabled=False):
            w_VD = weight_VD.to(dtype)
            for s in range(0, h_XD.shape[0], chunk):
                h_UD = h_XD[s : s + chunk].to(dtype)
                # dlogp/dz = onehot(target) - softmax(z), times 1/t through z = x / t
                z_UV = _chunk_logits(h_UD, w_VD, dtype, t)
                g_UV = z_UV.sub_(lse_X[s : s + chunk, None]).exp_().mul_(-g_X1[s : s + chunk])
                g_UV = g_UV.scatter_add_(-1, targets_X[s : s + chunk, None], g_X1[s : s + chunk])
                g_UV = g_UV.to(dtype)
                if grad_h_XD is not None:
                    grad_h_XD[s : s + chunk] = g_UV @ w_VD
                if grad_w_VD is None:
                    continue
                if dtype == acc:
                    grad_w_VD.addmm_(g_UV.T, h_UD)
                else:  # a chunk's sum in `dtype`, the sum over chunks in fp32
                    grad_w_VD += (g_UV.T @ h_UD).to(acc)
        grad_w = None if grad_w_VD is None else grad_w_VD.to(weight_VD.dtype)
        return grad_h_XD, grad_w, None, None, None, None
