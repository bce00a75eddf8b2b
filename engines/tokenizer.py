"""Load a model folder's tokenizer as the folder wrote it.

`AutoTokenizer.from_pretrained` picks the tokenizer class from the model type (transformers 5 does so even when
`tokenizer_config.json` names another class, for model types it lists as having wrong hub classes, qwen2 among them),
and a model-specific class may rebuild the pre-tokenizer instead of reading the one in `tokenizer.json`. For a
folder whose `tokenizer.json` is not that model's stock pipeline (a character-level WordLevel tokenizer in a
Qwen2 folder: transformers 5.24's `Qwen2Tokenizer` silently drops every newline) the trainer would then encode
prompts unlike the tokenizer that wrote the folder, and unlike any other reader of `tokenizer.json`. So:
`tokenizer.json` is the truth; when the class AutoTokenizer chose encodes a probe text differently from it, the
generic fast tokenizer (which runs `tokenizer.json` as written, with the folder's special tokens and chat template)
is used instead. Stock folders (a real Qwen2 or Llama-3 tokenizer, the project's own tiny tokenizer, which is a
`Qwen2Tokenizer`) keep their class.
"""

from __future__ import annotations

import os
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

# Newlines, tabs, runs of spaces, digits, punctuation, mixed case and a word a BPE would merge: the places where
# pre-tokenizers differ.
PROBE = "Hello, World!\n  12+30=42\t#### 7\n\nx_y (a-b)/c 'quote' \"q\" 3.5e-2 Ünïcode"


def _probe_ids(tok: PreTrainedTokenizerBase) -> list[int]:
    return tok(PROBE, add_special_tokens=False)["input_ids"]


def load_tokenizer(folder: str | os.PathLike) -> PreTrainedTokenizerBase:
    """The tokenizer of a Hugging Face folder, encoding exactly as its `tokenizer.json` (module docstring)."""
    from tokenizers import Tokenizer

    folder = Path(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    file = folder / "tokenizer.json"
    if not file.is_file():
        return tok
    want = Tokenizer.from_file(str(file)).encode(PROBE, add_special_tokens=False).ids
    if _probe_ids(tok) == want:
        return tok
    generic = PreTrainedTokenizerFast.from_pretrained(folder)
    if _probe_ids(generic) != want:
        raise ValueError(f"{folder}: neither {type(tok).__name__} nor the generic fast tokenizer encodes like its "
                         f"tokenizer.json; re-save the tokenizer with save_pretrained")
    return generic
