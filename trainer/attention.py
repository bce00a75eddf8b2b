"""Packing-correct attention for Hugging Face causal LMs: a packed row's forward equals each sequence's own.

Why position_ids are not enough: with SDPA or eager attention, transformers only infers sequence boundaries from
position_ids when no attention_mask is passed and no cache is used (masking_utils.find_packed_sequence_indices);
pass a 2D mask, a cache, or compile the call and the row gets one plain causal mask, so tokens attend across
sequences (the issue measured a max logit error of 0.15 on transformers 5.23). So every path here states the
document structure explicitly:

    attn implementation   what we pass                                            where
    sdpa                  4D bool mask [1, 1, N, N], True = attend                CPU default
    eager                 4D additive float mask [1, 1, N, N] (0 / dtype min)    debugging
    flash_attention_2/3   cu_seq_lens_q/k + max_length_q/k (varlen kernel)        CUDA when flash-attn is installed
    flex_attention        BlockMask with a document-causal mask_mod               CUDA otherwise

transformers returns a 4D tensor or BlockMask mask as-is (masking_utils._preprocess_mask_arguments), so the same
mask reaches every layer; the flash kwargs travel through **kwargs down to the attention function.

Mask semantics (all paths): query i attends key j iff j <= i and seq_index[i] == seq_index[j]. The padding tail
(seq_index -1) is one more causal block, so no softmax row is empty (an all-masked SDPA row is NaN, and NaN
times a zero loss mask is still NaN in the backward).
"""

from __future__ import annotations

import importlib.util

import torch

from kernels.packing import PackedBatch

_FLASH = ("flash_attention_2", "flash_attention_3")


def flash_attn_available() -> bool:
    """flash-attn importable (checked lazily, never imported here)."""
    return importlib.util.find_spec("flash_attn") is not None


def default_attn_implementation(device: torch.device | str) -> str:
    """The attn_implementation to load a model with for packed training on `device`."""
    if torch.device(device).type == "cuda":
        return "flash_attention_2" if flash_attn_available() else "flex_attention"
    return "sdpa"


def block_causal_mask(seq_index: torch.Tensor, dtype: torch.dtype = torch.bool) -> torch.Tensor:
    """[N] sequence ids -> [1, 1, N, N] document-causal mask: bool (True = attend) or additive float (0 / min).

    Dense: N^2 elements (64 MiB as bool at N = 8192); fine for the CPU path, which is what uses it.
    """
    n = seq_index.shape[0]
    i = torch.arange(n, device=seq_index.device)
    allowed = (seq_index[:, None] == seq_index[None, :]) & (i[None, :] <= i[:, None])
    if dtype == torch.bool:
        return allowed[None, None]
    zero = torch.zeros((), dtype=dtype, device=seq_index.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)[None, None]


def flex_block_mask(seq_index: torch.Tensor):
    """BlockMask for FlexAttention: document-causal over `seq_index` [N]; fully masked tiles are skipped."""
    from torch.nn.attention.flex_attention import create_block_mask

    def document_causal(b, h, q_idx, kv_idx):
        return (seq_index[q_idx] == seq_index[kv_idx]) & (kv_idx <= q_idx)

    n = seq_index.shape[0]
    return create_block_mask(document_causal, B=None, H=None, Q_LEN=n, KV_LEN=n, device=seq_index.device)


def _attn_implementation(model) -> str:
    config = getattr(model, "config", model)
    impl = getattr(config, "_attn_implementation", None) or "eager"
    return impl


def _model_dtype(model) -> torch.dtype:
    dtype = getattr(model, "dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype
    return next(model.parameters()).dtype


def packed_attention_kwargs(model, batch: PackedBatch) -> dict:
    """Keyword arguments for `model(**kw)` or its backbone on one packed row (batch dimension 1).

    Returns input_ids [1, N], position_ids [1, N], use_cache False, and the attention inputs the model's
    attn_implementation needs (see the module docstring).
    """
    impl = _attn_implementation(model)
    ids = batch.input_ids[None]
    kw: dict = {"input_ids": ids, "position_ids": batch.position_ids[None], "use_cache": False}
    if impl == "sdpa":
        kw["attention_mask"] = block_causal_mask(batch.seq_index, torch.bool)
    elif impl == "eager":
        kw["attention_mask"] = block_causal_mask(batch.seq_index, _model_dtype(model))
    elif impl in _FLASH:
        # Varlen segments: the real sequences, then the padding tail as one more segment (so every row of the
        # packed tensor belongs to some segment and the output shape stays [1, N, H]).
        cu = batch.cu_seqlens
        seg = list(batch.lengths)
        tail = batch.padded_len - batch.num_tokens
        if tail:
            cu = torch.cat([cu, torch.tensor([batch.padded_len], dtype=cu.dtype, device=cu.device)])
            seg.append(tail)
        max_len = max(seg) if seg else 0
        kw.update(attention_mask=None, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max_len,
                  max_length_k=max_len)
    elif impl == "flex_attention":
        kw["attention_mask"] = flex_block_mask(batch.seq_index)
    else:
        raise ValueError(
            f"attn_implementation={impl!r} has no packed path; load the model with one of "
            f"'sdpa', 'eager', 'flex_attention', {', '.join(repr(x) for x in _FLASH)} "
            "(trainer.attention.default_attn_implementation picks one per device)"
        )
    return kw


def backbone(model):
    """The decoder without its LM head (model.model for Llama/Qwen2); the model itself if it has no head."""
    prefix = getattr(model, "base_model_prefix", "model")
    inner = getattr(model, prefix, None)
    return inner if isinstance(inner, torch.nn.Module) else model


def packed_hidden_states(model, batch: PackedBatch) -> torch.Tensor:
    """[N, H] final hidden states (after the last norm) of one packed row; no logits are built.

    Feed them with the LM head weight to the fused log-prob / policy-loss kernels; hidden state i predicts token
    i + 1 of the same sequence (kernels.packing.shift_left builds those targets).
    """
    if batch.input_ids.dim() != 1:
        raise ValueError(f"batch.input_ids must be [N] (one packed row), got {tuple(batch.input_ids.shape)}")
    out = backbone(model)(**packed_attention_kwargs(model, batch))
    return out.last_hidden_state[0]


def packed_logits(model, batch: PackedBatch) -> torch.Tensor:
    """[N, V] logits of a packed row (tests and debugging; training uses packed_hidden_states + a fused head)."""
    return model.get_output_embeddings()(packed_hidden_states(model, batch))
