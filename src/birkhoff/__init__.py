"""birkhoff: a compact RL post-training stack for mHC + MTP transformers."""

from birkhoff.config import ModelConfig

__all__ = ["ModelConfig"]
__version__ = "0.1.0"
