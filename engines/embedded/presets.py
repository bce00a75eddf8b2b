"""Models the embedded engine can serve: `tiny` (random, seeded, the project tokenizer) or a local HF folder.

`build_tiny_model(seed)` is deterministic, so a trainer process can rebuild bit-identical initial weights to the
ones an engine started with `--model tiny --seed S` serves (tests rely on it).
"""

from __future__ import annotations

import os

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from engines.embedded.attention import use_engine_attention
from engines.tiny import BOS, EOS, IM_END, PAD, SPECIAL_TOKENS, build_tokenizer, tiny_model_config
from engines.tokenizer import load_tokenizer

TINY = "tiny"


def build_tiny_model(seed: int = 0, arch: str = "llama", dtype: torch.dtype = torch.float32, **config_kwargs):
    """A random-initialised tiny causal LM; the same seed and arguments give the same weights in any process."""
    config = tiny_model_config(arch, **config_kwargs)
    # fork_rng: seeding must not disturb the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Stock `generate()` on a saved folder stops where our engines do: at <eos> and at the chat template's end of
    # turn (a chat model's answer ends with <|im_end|>, not <eos>).
    ids = {t: SPECIAL_TOKENS.index(t) for t in (PAD, BOS, EOS, IM_END)}
    model.generation_config = GenerationConfig(bos_token_id=ids[BOS], eos_token_id=[ids[EOS], ids[IM_END]],
                                               pad_token_id=ids[PAD])
    return model.to(dtype).eval()


def load_engine_model(spec: str, *, seed: int = 0, dtype: torch.dtype | None = None, device: str = "cpu"):
    """(model, tokenizer) for `--model spec`: "tiny" or a folder with config.json and tokenizer files.

    dtype defaults to float32 on CPU and bfloat16 on CUDA (the usual rollout dtype)."""
    if dtype is None:
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    if spec == TINY:
        model, tok = build_tiny_model(seed, dtype=dtype), build_tokenizer()
    elif os.path.isdir(spec):
        model = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype)
        tok = load_tokenizer(spec)
    else:
        raise ValueError(f"--model {spec!r}: expected 'tiny' or an existing folder with a Hugging Face model")
    model = model.to(device).eval()
    use_engine_attention(model)  # decode steps without repeat_kv's copies (engines/embedded/attention.py)
    return model, tok
