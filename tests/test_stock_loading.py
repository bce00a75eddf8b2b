"""Folders the project writes load exactly in stock transformers: `AutoTokenizer` + `AutoModelForCausalLM`, the
folder's chat template and its generation config give the engine's greedy completions token for token.

The run is the demo's recipe cut short (SFT only, a few dozen steps: enough for answers that are digits and end with
the chat template's end of turn), exported with `python -m trainer export`; the completions are compared on 50
held-out prompts. Before the tokenizer was a `Qwen2Tokenizer` transformers rebuilt its pipeline and dropped every
space and newline, and `generate()` ran past `<|im_end|>`.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import trio
from transformers import AutoModelForCausalLM, AutoTokenizer

from engines.protocol import SamplingParams
from engines.registry import EngineSpec, build_engine
from engines.tiny import CHARS, IM_END, build_tokenizer, tiny_model_config
from kernels import use_backend
from trainer.cli import main

ROOT = Path(__file__).resolve().parents[1]
N_PROMPTS = 50
MAX_NEW = 6


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("stock")
    # The production CPU path, as a user's run takes it (the root conftest's TRITON_INTERPRET=1 would route the
    # training kernels through Triton's interpreter); batches of 16 (the demo's are 64) learn the answer format.
    with use_backend("torch"):
        assert main(["sft", "--config", str(ROOT / "configs/demo.toml"), "--set", f'output_dir="{out}"',
                     "--set", "sft.num_steps=60", "--set", "sft.batch_size=16", "--set", "eval.limit=8"]) == 0
    assert main(["export", "--config", str(ROOT / "configs/demo.toml"), "--set", f'output_dir="{out}"']) == 0
    return out / "export"


def _held_out() -> list[str]:
    rows = [json.loads(line) for line in (ROOT / "data/arithmetic_test.jsonl").read_text().splitlines()]
    return [r["prompt"] for r in rows[:N_PROMPTS]]


def _engine_completions(folder: Path, prompt_ids: list[list[int]]) -> list[list[int]]:
    engine = build_engine(EngineSpec(kind="local"), model_folder=folder, seed=0)
    tok = AutoTokenizer.from_pretrained(folder)
    stops = (tok.eos_token_id, tok.convert_tokens_to_ids(IM_END))
    params = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, stop_token_ids=stops)
    try:
        groups = trio.run(engine.generate, prompt_ids, params)
    finally:
        engine.close()
    return [list(g[0].output_ids) for g in groups]


def test_stock_transformers_gives_the_engines_greedy_completions(export):
    tok = AutoTokenizer.from_pretrained(export)
    model = AutoModelForCausalLM.from_pretrained(export).eval()
    assert type(tok).__name__ == "Qwen2Tokenizer"  # the class transformers picks; it must encode as we do
    ours = build_tokenizer()
    prompts = [[{"role": "user", "content": p}] for p in _held_out()]
    ids = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
           for m in prompts]
    assert ids == [ours.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=True)[
        "input_ids"] for m in prompts]
    want = _engine_completions(export, ids)
    got = []
    with torch.no_grad():
        for p in ids:  # one prompt at a time: no padding in the stock path
            out = model.generate(torch.tensor([p]), max_new_tokens=MAX_NEW)  # the folder's generation config
            got.append(out[0, len(p):].tolist())
    assert got == want
    im_end = tok.convert_tokens_to_ids(IM_END)
    # Not vacuous: the SFT model answers with digits and closes its turn, and generate() stopped there.
    ended = [c for c in got if c and c[-1] == im_end]
    assert len(ended) >= N_PROMPTS // 2, got
    answers = [tok.decode(c[:-1]) for c in ended]
    assert sum(a.lstrip("-").isdigit() for a in answers) >= len(answers) // 2, answers


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_the_tiny_tokenizer_round_trips_through_auto_tokenizer(tmp_path, arch):
    """Any text, not only the built-in alphabet: characters outside it are UTF-8 bytes, never <unk> or dropped."""
    tok = build_tokenizer()
    tiny_model_config(arch).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    rng = random.Random(7)
    alphabet = CHARS + "\t\r\u00e9\u00fc\u4e2d\u2014\U0001F600"
    for _ in range(30):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60)))
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert again(text, add_special_tokens=False)["input_ids"] == ids
        assert again.decode(ids) == text and tok.decode(ids) == text
    ascii_text = "".join(rng.choice(CHARS) for _ in range(200))
    assert len(tok(ascii_text, add_special_tokens=False)["input_ids"]) == 200  # one token per character
