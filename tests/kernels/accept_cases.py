"""Shared checks of the fused verify tail (kernels/accept.py) against the launches it replaces
(the rows' parameters gathered, the fused row arithmetic of sample_rows at every verified
position, RequestRandom's uniforms, speculative.accept_drafts, the token's write, the result's
gathers and the next step's n and draft starts), run in the Triton interpreter on CPU
(rng_interpret_cases.py) and on CUDA (test_rng_gpu.py).

Distributions, logprobs and acceptance decisions: the same bits. The next token: equal (the
residual's fp64 scan runs in another order than torch's cumsum; the draws here would have to
land within ~1e-15 of a boundary to differ).
"""

from __future__ import annotations

import pytest
import torch

from birkhoff.engine.rng import ACCEPT, SAMPLE, TAGS, RequestRandom
from birkhoff.engine.sampling import SamplingParams, SamplingTable
from birkhoff.engine.speculative import accept_drafts
from birkhoff.kernels.accept import verify_accept
from birkhoff.kernels.sample import sample_rows

# (drafts J, vocab V, logits dtype, draft agreement): one and several drafts, one block and
# several, drafts copied from the target's argmax (mostly accepted) or drawn at random
ACCEPT_CASES = [(1, 37, torch.float32, False), (2, 300, torch.float32, True),
                (3, 2500, torch.bfloat16, False), (2, 64, torch.float32, True)]  # fmt: skip


def check_verify_accept(device: str, J: int, V: int, dtype: torch.dtype, agree: bool) -> None:
    dev = torch.device(device)
    R, N, trash, T = 8, 40, 39, J + 1
    g = torch.Generator().manual_seed(J * 100 + V)
    temps = (0.0, 0.8, 1.2, 0.0, 1.0, 0.5, 2.0, 0.0)
    table = SamplingTable(R, dev)
    table.assign(list(range(R)), [SamplingParams(4, temperature=t) for t in temps])
    keys = [RequestRandom.request_key(seed=J, request=r) for r in range(R)]
    rng = RequestRandom(R, dev, "triton")
    rng.assign(list(range(R)), keys)
    rows = torch.tensor([6, 0, 2, 5, 1, 3, 7], device=dev)
    A = len(rows)
    n = torch.randint(0, N - T - 1, (A,), generator=g).to(dev)
    live = torch.tensor([True, True, True, False, True, True, True], device=dev)
    logits = (torch.randn(A, T, V, generator=g) * 2).to(dev, dtype)
    q_logits = logits[:, :J].float() + (0.0 if agree else torch.randn(A, J, V, generator=g).to(dev))
    rs_q = table.select(rows, J, filtered=False)
    u_q = torch.rand(A * J, generator=g, dtype=torch.float64).to(dev)
    _, q, drafts = sample_rows(q_logits.reshape(A * J, V), rs_q.temperature_A, rs_q.greedy_A, u_q)
    q, drafts = q.view(A, J, V).contiguous(), drafts.view(A, J).contiguous()
    tokens = torch.randint(0, V, (R, N), generator=g).to(dev)
    expected_tokens = tokens.clone()
    tables = (table.params.temperature_A, table.params.greedy_A, rng.keys_R)
    n_B = torch.randint(0, N, (R,), generator=g).to(dev)
    starts = torch.randint(0, N, (J + 1, R), generator=g).to(dev)  # one depth more than used
    state = (tokens, n_B, starts)
    expected_n, expected_starts = n_B.clone(), starts.clone()
    num, out = verify_accept(logits, q, drafts, rows, n, live, *tables, *state, trash, TAGS,
                             SAMPLE, ACCEPT)  # fmt: skip
    # the launches it replaces, as engine.step.verify ran them
    rs = table.select(rows, T, filtered=False)
    logp, p, _ = sample_rows(logits.reshape(A * T, V), rs.temperature_A, rs.greedy_A, None)
    tags = ACCEPT + torch.arange(1, J + 1, device=dev)
    u_AJ = rng.uniform(rows[:, None], n[:, None], tags[None, :])
    num_ref, next_ref = accept_drafts(p.view(A, T, V), q, drafts, u_AJ, rng.uniform(rows, n, 0))
    expected_tokens[rows, torch.where(live, n + 1 + num_ref, trash)] = next_ref
    emitted = torch.cat((drafts, next_ref[:, None]), dim=1)
    emitted[torch.arange(A, device=dev), num_ref] = next_ref
    logp_AT = logp.view(A, T, V).gather(-1, emitted[..., None]).squeeze(-1)
    ref = torch.cat((num_ref[:, None].double(), emitted.double(), logp_AT.double()), dim=1)
    assert torch.equal(num, num_ref) and torch.equal(out, ref)
    assert torch.equal(tokens, expected_tokens)
    expected_n[rows] = torch.where(live, n + 1 + num_ref, n_B[rows])
    depth = torch.arange(1, J + 1, device=dev)[:, None]
    expected_starts[:J, rows] = torch.where(live, (n - depth + 1).clamp(min=0), starts[:J, rows])
    assert torch.equal(n_B, expected_n) and torch.equal(starts, expected_starts)
    if agree:  # greedy rows take every draft of the argmax; some sampled rows reject
        assert (num[table.params.greedy_A[rows]] == J).all()
    with pytest.raises(ValueError, match="q must be a contiguous torch.float32"):
        verify_accept(logits, q.double(), drafts, rows, n, live, *tables, *state, trash, TAGS,
                      SAMPLE, ACCEPT)  # fmt: skip
    with pytest.raises(ValueError, match="verified positions"):
        verify_accept(logits[:, :J], q, drafts, rows, n, live, *tables, *state, trash, TAGS,
                      SAMPLE, ACCEPT)  # fmt: skip
    with pytest.raises(ValueError, match="starts"):
        verify_accept(logits, q, drafts, rows, n, live, *tables, tokens, n_B, starts[:, :2],
                      trash, TAGS, SAMPLE, ACCEPT)  # fmt: skip
