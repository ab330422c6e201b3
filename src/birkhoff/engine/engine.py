"""The inference engine: owns its weights in inference layout, generates with a KV cache.

Weights: `engine.weights` is the flat name -> tensor dict of the manifest (engine/layout.py:
fused q/k/v and gate/up, the MTP drafter included) and `engine.records` the same tensors as typed
records (`layout.Weights`), which the forward reads. A commit swaps both at once (one
assignment), and a generate call in flight keeps what it started with. Versions:
`weight_version` is -1 until weights are loaded, 0 after the first commit, +1 per refit.
Caches and per-row state are allocated once, at the engine's maximum batch size and sequence
length; a call takes any number of prompts (continuous batching). `kernels` picks the fused
Triton ops ("auto": on CUDA); `cuda_graphs` replays steps from CUDA graphs (default on CUDA).
Left out: paged KV, tensor parallel.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import NamedTuple

import torch
from torch import Tensor

from birkhoff.config import Kernels, ModelConfig, check, resolve_kernels
from birkhoff.engine.decode import Completion, Generation
from birkhoff.engine.fp8 import FP8_DTYPE, SCALE_SUFFIX, quantize_parts
from birkhoff.engine.graphs import GraphPool, GraphSteps, Steps
from birkhoff.engine.kv_cache import (
    DrafterState,
    KVCache,
    LayerCompression,
    StreamBuffer,
    compression_states,
)
from birkhoff.engine.layout import (
    Quantize,
    TensorSpec,
    Weights,
    build_manifest,
    engine_parts,
    load_weights,
    trainer_tensors,
)
from birkhoff.engine.rng import MAX_DRAFTS
from birkhoff.engine.rows import RowState
from birkhoff.engine.sampling import SamplingParams
from birkhoff.engine.speculative import SpecStats
from birkhoff.engine.stop import Detokenize
from birkhoff.engine.v4_forward import v4_rope_tables
from birkhoff.kernels import use_fused
from birkhoff.kernels.mhc import served_phi
from birkhoff.model.layers import rope_tables


class Served(NamedTuple):
    """What a commit serves: the flat tensors by name, and the same tensors as records."""

    weights: dict[str, Tensor]
    records: Weights | None


class Engine:
    def __init__(
        self,
        cfg: ModelConfig,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        quantize: Quantize = None,
        max_batch_size: int = 64,
        max_seq_len: int | None = None,
        max_speculative_tokens: int = 4,
        cuda_graphs: bool | None = None,
        kernels: Kernels = "auto",
    ) -> None:
        check(quantize in (None, "fp8"), "quantize", quantize, "None | 'fp8'")
        kernels = resolve_kernels(cfg, kernels)  # V4: eager ('triton' refused)
        check(
            dtype.is_floating_point and dtype.itemsize >= 2, "dtype", dtype, "bf16/fp16/fp32/fp64"
        )
        check(max_batch_size >= 1, "max_batch_size", max_batch_size, "must be >= 1")
        seq = cfg.max_seq_len if max_seq_len is None else max_seq_len
        check(seq >= 2, "max_seq_len", seq, "must be >= 2")
        spec = max_speculative_tokens
        check(
            0 <= spec <= MAX_DRAFTS, "max_speculative_tokens", spec, f"must be in [0, {MAX_DRAFTS}]"
        )
        graphs = torch.device(device).type == "cuda" if cuda_graphs is None else cuda_graphs
        check(
            not graphs or torch.device(device).type == "cuda",
            "cuda_graphs",
            cuda_graphs,
            "needs a CUDA device",
        )
        self.cfg, self.device, self.dtype, self.quantize = (
            cfg,
            torch.device(device),
            dtype,
            quantize,
        )
        self.max_batch_size, self.max_seq_len, self.max_speculative_tokens = (
            max_batch_size,
            seq,
            spec,
        )
        self.kernels = kernels
        self._manifest = build_manifest(cfg, dtype=dtype, quantize=quantize)
        self.served = Served({}, None)  # nothing served before the first commit
        self.committed: dict[str, Tensor] = {}  # the tensors as committed (weights reads them)
        # per phi name, (committed tensor, the buffer serving it) for the last two commits
        self._phi_buffers: dict[str, list[tuple[Tensor, Tensor]]] = {}
        self.weight_version = -1
        # slots 0..max_seq_len+spec-1 hold positions; the last one is the trash slot
        self.capacity = seq + spec + 1
        positions = torch.arange(self.capacity, device=self.device)
        self.rope = (
            rope_tables(positions, cfg.head_dim, cfg.rope_theta, cfg=cfg)
            if cfg.attention is None
            else v4_rope_tables(positions, cfg)
        )
        self._cache: KVCache | None = None
        self._drafter: DrafterState | None = None
        self._rows: RowState | None = None
        self.last_stats: SpecStats | None = None
        self.graphs = GraphPool(max_batch_size, self.capacity, self.device) if graphs else None

    @classmethod
    def from_model(cls, model: torch.nn.Module, **kwargs: object) -> Engine:
        """An engine serving `model`'s current weights (weight_version 0).

        Raises ValueError (SourceError) naming trainer tensors the model lacks or mis-shapes.
        """
        cfg = getattr(model, "cfg", None)
        if not isinstance(cfg, ModelConfig):
            raise ValueError(f"model must carry a ModelConfig as .cfg, got {type(cfg).__name__}")
        engine = cls(cfg, **kwargs)  # type: ignore[arg-type]
        engine.commit_weights(served_weights(model, engine.manifest(), engine.device))
        return engine

    def manifest(self) -> dict[str, TensorSpec]:
        return dict(self._manifest)

    @property
    def weights(self) -> dict[str, Tensor]:
        """The served tensors by manifest name."""
        return self.served.weights

    @property
    def records(self) -> Weights:
        """The served tensors as the forward reads them (engine/layout.py's records)."""
        if self.served.records is None:
            raise ValueError("engine has no weights loaded (use Engine.from_model or refit)")
        return self.served.records

    def commit_weights(self, new: dict[str, Tensor]) -> int:
        """Serve `new` from now on; returns the new version.

        `new` must hold exactly the manifest's tensors with its shapes and dtypes: the refit
        session checks that before it commits, and `from_model` builds it from the manifest.
        The one invariant asserted here is the cheap half (the names).
        """
        assert new.keys() == self._manifest.keys(), "committed names differ from the manifest"
        served = {n: self._serve(n, t) for n, t in new.items()}
        # one assignment: readers see the old or the new weights, never a mix
        self.served = Served(served, load_weights(self.cfg, served))
        self.committed = dict(new)
        self.weight_version += 1
        return self.weight_version

    def _serve(self, name: str, tensor: Tensor) -> Tensor:
        """A committed tensor as the forward reads it: an mHC projection `phi`, when the fused
        kernels run, in their padded, transposed layout (same values; no transposing launch per
        sublayer and step); every other tensor as committed.

        A refit commits the views of one of two alternating buffer banks, and a graph set is
        keyed by the served addresses, so phi's buffer follows its bank: a tensor committed
        before gets its buffer back, refreshed (not served since: the bank was not), and the
        graphs captured on it stay valid."""
        if not (name.endswith(".phi") and use_fused(tensor, self.kernels)):
            return tensor
        pairs = self._phi_buffers.setdefault(name, [])
        for source, buffer in pairs:
            if source is tensor and self.weights.get(name) is not buffer:
                buffer.copy_(tensor)
                return buffer
        buffer = served_phi(tensor)
        pairs[:] = [*pairs[-1:], (tensor, buffer)]
        return buffer

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams | Sequence[SamplingParams],
        *,
        detokenize: Detokenize | None = None,
    ) -> list[Completion]:
        """Complete every prompt (any number of them; completions in prompt order); `params` is
        one SamplingParams or one per prompt. With a seed, completion i is a function of
        (weights, prompt i, params i, seed, i) only, whatever else shares its batch.
        `detokenize` (token ids -> text, e.g. a tokenizer's decode) fills each completion's
        text and is needed for stop strings (`SamplingParams.stop`, engine/stop.py)."""
        per_row = self.check_request(prompts, params)
        if detokenize is None and any(p.stop for p in per_row):
            raise ValueError("SamplingParams.stop needs generate(..., detokenize=...)")
        served, version = self.served, self.weight_version
        num_drafts = per_row[0].num_speculative_tokens
        seed = per_row[0].seed
        with torch.inference_mode():
            cache, drafter = self.main_cache(), self.drafter_state() if num_drafts else None
            steps = Steps() if self.graphs is None else GraphSteps(self.graphs, served.weights)
            assert served.records is not None  # check_request: weights are loaded
            run = Generation(
                cfg=self.cfg,
                weights=served.records,
                steps=steps,
                cache=cache,
                drafter=drafter,
                rows=self.row_state(),
                rope=self.rope,
                prompts=[list(p) for p in prompts],
                params=per_row,
                max_seq_len=self.max_seq_len,
                seed=secrets.randbits(63) if seed is None else seed,
                kernels=self.kernels,
                detokenize=detokenize,
            )
            completions = run.run()
        self.last_stats = run.stats if num_drafts else None
        return [replace(c, weight_version=version) for c in completions]

    def main_cache(self) -> KVCache:
        """The main model's cache; V4: one shared kv head per layer and the compressed layers'
        states (engine/v4_forward.py)."""
        if self._cache is None:
            cfg, B, v4 = self.cfg, self.max_batch_size, self.cfg.attention is not None
            compressed: tuple[LayerCompression | None, ...] = ()
            if v4:
                spec, dtype = self.max_speculative_tokens, self.dtype
                compressed = compression_states(
                    cfg, B, self.capacity, spec, dtype=dtype, device=self.device
                )
            self._cache = KVCache(
                cfg.num_layers,
                B,
                cfg.kv_heads,
                self.capacity,
                cfg.head_dim,
                dtype=self.dtype,
                device=self.device,
                shared=v4,
                compressed=compressed,
            )
        return self._cache

    def row_state(self) -> RowState:
        if self._rows is None:
            self._rows = RowState.build(
                self.max_batch_size, self.capacity, self.device, kernels=self.kernels
            )
        return self._rows

    def drafter_state(self) -> DrafterState:
        if self._drafter is None:
            cfg, n = self.cfg, self.max_speculative_tokens
            cache = KVCache(
                n,
                self.max_batch_size,
                cfg.kv_heads,
                self.capacity,
                cfg.head_dim,
                dtype=self.dtype,
                device=self.device,
                shared=cfg.attention is not None,  # V4's MTP depths are sliding layers
            )
            streams = StreamBuffer(
                n,
                self.max_batch_size,
                self.capacity,
                cfg.num_streams,
                cfg.dim,
                dtype=self.dtype,
                device=self.device,
            )
            self._drafter = DrafterState(cache, streams)
        return self._drafter

    def check_request(
        self, prompts: list[list[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[SamplingParams]:
        """Validate a generate call; ValueError naming the offending prompt or field."""
        if self.weight_version < 0:
            raise ValueError("engine has no weights loaded (use Engine.from_model or refit)")
        if not isinstance(prompts, list | tuple) or not prompts:
            raise ValueError(f"prompts must be a non-empty list of token lists, got {prompts!r}")
        per_row = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per_row) != len(prompts):
            raise ValueError(f"got {len(per_row)} SamplingParams for {len(prompts)} prompts")
        for i, prompt in enumerate(prompts):
            self.check_prompt(i, prompt)
        for p in per_row:
            self.check_params(p, per_row[0])
        return per_row

    def check_prompt(self, i: int, prompt: Sequence[int]) -> None:
        V = self.cfg.vocab_size
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty")
        if len(prompt) >= self.max_seq_len:
            raise ValueError(
                f"prompt {i} has length {len(prompt)} >= max_seq_len={self.max_seq_len} "
                "(no room to generate)"
            )
        bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < V]
        if bad:
            raise ValueError(f"prompt {i} holds token id {bad[0]!r} outside [0, {V})")

    def check_params(self, p: SamplingParams, first: SamplingParams) -> None:
        V, k = self.cfg.vocab_size, p.num_speculative_tokens
        bad = [t for t in p.stop_token_ids if t >= V]
        check(not bad, "stop_token_ids", p.stop_token_ids, f"ids must be < vocab_size={V}")
        check(
            k == first.num_speculative_tokens,
            "num_speculative_tokens",
            k,
            "must be equal for all prompts",
        )
        check(p.seed == first.seed, "seed", p.seed, "must be equal for all prompts")
        if k:
            check(
                self.cfg.mtp_depth >= 1, "num_speculative_tokens", k, "the model has no MTP depth"
            )
            limit = self.max_speculative_tokens
            check(k <= limit, "num_speculative_tokens", k, f"engine max_speculative_tokens={limit}")


@torch.no_grad()
def served_weights(
    model: torch.nn.Module, manifest: Mapping[str, TensorSpec], device: torch.device
) -> dict[str, Tensor]:
    """The manifest's tensors from `model`'s current weights: cast, or fp8 codes + scales."""
    table = engine_parts(model.cfg)  # type: ignore[arg-type]
    names = [part for parts in table.values() for part, _ in parts]
    shapes = [shape for parts in table.values() for _, shape in parts]
    found = iter(trainer_tensors(model, names, shapes))
    new: dict[str, Tensor] = {}
    for name, table_parts in table.items():
        parts, spec = [next(found) for _ in table_parts], manifest[name]
        if spec.dtype == FP8_DTYPE:
            new[name], new[name + SCALE_SUFFIX] = quantize_parts(parts, device)
            continue
        tensor = torch.empty(spec.shape, dtype=spec.dtype, device=device)
        for dst, part in zip(tensor.split([p.shape[0] for p in parts]), parts, strict=True):
            dst.copy_(part)
        new[name] = tensor
    return new
