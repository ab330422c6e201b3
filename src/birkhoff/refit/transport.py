"""Transports: how buckets travel from the trainer to the engine's RefitSession.

A transport is the sender's view of a session: `begin`, `manifest`, `send`, `finish`, `abort`,
the `device` it builds buckets on, and `bank(layout)`, the bucket memory it writes next, owned
by a rule it can prove. `InProcessTransport` hands buckets to the engine zero-copy and alternates
two banks (tensors of version n stay intact until version n+2 commits); `BroadcastSender` /
`serve_refit` broadcast from one trainer rank to engine ranks through torch.distributed, with a
two-phase commit so no replica serves a version another rejected. Ownership and commit rules in
full: docs/refit.md.
Left out: point-to-point or RDMA transfer, sending bucket metadata once instead of per bucket,
recovering from a rank that dies mid-session.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any, Protocol

import torch
import torch.distributed as dist

from birkhoff.engine import Engine, TensorSpec
from birkhoff.refit.bucket import Bucket
from birkhoff.refit.pack import Bank, RefitLayout
from birkhoff.refit.session import RefitError, RefitReport, RefitSession


class Transport(Protocol):
    device: torch.device

    def begin(self) -> None: ...
    def manifest(self) -> Mapping[str, TensorSpec]: ...
    def bank(self, layout: RefitLayout) -> Bank: ...
    def send(self, bucket: Bucket) -> None: ...
    def finish(self, *, check_finite: bool = False) -> RefitReport: ...
    def abort(self) -> None: ...


# per engine, the banks of its current layout (at most two): the engine's memory, kept with it
_ENGINE_BANKS: weakref.WeakKeyDictionary[Engine, list[Bank]] = weakref.WeakKeyDictionary()


def _serves(engine: Engine, bank: Bank) -> bool:
    """True if the engine serves this bank's memory (its whole tensors are the bank's views)."""
    for entries, views in zip(bank.layout.buckets, bank.views, strict=True):
        for entry, view in zip(entries.entries, views, strict=True):
            if view is not None:
                return engine.committed.get(entry.name) is view
    return False  # a bank of chunks only: served tensors are staging copies, never bank memory


class InProcessTransport:
    """Same process: buckets go straight into a RefitSession of `engine`."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.session = RefitSession(engine)
        self.device = engine.device

    def begin(self) -> None:
        self.session.begin()

    def manifest(self) -> Mapping[str, TensorSpec]:
        return self.engine.manifest()

    def bank(self, layout: RefitLayout) -> Bank:
        """A bank of `layout` that the engine does not serve (made if there is none)."""
        banks = [b for b in _ENGINE_BANKS.get(self.engine, []) if b.layout is layout]
        free = next((b for b in banks if not _serves(self.engine, b)), None)
        if free is None:
            buffers = [
                torch.empty(b.nbytes, dtype=torch.uint8, device=self.device) for b in layout.buckets
            ]
            free = Bank(layout, buffers)
            banks = [*banks[-1:], free]  # the served one (if any) and the new one
        _ENGINE_BANKS[self.engine] = banks
        return free

    def send(self, bucket: Bucket) -> None:
        self.session.load_bucket(bucket)

    def finish(self, *, check_finite: bool = False) -> RefitReport:
        return self.session.finish(check_finite=check_finite)

    def abort(self) -> None:
        self.session.abort()


def _bcast_object(obj: Any, *, src: int, group: dist.ProcessGroup | None) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def _error_fields(error: RefitError) -> dict[str, Any]:
    return {
        "missing": error.missing,
        "unexpected": error.unexpected,
        "duplicated": error.duplicated,
        "mismatched": error.mismatched,
        "incomplete": error.incomplete,
        "non_finite": error.non_finite,
    }


def _merge_verdicts(verdicts: list[Any]) -> RefitError:
    """Union of the failing ranks' problems (falsy when every rank passed)."""
    merged: dict[str, Any] = {k: [] for k in _error_fields(RefitError())}
    merged["mismatched"] = {}
    for verdict in verdicts:
        for key, value in (verdict or {}).items():
            if isinstance(value, dict):
                merged[key].update(value)
            else:
                merged[key] = sorted(set(merged[key]) | set(value))
    return RefitError(**merged)


class BroadcastSender:
    """Trainer side of a torch.distributed broadcast refit (this rank is `src`)."""

    def __init__(
        self,
        *,
        src: int,
        engine_src: int,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.src, self.engine_src, self.group = src, engine_src, group
        self.device = torch.device(device)
        self._manifest: Mapping[str, Any] | None = None
        self._open = False  # receivers are inside a session
        self._pending: dist.Work | None = None  # the last payload broadcast (CUDA), not waited for
        self._bank: Bank | None = None

    def _control(self, message: dict[str, Any]) -> None:
        _bcast_object(message, src=self.src, group=self.group)

    def begin(self) -> None:
        self._control({"op": "begin"})
        self._open = True
        self._manifest = _bcast_object(None, src=self.engine_src, group=self.group)

    def manifest(self) -> Mapping[str, Any]:
        if self._manifest is None:
            raise RuntimeError("manifest() before begin()")
        return self._manifest

    def bank(self, layout: RefitLayout) -> Bank:
        """The sender's one bank: bucket i lives in buffer i % 2 (the broadcast copies it out)."""
        if self._bank is None or self._bank.layout is not layout:
            size = max((b.nbytes for b in layout.buckets), default=0)
            pool = [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in "ab"]
            self._bank = Bank(layout, [pool[i % 2] for i in range(len(layout.buckets))])
        return self._bank

    def send(self, bucket: Bucket) -> None:
        """Broadcast one bucket; on CUDA the payload overlaps the packing of the next bucket.

        The bank cycles two buffers, so the bucket after next reuses this one's memory: once
        the next payload is queued, the compute stream is made to wait for this one (no host
        sync). On CPU (gloo) every broadcast completes before `send` returns.
        """
        self._control(
            {
                "op": "bucket",
                "index": bucket.index,
                "nbytes": bucket.nbytes,
                "entries": bucket.entries,
            }
        )
        if not bucket.buffer.is_cuda:
            dist.broadcast(bucket.buffer, src=self.src, group=self.group)
            return
        work = dist.broadcast(bucket.buffer, src=self.src, group=self.group, async_op=True)
        assert work is not None
        self._drain()
        self._pending = work

    def _drain(self) -> None:
        """Make the compute stream wait for the last payload broadcast (a no-op if none)."""
        if self._pending is not None:
            self._pending.wait()
            self._pending = None

    def finish(self, *, check_finite: bool = False) -> RefitReport:
        self._drain()
        self._control({"op": "finish", "check_finite": check_finite})
        self._open = False
        verdicts: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(verdicts, None, group=self.group)
        error = _merge_verdicts(verdicts)
        if error:
            raise error
        report: RefitReport = _bcast_object(None, src=self.engine_src, group=self.group)
        return report

    def abort(self) -> None:
        self._drain()
        if self._open:  # after finish the receivers have left the session loop
            self._control({"op": "abort"})
            self._open = False


def serve_refit(
    engine: Engine, *, src: int, engine_src: int, group: dist.ProcessGroup | None = None
) -> RefitReport | None:
    """Engine side of one broadcast refit: receive until finish/abort; None when aborted.

    Raises RefitError when any engine rank rejected the update (this rank's weights unchanged).
    """
    session, rank = RefitSession(engine), dist.get_rank()
    while True:
        message = _bcast_object(None, src=src, group=group)
        op = message["op"]
        if op == "begin":
            session.begin()
            manifest = dict(engine.manifest()) if rank == engine_src else None
            _bcast_object(manifest, src=engine_src, group=group)
        elif op == "bucket":
            # a fresh buffer per bucket, kept by the session: received bytes are served as is
            buffer = torch.empty(message["nbytes"], dtype=torch.uint8, device=session.device)
            dist.broadcast(buffer, src=src, group=group)
            session.load_bucket(Bucket(message["index"], buffer, message["entries"]))
        elif op == "finish":
            return _finish_two_phase(session, message["check_finite"], engine_src, group)
        elif op == "abort":
            session.abort()
            return None
        else:
            raise ValueError(f"unknown refit control op {op!r}")


def _finish_two_phase(
    session: RefitSession, check_finite: bool, engine_src: int, group: dist.ProcessGroup | None
) -> RefitReport:
    problems = session.check(check_finite=check_finite)
    verdicts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(verdicts, _error_fields(problems) if problems else None, group=group)
    error = _merge_verdicts(verdicts)
    if error:
        session.abort()
        raise error
    report = session.commit()  # every rank passed its one check
    result: RefitReport = _bcast_object(
        report if dist.get_rank() == engine_src else None, src=engine_src, group=group
    )
    return result if dist.get_rank() == engine_src else report
