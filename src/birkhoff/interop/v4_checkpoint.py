"""Import and export of DeepSeek-V4 checkpoint directories (transformers' layout plus `mtp.*`,
or DeepSeek's original names: v4_deepseek.py reads either, or a mix, as transformers' names).

The config comes from config.json (v4_config.py). Import streams one birkhoff tensor at a time
(hf_import.py's plan / producer / atomic-commit path): its transformers tensors (v4_names.py;
two are concatenated for the shared expert's gate_up and an MTP depth's merge projection) are
read, block-fp8 ones (`e4m3` + fp32 `NAME_scale_inv`, 128x128 blocks) dequantized to
`fp8_dtype`. Every expected tensor must be there with the shape the config implies, and every
source tensor must be used: anything else raises a `ValueError` naming the tensor. Export
writes them back in the stored dtype (an imported bf16/fp32 checkpoint round-trips bit for bit)
with the imported config.json (or one written from the config), in transformers' names or
(`layout="deepseek"`) DeepSeek's; `fp8=True` writes the matmul weights as e4m3 + scales.
Left out: fp4 experts, writing e8m0 scales, sharded output files.
"""

from __future__ import annotations

import dataclasses
import json
import os
from functools import partial
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

from birkhoff.config import ModelConfig
from birkhoff.engine.fp8 import FP8_DTYPE, dequantize_fp8_blockwise, quantize_fp8_blockwise
from birkhoff.engine.fp8 import scale_shape as fp8_scale_shape
from birkhoff.interop.hf_export import verify_streaming, write_hf_dir
from birkhoff.interop.hf_import import (
    HF_CONFIG_FILE,
    TOKENIZER_FILES,
    Planned,
    Producer,
    expected_specs,
    side_files,
    write_planned,
)
from birkhoff.interop.streaming import (
    SafetensorsSource,
    TensorSource,
    TensorSpec,
    dtype_of_name,
)
from birkhoff.interop.v4_config import model_config_from_v4, v4_config_from_model
from birkhoff.interop.v4_deepseek import V4Source, deepseek_scale_name, deepseek_tensors
from birkhoff.interop.v4_names import SCALE_SUFFIX, Parts, hf_parts, is_ignored
from birkhoff.runtime.checkpoint import (
    CONFIG_FILE,
    MODEL_FILE,
    parse_config,
    read_manifest,
    read_verified,
)


def part_spec(source: TensorSource, name: str, fp8_dtype: torch.dtype) -> TensorSpec:
    """(shape, dtype) tensor `name` is imported as: fp8 with a scale becomes `fp8_dtype`."""
    spec = source.spec(name)
    scale = name + SCALE_SUFFIX
    if scale not in source:
        if spec.dtype == FP8_DTYPE:
            raise ValueError(f"{name}: fp8 weight without its block scales {scale}")
        return spec
    expected = fp8_scale_shape(spec.shape)
    if source.spec(scale).shape != expected:
        got = source.spec(scale).shape
        raise ValueError(f"{scale}: shape {got}, {name} of shape {spec.shape} needs {expected}")
    return TensorSpec(spec.shape, fp8_dtype)


def read_part(source: TensorSource, name: str, fp8_dtype: torch.dtype) -> Tensor:
    """Tensor `name`, dequantized when it carries block scales."""
    scale = name + SCALE_SUFFIX
    if scale not in source:
        return source.get(name)
    return dequantize_fp8_blockwise(source.get(name), source.get(scale), dtype=fp8_dtype)


def read_parts(source: TensorSource, parts: Parts, fp8_dtype: torch.dtype) -> Tensor:
    tensors = [read_part(source, name, fp8_dtype) for name in parts.names]
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=parts.dim)


def joined_shape(specs: list[TensorSpec], dim: int) -> tuple[int, ...]:
    shape = list(specs[0].shape)
    if len(specs) > 1 and all(len(s.shape) == len(shape) for s in specs):
        shape[dim] = sum(s.shape[dim] for s in specs)
    return tuple(shape)


def is_dropped(hf_name: str, cfg: ModelConfig) -> bool:
    """A tensor of an MTP depth the import leaves out (`mtp.{k}.*` with k >= cfg.mtp_depth)."""
    head, _, rest = hf_name.partition(".")
    index = rest.partition(".")[0]
    return head == "mtp" and index.isdigit() and int(index) >= cfg.mtp_depth


def plan_v4(cfg: ModelConfig, source: TensorSource, *, fp8_dtype: torch.dtype) -> Planned:
    """(write plan, producers, aliases) of a birkhoff V4 checkpoint read from `source`."""
    shapes, aliases = expected_specs(cfg)
    plan: list[tuple[str, TensorSpec]] = []
    producers: dict[str, Producer] = {}
    missing: list[str] = []
    used: set[str] = set()
    for name, shape in shapes.items():
        parts = hf_parts(name)
        if parts is None:
            raise ValueError(f"{name}: no DeepSeek-V4 tensor maps to this birkhoff tensor")
        absent = [part for part in parts.names if part not in source]
        if absent:
            missing += absent
            continue
        specs = [part_spec(source, part, fp8_dtype) for part in parts.names]
        got = joined_shape(specs, parts.dim)
        if got != shape:
            raise ValueError(f"{' + '.join(parts.names)}: shape {got}, the config implies {shape}")
        used.update(parts.names, (part + SCALE_SUFFIX for part in parts.names))
        plan.append((name, TensorSpec(shape, specs[0].dtype)))
        producers[name] = partial(read_parts, source, parts, fp8_dtype)
    if missing:
        raise ValueError(f"checkpoint is missing tensors: {missing}")
    unknown = [
        n for n in source.names() if n not in used and not is_ignored(n) and not is_dropped(n, cfg)
    ]
    if unknown:
        raise ValueError(f"checkpoint tensors with no birkhoff equivalent: {unknown}")
    return plan, producers, aliases


def import_v4(
    directory: str | os.PathLike[str],
    out: str | os.PathLike[str],
    cfg: ModelConfig | None = None,
    *,
    mtp_depth: int | None = None,
    max_seq_len: int | None = None,
    fp8_dtype: torch.dtype = torch.float32,
) -> Path:
    """Write a birkhoff checkpoint at `out` from the V4 checkpoint in `directory` (either
    layout); the config is config.json's (v4_config.py) unless `cfg` is given, keeping the
    first `mtp_depth` MTP depths. fp8 weights are dequantized to `fp8_dtype`; config.json is
    kept beside, for export."""
    src = Path(directory)
    if not (src / "config.json").is_file():
        raise ValueError(f"{src}: config.json not found (not a checkpoint directory)")
    hf_bytes = (src / "config.json").read_bytes()
    hf = json.loads(hf_bytes)
    if cfg is None:
        cfg = model_config_from_v4(hf, mtp_depth=mtp_depth, max_seq_len=max_seq_len)
    source = V4Source(SafetensorsSource(src), fp8_dtype=fp8_dtype)
    planned = plan_v4(cfg, source, fp8_dtype=fp8_dtype)
    extra = {"hf_import": {"source": str(src), "model_type": hf["model_type"]}}
    side = {HF_CONFIG_FILE: hf_bytes, **side_files(src)}
    return write_planned(out, cfg, planned, extra=extra, side=side)


def is_fp8_weight(hf_name: str) -> bool:
    """Exported as fp8 with `fp8=True`: the projections and expert stacks (never embeddings,
    head, norms, router, mHC or the compressors' projections, which V4 keeps in bf16)."""
    matmul = hf_name.endswith(("_proj.weight", "experts.gate_up_proj", "experts.down_proj"))
    return matmul and ".compressor." not in hf_name


LAYOUTS = ("transformers", "deepseek")


def layout_tensors(name: str, tensor: Tensor, layout: str) -> list[tuple[str, Tensor, bool]]:
    """(name, tensor, fp8 candidate) of birkhoff tensor `name` in `layout`: split into its
    transformers tensors, then (deepseek) renamed and the expert stacks split per expert."""
    parts = hf_parts(name)
    if parts is None:
        raise ValueError(f"{name}: no DeepSeek-V4 equivalent")
    pieces = tensor.chunk(len(parts.names), dim=parts.dim)
    out = []
    for part, piece in zip(parts.names, pieces, strict=True):
        named = deepseek_tensors(part, piece) if layout == "deepseek" else [(part, piece)]
        out += [(n, t, is_fp8_weight(part)) for n, t in named]
    return out


def scale_name(weight: str, layout: str) -> str:
    return deepseek_scale_name(weight) if layout == "deepseek" else weight + SCALE_SUFFIX


def export_entries(
    name: str, spec: TensorSpec, *, fp8: bool, layout: str = "transformers"
) -> list[tuple[str, TensorSpec]]:
    """The (name, spec) pairs birkhoff tensor `name` is written as (`export_tensors`' specs)."""
    meta = torch.empty(spec.shape, dtype=spec.dtype, device="meta")
    entries = []
    for n, piece, candidate in layout_tensors(name, meta, layout):
        shape = tuple(piece.shape)
        if fp8 and candidate:
            scale = TensorSpec(fp8_scale_shape(shape), torch.float32)
            entries += [(n, TensorSpec(shape, FP8_DTYPE)), (scale_name(n, layout), scale)]
        else:
            entries.append((n, TensorSpec(shape, spec.dtype)))
    return entries


def export_tensors(
    name: str, tensor: Tensor, *, fp8: bool, layout: str = "transformers"
) -> list[tuple[str, Tensor]]:
    """Birkhoff tensor `name` as the checkpoint's tensors (split, renamed for `layout`,
    optionally fp8 + block scales)."""
    out: list[tuple[str, Tensor]] = []
    for n, piece, candidate in layout_tensors(name, tensor, layout):
        if fp8 and candidate:
            q, scale_inv = quantize_fp8_blockwise(piece.float().contiguous())
            out += [(n, q), (scale_name(n, layout), scale_inv)]
        else:
            out.append((n, piece.contiguous()))
    return out


def architecture(cfg: ModelConfig) -> ModelConfig:
    """cfg with its training options (not in a V4 config.json) at fixed values."""
    moe = cfg.moe and dataclasses.replace(cfg.moe, bias_update_rate=0.0, balance_loss_weight=0.0)
    return cfg.replace(mtp_loss_weight=0.0, residual_dtype="fp32", moe=moe)


def export_config(cfg: ModelConfig, original: bytes | None) -> bytes:
    """config.json: the imported one (its MTP depth count set to cfg's) when it still
    describes `cfg`, else one written from `cfg`."""
    if original is None:
        return (json.dumps(v4_config_from_model(cfg), indent=2) + "\n").encode()
    hf = json.loads(original)
    if hf.get("num_nextn_predict_layers", 1) != cfg.mtp_depth:
        hf["num_nextn_predict_layers"] = cfg.mtp_depth
        if "compress_ratios" in hf:
            hf["compress_ratios"] = hf["compress_ratios"][: cfg.num_layers + cfg.mtp_depth]
        original = (json.dumps(hf, indent=2) + "\n").encode()
    imported = model_config_from_v4(hf, max_seq_len=cfg.max_seq_len)
    if architecture(imported) != architecture(cfg):
        raise ValueError(f"{HF_CONFIG_FILE} no longer describes the checkpoint's config {cfg}")
    return original


def export_v4(
    ckpt: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    fp8: bool = False,
    layout: str = "transformers",
) -> Path:
    """Write the birkhoff V4 checkpoint at `ckpt` as a V4 checkpoint directory at `out`, in
    transformers' names (MTP depths as `mtp.{k}.*`) or DeepSeek's (`layout="deepseek"`)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is invalid: one of {LAYOUTS}")
    path = Path(ckpt)
    manifest = read_manifest(path)
    cfg = parse_config(path / CONFIG_FILE, read_verified(path, manifest, CONFIG_FILE))
    original = read_verified(path, manifest, HF_CONFIG_FILE) if HF_CONFIG_FILE in manifest else None
    files = {CONFIG_FILE: export_config(cfg, original)}
    files |= {n: read_verified(path, manifest, n) for n in TOKENIZER_FILES if n in manifest}
    model_file = verify_streaming(path, manifest, MODEL_FILE)
    with safe_open(str(model_file), framework="pt") as handle:
        plan: list[tuple[str, str, TensorSpec]] = []
        for n in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
            sl = handle.get_slice(n)
            spec = TensorSpec(tuple(sl.get_shape()), dtype_of_name(sl.get_dtype()))
            plan += [(hf, n, s) for hf, s in export_entries(n, spec, fp8=fp8, layout=layout)]
        return write_hf_dir(Path(out), files, plan, _Splitter(handle, fp8=fp8, layout=layout))


class _Splitter:
    """`write_hf_dir`'s tensor reader: it asks for birkhoff tensor `name` once per checkpoint
    tensor, in plan order; each birkhoff tensor is read once and handed out piece by piece."""

    def __init__(self, handle: Any, *, fp8: bool, layout: str) -> None:
        self.handle, self.fp8, self.layout = handle, fp8, layout
        self.pending: list[Tensor] = []

    def get_tensor(self, name: str) -> Tensor:
        if not self.pending:
            tensor = self.handle.get_tensor(name)
            pieces = export_tensors(name, tensor, fp8=self.fp8, layout=self.layout)
            self.pending = [t for _, t in pieces]
        return self.pending.pop(0)
