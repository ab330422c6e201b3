"""`refit(model, engine)`: trainer weights -> engine layout -> (fp8) -> buckets -> session.

The pipeline is a stream: trainer tensors are visited once (`state_dict` references, no copy),
grouped into engine tensors by the shared layout mapping, and each engine tensor is written
straight into a bucket with the cast to the engine dtype fused into that copy. In process, the
session adopts the buckets (their whole tensors become the served weights), so that copy is the
only pass over the data. Fused
projections (q/k/v, gate/up) are packed part by part, so the engine state is never materialised on
the sender; only fp8 matmul weights are concatenated first, because their 128x128 scale blocks
straddle the part boundaries. The engine's manifest decides each tensor's dtype: a matmul weight
served as fp8 is quantized on the sender's device and followed by its `<name>_scale_inv`.
A successful refit records a `RefitPlan` (refit/plan.py) that later refits replay: the copies
(and the quantizations) without the traversal, and into reusable buffers.

Everything after `begin` runs under one try: any exception aborts the session, so the engine never
commits a partial update.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from birkhoff.config import ModelConfig
from birkhoff.refit.bucket import MIN_BUCKET_BYTES, Bucket, BucketPacker
from birkhoff.refit.fp8 import FP8_DTYPE, SCALE_SUFFIX, quantize_parts
from birkhoff.refit.layout import engine_sources, is_matmul_weight, trainer_tensors
from birkhoff.refit.plan import QuantizedSources, RefitPlan, cached_plan, store_plan
from birkhoff.refit.session import RefitReport, RefitTarget
from birkhoff.refit.transport import InProcessTransport, Transport

DEFAULT_BUCKET_BYTES = 256 * 2**20


def manifest_quantize(manifest: Mapping[str, Any]) -> str | None:
    """'fp8' if the manifest serves any matmul weight in fp8, else None."""
    fp8 = any(spec.dtype == FP8_DTYPE and is_matmul_weight(n) for n, spec in manifest.items())
    return "fp8" if fp8 else None


def pack_engine_tensor(
    packer: BucketPacker,
    name: str,
    parts: list[Tensor],
    manifest: Mapping[str, Any],
    quantized: QuantizedSources,
) -> Iterator[Bucket]:
    """Buckets filled while packing one engine tensor in the manifest's dtype (fp8 + scale)."""
    spec = manifest.get(name)
    if spec is None:  # not served: send as-is so finish() reports it as unexpected
        yield from packer.add(name, parts, parts[0].dtype)
        return
    if spec.dtype != FP8_DTYPE:
        yield from packer.add(name, parts, spec.dtype)
        return
    q, scale_inv = quantize_parts(parts, packer.device)
    q_as, scale_as = quantized.note(parts, q, scale_inv)
    yield from packer.add(name, [q], FP8_DTYPE, record_as=[q_as])
    yield from packer.add(name + SCALE_SUFFIX, [scale_inv], torch.float32, record_as=[scale_as])


def refit(
    model: torch.nn.Module,
    engine: RefitTarget | None,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    quantize: str | None = None,
    transport: Transport | None = None,
    check_finite: bool = False,
) -> RefitReport:
    """Stream `model`'s weights into `engine` (or through `transport`) and commit atomically.

    `quantize` must agree with the engine: None for an engine serving bf16/fp32 weights, "fp8"
    for one serving block-scaled fp8 matmul weights. Raises RefitError (engine unchanged) when the
    update is incomplete or malformed, ValueError for bad arguments.
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
    adopts = transport.adopts_buckets
    transport.begin()
    try:
        manifest = transport.manifest()
        served = manifest_quantize(manifest)
        if served != quantize:
            raise ValueError(f"quantize={quantize!r} but the engine serves quantize={served!r}")
        plan = cached_plan(
            model, manifest, bucket_bytes=bucket_bytes, device=transport.device, adopts=adopts
        )
        with torch.no_grad():
            if plan is not None:
                for bucket in plan.buckets_now():
                    transport.send(bucket)
            else:
                quantized = QuantizedSources()
                packer = stream_buckets(model, cfg, transport, manifest, bucket_bytes, quantized)
        report = transport.finish(check_finite=check_finite)
    except BaseException:
        transport.abort()  # idempotent: a no-op once finish() has ended the session
        raise
    if plan is None:  # a layout that just committed: replay it next time
        store_plan(model, RefitPlan(model, packer, manifest, quantized, adopts=adopts))
    return report


def stream_buckets(
    model: torch.nn.Module,
    cfg: ModelConfig,
    transport: Transport,
    manifest: Mapping[str, Any],
    bucket_bytes: int,
    quantized: QuantizedSources,
) -> BucketPacker:
    """The planless refit: traverse, group, pack and send; returns the (recording) packer."""
    num_buffers = None if transport.adopts_buckets else 2
    packer = BucketPacker(
        bucket_bytes, device=transport.device, num_buffers=num_buffers, record=True
    )
    # Parameters themselves (not detached views) so that a recorded plan reads current values
    for name, parts in engine_sources(trainer_tensors(model, cfg, detach=False)):
        for bucket in pack_engine_tensor(packer, name, parts, manifest, quantized):
            transport.send(bucket)
    for bucket in packer.flush():
        transport.send(bucket)
    return packer
