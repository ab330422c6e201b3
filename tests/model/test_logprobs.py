"""Chunked token logprobs: equal to the unchunked reference in fp64 (values and every gradient,
alone, in the model and in the GRPO loss), and a memory peak that no longer scales with B*T*V."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from birkhoff.config import ModelConfig
from birkhoff.model import Transformer
from birkhoff.model.logprobs import logprob_path, token_logprobs
from birkhoff.recompute.census import PeakLiveBytes
from birkhoff.rl.config import RLConfig
from birkhoff.rl.loop import grpo_loss_fn
from birkhoff.rl.loss import GRPOLossConfig
from birkhoff.rl.rollout import RLBatch


def reference_logp(h_BTD: Tensor, w_VD: Tensor, targets_BT: Tensor, t: float) -> Tensor:
    """The plain formula: the whole [B,T,V] log-softmax."""
    return F.log_softmax(h_BTD @ w_VD.T / t, dim=-1).gather(-1, targets_BT[..., None])[..., 0]


def head_inputs(B: int = 3, T: int = 7, D: int = 5, V: int = 11) -> tuple[Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(B, T, D, dtype=torch.float64, generator=g).requires_grad_()
    w = torch.randn(V, D, dtype=torch.float64, generator=g).requires_grad_()
    targets = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) < 0.6
    return h, w, targets, mask


@pytest.mark.parametrize("chunk", [1, 4, 7, 21, 64])  # 21 = B*T; 4 does not divide it
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_equals_reference_in_fp64(chunk: int, temperature: float) -> None:
    h, w, targets, mask = head_inputs()
    out = token_logprobs(h, w, targets, temperature=temperature, chunk_tokens=chunk)
    ref = reference_logp(h, w, targets, temperature)
    torch.testing.assert_close(out.logp, ref, rtol=0, atol=1e-13)
    assert torch.equal(out.argmax, (h @ w.T).argmax(-1))
    # a masked mean with weights: every masked-out token must get exactly zero gradient
    weight_BT = torch.randn(targets.shape, dtype=torch.float64) * mask

    def grads(logp: Tensor) -> tuple[Tensor, ...]:
        return torch.autograd.grad((logp * weight_BT).sum() / mask.sum(), (h, w))

    got_h, got_w = grads(out.logp)
    want_h, want_w = grads(ref)
    torch.testing.assert_close(got_h, want_h, rtol=0, atol=1e-13)
    torch.testing.assert_close(got_w, want_w, rtol=0, atol=1e-13)
    assert torch.equal(got_h[~mask], torch.zeros_like(h[~mask]))


def test_unchunked_path_is_the_reference_and_gradcheck_passes() -> None:
    h, w, targets, _ = head_inputs(2, 3, 4, 6)
    with logprob_path(unchunked=True):
        plain = token_logprobs(h, w, targets, temperature=0.5)
    torch.testing.assert_close(plain.logp, reference_logp(h, w, targets, 0.5), rtol=0, atol=1e-13)

    def fn(h: Tensor, w: Tensor) -> Tensor:
        return token_logprobs(h, w, targets, temperature=0.5, chunk_tokens=4).logp

    assert torch.autograd.gradcheck(fn, (h, w))


def test_bad_inputs_raise() -> None:
    h, w, targets, _ = head_inputs()
    with pytest.raises(ValueError, match="head weight"):
        token_logprobs(h, w[:, :3], targets)
    with pytest.raises(ValueError, match="targets"):
        token_logprobs(h, w, targets[:, :3])
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(h, w, targets, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_tokens"), logprob_path(chunk_tokens=0):
        pass


def test_bf16_autocast_matches_the_unchunked_path_and_keeps_fp32_grads() -> None:
    h, w, targets, mask = (x.float() if x.is_floating_point() else x for x in head_inputs(4, 9))
    h, w = h.detach().requires_grad_(), w.detach().requires_grad_()
    results = []
    for unchunked in (True, False):
        with logprob_path(chunk_tokens=5, unchunked=unchunked), torch.autocast("cpu"):
            logp = token_logprobs(h, w, targets, temperature=0.9).logp
        assert logp.dtype == torch.float32
        results.append((logp, *torch.autograd.grad((logp * mask).sum(), (h, w))))
    for got, want in zip(results[1], results[0], strict=True):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_autocast_on_cuda_matches_the_unchunked_path() -> None:
    g = torch.Generator().manual_seed(0)
    h = (0.3 * torch.randn(4, 300, 64, generator=g)).cuda().requires_grad_()
    w = (0.3 * torch.randn(1000, 64, generator=g)).cuda().requires_grad_()
    targets = torch.randint(0, 1000, (4, 300), generator=g).cuda()
    results = []
    for unchunked in (True, False):
        with logprob_path(chunk_tokens=128, unchunked=unchunked), torch.autocast("cuda"):
            logp = token_logprobs(h, w, targets, temperature=0.8).logp
        results.append((logp, *torch.autograd.grad(logp.sum(), (h, w))))
    for got, want in zip(results[1], results[0], strict=True):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def tiny_model(*, tied: bool, vocab: int = 37, mtp: int = 2, streams: int = 2) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=vocab,
        dim=16,
        num_layers=1,
        num_heads=2,
        num_streams=streams,
        mtp_depth=mtp,
        tie_embeddings=tied,
        max_seq_len=64,
    )
    return Transformer(cfg).double()


def grads_of(model: Transformer, loss: Tensor) -> dict[str, Tensor]:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
    return {n: g for (n, _), g in zip(named, grads, strict=True) if g is not None}


@pytest.mark.parametrize("tied", [False, True])
def test_model_losses_logp_and_grads_equal_the_unchunked_path(tied: bool) -> None:
    model = tiny_model(tied=tied)
    ids = torch.randint(0, 37, (3, 10))
    mask = torch.rand(3, 10) < 0.7
    results = []
    for unchunked in (True, False):
        with logprob_path(chunk_tokens=4, unchunked=unchunked):
            out = model(ids, labels=ids, loss_mask=mask, temperature=0.8)
        assert out.logits is None and out.loss is not None
        scalars = [out.loss, out.main_loss, *out.mtp_losses]
        results.append((scalars, out.logp, out.argmax, grads_of(model, out.loss)))
    (s0, logp0, arg0, g0), (s1, logp1, arg1, g1) = results
    torch.testing.assert_close(torch.stack(s1), torch.stack(s0), rtol=0, atol=1e-13)
    torch.testing.assert_close(logp1, logp0, rtol=0, atol=1e-13)
    assert torch.equal(arg1, arg0)
    assert g1.keys() == g0.keys() and ("embed.weight" if tied else "lm_head.weight") in g1
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=0, atol=1e-13, msg=name)


def grpo_batch(model: Transformer, B: int, T: int, seed: int = 1) -> RLBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.cfg.vocab_size, (B, T), generator=g)
    completion = torch.arange(T)[None, :] >= torch.randint(2, T // 2, (B, 1), generator=g)
    rollout_logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * completion
    advantages = torch.randn(B, generator=g, dtype=torch.float64)
    return RLBatch(ids, completion, rollout_logp, advantages, [0] * B)


def test_grpo_loss_with_kl_and_temperature_equals_the_unchunked_path() -> None:
    model = tiny_model(tied=True)
    reference = copy.deepcopy(model).requires_grad_(False)
    with torch.no_grad():  # a reference that differs from the policy, so the KL is not 0
        for p in reference.parameters():
            p.add_(0.01 * torch.randn_like(p))
    cfg = RLConfig(temperature=0.7, loss=GRPOLossConfig(kl_weight=0.1))
    loss_fn = grpo_loss_fn(cfg, reference)
    batch = grpo_batch(model, 4, 12)
    results = []
    for unchunked in (True, False):
        with logprob_path(chunk_tokens=5, unchunked=unchunked):
            loss, metrics = loss_fn(model, batch)
        results.append((loss, metrics, grads_of(model, loss)))
    (l0, m0, g0), (l1, m1, g1) = results
    assert m0["kl_ref"] > 0
    torch.testing.assert_close(l1, l0, rtol=0, atol=1e-13)
    for key in ("clip_frac", "ratio_mean", "kl_ref"):
        assert m1[key] == pytest.approx(m0[key], abs=1e-12)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=0, atol=1e-13, msg=name)


def grpo_peak_bytes(model: Transformer, B: int, T: int, *, unchunked: bool) -> int:
    """Peak live bytes of the storages a GRPO loss's forward + backward create (CPU)."""
    loss_fn = grpo_loss_fn(RLConfig(temperature=0.9))
    batch = grpo_batch(model, B, T)
    with logprob_path(chunk_tokens=16, unchunked=unchunked), PeakLiveBytes() as peak:
        loss, _ = loss_fn(model, batch)
        loss.backward()
    model.zero_grad(set_to_none=True)
    return peak.peak_bytes


def test_grpo_peak_memory_does_not_scale_with_tokens_times_vocab() -> None:
    """fp32 model: a [B*T, V] fp32 tensor costs V*4 bytes a token. The unchunked path's peak
    holds several (logits, log-softmax, its gradient), so it grows by more than 2*V*4 bytes a
    token; the chunked path's grows only with the model's activations (here ~10 KB a token),
    under a quarter of V*4, and stays below one [B*T, V] tensor."""
    V, T, small, large = 16384, 32, 2, 8
    model = tiny_model(tied=True, vocab=V, mtp=1, streams=1).float()
    row = V * 4  # bytes of one token's fp32 logits
    added = (large - small) * T  # tokens
    plain = [grpo_peak_bytes(model, B, T, unchunked=True) for B in (small, large)]
    assert plain[1] - plain[0] > 2 * row * added  # the measure sees the plain path's [B*T, V]
    chunked = [grpo_peak_bytes(model, B, T, unchunked=False) for B in (small, large)]
    assert chunked[1] - chunked[0] < row * added / 4
    assert chunked[1] < row * large * T
