"""mHC: Sinkhorn properties, gradcheck of the hyper-connection, closeness to a residual at init."""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from birkhoff.model.hyper import (
    HyperConnection,
    expand_streams,
    init_bias,
    mhc_coefficients,
    sinkhorn,
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
