"""mHC: Sinkhorn properties, gradcheck of the hyper-connection, closeness to a residual at init,
agreement with an fp64 transcription of DeepSeek-V4's published formulation."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from birkhoff.model.hyper import (
    HyperConnection,
    expand_streams,
    init_bias,
    mhc_coefficients,
    mix_in,
    mix_out,
    sinkhorn,
    use_fused,
)


@st.composite
def logit_matrices(draw: st.DrawFn, bound: float) -> torch.Tensor:
    S = draw(st.integers(2, 8))
    values = draw(
        st.lists(st.floats(-bound, bound, allow_nan=False), min_size=S * S, max_size=S * S)
    )
    return torch.tensor(values, dtype=torch.float64).view(S, S)


@settings(max_examples=200, deadline=None)
@given(logit_matrices(bound=1.0))
def test_sinkhorn_doubly_stochastic_for_mixing_logits(logits: torch.Tensor) -> None:
    # Mixing logits of this size (the alpha-scaled dynamic part) converge well within 20 steps.
    m = sinkhorn(logits, iters=20)
    assert (m >= 0).all()
    assert torch.allclose(m.sum(-1), torch.ones(len(m), dtype=m.dtype), atol=1e-3)
    assert torch.allclose(m.sum(-2), torch.ones(len(m), dtype=m.dtype), atol=1e-3)


@settings(max_examples=100, deadline=None)
@given(logit_matrices(bound=8.0))
def test_sinkhorn_last_axis_exact_for_wide_logits(logits: torch.Tensor) -> None:
    # Columns are normalised last, so they are exact up to eps even where rows converge slowly.
    m = sinkhorn(logits, iters=20)
    assert torch.isfinite(m).all() and (m >= 0).all()
    assert torch.allclose(m.sum(-2), torch.ones(len(m), dtype=m.dtype), atol=1e-5)


def test_sinkhorn_of_published_bias_is_near_identity() -> None:
    m = sinkhorn(6.0 * torch.eye(4, dtype=torch.float64) - 3.0, iters=20)
    assert torch.allclose(m.diagonal(), torch.full((4,), 0.993, dtype=m.dtype), atol=1e-3)


def _row_major_sinkhorn(logits: torch.Tensor, iters: int, eps: float = 1e-6) -> torch.Tensor:
    m = torch.softmax(logits, dim=-1) + eps
    m = m / (m.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        m = m / (m.sum(dim=-1, keepdim=True) + eps)
        m = m / (m.sum(dim=-2, keepdim=True) + eps)
    return m


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(64, 9, 4, 4), (3, 7, 2, 2), (5, 3, 3), (4, 4)])
@pytest.mark.parametrize("scale", [0.01, 1.0, 8.0])
def test_sinkhorn_equals_the_row_major_form_to_the_last_bit(
    dtype: torch.dtype, shape: tuple[int, ...], scale: float
) -> None:
    # The entries-leading layout sums S <= 4 entries in the same order: same values, and the
    # written-out backward equals autograd's through the row-major ops.
    g = torch.Generator().manual_seed(0)
    logits = (scale * torch.randn(shape, generator=g, dtype=dtype)).requires_grad_()
    ours, ref = sinkhorn(logits, 20), _row_major_sinkhorn(logits, 20)
    grad = torch.randn(shape, generator=g, dtype=dtype)
    assert torch.equal(ours, ref)
    assert torch.equal(*(torch.autograd.grad(m, logits, grad)[0] for m in (ours, ref)))
    with torch.inference_mode():
        assert torch.equal(sinkhorn(logits, 20), ours)


def test_sinkhorn_gradcheck_fp64() -> None:
    logits = torch.randn(2, 3, 4, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: sinkhorn(x, 5), (logits,))


def test_coefficient_ranges_and_slice_order() -> None:
    torch.manual_seed(0)
    S, D = 4, 8
    x = torch.randn(2, 3, S, D, dtype=torch.float64)
    phi = torch.zeros(S * S + 2 * S, S * D, dtype=torch.float64)
    bias = init_bias(S, home=1).double()
    pre, post, res = mhc_coefficients(
        x, phi, torch.zeros(3).double(), bias, iters=20, norm_eps=1e-6
    )
    # With phi = 0 the coefficients are the static ones: pre peaks on the home stream,
    # post = 2 sigmoid(0) = 1, res = Sinkhorn(6I - 3).
    assert torch.allclose(pre[0, 0], torch.sigmoid(bias[:S]) + 1e-6)
    assert pre[0, 0].argmax() == 1
    assert torch.allclose(post, torch.ones_like(post))
    assert torch.allclose(res[0, 0], sinkhorn(bias[2 * S :].view(S, S), 20))


def _sublayer(d: int) -> torch.nn.Module:
    torch.manual_seed(1)
    lin = torch.nn.Linear(d, d).double()
    return torch.nn.Sequential(lin, torch.nn.Tanh())


def test_hyper_connection_gradcheck_fp64() -> None:
    torch.manual_seed(0)
    S, D = 3, 4
    hc = HyperConnection(D, S, home=0, iters=20, norm_eps=1e-6).double()
    with torch.no_grad():  # move away from the init so every coefficient path is exercised
        hc.alpha.fill_(0.5)
    f = _sublayer(D)
    x = torch.randn(2, 2, S, D, dtype=torch.float64, requires_grad=True)

    def fn(x: torch.Tensor, phi: torch.Tensor, alpha: torch.Tensor, bias: torch.Tensor):
        pre, post, res = mhc_coefficients(x, phi, alpha, bias, iters=20, norm_eps=1e-6)
        from birkhoff.model.hyper import mix_in, mix_out

        return mix_out(x, f(mix_in(x, pre)), post, res)

    params = [p.detach().clone().requires_grad_(True) for p in (hc.phi, hc.alpha, hc.bias)]
    assert torch.autograd.gradcheck(fn, (x, *params), eps=1e-6, atol=1e-5)
    # the module applies the same function
    assert torch.equal(hc(x, f), fn(x, hc.phi, hc.alpha, hc.bias))


def test_sublayer_at_init_is_close_to_plain_residual() -> None:
    # Streams start identical (expanded embedding). At init each stream must follow
    # x + F(x) within 2% of |F(x)|: H_post = 2 sigmoid(~0) ~ 1, H_res columns sum to 1 exactly,
    # and the sublayer's pre-norm makes F insensitive to the H_pre scale (sum ~1.1).
    torch.manual_seed(0)
    S, D = 4, 32
    hc = HyperConnection(D, S, home=2, iters=20, norm_eps=1e-6).double()
    norm = torch.nn.RMSNorm(D, eps=1e-6).double()
    f_mod = _sublayer(D)

    def f(h: torch.Tensor) -> torch.Tensor:
        return f_mod(norm(h))

    x_BTD = torch.randn(2, 5, D, dtype=torch.float64)
    with torch.no_grad():
        y_BTSD = hc(expand_streams(x_BTD, S), f)
    plain_BTD = x_BTD + f(x_BTD)
    err = (y_BTSD - plain_BTD[:, :, None]).abs().max() / f(x_BTD).abs().max()
    assert err < 0.02, f"relative deviation from plain residual {err:.4f}"
    assert not math.isnan(err.item())


def v4_reference(
    x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int
) -> tuple[torch.Tensor, ...]:
    """fp64 transcription of DeepSeek-V4's published hyper-connection: pre, post, comb, collapse."""
    B, T, S, D = x.shape
    eps = 1e-6
    flat = x.reshape(B, T, S * D).double()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + 1e-6)
    pre_w, post_w, comb_w = (flat @ fn.double().t()).split([S, S, S * S], dim=-1)
    pre_b, post_b, comb_b = base.double().split([S, S, S * S])
    scale = scale.double()
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.view(B, T, S, S) * scale[2] + comb_b.view(S, S), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    collapsed = (pre.unsqueeze(-1) * x.double()).sum(dim=2)
    return pre, post, comb, collapsed


def _v4_inputs(S: int = 4, D: int = 16, magnitude: float = 1.0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(3)
    P = S * S + 2 * S
    x = magnitude * torch.randn(2, 5, S, D, generator=g, dtype=torch.float64)
    fn = torch.randn(P, S * D, generator=g, dtype=torch.float64) / math.sqrt(S * D)
    base = init_bias(S, home=1).double() + 0.5 * torch.randn(P, generator=g, dtype=torch.float64)
    return x, fn, base, torch.tensor([0.8, 0.6, 1.5], dtype=torch.float64)


@pytest.mark.parametrize("S", [1, 2, 4, 8])
def test_eager_coefficients_equal_the_v4_formulation_in_fp64(S: int) -> None:
    x, fn, base, scale = _v4_inputs(S)
    pre, post, res = mhc_coefficients(x, fn, scale, base, iters=20, norm_eps=1e-6)
    ref = v4_reference(x, fn, base, scale, iters=20)
    for ours, theirs in zip((pre, post, res, mix_in(x, pre)), ref, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)


def test_bf16_mix_in_sums_in_fp32_like_the_reference() -> None:
    # The published collapse multiplies fp32 weights with the bf16 streams, sums in fp32 and casts
    # after; casting H_pre to bf16 first (the previous formulation) lands further from fp64.
    x, fn, base, scale = _v4_inputs(magnitude=4.0)
    x_bf = x.to(torch.bfloat16)
    pre = mhc_coefficients(x_bf, fn.float(), scale.float(), base.float(), iters=20, norm_eps=1e-6)[
        0
    ]
    exact = (pre.double()[..., None] * x_bf.double()).sum(2)
    ours = mix_in(x_bf, pre)
    published = (pre.unsqueeze(-1) * x_bf).sum(dim=2).to(torch.bfloat16)
    cast_first = torch.einsum("btj,btjd->btd", pre.to(torch.bfloat16), x_bf)
    assert ours.dtype == torch.bfloat16
    assert (ours.double() - published.double()).abs().max() <= 4 * 2**-8  # one bf16 ulp at ~4-8
    err_ours = (ours.double() - exact).abs().max()
    assert err_ours < (cast_first.double() - exact).abs().max()


def test_kernels_switch_is_validated() -> None:
    x = torch.zeros(1, 1, 2, 3)
    with pytest.raises(ValueError, match="kernels='cuda'"):
        mix_in(x, torch.ones(1, 1, 2), kernels="cuda")
    assert not use_fused(x, "auto") and not use_fused(x, "eager") and use_fused(x, "triton")
    assert not use_fused(x.double(), "auto")


def test_config_fields_reach_the_hyper_connection_and_are_validated() -> None:
    from birkhoff.config import ModelConfig
    from birkhoff.model.hyper import StreamContraction, apply_kernels, build_hyper_connection
    from birkhoff.model.transformer import Transformer

    cfg = ModelConfig(vocab_size=8, dim=8, num_layers=1, num_heads=2, mhc_eps=1e-5)
    hc = build_hyper_connection(cfg, home=0)
    assert isinstance(hc, HyperConnection) and (hc.eps, hc.kernels) == (1e-5, "auto")
    with pytest.raises(ValueError, match="mhc_eps=0"):
        cfg.replace(mhc_eps=0)
    # the kernel choice is applied from outside, to every hyper-connection and contraction
    model = apply_kernels(Transformer(cfg), "eager")
    mhc = [m for m in model.modules() if isinstance(m, HyperConnection | StreamContraction)]
    assert len(mhc) == 2 * 2 + 2 and all(m.kernels == "eager" for m in mhc)
    with pytest.raises(ValueError, match="kernels='cuda'"):
        apply_kernels(model, "cuda")  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_mix_out_of_expanded_streams_equals_contiguous(dtype: torch.dtype) -> None:
    # the first sublayer reads the expanded embedding; mix out copies it before its bmm
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(16, 9, 64, generator=g, dtype=dtype)
    post, res = (
        torch.rand(16, 9, 4, generator=g, dtype=dtype),
        torch.rand(16, 9, 4, 4, generator=g, dtype=dtype),
    )
    f = torch.randn(16, 9, 64, generator=g, dtype=dtype)
    x = expand_streams(emb, 4)
    assert torch.equal(mix_out(x, f, post, res), mix_out(x.contiguous(), f, post, res))
