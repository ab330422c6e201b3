"""Speculative decoding: exact acceptance rule, greedy identity, distribution equality.

Statistical tests use Pearson's chi-square at significance level ALPHA = 1e-3 against exact
probabilities; every generator is seeded, so each test is deterministic (it cannot flake), and
a wrong acceptance rule shifts the distribution far beyond what the test tolerates.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from engine_helpers import chi_square_pvalue

from birkhoff.engine import Engine, SamplingParams
from birkhoff.engine.sampling import RowSampling, target_logprobs
from birkhoff.engine.speculative import SpecStats, accept_drafts
from birkhoff.model import Transformer

ALPHA = 1e-3
RAGGED = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13, 14, 15, 0], [3, 5, 8, 13]]


def uniforms(gen: torch.Generator, A: int, J: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(acceptance uniforms [A,J], next-token uniforms [A]) as the engine passes them."""
    return torch.rand(A, J, generator=gen, dtype=torch.float64), torch.rand(
        A, generator=gen, dtype=torch.float64
    )


def test_accept_drafts_first_token_is_distributed_as_p() -> None:
    gen = torch.Generator().manual_seed(0)
    V, A = 5, 100_000
    p_V = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05], dtype=torch.float64)
    q_V = torch.tensor([0.1, 0.2, 0.3, 0.2, 0.2], dtype=torch.float64)
    p_ATV = p_V.expand(A, 2, V).clone()
    q_AJV = q_V.expand(A, 1, V).clone()
    drafts_AJ = torch.multinomial(q_V, A, replacement=True, generator=gen)[:, None]
    u_AJ, u_A = uniforms(gen, A, 1)
    num_acc_A, next_A = accept_drafts(p_ATV, q_AJV, drafts_AJ, u_AJ, u_A)
    first_A = torch.where(num_acc_A > 0, drafts_AJ[:, 0], next_A)
    assert chi_square_pvalue(torch.bincount(first_A, minlength=V), p_V) > ALPHA
    # acceptance probability is sum_x min(p(x), q(x)) = 0.6
    assert abs(num_acc_A.double().mean().item() - 0.6) < 0.01
    # the same rule with the roles swapped is wrong, and the test sees it
    _, wrong_A = accept_drafts(q_AJV.expand(A, 2, V), p_ATV[:, :1], drafts_AJ, *uniforms(gen, A, 1))
    wrong_first = torch.where(num_acc_A > 0, drafts_AJ[:, 0], wrong_A)
    assert chi_square_pvalue(torch.bincount(wrong_first, minlength=V), p_V) < ALPHA


def test_accept_drafts_one_hot_is_argmax_agreement() -> None:
    gen = torch.Generator().manual_seed(0)
    eye = torch.eye(4)
    p_ATV = eye[torch.tensor([[1, 2, 3], [1, 0, 3], [2, 2, 2]])]  # target argmax per position
    drafts_AJ = torch.tensor([[1, 2], [1, 2], [0, 2]])
    q_AJV = eye[drafts_AJ]
    num_acc_A, next_A = accept_drafts(p_ATV, q_AJV, drafts_AJ, *uniforms(gen, 3, 2))
    assert num_acc_A.tolist() == [2, 1, 0]
    assert next_A.tolist() == [3, 0, 2]  # bonus; first mismatch -> target argmax


def test_spec_stats() -> None:
    stats = SpecStats(3)
    stats.record([0, 3, 1, 2])
    assert stats.acceptance_rate == [0.75, 0.5, 0.25]
    assert stats.conditional_acceptance_rate == [0.75, 2 / 3, 0.5]
    assert stats.mean_accepted_length == (1 + 4 + 2 + 3) / 4


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_greedy_speculative_equals_greedy_plain(trained_model: Transformer, k: int) -> None:
    engine = Engine.from_model(trained_model, dtype=torch.float64, max_batch_size=8)
    plain = engine.generate(RAGGED, SamplingParams(16))
    spec = engine.generate(RAGGED, SamplingParams(16, num_speculative_tokens=k))
    assert [c.tokens for c in spec] == [c.tokens for c in plain]
    torch.testing.assert_close(
        [c.logprobs for c in spec], [c.logprobs for c in plain], rtol=0, atol=1e-12
    )
    stats = engine.last_stats
    assert stats is not None and stats.num_drafts == k
    assert 0 < stats.accepted_at[0] < stats.num_steps, "need both accepted and rejected drafts"


def exact_pair_probs(model: Transformer, prompt: list[int], params: SamplingParams) -> torch.Tensor:
    """P(t2, t3) [V, V] of plain sampling, marginalised over t1, from the trainer's logits."""
    V = model.cfg.vocab_size
    rs = RowSampling.build([params], torch.device("cpu"))

    def logp(seqs: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            logits_AV = model(seqs).logits[:, -1].double()
        return target_logprobs(logits_AV, rs.select(torch.zeros(len(seqs), dtype=torch.long)))

    base = torch.tensor([prompt])
    p1_V = logp(base)[0].exp()
    seqs1 = torch.cat((base.expand(V, -1), torch.arange(V)[:, None]), dim=1)
    p2_VV = logp(seqs1).exp()  # [t1, t2]
    pairs = torch.tensor(list(itertools.product(range(V), range(V))))
    seqs2 = torch.cat((base.expand(V * V, -1), pairs), dim=1)
    p3_VVV = logp(seqs2).exp().view(V, V, V)  # [t1, t2, t3]
    return (p1_V[:, None, None] * p2_VV[:, :, None] * p3_VVV).sum(0)


@pytest.mark.parametrize(
    "sampling",
    [dict(temperature=1.0), dict(temperature=0.7, top_k=6, top_p=0.9)],
    ids=["t1", "t0.7-topk-topp"],
)
def test_speculative_and_plain_sample_the_same_distribution(
    trained_model: Transformer, sampling: dict[str, float]
) -> None:
    prompt, N, V = [3, 5, 8, 13], 6000, trained_model.cfg.vocab_size
    exact_VV = exact_pair_probs(trained_model, prompt, SamplingParams(3, **sampling))  # type: ignore[arg-type]
    engine = Engine.from_model(trained_model, max_batch_size=N)
    for k in (0, 2):
        params = SamplingParams(3, seed=11, num_speculative_tokens=k, **sampling)  # type: ignore[arg-type]
        out = engine.generate([prompt] * N, params)
        pairs = torch.tensor([c.tokens[1] * V + c.tokens[2] for c in out])
        pvalue = chi_square_pvalue(torch.bincount(pairs, minlength=V * V), exact_VV)
        assert pvalue > ALPHA, f"k={k}: p-value {pvalue:.2e} rejects the exact distribution"
        if k:
            stats = engine.last_stats
            assert stats is not None
            assert 0 < stats.accepted_at[0] < stats.num_steps


def test_greedy_row_in_a_sampled_batch_keeps_its_greedy_tokens(trained_model: Transformer) -> None:
    engine = Engine.from_model(trained_model, dtype=torch.float64, max_batch_size=8)
    greedy = engine.generate(RAGGED[:2], SamplingParams(12))
    params = [SamplingParams(12), SamplingParams(12, temperature=1.0, num_speculative_tokens=2)]
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        engine.generate(RAGGED[:2], params)
    params[0] = SamplingParams(12, num_speculative_tokens=2)
    mixed = engine.generate(RAGGED[:2], params)
    assert mixed[0].tokens == greedy[0].tokens
    assert mixed[0].logprobs == pytest.approx(greedy[0].logprobs, abs=1e-12)
