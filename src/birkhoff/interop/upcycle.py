"""Upcycling a dense checkpoint to S mHC streams and M MTP depths, with the dense logits at init.

Legend: S streams, D model dim, P = S*S + 2S coefficient logits, C = S*D.

The embedding is repeated on every stream and phi is zero, so every coefficient is its static
bias; the biases are set so that each sublayer is the dense residual step (sum_j H_pre[j] = 1,
H_post compensating Sinkhorn's eps per sublayer) and the final norm sees the dense hidden state.
Non-uniform stream weights with a rotating home stream break the streams' symmetry. MTP depth k
copies the dense last layer and final norm, with W_k = [I | 0] ignoring the embedding at init.
The derivation is in docs/interop.md; the math in model/hyper.py.
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
