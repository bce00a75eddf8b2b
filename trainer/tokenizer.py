"""The project's own tokenizer: character level, built in code, so nothing is downloaded at run time.

One token per character (digits, letters, arithmetic symbols, punctuation, space, newline) plus the special
tokens of a Qwen-style chat template. Small (~100 ids) so a tiny model learns arithmetic quickly, and a real
`transformers.PreTrainedTokenizerFast`, so engines, SFT and the chat template use the ordinary HF API and
`save_pretrained` writes a folder any HF loader reads.
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK, IM_START, IM_END)
CHARS = string.digits + string.ascii_lowercase + string.ascii_uppercase + " \n+-*/=()<>.,:;!?'\"_#%&[]{}|^~@$\\`"

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
