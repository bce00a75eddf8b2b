"""DataBuffer (epochs, seeded shuffle, resume) and the JSONL loader's errors."""

import json
import random

import pytest

from trainer.data.buffer import DataBuffer, Prompt, load_jsonl, write_jsonl


def _prompts(n):
    return [Prompt(prompt=f"p{i}", answer=str(i), index=i) for i in range(n)]


def test_every_prompt_once_per_epoch_and_epochs_reshuffle():
    rng = random.Random(1)
    n, seed = rng.randint(7, 23), rng.randint(0, 10_000)
    buf = DataBuffer(_prompts(n), seed=seed)
    # Draw in ragged chunks that straddle epoch boundaries.
    drawn = []
    while len(drawn) < 3 * n:
        drawn += [p.index for p in buf.get_prompts(min(rng.randint(1, 5), 3 * n - len(drawn)))]
    epochs = [drawn[k * n:(k + 1) * n] for k in range(3)]
    for e in epochs:
        assert sorted(e) == list(range(n))
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]  # fresh permutation per epoch
    assert buf.epoch_id == 2 and buf.sample_offset == n
    # Same seed -> same order; other seed -> other order.
    assert [p.index for p in DataBuffer(_prompts(n), seed=seed).get_prompts(3 * n)] == drawn
    assert [p.index for p in DataBuffer(_prompts(n), seed=seed + 1).get_prompts(n)] != epochs[0]
    assert [p.index for p in DataBuffer(_prompts(n), shuffle=False).get_prompts(n)] == list(range(n))


def test_state_dict_resume_continues_the_same_stream():
    n = 11
    ref = DataBuffer(_prompts(n), seed=5)
    stream = [p.index for p in ref.get_prompts(40)]
    a = DataBuffer(_prompts(n), seed=5)
    head = [p.index for p in a.get_prompts(17)]
    state = json.loads(json.dumps(a.state_dict()))  # must survive a JSON checkpoint
    b = DataBuffer(_prompts(n), seed=999)  # a different seed is overwritten by the state
    b.load_state_dict(state)
    assert head + [p.index for p in b.get_prompts(23)] == stream
    with pytest.raises(ValueError, match="same prompt file"):
        DataBuffer(_prompts(n + 1)).load_state_dict(state)
    with pytest.raises(ValueError, match="missing keys"):
        b.load_state_dict({"epoch_id": 0})


def test_load_jsonl_keeps_answer_and_metadata(tmp_path):
    path = tmp_path / "p.jsonl"
    write_jsonl(path, [{"prompt": "1+2=", "answer": 3, "level": "easy"}, {"prompt": "x", "tags": [1, 2]}])
    with open(path, "a") as f:
        f.write("\n   \n")  # blank lines are skipped
    ps = load_jsonl(path)
    assert [(p.prompt, p.answer, dict(p.metadata), p.index) for p in ps] == [
        ("1+2=", "3", {"level": "easy"}, 0), ("x", None, {"tags": [1, 2]}, 1)]
    assert len(DataBuffer.from_jsonl(path)) == 2


def test_empty_prompt_file_is_a_clear_error(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    with pytest.raises(ValueError, match=r"empty\.jsonl: no prompts found"):
        load_jsonl(path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_jsonl(tmp_path / "nope.jsonl")
    with pytest.raises(ValueError, match="at least one prompt"):
        DataBuffer([])


@pytest.mark.parametrize("bad, msg", [
    ('{"prompt": "ok"', "malformed JSON"),
    ('["a list"]', "expected a JSON object"),
    ('{"question": "no prompt key"}', "missing key 'prompt'"),
    ('{"prompt": ""}', "non-empty string"),
])
def test_malformed_line_names_file_and_line(tmp_path, bad, msg):
    path = tmp_path / "bad.jsonl"
    lines = ['{"prompt": "a"}', "", '{"prompt": "b"}', bad, '{"prompt": "c"}']
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=msg) as e:
        load_jsonl(path)
    assert f"{path}:4:" in str(e.value)


def test_get_prompts_rejects_negative():
    with pytest.raises(ValueError, match="n: must be >= 0"):
        DataBuffer(_prompts(3)).get_prompts(-1)


def _char_tokenizer_with_unk():
    """A character-level WordLevel tokenizer over digits, '+', '=' and a few letters; anything else is <unk>."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(["<unk>", *"0123456789+=abc "])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def test_characters_outside_the_vocabulary_are_counted_and_warned_once():
    import warnings

    from engines.tiny import build_tokenizer
    from trainer.data.buffer import unknown_characters, warn_unknown_characters

    tok = _char_tokenizer_with_unk()
    texts = ["1+2=", "a é+€=é", "b\u00e9c"]
    assert unknown_characters(tok, texts) == {"é": 3, "€": 1}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert warn_unknown_characters(tok, texts, where="[data].train") == 4
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "[data].train: 4 characters are outside the tokenizer's vocabulary and become <unk>" in message
    assert "'é' x3, '€' x1" in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about: no warning at all
        assert warn_unknown_characters(tok, ["1+2=3"], where="x") == 0
        assert warn_unknown_characters(build_tokenizer(), texts, where="x") == 0  # byte-level: every text encodes


def test_the_cli_warns_about_unknown_characters_of_the_eval_set(tmp_path):
    from pathlib import Path

    from trainer.cli import load_run_config
    from trainer.evaluation import eval_sets

    root = Path(__file__).resolve().parents[1]
    data = tmp_path / "eval.jsonl"
    data.write_text('{"prompt": "1+1=€", "answer": "2"}\n{"prompt": "2+2=", "answer": "4"}\n')
    cfg = load_run_config(root / "configs" / "demo.toml", [f'data.eval="{data}"'])
    with pytest.warns(UserWarning, match=r"\[data\]\.eval: 1 characters are outside .*most common: '€' x1\)"):
        eval_sets(cfg, tokenizer=_char_tokenizer_with_unk())


def test_plain_strings_and_dicts_become_prompts_with_their_positions():
    rng = random.Random(3)
    texts = [f"q{rng.randint(0, 999)}" for _ in range(rng.randint(5, 15))]
    buf = DataBuffer(texts, shuffle=False)
    got = buf.get_prompts(len(texts))
    assert [(p.prompt, p.answer, p.index) for p in got] == [(t, None, i) for i, t in enumerate(texts)]
    rows = [{"prompt": t, "answer": i, "level": i % 3} for i, t in enumerate(texts)]
    got = DataBuffer(rows, shuffle=False).get_prompts(len(rows))
    assert [(p.prompt, p.answer, dict(p.metadata), p.index) for p in got] == \
        [(t, str(i), {"level": i % 3}, i) for i, t in enumerate(texts)]
    # in a mixture each set's indices continue after the sets before it
    mix = DataBuffer.mixture([texts, ["a", "b"]], [1.0, 1.0], seed=1)
    assert sorted(p.index for p in mix.sets[1]) == [len(texts), len(texts) + 1]


def test_a_bad_prompt_item_is_refused_naming_its_position():
    with pytest.raises(ValueError, match=r"prompts\[1\]: expected a string"):
        DataBuffer(["ok", 3])
    with pytest.raises(ValueError, match=r"prompts\[0\]: an empty prompt"):
        DataBuffer([""])
    with pytest.raises(ValueError, match=r"prompts\[0\]: missing key 'prompt'"):
        DataBuffer([{"question": "x"}])
