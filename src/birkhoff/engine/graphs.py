"""Steps (step.py) run eagerly, or replayed from CUDA graphs.

Legend: A active rows, K rows of a step's state, N key positions, J drafts per step.

`Steps` calls a step on the active rows; `GraphSteps` replays a graph captured for the step's
static shape: (step, K, batch bucket A' = a power of two, length bucket N' >= 32, whether some
row filters with top-k / top-p, the draft count J). The state goes in through a static buffer,
results come back in a shared one (copy them before the next step). Graph sets are keyed by the
addresses of the served weights (`fingerprint`), so a refit never leaves a graph reading stale
memory; two sets serve the two refit banks. docs/engine.md has the details.
Left out: torch.compile, piecewise graphs.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from birkhoff.engine.step import StepContext
from birkhoff.engine.transfer import copy_to, to_device

MIN_KEYS = 32  # smallest length bucket
MAX_WEIGHT_SETS = 2  # graph sets kept (refit alternates two buffer banks)

Fingerprint = tuple[tuple[int, tuple[int, ...]], ...]
Key = tuple[str, int, int, int, bool, int]  # (step, K, A', N', filtered, J)
Step = Callable[[StepContext, Tensor, "int | None", Tensor, int], Tensor]
Weights = Mapping[str, Tensor]  # the engine's served tensors by name


def bucket(n: int, cap: int, smallest: int = 1) -> int:
    """The smallest power of two >= max(n, smallest), but at most `cap` (n <= cap)."""
    assert 1 <= n <= cap, (n, cap)
    return min(cap, max(smallest, 1 << (n - 1).bit_length()))


def fingerprint(weights: Weights) -> Fingerprint:
    """Where every weight lives (address and strides): what a captured graph reads."""
    return tuple((t.data_ptr(), t.stride()) for t in weights.values())


class Steps:
    """Steps run eagerly on the active rows."""

    static_shapes = False  # steps may take shapes that fit the rows exactly

    def run(
        self,
        step: Step,
        ctx: StepContext,
        rows: list[int],
        state: list[list[int]],
        limit: int,
        *,
        max_graph_tokens: int | None = None,
    ) -> Tensor:
        """`step`'s result [A, ...] for cache rows `rows` with state [K, A]; keys are slots
        0..limit-1. `max_graph_tokens`: graph steps run eagerly where the batch bucket times
        the length bucket exceeds it (a prefill of long prompts: its activations would stay in
        the graph pool). With graphs the result may be a view that the next step overwrites:
        copy it before running another."""
        device = ctx.cache.k.device
        prefix = len(rows) if rows == list(range(len(rows))) else None
        return step(ctx, to_device(rows, device), prefix, to_device(state, device), limit)


class GraphPool:
    """The engine's CUDA graphs: per weight fingerprint, one graph per step key."""

    def __init__(self, max_rows: int, capacity: int, device: torch.device) -> None:
        self.max_rows, self.capacity, self.device = max_rows, capacity, device
        self.pool: Any = None  # the graphs' shared memory pool, made at first capture
        self.sets: OrderedDict[Fingerprint, dict[Key, tuple[object, Tensor]]] = OrderedDict()
        self.states: dict[int, Tensor] = {}  # state buffers [K * max_rows], per K
        self.outputs: dict[tuple[str, int, int], Tensor] = {}
        self.num_captured = 0
        self.stream: torch.cuda.Stream | None = None

    def graphs_for(self, weights: Weights) -> dict[Key, tuple[object, Tensor]]:
        key = fingerprint(weights)
        if key in self.sets:
            self.sets.move_to_end(key)
        else:
            self.sets[key] = {}
            while len(self.sets) > MAX_WEIGHT_SETS:
                self.sets.popitem(last=False)  # its graphs read weights no longer served
        return self.sets[key]

    def static_state(self, num_rows: int, batch: int) -> Tensor:
        """The state buffer [K, A] (contiguous, so the host's copy is one transfer) of steps
        whose state has K = num_rows rows, at batch bucket A: a view of one buffer per K."""
        if num_rows not in self.states:
            self.states[num_rows] = torch.zeros(
                num_rows * self.max_rows, dtype=torch.long, device=self.device
            )
        return self.states[num_rows][: num_rows * batch].view(num_rows, batch)

    def static_output(self, kind: tuple[str, int, int], out: Tensor) -> Tensor:
        """Copy `out` into the first rows of `kind`'s shared result buffer (made on first use,
        during the eager warm-up run, at the largest bucket)."""
        if kind not in self.outputs:
            self.outputs[kind] = out.new_empty((self.max_rows, *out.shape[1:]))
        shared = self.outputs[kind]
        shared[: len(out)].copy_(out)
        return shared

    def capture(self, fn: Callable[[], Tensor]) -> tuple[object, Tensor]:
        """Warm up `fn` on the side stream (GraphSteps runs it with no live row), then capture
        it there. capture_begin/end, not `torch.cuda.graph`, which would also collect
        garbage and empty the allocator cache on every one of the many captures."""
        if self.stream is None:
            self.stream, self.pool = torch.cuda.Stream(), torch.cuda.graph_pool_handle()
        self.stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self.stream):
            fn()
            torch.cuda.synchronize()  # as torch.cuda.graph: nothing pending when capture begins
            graph.capture_begin(pool=self.pool)
            try:
                outputs = fn()
            finally:
                graph.capture_end()
        torch.cuda.current_stream().wait_stream(self.stream)
        self.num_captured += 1
        return graph, outputs


class GraphSteps(Steps):
    """Steps replayed from the CUDA graphs of `pool` for the weights `weights`."""

    static_shapes = True

    def __init__(self, pool: GraphPool, weights: Weights) -> None:
        self.pool, self.graphs = pool, pool.graphs_for(weights)

    def run(
        self,
        step: Step,
        ctx: StepContext,
        rows: list[int],
        state: list[list[int]],
        limit: int,
        *,
        max_graph_tokens: int | None = None,
    ) -> Tensor:
        K, A = len(state), bucket(max(rows) + 1, self.pool.max_rows)
        N = bucket(limit, self.pool.capacity - 1, MIN_KEYS)
        if max_graph_tokens is not None and max_graph_tokens < A * N:
            return super().run(step, ctx, rows, state, limit)
        padded = [[0] * A for _ in state]  # rows of the bucket without a request: not live
        for a, i in enumerate(rows):
            for dst, src in zip(padded, state, strict=True):
                dst[i] = src[a]
        buf = self.pool.static_state(K, A)
        # the draft count J shapes a speculative step (J + 1 positions, 1 + 2(J + 1) result
        # columns): a call with another J must not replay this one's graphs
        key: Key = (step.__name__, K, A, N, ctx.filtered, ctx.num_drafts)
        if key not in self.graphs:

            def fn() -> Tensor:
                rows_A = torch.arange(A, device=buf.device)
                out = step(ctx, rows_A, A, buf, N)
                return self.pool.static_output((step.__name__, K, ctx.num_drafts), out)[:A]

            # the warm-up run of a capture sees no live row, so it writes only the trash slot
            # and does not apply a step's own state updates (speculative: n, draft starts)
            # before the replay applies them
            buf.zero_()
            self.graphs[key] = self.pool.capture(fn)
        copy_to(buf, padded)
        graph, out = self.graphs[key]
        graph.replay()  # type: ignore[attr-defined]
        if rows == list(range(len(rows))):  # packed at the front: a view, no launch
            return out[: len(rows)]
        return out.index_select(0, to_device(rows, buf.device))
