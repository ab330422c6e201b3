"""Every fused mHC kernel compiles for an sm_90 (H200) target, on a machine without a GPU, with
the launch parameters of `mhc.CONFIG` and the training shape's specialisation (aligned pointers,
sizes divisible by 16), and ptxas reports no register spills.

The interpreter runs the kernels' math but skips the compiler's checks (types of names bound
in both branches of a runtime `if`, layouts, dot precisions, register allocation); this compiles
each kernel through Triton's full pipeline to PTX and runs ptxas -v on it.
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest

triton = pytest.importorskip("triton")
from birkhoff.kernels.mhc import configs  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1", reason="kernels are interpreted in this process"
)


def ptxas_usage(ptx: str) -> tuple[int, int]:
    """(registers per thread, spill store + load bytes) that ptxas -v reports for sm_90a."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.ptx"
        path.write_text(ptx)
        cmd = [get_ptxas(90).path, "-v", "--gpu-name", "sm_90a", str(path), "-o", os.devnull]
        log = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    regs = int(re.search(r"Used (\d+) registers", log).group(1))  # type: ignore[union-attr]
    spills = sum(int(b) for b in re.findall(r"(\d+) bytes spill (?:stores|loads)", log))
    return regs, spills


# Triton's launcher specializes a pointer aligned to 16 bytes and an int divisible by 16 (wider
# loads, fewer address registers): at the training shape (B 8, T 2048, D 768) these are.
ALIGNED_INTS = ("N", "C", "D", "TOKENS", "Z")


Job = tuple[object, dict[str, str], dict[str, object], dict[str, int]]  # fn, types, consts, launch


def planned(
    fn: object, types: dict[str, str], consts: dict[str, object], launch: dict[str, int]
) -> Job:
    """A kernel to compile for sm_90 with these constexprs and launch options (`usage` compiles
    it; `kernel_jobs` plans them all first, so a variant compiles only what it changes)."""
    return fn, types, consts, launch


def job_key(job: Job) -> str:
    """What the compiled kernel depends on: the kernel, its argument types, constexprs, launch."""
    fn, types, consts, launch = job
    params = inspect.signature(fn.fn).parameters  # type: ignore[attr-defined]
    used = {p: types[p] for p in params if p in types and p not in consts}
    name = fn.fn.__name__  # type: ignore[attr-defined]
    return repr((name, sorted(used.items()), sorted(consts.items()), sorted(launch.items())))


def changed(jobs: dict[str, Job], base: dict[str, Job]) -> dict[str, Job]:
    """The jobs of `jobs` that compile another kernel than any of `base` (the rest are base's)."""
    seen = {job_key(job) for job in base.values()}
    return {name: job for name, job in jobs.items() if job_key(job) not in seen}


def usage(jobs: dict[str, Job]) -> dict[str, tuple[int, int]]:
    """ptxas (registers, spill bytes) of each planned kernel."""
    return {name: ptxas_usage(compiled_for_h200(*job).asm["ptx"]) for name, job in jobs.items()}


def compiled_for_h200(
    fn: object, types: dict[str, str], consts: dict[str, object], launch: dict[str, int]
) -> Any:
    """The kernel `fn` compiled for sm_90 (its .asm holds the TTGIR and the PTX)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    params = list(inspect.signature(fn.fn).parameters)  # type: ignore[attr-defined]
    signature = {p: "constexpr" if p in consts else types[p] for p in params}
    constexprs = {(params.index(k),): v for k, v in consts.items()}
    aligned = [i for i, p in enumerate(params) if p not in consts
               and (signature[p].startswith("*") or p in ALIGNED_INTS)]  # fmt: skip
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    opts = {k: v for k, v in launch.items() if k in ("num_warps", "num_stages")}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


def split(cfg: dict[str, int | str]) -> tuple[dict[str, object], dict[str, int]]:
    """(constexprs, launch options) of a CONFIG entry."""
    launch = {k: int(v) for k, v in cfg.items() if k in ("num_warps", "num_stages")}
    return {k: v for k, v in cfg.items() if k not in launch and k != "TOKENS"}, launch


def kernel_types(dtype: str, floats: str = "fp32") -> dict[str, str]:
    """Triton type of each argument name of the mHC kernels, for `dtype` streams and `floats`
    float arguments."""
    f32, xt = "*fp32", f"*{dtype}"
    ptrs = ("phit_ptr", "phi_ptr", "raw_ptr", "alpha_ptr", "bias_ptr", "pre_ptr", "post_ptr",
            "res_ptr", "rstd_ptr", "gpre_ptr", "gpost_ptr", "gres_ptr", "ga_ptr", "graw_ptr",
            "coef_ptr", "scr_ptr", "gphi_ptr", "h_ptr", "gh_ptr", "part_ptr", "sq_ptr")  # fmt: skip
    types = {n: f32 for n in ptrs}
    types |= {n: xt for n in ("x_ptr", "gx_ptr", "y_ptr", "gy_ptr", "gr_ptr")}
    types |= dict(f_ptr=xt, gf_ptr=xt, N="i32", C="i32", D="i32", S="i32", TOKENS="i32")
    types |= dict(iters="i32", CHUNK="i32", SPLITS="i32")
    return types | dict(norm_eps=floats, hc_eps=floats)


def kernel_jobs(S: int, dtype: str, floats: str = "fp32") -> dict[str, Job]:
    """Every kernel as the ops launch it under mhc.CONFIG, by name; `floats`: the type of float
    arguments (Triton's launcher passes fp32, inductor's fp64)."""
    import torch

    from birkhoff.kernels.mhc import coefficients as K
    from birkhoff.kernels.mhc import configs as mhc_configs
    from birkhoff.kernels.mhc import entry as mhc_entry
    from birkhoff.kernels.mhc import mixes as M
    from birkhoff.kernels.mhc import phi as mhc_phi
    from birkhoff.kernels.mhc import projection_grad as G

    x = torch.empty(0, dtype=torch.float32 if dtype == "fp32" else torch.bfloat16)
    f32, xt = "*fp32", f"*{dtype}"
    types = kernel_types(dtype, floats)
    jobs: dict[str, Job] = {}
    for P in (S * S + 2 * S, S):
        SP, PP = mhc_configs.pads(S, P)
        consts = dict(S=S, SP=SP, P=P, WITH_RES=P > S)
        const, launch = split(mhc_configs.launch("coeff_proj", x, S))
        const.pop("PROGRAMS")
        terms = dict(phit_ptr="*bf16" if const["PREC"] == "bf16x3" else f32)
        jobs[f"coeff_proj/{P}"] = planned(
            K.coeff_proj, types | terms, const | dict(PP=PP, EMU=False), launch
        )
        const, launch = split(mhc_configs.launch("coeff_tail", x, S))
        kb = max(1, K.TAIL_ELEMENTS // (int(const["BN"]) * PP))  # decode's widest load
        jobs[f"coeff_tail/{P}"] = planned(
            K.coeff_tail, types, consts | const | dict(PP=PP, KB=kb), launch
        )
        bn = mhc_entry.ENTRY_ELEMENTS // 1024  # the engine's entry at D 768 (BD 1024)
        entry = dict(S=S, SP=SP, P=P, PP=PP, BN=bn, BD=1024, KB=K.TAIL_ELEMENTS // (bn * PP))
        jobs[f"pre_mix_norm/{P}"] = planned(
            mhc_entry.pre_mix_norm_kernel,
            types | dict(w_ptr=xt, rms_eps=floats),
            entry,
            {"num_warps": int(mhc_configs.CONFIG["pre_mix_norm"]["num_warps"])},
        )
        if P > S:  # coeff_rest as the engine launches it at batch 256
            const, launch = split(mhc_entry._rest_launch(256))
            rest = dict(S=S, SP=SP, P=P) | const
            jobs[f"coeff_rest/{P}"] = planned(mhc_entry.coeff_rest, types, rest, launch)
        const, launch = split(mhc_configs.launch("coeff_bwd", x, S))
        jobs[f"coeff_bwd/{P}"] = planned(K.coeff_bwd, types, consts | const, launch)
        const, launch = split(mhc_configs.launch("grad_x", x, S))
        terms = dict(phi_ptr="*bf16" if const["PREC"] == "bf16x3" else f32)
        for mix, res in ((True, True), (True, False), (False, False)):  # as the ops launch it
            jobs[f"grad_x/{P}/{mix}/{res}"] = planned(
                G.grad_x, types | terms,
                const | dict(P=P, PP=PP, MIX=mix, RES=res, WHOLE=768 % int(const["BC"]) == 0,
                             EMU=False, PHI=G.phi_in_grad_x(const, x, PP)), launch,
            )  # fmt: skip
        const, launch = split(mhc_configs.launch("grad_phi", x, S))
        split_bf16 = dict(P=P, PP=PP, SPLIT=dtype == "bf16", EMU=False) | const
        jobs[f"grad_phi/{P}"] = planned(G.grad_phi, types, split_bf16, launch)
        for terms in (1, 3):
            jobs[f"phi_pad_t/{P}/{terms}"] = planned(
                mhc_phi.phi_pad_t,
                types | dict(P="i32", out_ptr="*bf16" if terms == 3 else f32),
                dict(PP=PP, BC=64, TERMS=terms),
                {},
            )
    const, launch = split(M._mix_grid(1, S, 768)[1])
    for kernel in (M.mix_in_fwd, M.mix_out_fwd, M.mix_out_bwd):
        jobs[kernel.fn.__name__] = planned(kernel, types, dict(S=S) | const, launch)
    for write in (True, False):
        consts = dict(S=S, WRITE_GX=write) | const
        jobs[f"mix_in_bwd/{write}"] = planned(M.mix_in_bwd, types, consts, launch)
    for N in (1, 256):  # the exit's tile at batch 1 and at batch 256 (more tokens a program)
        const, launch = split(mhc_entry._exit_launch(N, 768))
        for P in (S * S + 2 * S, S):  # the next entry a sublayer's, or the output contraction
            consts = dict(S=S, PP=mhc_configs.pads(S, P)[1]) | const
            kernel = mhc_entry.mix_out_proj_kernel
            jobs[f"mix_out_proj/{N}/{P}"] = planned(kernel, types, consts, launch)
    return jobs | fold_jobs(S, dtype, floats)


def fold_jobs(S: int, dtype: str, floats: str = "fp32") -> dict[str, Job]:
    """The GEMM-folded sublayer's kernels: the entry's row passes at D 768 and 4096 (whole rows
    a program)."""
    import importlib

    rows = importlib.import_module("birkhoff.kernels.mhc.mix_norm_linear")
    xt = f"*{dtype}"
    types = kernel_types(dtype, floats) | dict(wn_ptr="*fp32", a_ptr=xt, g_ptr=xt, gw_ptr="*fp32")
    types |= dict(eps=floats)
    jobs: dict[str, Job] = {}
    for D in (768, 4096):
        cfg = rows.row_launch(16384, D)[1]
        cfg.pop("TOKENS")
        const, launch = split(cfg)
        for kernel in (rows.mix_norm_fwd, rows.mix_norm_bwd):
            name = f"{kernel.fn.__name__}/{D}"
            jobs[name] = planned(kernel, types, const | dict(S=S), launch)
    return jobs


def assert_no_spills(usage: dict[str, tuple[int, int]]) -> None:
    print(usage)
    spilled = {k: v for k, v in usage.items() if v[1]}
    assert not spilled, f"(registers, spill bytes) per kernel: {spilled}"


@pytest.mark.slow
@pytest.mark.parametrize(("S", "dtype"), [(4, "bf16"), (4, "fp32"), (8, "bf16")])
def test_kernels_compile_for_sm90_without_spills(S: int, dtype: str) -> None:
    assert_no_spills(usage(kernel_jobs(S, dtype)))


@pytest.mark.slow
def test_kernels_compile_with_float_arguments_as_inductor_passes_them() -> None:
    # torch.compile launches the triton_ops' kernels from inductor's code, with fp64 floats;
    # the kernels without float arguments are the fp32 launcher's (compiled above)
    jobs = changed(kernel_jobs(4, "bf16", floats="fp64"), kernel_jobs(4, "bf16"))
    assert jobs
    assert_no_spills(usage(jobs))


SWEPT = sorted({variant.split("/")[0] for variant in configs.SWEEP})  # CONFIG keys swept


@pytest.mark.slow
@pytest.mark.parametrize("key", SWEPT)
def test_sweep_variants_compile_for_sm90_without_spills(
    key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each variant of CONFIG[key] compiles the kernels it launches differently from CONFIG
    (CONFIG's compile above) and from an earlier variant; a variant of the grid size alone
    (PROGRAMS, TOKENS) launches no other kernel."""
    dtype = "fp32" if key.endswith("_fp32") else "bf16"
    jobs = kernel_jobs(4, dtype)
    swept: dict[str, Job] = {}
    for variant in (v for v in configs.SWEEP if v.split("/")[0] == key):
        with monkeypatch.context() as patch:
            for name, entry in configs.SWEEP[variant].items():
                patch.setitem(configs.CONFIG, name, entry)
            new = changed(kernel_jobs(4, dtype), jobs)
        jobs |= {f"{variant}: {name}": job for name, job in new.items()}
        swept |= {f"{variant}: {name}": job for name, job in new.items()}
    assert swept, f"no variant of {key} launches another kernel"
    assert_no_spills(usage(swept))


def reductions_across_warps(ttgir: str) -> list[tuple[int, str]]:
    """(axis, layout) of each `tt.reduce` in a TTGIR whose axis is split across warps (the
    reduction then goes through shared memory and a block barrier)."""
    warps = dict(
        re.findall(r"^(#\w+) = #ttg\.blocked<\{.*warpsPerCTA = \[([\d, ]+)\]", ttgir, re.M)
    )
    lines, found = ttgir.splitlines(), []
    for i, line in enumerate(lines):
        if (m := re.search(r'"tt\.reduce"\(.*<\{axis = (\d+) : i32\}>', line)) is None:
            continue
        axis = int(m.group(1))
        for close in lines[i : i + 16]:  # the op's type signature closes its region
            if (t := re.search(r"\}\) : \(tensor<[^,]*, (#\w+)>", close)) is not None:
                split = warps.get(t.group(1), "1").split(",")
                if axis < len(split) and int(split[axis]) > 1:
                    found.append((axis, t.group(1)))
                break
    return found


def test_sinkhorn_sums_stay_inside_a_warp() -> None:
    # The Sinkhorn's row and column sums (axes 1 and 2 of its [tokens, S, S] state) run 40 times
    # a token. A layout with a token's rows across warps (Triton 3.6 picked one for a 3-D load)
    # made each a shared-memory round trip with barriers: coeff_tail 29.7 -> 10.3 us a call once
    # the state was loaded as [tokens, S*S] and reshaped. Only the sums over the projection's
    # splits (axis 0) may cross warps. Triton 3.9 lays out the old 3-D form well too; under the
    # device's 3.6 (`pip install --target DIR triton==3.6.0`, PYTHONPATH=DIR) it fails this test.
    import torch

    from birkhoff.kernels.mhc import coefficients as K
    from birkhoff.kernels.mhc import configs as mhc_configs

    x, P = torch.empty(0, dtype=torch.bfloat16), 24
    SP, PP = mhc_configs.pads(4, P)
    types = kernel_types("bf16")
    consts = dict(S=4, SP=SP, P=P, WITH_RES=True)
    tail, tail_launch = split(mhc_configs.launch("coeff_tail", x, 4))
    bwd, bwd_launch = split(mhc_configs.launch("coeff_bwd", x, 4))
    kernels = {
        "coeff_tail": (K.coeff_tail, consts | tail | dict(PP=PP, KB=4), tail_launch),
        "coeff_bwd": (K.coeff_bwd, consts | bwd, bwd_launch),
    }
    for name, (fn, const, launch) in kernels.items():
        ttgir = compiled_for_h200(fn, types, const, launch).asm["ttgir"]
        crossing = [r for r in reductions_across_warps(ttgir) if r[0] > 0]
        assert not crossing, f"{name}: reductions (axis, layout) split across warps: {crossing}"
