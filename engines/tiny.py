"""The project's tiny model preset and its own tokenizer, shared by the trainer and the engines.

The tokenizer is character level and built in code, so nothing is downloaded at run time: one token per character
(digits, letters, arithmetic symbols, punctuation, space, newline) plus the special tokens of a Qwen-style chat
template. Small (~100 ids) so a tiny model learns arithmetic quickly, and a real
`transformers.PreTrainedTokenizerFast`, so engines, SFT and the chat template use the ordinary HF API and
`save_pretrained` writes a folder any HF loader reads. `tiny_model_config` builds a small random-initialisable
Llama/Qwen2 config whose special ids match that tokenizer.
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, PretrainedConfig, PreTrainedTokenizerFast, Qwen2Config

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK, IM_START, IM_END)
CHARS = string.digits + string.ascii_lowercase + string.ascii_uppercase + " \n+-*/=()<>.,:;!?'\"_#%&[]{}|^~@$\\`"
TINY_VOCAB = 128  # >= len(build_tokenizer()), a multiple of 32

# Qwen-style template. `{% generation %}` marks assistant spans so transformers can return the assistant mask.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}"
    "{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A fresh character-level tokenizer; ids: specials first (pad=0, bos=1, eos=2, unk=3, im_start=4, im_end=5)."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + tuple(CHARS))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Every character is its own pre-token; [\s\S] also matches the newline.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        additional_special_tokens=[IM_START, IM_END],
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_model_config(arch: str = "llama", *, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                      num_kv_heads: int = 2, intermediate_size: int | None = None, vocab_size: int = TINY_VOCAB,
                      max_position_embeddings: int = 512, tie_word_embeddings: bool = False) -> PretrainedConfig:
    """A small random-initialisable config with the project tokenizer's special ids (pad 0, bos 1, eos 2)."""
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"arch={arch!r}: tiny presets exist for 'llama' and 'qwen2'")
    n_tok = len(SPECIAL_TOKENS) + len(CHARS)
    if vocab_size < n_tok:
        raise ValueError(f"vocab_size={vocab_size} is smaller than the project tokenizer ({n_tok} ids)")
    cls = LlamaConfig if arch == "llama" else Qwen2Config
    return cls(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=SPECIAL_TOKENS.index(PAD),
        bos_token_id=SPECIAL_TOKENS.index(BOS),
        eos_token_id=SPECIAL_TOKENS.index(EOS),
        rms_norm_eps=1e-6,
    )
