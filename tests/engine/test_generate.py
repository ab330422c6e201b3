"""Engine generation against the trainer: greedy tokens, logprobs, MTP drafts, per-row stops."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import tiny_config

from birkhoff.engine import Engine, SamplingParams
from birkhoff.engine.decode import Generation
from birkhoff.engine.graphs import Steps
from birkhoff.engine.step import draft
from birkhoff.model import Transformer

RAGGED = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13, 14, 15, 0]]


def naive_greedy(
    model: Transformer, prompt: list[int], num_tokens: int
) -> tuple[list[int], list[float]]:
    """Reference: recompute the full logits every step, take the argmax."""
    ids, logps = list(prompt), []
    device = next(model.parameters()).device
    with torch.no_grad():
        for _ in range(num_tokens):
            logp_V = model(torch.tensor([ids], device=device)).logits[0, -1].log_softmax(-1)
            ids.append(int(logp_V.argmax()))
            logps.append(float(logp_V[ids[-1]]))
    return ids[len(prompt) :], logps


@pytest.mark.parametrize("streams", [1, 4])
def test_greedy_equals_naive_reference_on_ragged_prompts(streams: int) -> None:
    torch.manual_seed(0)
    model = Transformer(tiny_config(num_streams=streams)).double().eval()
    engine = Engine.from_model(model, dtype=torch.float64, max_batch_size=8)
    completions = engine.generate(RAGGED, SamplingParams(10))
    for prompt, completion in zip(RAGGED, completions, strict=True):
        tokens, logps = naive_greedy(model, prompt, 10)
        assert completion.tokens == tokens
        torch.testing.assert_close(completion.logprobs, logps, rtol=0, atol=1e-12)
        assert completion.weight_version == 0 and completion.finish_reason == "length"


def trainer_logprobs(
    model: Transformer, prompt: list[int], tokens: list[int], temperature: float
) -> torch.Tensor:
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits_TV = model(ids).logits[0, len(prompt) - 1 : -1].float()
    logp_TV = (logits_TV / temperature).log_softmax(-1)
    return logp_TV.gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


@pytest.mark.parametrize("num_speculative_tokens", [0, 2])
def test_sampled_logprobs_equal_trainer_fp32(
    trained_model: Transformer, num_speculative_tokens: int
) -> None:
    engine = Engine.from_model(trained_model, max_batch_size=8)
    params = SamplingParams(
        12, temperature=0.8, seed=3, num_speculative_tokens=num_speculative_tokens
    )
    for prompt, completion in zip(RAGGED, engine.generate(RAGGED, params), strict=True):
        expected = trainer_logprobs(trained_model, prompt, completion.tokens, 0.8)
        torch.testing.assert_close(torch.tensor(completion.logprobs), expected, rtol=0, atol=1e-5)


def test_greedy_logprobs_are_untempered_and_fp32_close(trained_model: Transformer) -> None:
    engine = Engine.from_model(trained_model, max_batch_size=8)
    for prompt, completion in zip(RAGGED, engine.generate(RAGGED, SamplingParams(8)), strict=True):
        expected = trainer_logprobs(trained_model, prompt, completion.tokens, 1.0)
        torch.testing.assert_close(torch.tensor(completion.logprobs), expected, rtol=0, atol=1e-5)


def chained_reference(model: Transformer, num_depths: int) -> Transformer:
    """A trainer model with `num_depths` MTP depths, the extra ones copies of the last depth:
    the trainer-side meaning of drafting beyond M by reusing the last depth."""
    cfg = model.cfg.replace(mtp_depth=num_depths)
    ref = Transformer(cfg).double().eval()
    state = {k: v.double() for k, v in model.state_dict().items()}
    last = model.cfg.mtp_depth - 1
    for k in range(model.cfg.mtp_depth, num_depths):
        prefix = f"mtp.{last}."
        state.update(
            {f"mtp.{k}." + n[len(prefix) :]: v for n, v in state.items() if n.startswith(prefix)}
        )
    ref.load_state_dict(state)
    return ref


def test_drafts_equal_trainer_mtp_after_rollbacks(trained_model: Transformer) -> None:
    """After several speculative steps (with rejections, so the MTP caches were rolled back), the
    draft distribution of every depth equals the trainer's MTP head on the same tokens."""
    K = trained_model.cfg.mtp_depth + 1
    ref = chained_reference(trained_model, K)
    engine = Engine.from_model(trained_model, dtype=torch.float64, max_batch_size=8)
    params = [SamplingParams(40, temperature=1.0, num_speculative_tokens=K)] * len(RAGGED)
    cache, drafter = engine.main_cache(), engine.drafter_state()
    run = Generation(
        cfg=engine.cfg, weights=engine.records, steps=Steps(), cache=cache,
        drafter=drafter, rows=engine.row_state(), rope=engine.rope, prompts=RAGGED, params=params,
        max_seq_len=engine.max_seq_len, seed=0, kernels=engine.kernels,
    )  # fmt: skip
    rows = list(range(len(RAGGED)))
    with torch.inference_mode():
        run.admit()
        for _ in range(4):
            run.collect_speculative(run.queue_speculative_step(rows, None))
        assert run.rows.n_B[rows].tolist() == [run.n[i] for i in rows]  # device == host
        assert run.drafter.valid_JB[:K, rows].tolist() == [[v[i] for i in rows] for v in run.valid]
        limit = max(run.n) + K + 1
        rows_A = torch.tensor(rows)
        live_A = torch.ones(len(rows), dtype=torch.bool)
        drafts_AJ, q_AJV = draft(run.context(rows), rows_A, len(rows), run.rows.n_B[rows_A],
                                 live_A, limit)  # fmt: skip
    assert 0 < run.stats.num_emitted - run.stats.num_steps < K * run.stats.num_steps  # mixed
    for i in rows:
        n = run.n[i]
        seq = run.tokens_BN[i, : n + K].tolist()  # accepted, pending t_n, drafts d_1..d_{K-1}
        ids = torch.tensor([seq])
        with torch.no_grad():
            heads = ref.mtp_hidden(ref.decoder(ids).multistream, ids)
        for k in range(K):
            expected_V = ref.lm_head(heads[k][0, n - 1]).log_softmax(-1)
            torch.testing.assert_close(q_AJV[i, k].log(), expected_V, rtol=0, atol=1e-9)
        assert drafts_AJ[i].tolist() == run.tokens_BN[i, n + 1 : n + K + 1].tolist()


def test_per_sequence_stop_tokens_and_max_new_tokens(trained_model: Transformer) -> None:
    engine = Engine.from_model(trained_model, max_batch_size=8)
    free = engine.generate(RAGGED, SamplingParams(12))
    stop = free[0].tokens[3]
    params = [
        SamplingParams(12, stop_token_ids=(stop,)),
        SamplingParams(2),
        SamplingParams(12),
        SamplingParams(5, stop_token_ids=(stop,)),
    ]
    out = engine.generate(RAGGED, params)
    first = free[0].tokens.index(stop)
    assert out[0].tokens == free[0].tokens[: first + 1] and out[0].finish_reason == "stop"
    assert out[1].tokens == free[1].tokens[:2] and out[1].finish_reason == "length"
    assert out[2].tokens == free[2].tokens
    expect3 = free[3].tokens[:5]
    if stop in expect3:
        expect3 = expect3[: expect3.index(stop) + 1]
    assert out[3].tokens == expect3


def test_generation_stops_at_max_seq_len(trained_model: Transformer) -> None:
    engine = Engine.from_model(trained_model, max_seq_len=10, max_batch_size=8)
    for k in (0, 2):
        out = engine.generate(RAGGED, SamplingParams(50, num_speculative_tokens=k))
        for prompt, completion in zip(RAGGED, out, strict=True):
            assert len(prompt) + len(completion.tokens) == 10
            assert completion.finish_reason == "length"


def test_seeded_sampling_is_reproducible(trained_model: Transformer) -> None:
    engine = Engine.from_model(trained_model, max_batch_size=8)
    params = SamplingParams(10, temperature=1.0, top_k=5, top_p=0.9, seed=7)
    a, b = engine.generate(RAGGED, params), engine.generate(RAGGED, params)
    other = engine.generate(RAGGED, SamplingParams(10, temperature=1.0, top_k=5, top_p=0.9, seed=8))
    assert [c.tokens for c in a] == [c.tokens for c in b]
    assert [c.tokens for c in a] != [c.tokens for c in other]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_engine_matches_trainer_and_runs_bf16() -> None:
    torch.manual_seed(0)
    model = Transformer(tiny_config()).cuda().eval()
    engine = Engine.from_model(model, device="cuda", max_batch_size=8)
    for k in (0, 3):
        out = engine.generate(RAGGED, SamplingParams(8, num_speculative_tokens=k))
        for prompt, completion in zip(RAGGED, out, strict=True):
            tokens, logps = naive_greedy(model, prompt, 8)
            assert completion.tokens == tokens
            torch.testing.assert_close(completion.logprobs, logps, rtol=0, atol=1e-4)
    bf16 = Engine.from_model(model, device="cuda", dtype=torch.bfloat16, max_batch_size=8)
    params = SamplingParams(8, temperature=1.0, seed=0, num_speculative_tokens=2)
    assert all(len(c.tokens) == 8 for c in bf16.generate(RAGGED, params))
