"""Checks of the engine's fused sublayer entry `mhc_decode.mix_in_norm` against the eager ops it
replaces (coefficients, mix in, RMSNorm), shared by the interpreter (CPU) and the CUDA tests.

Tolerances as in mhc_cases: fp32 within 2e-5 of max(1, |eager|); bf16 h within 2^-6 (the mix is
rounded to bf16 before its RMS, as the separate ops do, so h may differ by an ulp or two), the
fp32 coefficients within 2e-5 (they are computed from the same bf16 streams).
"""

from __future__ import annotations

import torch
from mhc_cases import BF16_OUT_TOL, OUT_TOL, Case, make_inputs
from torch import Tensor

from birkhoff.kernels import mhc_decode
from birkhoff.kernels.mhc_phi import served_phi
from birkhoff.model import hyper
from birkhoff.model.layers import rms_norm

DECODE_CASES = [  # S >= 2 (S = 1 has no hyper-connection): one token, several blocks and splits
    Case(S=2, D=33, B=1, T=1),
    Case(S=3, D=7),
    Case(S=4, D=40, B=1, T=1, iters=20),
    Case(S=4, D=40, B=2, T=20, iters=20),
    Case(S=8, D=16, B=1, T=5),
    Case(S=4, D=24, B=3, T=7, kind="large_logits", iters=20),
    Case(S=4, D=24, B=2, T=3, kind="near_singular"),
    Case(S=4, B=0),
]


def eager(inp: dict[str, Tensor], weight: Tensor, c: Case, with_res: bool) -> list[Tensor]:
    x, phi, alpha, bias = (inp[k] for k in ("x", "phi", "alpha", "bias"))
    if with_res:
        y, pre, post, res = hyper.coefficients_and_mix_in(
            x, phi, alpha, bias, iters=c.iters, norm_eps=1e-6, kernels="eager"
        )
        return [rms_norm(y, weight, 1e-6), pre, post, res]
    phi, alpha, bias = phi[: c.S], alpha[:1], bias[: c.S]
    y = hyper.contract(x, phi, alpha, bias, norm_eps=1e-6, kernels="eager")
    pre = hyper.contraction_weights(x, phi, alpha, bias, norm_eps=1e-6, kernels="eager")
    return [rms_norm(y, weight, 1e-6), pre]


def check_mix_in_norm(c: Case, device: str, dtype: torch.dtype, with_res: bool = True) -> None:
    """Fused == eager (phi as the trainer keeps it and as the engine serves it); the counters
    are zero afterwards and a second call gives the same bits."""
    inp = make_inputs(c, device, dtype)
    for k in ("phi", "alpha", "bias"):
        inp[k] = inp[k].float()
    weight = (0.5 + torch.rand(c.D, generator=torch.Generator().manual_seed(c.D))).to(device, dtype)
    want = eager(inp, weight, c, with_res)
    cut = slice(None) if with_res else slice(0, c.S)  # the contraction's S logits
    phi, bias = inp["phi"][cut], inp["bias"][cut]
    alpha = inp["alpha"] if with_res else inp["alpha"][:1]
    for phi_in in (phi, served_phi(phi)):
        got = mhc_decode.mix_in_norm(
            inp["x"], phi_in, alpha, bias, weight, iters=c.iters, norm_eps=1e-6, eps=hyper.MHC_EPS,
            with_res=with_res,
        )  # fmt: skip
        again = mhc_decode.mix_in_norm(
            inp["x"], phi_in, alpha, bias, weight, iters=c.iters, norm_eps=1e-6, eps=hyper.MHC_EPS,
            with_res=with_res,
        )  # fmt: skip
        if not with_res:
            assert got[2].numel() == got[3].numel() == 0
        for i, (g, w) in enumerate(zip(got, want, strict=False)):
            tol = BF16_OUT_TOL if i == 0 and dtype == torch.bfloat16 else OUT_TOL
            assert g.shape == w.shape and g.dtype == w.dtype, (i, g.shape, w.shape, g.dtype)
            err = (g.float() - w.float()).abs() / w.float().abs().clamp(min=1)
            assert not err.numel() or err.max().item() <= tol, (i, err.max(), tol)
        for g, a in zip(got, again, strict=True):
            assert torch.equal(g, a)
    for held in mhc_decode._COUNTERS.get(inp["x"].device, []):
        assert not held.any()


def check_rejects_a_misshaped_weight(device: str) -> None:
    import pytest

    inp = make_inputs(Case(S=4, D=8), device, torch.float32)
    with pytest.raises(ValueError, match="weight has shape"):
        mhc_decode.mix_in_norm(
            inp["x"], inp["phi"], inp["alpha"], inp["bias"], torch.ones(7, device=device),
            iters=2, norm_eps=1e-6, eps=1e-6,
        )  # fmt: skip
