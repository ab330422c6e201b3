"""Launch parameters of the fused mHC kernels, the paddings they use, and the sweep's variants.

`CONFIG` is what the ops launch (read at every call, so a change applies at the next call; no
`triton.autotune`, whose first call syncs inside a graph capture): BN tokens and BC / BD columns
a program, num_warps, num_stages; coeff_proj splits C until about PROGRAMS programs; TOKENS:
tokens a partial g_phi sums; PREC: the projection's products ("bf16x3", "tf32x3", "tf32", "ieee",
"fma"); TRANS: grad_phi's product order; PHI: grad_x also forms g_phi. fp32 streams use the
"_fp32" entries. `launch` adapts an entry to S streams. Every entry here and in `SWEEP`
compiles for sm_90 without spills (tests/kernels/mhc/test_compile.py); the measurements that
chose them are in docs/log/kernels.md.
"""

from __future__ import annotations

import torch
from torch import Tensor

from birkhoff.kernels.common import pow2

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
    # the folded entry's row passes (mix_norm_linear.py): whole rows, about ELEMENTS a tile;
    # the backward's grid about PROGRAMS programs
    "fold_norm": dict(ELEMENTS=4096, PROGRAMS=528),
}


def pad_streams(S: int) -> int:
    return max(2, pow2(S))


def padded_logits(P: int) -> int:
    """PP: P padded to a power of two >= 16 (what tl.dot needs)."""
    return max(16, pow2(P))


def pads(S: int, P: int) -> tuple[int, int]:
    """(SP, PP): S padded to a power of two >= 2, P to a power of two >= 16 (tl.dot)."""
    return pad_streams(S), padded_logits(P)


def launch(name: str, x: Tensor | None = None, S: int = 4) -> Launch:
    """CONFIG[name] (its "_fp32" entry for fp32 streams) for S streams, tuned at S = 4: for
    S > 4 the coefficient kernels' token block shrinks (their Sinkhorn state is BN x SP x SP,
    the projection BN x PP), and so do grad_phi's blocks (accumulator PP x BC, g_raw BN x PP)
    and the columns of coeff_proj's and grad_x's dots (phi tiles PP x BC)."""
    fp32 = x is not None and x.dtype == torch.float32 and f"{name}_fp32" in CONFIG
    cfg = dict(CONFIG[f"{name}_fp32" if fp32 else name])
    if name.startswith("coeff"):
        cfg["BN"] = max(16, int(cfg["BN"]) * 16 // max(16, pad_streams(S) ** 2))
    if name in ("grad_phi", "coeff_proj") or (name == "grad_x" and cfg["PREC"] == "bf16x3"):
        shrink = max(32, pads(S, S * S + 2 * S)[1]) // 32
        cfg["BC"] = max(16, int(cfg["BC"]) // shrink)
        if name == "grad_phi":
            cfg["BN"] = max(16, int(cfg["BN"]) // shrink)
    return cfg


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
