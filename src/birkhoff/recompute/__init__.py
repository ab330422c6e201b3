"""Activation recompute with safe early reclaim, a use-after-free sanitizer and a leak census."""

from birkhoff.recompute.census import Census, PeakLiveBytes, census
from birkhoff.recompute.checkpoint import RECLAIM_MODES, checkpoint, default_label
from birkhoff.recompute.registry import (
    StorageRegistry,
    active_registry,
    last_registry,
    track_saved_storages,
)
from birkhoff.recompute.sanitizer import UseAfterFreeError, sanitize

__all__ = [
    "RECLAIM_MODES",
    "Census",
    "PeakLiveBytes",
    "StorageRegistry",
    "UseAfterFreeError",
    "active_registry",
    "census",
    "checkpoint",
    "default_label",
    "last_registry",
    "sanitize",
    "track_saved_storages",
]
