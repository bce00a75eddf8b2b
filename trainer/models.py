"""Model construction: tiny presets for tests and the demo (the trainer issue extends this module)."""

from __future__ import annotations

from transformers import LlamaConfig, PretrainedConfig, Qwen2Config

from trainer.tokenizer import SPECIAL_TOKENS, build_tokenizer

TINY_VOCAB = 128  # >= len(build_tokenizer()), a multiple of 32


def tiny_model_config(arch: str = "llama", *, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                      num_kv_heads: int = 2, intermediate_size: int | None = None, vocab_size: int = TINY_VOCAB,
                      max_position_embeddings: int = 512, tie_word_embeddings: bool = False) -> PretrainedConfig:
    """A small random-initialisable config with the project tokenizer's special ids (pad 0, bos 1, eos 2)."""
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"arch={arch!r}: tiny presets exist for 'llama' and 'qwen2'")
    n_tok = len(build_tokenizer())
    if vocab_size < n_tok:
        raise ValueError(f"vocab_size={vocab_size} is smaller than the project tokenizer ({n_tok} ids)")
    cls = LlamaConfig if arch == "llama" else Qwen2Config
    ids = {name: SPECIAL_TOKENS.index(tok) for name, tok in (("pad", "<pad>"), ("bos", "<bos>"), ("eos", "<eos>"))}
    return cls(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=ids["pad"],
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        rms_norm_eps=1e-6,
    )
