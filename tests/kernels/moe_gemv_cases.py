"""Checks of the fused MoE decode ops `kernels.moe_gemv` against the eager MoE functions, shared
by the interpreter (CPU) and the CUDA tests.

Tolerances, relative to max(1, |y|): fp32 within 2e-5 (fp32 sums in another order); bf16
within 2^-5 (the eager path rounds gate_up, the SwiGLU product, each expert's output and the
shared output to bf16; the kernels round the SwiGLU product and the gated sum once each).
Routing is exact: the same expert ids as `select_experts` (fp32 affinities, distinct values).
"""

from __future__ import annotations

import pytest
import torch

from birkhoff.kernels.moe_gemv import moe_experts, moe_route
from birkhoff.model.moe import experts_loop, router_scores, select_experts, swiglu

# rows, D, E, F, shared F, top_k: one row and several (rows sharing experts: top_k of few
# experts), no shared experts, top_k 1; the last: 8 rows shrink the reduction tiles to 128, so
# D and F span two tiles each (the second partial: 8 and 4 wide)
MOE_CASES = [(1, 40, 6, 16, 32, 2), (3, 130, 5, 24, 0, 3), (8, 64, 4, 8, 8, 1),
             (8, 136, 2, 132, 4, 1)]  # fmt: skip
DTYPES = [torch.float32, torch.bfloat16]


def rel_err(y: torch.Tensor, want: torch.Tensor) -> float:
    return ((y.float() - want).abs() / want.abs().clamp(min=1)).max().item()


def _weights(case: tuple, device: str, dtype: torch.dtype, g: torch.Generator) -> list:
    X, D, E, F, FS, _ = case
    ws = [
        torch.randn(E, 2 * F, D, generator=g) / D**0.5,
        torch.randn(E, D, F, generator=g) / F**0.5,
    ]
    if FS:
        ws += [
            torch.randn(2 * FS, D, generator=g) / D**0.5,
            torch.randn(D, FS, generator=g) / FS**0.5,
        ]
    return [w.to(device, dtype) for w in ws]


def _reference(x: torch.Tensor, ids: torch.Tensor, gates: torch.Tensor, ws: list) -> torch.Tensor:
    """The eager expert math in fp32 (weights as given, widened)."""
    xf, wf = x.float(), [w.float() for w in ws]
    y = experts_loop(xf, ids, gates, wf[0], wf[1])
    return y + swiglu(xf, wf[2], wf[3]) if len(wf) == 4 else y


def check_moe_route(device: str, case: tuple, dtype: torch.dtype) -> None:
    X, D, E, _, _, top_k = case
    g = torch.Generator().manual_seed(X * D + E)
    x = torch.randn(X, D, generator=g).to(device, dtype)
    weight = (torch.randn(E, D, generator=g) * 0.3).to(device)
    bias = (torch.randn(E, generator=g) * 0.1).to(device)
    ids, gates = moe_route(x, weight, bias, top_k, 2.5)
    want_ids, want_gates = select_experts(router_scores(x, weight), bias, top_k)
    assert ids.dtype == torch.int64 and gates.dtype == torch.float32
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(gates, want_gates * 2.5, rtol=1e-5, atol=1e-6)


def check_moe_experts(device: str, case: tuple, dtype: torch.dtype) -> None:
    X, D, E, _, _, top_k = case
    g = torch.Generator().manual_seed(X + D + E)
    x = torch.randn(X, D, generator=g).to(device, dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(X)]).to(device)
    gates = torch.rand(X, top_k, generator=g).to(device)
    ws = _weights(case, device, dtype, g)
    y = moe_experts(x, ids, gates, ws[0], ws[1], [], *ws[2:])
    want = _reference(x, ids, gates, ws)
    assert y.shape == x.shape and y.dtype == dtype
    tol = 2e-5 if dtype == torch.float32 else 2.0**-5
    assert (err := rel_err(y, want)) <= tol, (err, tol)
    if dtype == torch.bfloat16:  # and as close to the eager bf16 path as the tolerance says
        eager = experts_loop(x, ids, gates, ws[0], ws[1])
        eager = eager + swiglu(x, ws[2], ws[3]) if len(ws) == 4 else eager
        assert rel_err(y, eager.float()) <= 2 * tol


def check_moe_experts_fp8(device: str, case: tuple, dtype: torch.dtype) -> None:
    """Block-fp8 stacks (each expert's own 128 x 128 blocks) against the eager math on the
    dequantized weights: the kernels decode the codes exactly, only sums' order differs."""
    from birkhoff.engine.fp8 import dequantize_fp8_blockwise, quantize_fp8_blockwise

    X, D, E, _, _, top_k = case
    g = torch.Generator().manual_seed(X * E + D)
    x = torch.randn(X, D, generator=g).to(device, dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(X)]).to(device)
    gates = torch.rand(X, top_k, generator=g).to(device)
    quantized = [quantize_fp8_blockwise(w) for w in _weights(case, "cpu", torch.float32, g)]
    codes = [q.to(device) for q, _ in quantized]
    scales = [s.to(device) for _, s in quantized]
    y = moe_experts(x, ids, gates, codes[0], codes[1], scales, *codes[2:])
    deq = [
        dequantize_fp8_blockwise(q, s, dtype=torch.float32)
        for q, s in zip(codes, scales, strict=True)
    ]
    tol = 2e-5 if dtype == torch.float32 else 2.0**-5
    assert (err := rel_err(y, _reference(x, ids, gates, deq))) <= tol, (err, tol)


def check_moe_rejects(device: str) -> None:
    x = torch.randn(2, 8, device=device)
    wgu, wd = torch.randn(3, 8, 8, device=device), torch.randn(3, 8, 4, device=device)
    ids, gates = (
        torch.zeros(2, 1, dtype=torch.int64, device=device),
        torch.ones(2, 1, device=device),
    )
    with pytest.raises(ValueError, match="9 rows, serves 1 to 8"):
        moe_experts(torch.randn(9, 8, device=device), ids, gates, wgu, wd, [])
    with pytest.raises(ValueError, match=r"expected \[X, D\], \[E, 2F, D\], \[E, D, F\]"):
        moe_experts(x, ids, gates, wgu, wd.transpose(1, 2).contiguous(), [])
    with pytest.raises(ValueError, match="int64 both"):
        moe_experts(x, ids.int(), gates, wgu, wd, [])
    with pytest.raises(ValueError, match="scale_inv missing"):
        moe_experts(x, ids, gates, wgu.to(torch.float8_e4m3fn), wd, [])
    with pytest.raises(ValueError, match="come together"):
        moe_experts(x, ids, gates, wgu, wd, [], torch.randn(8, 8, device=device))
    with pytest.raises(ValueError, match="1 <= top_k <= E"):
        moe_route(x, torch.randn(3, 8, device=device), torch.zeros(3, device=device), 4, 1.0)


def check_moe_engine_tokens(device: str, *, num_new: int = 6, num_layers: int = 2) -> None:
    """An MoE engine with fused kernels gives the eager engine's greedy tokens (decode steps of
    3 rows and of 1 row) and its decode steps take the gather-and-gemv ops (speculative steps'
    tokens equal plain ones on either path: tests/engine/test_moe_engine.py). The first of
    `num_layers` layers is dense, unless it is the only one."""
    from mhc_model_cases import build_model, tiny_config

    from birkhoff.config import MoEConfig
    from birkhoff.engine import Engine, SamplingParams
    from birkhoff.kernels import moe_gemv

    dense = min(1, num_layers - 1)
    moe = MoEConfig(num_experts=6, experts_per_token=2, expert_hidden=8, num_dense_layers=dense)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    calls, launch = [0], moe_gemv.moe_experts

    def counted(*args: object) -> torch.Tensor:
        calls[0] += 1
        return launch(*args)  # type: ignore[no-any-return]

    tokens = {}
    moe_gemv.moe_experts = counted  # type: ignore[assignment]
    try:
        for kernels in ("triton", "eager"):
            model = build_model(tiny_config(moe=moe, num_layers=num_layers), device, kernels)
            engine = Engine.from_model(model, device=device, dtype=torch.float32, kernels=kernels)
            plain = engine.generate(prompts, SamplingParams(num_new))
            single = engine.generate(prompts[1:2], SamplingParams(num_new))
            tokens[kernels] = ([c.tokens for c in plain], single[0].tokens)
            assert (calls[0] > 0) == (kernels == "triton")
            calls[0] = 0
    finally:
        moe_gemv.moe_experts = launch  # type: ignore[assignment]
    assert tokens["triton"] == tokens["eager"]
