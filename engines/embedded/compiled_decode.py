"""The engine's compiled decode step (the CUDA default): torch.compile over the model's forward, traced once.

A decode step's row count changes every few steps as rows join and finish, so the step is compiled with dynamic
shapes. Left to that alone, dynamo compiled the demo's decode three times, each an inductor compile before the next
token: at the first call the cache's rows and the batch's were equal (200), so duck sizing tied them and the first
larger cache recompiled; then the batch's last row alone (size 1) recompiled. `kernels.device.dynamic_compile`
traces it once, the rows of the fed tokens, the mask and the positions unbacked (tests/test_decode_batch.py counts
the graphs on the CPU).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels.device import dynamic_compile

# The decode call's tensors with a row dimension (first): the fed tokens [B, 1], the mask [B, L + 1], positions [B, 1]
ROW_INPUTS = ("input_ids", "attention_mask", "position_ids")


def compiled_decode(model: torch.nn.Module, backend: str | Callable = "inductor") -> Callable:
    """A function with the decode call's signature (keyword arguments, as DecodeBatch calls it): the model's
    forward compiled once for every row count, cache capacity and length."""
    return dynamic_compile(model.forward, backend=backend, unbacked=ROW_INPUTS, what="the engine's compiled decode")
