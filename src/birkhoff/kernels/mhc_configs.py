"""Launch parameters of the fused mHC kernels, and the variants the sweep compares.

`CONFIG` is what the ops launch (read at every call, so a change applies at the next call):
BN tokens and BC / BD columns per program, num_warps, num_stages. coeff_proj splits the C
columns until its grid has about PROGRAMS programs (decode's few tokens too); grad_phi sums
TOKENS tokens (a multiple of BN) per partial g_phi. PREC is the tensor-core precision of the
projection dots for bf16/fp16 streams: "tf32x3" (three TF32 products, ~fp32 accurate; bf16 is
exact in TF32) or "tf32" (one product, ~1e-3 relative); grad_phi on bf16 streams splits g_raw
into three bf16 terms instead and does not read PREC. fp32 streams use the "_fp32" entries with
exact fp32 "ieee" dots. Every entry here and in `SWEEP` compiles for sm_90 without register
spills (tests/kernels/test_mhc_compile.py) and matches the eager path under the Triton
interpreter.

coeff_proj's PROGRAMS comes from an H200 sweep (`python benchmarks/mhc_sweep.py`,
docs/results.md; 1056 programs: coefficient forward 0.39 -> 0.23 ms); the other entries come
from ptxas register counts. The sweep's other differences were within its run-to-run noise
(+-25% on ops a variant does not touch), so they were not taken.
"""

from __future__ import annotations

Launch = dict[str, int | str]

CONFIG: dict[str, Launch] = {
    "coeff_proj": dict(BN=64, BC=64, num_warps=4, num_stages=3, PREC="tf32x3", PROGRAMS=1056),
    "coeff_proj_fp32": dict(BN=32, BC=32, num_warps=4, num_stages=2, PREC="ieee", PROGRAMS=528),
    "coeff_tail": dict(BN=32, num_warps=4),
    "coeff_bwd": dict(BN=16, num_warps=2),
    "grad_x": dict(BN=16, BC=256, num_warps=4, PREC="fma"),
    "grad_phi": dict(BN=64, BC=128, TOKENS=512, num_warps=8, num_stages=3, PREC="tf32x3"),
    "grad_phi_fp32": dict(BN=32, BC=64, TOKENS=512, num_warps=4, num_stages=2, PREC="ieee"),
    "mix": dict(BN=8, BD=128, num_warps=4),
}

# variant name -> {CONFIG key: entry replacing CONFIG[key]}, timed by the sweep one at a time.
SWEEP: dict[str, dict[str, Launch]] = {
    "coeff_proj/BN128-BC32-w8": {
        "coeff_proj": dict(CONFIG["coeff_proj"], BN=128, BC=32, num_warps=8)
    },
    "coeff_proj/BN32-BC64": {"coeff_proj": dict(CONFIG["coeff_proj"], BN=32)},
    "coeff_proj/programs2112": {"coeff_proj": dict(CONFIG["coeff_proj"], PROGRAMS=2112)},
    "coeff_proj/programs528": {"coeff_proj": dict(CONFIG["coeff_proj"], PROGRAMS=528)},
    "coeff_tail/BN16-w2": {"coeff_tail": dict(BN=16, num_warps=2)},
    "coeff_tail/BN64-w4": {"coeff_tail": dict(BN=64, num_warps=4)},
    "coeff_bwd/BN32-w4": {"coeff_bwd": dict(BN=32, num_warps=4)},
    "coeff_bwd/BN16-w1": {"coeff_bwd": dict(BN=16, num_warps=1)},
    "grad_x/BN8-BC512": {"grad_x": dict(CONFIG["grad_x"], BN=8, BC=512)},
    "grad_x/BN32-BC128": {"grad_x": dict(CONFIG["grad_x"], BN=32, BC=128)},
    "grad_x/BN16-BC256-w8": {"grad_x": dict(CONFIG["grad_x"], num_warps=8)},
    "grad_x/tf32x3-w8": {"grad_x": dict(CONFIG["grad_x"], PREC="tf32x3", num_warps=8)},
    "grad_x/tf32x3-BN32-BC128-w8": {
        "grad_x": dict(CONFIG["grad_x"], BN=32, BC=128, PREC="tf32x3", num_warps=8)
    },
    "grad_x/tf32x3-BN16-BC128": {"grad_x": dict(CONFIG["grad_x"], BC=128, PREC="tf32x3")},
    "coeff_proj_fp32/tf32x3": {"coeff_proj_fp32": dict(CONFIG["coeff_proj_fp32"], PREC="tf32x3")},
    "coeff_proj_fp32/tf32x3-BN64-BC64": {
        "coeff_proj_fp32": dict(CONFIG["coeff_proj"], num_stages=2)
    },
    "grad_phi_fp32/tf32x3": {"grad_phi_fp32": dict(CONFIG["grad_phi_fp32"], PREC="tf32x3")},
    "grad_phi_fp32/tf32x3-BN64-BC128": {"grad_phi_fp32": dict(CONFIG["grad_phi"], num_stages=2)},
    "grad_phi/BN32-BC128-w4": {"grad_phi": dict(CONFIG["grad_phi"], BN=32, num_warps=4)},
    "grad_phi/BC64-w4": {"grad_phi": dict(CONFIG["grad_phi"], BC=64, num_warps=4)},
    "grad_phi/TOKENS1024": {"grad_phi": dict(CONFIG["grad_phi"], TOKENS=1024)},
    "grad_phi/TOKENS256-s2": {"grad_phi": dict(CONFIG["grad_phi"], TOKENS=256, num_stages=2)},
    "mix/BN4-BD256": {"mix": dict(CONFIG["mix"], BN=4, BD=256)},
    "mix/BN8-BD256": {"mix": dict(CONFIG["mix"], BD=256)},
    "mix/BN16-BD128-w8": {"mix": dict(CONFIG["mix"], BN=16, num_warps=8)},
    "mix/BN4-BD128-w2": {"mix": dict(CONFIG["mix"], BN=4, num_warps=2)},
}
