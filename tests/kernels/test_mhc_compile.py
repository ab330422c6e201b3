"""Every fused mHC kernel compiles for an sm_90 (H200) target, on a machine without a GPU.

The interpreter runs the kernels' math but skips the compiler's checks (types of names bound
in both branches of a runtime `if`, layouts, register allocation); this compiles each kernel
through Triton's full pipeline to a cubin for the shapes the ops launch.
"""

from __future__ import annotations

import inspect
import os

import pytest

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1", reason="kernels are interpreted in this process"
)


def compile_for_h200(
    fn: object, types: dict[str, str], consts: dict[str, object], num_warps: int = 4
) -> None:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    params = list(inspect.signature(fn.fn).parameters)  # type: ignore[attr-defined]
    signature = {p: "constexpr" if p in consts else types[p] for p in params}
    constexprs = {(params.index(k),): v for k, v in consts.items()}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


@pytest.mark.parametrize("S", [4, 8])
def test_kernels_compile_for_sm90(S: int) -> None:
    from birkhoff.kernels import mhc
    from birkhoff.kernels import mhc_triton as K

    f32 = "*fp32"
    coeff = {n: f32 for n in ("x_ptr", "phi_ptr", "raw_ptr", "alpha_ptr", "bias_ptr", "pre_ptr",
                              "post_ptr", "res_ptr", "rstd_ptr", "gpre_ptr", "gpost_ptr",
                              "gres_ptr", "ga_ptr", "graw_ptr", "coef_ptr")}  # fmt: skip
    coeff |= dict(x_ptr="*bf16", N="i32", C="i32", norm_eps="fp32", hc_eps="fp32", iters="i32")
    for P in (S * S + 2 * S, S):
        SP, PP, BN, BC = mhc._coeff_blocks(S, 768 * S, P)
        consts = dict(S=S, SP=SP, P=P, WITH_RES=P > S, BN=BN)
        compile_for_h200(K.coeff_fwd, coeff, consts | dict(PP=PP, BC=BC))
        compile_for_h200(K.coeff_bwd, coeff, consts)
    mix = {n: "*bf16" for n in ("x_ptr", "y_ptr", "gy_ptr", "gx_ptr", "f_ptr", "gf_ptr")}
    mix |= {n: f32 for n in ("h_ptr", "gh_ptr", "post_ptr", "res_ptr", "gpost_ptr", "gres_ptr")}
    mix |= dict(D="i32")
    SP, BD = mhc._mix_in_block(S, 768)
    for kernel in (K.mix_in_fwd, K.mix_in_bwd):
        compile_for_h200(kernel, mix, dict(S=S, SP=SP, BD=BD))
    SP, BD = mhc._mix_out_block(S, 768)
    for kernel in (K.mix_out_fwd, K.mix_out_bwd):
        compile_for_h200(kernel, mix, dict(S=S, SP=SP, BD=BD))
    rms = dict(graw_ptr=f32, phi_ptr=f32, x_ptr="*bf16", coef_ptr=f32, gx_ptr="*bf16")
    rms |= dict(gphi_ptr=f32, N="i32", C="i32", TOKENS="i32")
    for P in (S * S + 2 * S, S):
        PP = max(16, 1 << (P - 1).bit_length())
        consts = dict(P=P, PP=PP, BN=16, BC=max(16, min(128, 4096 // PP)))
        compile_for_h200(K.rms_grad, rms, consts, num_warps=8)  # as mhc.py launches it
