"""FlexAttention over the trainer's packed rows, compiled once for every row length (the CUDA default attention
without flash-attn: trainer.backend.attention.choose_attn_implementation).

transformers' flex_attention_forward calls torch.compile(flex_attention): static at its first call, recompiled with
dynamic shapes at the first change of shape. A packed row's length changes nearly every step (it is bucketed), so
every (grad mode, mask_mod) the trainer runs compiled at least twice: in the demo the SFT steps' document mask with
gradients, the RL steps' tree mask without (the KL reference) and with them. And at the dynamic compile the row's
block count could stay tied to an equal size (the KV heads: duck sizing) and recompile once more when it changed
(tests/test_flex_compile.py: three graphs where one does). Each is an inductor compile of FlexAttention's Triton
templates, seconds on a cold CUDA machine (the backward's the slowest).

`packed_flex_attention` is registered over transformers' "flex_attention". With a BlockMask and nothing that changes
the scores (no softcap, attention sinks, position bias or dropout: the Llama-family models trained here), it runs
the computation transformers' function runs (flex_attention with the BlockMask, GQA on the key/value heads when the
query heads are a power of two, else repeated as transformers repeats them; the scale; the output as [B, N, H, D])
through kernels.device.dynamic_compile: one compile per (grad mode, mask_mod). Inside compiled blocks
([trainer] compile) dynamo traces flex_attention itself, as before. Every other call is transformers' own.
Not returned: the log-sum-exp transformers asks flex for on CUDA (its attention weights; no caller here reads them).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import AttentionInterface
from transformers.integrations.flex_attention import flex_attention_forward

from kernels.device import dynamic_compile

# The compiler of the packed calls (tests on the CPU use "aot_eager": the CPU has no FlexAttention backward, and its
# inductor template does not build with dynamic shapes in torch 2.13)
BACKEND = "inductor"
_SCORE_KWARGS = ("softcap", "s_aux", "position_bias")
_compiled: dict = {}  # backend -> flex_attention through dynamic_compile
# The attribute that marks a BlockMask built for one packed row (trainer.backend.attention: seq_lengths = the row's)
PACKED_ROW = "packed_row"


def compiled_flex_attention(backend: str | Callable | None = None) -> Callable:
    """flex_attention compiled once for every size (kernels.device.dynamic_compile), one per backend."""
    backend = BACKEND if backend is None else backend
    if backend not in _compiled:
        _compiled[backend] = dynamic_compile(flex_attention, backend=backend)
    return _compiled[backend]


def packed_flex_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask, scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function for "flex_attention": query [B, H, N, D], key/value [B, Hkv, N, D], a
    BlockMask -> ([B, N, H, D], None) (module docstring). Other calls go to transformers' flex_attention_forward."""
    modifies_scores = kwargs.get("dropout", 0.0) or any(kwargs.get(k) is not None for k in _SCORE_KWARGS)
    if not isinstance(attention_mask, BlockMask) or modifies_scores:
        return flex_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    heads = query.shape[1]
    gqa = (heads & (heads - 1)) == 0  # as transformers: flex's GQA for a power-of-two query head count only
    if not gqa and heads != key.shape[1]:  # each KV head repeated for its query heads (transformers' order)
        key, value = key.repeat_interleave(heads // key.shape[1], 1), value.repeat_interleave(heads // key.shape[1], 1)
    if not torch.compiler.is_compiling():
        attend = compiled_flex_attention()
    else:  # inside compiled blocks (trainer.backend.parallel.compile_blocks): dynamo traces flex_attention itself
        attend = flex_attention
        if getattr(attention_mask, PACKED_ROW, False):
            # A packed row's own mask: its seq_lengths are the row's length as plain ints, which dynamo would guard
            # on (flex_attention compares them with the query's), tracing the row length as a constant. They become
            # the query's and key's sizes: the same numbers, but dynamic.
            attention_mask.seq_lengths = (query.shape[-2], key.shape[-2])
    out = attend(query, key, value, block_mask=attention_mask, enable_gqa=gqa, scale=scaling,
                 kernel_options=kwargs.get("kernel_options"))
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register("flex_attention", packed_flex_attention)
