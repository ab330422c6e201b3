"""DeepSeek-V4's original tensor names (released checkpoints) <-> transformers' names.

Released V4 checkpoints name tensors as DeepSeek's inference code does (`embed.weight`,
`layers.{i}.attn.wq_a.weight`, `layers.{i}.hc_attn_fn`, `layers.{i}.ffn.experts.{e}.w1.weight`,
`head.weight`, fp8 block scales as `NAME.scale`); transformers renames them on load
(conversion_mapping.py, "deepseek_v4"). The tables below are that renaming written out name by
name, so it is exactly invertible; the experts' per-expert w1 / w3 / w2 become the stacks
`experts.gate_up_proj` ([E, 2F, D], w1 rows then w3 rows per expert) and `experts.down_proj`.
MTP depth k keeps its own tensors (`mtp.{k}.e_proj`, `h_proj`, `enorm`, `hnorm`, `norm`,
`hc_head_{fn,base,scale}`) in both layouts and its decoder-layer tensors renamed as a layer's.
`V4Source` shows any checkpoint (transformers', DeepSeek's, transformers 5's save_pretrained
spelling, which is DeepSeek's under `model.`, or a mix) under transformers' names;
`deepseek_tensors` writes DeepSeek's.
Left out: fp4 experts, scale layouts other than one per 128x128 block.
"""

from __future__ import annotations

import re

import torch
from torch import Tensor

from birkhoff.engine.fp8 import dequantize_fp8_blockwise
from birkhoff.interop.streaming import TensorSource, TensorSpec
from birkhoff.interop.v4_names import SCALE_SUFFIX

TOP = {  # DeepSeek -> transformers, whole-model tensors
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}
COMPRESSOR = {  # DeepSeek -> transformers, inside a compressor (the indexer's too)
    "wkv.weight": "kv_proj.weight",
    "wgate.weight": "gate_proj.weight",
    "ape": "position_bias",
    "norm.weight": "kv_norm.weight",
}
LAYER = {  # DeepSeek -> transformers, inside `layers.{i}.` and `mtp.{k}.`
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    **{
        f"hc_{a}_{p}": f"{b}_hc.{p}"
        for a, b in (("attn", "attn"), ("ffn", "ffn"))
        for p in ("fn", "base", "scale")
    },
    "attn.attn_sink": "self_attn.sinks",
    "attn.wq_a.weight": "self_attn.q_a_proj.weight",
    "attn.q_norm.weight": "self_attn.q_a_norm.weight",
    "attn.wq_b.weight": "self_attn.q_b_proj.weight",
    "attn.wkv.weight": "self_attn.kv_proj.weight",
    "attn.kv_norm.weight": "self_attn.kv_norm.weight",
    "attn.wo_a.weight": "self_attn.o_a_proj.weight",
    "attn.wo_b.weight": "self_attn.o_b_proj.weight",
    **{f"attn.compressor.{a}": f"self_attn.compressor.{b}" for a, b in COMPRESSOR.items()},
    **{
        f"attn.indexer.compressor.{a}": f"self_attn.compressor.indexer.{b}"
        for a, b in COMPRESSOR.items()
    },
    "attn.indexer.wq_b.weight": "self_attn.compressor.indexer.q_b_proj.weight",
    "attn.indexer.weights_proj.weight": "self_attn.compressor.indexer.scorer.weights_proj.weight",
    "ffn.gate.weight": "mlp.gate.weight",
    "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
    "ffn.gate.tid2eid": "mlp.gate.tid2eid",
    "ffn.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "ffn.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
}
LAYER_ALIASES = {"attn.norm.weight": "self_attn.kv_norm.weight"}  # accepted on import only
MTP_OWN = (
    "e_proj.weight",
    "h_proj.weight",
    "enorm.weight",
    "hnorm.weight",
    "norm.weight",
    "hc_head_fn",
    "hc_head_base",
    "hc_head_scale",
)
EXPERT = re.compile(
    r"^(?:model\.)?(layers|mtp)\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.(weight|scale)$"
)
STACKS = {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)}  # transformers stack <- DeepSeek


def split_prefix(name: str) -> tuple[str, str, str]:
    """(`layers.{i}.` / `mtp.{k}.` or "", model prefix of transformers' name, the rest)."""
    head, _, rest = name.partition(".")
    index, _, leaf = rest.partition(".")
    if head in ("layers", "mtp") and index.isdigit() and leaf:
        return f"{head}.{index}.", "model." if head == "layers" else "", leaf
    return "", "", name


def transformers_name(name: str) -> str | None:
    """transformers' name of DeepSeek tensor `name` (block scales `.scale` -> `_scale_inv`);
    None: not one of DeepSeek's names (it may already be transformers')."""
    if name.endswith(".scale"):
        weight = transformers_name(name.removesuffix(".scale") + ".weight")
        return None if weight is None else weight + SCALE_SUFFIX
    if name.startswith("model."):
        return transformers_name(name.removeprefix("model."))  # save_pretrained's spelling
    if name in TOP:
        return TOP[name]
    prefix, model, leaf = split_prefix(name)
    if not prefix:
        return None
    if prefix.startswith("mtp.") and leaf in MTP_OWN:
        return name
    renamed = LAYER.get(leaf) or LAYER_ALIASES.get(leaf)
    return None if renamed is None else model + prefix + renamed


TO_DEEPSEEK_TOP = {v: k for k, v in TOP.items()}
TO_DEEPSEEK_LAYER = {v: k for k, v in LAYER.items()}


def deepseek_name(name: str) -> str:
    """DeepSeek's name of transformers tensor `name` (not an expert stack); `_scale_inv` scales
    become `.scale`. A name with no DeepSeek counterpart raises ValueError."""
    if name.endswith(SCALE_SUFFIX):
        return deepseek_name(name.removesuffix(SCALE_SUFFIX)).removesuffix(".weight") + ".scale"
    if name in TO_DEEPSEEK_TOP:
        return TO_DEEPSEEK_TOP[name]
    prefix, _, leaf = split_prefix(name.removeprefix("model."))
    if prefix.startswith("mtp.") and leaf in MTP_OWN:
        return name
    if prefix and leaf in TO_DEEPSEEK_LAYER:
        return prefix + TO_DEEPSEEK_LAYER[leaf]
    raise ValueError(f"{name}: no DeepSeek-V4 original name")


def stack_name(prefix: str, which: str) -> str:
    """transformers' expert stack of `w1`/`w3` (gate_up_proj) or `w2` (down_proj)."""
    model = "model." if prefix.startswith("layers.") else ""
    stack = "gate_up_proj" if which in ("w1", "w3") else "down_proj"
    return f"{model}{prefix}mlp.experts.{stack}"


class ExpertStack:
    """The per-expert DeepSeek tensors of one transformers expert stack: `parts[e]` lists
    expert e's weights in stack order (w1, w3 | w2), `scales[e]` their `.scale`s (or None)."""

    def __init__(self, stack: str) -> None:
        self.stack = stack
        self.found: dict[tuple[int, str, str], str] = {}  # (expert, w1|w2|w3, weight|scale)

    def check(self) -> None:
        experts = sorted({e for e, _, _ in self.found})
        kinds = STACKS[self.stack.rsplit(".", 1)[1]]
        scaled = any(k == "scale" for _, _, k in self.found)
        for e in range(max(experts) + 1):
            for which in kinds:
                for kind in ("weight", "scale") if scaled else ("weight",):
                    if (e, which, kind) not in self.found:
                        raise ValueError(f"{self.stack}: expert {e} has no {which}.{kind}")

    @property
    def num_experts(self) -> int:
        return max(e for e, _, _ in self.found) + 1

    def names(self, expert: int, kind: str) -> list[str]:
        kinds = STACKS[self.stack.rsplit(".", 1)[1]]
        return [
            self.found[(expert, which, kind)]
            for which in kinds
            if (expert, which, kind) in self.found
        ]


class V4Source:
    """A V4 checkpoint's tensors under transformers' names, whichever layout it is written in
    (a TensorSource): DeepSeek's names are renamed, per-expert tensors read as the stacks
    (block-fp8 experts dequantized to `fp8_dtype` as they are stacked), `.scale`s read as fp32
    `_scale_inv`s. Two source tensors with one transformers name raise ValueError."""

    def __init__(self, inner: TensorSource, *, fp8_dtype: torch.dtype = torch.float32) -> None:
        self.inner, self.fp8_dtype = inner, fp8_dtype
        self.renamed: dict[str, str] = {}  # transformers name -> source name
        self.stacks: dict[str, ExpertStack] = {}
        for name in inner.names():
            expert = EXPERT.match(name)
            if expert:
                head, index, e, which, kind = expert.groups()
                stack = stack_name(f"{head}.{index}.", which)
                self.stacks.setdefault(stack, ExpertStack(stack))
                self.stacks[stack].found[(int(e), which, kind)] = name
                continue
            target = transformers_name(name) or name
            if target in self.renamed:
                raise ValueError(f"{self.renamed[target]} and {name} are both {target}")
            self.renamed[target] = name
        for group in self.stacks.values():
            group.check()
            if group.stack in self.renamed:
                raise ValueError(f"{group.stack} is given both stacked and per expert")

    def names(self) -> list[str]:
        return sorted([*self.renamed, *self.stacks])

    def __contains__(self, name: str) -> bool:
        return name in self.renamed or name in self.stacks

    def spec(self, name: str) -> TensorSpec:
        if name in self.stacks:
            return self.stack_spec(self.stacks[name])
        spec = self.inner.spec(self.renamed[name])
        return TensorSpec(spec.shape, torch.float32) if name.endswith(SCALE_SUFFIX) else spec

    def stack_spec(self, stack: ExpertStack) -> TensorSpec:
        specs = [self.inner.spec(n) for n in stack.names(0, "weight")]
        rows = sum(s.shape[0] for s in specs)
        scaled = bool(stack.names(0, "scale"))
        dtype = self.fp8_dtype if scaled else specs[0].dtype
        return TensorSpec((stack.num_experts, rows, specs[0].shape[1]), dtype)

    def get(self, name: str) -> Tensor:
        if name in self.stacks:
            return self.read_stack(self.stacks[name])
        tensor = self.inner.get(self.renamed[name])
        return tensor.float() if name.endswith(SCALE_SUFFIX) else tensor

    def read_stack(self, stack: ExpertStack) -> Tensor:
        experts = []
        for e in range(stack.num_experts):
            weights = [self.inner.get(n) for n in stack.names(e, "weight")]
            scales = [self.inner.get(n).float() for n in stack.names(e, "scale")]
            if scales:
                weights = [
                    dequantize_fp8_blockwise(w, s, dtype=self.fp8_dtype)
                    for w, s in zip(weights, scales, strict=True)
                ]
            experts.append(torch.cat(weights, dim=0))
        return torch.stack(experts)


def deepseek_tensors(name: str, tensor: Tensor) -> list[tuple[str, Tensor]]:
    """transformers tensor `name` under DeepSeek's names: an expert stack as one tensor per
    expert and projection, anything else renamed (`deepseek_name`)."""
    leaf = name.rsplit(".", 1)[-1]
    if not name.endswith(tuple(f"mlp.experts.{s}" for s in STACKS)):
        return [(deepseek_name(name), tensor)]
    prefix = name.removeprefix("model.").removesuffix(f"mlp.experts.{leaf}")
    kinds = STACKS[leaf]
    out = []
    for e in range(tensor.shape[0]):
        for which, piece in zip(kinds, tensor[e].chunk(len(kinds), dim=0), strict=True):
            out.append((f"{prefix}ffn.experts.{e}.{which}.weight", piece.contiguous()))
    return out


def deepseek_scale_name(weight: str) -> str:
    """DeepSeek's name of the block scales of weight `weight` (`X.weight` -> `X.scale`)."""
    return weight.removesuffix(".weight") + ".scale"
