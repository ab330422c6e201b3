"""Shared helpers for refit tests: tiny configs, trainer models, engine factory, scoring.

`make_engine` builds the real `birkhoff.engine.Engine` when it is importable, otherwise a minimal
stand-in that honours the same contract (manifest, weights, weight_version, commit_weights,
greedy generate with logprobs), so the refit tests do not depend on the engine's internals.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from birkhoff.config import ModelConfig
from birkhoff.model import Transformer
from birkhoff.refit.fp8 import FP8_DTYPE, dequantize_fp8_blockwise, quantize_fp8_blockwise
from birkhoff.refit.layout import (
    FUSIONS,
    engine_shapes,
    is_matmul_weight,
    to_engine_layout,
    trainer_tensors,
)

try:
    from birkhoff.engine import Engine, SamplingParams  # type: ignore[attr-defined]

    REAL_ENGINE = True
except ImportError:
    REAL_ENGINE = False


def tiny_config(**overrides: Any) -> ModelConfig:
    base: dict[str, Any] = dict(vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                num_streams=2, mtp_depth=2, max_seq_len=32)  # fmt: skip
    base.update(overrides)
    return ModelConfig(**base)


def make_model(cfg: ModelConfig, seed: int) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(cfg)
    with torch.no_grad():  # move the mHC coefficients off their init so they matter
        for name, p in model.named_parameters():
            if name.endswith(("phi", "alpha", "norm.weight")):
                p.add_(0.05 * torch.randn_like(p))
    return model


@dataclass
class _Completion:
    tokens: list[int]
    logprobs: list[float]
    weight_version: int


@dataclass(frozen=True)
class _Params:
    max_new_tokens: int
    temperature: float = 0.0


class StandInEngine:
    """Contract-only engine: served dict + manifest + greedy decoding by full recompute."""

    def __init__(self, cfg: ModelConfig, *, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 quantize: str | None = None) -> None:  # fmt: skip
        self.cfg, self.device, self.dtype, self.quantize = (
            cfg,
            torch.device(device),
            dtype,
            quantize,
        )
        self._manifest: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for name, shape in engine_shapes(cfg).items():
            if quantize == "fp8" and is_matmul_weight(name):
                scale = (-(-shape[0] // 128), -(-shape[1] // 128))
                self._manifest[name] = (shape, FP8_DTYPE)
                self._manifest[name + "_scale_inv"] = (scale, torch.float32)
            else:
                self._manifest[name] = (shape, dtype)
        self.weights: dict[str, Tensor] = {}
        self.weight_version = 0

    @classmethod
    def from_model(cls, model: Transformer, **kw: Any) -> StandInEngine:
        engine = cls(model.cfg, **kw)
        for name, t in to_engine_layout(trainer_tensors(model, model.cfg)):
            if engine._manifest[name][1] == FP8_DTYPE:
                q, s = quantize_fp8_blockwise(t.detach())
                engine.weights[name], engine.weights[name + "_scale_inv"] = q, s
            else:
                engine.weights[name] = t.detach().to(engine.dtype).clone()
        return engine

    def manifest(self) -> dict[str, Any]:
        from collections import namedtuple

        spec = namedtuple("TensorSpec", "shape dtype")
        return {n: spec(s, d) for n, (s, d) in self._manifest.items()}

    def commit_weights(self, new: dict[str, Tensor]) -> int:
        self.weights = dict(new)
        self.weight_version += 1
        return self.weight_version

    def _trainer(self) -> Transformer:
        state: dict[str, Tensor] = {}
        for name, t in self.weights.items():
            if name.endswith("_scale_inv"):
                continue
            if t.dtype == FP8_DTYPE:
                t = dequantize_fp8_blockwise(t, self.weights[name + "_scale_inv"])
            state.update(_unfuse(name, t.float(), self.cfg))
        model = Transformer(self.cfg)
        if self.cfg.tie_embeddings:
            state["lm_head.weight"] = state["embed.weight"]
        model.load_state_dict(state)
        return model

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: Any) -> list[_Completion]:
        model, out = self._trainer(), []
        for prompt in prompts:
            ids, logps = list(prompt), []
            for _ in range(params.max_new_tokens):
                logp = model(torch.tensor([ids])).logits[0, -1].log_softmax(-1)
                ids.append(int(logp.argmax()))
                logps.append(float(logp[ids[-1]]))
            out.append(_Completion(ids[len(prompt) :], logps, self.weight_version))
        return out


def _unfuse(name: str, t: Tensor, cfg: ModelConfig) -> dict[str, Tensor]:
    for fused, parts in FUSIONS.items():
        if name.endswith(fused):
            prefix = name[: -len(fused)]
            if fused.startswith("attn"):
                q, kv = cfg.num_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
                sizes = [q, kv, kv]
            else:
                sizes = [cfg.ffn_dim, cfg.ffn_dim]
            return {prefix + p: c for p, c in zip(parts, t.split(sizes), strict=True)}
    return {name: t}


PROMPTS = [[1, 2, 3, 4, 5], [7, 3], [60, 61, 62, 10, 11, 12, 13]]


def make_engine(model: Transformer, **kw: Any) -> Any:
    """Engine built directly from `model` (the 'direct load' a refit must reproduce)."""
    if REAL_ENGINE:
        return Engine.from_model(model, device="cpu", max_batch_size=len(PROMPTS), **kw)
    return StandInEngine.from_model(model, **kw)


def greedy(max_new_tokens: int) -> Any:
    if REAL_ENGINE:
        return SamplingParams(max_new_tokens=max_new_tokens)
    return _Params(max_new_tokens)


def run(engine: Any, num_tokens: int = 4) -> list[tuple[list[int], list[float], int]]:
    """(tokens, logprobs, weight_version) of greedy completions of PROMPTS."""
    completions = engine.generate(PROMPTS, greedy(num_tokens))
    return [(list(c.tokens), [float(x) for x in c.logprobs], c.weight_version) for c in completions]


@torch.no_grad()
def trainer_logprobs(model: Transformer, prompt: list[int], tokens: list[int]) -> Tensor:
    """log p(tokens[i] | prompt + tokens[:i]) under the trainer, fp32."""
    ids = torch.tensor([prompt + tokens])
    logp = model(ids).logits[0].float().log_softmax(-1)
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(tokens) - 1)
    return logp[positions, torch.tensor(tokens)]
