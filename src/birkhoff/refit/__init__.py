"""Refit: stream trainer weights into the engine in buckets, one completeness check, atomic commit.

Modules: layout (trainer -> engine names and fusions), fp8 (block-scaled e4m3), bucket (byte
buffers + metadata, chunking, reassembly), session (staging, the one completeness check, atomic
commit), transport (in-process; torch.distributed broadcast), api (`refit`).
"""

from birkhoff.refit.api import DEFAULT_BUCKET_BYTES, SCALE_SUFFIX, engine_sources, refit
from birkhoff.refit.bucket import Bucket, BucketEntry, BucketPacker, pack_buckets, unpack_buckets
from birkhoff.refit.fp8 import dequantize_fp8_blockwise, quantize_fp8_blockwise
from birkhoff.refit.session import RefitError, RefitReport, RefitSession
from birkhoff.refit.transport import BroadcastSender, InProcessTransport, serve_refit

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "SCALE_SUFFIX",
    "Bucket",
    "BucketEntry",
    "BucketPacker",
    "BroadcastSender",
    "InProcessTransport",
    "RefitError",
    "RefitReport",
    "RefitSession",
    "dequantize_fp8_blockwise",
    "engine_sources",
    "pack_buckets",
    "quantize_fp8_blockwise",
    "refit",
    "serve_refit",
    "unpack_buckets",
]
