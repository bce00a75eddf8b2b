"""Fused Triton kernels for RL post-training, with torch paths and float64-checkable references."""

from kernels.device import backend_for, use_backend
from kernels.logprobs import token_logprobs
from kernels.scale import masked_scale

__all__ = ["backend_for", "use_backend", "masked_scale", "token_logprobs"]
