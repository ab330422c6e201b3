"""Decode, verify and draft steps: run eagerly, or replayed from CUDA graphs.

Legend: A active rows, T tokens of one chunk, N key positions, S streams, D model dim, V vocab.

A step is `forward.decode_step` (plain decode, T = 1; verify, T = J+1) or `forward.draft_step`
(one MTP depth over the positions it catches up on). `Steps` runs them eagerly on the chunk the
generation built; `GraphSteps` replays a CUDA graph captured for the step's static shape:
- rows: the cache rows 0..A'-1 of the smallest batch bucket A' (1, 2, 4, ..., up to the engine's
  maximum) that holds every active row; the scheduler packs active rows at the front. Rows of the
  bucket that are not active compute on padding: their positions are the cache's trash slot, so
  they write only there, and their outputs are dropped.
- keys: cache slots 0..N'-1 of a length bucket N' (a power of two >= 32, at most capacity - 1)
  that covers the chunk; the causal mask is built on the device from the positions, as are the
  rope tables (a gather) and the cache writes (index_put), so a step has no host sync.
- T is exact (a graph per chunk length); a chunk longer than `MAX_GRAPH_T` (a drafter catching
  up on a whole prompt right after admission) runs eagerly.
Inputs are copied into static buffers and outputs come back in static buffers (both shared by
all graphs of one step kind); the graph is replayed and the active rows' outputs copied out.
Graphs are captured lazily, on the first step that needs them (warm-up run on a side stream, then
capture), into one shared memory pool; they run one at a time on one stream, so their
intermediates may share memory.

Weights: a graph reads the weight tensors at the addresses it was captured with. Graph sets are
therefore keyed by the addresses of the committed weights (`fingerprint`): a step replays a graph
only when every weight it reads lives where it was captured, and the generation holds that dict
(so those tensors are alive and are the committed ones). A refit that commits new tensors selects
(or captures) another set; it can never leave a graph reading stale or freed memory. Refit
alternates between two buffer banks, so two sets (`MAX_WEIGHT_SETS`) serve every later refit
without capturing again. Caches and stream buffers are allocated once per engine and never move.
Left out: capturing prefill and sampling, torch.compile, piecewise graphs.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from birkhoff.config import ModelConfig
from birkhoff.engine.forward import Chunk, Weights, chunk_at, decode_step, draft_step
from birkhoff.engine.kv_cache import DrafterState, KVCache

MAX_GRAPH_T = 16  # longer chunks (drafter catch-up over a prompt) run eagerly
MIN_KEYS = 32  # smallest length bucket
MAX_WEIGHT_SETS = 2  # graph sets kept (refit alternates two buffer banks)

Fingerprint = tuple[tuple[int, tuple[int, ...]], ...]
Outputs = tuple[Tensor, Tensor]


def bucket(n: int, cap: int, smallest: int = 1) -> int:
    """The smallest power of two >= max(n, smallest), but at most `cap` (n <= cap)."""
    assert 1 <= n <= cap, (n, cap)
    return min(cap, max(smallest, 1 << (n - 1).bit_length()))


def fingerprint(weights: Weights) -> Fingerprint:
    """Where every weight lives (address and strides): what a captured graph reads."""
    return tuple((t.data_ptr(), t.stride()) for t in weights.values())


class Steps:
    """Eager steps over the chunk the generation built."""

    def __init__(
        self, cfg: ModelConfig, weights: Weights, cache: KVCache, drafter: DrafterState | None,
    ) -> None:  # fmt: skip
        self.cfg, self.w, self.cache, self.drafter = cfg, weights, cache, drafter

    def decode(self, rows: list[int], chunk: Chunk, tokens_AT: Tensor) -> Outputs:
        """(multistream [A,T,S,D], logits [A,T,V]) of the main model over `chunk`."""
        return decode_step(self.w, self.cfg, self.cache, tokens_AT, chunk)

    def draft(
        self, depth: int, rows: list[int], chunk: Chunk, h_prev_ATSD: Tensor, tokens_AT: Tensor,
        last_A: Tensor,
    ) -> Outputs:  # fmt: skip
        """(h_depth [A,T,S,D], logits [A,V] at chunk offset last_A) of MTP depth `depth`."""
        assert self.drafter is not None
        return draft_step(
            self.w, self.cfg, depth, self.drafter.cache, h_prev_ATSD, tokens_AT, chunk, last_A
        )


@dataclass
class StaticInputs:
    """Input buffers of one step kind at the largest bucket; a bucket uses a prefix of rows."""

    tokens_AT: Tensor
    positions_AT: Tensor
    valid_AT: Tensor
    h_prev_ATSD: Tensor | None  # draft steps only
    last_A: Tensor | None


class GraphPool:
    """The engine's CUDA graphs: per weight fingerprint, one graph per step key."""

    def __init__(self, max_rows: int, capacity: int, rope: tuple[Tensor, Tensor]) -> None:
        self.max_rows, self.capacity, self.rope = max_rows, capacity, rope
        self.pool: Any = None  # the graphs' shared memory pool, made at first capture
        self.sets: OrderedDict[Fingerprint, dict[tuple[int, ...], tuple[object, Outputs]]]
        self.sets = OrderedDict()
        self.inputs: dict[tuple[int, int], StaticInputs] = {}
        self.outputs: dict[tuple[int, int], Outputs] = {}
        self.num_captured = 0
        self.stream: torch.cuda.Stream | None = None

    def graphs_for(self, weights: Weights) -> dict[tuple[int, ...], tuple[object, Outputs]]:
        key = fingerprint(weights)
        if key in self.sets:
            self.sets.move_to_end(key)
        else:
            self.sets[key] = {}
            while len(self.sets) > MAX_WEIGHT_SETS:
                self.sets.popitem(last=False)  # its graphs read weights no longer served
        return self.sets[key]

    def static_inputs(self, depth: int, T: int, like_SD: Tensor | None) -> StaticInputs:
        """Buffers of step kind (depth: -1 main model, else MTP depth) and chunk length T."""
        if (depth, T) not in self.inputs:
            A, dev = self.max_rows, self.rope[0].device
            h = last = None
            if like_SD is not None:
                h = like_SD.new_zeros((A, T, *like_SD.shape[-2:]))
                last = torch.zeros(A, dtype=torch.long, device=dev)
            self.inputs[depth, T] = StaticInputs(
                torch.zeros(A, T, dtype=torch.long, device=dev),
                torch.zeros(A, T, dtype=torch.long, device=dev),
                torch.zeros(A, T, dtype=torch.bool, device=dev), h, last,
            )  # fmt: skip
        return self.inputs[depth, T]

    def static_outputs(self, kind: tuple[int, int], outputs: Outputs) -> Outputs:
        """Copy `outputs` into the first rows of `kind`'s shared output buffers (made on first
        use, during the eager warm-up run, at the largest bucket)."""
        if kind not in self.outputs:
            self.outputs[kind] = tuple(  # type: ignore[assignment]
                t.new_empty((self.max_rows, *t.shape[1:])) for t in outputs
            )
        shared = self.outputs[kind]
        for buf, t in zip(shared, outputs, strict=True):
            buf[: len(t)].copy_(t)
        return shared

    def capture(self, fn: Callable[[], Outputs]) -> tuple[object, Outputs]:
        """Warm up `fn` on the side stream (its effects are the replay's: same inputs), then
        capture it there. capture_begin/end, not `torch.cuda.graph`, which would also collect
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
    """Steps replayed from the CUDA graphs of `pool`, eager where a shape has no graph."""

    def __init__(
        self, cfg: ModelConfig, weights: Weights, cache: KVCache, drafter: DrafterState | None,
        pool: GraphPool,
    ) -> None:  # fmt: skip
        super().__init__(cfg, weights, cache, drafter)
        self.pool, self.graphs = pool, pool.graphs_for(weights)

    def buckets(self, rows: list[int], chunk: Chunk) -> tuple[int, int]:
        """(rows A', keys N') of the graph that covers this chunk."""
        A = bucket(max(rows) + 1, self.pool.max_rows)
        return A, bucket(chunk.limit, self.pool.capacity - 1, MIN_KEYS)

    def fill(self, buf: StaticInputs, A: int, chunk: Chunk, tokens_AT: Tensor) -> None:
        """Copy the active rows into the first A static rows; the rest is padding (trash)."""
        buf.positions_AT[:A].fill_(self.cache.trash)
        buf.valid_AT[:A].fill_(False)
        buf.tokens_AT[:A].zero_()
        buf.positions_AT.index_copy_(0, chunk.rows_A, chunk.positions_AT)
        buf.valid_AT.index_copy_(0, chunk.rows_A, chunk.valid_AT)
        buf.tokens_AT.index_copy_(0, chunk.rows_A, tokens_AT)

    def static_chunk(self, buf: StaticInputs, A: int, N: int) -> Chunk:
        rows_A = torch.arange(A, device=buf.tokens_AT.device)
        return chunk_at(
            rows_A, A, buf.positions_AT[:A], buf.valid_AT[:A], rope=self.pool.rope, limit=N
        )

    def replay(self, key: tuple[int, ...], step: Callable[[], Outputs], rows_A: Tensor) -> Outputs:
        """Replay the graph of `key` (capturing `step` first if needed); the active rows' outputs.

        The graph ends by copying its outputs into buffers shared by every graph of the same step
        kind, so outputs (e.g. logits) take memory once, not once per graph; the step's own
        tensors are intermediates of the shared pool."""
        if key not in self.graphs:

            def fn() -> Outputs:
                a, b = self.pool.static_outputs((key[0], key[1]), step())
                return a[: key[2]], b[: key[2]]

            self.graphs[key] = self.pool.capture(fn)
        graph, (a, b) = self.graphs[key]
        graph.replay()  # type: ignore[attr-defined]
        return a.index_select(0, rows_A), b.index_select(0, rows_A)

    def decode(self, rows: list[int], chunk: Chunk, tokens_AT: Tensor) -> Outputs:
        T = tokens_AT.shape[1]
        if T > MAX_GRAPH_T:
            return super().decode(rows, chunk, tokens_AT)
        A, N = self.buckets(rows, chunk)
        buf = self.pool.static_inputs(-1, T, None)
        self.fill(buf, A, chunk, tokens_AT)

        def fn() -> Outputs:
            return decode_step(
                self.w, self.cfg, self.cache, buf.tokens_AT[:A], self.static_chunk(buf, A, N)
            )

        return self.replay((-1, T, A, N), fn, chunk.rows_A)  # key: (kind, T, A', N')

    def draft(
        self, depth: int, rows: list[int], chunk: Chunk, h_prev_ATSD: Tensor, tokens_AT: Tensor,
        last_A: Tensor,
    ) -> Outputs:  # fmt: skip
        T = tokens_AT.shape[1]
        if T > MAX_GRAPH_T:
            return super().draft(depth, rows, chunk, h_prev_ATSD, tokens_AT, last_A)
        assert self.drafter is not None
        A, N = self.buckets(rows, chunk)
        buf = self.pool.static_inputs(depth, T, h_prev_ATSD)
        assert buf.h_prev_ATSD is not None and buf.last_A is not None
        self.fill(buf, A, chunk, tokens_AT)
        buf.h_prev_ATSD.index_copy_(0, chunk.rows_A, h_prev_ATSD)
        buf.last_A.index_copy_(0, chunk.rows_A, last_A)
        h, last, cache = buf.h_prev_ATSD, buf.last_A, self.drafter.cache

        def fn() -> Outputs:
            chunk_A = self.static_chunk(buf, A, N)
            tokens = buf.tokens_AT[:A]
            return draft_step(self.w, self.cfg, depth, cache, h[:A], tokens, chunk_A, last[:A])

        return self.replay((depth, T, A, N), fn, chunk.rows_A)
