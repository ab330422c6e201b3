"""Engine weights: the manifest of served tensors, and conversion of incoming tensors to it.

The engine serves the inference layout of `birkhoff.refit.layout` (fused q/k/v and gate/up, the
MTP drafter included) as one flat `dict[str, Tensor]`. The manifest lists every served tensor with
its shape and dtype; refit checks a whole update against it before the engine commits.

Design choices:
- One dtype for every non-quantized tensor (the engine's `dtype`); norms and mHC coefficients are
  upcast to fp32 inside the pure model functions anyway.
- With `quantize="fp8"` exactly the matmul weights (`is_matmul_weight`) are stored as
  float8_e4m3fn plus `name + "_scale_inv"` (fp32, one scale per 128x128 block). Norms, embeddings
  (also when tied to the lm_head) and mHC coefficients stay in `dtype`.
Left out: per-channel scales, int8/int4, sharding across devices.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from birkhoff.config import ModelConfig
from birkhoff.refit.fp8 import (
    FP8_BLOCK,
    FP8_DTYPE,
    SCALE_SUFFIX,
    quantize_fp8_blockwise,
    scale_shape,
)
from birkhoff.refit.layout import engine_shapes, is_matmul_weight

Quantize = Literal["fp8"] | None


class TensorSpec(NamedTuple):
    shape: tuple[int, ...]
    dtype: torch.dtype


def build_manifest(
    cfg: ModelConfig, *, dtype: torch.dtype, quantize: Quantize
) -> dict[str, TensorSpec]:
    """Name -> TensorSpec of every tensor the engine serves (main model and MTP drafter)."""
    manifest: dict[str, TensorSpec] = {}
    for name, shape in engine_shapes(cfg).items():
        if quantize == "fp8" and is_matmul_weight(name):
            manifest[name] = TensorSpec(shape, FP8_DTYPE)
            manifest[name + SCALE_SUFFIX] = TensorSpec(scale_shape(shape, FP8_BLOCK), torch.float32)
        else:
            manifest[name] = TensorSpec(shape, dtype)
    return manifest


def convert(
    named: Iterable[tuple[str, Tensor]],
    manifest: dict[str, TensorSpec],
    *,
    device: torch.device,
) -> Iterator[tuple[str, Tensor]]:
    """Engine-layout (name, tensor) pairs -> served pairs: cast, or quantize to fp8 + scales.

    Raises ValueError for a name the manifest does not list or a shape it does not expect.
    """
    for name, tensor in named:
        spec = manifest.get(name)
        if spec is None:
            raise ValueError(f"engine does not serve a tensor named {name!r}")
        if tuple(tensor.shape) != spec.shape:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} != expected {spec.shape}")
        if spec.dtype == FP8_DTYPE and tensor.dtype != FP8_DTYPE:
            q, scale_inv = quantize_fp8_blockwise(tensor.to(device), block=FP8_BLOCK)
            yield name, q
            yield name + SCALE_SUFFIX, scale_inv.to(torch.float32)
        else:
            yield name, tensor.detach().to(device=device, dtype=spec.dtype).clone()


def check_weights(weights: dict[str, Tensor], manifest: dict[str, TensorSpec]) -> None:
    """Invariant: `weights` holds exactly the manifest's names with its shapes and dtypes."""
    missing = sorted(set(manifest) - set(weights))
    extra = sorted(set(weights) - set(manifest))
    assert not missing and not extra, (
        f"weights differ from manifest: missing {missing}, extra {extra}"
    )
    bad = [
        name
        for name, spec in manifest.items()
        if tuple(weights[name].shape) != spec.shape or weights[name].dtype != spec.dtype
    ]
    assert not bad, f"weights with wrong shape or dtype: {bad}"
