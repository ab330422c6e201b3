"""Standard transformer pieces: RMSNorm, rotary embedding, grouped-query attention, SwiGLU.

Legend: B batch, T tokens, D model dim, H query heads, G kv heads, K head dim, F MLP hidden.

Design choices:
- Norms and rope run in at least fp32 (`_compute_dtype`): fp64 inputs stay fp64 so the CPU
  reference tests compare exactly; bf16 inputs are upcast and the result cast back.
- Rope tables are computed from explicit positions, so the trainer (positions 0..T-1) and the
  engine (arbitrary per-sequence positions with a KV cache) share one function. Scaling
  variants (linear, llama3, yarn) are one function each on the inverse frequencies, matching
  transformers' rope init functions; dynamic NTK and longrope are left out (import refuses them).
- Projections are separate (wq, wk, wv; w_gate, w_up) in the trainer layout; the engine fuses
  them (see birkhoff/engine/layout.py) and calls the same pure functions (`rms_norm`,
  `apply_rope`, `swiglu_halves`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from birkhoff.config import ModelConfig
from birkhoff.kernels import needs_grad, use_fused


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _fused_inference(kernels: str, x: Tensor, *others: Tensor | None) -> bool:
    """Fused forward-only kernels (`birkhoff.kernels.norm_rope`) apply when `kernels` asks for
    them on x and autograd will not need a backward through x or the other inputs."""
    return use_fused(x, kernels) and not needs_grad(x, *others)


def rms_norm(x: Tensor, weight: Tensor | None, eps: float, *, kernels: str = "eager") -> Tensor:
    """x / rms(x) * weight over the last dim, computed in >= fp32 (`kernels`: see
    `birkhoff.kernels.use_fused`; fused only for inference)."""
    if _fused_inference(kernels, x, weight):
        from birkhoff.kernels import norm_rope

        return norm_rope.rms_norm(x, weight, eps)
    xf = x.to(_compute_dtype(x.dtype))
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(y.dtype)
    return y.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_tables(
    positions: Tensor, head_dim: int, theta: float, *, cfg: ModelConfig | None = None
) -> tuple[Tensor, Tensor]:
    """cos, sin of shape [*positions.shape, K/2] in fp64 (cast at use).

    `cfg` supplies the rope scaling variant (`cfg.rope_scaling`); None is plain rope.
    """
    inv_freq = rope_inv_freq(head_dim, theta, positions.device)
    scale = 1.0
    if cfg is not None and cfg.rope_scaling != "none":
        inv_freq = ROPE_SCALING_FNS[cfg.rope_scaling](inv_freq, cfg)
        scale = cfg.rope_attention_factor
    angles = positions.to(torch.float64)[..., None] * inv_freq
    return angles.cos() * scale, angles.sin() * scale


def rope_inv_freq(head_dim: int, theta: float, device: torch.device | None = None) -> Tensor:
    """theta^(-2i/K) for i < K/2, fp64."""
    return theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)


def linear_inv_freq(inv_freq: Tensor, cfg: ModelConfig) -> Tensor:
    """Position interpolation: every frequency divided by the factor."""
    return inv_freq / cfg.rope_factor


def llama3_inv_freq(inv_freq: Tensor, cfg: ModelConfig) -> Tensor:
    """Llama 3.1: long wavelengths divided by the factor, short ones kept, a smooth ramp between."""
    assert cfg.rope_original_max_seq_len is not None  # ModelConfig checks it for llama3
    factor, low, high = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    old_len = cfg.rope_original_max_seq_len
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def yarn_inv_freq(inv_freq: Tensor, cfg: ModelConfig) -> Tensor:
    """YaRN: interpolated frequencies below a correction range, original ones above, a ramp between.

    The cos/sin scale (`rope_attention_factor`) is applied by rope_tables.
    """
    assert cfg.rope_original_max_seq_len is not None  # ModelConfig checks it for yarn
    half = inv_freq.shape[0]
    dim, base, orig = 2 * half, cfg.rope_theta, cfg.rope_original_max_seq_len

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(cfg.rope_beta_fast), correction_dim(cfg.rope_beta_slow)
    if cfg.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high  # avoid a zero-width ramp
    ramp = (torch.arange(half, dtype=inv_freq.dtype, device=inv_freq.device) - low) / (high - low)
    extrapolation = 1 - ramp.clamp(0, 1)  # 1: keep the original frequency
    return inv_freq / cfg.rope_factor * (1 - extrapolation) + inv_freq * extrapolation


ROPE_SCALING_FNS: dict[str, Callable[[Tensor, ModelConfig], Tensor]] = {
    "linear": linear_inv_freq,
    "llama3": llama3_inv_freq,
    "yarn": yarn_inv_freq,
}


def apply_rope(
    x_BTHK: Tensor, cos_BTK2: Tensor, sin_BTK2: Tensor, *, kernels: str = "eager"
) -> Tensor:
    """Rotate pairs (x[..., :K/2], x[..., K/2:]) by the position angle (the 'half' layout);
    `kernels` as for `rms_norm`."""
    if _fused_inference(kernels, x_BTHK):
        from birkhoff.kernels import norm_rope

        return norm_rope.rope(x_BTHK, cos_BTK2, sin_BTK2)
    dtype = _compute_dtype(x_BTHK.dtype)
    xf = x_BTHK.to(dtype)
    cos, sin = cos_BTK2.to(dtype)[:, :, None, :], sin_BTK2.to(dtype)[:, :, None, :]
    x1, x2 = xf.chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x_BTHK.dtype)


class Attention(nn.Module):
    """Causal grouped-query self-attention over a full sequence (training path).

    Options of the Llama family: q/k/v biases (`qkv_bias`), an output bias (`attn_out_bias`) and
    a per-head RMSNorm of q and k over the head dim before rope (`qk_norm`).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.kv_heads, cfg.head_dim
        qkv_bias = cfg.qkv_bias
        self.wq = nn.Linear(cfg.dim, cfg.num_heads * cfg.head_dim, bias=qkv_bias)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=qkv_bias)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=qkv_bias)
        self.wo = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.dim, bias=cfg.attn_out_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None

    def forward(self, x_BTD: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
        heads = self.heads(self.wq(x_BTD), self.wk(x_BTD), self.wv(x_BTD), rope)
        return self.wo(heads)

    def heads(self, q: Tensor, k: Tensor, v: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
        """Attention between the q, k, v projections and wo: [B,T,H*K] from [B,T,H*K] and two
        [B,T,G*K] (the GEMM-folded sublayer, model/fold.py, projects q, k, v itself)."""
        B, T, _ = q.shape
        q_BTHK = q.view(B, T, self.num_heads, self.head_dim)
        k_BTGK = k.view(B, T, self.num_kv_heads, self.head_dim)
        v_BTGK = v.view(B, T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q_BTHK, k_BTGK = self.q_norm(q_BTHK), self.k_norm(k_BTGK)
        q_BTHK, k_BTGK = apply_rope(q_BTHK, *rope), apply_rope(k_BTGK, *rope)
        out_BHTK = causal_attention(q_BTHK, k_BTGK, v_BTGK)
        return out_BHTK.transpose(1, 2).reshape(B, T, -1)


def causal_attention(q_BTHK: Tensor, k_BTGK: Tensor, v_BTGK: Tensor) -> Tensor:
    """SDPA with GQA: kv heads are repeated to match query heads. Returns [B,H,T,K]."""
    groups = q_BTHK.shape[2] // k_BTGK.shape[2]
    k_BTHK = k_BTGK.repeat_interleave(groups, dim=2) if groups > 1 else k_BTGK
    v_BTHK = v_BTGK.repeat_interleave(groups, dim=2) if groups > 1 else v_BTGK
    return F.scaled_dot_product_attention(
        q_BTHK.transpose(1, 2), k_BTHK.transpose(1, 2), v_BTHK.transpose(1, 2), is_causal=True
    )


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w_gate = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w_up = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w_down = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x_BTD: Tensor) -> Tensor:
        return self.w_down(swiglu(self.w_gate(x_BTD), self.w_up(x_BTD)))


def swiglu(gate_BTF: Tensor, up_BTF: Tensor) -> Tensor:
    """The SwiGLU activation silu(gate) * up (the projections around it are the caller's)."""
    return F.silu(gate_BTF) * up_BTF


def swiglu_halves(gate_up_BTF2: Tensor, *, kernels: str = "eager") -> Tensor:
    """`swiglu` of the two halves [gate | up] of one fused projection's output (the engine's
    w_gate_up); `kernels` as for `rms_norm`."""
    if _fused_inference(kernels, gate_up_BTF2):
        from birkhoff.kernels import norm_rope

        return norm_rope.silu_mul(gate_up_BTF2)
    return swiglu(*gate_up_BTF2.chunk(2, dim=-1))
