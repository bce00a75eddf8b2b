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


# The files that hold a vocabulary, one set per kind of tokenizer: the fast tokenizer's, then the slow BPE,
# SentencePiece and WordPiece ones. Without any, transformers still builds a tokenizer from tokenizer_config.json
# alone: its special tokens and nothing else, so every text encodes to no tokens at all.
VOCAB_FILES = (("tokenizer.json",), ("vocab.json", "merges.txt"), ("tokenizer.model",), ("vocab.txt",))


def missing_tokenizer_files(folder: str | os.PathLike) -> list[str]:
    """The files a model folder lacks to hold a usable tokenizer ([] when it has one): a vocabulary (VOCAB_FILES:
    tokenizer.json, the usual one, named when there is none) and tokenizer_config.json (special tokens, chat
    template)."""
    folder = Path(folder)
    missing = [] if any(all((folder / f).is_file() for f in files) for files in VOCAB_FILES) else ["tokenizer.json"]
    return missing + ([] if (folder / "tokenizer_config.json").is_file() else ["tokenizer_config.json"])


def check_tokenizer_files(folder: str | os.PathLike) -> None:
    """FileNotFoundError naming the missing files when `folder` holds no usable tokenizer."""
    missing = missing_tokenizer_files(folder)
    if missing:
        raise FileNotFoundError(f"{folder}: the model folder has no tokenizer (missing {' and '.join(missing)}); save "
                                f"the model's tokenizer there with tokenizer.save_pretrained({str(folder)!r})")


def _probe_ids(tok: PreTrainedTokenizerBase) -> list[int]:
    return tok(PROBE, add_special_tokens=False)["input_ids"]


def load_tokenizer(folder: str | os.PathLike) -> PreTrainedTokenizerBase:
    """The tokenizer of a Hugging Face folder, encoding exactly as its `tokenizer.json` (module docstring); a folder
    without tokenizer files is refused (`check_tokenizer_files`)."""
    from tokenizers import Tokenizer

    folder = Path(folder)
    check_tokenizer_files(folder)
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
