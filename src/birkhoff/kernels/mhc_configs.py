"""Launch parameters of the fused mHC kernels, and the variants the sweep compares.

`CONFIG` is what the ops launch (read at every call, so a change applies at the next call):
BN tokens and BC / BD columns per program, num_warps, num_stages; rms_grad sums TOKENS tokens
(a multiple of BN) per partial g_phi. PREC is the tensor-core precision of the projection dots
for bf16/fp16 streams: "tf32x3" (three TF32 products, ~fp32 accurate; bf16 is exact in TF32)
or "tf32" (one product, ~1e-3 relative). MIX_IN=1 lets the coefficient kernel also compute the
mix in (when the op asks for it) by re-reading its own rows of x in BD-column tiles, which are
partly still in L2; MIX_IN=0 launches the mix-in kernel after it. fp32 streams use the "_fp32"
entries with exact fp32 "ieee" dots. Every entry here and in `SWEEP` compiles for sm_90
without register spills (tests/kernels/test_mhc_compile.py) and matches the eager path under
the Triton interpreter.

The defaults were picked by register/spill counts from ptxas, pending the H200 sweep
(`python benchmarks/mhc_sweep.py`), which times every `SWEEP` variant.
"""

from __future__ import annotations

Launch = dict[str, int | str]

CONFIG: dict[str, Launch] = {
    "coeff_fwd": dict(BN=64, BC=64, num_warps=4, num_stages=3, PREC="tf32x3", MIX_IN=0, BD=128),
    "coeff_fwd_fp32": dict(BN=32, BC=32, num_warps=4, num_stages=2, PREC="ieee", MIX_IN=0, BD=128),
    "coeff_bwd": dict(BN=32, num_warps=4),
    "rms_grad": dict(BN=32, BC=64, TOKENS=512, num_warps=8, num_stages=2, PREC="tf32x3"),
    "rms_grad_fp32": dict(BN=16, BC=128, TOKENS=512, num_warps=8, num_stages=2, PREC="ieee"),
    "mix": dict(BN=8, BD=256, num_warps=4),
}

# variant name -> {CONFIG key: entry replacing CONFIG[key]}, timed by the sweep one at a time.
SWEEP: dict[str, dict[str, Launch]] = {
    "coeff_fwd/BN128-BC32-w8-s3": {
        "coeff_fwd": dict(CONFIG["coeff_fwd"], BN=128, BC=32, num_warps=8)
    },
    "coeff_fwd/BN64-BC32-w4-s4": {"coeff_fwd": dict(CONFIG["coeff_fwd"], BC=32, num_stages=4)},
    "coeff_fwd/BN32-BC64-w4-s3": {"coeff_fwd": dict(CONFIG["coeff_fwd"], BN=32)},
    "coeff_fwd/tf32": {"coeff_fwd": dict(CONFIG["coeff_fwd"], PREC="tf32")},
    "coeff_fwd/mix-in-BN32-BD32": {"coeff_fwd": dict(CONFIG["coeff_fwd"], MIX_IN=1, BN=32, BD=32)},
    "coeff_fwd/mix-in-BN16-BD64": {"coeff_fwd": dict(CONFIG["coeff_fwd"], MIX_IN=1, BN=16, BD=64)},
    "coeff_bwd/BN16-w2": {"coeff_bwd": dict(BN=16, num_warps=2)},
    "coeff_bwd/BN64-w4": {"coeff_bwd": dict(BN=64, num_warps=4)},
    "rms_grad/BN16-BC128-w8": {"rms_grad": dict(CONFIG["rms_grad"], BN=16, BC=128)},
    "rms_grad/BN16-BC64-w4": {"rms_grad": dict(CONFIG["rms_grad"], BN=16, num_warps=4)},
    "rms_grad/BN32-BC64-w8-s3": {"rms_grad": dict(CONFIG["rms_grad"], num_stages=3)},
    "rms_grad/TOKENS1024": {"rms_grad": dict(CONFIG["rms_grad"], TOKENS=1024)},
    "rms_grad/tf32": {"rms_grad": dict(CONFIG["rms_grad"], PREC="tf32")},
    "mix/BN4-BD256": {"mix": dict(CONFIG["mix"], BN=4)},
    "mix/BN16-BD128-w8": {"mix": dict(CONFIG["mix"], BN=16, BD=128, num_warps=8)},
    "mix/BN4-BD512-w4": {"mix": dict(CONFIG["mix"], BN=4, BD=512)},
    "mix/BN2-BD1024-w8": {"mix": dict(CONFIG["mix"], BN=2, BD=1024, num_warps=8)},
    "mix/BN8-BD128-w4": {"mix": dict(CONFIG["mix"], BD=128)},
}
