"""Import and export of DeepSeek-V4 checkpoint directories (transformers' layout plus `mtp.*`).

Import streams one birkhoff tensor at a time (hf_import.py's plan / producer / atomic-commit
path): its transformers tensors (v4_names.py; two are concatenated for the shared expert's
gate_up and an MTP depth's merge projection) are read, block-fp8 ones (`e4m3` + fp32
`NAME_scale_inv`, 128x128 blocks) dequantized to `fp8_dtype`. Every expected tensor must be
there with the shape the config implies, and every source tensor must be used: anything else
raises a `ValueError` naming the transformers tensor. Export writes them back under the same
names in the stored dtype (an imported bf16/fp32 checkpoint round-trips bit for bit), or with
`fp8=True` the matmul weights as e4m3 + scales (engine/fp8.py's quantization).
Left out: DeepSeek's original key names, e8m0 scales, sharded output files.
"""

from __future__ import annotations

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
    unknown = [n for n in source.names() if n not in used and not is_ignored(n)]
    if unknown:
        raise ValueError(f"checkpoint tensors with no birkhoff equivalent: {unknown}")
    return plan, producers, aliases


def import_v4(
    directory: str | os.PathLike[str],
    out: str | os.PathLike[str],
    cfg: ModelConfig,
    *,
    fp8_dtype: torch.dtype = torch.float32,
) -> Path:
    """Write a birkhoff checkpoint of `cfg` at `out` from the V4 checkpoint in `directory`
    (config.json is kept beside, for export); fp8 weights are dequantized to `fp8_dtype`."""
    src = Path(directory)
    if not (src / "config.json").is_file():
        raise ValueError(f"{src}: config.json not found (not a checkpoint directory)")
    hf_bytes = (src / "config.json").read_bytes()
    planned = plan_v4(cfg, SafetensorsSource(src), fp8_dtype=fp8_dtype)
    extra = {"hf_import": {"source": str(src), "model_type": json.loads(hf_bytes)["model_type"]}}
    side = {HF_CONFIG_FILE: hf_bytes, **side_files(src)}
    return write_planned(out, cfg, planned, extra=extra, side=side)


def is_fp8_weight(hf_name: str) -> bool:
    """Exported as fp8 with `fp8=True`: the projections and expert stacks (never embeddings,
    head, norms, router, mHC or the compressors' projections, which V4 keeps in bf16)."""
    matmul = hf_name.endswith(("_proj.weight", "experts.gate_up_proj", "experts.down_proj"))
    return matmul and ".compressor." not in hf_name


def export_entries(name: str, spec: TensorSpec, *, fp8: bool) -> list[tuple[str, TensorSpec]]:
    """The (transformers name, spec) pairs birkhoff tensor `name` is written as."""
    parts = hf_parts(name)
    if parts is None:
        raise ValueError(f"{name}: no DeepSeek-V4 equivalent")
    shape = list(spec.shape)
    shape[parts.dim] //= len(parts.names)
    entries = []
    for part in parts.names:
        if fp8 and is_fp8_weight(part):
            entries.append((part, TensorSpec(tuple(shape), FP8_DTYPE)))
            scale = TensorSpec(fp8_scale_shape(tuple(shape)), torch.float32)
            entries.append((part + SCALE_SUFFIX, scale))
        else:
            entries.append((part, TensorSpec(tuple(shape), spec.dtype)))
    return entries


def export_tensors(name: str, tensor: Tensor, *, fp8: bool) -> list[tuple[str, Tensor]]:
    """Birkhoff tensor `name` as its transformers tensors (split, optionally fp8 + scales)."""
    parts = hf_parts(name)
    assert parts is not None, name
    pieces = tensor.chunk(len(parts.names), dim=parts.dim)
    out: list[tuple[str, Tensor]] = []
    for part, piece in zip(parts.names, pieces, strict=True):
        if fp8 and is_fp8_weight(part):
            q, scale_inv = quantize_fp8_blockwise(piece.float().contiguous())
            out += [(part, q), (part + SCALE_SUFFIX, scale_inv)]
        else:
            out.append((part, piece.contiguous()))
    return out


def export_v4(
    ckpt: str | os.PathLike[str], out: str | os.PathLike[str], *, fp8: bool = False
) -> Path:
    """Write the birkhoff V4 checkpoint at `ckpt` as a V4 checkpoint directory at `out`
    (the imported config.json back; MTP depths as `mtp.{k}.*`)."""
    path = Path(ckpt)
    manifest = read_manifest(path)
    parse_config(path / CONFIG_FILE, read_verified(path, manifest, CONFIG_FILE))
    if HF_CONFIG_FILE not in manifest:
        raise ValueError(f"{path}: no {HF_CONFIG_FILE}; export needs an imported V4 checkpoint")
    files = {CONFIG_FILE: read_verified(path, manifest, HF_CONFIG_FILE)}
    model_file = verify_streaming(path, manifest, MODEL_FILE)
    with safe_open(str(model_file), framework="pt") as handle:
        plan: list[tuple[str, str, TensorSpec]] = []
        for n in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
            sl = handle.get_slice(n)
            spec = TensorSpec(tuple(sl.get_shape()), dtype_of_name(sl.get_dtype()))
            plan += [(hf, n, s) for hf, s in export_entries(n, spec, fp8=fp8)]
        return write_hf_dir(Path(out), files, plan, _Splitter(handle, fp8=fp8))


class _Splitter:
    """`write_hf_dir`'s tensor reader: it asks for birkhoff tensor `name` once per transformers
    tensor, in plan order; each birkhoff tensor is read once and handed out piece by piece."""

    def __init__(self, handle: Any, *, fp8: bool) -> None:
        self.handle, self.fp8 = handle, fp8
        self.pending: list[Tensor] = []

    def get_tensor(self, name: str) -> Tensor:
        if not self.pending:
            pieces = export_tensors(name, self.handle.get_tensor(name), fp8=self.fp8)
            self.pending = [t for _, t in pieces]
        return self.pending.pop(0)
