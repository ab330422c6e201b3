"""Inference engine: inference-layout weights, static KV cache, sampling, MTP speculation."""

from birkhoff.engine.decode import Completion
from birkhoff.engine.engine import Engine
from birkhoff.engine.sampling import SamplingParams
from birkhoff.engine.speculative import SpecStats
from birkhoff.engine.weights import TensorSpec

__all__ = ["Completion", "Engine", "SamplingParams", "SpecStats", "TensorSpec"]
