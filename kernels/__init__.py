"""Fused Triton kernels for RL post-training, with torch paths and float64-checkable references."""

from kernels.advantages import grpo_advantages, reinforce_advantages, rloo_advantages
from kernels.device import backend_for, use_backend
from kernels.linear_logprobs import linear_token_logprobs
from kernels.linear_policy_loss import linear_policy_loss
from kernels.logprobs import token_logprobs
from kernels.objective import LossInputs, PolicyLossConfig, raise_on_input_errors
from kernels.packing import (
    PackedBatch,
    broadcast_to_tokens,
    cu_seqlens_from_lengths,
    pack,
    pack_batch,
    packed_layout,
    shift_left,
    unpack,
)
from kernels.policy_loss import policy_loss
from kernels.scale import masked_scale

__all__ = [
    "PackedBatch", "pack", "unpack", "pack_batch", "packed_layout", "cu_seqlens_from_lengths",
    "broadcast_to_tokens", "shift_left",
    "backend_for", "use_backend", "masked_scale", "token_logprobs", "linear_token_logprobs",
    "LossInputs", "PolicyLossConfig", "policy_loss", "linear_policy_loss", "raise_on_input_errors", "grpo_advantages",
    "rloo_advantages", "reinforce_advantages"]
