"""The project's tiny model preset and its own tokenizer, shared by the trainer and the engines.

The tokenizer is built in code, so nothing is downloaded at run time. It is a byte-level BPE with no merges: one
token per byte, so one token per character of the ASCII alphabet the built-in tasks use (digits, letters,
arithmetic symbols, punctuation, space, newline), and any other text still encodes (as its UTF-8 bytes) and
decodes back exactly. Those characters keep the low ids (after the special tokens of a Qwen-style chat template),
so a tiny model learns arithmetic quickly. It is a `transformers.Qwen2Tokenizer`: the class transformers'
`AutoTokenizer` picks for any qwen2 folder (and rebuilds the pipeline of, from the vocabulary), so the folders the
project writes load exactly in stock transformers, for qwen2 and llama configs alike (`tokenizer_config.json`
names the class). `tiny_model_config` builds a small random-initialisable Llama/Qwen2 config whose special ids
match that tokenizer.
"""

from __future__ import annotations

import string

from transformers import LlamaConfig, PretrainedConfig, PreTrainedTokenizerBase, Qwen2Config, Qwen2Tokenizer

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK, IM_START, IM_END)
CHARS = string.digits + string.ascii_lowercase + string.ascii_uppercase + " \n+-*/=()<>.,:;!?'\"_#%&[]{}|^~@$\\`"
TINY_VOCAB = 288  # >= len(build_tokenizer()) (6 specials + 256 bytes), a multiple of 32

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


def byte_symbols() -> dict[int, str]:
    """Byte -> the printable character byte-level BPE vocabularies spell it with (GPT-2's convention, which the
    byte-level pre-tokenizer and decoder of `tokenizers` use): printable Latin-1 bytes stand for themselves, the
    others (controls, space, ...) are shifted to 256 + k in byte order (space -> "Ġ", newline -> "Ċ")."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)}
    out, shifted = {}, 0
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + shifted)
            shifted += 1
    return out


def build_tokenizer() -> PreTrainedTokenizerBase:
    """A fresh tokenizer; ids: specials first (pad=0, bos=1, eos=2, unk=3, im_start=4, im_end=5), then CHARS in
    order (one id each), then the remaining bytes."""
    sym = byte_symbols()
    chars = tuple(sym[ord(c)] for c in CHARS)
    rest = tuple(s for s in sym.values() if s not in chars)
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + chars + rest)}
    # No merges: every byte is its own token, whatever the pre-tokenizer's splits.
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK,
                         additional_special_tokens=[IM_START, IM_END], clean_up_tokenization_spaces=False)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_model_config(arch: str = "llama", *, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                      num_kv_heads: int = 2, intermediate_size: int | None = None, vocab_size: int = TINY_VOCAB,
                      max_position_embeddings: int = 512, tie_word_embeddings: bool = False) -> PretrainedConfig:
    """A small random-initialisable config with the project tokenizer's special ids (pad 0, bos 1, eos 2)."""
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"arch={arch!r}: tiny presets exist for 'llama' and 'qwen2'")
    n_tok = len(SPECIAL_TOKENS) + 256
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
