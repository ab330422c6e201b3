"""Shared helpers for refit tests: tiny configs, models, engines, greedy runs, packing as-is."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor

from birkhoff.config import ModelConfig
from birkhoff.engine import Engine, SamplingParams
from birkhoff.model import Transformer
from birkhoff.refit.bucket import Assembler, Bucket, as_bytes, bucket_nbytes, place

PROMPTS = [[1, 2, 3, 4, 5], [7, 3], [60, 61, 62, 10, 11, 12, 13]]


def tiny_config(**overrides: Any) -> ModelConfig:
    base: dict[str, Any] = dict(vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                num_streams=2, mtp_depth=2, max_seq_len=32)  # fmt: skip
    base.update(overrides)
    return ModelConfig(**base)


def make_model(cfg: ModelConfig, seed: int) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(cfg)
    with torch.no_grad():  # move the mHC coefficients and norms off their init so they matter
        for name, p in model.named_parameters():
            if name.endswith(("phi", "alpha", "norm.weight")):
                p.add_(0.05 * torch.randn_like(p))
    return model


def make_engine(model: Transformer, **kw: Any) -> Engine:
    """Engine built directly from `model` (the 'direct load' a refit must reproduce)."""
    return Engine.from_model(model, device="cpu", max_batch_size=len(PROMPTS), **kw)


def run(engine: Engine, num_tokens: int = 4, **kw: Any) -> list[tuple[list[int], list[float], int]]:
    """(tokens, logprobs, weight_version) of greedy completions of PROMPTS."""
    params = SamplingParams(max_new_tokens=num_tokens, **kw)
    completions = engine.generate(PROMPTS, params)
    return [(list(c.tokens), [float(x) for x in c.logprobs], c.weight_version) for c in completions]


@torch.no_grad()
def trainer_logprobs(model: Transformer, prompt: list[int], tokens: list[int]) -> Tensor:
    """log p(tokens[i] | prompt + tokens[:i]) under the trainer, fp32."""
    ids = torch.tensor([prompt + tokens])
    logp = model(ids).logits[0].float().log_softmax(-1)
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(tokens) - 1)
    return logp[positions, torch.tensor(tokens)]


def bit_equal(a: dict[str, Tensor], b: dict[str, Tensor]) -> bool:
    """Same names, dtypes, shapes and bytes."""
    return a.keys() == b.keys() and all(
        a[n].dtype == b[n].dtype
        and a[n].shape == b[n].shape
        and torch.equal(a[n].reshape(-1).view(torch.uint8), b[n].reshape(-1).view(torch.uint8))
        for n in a
    )


def pack_buckets(
    named: Iterable[tuple[str, Tensor]], bucket_bytes: int, *, device: str = "cpu"
) -> Iterator[Bucket]:
    """Pack (name, tensor) pairs as they are (any dtype, repeats allowed), a buffer per bucket."""
    named = list(named)
    specs = [[(n, t.dtype, tuple(t.shape))] for n, t in named]
    sources: dict[str, list[Tensor]] = {}
    for name, tensor in named:  # a repeated name sends its tensors in turn
        sources.setdefault(name, []).append(tensor.contiguous())
    sent: dict[str, int] = {}
    for index, entries in enumerate(place(specs, bucket_bytes)):
        buffer = torch.empty(bucket_nbytes(entries), dtype=torch.uint8, device=device)
        for e in entries:
            if e.chunk_offset == 0:  # the next tensor of this name starts
                sent[e.name] = sent.get(e.name, -1) + 1
            src = as_bytes(sources[e.name][sent[e.name]])
            buffer[e.offset : e.offset + e.nbytes].copy_(src[e.chunk_offset :][: e.nbytes])
        yield Bucket(index, buffer, entries)


def unpack_buckets(buckets: Iterable[Bucket], *, device: str = "cpu") -> dict[str, Tensor]:
    """Reassemble buckets (in any order) into whole tensors; ValueError on any problem."""
    assembler = Assembler(device)
    for bucket in buckets:
        assembler.stage(bucket)
    problems = assembler.duplicated | assembler.inconsistent | assembler.incomplete()
    if problems:
        raise ValueError(f"buckets did not reassemble cleanly: {sorted(problems)}")
    return assembler.tensors
