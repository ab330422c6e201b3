"""Refit: stream trainer weights into the engine in buckets, one completeness check, atomic commit.

Modules: bucket (placement, byte buffers + metadata, reassembly), pack (the memoised refit
layout, banks of bucket memory, filling them from the model), session (staging, the one
completeness check, atomic commit), transport (in-process; torch.distributed broadcast), api
(`refit`). The engine's layout and fp8 format come from `birkhoff.engine`.
"""

from birkhoff.refit.api import DEFAULT_BUCKET_BYTES, refit
from birkhoff.refit.bucket import Bucket, BucketEntry
from birkhoff.refit.session import RefitError, RefitReport, RefitSession
from birkhoff.refit.transport import BroadcastSender, InProcessTransport, serve_refit

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "Bucket",
    "BucketEntry",
    "BroadcastSender",
    "InProcessTransport",
    "RefitError",
    "RefitReport",
    "RefitSession",
    "refit",
    "serve_refit",
]
