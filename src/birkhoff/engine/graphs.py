"""Decode and speculative steps: run eagerly, or replayed from CUDA graphs.

Legend: A active rows, T tokens of one chunk, N key positions, S streams, D model dim, V vocab,
J drafts per step.

A step is `forward.decode_step` (plain decode, T = 1) or `speculative.speculative_step` (every
MTP depth's draft, the verify pass over J+1 positions and the acceptance, sampling included).
`Steps` runs them eagerly on the rows the generation gives; `GraphSteps` replays a CUDA graph
captured for the step's static shape:
- rows: the cache rows 0..A'-1 of the smallest batch bucket A' (1, 2, 4, ..., up to the engine's
  maximum) that holds every active row; the scheduler packs active rows at the front. Rows of the
  bucket that are not active compute on padding: their positions are the cache's trash slot, so
  they write only there, and their outputs are dropped.
- keys: cache slots 0..N'-1 of a length bucket N' (a power of two >= 32, at most capacity - 1)
  that covers the step; the causal mask is built on the device from the positions, as are the
  rope tables (a gather) and the cache writes (index_put), so a step has no host sync.
- T is exact (a graph per chunk length; prefill runs eagerly); a speculative graph is per J and
  per whether some row filters with top-k / top-p (the sort is skipped otherwise).
Inputs are copied into static buffers and outputs come back in static buffers (both shared by
all graphs of one step kind); the graph is replayed and the active rows' outputs copied out.
Graphs are captured lazily, on the first step that needs them (warm-up run on a side stream, then
capture), into one shared memory pool; they run one at a time on one stream, so their
intermediates may share memory. Everything else a graph reads (caches, stream buffers, the
rows' tokens, keys and sampling parameters: rows.py) is allocated once per engine.

Weights: a graph reads the weight tensors at the addresses it was captured with. Graph sets are
therefore keyed by the addresses of the committed weights (`fingerprint`): a step replays a graph
only when every weight it reads lives where it was captured, and the generation holds that dict
(so those tensors are alive and are the committed ones). A refit that commits new tensors selects
(or captures) another set; it can never leave a graph reading stale or freed memory. Refit
alternates between two buffer banks, so two sets (`MAX_WEIGHT_SETS`) serve every later refit
without capturing again. Caches and stream buffers are allocated once per engine and never move.
Left out: capturing prefill, torch.compile, piecewise graphs.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from birkhoff.config import ModelConfig
from birkhoff.engine.forward import Chunk, Weights, chunk_at, decode_step
from birkhoff.engine.kv_cache import KVCache
from birkhoff.engine.speculative import SpecContext, speculative_step
from birkhoff.engine.transfer import to_device

MAX_GRAPH_T = 16  # longer decode chunks run eagerly (a plain step has T = 1)
MIN_KEYS = 32  # smallest length bucket
MAX_WEIGHT_SETS = 2  # graph sets kept (refit alternates two buffer banks)
DECODE, SPECULATIVE = -1, -2  # step kinds (the first element of a graph key)

Fingerprint = tuple[tuple[int, tuple[int, ...]], ...]
Outputs = tuple[Tensor, ...]


def bucket(n: int, cap: int, smallest: int = 1) -> int:
    """The smallest power of two >= max(n, smallest), but at most `cap` (n <= cap)."""
    assert 1 <= n <= cap, (n, cap)
    return min(cap, max(smallest, 1 << (n - 1).bit_length()))


def fingerprint(weights: Weights) -> Fingerprint:
    """Where every weight lives (address and strides): what a captured graph reads."""
    return tuple((t.data_ptr(), t.stride()) for t in weights.values())


class Steps:
    """Eager steps over the chunk the generation built."""

    def __init__(self, cfg: ModelConfig, weights: Weights, cache: KVCache) -> None:
        self.cfg, self.w, self.cache = cfg, weights, cache

    def decode(self, rows: list[int], chunk: Chunk, tokens_AT: Tensor) -> Outputs:
        """(multistream [A,T,S,D], logits [A,T,V]) of the main model over `chunk`."""
        return decode_step(self.w, self.cfg, self.cache, tokens_AT, chunk)

    def speculative(
        self, ctx: SpecContext, rows: list[int], state: list[list[int]], limit: int
    ) -> Tensor:
        """One speculative step of `rows` ([A, 1 + 2T], speculative.verify) from their state
        ([J+2, A], speculative.state_rows); keys are slots 0..limit-1."""
        device = self.cache.k.device
        prefix = len(rows) if rows == list(range(len(rows))) else None
        rows_A, state_KA = to_device(rows, device), to_device(state, device)
        return speculative_step(ctx, rows_A, prefix, state_KA, limit)


@dataclass
class StaticInputs:
    """Input buffers of one step kind at the largest bucket; a bucket uses a prefix of rows."""

    tokens_AT: Tensor
    positions_AT: Tensor
    valid_AT: Tensor


class GraphPool:
    """The engine's CUDA graphs: per weight fingerprint, one graph per step key."""

    def __init__(self, max_rows: int, capacity: int, rope: tuple[Tensor, Tensor]) -> None:
        self.max_rows, self.capacity, self.rope = max_rows, capacity, rope
        self.pool: Any = None  # the graphs' shared memory pool, made at first capture
        self.sets: OrderedDict[Fingerprint, dict[tuple[int, ...], tuple[object, Outputs]]]
        self.sets = OrderedDict()
        self.inputs: dict[int, StaticInputs] = {}  # per chunk length T
        self.states: dict[int, Tensor] = {}  # speculative step state [J+2, max_rows], per J
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

    def static_inputs(self, T: int) -> StaticInputs:
        """Buffers of the decode/verify step of chunk length T."""
        if T not in self.inputs:
            A, dev = self.max_rows, self.rope[0].device
            self.inputs[T] = StaticInputs(
                torch.zeros(A, T, dtype=torch.long, device=dev),
                torch.zeros(A, T, dtype=torch.long, device=dev),
                torch.zeros(A, T, dtype=torch.bool, device=dev),
            )
        return self.inputs[T]

    def static_state(self, num_drafts: int) -> Tensor:
        """The speculative step's state buffer [J+2, max_rows] for J drafts."""
        if num_drafts not in self.states:
            shape = (num_drafts + 2, self.max_rows)
            self.states[num_drafts] = torch.zeros(
                shape, dtype=torch.long, device=self.rope[0].device
            )
        return self.states[num_drafts]

    def static_outputs(self, kind: tuple[int, int], outputs: Outputs) -> Outputs:
        """Copy `outputs` into the first rows of `kind`'s shared output buffers (made on first
        use, during the eager warm-up run, at the largest bucket)."""
        if kind not in self.outputs:
            self.outputs[kind] = tuple(t.new_empty((self.max_rows, *t.shape[1:])) for t in outputs)
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

    def __init__(self, cfg: ModelConfig, weights: Weights, cache: KVCache, pool: GraphPool) -> None:
        super().__init__(cfg, weights, cache)
        self.pool, self.graphs = pool, pool.graphs_for(weights)

    def buckets(self, rows: list[int], limit: int) -> tuple[int, int]:
        """(rows A', keys N') of the graph that covers rows `rows` and slots 0..limit-1."""
        A = bucket(max(rows) + 1, self.pool.max_rows)
        return A, bucket(limit, self.pool.capacity - 1, MIN_KEYS)

    def fill(self, buf: StaticInputs, A: int, chunk: Chunk, tokens_AT: Tensor) -> None:
        """Copy the active rows into the first A static rows; the rest is padding (trash)."""
        buf.positions_AT[:A].fill_(self.cache.trash)
        buf.valid_AT[:A].fill_(False)
        buf.tokens_AT[:A].zero_()
        buf.positions_AT.index_copy_(0, chunk.rows_A, chunk.positions_AT)
        buf.valid_AT.index_copy_(0, chunk.rows_A, chunk.valid_AT)
        buf.tokens_AT.index_copy_(0, chunk.rows_A, tokens_AT)

    def replay(self, key: tuple[int, ...], step: Callable[[], Outputs]) -> Outputs:
        """Replay the graph of `key` = (kind, T, A', N', ...) (capturing `step` first if needed);
        its outputs for the A' rows of its bucket.

        The graph ends by copying its outputs into buffers shared by every graph of the same step
        kind, so outputs (e.g. logits) take memory once, not once per graph; the step's own
        tensors are intermediates of the shared pool."""
        if key not in self.graphs:

            def fn() -> Outputs:
                shared = self.pool.static_outputs((key[0], key[1]), step())
                return tuple(t[: key[2]] for t in shared)

            self.graphs[key] = self.pool.capture(fn)
        graph, outputs = self.graphs[key]
        graph.replay()  # type: ignore[attr-defined]
        return outputs

    def decode(self, rows: list[int], chunk: Chunk, tokens_AT: Tensor) -> Outputs:
        T = tokens_AT.shape[1]
        if T > MAX_GRAPH_T:
            return super().decode(rows, chunk, tokens_AT)
        A, N = self.buckets(rows, chunk.limit)
        buf = self.pool.static_inputs(T)
        self.fill(buf, A, chunk, tokens_AT)

        def fn() -> Outputs:
            rows_A = torch.arange(A, device=buf.tokens_AT.device)
            static = chunk_at(
                rows_A, A, buf.positions_AT[:A], buf.valid_AT[:A], rope=self.pool.rope, limit=N
            )
            return decode_step(self.w, self.cfg, self.cache, buf.tokens_AT[:A], static)

        ms, logits = self.replay((DECODE, T, A, N), fn)
        return ms.index_select(0, chunk.rows_A), logits.index_select(0, chunk.rows_A)

    def speculative(
        self, ctx: SpecContext, rows: list[int], state: list[list[int]], limit: int
    ) -> Tensor:
        J = ctx.num_drafts
        A, N = self.buckets(rows, limit)
        padded = [[0] * A for _ in state]  # rows of the bucket without a request: not live
        for a, i in enumerate(rows):
            for dst, src in zip(padded, state, strict=True):
                dst[i] = src[a]
        buf = self.pool.static_state(J)
        buf[:, :A].copy_(to_device(padded, buf.device))

        def fn() -> Outputs:
            rows_A = torch.arange(A, device=buf.device)
            return (speculative_step(ctx, rows_A, A, buf[:, :A], N),)

        (out,) = self.replay((SPECULATIVE, J, A, N, int(ctx.filtered)), fn)
        return out.index_select(0, to_device(rows, buf.device))
