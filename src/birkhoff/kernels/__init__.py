"""Fused GPU ops (Triton) with their eager references and autograd wrappers."""
