"""Inference engine: its own weight layout and fp8 format, KV cache, sampling, MTP speculation."""

from birkhoff.engine.decode import Completion
from birkhoff.engine.engine import Engine
from birkhoff.engine.layout import TensorSpec
from birkhoff.engine.sampling import SamplingParams
from birkhoff.engine.speculative import SpecStats

__all__ = ["Completion", "Engine", "SamplingParams", "SpecStats", "TensorSpec"]
