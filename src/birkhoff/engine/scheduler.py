"""Continuous batching: which request occupies which cache row, and when rows are refilled.

A generate call may hold any number of requests; the engine has `num_rows` cache rows (its
`max_batch_size`). Requests wait in call order; whenever rows are free, the lowest free rows take
the next waiting requests (their prefill runs, then they join the decode steps). A row whose
request finishes is free again at the next step. Lowest-first keeps the occupied rows packed at
the front, so a decode step over rows 0..r-1 (a CUDA-graph batch bucket) covers them all.

Results are kept per request and returned in request order. The scheduler is host-side
bookkeeping only; it never touches tensors. Left out: preemption, priorities, chunked prefill,
a token budget per step (a prefill admits every request that has a free row).
"""

from __future__ import annotations

import heapq


class Scheduler:
    """Requests 0..num_requests-1 over cache rows 0..num_rows-1."""

    def __init__(self, num_requests: int, num_rows: int) -> None:
        assert num_requests >= 1 and num_rows >= 1, (num_requests, num_rows)
        self.num_requests = num_requests
        self._next = 0  # the first request not yet admitted
        self._free = list(range(num_rows))  # a heap: the lowest free row first
        self.request_of: dict[int, int] = {}  # occupied row -> its request
        self.num_finished = 0

    def admit(self) -> list[tuple[int, int]]:
        """(row, request) pairs for waiting requests that get a free row now, lowest rows first."""
        admitted = []
        while self._free and self._next < self.num_requests:
            admitted.append((heapq.heappop(self._free), self._next))
            self._next += 1
        self.request_of.update(admitted)
        return admitted

    def release(self, row: int) -> int:
        """Free `row` (its request finished); returns that request."""
        request = self.request_of.pop(row)
        heapq.heappush(self._free, row)
        self.num_finished += 1
        return request

    @property
    def active_rows(self) -> list[int]:
        """Occupied rows, ascending."""
        return sorted(self.request_of)

    @property
    def done(self) -> bool:
        return self.num_finished == self.num_requests
