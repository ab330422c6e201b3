"""The GEMM-folded mHC ops against the unfused path, under the Triton interpreter (run by
test_mhc_interpret.py with TRITON_INTERPRET=1) and on CUDA.

Legend: B batch, T tokens, S streams, D model dim, Z a projection's other side.

`mix_norm_linear` is compared with linear(rms_norm(mix_in(x, h), w_n), W), the eager
functions, on the same inputs: the output and every gradient (x, h, w_n, W). Tolerances, relative to
max(1, max |eager|): fp32 outputs 2e-5, gradients 1e-4 (summation order; exact fp32 dots).
bf16 (operands and streams): outputs and gradients 2^-6 (the eager path rounds y = sum h x,
the normalised input and F to bf16, the fused one keeps y and F in fp32: an output moves by
about one bf16 ulp of the inputs' scale).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from birkhoff.kernels import mhc
from birkhoff.model import hyper
from birkhoff.model.layers import rms_norm

FP32_TOL = (2e-5, 1e-4)
BF16_TOL = (2.0**-6, 2.0**-6)
NORM_EPS = 1e-5


def fold_inputs(
    B: int, T: int, S: int, D: int, Z: int, dtype: torch.dtype, device: str = "cpu"
) -> dict[str, Tensor]:
    """Streams, mix weights (H_pre > 0, H_post in (0, 2), H_res row-stochastic), norm weight
    and an input projection W [Z, D]."""
    g = torch.Generator().manual_seed(7 * D + Z)
    named = dict(
        x=torch.randn(B, T, S, D, generator=g),
        pre=torch.rand(B, T, S, generator=g) + 0.05,
        post=2 * torch.rand(B, T, S, generator=g),
        res=torch.softmax(2 * torch.randn(B, T, S, S, generator=g), dim=-1),
        wn=1 + 0.3 * torch.randn(D, generator=g),
        w_in=torch.randn(Z, D, generator=g) / D**0.5,
    )
    low = ("x", "w_in")  # the coefficients and the norm weight stay fp32
    return {k: (v.to(dtype) if k in low else v).to(device) for k, v in named.items()}


def _grads(fn, inputs: list[Tensor], seed: int) -> tuple[Tensor, list[Tensor]]:  # type: ignore[no-untyped-def]
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.device)
    (out.float() * probe).sum().backward()
    return out.detach(), [t.grad for t in leaves]  # type: ignore[misc]


def _close(name: str, got: Tensor, want: Tensor, tol: float) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, (name, got.dtype, want.dtype)
    err = (got.float() - want.float()).abs().max().item() if want.numel() else 0.0
    scale = max(1.0, want.float().abs().max().item()) if want.numel() else 1.0
    assert err <= tol * scale, f"{name}: max error {err:.3g} > {tol:.3g} x {scale:.3g}"


def _compare(fused, eager, inputs: list[Tensor], names: str, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    out_tol, grad_tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    out_f, grads_f = _grads(fused, inputs, seed=3)
    out_e, grads_e = _grads(eager, inputs, seed=3)
    _close("out", out_f, out_e, out_tol)
    for name, g_f, g_e in zip(names.split(), grads_f, grads_e, strict=True):
        _close(f"g_{name}", g_f, g_e, grad_tol)


def check_mix_norm_linear(
    B: int, T: int, S: int, D: int, Z: int, dtype: torch.dtype, device: str = "cpu"
) -> None:
    inp = fold_inputs(B, T, S, D, Z, dtype, device)

    def fused(x, pre, wn, w):  # type: ignore[no-untyped-def]
        return mhc.mix_norm_linear(x, pre, wn, w, eps=NORM_EPS)

    def eager(x, pre, wn, w):  # type: ignore[no-untyped-def]
        return F.linear(rms_norm(hyper.mix_in(x, pre, kernels="eager"), wn, NORM_EPS), w)

    inputs = [inp["x"], inp["pre"], inp["wn"], inp["w_in"]]
    _compare(fused, eager, inputs, "x pre wn w", dtype)


@functools.cache
def _model_loss_and_grads(
    device: str, fold_on: bool, *, recompute: bool = False, autocast: bool = False
) -> tuple[Tensor, dict[str, Tensor]]:
    """One layer and one MTP depth (two folded blocks), D 32, F 48, 2 x 8 tokens. Cached: the
    folded run without recompute is the reference of both whole-model checks (read only)."""
    from mhc_model_cases import build_model, tiny_config, token_ids

    from birkhoff.model.block import apply_fold
    from birkhoff.recompute import track_saved_storages
    from birkhoff.train.recompute import apply_recompute

    cfg = tiny_config(dim=32, mlp_hidden=48, num_layers=1)
    model = apply_fold(build_model(cfg, device, "triton"), fold_on)
    if recompute:
        apply_recompute(model, reclaim="safe")
    ids = token_ids(cfg, device, (2, 8))
    with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast), track_saved_storages():
        out = model(ids, labels=ids)
    assert out.loss is not None
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach().clone(), grads  # a clone: the loss itself is an activation


def check_folded_train_step(
    device: str, *, autocast: bool, loss_tol: float, grad_tol: float
) -> None:
    """A whole model's loss and every parameter gradient with the mixes folded into the
    projections against the same model on the unfused fused ops."""
    loss_f, grads_f = _model_loss_and_grads(device, True, autocast=autocast)
    loss_u, grads_u = _model_loss_and_grads(device, False, autocast=autocast)
    assert abs(loss_f.item() - loss_u.item()) <= loss_tol * abs(loss_u.item()), (loss_f, loss_u)
    assert grads_f.keys() == grads_u.keys() and any("w_gate" in n for n in grads_f)
    for name, g in grads_u.items():
        err = (grads_f[name] - g).abs().max().item()
        assert err <= grad_tol * max(1e-3, g.abs().max().item()), (name, err)


def check_folded_safe_reclaim(device: str) -> None:
    """Full recompute with safe reclaim reruns the folded ops: the same loss and gradients to
    the bit, the sanitizer sees no use-after-free, nothing stays alive after the step."""
    from birkhoff.recompute import census, sanitize

    ref_loss, ref_grads = _model_loss_and_grads(device, True, autocast=False)  # cached
    with sanitize():
        loss, grads = _model_loss_and_grads(device, True, recompute=True)
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        assert torch.equal(g, ref_grads[name]), name
    assert census().live_bytes == 0
