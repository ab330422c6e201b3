"""DeepSeek-V4 tensor names: transformers' layout plus the checkpoint's `mtp.{k}.*` <-> birkhoff's.

A birkhoff tensor comes from one transformers tensor, or from two concatenated ones (`Parts`):
the shared expert's gate and up rows (`mlp.shared.w_gate_up`, dim 0) and an MTP depth's merge
projection (`proj.weight` = [h_proj | e_proj], dim 1: birkhoff applies one [D, 2D] matrix to
[RMSNorm(h); RMSNorm(emb)], V4 adds h_proj(h) + e_proj(emb)). Inside a decoder layer,
`self_attn.*` is birkhoff's `attn.*` with the same leaf names. MTP depth k is `mtp.{k}.` in
both: V4's MTP block holds the decoder-layer tensors at its top level next to its own enorm /
hnorm / e_proj / h_proj / hc_head_{fn,base,scale} / norm, which keep the released checkpoint's
names (transformers drops `mtp.*`, so it has no names of its own for them). fp8 weights travel
with `NAME_scale_inv` (fp32, one per 128x128 block). The mapping is documented in docs/v4.md;
DeepSeek's original names (attn.wq_a, ffn.experts.{j}.w1, ...) are v4_deepseek.py's.
"""

from __future__ import annotations

from typing import NamedTuple

SCALE_SUFFIX = "_scale_inv"  # a block-fp8 weight NAME travels with NAME + SCALE_SUFFIX


class Parts(NamedTuple):
    """The transformers tensors of one birkhoff tensor, concatenated along `dim` in order."""

    names: tuple[str, ...]
    dim: int = 0


TOP = {  # birkhoff -> transformers, whole-model tensors
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
    "contraction.phi": "model.hc_head.hc_fn",
    "contraction.bias": "model.hc_head.hc_base",
    "contraction.alpha": "model.hc_head.hc_scale",
}
LAYER = {  # birkhoff -> transformers, inside a block / decoder layer (attn.* is a prefix rule)
    "attn_norm.weight": "input_layernorm.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "hc_attn.phi": "attn_hc.fn",
    "hc_attn.bias": "attn_hc.base",
    "hc_attn.alpha": "attn_hc.scale",
    "hc_mlp.phi": "ffn_hc.fn",
    "hc_mlp.bias": "ffn_hc.base",
    "hc_mlp.alpha": "ffn_hc.scale",
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.router_bias": "mlp.gate.e_score_correction_bias",
    "mlp.tid2eid": "mlp.gate.tid2eid",
    "mlp.experts.w_gate_up": "mlp.experts.gate_up_proj",
    "mlp.experts.w_down": "mlp.experts.down_proj",
    "mlp.shared.w_down": "mlp.shared_experts.down_proj.weight",
}
LAYER_FUSED = {
    "mlp.shared.w_gate_up": Parts(
        ("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"), 0
    ),
}
MTP = {  # birkhoff -> the checkpoint's, inside `mtp.{k}.` (the block's tensors: LAYER)
    "hidden_norm.weight": "hnorm.weight",
    "embed_norm.weight": "enorm.weight",
    "norm.weight": "norm.weight",
    "contraction.phi": "hc_head_fn",
    "contraction.bias": "hc_head_base",
    "contraction.alpha": "hc_head_scale",
}
MTP_FUSED = {"proj.weight": Parts(("h_proj.weight", "e_proj.weight"), 1)}


def _layer_parts(rest: str) -> Parts | None:
    if rest.startswith("attn."):
        return Parts(("self_attn." + rest.removeprefix("attn."),))
    if rest in LAYER:
        return Parts((LAYER[rest],))
    return LAYER_FUSED.get(rest)


def _prefixed(prefix: str, parts: Parts | None) -> Parts | None:
    if parts is None:
        return None
    return Parts(tuple(prefix + name for name in parts.names), parts.dim)


def hf_parts(name: str) -> Parts | None:
    """The transformers tensors of birkhoff tensor `name` (None: V4 has no such tensor)."""
    if name in TOP:
        return Parts((TOP[name],))
    head, _, rest = name.partition(".")
    index, _, rest = rest.partition(".")
    if head == "layers" and index.isdigit():
        return _prefixed(f"model.layers.{index}.", _layer_parts(rest))
    if head == "mtp" and index.isdigit():
        prefix = f"mtp.{index}."
        if rest.startswith("block."):
            return _prefixed(prefix, _layer_parts(rest.removeprefix("block.")))
        if rest in MTP:
            return Parts((prefix + MTP[rest],))
        return _prefixed(prefix, MTP_FUSED.get(rest))
    return None


def is_ignored(hf_name: str) -> bool:
    """Source tensors recomputed from the config rather than read (rope tables)."""
    return hf_name.endswith("inv_freq")
