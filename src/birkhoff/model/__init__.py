"""The mHC + MTP transformer: hyper-connections, layers, MTP depths, the model."""

from birkhoff.model.hyper import HyperConnection, mhc_coefficients, sinkhorn
from birkhoff.model.logprobs import HeadScores, token_logprobs
from birkhoff.model.mtp import MTPDepth, masked_token_ce, shift_targets
from birkhoff.model.transformer import DecoderOutput, Transformer, TransformerOutput

__all__ = [
    "DecoderOutput",
    "HeadScores",
    "HyperConnection",
    "MTPDepth",
    "Transformer",
    "TransformerOutput",
    "masked_token_ce",
    "mhc_coefficients",
    "shift_targets",
    "sinkhorn",
    "token_logprobs",
]
