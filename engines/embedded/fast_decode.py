"""A decode step of a Llama-family model (qwen2, llama) on the CPU without transformers' per-call machinery.

A decode step feeds one token a row. At the batch sizes an agent step decodes with (~32 cache rows of a small model),
transformers' forward spends ~0.45 of ~2 ms a step outside the model's arithmetic: the mask functions (a 4D mask
built from the 2D one), the output-capturing and deprecation wrappers, the attention-interface lookup, the decoder
layers' checkpointing wrapper. `plain_decode(model)` returns a function with the decode call's signature that runs
the same modules in the same order on the same tensors: the model's own embedding, norms, projections, MLPs and
rotary module, the engine's attention (engines/embedded/attention.py: the matmul path every CPU decode already
takes) over the engine's KV cache. Its logits equal the forward's bit for bit (tests/test_fast_decode.py), so
engine log-probs do not move.

Per layer, for hidden h [B, 1, H] (one token a row):
    x = input_layernorm(h);  q, k, v = q/k/v_proj(x) as [B, heads, 1, D];  q, k = rope(q, k; cos, sin)
    K, V = cache.update(k, v)                         (the filled columns [B, Hkv, L + 1, D])
    h = h + o_proj(attention(q, K, V; mask [B, 1, 1, L + 1]));  h = h + mlp(post_attention_layernorm(h))
then logits = lm_head(norm(h)) [B, 1, V].

Only where it is exact: float32/float64 weights on the CPU, model_type qwen2 or llama, the model attending through
the engine's attention (use_engine_attention), every layer full attention (no sliding window). Elsewhere
`plain_decode` returns None and the engine keeps the model's forward (or its compiled form on CUDA).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from engines.embedded.attention import ENGINE_SDPA, engine_attention

SUPPORTED_MODEL_TYPES = ("qwen2", "llama")


def _signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [..., D]: sin with its first half negated, so that rope(x) = x * cos + x.roll(D / 2) * it.
    transformers' rope is x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1); x.roll(D / 2) = cat(x2, x1)
    times cat(-sin1, sin2) gives each element the same product (only the sign moves from one factor to the other,
    which is exact), so the result is equal bit for bit, in one roll instead of two slices, a negation and a cat."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def supports_plain_decode(model: torch.nn.Module) -> bool:
    """Whether `plain_decode` computes this model's decode step exactly (see the module docstring)."""
    config = getattr(model, "config", None)
    base = getattr(model, "model", None)
    if config is None or base is None or getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return False
    param = next(model.parameters())
    if param.device.type != "cpu" or param.dtype not in (torch.float32, torch.float64):
        return False
    if any(t != "full_attention" for t in (getattr(config, "layer_types", None) or ())):
        return False
    # The forward attends through engine_attention (use_engine_attention switched it): the same function here.
    if getattr(config, "_attn_implementation", None) != ENGINE_SDPA:
        return False
    if getattr(config, "pretraining_tp", 1) != 1 or not hasattr(base, "rotary_emb"):
        return False
    return all(hasattr(layer, "self_attn") and hasattr(layer.self_attn, "q_proj") and
               getattr(layer.self_attn, "sliding_window", None) is None for layer in base.layers)


def plain_decode(model: torch.nn.Module) -> Callable | None:
    """The decode call `fn(input_ids=[B, 1], attention_mask=[B, L + 1] bool, position_ids=[B, 1],
    past_key_values=KVCache, use_cache=True) -> CausalLMOutputWithPast(logits=[B, 1, V])` for `model`, or None
    where it would not be exact (then decode with the model's forward)."""
    if not supports_plain_decode(model):
        return None
    base = model.model

    def decode(*, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
               past_key_values, use_cache: bool = True) -> CausalLMOutputWithPast:
        b, q_len = input_ids.shape
        assert q_len == 1 and attention_mask.dtype == torch.bool, (input_ids.shape, attention_mask.dtype)
        mask = attention_mask[:, None, None, :]  # [B, 1, 1, L + 1]: what sdpa's mask function makes of it
        h = base.embed_tokens(input_ids)  # [B, 1, H]
        cos, sin = base.rotary_emb(h, position_ids)  # [B, 1, D] each, the forward's own
        cos, sin = cos[:, None], _signed_sin(sin)[:, None]  # [B, 1, 1, D]: broadcast over heads
        half = cos.shape[-1] // 2
        for layer in base.layers:
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            shape = (b, q_len, -1, attn.head_dim)
            q = attn.q_proj(x).view(shape).transpose(1, 2)  # [B, heads, 1, D]
            k = attn.k_proj(x).view(shape).transpose(1, 2)  # [B, kv heads, 1, D]
            v = attn.v_proj(x).view(shape).transpose(1, 2)
            q = q * cos + q.roll(half, -1) * sin
            k = k * cos + k.roll(half, -1) * sin
            keys, values = past_key_values.update(k, v, attn.layer_idx)
            out, _ = engine_attention(attn, q, keys, values, mask, scaling=attn.scaling)  # [B, 1, heads, D]
            h = h + attn.o_proj(out.reshape(b, q_len, -1).contiguous())
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return CausalLMOutputWithPast(logits=model.lm_head(base.norm(h)))

    return decode
