"""Tensor-by-tensor safetensors reading (single file or sharded) and writing.

Design choices:
- `SafetensorsSource` opens `model.safetensors` or the shards named by
  `model.safetensors.index.json` with `safe_open`, which memory-maps the files: shapes and dtypes
  are known without reading data, and `get` reads one tensor at a time.
- `StreamingWriter` writes the safetensors format directly (8-byte little-endian header length,
  JSON header, raw little-endian data, tensors back to back): the header is computed from the
  planned (name, shape, dtype) list, then each tensor is written and hashed as it arrives, so
  a checkpoint of any size passes through memory one tensor at a time. `safetensors.save` would
  need every tensor in memory at once. Tensors must arrive in the planned order with the planned
  shape and dtype (an assert-level contract: the import plans and writes from one list).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import torch
from safetensors import safe_open
from torch import Tensor

DTYPE_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e8m0fnu: "F8_E8M0",  # DeepSeek-V4's block scales (powers of two)
}
SINGLE_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"


class TensorSpec(NamedTuple):
    shape: tuple[int, ...]
    dtype: torch.dtype


class TensorSource(Protocol):
    """Named tensors read one at a time (a safetensors checkpoint, a GGUF file)."""

    def names(self) -> list[str]: ...

    def __contains__(self, name: str) -> bool: ...

    def spec(self, name: str) -> TensorSpec: ...

    def get(self, name: str) -> Tensor: ...


def dtype_of_name(name: str) -> torch.dtype:
    for dtype, dtype_name in DTYPE_NAMES.items():
        if dtype_name == name:
            return dtype
    raise ValueError(f"safetensors dtype {name!r} is not supported")


class SafetensorsSource:
    """Read-only view of a checkpoint's tensors, single-file or sharded, one tensor at a time."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        root = Path(directory)
        if (root / INDEX_FILE).is_file():
            weight_map = json.loads((root / INDEX_FILE).read_text())["weight_map"]
            shard_of = {name: root / file for name, file in weight_map.items()}
        elif (root / SINGLE_FILE).is_file():
            shard_of = {}
        else:
            raise ValueError(f"{root}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
        self._handles: dict[Path, Any] = {}
        self._shard_of: dict[str, Path] = {}
        for shard in sorted(set(shard_of.values())) or [root / SINGLE_FILE]:
            if not shard.is_file():
                raise ValueError(f"{shard}: shard listed in {INDEX_FILE} is missing")
            handle = safe_open(str(shard), framework="pt")
            self._handles[shard] = handle
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                self._shard_of[name] = shard
        missing = sorted(set(shard_of) - set(self._shard_of))
        if missing:
            raise ValueError(f"{root}: tensors listed in {INDEX_FILE} are missing: {missing}")

    def names(self) -> list[str]:
        return sorted(self._shard_of)

    def __contains__(self, name: str) -> bool:
        return name in self._shard_of

    def spec(self, name: str) -> TensorSpec:
        sl = self._handles[self._shard_of[name]].get_slice(name)
        return TensorSpec(tuple(sl.get_shape()), dtype_of_name(sl.get_dtype()))

    def get(self, name: str) -> Tensor:
        return self._handles[self._shard_of[name]].get_tensor(name)


def header_bytes(plan: list[tuple[str, TensorSpec]], metadata: dict[str, str]) -> bytes:
    """Length prefix + JSON header (padded with spaces to 8 bytes) for tensors laid out in order."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, spec in plan:
        nbytes = spec.dtype.itemsize * int(torch.Size(spec.shape).numel())
        header[name] = {
            "dtype": DTYPE_NAMES[spec.dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


class StreamingWriter:
    """Write a safetensors file tensor by tensor in a planned order; tracks size and sha256."""

    def __init__(
        self,
        path: Path,
        plan: list[tuple[str, TensorSpec]],
        metadata: dict[str, str] | None = None,
    ) -> None:
        self.path, self.plan, self.next = path, plan, 0
        self.sha256, self.num_bytes = hashlib.sha256(), 0
        self.file = open(path, "wb")  # noqa: SIM115 (closed in close())
        self._write(header_bytes(plan, metadata or {}))

    def _write(self, data: bytes | memoryview) -> None:
        self.file.write(data)
        self.sha256.update(data)
        self.num_bytes += len(data)

    def write(self, name: str, tensor: Tensor) -> None:
        expected_name, spec = self.plan[self.next]
        assert name == expected_name, f"wrote {name}, planned {expected_name}"
        assert (tuple(tensor.shape), tensor.dtype) == spec, f"{name}: {tensor.shape} {spec}"
        flat = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        self._write(flat.numpy().data)
        self.next += 1

    def close(self) -> tuple[int, str]:
        """Flush and fsync; returns (bytes, sha256 hex). Every planned tensor must be written."""
        assert self.next == len(self.plan), f"{len(self.plan) - self.next} tensors not written"
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        return self.num_bytes, self.sha256.hexdigest()
