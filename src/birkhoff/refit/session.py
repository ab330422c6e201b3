"""RefitSession: stage buckets, check completeness once, commit atomically.

Protocol: `begin()` -> `load_bucket(bucket)` any number of times, in any order, with any bucket
size -> `finish(check_finite=False)` (or `abort()`). Buckets are written into staging tensors,
never into the live weights, so generation keeps using the previous version throughout.

The completeness check runs exactly once, in `finish`, against `engine.manifest()`: every manifest
name arrived exactly once (no overlapping chunk), fully covered, with the manifest's shape and
dtype, nothing unexpected arrived and, with `check_finite=True`, every floating tensor is finite.
A per-bucket check cannot work (a bucket holding no MTP weight is not an incomplete update) and a
check that is switched off lets a missing weight through; this is the one place it belongs.
On any failure `RefitError` lists every problem by name and the engine keeps its weights and
`weight_version`; on success `engine.commit_weights` swaps the whole dict and bumps the version.

Design choices: the staging dict is allocated lazily from the chunks' own metadata, so an
unexpected or mis-shaped tensor is still staged and reported precisely rather than crashing a
copy. A transferable bucket (its sender never writes it again) is adopted: its whole tensors
become views of its buffer, so an in-process refit moves every byte once (trainer -> bucket,
cast fused in) and a broadcast receives straight into the memory the engine will serve.
The finiteness flags of all tensors are reduced on the device and read back with one host sync.
Left out: detecting a concurrent commit by another session (single writer assumed), and
reusing the previous version's buffers as the next staging area.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor

from birkhoff.refit.bucket import Assembler, Bucket, unpack_typed


class TensorSpecLike(Protocol):
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def dtype(self) -> torch.dtype: ...


class RefitTarget(Protocol):
    """What a refit needs from an engine."""

    weights: dict[str, Tensor]
    weight_version: int

    def manifest(self) -> Mapping[str, Any]: ...
    def commit_weights(self, new: dict[str, Tensor]) -> int: ...


class RefitReport(NamedTuple):
    version: int  # engine weight_version after the commit
    num_tensors: int
    num_buckets: int
    bytes: int  # payload bytes received
    seconds: float  # begin() to commit, device work included


class RefitError(RuntimeError):
    """A refit that did not commit; every attribute lists offending names (sorted)."""

    def __init__(
        self,
        *,
        missing: list[str] | None = None,
        unexpected: list[str] | None = None,
        duplicated: list[str] | None = None,
        mismatched: dict[str, str] | None = None,
        incomplete: list[str] | None = None,
        non_finite: list[str] | None = None,
    ) -> None:
        self.missing = sorted(missing or [])
        self.unexpected = sorted(unexpected or [])
        self.duplicated = sorted(duplicated or [])
        self.mismatched = dict(sorted((mismatched or {}).items()))
        self.incomplete = sorted(incomplete or [])
        self.non_finite = sorted(non_finite or [])
        parts = [
            f"{label}: {value}"
            for label, value in (
                ("missing", self.missing),
                ("unexpected", self.unexpected),
                ("duplicated", self.duplicated),
                ("mismatched", self.mismatched),
                ("incomplete", self.incomplete),
                ("non-finite", self.non_finite),
            )
            if value
        ]
        super().__init__("refit rejected, engine weights unchanged; " + "; ".join(parts))

    def __bool__(self) -> bool:
        return any((self.missing, self.unexpected, self.duplicated, self.mismatched,
                    self.incomplete, self.non_finite))  # fmt: skip


def engine_device(engine: RefitTarget) -> torch.device:
    """The device of the engine's weights (cpu for an engine with none)."""
    for tensor in engine.weights.values():
        return tensor.device
    return torch.device("cpu")


def _describe(dtype: torch.dtype, shape: tuple[int, ...]) -> str:
    return f"{str(dtype).removeprefix('torch.')}{list(shape)}"


def _non_finite(tensors: Mapping[str, Tensor]) -> list[str]:
    """Names of floating tensors holding NaN/inf; one host sync for all of them."""
    names = [n for n, t in tensors.items() if t.is_floating_point() and t.numel()]
    if not names:
        return []
    # fp8 has no elementwise kernels on every backend; upcast per tensor
    flags = [torch.isfinite(tensors[n].float() if tensors[n].itemsize == 1 else tensors[n]).all()
             for n in names]  # fmt: skip
    ok = torch.stack(flags).cpu()
    return [n for n, good in zip(names, ok.tolist(), strict=True) if not good]


class RefitSession:
    """One weight update of `engine`: stage, check once, commit atomically."""

    def __init__(self, engine: RefitTarget, *, device: torch.device | str | None = None) -> None:
        self.engine = engine
        self.device = torch.device(device) if device is not None else engine_device(engine)
        self._staging: Assembler | None = None
        self._num_buckets = 0
        self._bytes = 0
        self._start = 0.0

    @property
    def active(self) -> bool:
        return self._staging is not None

    def begin(self) -> None:
        if self._staging is not None:
            raise RuntimeError("refit session already begun; finish() or abort() it first")
        self._staging = Assembler(self.device)
        self._num_buckets, self._bytes, self._start = 0, 0, time.perf_counter()

    def load_bucket(self, bucket: Bucket) -> None:
        """Stage a bucket's chunks; problems are recorded for finish(), not raised.

        Whole tensors of a transferable bucket are kept as views of its buffer (zero-copy);
        everything else is copied into staging tensors.
        """
        if self._staging is None:
            raise RuntimeError("load_bucket() before begin()")
        if bucket.transferable and bucket.views is not None:
            self._staging.adopt_views(bucket)
            self._bytes += sum(entry.nbytes for entry in bucket.entries)
        else:
            store = self._staging.adopt if bucket.transferable else self._staging.add
            for entry, chunk in unpack_typed(bucket):
                store(entry, chunk)
                self._bytes += entry.nbytes
        self._num_buckets += 1

    def check(self, *, check_finite: bool = False) -> RefitError:
        """Every problem of the staged update against the manifest (falsy when there is none)."""
        if self._staging is None:
            raise RuntimeError("check() before begin()")
        staged, manifest = self._staging, self.engine.manifest()
        mismatched = self._mismatched(manifest)
        return RefitError(
            missing=[n for n in manifest if n not in staged.specs],
            unexpected=[n for n in staged.specs if n not in manifest],
            duplicated=list(staged.duplicated),
            mismatched=mismatched,
            incomplete=list(staged.incomplete() - staged.duplicated - staged.inconsistent),
            non_finite=_non_finite(staged.tensors) if check_finite else [],
        )

    def _mismatched(self, manifest: Mapping[str, Any]) -> dict[str, str]:
        assert self._staging is not None
        out = {n: "chunks disagree on dtype/shape/size" for n in self._staging.inconsistent}
        for name, (dtype, shape, _) in self._staging.specs.items():
            spec = manifest.get(name)
            if spec is not None and (dtype, shape) != (spec.dtype, tuple(spec.shape)):
                got, want = _describe(dtype, shape), _describe(spec.dtype, tuple(spec.shape))
                out[name] = f"got {got}, expected {want}"
        return out

    def finish(self, *, check_finite: bool = False) -> RefitReport:
        """Check once; commit atomically or raise RefitError (engine unchanged either way)."""
        problems = self.check(check_finite=check_finite)
        staged = self._staging
        assert staged is not None
        self._staging = None  # the session is over whatever happens next
        if problems:
            raise problems
        manifest = self.engine.manifest()
        version = self.engine.commit_weights({n: staged.tensors[n] for n in manifest})
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # seconds include the queued copies
        seconds = time.perf_counter() - self._start
        return RefitReport(version, len(manifest), self._num_buckets, self._bytes, seconds)

    def abort(self) -> None:
        """Drop everything staged; the engine never saw any of it."""
        self._staging = None
