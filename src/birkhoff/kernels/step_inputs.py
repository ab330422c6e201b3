"""A plain decode step's inputs as one fused forward-only custom op (`birkhoff::decode_inputs`).

Legend: A rows of the step, B cache rows, N cache positions, K2 rope angles a token.

Eagerly (`engine.step.plain_step`) a step's position, valid flag, rope angles and input token
are five small launches (the flag's cast, a `where`, two table gathers and the token's index):
each costs its launch, not its bytes. `decode_inputs` writes the same values in one launch
(kernels/step_inputs_triton.py); the eager ops stay the reference and the CPU path. No host
sync, so it runs inside the engine's CUDA graphs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from birkhoff.kernels import step_inputs_triton as K
from birkhoff.kernels.mhc_mix import INTERPRET, pow2

ROWS = 16  # rows a program


@torch.library.custom_op("birkhoff::decode_inputs", mutates_args=())
def decode_inputs(
    n_A: Tensor, live_A: Tensor, rows_A: Tensor, tokens_BN: Tensor, cos_NK2: Tensor,
    sin_NK2: Tensor, trash: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """(positions [A, 1] int64: n where live != 0, else `trash`; valid [A, 1] bool: live;
    cos, sin [A, 1, K2]: the tables' rows at the positions; tokens [A, 1] int64:
    tokens_BN[rows, positions]) for int64 n and rows, any integer or bool live."""
    if not n_A.is_cuda and not INTERPRET:
        raise ValueError(f"decode_inputs: device={n_A.device} needs CUDA")
    A = n_A.shape[0]
    for name, t in (("n", n_A), ("live", live_A), ("rows", rows_A)):
        if t.shape != (A,) or (name != "live" and t.dtype != torch.long):
            raise ValueError(f"decode_inputs: {name} must be {A} entries"
                             f"{'' if name == 'live' else ' of int64'}, got "
                             f"{t.dtype}{tuple(t.shape)}")  # fmt: skip
    if cos_NK2.dim() != 2 or sin_NK2.shape != cos_NK2.shape:
        raise ValueError(f"decode_inputs: rope tables {tuple(cos_NK2.shape)} / "
                         f"{tuple(sin_NK2.shape)} must be one [N, K2] shape")  # fmt: skip
    if tokens_BN.dtype != torch.long or tokens_BN.dim() != 2 or tokens_BN.stride(1) != 1:
        raise ValueError(f"decode_inputs: tokens must be a row-major [B, N] int64 tensor, got "
                         f"{tokens_BN.dtype}{tuple(tokens_BN.shape)}")  # fmt: skip
    if not 0 <= trash < min(tokens_BN.shape[1], cos_NK2.shape[0]):
        raise ValueError(f"decode_inputs: trash slot {trash} outside the tokens' "
                         f"{tokens_BN.shape[1]} or the tables' {cos_NK2.shape[0]} "
                         "positions")  # fmt: skip
    outs = _fake(n_A, live_A, rows_A, tokens_BN, cos_NK2, sin_NK2, trash)
    if A:
        K2 = cos_NK2.shape[1]
        K.decode_inputs[(-(-A // ROWS),)](
            n_A.contiguous(), live_A.contiguous(), rows_A.contiguous(), tokens_BN,
            cos_NK2.contiguous(), sin_NK2.contiguous(), *outs[:4], outs[4], A, K2,
            tokens_BN.stride(0), trash, BA=ROWS, BK=max(2, pow2(K2)), num_warps=1,
        )  # fmt: skip
    return outs


@decode_inputs.register_fake
def _fake(n_A, live_A, rows_A, tokens_BN, cos_NK2, sin_NK2, trash):  # type: ignore[no-untyped-def]
    A, K2 = n_A.shape[0], cos_NK2.shape[1]
    positions = n_A.new_empty((A, 1), dtype=torch.long)
    angles = [cos_NK2.new_empty((A, 1, K2)) for _ in range(2)]
    valid = torch.empty_like(positions, dtype=torch.bool)
    return positions, valid, *angles, torch.empty_like(positions)
