"""Import a HuggingFace Llama-family checkpoint directory as a birkhoff checkpoint.

The output is runtime/checkpoint.py's format, committed atomically, with the original HF config
(`hf_config.json`, so export reproduces it byte for byte) and the tokenizer files in its
manifest. Tensors are streamed one at a time (names and shapes from a meta-device
`Transformer`, read with `safe_open`, source dtypes kept); names map one to one
(`HF_LAYER_NAMES`), and unknown, missing or mis-shaped tensors raise `ValueError` naming the
tensor. `num_streams > 1` / `mtp_depth > 0` upcycle (upcycle.py). Details: docs/interop.md.
Left out: architectures outside the Llama family (hf_config.py lists those mapped).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from birkhoff.config import ModelConfig
from birkhoff.interop.hf_config import model_config_from_hf
from birkhoff.interop.streaming import (
    SafetensorsSource,
    StreamingWriter,
    TensorSource,
    TensorSpec,
)
from birkhoff.interop.upcycle import hyper_tensor, is_upcycled, mtp_built_tensor, mtp_source
from birkhoff.model.transformer import Transformer
from birkhoff.runtime.checkpoint import (
    CONFIG_FILE,
    FORMAT_VERSION,
    MANIFEST_FILE,
    META_FILE,
    MODEL_FILE,
    RNG_FILE,
    capture_rng_state,
    commit_dir,
    torch_bytes,
)

HF_CONFIG_FILE = "hf_config.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
)
HF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn.wq.weight",
    "self_attn.q_proj.bias": "attn.wq.bias",
    "self_attn.k_proj.weight": "attn.wk.weight",
    "self_attn.k_proj.bias": "attn.wk.bias",
    "self_attn.v_proj.weight": "attn.wv.weight",
    "self_attn.v_proj.bias": "attn.wv.bias",
    "self_attn.o_proj.weight": "attn.wo.weight",
    "self_attn.o_proj.bias": "attn.wo.bias",
    "self_attn.q_norm.weight": "attn.q_norm.weight",
    "self_attn.k_norm.weight": "attn.k_norm.weight",
    "post_attention_layernorm.weight": "mlp_norm.weight",
    "mlp.gate_proj.weight": "mlp.w_gate.weight",
    "mlp.up_proj.weight": "mlp.w_up.weight",
    "mlp.down_proj.weight": "mlp.w_down.weight",
}
HF_TOP_NAMES = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}


def birkhoff_name(hf_name: str) -> str | None:
    """Trainer-layout name of an HF tensor name (None if it has none)."""
    if hf_name in HF_TOP_NAMES:
        return HF_TOP_NAMES[hf_name]
    parts = hf_name.split(".", 3)  # model, layers, i, rest
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in HF_LAYER_NAMES:
        return f"layers.{parts[2]}.{HF_LAYER_NAMES[parts[3]]}"
    return None


def hf_name(name: str) -> str | None:
    """HF tensor name of a trainer-layout name (None if HF has no such tensor)."""
    for hf, ours in HF_TOP_NAMES.items():
        if ours == name:
            return hf
    parts = name.split(".", 2)  # layers, i, rest
    if len(parts) == 3 and parts[0] == "layers":
        for hf, ours in HF_LAYER_NAMES.items():
            if ours == parts[2]:
                return f"model.layers.{parts[1]}.{hf}"
    return None


def expected_specs(cfg: ModelConfig) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """(stored name -> shape, alias -> stored name) of a Transformer(cfg) checkpoint."""
    with torch.device("meta"):
        model = Transformer(cfg)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    aliases = {"lm_head.weight": "embed.weight"} if cfg.tie_embeddings else {}
    for alias in aliases:
        del shapes[alias]
    return shapes, aliases


def map_source(source: TensorSource, cfg: ModelConfig) -> dict[str, str]:
    """Trainer name -> source name for every dense tensor; unknown source tensors raise."""
    mapped, unknown = {}, []
    for name in source.names():
        ours = birkhoff_name(name)
        if name.endswith("rotary_emb.inv_freq"):
            continue  # recomputed from the config
        if ours is None:
            unknown.append(name)
        elif ours == "lm_head.weight" and cfg.tie_embeddings:
            if not torch.equal(source.get(name), source.get("model.embed_tokens.weight")):
                raise ValueError("tie_word_embeddings=True but lm_head.weight != embed_tokens")
        else:
            mapped[ours] = name
    if unknown:
        raise ValueError(f"checkpoint tensors with no birkhoff equivalent: {unknown}")
    return mapped


Producer = Callable[[], Tensor]


def plan_tensors(
    cfg: ModelConfig, source: TensorSource
) -> tuple[list[tuple[str, TensorSpec]], dict[str, Producer], dict[str, str]]:
    """(write plan, name -> tensor producer, aliases): dense, copied-for-MTP and upcycled tensors.

    Producers run lazily, one at a time, while the model file is written.
    """
    shapes, aliases = expected_specs(cfg)
    mapped = map_source(source, cfg)
    embed_dtype = source.spec(mapped["embed.weight"]).dtype if "embed.weight" in mapped else None
    plan: list[tuple[str, TensorSpec]] = []
    producers: dict[str, Producer] = {}
    missing: list[str] = []
    for name, shape in shapes.items():
        copied = mapped.get(mtp_source(cfg, name) or name)
        if copied is not None:
            spec = source.spec(copied)
            producers[name] = partial(source.get, copied)
        elif is_upcycled(name):
            spec = TensorSpec(shape, torch.float32)
            producers[name] = partial(hyper_tensor, cfg, name)
        elif name.startswith("mtp.") and embed_dtype is not None:
            spec = TensorSpec(shape, embed_dtype)
            producers[name] = partial(mtp_built_tensor, cfg, name, embed_dtype)
        else:
            missing.append(hf_name(name) or name)
            continue
        if spec.shape != shape:
            raise ValueError(f"{copied}: shape {spec.shape}, the config implies {shape}")
        plan.append((name, spec))
    if missing:
        raise ValueError(f"checkpoint is missing tensors: {missing}")
    return plan, producers, aliases


def write_checkpoint_dir(
    path: Path, files: dict[str, bytes], write_model: Callable[[Path], tuple[int, str]]
) -> Path:
    """Fill a temp dir (small `files` + the streamed model file), manifest last, then commit."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        tmp.chmod(0o755)
        manifest: dict[str, Any] = {"format": FORMAT_VERSION, "files": {}}
        num_bytes, sha = write_model(tmp)
        manifest["files"][MODEL_FILE] = {"bytes": num_bytes, "sha256": sha}
        for name, data in files.items():
            (tmp / name).write_bytes(data)
            manifest["files"][name] = {
                "bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
            }
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2))
        commit_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def side_files(directory: Path) -> dict[str, bytes]:
    """Tokenizer and generation files present in an HF directory, byte for byte."""
    return {
        name: (directory / name).read_bytes()
        for name in TOKENIZER_FILES
        if (directory / name).is_file()
    }


def write_imported(
    out: str | os.PathLike[str],
    cfg: ModelConfig,
    source: TensorSource,
    *,
    extra: dict[str, Any],
    side: dict[str, bytes],
) -> Path:
    """The checkpoint of `cfg` at `out`, tensors streamed from `source`, `side` files beside."""
    planned = plan_tensors(cfg, source)
    return write_planned(out, cfg, planned, extra=extra, side=side)


Planned = tuple[list[tuple[str, TensorSpec]], dict[str, Producer], dict[str, str]]


def write_planned(
    out: str | os.PathLike[str],
    cfg: ModelConfig,
    planned: Planned,
    *,
    extra: dict[str, Any],
    side: dict[str, bytes],
) -> Path:
    """The checkpoint of `cfg` at `out` from a (plan, producers, aliases) triple."""
    plan, producers, aliases = planned
    meta = {
        "format": FORMAT_VERSION,
        "step": 0,
        "aliases": aliases,
        "has_optimizer": False,
        "torch": torch.__version__,
        "extra": extra,
    }

    def write_model(tmp: Path) -> tuple[int, str]:
        writer = StreamingWriter(tmp / MODEL_FILE, plan)
        for name, _ in plan:
            writer.write(name, producers[name]())
        return writer.close()

    files = {
        CONFIG_FILE: cfg.to_json().encode(),
        RNG_FILE: torch_bytes(capture_rng_state()),
        META_FILE: json.dumps(meta, indent=2, sort_keys=True).encode(),
        **side,
    }
    return write_checkpoint_dir(Path(out), files, write_model)


def import_hf(
    directory: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    num_streams: int = 1,
    mtp_depth: int = 0,
    max_seq_len: int | None = None,
) -> Path:
    """Write a birkhoff checkpoint at `out` from the HF checkpoint in `directory`.

    `num_streams` S and `mtp_depth` M upcycle the dense model (logits unchanged at init);
    `max_seq_len` defaults to the checkpoint's context (capped at a sliding window).
    """
    src = Path(directory)
    if not (src / "config.json").is_file():
        raise ValueError(f"{src}: config.json not found (not a HuggingFace checkpoint directory)")
    hf_bytes = (src / "config.json").read_bytes()
    hf = json.loads(hf_bytes)
    cfg = model_config_from_hf(
        hf, num_streams=num_streams, mtp_depth=mtp_depth, max_seq_len=max_seq_len
    )
    extra = {"hf_import": {"source": str(src), "model_type": hf["model_type"]}}
    side = {HF_CONFIG_FILE: hf_bytes, **side_files(src)}
    return write_imported(out, cfg, SafetensorsSource(src), extra=extra, side=side)
