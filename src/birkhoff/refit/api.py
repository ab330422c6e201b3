"""`refit(model, engine)`: trainer weights -> engine layout -> (fp8) -> buckets -> session.

One path for every refit: the memoised `refit_layout` of (the model's config, the engine's
manifest, the bucket size) says where each served tensor goes; the model's Parameters are looked
up by name (and their shapes checked) on every call; the transport lends the bucket memory
(`bank`), `fill` writes each bucket (bf16/fp32 casts fused into the copies, fp8 quantized straight
into the bucket) and the transport sends it; the session checks the whole update once and
commits atomically. Everything after `begin` runs under one try: any exception aborts the
session, so the engine never commits a partial update.

A model sharded with FSDP2 refits through the same path: its sources are DTensors, which
`refit.sharded.gathered` turns into full tensors one bucket at a time (every rank of the shard
group calls `refit` with its own engine, colocated).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from birkhoff.config import ModelConfig
from birkhoff.engine import Engine, TensorSpec
from birkhoff.engine.fp8 import FP8_DTYPE
from birkhoff.refit.bucket import MIN_BUCKET_BYTES
from birkhoff.refit.pack import fill, manifest_key, refit_layout
from birkhoff.refit.session import RefitReport
from birkhoff.refit.sharded import GatheredSources, gathered
from birkhoff.refit.transport import InProcessTransport, Transport

DEFAULT_BUCKET_BYTES = 256 * 2**20


def manifest_quantize(manifest: Mapping[str, TensorSpec]) -> str | None:
    """'fp8' if the manifest serves any tensor in fp8 (only matmul weights ever are), else None."""
    return "fp8" if any(spec.dtype == FP8_DTYPE for spec in manifest.values()) else None


def refit(
    model: torch.nn.Module,
    engine: Engine | None,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    quantize: str | None = None,
    transport: Transport | None = None,
    check_finite: bool = False,
) -> RefitReport:
    """Stream `model`'s weights into `engine` (or through `transport`) and commit atomically.

    `quantize` must agree with the engine: None for an engine serving bf16/fp32 weights, "fp8"
    for one serving block-scaled fp8 matmul weights. Raises RefitError (engine unchanged) when the
    update is incomplete or malformed (a trainer tensor missing or mis-shaped included),
    ValueError for bad arguments.
    """
    cfg = getattr(model, "cfg", None)
    if not isinstance(cfg, ModelConfig):
        raise ValueError(f"model must carry a ModelConfig as .cfg, got {type(cfg).__name__}")
    if quantize not in (None, "fp8"):
        raise ValueError(f"quantize={quantize!r} is invalid: None | 'fp8'")
    if transport is None:
        if engine is None:
            raise ValueError("engine=None needs a transport")
        transport = InProcessTransport(engine)
    if not isinstance(bucket_bytes, int) or bucket_bytes < MIN_BUCKET_BYTES:
        raise ValueError(f"bucket_bytes={bucket_bytes!r} is invalid: must be an int >= 16")
    transport.begin()
    try:
        manifest = transport.manifest()
        served = manifest_quantize(manifest)
        if served != quantize:
            raise ValueError(f"quantize={quantize!r} but the engine serves quantize={served!r}")
        layout = refit_layout(cfg, manifest_key(manifest), bucket_bytes)
        with torch.no_grad():
            sources = gathered(layout.sources(model))
            for bucket in fill(transport.bank(layout), sources, device=transport.device):
                transport.send(bucket)
                if isinstance(sources, GatheredSources):
                    sources.release()  # keep at most one bucket's gathered tensors
        return transport.finish(check_finite=check_finite)
    except BaseException:
        transport.abort()  # idempotent: a no-op once finish() has ended the session
        raise
