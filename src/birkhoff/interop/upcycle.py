"""Upcycling a dense checkpoint to S mHC streams and M MTP depths, with the dense logits at init.

Legend: S streams, D model dim, P = S*S + 2S coefficient logits, C = S*D.

Why the logits equal the dense model's (derivation, model/hyper.py for the math):
- The embedding is repeated on every stream, so all S streams start equal to the dense x.
- Coefficient projections phi are zero, so every coefficient is its static bias (alpha keeps its
  0.01 init and multiplies a zero logit). For equal streams x_j = x:
    sublayer input  sum_j H_pre[j] x_j = (sum_j H_pre[j]) x = x   iff sum_j H_pre[j] = 1,
    stream k output H_post[k] F + sum_j H_res[j,k] x_j = F + x    iff H_post[k] = 1 and the
                    columns of H_res sum to 1 (any doubly stochastic H_res),
  so each sublayer is exactly the dense residual step and the streams stay equal to the dense
  residual stream. H_post = 2 sigmoid(b_post) = 1 needs b_post = 0 (but see the next point);
  H_pre[j] = sigmoid(b_pre[j]) + eps
  with b_pre[j] = logit(w_j - eps) and sum_j w_j = 1 gives sum_j H_pre[j] = 1. The output
  contraction gets the same weights, so it returns x and the final norm and lm_head see the dense
  hidden state.
- Sinkhorn's eps makes every column sum of H_res c = s / (s + eps) ~ 1 - 1e-6, not 1: the
  residual would shrink by c per sublayer, ~6e-5 relative over a 30-layer model, enough to
  move SmolLM2's logits by ~3e-3. Sublayer n (counted along the residual chain: 2 * layer +
  (0 attention | 1 MLP)) therefore gets H_post = c^(n+1) instead of 1: with x_n = c^n y_n,
        x_(n+1) = c x_n + c^(n+1) F(norm(x_n)) = c^(n+1) (y_n + F(norm(y_n))),
  because the sublayer's RMSNorm does not see the scale. The streams are the dense residual
  stream y times c^n, and the final RMSNorm removes that factor: what remains is rounding.
  c is computed by the model's own `sinkhorn` in fp32 on the static logits. The streams stay
  equal, so the contraction and the MTP depths (whose input norms drop the scale) see them as
  before.
- Symmetry breaking: the weights w are not uniform. The sublayer's home stream gets
  w = 1 - (S-1) r and the others r (r = 0.05), and the home stream rotates with the sublayer
  (block.py). The gradient reaching stream j through a sublayer input is H_pre[j] times the
  input's gradient, so streams receive different gradients from the first step, and phi, b_post
  and b_res (the published 6I - 3) then make the streams differ. Uniform w with a symmetric
  H_res would keep every stream identical forever (permutation symmetry).
- MTP depth k (DeepSeek-V3 layout, model/mtp.py): its block copies the dense model's last layer,
  its head norm copies the final norm, both input norms are ones and the projection W_k = [I | 0]
  passes the normed hidden half through and ignores the embedding half at init; training moves
  W_k's embedding half (its gradient is non-zero) so the depth learns to use the next token.
"""

from __future__ import annotations

import re

import torch
from torch import Tensor

from birkhoff.config import ModelConfig
from birkhoff.model.hyper import sinkhorn

OFF_HOME_WEIGHT = 0.05  # r above: the weight of a non-home stream in H_pre and the contraction
HC_PATTERN = re.compile(r"^(?:layers\.(\d+)|mtp\.(\d+)\.block)\.hc_(attn|mlp)\.(phi|alpha|bias)$")
CONTRACTION_PATTERN = re.compile(r"^(?:mtp\.\d+\.)?contraction\.(phi|alpha|bias)$")


def stream_weights(num_streams: int, home: int) -> Tensor:
    """Mixing weights w (fp64) summing to 1, with the home stream largest."""
    S = num_streams
    w = torch.full((S,), OFF_HOME_WEIGHT, dtype=torch.float64)
    w[home % S] = 1.0 - (S - 1) * OFF_HOME_WEIGHT
    return w


def pre_bias(num_streams: int, home: int, eps: float) -> Tensor:
    """b with sigmoid(b) + eps = w (eps = ModelConfig.mhc_eps, added to H_pre in model/hyper.py):
    the static pre (or contraction) logits, fp32."""
    p = stream_weights(num_streams, home) - eps
    return torch.log(p / (1 - p)).float()


def residual_logits(num_streams: int) -> Tensor:
    """Static H_res logits 6I - 3 (any doubly stochastic H_res keeps the dense output)."""
    return 6.0 * torch.eye(num_streams) - 3.0


def column_sum(cfg: ModelConfig) -> float:
    """c: the column sum of the upcycled H_res as the model computes it (fp32 Sinkhorn)."""
    h_res = sinkhorn(residual_logits(cfg.num_streams), cfg.sinkhorn_iters, cfg.mhc_eps)
    return float(h_res.sum(dim=-2).double().mean())


def post_bias(num_streams: int, gain: float) -> Tensor:
    """b_post with H_post = 2 sigmoid(b_post) = gain on every stream, fp32."""
    p = torch.full((num_streams,), gain / 2, dtype=torch.float64)
    return torch.log(p / (1 - p)).float()


def hyper_bias(cfg: ModelConfig, home: int, chain_index: int) -> Tensor:
    """Static bias [pre | post | res] of one upcycled sublayer: sum H_pre = 1 and
    H_post = c^(chain_index + 1) (the derivation above)."""
    S = cfg.num_streams
    post = post_bias(S, column_sum(cfg) ** (chain_index + 1))
    return torch.cat((pre_bias(S, home, cfg.mhc_eps), post, residual_logits(S).flatten()))


def is_upcycled(name: str) -> bool:
    """Whether `name` is an mHC parameter that upcycling creates (hyper-connection, contraction)."""
    return bool(HC_PATTERN.match(name) or CONTRACTION_PATTERN.match(name))


def hyper_tensor(cfg: ModelConfig, name: str) -> Tensor:
    """Upcycled mHC parameter `name` (hyper-connection or contraction), fp32."""
    S, D = cfg.num_streams, cfg.dim
    hc = HC_PATTERN.match(name)
    if hc is not None:
        layer_s, depth_s, sublayer, param = hc.groups()
        index = int(layer_s) if layer_s is not None else cfg.num_layers + int(depth_s)
        home = 2 * index + (sublayer == "mlp")  # as block.py assigns homes
        # an MTP depth's chain starts at its own input projection (its RMSNorms drop the scale)
        chain_index = home if layer_s is not None else int(sublayer == "mlp")
        values = {
            "phi": lambda: torch.zeros(S * S + 2 * S, S * D),
            "alpha": lambda: torch.full((3,), 0.01),
            "bias": lambda: hyper_bias(cfg, home, chain_index),
        }
        return values[param]()
    contraction = CONTRACTION_PATTERN.match(name)
    if contraction is not None:
        param = contraction.group(1)
        values = {
            "phi": lambda: torch.zeros(S, S * D),
            "alpha": lambda: torch.full((1,), 0.01),
            "bias": lambda: pre_bias(S, 0, cfg.mhc_eps),
        }
        return values[param]()
    raise ValueError(f"{name}: not an mHC parameter")


def mtp_source(cfg: ModelConfig, name: str) -> str | None:
    """The birkhoff dense name an MTP parameter is copied from (None: built, not copied)."""
    match = re.match(r"^mtp\.\d+\.(.*)$", name)
    if match is None:
        return None
    rest = match.group(1)
    if rest.startswith("block."):
        return f"layers.{cfg.num_layers - 1}.{rest.removeprefix('block.')}"
    if rest == "norm.weight":
        return "norm.weight"
    return None


def mtp_built_tensor(cfg: ModelConfig, name: str, dtype: torch.dtype) -> Tensor:
    """MTP input norms (ones) and the projection W_k = [I | 0] (hidden half passed through)."""
    if name.endswith(("hidden_norm.weight", "embed_norm.weight")):
        return torch.ones(cfg.dim, dtype=dtype)
    if name.endswith("proj.weight"):
        eye = torch.eye(cfg.dim, dtype=dtype)
        return torch.cat((eye, torch.zeros_like(eye)), dim=1)
    raise ValueError(f"{name}: no upcycling rule for this MTP parameter")
