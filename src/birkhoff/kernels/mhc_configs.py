"""Launch parameters of the fused mHC kernels, and the variants the sweep compares.

`CONFIG` is what the ops launch (read at every call, so a change applies at the next call): BN
tokens and BC / BD columns per program, num_warps, num_stages. coeff_proj splits the C columns
until its grid has about PROGRAMS programs (decode's few tokens too); grad_phi sums TOKENS
tokens (a multiple of BN) per partial g_phi, and grad_x's dots walk TOKENS tokens BN at a time
(their phi tiles loaded once; "fma" takes BN tokens a program). PREC is the precision of the
projection's products: "bf16x3" (coeff_proj on bf16 streams: phi as three bf16 terms, exact
products, ~fp32; grad_x: the three largest products of bf16 terms of g_raw and phi, ~2^-15
relative, for g_x written in bf16), "tf32x3" (three TF32 products, ~fp32 accurate; bf16 is
exact in TF32), "tf32" (one product, ~1e-3 relative) or "fma" (grad_x: exact fp32 FMAs);
grad_phi on bf16 streams splits g_raw into three bf16 terms instead and does not read PREC, and
TRANS computes its product as g_phi^T = x^T g_raw; grad_x's PHI (bf16 streams, at most 32
padded logits) has it compute g_phi's partials over its TOKENS tokens from the x tiles it
reads, and grad_phi does not run. fp32 streams use the "_fp32" entries with exact fp32 "ieee"
dots and FMAs. Every entry here and in `SWEEP` compiles for sm_90 without
register spills with Triton 3.9 and 3.6 (tests/kernels/test_mhc_compile.py, at the training
shape's specialisation; the device's 3.6 gave the registers ncu reports) and matches the eager
path under the Triton interpreter.

coeff_proj's PROGRAMS comes from an H200 sweep (`python benchmarks/mhc_sweep.py`,
docs/results.md; 1056 programs: coefficient forward 0.39 -> 0.23 ms), and so do the bf16x3
dots of coeff_proj and grad_x and grad_phi's TRANS (`mhc_sweep-cuda-bf16.json`, device time
of graph replays: coefficient forward 0.157 -> 0.067 ms, its backward's grad_x and grad_phi
-87 and -67 us), and grad_x's 4 warps and 256 tokens a program (8 warps and 1024 before: coefficient
fwd+bwd 0.340 -> 0.300 ms at 4 warps, `mhc_sweep-cuda-bf16-grad_x-warps.json`; ncu 205 -> 137
us), and grad_x's PHI at 1024 tokens a program (`mhc_sweep-cuda-bf16-grad_x-phi.json`:
coefficient fwd+bwd 0.288 -> 0.273 ms); the engine's exit and entry launches come from
`python benchmarks/mhc_exit.py` (`mhc-exit-cuda-tiles.json`: at 256 tokens, exit 6.68 -> 5.79
us with 32 tokens a program, entry 3.65 -> 3.19 us with 256 programs); the other entries
come from ptxas register counts.
"""

from __future__ import annotations

Launch = dict[str, int | str]

CONFIG: dict[str, Launch] = {
    "coeff_proj": dict(BN=64, BC=64, num_warps=4, num_stages=3, PREC="bf16x3", PROGRAMS=1056),
    "coeff_proj_fp32": dict(BN=32, BC=32, num_warps=4, num_stages=2, PREC="ieee", PROGRAMS=528),
    "coeff_tail": dict(BN=32, num_warps=4),
    "coeff_bwd": dict(BN=16, num_warps=2),
    "grad_x": dict(BN=64, BC=64, TOKENS=1024, num_warps=4, PREC="bf16x3", PHI=True),
    "grad_x_fp32": dict(BN=16, BC=256, num_warps=4, PREC="fma"),
    "grad_phi": dict(
        BN=64, BC=128, TOKENS=1024, num_warps=8, num_stages=3, PREC="tf32x3", TRANS=True
    ),
    "grad_phi_fp32": dict(
        BN=32, BC=64, TOKENS=512, num_warps=4, num_stages=2, PREC="ieee", TRANS=False
    ),
    "mix": dict(BN=8, BD=128, num_warps=4),
    # the engine's exit: BN doubles (to 32 at most) while the grid has over PROGRAMS programs;
    # BN >= 16 (tl.dot). The entry after it: ~PROGRAMS programs.
    "mix_out_proj": dict(BN=16, BD=16, num_warps=4, PROGRAMS=384),
    "pre_mix_norm": dict(PROGRAMS=256, num_warps=4),
}

# grad_x before g_phi moved into its pass (grad_phi's own pass over x), and the tiles swept then
_GRAD_X_SEPARATE: Launch = dict(BN=64, BC=64, TOKENS=256, num_warps=4, PREC="bf16x3")

# variant name -> {CONFIG key: entry replacing CONFIG[key]}, timed by the sweep one at a time.
SWEEP: dict[str, dict[str, Launch]] = {
    "coeff_proj/programs2112": {"coeff_proj": dict(CONFIG["coeff_proj"], PROGRAMS=2112)},
    "coeff_proj/programs528": {"coeff_proj": dict(CONFIG["coeff_proj"], PROGRAMS=528)},
    "coeff_tail/BN16-w2": {"coeff_tail": dict(BN=16, num_warps=2)},
    "coeff_tail/BN64-w4": {"coeff_tail": dict(BN=64, num_warps=4)},
    "coeff_bwd/BN32-w4": {"coeff_bwd": dict(BN=32, num_warps=4)},
    "coeff_bwd/BN16-w1": {"coeff_bwd": dict(BN=16, num_warps=1)},
    "grad_x/fma": {"grad_x": dict(BN=16, BC=256, num_warps=4, PREC="fma")},
    "grad_x/separate-phi": {"grad_x": _GRAD_X_SEPARATE},
    "grad_x/T256": {"grad_x": dict(CONFIG["grad_x"], TOKENS=256)},
    "grad_x/T4096": {"grad_x": dict(CONFIG["grad_x"], TOKENS=4096)},
    "grad_x/BN32": {"grad_x": dict(CONFIG["grad_x"], BN=32)},
    "grad_x/s3": {"grad_x": dict(_GRAD_X_SEPARATE, num_stages=3)},
    "grad_x/BC128": {"grad_x": dict(_GRAD_X_SEPARATE, BC=128)},
    "grad_x/w8": {"grad_x": dict(_GRAD_X_SEPARATE, num_warps=8)},
    "grad_x/BN32-w2": {"grad_x": dict(_GRAD_X_SEPARATE, BN=32, num_warps=2)},
    "grad_x/BC32-w2": {"grad_x": dict(_GRAD_X_SEPARATE, BC=32, num_warps=2)},
    "grad_x/BN32-BC32-w1": {"grad_x": dict(_GRAD_X_SEPARATE, BN=32, BC=32, num_warps=1)},
    "grad_x/s2": {"grad_x": dict(_GRAD_X_SEPARATE, num_stages=2)},
    "grad_x/BN32-BC128": {"grad_x": dict(_GRAD_X_SEPARATE, BN=32, BC=128)},
    "coeff_proj/BN128-w8": {"coeff_proj": dict(CONFIG["coeff_proj"], BN=128, num_warps=8)},
    "coeff_proj/s4": {"coeff_proj": dict(CONFIG["coeff_proj"], num_stages=4)},
    "grad_phi/no-trans": {"grad_phi": dict(CONFIG["grad_phi"], TRANS=False, TOKENS=512)},
    "grad_phi/BC256": {"grad_phi": dict(CONFIG["grad_phi"], BC=256)},
    "grad_phi/BN32-w4": {"grad_phi": dict(CONFIG["grad_phi"], BN=32, num_warps=4)},
    "grad_phi/TOKENS2048": {"grad_phi": dict(CONFIG["grad_phi"], TOKENS=2048)},
    "grad_phi/BN128": {"grad_phi": dict(CONFIG["grad_phi"], BN=128)},
    "coeff_proj_fp32/tf32x3": {"coeff_proj_fp32": dict(CONFIG["coeff_proj_fp32"], PREC="tf32x3")},
    "coeff_proj_fp32/tf32x3-BN64-BC64": {
        "coeff_proj_fp32": dict(CONFIG["coeff_proj"], num_stages=2, PREC="tf32x3")
    },
    "grad_phi_fp32/tf32x3": {"grad_phi_fp32": dict(CONFIG["grad_phi_fp32"], PREC="tf32x3")},
    "grad_phi_fp32/tf32x3-BN64-BC128": {
        "grad_phi_fp32": dict(CONFIG["grad_phi"], num_stages=2, TRANS=False)
    },
    "grad_phi_fp32/trans": {"grad_phi_fp32": dict(CONFIG["grad_phi_fp32"], TRANS=True)},
    "mix/BN4-BD256": {"mix": dict(CONFIG["mix"], BN=4, BD=256)},
    "mix/BN8-BD256": {"mix": dict(CONFIG["mix"], BD=256)},
    "mix/BN16-BD128-w8": {"mix": dict(CONFIG["mix"], BN=16, num_warps=8)},
    "mix/BN4-BD128-w2": {"mix": dict(CONFIG["mix"], BN=4, num_warps=2)},
}
