"""Fused mHC ops on CUDA: fused vs eager on every case, bf16 and fp32 train steps, engine greedy
tokens, safe reclaim, custom-op checks and torch.compile (inductor) without a graph break."""

from __future__ import annotations

import pytest
import torch
from mhc_cases import (
    CASES,
    Case,
    case_id,
    check_bf16_streams_keep_fp32_precision,
    check_contraction,
    check_exit,
    check_hyper,
    check_hyper_entry,
    check_sublayer,
    make_inputs,
)
from mhc_model_cases import check_engine_tokens, check_safe_reclaim, check_train_step

from birkhoff.model import hyper

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
CUDA_CASES = [*CASES, Case(S=4, D=768, B=2, T=64, iters=20), Case(S=4, D=769, B=1, T=33)]


@pytest.mark.parametrize("case", CUDA_CASES, ids=case_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_hyper_fused_matches_eager(case: Case, dtype: torch.dtype) -> None:
    check_hyper(case, "cuda", dtype)


@pytest.mark.parametrize("case", CUDA_CASES, ids=case_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_coefficients_and_mix_in_as_one_op_match_eager(case: Case, dtype: torch.dtype) -> None:
    check_hyper(case, "cuda", dtype, joint=True)


@pytest.mark.parametrize("case", CUDA_CASES, ids=case_id)
@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graphed"])
def test_engine_entry_equals_the_training_ops(case: Case, graphed: bool) -> None:
    check_hyper_entry(case, "cuda", torch.bfloat16, graphed=graphed)


@pytest.mark.parametrize("case", CUDA_CASES, ids=case_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_engine_exit_projects_for_the_next_entry(case: Case, dtype: torch.dtype) -> None:
    check_exit(case, "cuda", dtype)


@pytest.mark.parametrize("case", CUDA_CASES, ids=case_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_sublayer_sums_both_gradients_of_the_streams(case: Case, dtype: torch.dtype) -> None:
    check_sublayer(case, "cuda", dtype)


@pytest.mark.parametrize("case", CUDA_CASES, ids=case_id)
def test_contraction_fused_matches_eager(case: Case) -> None:
    check_contraction(case, "cuda")


@pytest.mark.parametrize("case", CUDA_CASES[-2:], ids=case_id)
def test_bf16_streams_keep_fp32_precision(case: Case) -> None:
    check_bf16_streams_keep_fp32_precision(case, "cuda")


def test_auto_selects_the_fused_ops_on_cuda() -> None:
    x = torch.zeros(1, 1, 4, 8, device="cuda")
    assert hyper.use_fused(x, "auto") and not hyper.use_fused(x, "eager")
    assert not hyper.use_fused(x.double(), "auto")


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_train_step_fused_matches_eager(autocast: bool) -> None:
    tol = (1e-3, 3e-2) if autocast else (1e-6, 1e-4)
    check_train_step("cuda", autocast=autocast, loss_tol=tol[0], grad_tol=tol[1])


def test_engine_greedy_tokens_fused_equal_eager() -> None:
    check_engine_tokens("cuda")


def test_checkpointed_blocks_rerun_fused_kernels_under_safe_reclaim() -> None:
    check_safe_reclaim("cuda")


@pytest.mark.parametrize("name", ["mhc_coefficients", "mhc_mix_in", "mhc_mix_out"])
def test_custom_op_registration(name: str) -> None:
    import birkhoff.kernels  # noqa: F401  (registers the ops)

    g = torch.Generator().manual_seed(0)
    N, S, D = 5, 4, 24
    P = S * S + 2 * S

    def rand(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=g).cuda().requires_grad_(True)

    x = rand(N, S, D)
    args = {
        "mhc_coefficients": (x, rand(P, S * D), rand(3), rand(P), 3, True, True, 1e-6, 1e-6),
        "mhc_mix_in": (x, rand(N, S)),
        "mhc_mix_out": (x, rand(N, D), rand(N, S), rand(N, S, S)),
    }[name]
    torch.library.opcheck(getattr(torch.ops.birkhoff, name).default, args)


def test_inductor_compiles_the_block_without_graph_break() -> None:
    case = Case(S=4, D=64, iters=20)
    inp = make_inputs(case, "cuda", torch.float32)
    leaves = [inp[k].requires_grad_(True) for k in ("x", "phi", "alpha", "bias")]

    def block(x, phi, alpha, bias):  # type: ignore[no-untyped-def]
        pre, post, res = hyper.mhc_coefficients(x, phi, alpha, bias, iters=20, norm_eps=1e-6)
        y = hyper.mix_out(x, torch.tanh(hyper.mix_in(x, pre)), post, res)
        return y.square().sum()

    def sublayer(x, phi, alpha, bias):  # type: ignore[no-untyped-def]
        y = hyper.hyper_connection(x, phi, alpha, bias, torch.tanh, iters=20, norm_eps=1e-6)
        return y.square().sum()

    for fn in (block, sublayer):
        torch._dynamo.reset()
        loss = torch.compile(fn, fullgraph=True)(*leaves)
        grads = torch.autograd.grad(loss, leaves)
        ref = fn(*leaves)
        ref_grads = torch.autograd.grad(ref, leaves)
        torch.testing.assert_close(loss, ref)
        for got, want in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_kernels_launch_through_wrap_triton_only_when_traced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Eager calls (FusedOp's direct entry, forward and backward) launch the kernels directly;
    torch.compile traces the same implementations through wrap_triton (the triton_op), so
    inductor sees every launch."""
    wrapped: list[str] = []
    real = torch.library.wrap_triton

    def counting(kernel):  # type: ignore[no-untyped-def]
        wrapped.append(kernel.fn.__name__)
        return real(kernel)

    monkeypatch.setattr(torch.library, "wrap_triton", counting)
    inp = make_inputs(Case(S=4, D=64, iters=20), "cuda", torch.float32)
    leaves = [inp[k].requires_grad_(True) for k in ("x", "phi", "alpha", "bias")]

    def sublayer(x, phi, alpha, bias):  # type: ignore[no-untyped-def]
        y = hyper.hyper_connection(x, phi, alpha, bias, torch.tanh, iters=20, norm_eps=1e-6)
        return y.square().sum()

    torch.autograd.grad(sublayer(*leaves), leaves)
    assert wrapped == []
    torch._dynamo.reset()
    torch.autograd.grad(torch.compile(sublayer, fullgraph=True)(*leaves), leaves)
    assert {"coeff_proj", "coeff_tail", "mix_out_fwd", "grad_x", "mix_out_bwd"} <= set(wrapped)
