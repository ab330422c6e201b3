"""Fused-vs-eager checks of the mHC ops, shared by the interpreter (CPU) and the CUDA tests.

Legend: B batch, T tokens, S streams, D model dim, P = S*S + 2S logits.

Each check runs one loss through the eager path and the fused path on the same inputs and
compares every output and every gradient (streams x, F's input, phi, alpha, bias).
Tolerances (fp32): outputs within 2e-5 of max(1, |eager|), gradients within 1e-4 of max(1, |eager|)
(different summation orders and fp32 Sinkhorn; observed ~1e-7 to 1e-6). bf16 streams: outputs
within 2^-6 of max(1, |eager|) (two bf16 ulps at the top of a binade: both paths sum in fp32
and round once, but a one-ulp difference in F's input moves an output by an ulp), gradients
within 3e-2.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor

from birkhoff.model import hyper

OUT_TOL, GRAD_TOL = 2e-5, 1e-4
BF16_OUT_TOL, BF16_GRAD_TOL = 2.0**-6, 3e-2


@dataclass(frozen=True)
class Case:
    S: int
    D: int = 5
    B: int = 2
    T: int = 3
    iters: int = 6
    kind: str = "random"  # random | large_logits | near_singular


CASES = [
    Case(S=1),
    Case(S=2),
    Case(S=3, D=7),
    Case(S=4, iters=10),
    Case(S=8),
    Case(S=4, B=3, T=1),
    Case(S=4, B=0),
    Case(S=4, D=300, B=1, T=2, iters=3),
    Case(S=8, D=130, B=1, T=2, iters=3),
    Case(S=4, B=2, T=17, iters=2),
    Case(S=4, kind="large_logits", iters=20),
    Case(S=4, kind="near_singular"),
    Case(S=4, D=16, B=3, T=100, iters=2),  # the engine's coeff_rest over two programs
]


def case_id(c: Case) -> str:
    return f"S{c.S}-D{c.D}-B{c.B}-T{c.T}-it{c.iters}-{c.kind}"


def make_inputs(c: Case, device: str, dtype: torch.dtype) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(1000 * c.S + c.D)
    S, D, P = c.S, c.D, c.S * c.S + 2 * c.S
    x = torch.randn(c.B, c.T, S, D, generator=g)
    phi = torch.randn(P, S * D, generator=g) / (S * D) ** 0.5
    alpha = torch.tensor([0.7, 0.5, 1.3])
    bias = hyper.init_bias(S, home=1) + 0.3 * torch.randn(P, generator=g)
    if c.kind == "large_logits":  # saturated sigmoids, near-permutation Sinkhorn input
        alpha, bias = torch.tensor([8.0, 8.0, 40.0]), 3.0 * bias
    if c.kind == "near_singular":  # streams equal up to 1e-4, tiny magnitude
        x = 1e-3 * (x[:, :, :1] + 1e-4 * x)
    f_in = torch.randn(c.B, c.T, D, generator=g)
    w_out = torch.randn(c.B, c.T, S, D, generator=g)
    named = dict(x=x, phi=phi, alpha=alpha, bias=bias, f_in=f_in, w_out=w_out)
    return {k: v.to(device=device, dtype=dtype) for k, v in named.items()}


def hyper_loss(
    inp: dict[str, Tensor], c: Case, kernels: str, joint: bool = False
) -> tuple[list[Tensor], list[Tensor]]:
    """Outputs (H_pre, H_post, H_res, mix_in, mix_out) and grads of a loss touching all of them;
    joint: coefficients and mix in through `coefficients_and_mix_in` (one op when fused)."""
    leaves = [inp[k].detach().clone().requires_grad_(True) for k in ("x", "phi", "alpha", "bias")]
    x, phi, alpha, bias = leaves
    f_in = inp["f_in"].detach().clone().requires_grad_(True)
    if joint:
        h, pre, post, res = hyper.coefficients_and_mix_in(
            x, phi, alpha, bias, iters=c.iters, norm_eps=1e-6, kernels=kernels
        )
    else:
        pre, post, res = hyper.mhc_coefficients(
            x, phi, alpha, bias, iters=c.iters, norm_eps=1e-6, kernels=kernels
        )
        h = hyper.mix_in(x, pre, kernels=kernels)
    f = torch.tanh(h + f_in)  # a sublayer that depends on the mix-in
    y = hyper.mix_out(x, f, post, res, kernels=kernels)
    S = c.S
    w_res = torch.arange(S * S, device=x.device, dtype=torch.float32).view(S, S).cos()
    loss = (y.float() * inp["w_out"].float()).sum() + (res * w_res).sum() + pre.sin().sum()
    loss = loss + post.square().sum()
    grads = torch.autograd.grad(loss, [*leaves, f_in])
    return [pre, post, res, h, y], list(grads)


def sublayer_loss(
    inp: dict[str, Tensor], c: Case, kernels: str, *, residual: bool = True
) -> tuple[list[Tensor], list[Tensor]]:
    """Output and grads of a whole sublayer through `hyper.hyper_connection` (the fused path
    folds mix out's g_x into the coefficient op's write of g_x); residual=False detaches mix
    out's streams, leaving x only the gradient through the coefficients and the mix in."""
    leaves = [inp[k].detach().clone().requires_grad_(True) for k in ("x", "phi", "alpha", "bias")]
    x, phi, alpha, bias = leaves
    f_in = inp["f_in"].detach().clone().requires_grad_(True)

    def sublayer(h: Tensor) -> Tensor:
        return torch.tanh(h + f_in)

    if residual:
        y = hyper.hyper_connection(
            x, phi, alpha, bias, sublayer, iters=c.iters, norm_eps=1e-6, kernels=kernels
        )
    else:
        h, _, post, res = hyper.coefficients_and_mix_in(
            x, phi, alpha, bias, iters=c.iters, norm_eps=1e-6, kernels=kernels
        )
        y = hyper.mix_out(x.detach(), sublayer(h), post, res, kernels=kernels)
    loss = (y.float() * inp["w_out"].float()).sum()
    return [y], list(torch.autograd.grad(loss, [*leaves, f_in]))


def contraction_loss(
    inp: dict[str, Tensor], c: Case, kernels: str
) -> tuple[list[Tensor], list[Tensor]]:
    S = c.S
    x = inp["x"].detach().clone().requires_grad_(True)
    phi = inp["phi"][:S].detach().clone().requires_grad_(True)
    alpha = inp["alpha"][:1].detach().clone().requires_grad_(True)
    bias = inp["bias"][:S].detach().clone().requires_grad_(True)
    w = hyper.contraction_weights(x, phi, alpha, bias, norm_eps=1e-6, kernels=kernels)
    h = hyper.contract(x, phi, alpha, bias, norm_eps=1e-6, kernels=kernels)
    loss = (h.float() * inp["f_in"].float()).sum() + w.cos().sum()
    return [w, h], list(torch.autograd.grad(loss, [x, phi, alpha, bias]))


def assert_close(fused: list[Tensor], eager: list[Tensor], tol: float, what: str) -> None:
    for i, (a, b) in enumerate(zip(fused, eager, strict=True)):
        assert a.shape == b.shape and a.dtype == b.dtype, (what, i, a.shape, b.shape)
        assert torch.isfinite(a).all(), (what, i)
        if b.numel() == 0:
            continue
        scale = max(1.0, b.abs().max().item())
        err = (a.float() - b.float()).abs().max().item()
        assert err <= tol * scale, (
            f"{what}[{i}]: max |fused - eager| = {err:.3g} > {tol * scale:.3g}"
        )


def tolerances(dtype: torch.dtype, what: str) -> tuple[float, str]:
    fp32 = dtype == torch.float32
    if what == "outputs":
        return (OUT_TOL if fp32 else BF16_OUT_TOL), what
    return (GRAD_TOL if fp32 else BF16_GRAD_TOL), what


def check_fused_vs_eager(
    loss: Callable[..., tuple[list[Tensor], list[Tensor]]], c: Case, device: str,
    dtype: torch.dtype, **fused_kwargs: bool,
) -> None:  # fmt: skip
    """`loss(inputs, case, kernels)`'s output and gradients, fused vs eager, within tolerance."""
    inp = make_inputs(c, device, dtype)
    out_f, grads_f = loss(inp, c, "triton", **fused_kwargs)
    out_e, grads_e = loss(inp, c, "eager")
    assert_close(out_f, out_e, *tolerances(dtype, "outputs"))
    assert_close(grads_f, grads_e, *tolerances(dtype, "grads"))


def check_hyper(
    c: Case, device: str, dtype: torch.dtype = torch.float32, joint: bool = False
) -> None:
    check_fused_vs_eager(hyper_loss, c, device, dtype, joint=joint)


def check_sublayer(c: Case, device: str, dtype: torch.dtype = torch.float32) -> None:
    """The fused sublayer (mix out's g_x folded into the coefficient op's g_x) matches eager."""
    check_fused_vs_eager(sublayer_loss, c, device, dtype)


def check_both_streams_gradients_matter(c: Case, device: str) -> None:
    """x's eager gradient in `sublayer_loss` has two parts (the coefficients + mix in, and mix
    out's residual H_res g_y), each over 10x the fp32 gradient tolerance: a fused path that
    drops either one fails `check_sublayer` on this case."""
    inp = make_inputs(c, device, torch.float32)
    total = sublayer_loss(inp, c, "eager")[1][0]
    coefficient_part = sublayer_loss(inp, c, "eager", residual=False)[1][0]
    residual_part = total - coefficient_part
    tol = GRAD_TOL * max(1.0, total.abs().max().item())
    assert coefficient_part.abs().max().item() > 10 * tol, "x gets no coefficient gradient"
    assert residual_part.abs().max().item() > 10 * tol, "x gets no residual gradient"


def check_contraction(c: Case, device: str, dtype: torch.dtype = torch.float32) -> None:
    check_fused_vs_eager(contraction_loss, c, device, dtype)


def check_bf16_streams_keep_fp32_precision(c: Case, device: str, truncates: bool = False) -> None:
    """On bf16 streams (values exact in fp32) the fused coefficients and g_phi equal the eager
    fp32 path's to fp32 rounding: phi's three bf16 terms and g_raw's give exact tensor-core
    products. g_x, written in bf16, is the fp32 gradient rounded: a product of bf16-truncated
    operands (~2^-9 relative) would change ~half of its bf16 values, the kept three terms
    (~2^-15) only those within rounding noise of a tie. truncates: the kernels' fp32 -> bf16 casts
    round toward zero (the Triton interpreter's; CUDA rounds to nearest)."""
    inp = make_inputs(c, device, torch.float32)
    inp["x"] = inp["x"].bfloat16().float()
    S = c.S
    w_res = torch.arange(S * S, device=device, dtype=torch.float32).view(S, S).cos()
    out = {}
    for kernels, dtype in (("triton", torch.bfloat16), ("eager", torch.float32)):
        x, phi, alpha, bias = (inp[k].clone().requires_grad_(True) for k in
                               ("x", "phi", "alpha", "bias"))  # fmt: skip
        xs = x.to(dtype)
        pre, post, res = hyper.mhc_coefficients(
            xs, phi, alpha, bias, iters=c.iters, norm_eps=1e-6, kernels=kernels
        )
        loss = (res * w_res).sum() + pre.sin().sum() + post.square().sum()
        g_x, g_phi, g_alpha, g_bias = torch.autograd.grad(loss, [xs, phi, alpha, bias])
        out[kernels] = [pre, post, res, g_phi, g_alpha, g_bias], g_x
    (fused, g_x), (eager, g_x_ref) = out["triton"], out["eager"]
    assert g_x.dtype == torch.bfloat16
    assert_close(fused, eager, 2e-5, "bf16 streams, fp32 outputs")
    if truncates:  # clear the 16 low bits: the bf16 value toward zero, exactly representable
        rounded = (g_x_ref.view(torch.int32) & -65536).view(torch.float32).bfloat16()
    else:
        rounded = g_x_ref.bfloat16()
    differs = (g_x != rounded).float().mean().item()
    ulp = (rounded.float().abs() * 2.0**-7).clamp_min(2.0**-14 * g_x_ref.abs().max().item())
    assert ((g_x.float() - rounded.float()).abs() <= ulp).all(), "g_x off by more than an ulp"
    assert differs < 0.02, f"{differs:.1%} of g_x differ from the rounded fp32 gradient"


def check_hyper_entry(
    c: Case, device: str, dtype: torch.dtype = torch.float32, *, graphed: bool = False
) -> None:
    """The engine's entry (`mhc_entry.hyper_entry`: H_post and H_res on a side stream on CUDA,
    the tail, mix in and RMSNorm in one launch) against the training ops' launches: H_post,
    H_res and mix out bit for bit (CUDA: 1e-6, and two ulps at scale), the normed input too;
    graphed: captured in a CUDA graph (fork and join as graph edges) and replayed on new
    streams. Also `contract_norm`."""
    from birkhoff.kernels import mhc, norm_rope
    from birkhoff.kernels.mhc import entry as mhc_entry

    inp = make_inputs(c, device, dtype)
    x_in, coefficients = inp["x"].clone(), (inp["phi"], inp["alpha"], inp["bias"])
    weight = 1.0 + 0.1 * torch.arange(c.D, device=device, dtype=dtype).sin()
    opts = dict(iters=c.iters, norm_eps=1e-6, eps=1e-6, rms_eps=1e-5)
    side = torch.cuda.Stream(device) if device == "cuda" else None

    def entry() -> list[Tensor]:
        x, y, post, res, read = mhc_entry.hyper_entry(
            x_in, *coefficients, weight, stream=side, **opts
        )
        if side is not None:
            torch.cuda.current_stream().wait_stream(side)
        del read
        return [y, post, res, mhc.mix_out(x, inp["f_in"], post, res)]

    with torch.no_grad():
        if graphed:
            graph, capture = torch.cuda.CUDAGraph(), torch.cuda.Stream(device)
            capture.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(capture):
                entry()  # warm up (compiles) off the capture
                torch.cuda.synchronize()
                with torch.cuda.graph(graph, stream=capture):
                    outs = entry()
            # the replay must read the new streams (seeded: the bounds below are checked on
            # the same values every run)
            fresh = torch.randn(x_in.shape, generator=torch.Generator().manual_seed(c.D))
            x_in.copy_(fresh)
            graph.replay()
            torch.cuda.synchronize()
            got = [t.clone() for t in outs]
        else:
            got = entry()
        y, _, post, res = mhc.coefficients_and_mix_in(x_in, *coefficients, **_no_rms(opts))
        normed = norm_rope.rms_norm(y, weight, 1e-5)
        ref = [normed, post, res, mhc.mix_out(x_in, inp["f_in"], post, res)]
        phi_S, alpha_1, bias_S = inp["phi"][: c.S], inp["alpha"][:1], inp["bias"][: c.S]
        contracted = mhc_entry.contract_norm(
            x_in, phi_S, alpha_1, bias_S, weight, norm_eps=1e-6, eps=1e-6, rms_eps=1e-5
        )
        h = mhc.contract(x_in, phi_S, alpha_1, bias_S, norm_eps=1e-6, eps=1e-6)
    # the interpreter reduces like numpy in every kernel: bit for bit. Compiled kernels may
    # order the Sinkhorn's few sums differently from the training ops' (observed on the H200:
    # 1.2e-7 in H_res after 40 normalisations), and the mixes (mix out's outputs, the normed
    # mix in), sums that can cancel to small values, then round to a neighbouring value of
    # their dtype: within two ulps at the tensor's scale (observed: 5 ulps of one small mix out
    # element's own magnitude, 14 of one normed input's, on the H200 at D 768). The engine's
    # Sinkhorn (a token a thread) sums in index order, as numpy sums fewer than 8 values; from 8
    # numpy pairs them, so H_res at S = 8 (and mix out, which applies it) is held to the
    # tolerances alone.
    two_ulps = 2.0 * torch.finfo(dtype).eps
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert a.shape == b.shape and a.dtype == b.dtype, (i, a.shape, b.shape)
        if i and device == "cpu" and not (i >= 2 and c.S >= 8):
            assert torch.equal(a, b), (i, (a.float() - b.float()).abs().max().item())
        if i in (1, 2):
            assert_close([a], [b], 1e-6, f"coefficient {i}")
        else:
            assert_close([a], [b], two_ulps, "normed input" if i == 0 else "mix out")
    want = norm_rope.rms_norm(h, weight, 1e-5)
    assert contracted.shape == want.shape
    assert_close([contracted], [want], two_ulps, "contracted and normed")


def _no_rms(opts: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in opts.items() if k != "rms_eps"}


def check_exit(c: Case, device: str, dtype: torch.dtype = torch.float32) -> None:
    """The engine's exit (`mhc_entry.mix_out_proj`): its new streams are mix out's (bit for
    bit under the interpreter, within two ulps at their scale compiled), and the next entry
    from its projection partials equals that entry with its own projection (the sums run in
    another order: raw logits within 2e-6 and rstd 1e-6 of their scale; so H_pre moves by
    ~1e-7 and the normed input within 1e-5 of its scale, or two of its dtype's ulps there).
    The next phi is served (the engine's layout), an fp32 weight with all 24 bits in use; the
    projection is an fp32 dot of the streams as stored in IEEE precision, so each logit is
    within 5e-7 of sum |y phi| from the fp64 product (a phi cut to 16 bits gives 1e-6 to 1e-5)."""
    from birkhoff.kernels import mhc
    from birkhoff.kernels.mhc import entry as mhc_entry

    inp = make_inputs(c, device, dtype)
    post = torch.rand(c.B, c.T, c.S, device=device) * 2.0
    res = torch.rand(c.B, c.T, c.S, c.S, device=device)
    jitter = torch.randn(inp["phi"].shape, generator=torch.Generator().manual_seed(c.D))
    phi32 = inp["phi"].float() * (1.0 + 0.01 * jitter.to(device))
    phi = mhc.served_phi(phi32)
    alpha, bias = inp["alpha"].float(), inp["bias"].float()
    weight = 1.0 + 0.1 * torch.arange(c.D, device=device, dtype=dtype).sin()
    opts = (1e-6, 1e-6, 1e-5)
    with torch.no_grad():
        new, part, sq = mhc_entry.mix_out_proj(inp["x"], inp["f_in"], post, res, phi)
        want = mhc.mix_out(inp["x"], inp["f_in"], post, res)
        chained = mhc_entry.pre_mix_norm(new, phi, alpha, bias, weight, *opts, part, sq)
        direct = mhc_entry.pre_mix_norm(new, phi, alpha, bias, weight, *opts)
    if device == "cpu":  # compiled, the two kernels may contract their FMAs differently
        assert torch.equal(new, want), (new.float() - want.float()).abs().max().item()
    assert_close([new], [want], 2.0 * torch.finfo(new.dtype).eps, "new streams")
    y_NC = new.double().reshape(-1, c.S * c.D)
    exact, scale = y_NC @ phi32.double().t(), y_NC.abs() @ phi32.double().abs().t()
    projected = part.double().sum(0)[:, : phi.shape[0]]
    err = ((projected - exact).abs() / scale.clamp(min=1e-30)).max().item() if c.B else 0.0
    assert err <= 5e-7, f"exit projection {err:.2e} of sum |y phi| from the fp64 product"
    (y, raw, rstd), (y_ref, raw_ref, rstd_ref) = chained, direct
    assert_close([raw], [raw_ref], 2e-6, "raw logits")
    assert_close([rstd], [rstd_ref], 1e-6, "rstd")
    assert_close([y], [y_ref], max(1e-5, 2.0 * torch.finfo(dtype).eps), "normed input")
    with pytest.raises(ValueError, match="phi of shape"):
        mhc_entry.mix_out_proj(inp["x"], inp["f_in"], post, res, phi[:, :-1])
