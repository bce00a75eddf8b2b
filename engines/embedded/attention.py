"""The engine's attention: transformers' sdpa, except a decode step, which never copies the keys and values per query
head.

A decode step feeds one token a row against the row's cached keys, under the padding mask of the left-aligned cache
(engines/embedded/kv_cache.py). transformers' sdpa path copies each KV head per query head first whenever a mask is
given (repeat_kv: it uses SDPA's GQA only without one), except a decode step outside torch.compile since its pack_gqa
(5.2x; the GPU machine's 5.17 has none). The CUDA engine's decode is compiled by default, so there every step read
the whole cache once, wrote it n_rep = H / Hkv times and read that again: 15x the cache's bytes a step for
Qwen2.5-0.5B (14 query heads over 2 KV heads), and a CUDA graph's memory pool held one layer's copy
(engines/embedded/graphs.py). Here:

- on the CPU in float32/64: scores = q k^T, masked, softmaxed and times v as two matmuls. transformers' sdpa path
  costs the CPU's SDPA 0.67 / 0.90 / 1.13 ms a call at L = 60 / 125 / 250 for 128 rows (4 query heads over 2 KV
  heads, head dim 32, the cache's strided views); the matmuls 0.27 / 0.39 / 0.69 ms (max difference 8e-7). A decode
  step of the demo's model calls it twice (two layers), ~20 % of the step. A speculative step (engines/embedded/
  drafts.py) feeds a few tokens a row (its last token and its draft, causal among themselves) and runs the same
  way, the query tokens of a KV head's query heads stacked;
- elsewhere (CUDA, half precision), compiled or not: SDPA over the queries folded as [B, Hkv, n_rep, D], the n_rep
  query heads of a KV head as its n_rep query rows (one token a row, so the [B, 1, 1, L] mask broadcasts over them
  unchanged): each KV head read once. Bit for bit transformers' own pack_gqa path; as close to float64 as its
  repeat_kv path (tests/test_engine_attention.py). bench/bench_decode_attention.py: bf16 on the CPU, 64 rows x 512
  columns, 1.8 ms against 52 ms for the repeat_kv path. A speculative step the same way, its q tokens a query
  head's rows and the mask repeated over the n_rep heads;
- prefill (more tokens a row) on the CPU in float32/64: torch's SDPA with enable_gqa (the same flash kernel as
  transformers' path on the same numbers, without the copy). Prefill on other devices and any call this does not
  recognise go to transformers' sdpa unchanged (on CUDA its repeat_kv keeps SDPA's memory-efficient kernel:
  enable_gqa with a mask would take the math kernel, O(L^2) float32 scores).

`use_engine_attention(model)` switches a loaded model from "sdpa" to ENGINE_SDPA (engines/embedded/presets.py does it
for every model the engine serves); the mask function stays sdpa's.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from engines.embedded.drafts import MAX_SPECULATIVE_TOKENS

ENGINE_SDPA = "engine_sdpa"
_OTHER_TERMS = ("softcap", "position_bias", "s_aux")  # attention terms the matmul path does not apply
# Half-precision inputs keep SDPA, which accumulates in float32; the matmuls would round the scores to bf16/fp16.
_FULL_PRECISION = (torch.float32, torch.float64)
# The most query tokens a row the matmul path takes: a decode step (1) or a speculative one (1 + its drafts); a
# prefill of more tokens is SDPA's (its flash kernel skips the masked blocks of a long causal mask).
MAX_QUERY_TOKENS = 1 + MAX_SPECULATIVE_TOKENS


def engine_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function: query [B, H, q, D], key [B, Hkv, L, D], value [B, Hkv, L, Dv] ->
    ([B, q, H, Dv], None).

    The cases it takes (a bool mask [B, 1, q, L], no dropout or extra terms, H a multiple of Hkv): a decode step
    (q = 1) or a speculative one (q <= MAX_QUERY_TOKENS) anywhere; on the CPU in float32/64 also a prefill.
    Query head h reads KV head h // (H / Hkv) (transformers' repeat_kv order). The matmul path's masked scores are
    the dtype's min, not -inf, so a row with every key masked gets finite (unused) outputs instead of NaN."""
    b, h, q_len, d = query.shape
    hkv, n_keys, dv = key.shape[1], key.shape[2], value.shape[-1]  # dv: the values' head dim (MLA: != d)
    plain = (attention_mask is None or attention_mask.dtype != torch.bool
             or attention_mask.shape != (b, 1, q_len, n_keys)
             or dropout != 0.0 or h % hkv or any(kwargs.get(k) is not None for k in _OTHER_TERMS))
    matmuls = query.device.type == "cpu" and query.dtype in _FULL_PRECISION
    if plain or not (matmuls or q_len <= MAX_QUERY_TOKENS):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    scale = d ** -0.5 if scaling is None else scaling
    n_rep = h // hkv
    if not matmuls:  # a decode step on CUDA or in half precision: SDPA on the folded queries [B, Hkv, n_rep * q, D]
        # (for one token a row a view of q_proj's output) under the mask [B, 1, 1, L], which broadcasts over the
        # n_rep rows; a speculative step's [B, 1, q, L] is repeated for them ([B, 1, n_rep * q, L] bools: small
        # beside the keys and values transformers would copy)
        mask = attention_mask if q_len == 1 else attention_mask[:, :, None].expand(
            b, 1, n_rep, q_len, n_keys).reshape(b, 1, n_rep * q_len, n_keys)
        out = torch.nn.functional.scaled_dot_product_attention(query.reshape(b, hkv, n_rep * q_len, d), key, value,
                                                               attn_mask=mask, scale=scale)
        # row r * q + t of KV head kv is query head kv * n_rep + r's token t
        return out.reshape(b, h, q_len, dv).transpose(1, 2), None
    if q_len > MAX_QUERY_TOKENS:  # a prefill: SDPA reading each KV head for its query heads (enable_gqa), where
        # transformers' path copies the keys and values per query head first (repeat_kv: it uses GQA only without a
        # mask); the same flash kernel on the same numbers, equal bit for bit, 5-30 % faster at an agent's turn-2
        # prefills (16-64 rows x 25 queries x 135 keys)
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                               scale=scale, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    # [B, Hkv, n_rep * q, D]: the query heads of each KV head, each with its q tokens (head-major)
    q = query.reshape(b, hkv, n_rep * q_len, d)
    scores = torch.matmul(q, key.transpose(-1, -2)) * scale  # [B, Hkv, n_rep * q, L]
    if q_len == 1:
        scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)  # [B, 1, 1, L] broadcasts
    else:  # the mask [B, 1, q, L] broadcast over the n_rep heads of a KV head
        scores = scores.view(b, hkv, n_rep, q_len, n_keys).masked_fill(
            ~attention_mask[:, :, None], torch.finfo(scores.dtype).min).view(b, hkv, n_rep * q_len, n_keys)
    out = torch.matmul(torch.softmax(scores, dim=-1), value)  # [B, Hkv, n_rep * q, Dv]
    return out.view(b, h, q_len, dv).transpose(1, 2), None


def use_engine_attention(model: torch.nn.Module) -> None:
    """Serve `model` with engine_attention where it would run transformers' sdpa; others unchanged."""
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "_attn_implementation", None) == "sdpa":
        model.set_attn_implementation(ENGINE_SDPA)


AttentionInterface.register(ENGINE_SDPA, engine_attention)
AttentionMaskInterface.register(ENGINE_SDPA, sdpa_mask)
