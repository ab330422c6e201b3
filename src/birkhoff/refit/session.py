"""RefitSession: stage buckets, check completeness once, commit atomically.

Protocol: `begin()` -> `load_bucket(bucket)` any number of times, in any order -> `finish()` (or
`abort()`). Buckets are staged, never written into the live weights, so generation keeps using
the previous version. `check` runs once per update against `engine.manifest()` (every name
exactly once, fully covered, right shape and dtype, nothing unexpected, optionally finite); on
failure `RefitError` lists every problem and the engine keeps its weights, on success
`engine.commit_weights` swaps the whole dict. A bucket belongs to the session once loaded, so
whole tensors are staged as views of it. Why the check lives here only: docs/refit.md.
Left out: detecting a concurrent commit by another session (single writer assumed).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import NamedTuple

import torch
from torch import Tensor

from birkhoff.engine import Engine, TensorSpec
from birkhoff.refit.bucket import Assembler, Bucket


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
        return any(
            (
                self.missing,
                self.unexpected,
                self.duplicated,
                self.mismatched,
                self.incomplete,
                self.non_finite,
            )
        )


def _describe(dtype: torch.dtype, shape: tuple[int, ...]) -> str:
    return f"{str(dtype).removeprefix('torch.')}{list(shape)}"


def _non_finite(tensors: Mapping[str, Tensor]) -> list[str]:
    """Names of floating tensors holding NaN/inf; one host sync for all of them."""
    names = [n for n, t in tensors.items() if t.is_floating_point() and t.numel()]
    if not names:
        return []
    # fp8 has no elementwise kernels on every backend; upcast per tensor
    flags = [
        torch.isfinite(tensors[n].float() if tensors[n].itemsize == 1 else tensors[n]).all()
        for n in names
    ]
    ok = torch.stack(flags).cpu()
    return [n for n, good in zip(names, ok.tolist(), strict=True) if not good]


class RefitSession:
    """One weight update of `engine`: stage, check once, commit atomically."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.device = engine.device
        self._staging: Assembler | None = None
        self._checked = False
        self._num_buckets = 0
        self._bytes = 0
        self._start = 0.0

    def begin(self) -> None:
        if self._staging is not None:
            raise RuntimeError("refit session already begun; finish() or abort() it first")
        self._staging, self._checked = Assembler(self.device), False
        self._num_buckets, self._bytes, self._start = 0, 0, time.perf_counter()

    def load_bucket(self, bucket: Bucket) -> None:
        """Stage a bucket (it now belongs to the session); problems are recorded, not raised."""
        if self._staging is None:
            raise RuntimeError("load_bucket() before begin()")
        self._staging.stage(bucket)
        self._bytes += sum(entry.nbytes for entry in bucket.entries)
        self._num_buckets += 1

    def check(self, *, check_finite: bool = False) -> RefitError:
        """Every problem of the staged update against the manifest (falsy when there is none)."""
        if self._staging is None:
            raise RuntimeError("check() before begin()")
        staged, manifest = self._staging, self.engine.manifest()
        problems = RefitError(
            missing=[n for n in manifest if n not in staged.specs],
            unexpected=[n for n in staged.specs if n not in manifest],
            duplicated=list(staged.duplicated),
            mismatched=self._mismatched(manifest),
            incomplete=self._incomplete(),
            non_finite=_non_finite(staged.tensors) if check_finite else [],
        )
        self._checked = not problems
        return problems

    def _incomplete(self) -> list[str]:
        """Names not fully covered; a 3-D stack as "name expert e" for every expert with a gap."""
        staged = self._staging
        assert staged is not None
        out = []
        for name in staged.incomplete() - staged.duplicated - staged.inconsistent:
            _, shape, total = staged.specs[name]
            if len(shape) != 3 or shape[0] == 0:
                out.append(name)
                continue
            per_expert = total // shape[0]
            hit = {
                e
                for lo, hi in staged.gaps(name)
                for e in range(lo // per_expert, -(-hi // per_expert))
            }
            out += [f"{name} expert {e}" for e in sorted(hit)]
        return out

    def _mismatched(self, manifest: Mapping[str, TensorSpec]) -> dict[str, str]:
        assert self._staging is not None
        out = {n: "chunks disagree on dtype/shape/size" for n in self._staging.inconsistent}
        for name, (dtype, shape, _) in self._staging.specs.items():
            spec = manifest.get(name)
            if spec is not None and (dtype, shape) != (spec.dtype, tuple(spec.shape)):
                got, want = _describe(dtype, shape), _describe(spec.dtype, tuple(spec.shape))
                out[name] = f"got {got}, expected {want}"
        return out

    def commit(self) -> RefitReport:
        """Commit an update that `check` passed; ends the session."""
        staged = self._staging
        assert staged is not None and self._checked, "commit() needs a passing check()"
        self._staging = None
        manifest = self.engine.manifest()
        version = self.engine.commit_weights({n: staged.tensors[n] for n in manifest})
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # seconds include the queued copies
        seconds = time.perf_counter() - self._start
        return RefitReport(version, len(manifest), self._num_buckets, self._bytes, seconds)

    def finish(self, *, check_finite: bool = False) -> RefitReport:
        """Check once; commit atomically or raise RefitError (engine unchanged either way)."""
        problems = self.check(check_finite=check_finite)
        if problems:
            self._staging = None  # the session is over
            raise problems
        return self.commit()

    def abort(self) -> None:
        """Drop everything staged; the engine never saw any of it."""
        self._staging = None
