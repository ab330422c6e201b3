"""DeepSeek-V4 in the engine: weight records, the sliding / CSA / HCA caches, hash-routed MoE,
MTP drafts and refit, against the trainer's full-sequence forward (itself exact against
transformers: tests/model/test_v4_*.py).

The configs are tiny (window 6, CSA windows of 4, HCA windows of 8, top-3 entries) and the
prompts and completions cross all of them. The indexer has 16 heads: its scores are sums of
ReLUs, and with 2 heads exact-zero ties are common, where `topk` picks among equals by its
implementation (which then depends on how many entries a call holds).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from test_generate import naive_greedy

from birkhoff.config import ModelConfig, MoEConfig, V4AttentionConfig
from birkhoff.engine import Engine, SamplingParams
from birkhoff.engine.forward import chunk_at, decode_step
from birkhoff.engine.layout import build_manifest, engine_parts, leaves, load_weights
from birkhoff.model import Transformer
from birkhoff.model.moe import HashMoEFeedForward, MoEFeedForward
from birkhoff.refit import Bucket, RefitError, RefitSession, refit
from birkhoff.refit.bucket import as_bytes, bucket_nbytes, place

SLIDING, CSA, HCA = (
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
)
KINDS = (SLIDING, CSA, HCA)
PROMPTS = [[1, 2, 3], list(range(5, 14)), list(range(20, 37))]  # lengths 3, 9, 17
NEW = 20  # the longest row ends at position 36: past 4 HCA and 9 CSA windows


def v4_config(
    kinds: tuple[str, ...] = KINDS, *, moe: bool = True, **overrides: object
) -> ModelConfig:
    attention = V4AttentionConfig(
        q_lora_rank=12, head_dim=16, qk_rope_head_dim=8, layer_types=kinds,  # type: ignore[arg-type]
        sliding_window=6, compress_rate_csa=4, compress_rate_hca=8, index_n_heads=16,
        index_head_dim=12, index_topk=3, o_groups=2, o_lora_rank=8, compress_rope_theta=4000.0,
    )  # fmt: skip
    experts = MoEConfig(
        num_experts=4, experts_per_token=2, expert_hidden=24, num_dense_layers=0,
        num_hash_layers=1, scoring="sqrtsoftplus", swiglu_limit=1.5,
    )  # fmt: skip
    base: dict[str, object] = dict(
        vocab_size=61, dim=32, num_layers=len(kinds), num_heads=4, num_kv_heads=1,
        mlp_hidden=24, num_streams=4, sinkhorn_iters=5, mtp_depth=1, max_seq_len=64,
        rope_theta=500.0, attention=attention, moe=experts if moe else None,
    )  # fmt: skip
    return ModelConfig(**{**base, **overrides})  # type: ignore[arg-type]


def v4_model(cfg: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float64) -> Transformer:
    """A random model whose every tensor matters: weights ~ fan_in^-1/2, norms near 1, sinks,
    biases and the router bias ~ N(0, 0.5 / 0.3), a random hash table."""
    torch.manual_seed(seed)
    model = Transformer(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, p.shape[-1] ** -0.5)
            elif name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.5)
        for module in model.modules():
            if isinstance(module, HashMoEFeedForward):
                E = module.moe.num_experts
                picks = [torch.randperm(E)[:2] for _ in range(cfg.vocab_size)]
                module.tid2eid.copy_(torch.stack(picks))
            elif isinstance(module, MoEFeedForward):
                module.router_bias.normal_(0.0, 0.3)
    return model.to(dtype).eval()


def test_layout_serves_every_v4_tensor_once() -> None:
    """Every trainer tensor of a V4 MoE model (attention, compressors, indexer, router bias,
    hash table; main layers and the MTP depth) is one part of one served tensor, with its
    shape; the records read exactly the manifest, plain and fp8."""
    cfg = v4_config()
    with torch.device("meta"):
        model = Transformer(cfg)
    trainer = {n: tuple(p.shape) for n, p in model.named_parameters()}
    buffers = dict(model.named_buffers())
    trainer.update({n: tuple(b.shape) for n, b in buffers.items() if "router_bias" in n})
    trainer.update({n: tuple(b.shape) for n, b in buffers.items() if "tid2eid" in n})
    parts = [part for ps in engine_parts(cfg).values() for part in ps]
    assert sorted(name for name, _ in parts) == sorted(trainer)
    assert all(trainer[name] == shape for name, shape in parts)
    for quantize in (None, "fp8"):
        manifest = build_manifest(cfg, dtype=torch.bfloat16, quantize=quantize)  # type: ignore[arg-type]
        assert manifest["layers.0.mlp.tid2eid"].dtype == torch.int64
        assert "layers.0.mlp.router_bias" not in manifest  # the hash layer has no selection bias
        kv_gate = manifest["layers.1.attn.compressor.indexer.kv_gate.weight"]
        assert kv_gate == ((4 * 12, 32), torch.bfloat16)  # compressors stay out of fp8
        weights = {n: torch.empty(s.shape, dtype=s.dtype) for n, s in manifest.items()}
        read = [id(t) for t in leaves(load_weights(cfg, weights))]
        assert sorted(read) == sorted(id(t) for t in weights.values())
    fp8 = build_manifest(cfg, dtype=torch.bfloat16, quantize="fp8")
    assert fp8["mtp.0.block.attn.q_a_kv.weight"].dtype == torch.float8_e4m3fn


@pytest.mark.parametrize(
    ("kinds", "moe"),
    [((SLIDING, SLIDING), False), ((CSA, CSA), False), ((HCA, HCA), False), (KINDS, True)],
    ids=["sliding", "csa", "hca", "all-moe"],
)
def test_greedy_tokens_equal_the_trainer(kinds: tuple[str, ...], moe: bool) -> None:
    """fp64: the engine's greedy tokens are the trainer's full-forward argmax at every step, and
    its logprobs the trainer's, on ragged prompts decoded across windows in one batch."""
    model = v4_model(v4_config(kinds, moe=moe))
    engine = Engine.from_model(model, dtype=torch.float64, max_batch_size=4)
    for prompt, completion in zip(PROMPTS, engine.generate(PROMPTS, SamplingParams(NEW)),
                                  strict=True):  # fmt: skip
        tokens, logps = naive_greedy(model, prompt, NEW)
        assert completion.tokens == tokens
        torch.testing.assert_close(completion.logprobs, logps, rtol=0, atol=1e-12)


def test_fp32_logprobs_equal_the_trainer_within_tolerance() -> None:
    """fp32 engine and trainer: every completion token's logprob within 1e-5 of the trainer's
    teacher-forced full forward over prompt + completion (measured: 3.3e-6)."""
    model = v4_model(v4_config(), dtype=torch.float32)
    engine = Engine.from_model(model, dtype=torch.float32, max_batch_size=4)
    for prompt, completion in zip(PROMPTS, engine.generate(PROMPTS, SamplingParams(NEW)),
                                  strict=True):  # fmt: skip
        ids = torch.tensor([prompt + completion.tokens])
        with torch.no_grad():
            logp_TV = model(ids).logits[0].log_softmax(-1)
        at = torch.arange(len(prompt) - 1, ids.shape[1] - 1)
        expected = logp_TV[at, torch.tensor(completion.tokens)]
        torch.testing.assert_close(torch.tensor(completion.logprobs), expected, rtol=0, atol=1e-5)


def chunks(total: int) -> Iterator[tuple[int, int, bool]]:
    """(start, length, rejected first) of the chunks that cover positions 0..total-1: a prefill
    of 13, then single tokens and verify chunks of 3, every other verify chunk run first with
    wrong tokens (a rejection) and then again with the true ones."""
    yield 0, 13, False
    start, i = 13, 0
    while start < total:
        T = 1 if i % 3 == 0 else 3
        T = min(T, total - start)
        yield start, T, T > 1 and i % 2 == 0
        start, i = start + T, i + 1


def test_prefill_decode_and_verify_chunks_give_the_trainer_logits() -> None:
    """fp64: the logits of every position, computed in chunks over the caches (prefill, single
    tokens, verify chunks of J+1 = 3, rejected chunks re-run with the true tokens), equal the
    trainer's full-sequence forward (every layer kind, hash and top-k MoE)."""
    model = v4_model(v4_config())
    engine = Engine.from_model(model, dtype=torch.float64, max_batch_size=2)
    cache, w, cfg = engine.main_cache(), engine.records, engine.cfg
    gen = torch.Generator().manual_seed(3)
    ids_N = torch.randint(0, cfg.vocab_size, (40,), generator=gen)
    with torch.no_grad():
        expected_NV = model(ids_N[None]).logits[0]
    rows_A = torch.tensor([1])  # not row 0: reads go through the row gather
    for start, T, rejected in chunks(len(ids_N)):
        positions_AT = torch.arange(start, start + T)[None]
        valid_AT = torch.ones_like(positions_AT, dtype=torch.bool)
        chunk = chunk_at(rows_A, None, positions_AT, valid_AT, rope=engine.rope, limit=start + T)
        tokens_AT = ids_N[positions_AT]
        with torch.inference_mode():
            if rejected:
                wrong = (tokens_AT + 7) % cfg.vocab_size
                decode_step(w, cfg, cache, wrong, chunk, kernels="eager")
            _, logits_ATV = decode_step(w, cfg, cache, tokens_AT, chunk, kernels="eager")
        torch.testing.assert_close(
            logits_ATV[0], expected_NV[start : start + T], rtol=0, atol=1e-12
        )


@pytest.mark.parametrize("k", [1, 3])
def test_speculative_greedy_with_the_v4_drafter_equals_plain(k: int) -> None:
    """The MTP depth (a sliding layer, its own shared-head cache) drafts; greedy tokens and
    logprobs are those of plain decoding."""
    model = v4_model(v4_config())
    engine = Engine.from_model(model, dtype=torch.float64, max_batch_size=4)
    plain = engine.generate(PROMPTS, SamplingParams(NEW))
    spec = engine.generate(PROMPTS, SamplingParams(NEW, num_speculative_tokens=k))
    for a, b in zip(plain, spec, strict=True):
        assert a.tokens == b.tokens
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-12)
    stats = engine.last_stats
    assert stats is not None and stats.num_emitted > stats.num_steps  # some drafts accepted


def buckets_of(named: dict[str, torch.Tensor], bucket_bytes: int) -> Iterator[Bucket]:
    """The tensors packed as they are into buckets (the session's input)."""
    specs = [[(n, t.dtype, tuple(t.shape))] for n, t in named.items()]
    for index, entries in enumerate(place(specs, bucket_bytes)):
        buffer = torch.empty(bucket_nbytes(entries), dtype=torch.uint8)
        for e in entries:
            src = as_bytes(named[e.name].contiguous())[e.chunk_offset :][: e.nbytes]
            buffer[e.offset : e.offset + e.nbytes].copy_(src)
        yield Bucket(index, buffer, entries)


@pytest.mark.parametrize(
    "lost", ["layers.1.attn.compressor.indexer.kv_gate.weight", "mtp.0.block.attn.sinks"]
)
def test_refit_of_a_v4_model_checks_every_tensor_and_commits_atomically(lost: str) -> None:
    """An update lacking one V4 tensor (main model or drafter) is a RefitError naming it, and
    the engine keeps serving the old weights; a full refit serves the new model's greedy."""
    cfg = v4_config()
    old, new = v4_model(cfg, seed=0), v4_model(cfg, seed=1)
    engine = Engine.from_model(old, dtype=torch.float64, max_batch_size=4)
    before = engine.generate(PROMPTS, SamplingParams(8))
    update = Engine.from_model(new, dtype=torch.float64, max_batch_size=1).weights
    session = RefitSession(engine)
    session.begin()
    for bucket in buckets_of({n: t for n, t in update.items() if n != lost}, 4096):
        session.load_bucket(bucket)
    with pytest.raises(RefitError, match=lost) as info:
        session.finish()
    assert info.value.missing == [lost] and engine.weight_version == 0
    assert [c.tokens for c in engine.generate(PROMPTS, SamplingParams(8))] == [
        c.tokens for c in before
    ]
    assert refit(new, engine, bucket_bytes=4096).version == 1
    after = engine.generate(PROMPTS, SamplingParams(8))
    assert [c.tokens for c in after] != [c.tokens for c in before]
    for prompt, completion in zip(PROMPTS, after, strict=True):
        assert completion.tokens == naive_greedy(new, prompt, 8)[0]
