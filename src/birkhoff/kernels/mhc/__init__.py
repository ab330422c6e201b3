"""Fused mHC ops: coefficients (RMS + projection + Sinkhorn), stream mixes, the mixes folded
into the neighbouring GEMMs, the engine's entry and exit, and their launch parameters.

The training ops mirror the eager functions of `birkhoff.model.hyper` (same arguments, same
outputs) and carry their autograd; the engine's ops (`hyper_entry`, `post_res`, `mix_out_proj`,
`contract_norm`) are forward-only. Each module holds its Triton kernels, their launches and the
custom ops around them.
"""

from birkhoff.kernels.mhc.coefficients import (
    coefficients_and_mix_in,
    coefficients_and_mix_in_streams,
    contract,
    contraction_weights,
    mhc_coefficients,
)
from birkhoff.kernels.mhc.configs import CONFIG
from birkhoff.kernels.mhc.entry import contract_norm, hyper_entry, mix_out_proj, post_res
from birkhoff.kernels.mhc.mix_norm_linear import fold_entry, mix_norm, mix_norm_linear
from birkhoff.kernels.mhc.mixes import mix_in, mix_out
from birkhoff.kernels.mhc.phi import served_phi

__all__ = [
    "CONFIG",
    "coefficients_and_mix_in",
    "coefficients_and_mix_in_streams",
    "contract",
    "contract_norm",
    "contraction_weights",
    "fold_entry",
    "hyper_entry",
    "mhc_coefficients",
    "mix_in",
    "mix_norm",
    "mix_norm_linear",
    "mix_out",
    "mix_out_proj",
    "post_res",
    "served_phi",
]
