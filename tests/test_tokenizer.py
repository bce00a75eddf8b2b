"""The project's own byte-level tokenizer (one token per character of its alphabet) and tiny model presets."""

import random
from pathlib import Path

import pytest

from engines.tiny import CHARS, build_tokenizer, tiny_model_config

ROOT = Path(__file__).resolve().parents[1]


def test_round_trip_on_random_text():
    tok = build_tokenizer()
    rng = random.Random(0)
    for _ in range(20):
        text = "".join(rng.choice(CHARS) for _ in range(rng.randint(1, 40)))
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert len(ids) == len(text)  # one token per character
        assert tok.decode(ids) == text


def test_chat_template_assistant_mask_covers_exactly_the_reply(tmp_path):
    tok = build_tokenizer()
    msgs = [{"role": "user", "content": "12+7="}, {"role": "assistant", "content": "19"}]
    out = tok.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "19<|im_end|>"
    tok.save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again("3*4=12")["input_ids"] == tok("3*4=12")["input_ids"]


def test_tiny_config_matches_tokenizer():
    cfg = tiny_model_config("qwen2")
    assert cfg.vocab_size >= len(build_tokenizer()) and cfg.eos_token_id == build_tokenizer().eos_token_id
    with pytest.raises(ValueError, match="arch"):
        tiny_model_config("gpt2")
    with pytest.raises(ValueError, match="vocab_size"):
        tiny_model_config(vocab_size=10)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_a_model_folder_gives_back_the_tokenizer_that_wrote_it(tmp_path, arch):
    """The project tokenizer saved beside a Qwen2 / Llama config reloads encoding as it did: newlines included
    (transformers 5's AutoTokenizer picks Qwen2Tokenizer for a qwen2 folder, which dropped them)."""
    from engines.tokenizer import load_tokenizer

    tok = build_tokenizer()
    tiny_model_config(arch).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    again = load_tokenizer(tmp_path)
    msgs = [{"role": "system", "content": "Be brief.\nOnly digits."}, {"role": "user", "content": "12+7=\n"},
            {"role": "assistant", "content": "19"}]
    chat = tok.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"]
    assert again.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"] == chat
    (newline,) = tok("\n", add_special_tokens=False)["input_ids"]
    assert chat.count(newline) == 8  # 2 per turn + 2 in the contents
    rng = random.Random(3)
    text = "".join(rng.choice(CHARS) for _ in range(500))
    assert again(text, add_special_tokens=False)["input_ids"] == tok(text, add_special_tokens=False)["input_ids"]
    assert (again.pad_token_id, again.eos_token_id, again.convert_tokens_to_ids("<|im_end|>")) == \
        (tok.pad_token_id, tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>"))


def test_a_model_folder_without_tokenizer_files_is_refused_naming_them(tmp_path):
    """A folder with only tokenizer_config.json loads in transformers as a tokenizer of its special tokens, which
    encodes every text to nothing: refused before any work, naming the missing files."""
    import json

    from engines.tokenizer import load_tokenizer
    from trainer.cli import load_run_config
    from trainer.config import ConfigError

    folder = tmp_path / "model"
    tiny_model_config().save_pretrained(folder)
    with pytest.raises(FileNotFoundError, match="has no tokenizer \\(missing tokenizer.json and tokenizer_config.json"):
        load_tokenizer(folder)
    build_tokenizer().save_pretrained(folder)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"model.*has no tokenizer \(missing tokenizer.json\); save"):
        load_tokenizer(folder)
    data = json.dumps(str(ROOT / "data" / "arithmetic_train.jsonl"))
    with pytest.raises(ConfigError, match=r"\[model\]\.path = .*has no tokenizer \(missing tokenizer.json\)"):
        load_run_config(ROOT / "configs" / "demo.toml", [f"model.path={json.dumps(str(folder))}", f"data.train={data}",
                                                         f"data.eval={data}"], mode="rl")
    build_tokenizer().save_pretrained(folder)
    assert load_tokenizer(folder)("12", add_special_tokens=False)["input_ids"]
