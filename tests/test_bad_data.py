"""Bad data and bad config values are refused before any work (issue 30 items 10-13): `error: ...` naming the file,
the row or line and the key to change, exit code 2, and the run (engines, SFT, evaluation) never started."""

import json
from pathlib import Path

import pytest

import trainer.cli as cli
from trainer.data.buffer import load_jsonl, load_prompts

ROOT = Path(__file__).resolve().parents[1]


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _toml(value) -> str:
    """A TOML value: a table inline, anything else as JSON (which TOML reads alike for strings and numbers)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)


def _config(tmp_path: Path, train: Path, **tables: dict) -> Path:
    """A small run config: the tiny preset, `train` as the data, the arithmetic reward; `tables` add keys by table
    ("data", "rl.rollout", ...)."""
    sections = {"data": {"train": str(train), "reward": "arithmetic"}, "engines": {"in_process": True}}
    for name, keys in tables.items():
        sections.setdefault(name.replace("__", "."), {}).update(keys)
    text = "".join(f"[{name}]\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in keys.items())
                   for name, keys in sections.items())
    path = tmp_path / "run.toml"
    path.write_text(f'output_dir = "{tmp_path / "out"}"\n' + text)
    return path


def _refused(monkeypatch, capsys, mode: str, config: Path, *overrides: str) -> str:
    """main() exits 2 with `error: ...` and no traceback, and never reaches cli.run; returns the message."""
    ran = []
    monkeypatch.setattr(cli, "run", lambda *a, **k: ran.append(a))
    args = [mode, "--config", str(config)] + [a for o in overrides for a in ("--set", o)]
    assert cli.main(args) == 2
    err = capsys.readouterr().err  # after `datasets`' progress lines, when a set was converted
    assert "Traceback" not in err and err.splitlines()[-1].startswith("error: "), err
    assert ran == []  # nothing started: no engine, no SFT step, no evaluation
    return err.splitlines()[-1]


ROWS = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+3=", "answer": "5"}]


# ----------------------------------------------------------------------------------------------- item 13
def test_an_empty_data_file_is_refused_before_the_engine_starts(monkeypatch, capsys, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    err = _refused(monkeypatch, capsys, "rl", _config(tmp_path, empty))
    assert f"{empty}: the data set has no rows" in err


@pytest.mark.parametrize("mode", ["rl", "sft", "sft+rl"])
def test_data_field_errors_are_refused_before_the_engine_starts(monkeypatch, capsys, tmp_path, mode):
    bad = _jsonl(tmp_path / "bad.jsonl", [{"question": "1+1=", "answer": "2"}])
    err = _refused(monkeypatch, capsys, mode, _config(tmp_path, bad))
    assert f"{bad}: row 0: missing field 'prompt'" in err and "prompt_key" in err


def test_an_eval_set_with_a_field_error_is_refused_before_the_engine_starts(monkeypatch, capsys, tmp_path):
    good = _jsonl(tmp_path / "train.jsonl", ROWS)
    bad = _jsonl(tmp_path / "eval.jsonl", [ROWS[0], {"prompt": 7, "answer": "5"}])
    err = _refused(monkeypatch, capsys, "rl", _config(tmp_path, good, data={"eval": str(bad)}))
    assert str(bad) in err and "'prompt'" in err


def test_a_group_estimator_with_one_sample_per_prompt_is_a_config_error(monkeypatch, capsys, tmp_path):
    config = _config(tmp_path, _jsonl(tmp_path / "train.jsonl", ROWS))
    for estimator in ("grpo", "rloo"):
        err = _refused(monkeypatch, capsys, "rl", config, "rl.rollout.n_samples_per_prompt=1",
                       f'rl.advantage_estimator="{estimator}"')
        assert f"[rl] advantage_estimator: '{estimator}' takes each sample's baseline from its group" in err
        assert "n_samples_per_prompt >= 2 (got 1)" in err and "'reinforce'" in err
    cfg = cli.load_run_config(config, ["rl.rollout.n_samples_per_prompt=1", 'rl.advantage_estimator="reinforce"'],
                              mode="rl")
    assert cfg.rl.rollout.n_samples_per_prompt == 1  # an estimator without groups takes groups of one


def test_a_token_budget_smaller_than_one_sequence_is_a_config_error(monkeypatch, capsys, tmp_path):
    config = _config(tmp_path, _jsonl(tmp_path / "train.jsonl", ROWS))
    err = _refused(monkeypatch, capsys, "rl", config, "rl.token_budget=64", "rl.micro_batch_buckets=64",
                   "rl.rollout.max_new_tokens=64")
    assert "[rl] token_budget: 64 cannot hold one sequence" in err and "max_new_tokens = 64" in err


@pytest.mark.parametrize("value, message", [("abc", "rl.num_steps = 'abc': expected an integer"),
                                            ("2.5", "rl.num_steps = 2.5: expected an integer")])
def test_a_mistyped_num_steps_is_a_config_error(monkeypatch, capsys, tmp_path, value, message):
    config = _config(tmp_path, _jsonl(tmp_path / "train.jsonl", ROWS))
    assert message in _refused(monkeypatch, capsys, "rl", config, f"rl.num_steps={value}")


@pytest.mark.parametrize("name", ["demo.toml", "agent_demo.toml", "agent_demo_notools.toml"])
def test_the_shipped_configs_pass_the_data_checks(name):
    for mode in ("sft", "rl", "sft+rl"):
        cli.load_run_config(ROOT / "configs" / name, mode=mode)


# ----------------------------------------------------------------------------------------------- item 11
def test_a_row_that_is_not_utf8_is_refused_naming_the_file_and_line(monkeypatch, capsys, tmp_path):
    """The JSON reader keeps invalid bytes: the row used to load, then fail with a UnicodeDecodeError mid-run."""
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "a\xff\xfeb", "answer": "3"}\n')
    message = f"{bad}: line 2: not valid UTF-8 (byte 0xff at column 14)"
    with pytest.raises(ValueError) as e:
        load_prompts(bad)
    assert message in str(e.value)
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: not valid UTF-8 \(byte 0xff at column 14\)"):
        load_jsonl(bad)  # the small-file reader too
    for mode in ("rl", "sft"):
        err = _refused(monkeypatch, capsys, mode, _config(tmp_path, bad))
        assert message in err and "re-save the file as UTF-8" in err


def test_a_parquet_row_that_is_not_utf8_is_refused_naming_the_row_and_field(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    prompts = pa.array([b"1+1=", b"2+\xc3(="], pa.binary()).view(pa.string())  # a view does not check the bytes
    pq.write_table(pa.table({"prompt": prompts, "answer": ["2", "5"]}), tmp_path / "bad.parquet")
    with pytest.raises(ValueError) as e:
        load_prompts(tmp_path / "bad.parquet")
    assert f"{tmp_path / 'bad.parquet'}: row 1: field 'prompt': not valid UTF-8 (byte 0xc3 at column 3)" in str(e.value)


# ----------------------------------------------------------------------------------------------- item 10
NO_ANSWER = [ROWS[0], {"prompt": "2+3="}, {"prompt": "4+4=", "answer": "8"}]


@pytest.mark.parametrize("mode", ["sft", "sft+rl"])
def test_sft_rows_without_an_answer_are_refused_naming_the_row(monkeypatch, capsys, tmp_path, mode):
    """SFT from prompt/answer pairs used to train on the text "None" for these rows."""
    bad = _jsonl(tmp_path / "sft.jsonl", NO_ANSWER)
    err = _refused(monkeypatch, capsys, mode, _config(tmp_path, bad))
    assert f"{bad}: row 1: field 'answer' is missing (null), and SFT from prompt/answer pairs trains on the answer" \
        in err and 'train on the text "None"' in err
    none = _jsonl(tmp_path / "none.jsonl", [{"prompt": "1+1="}, {"prompt": "2+3="}])  # no answer field at all
    err = _refused(monkeypatch, capsys, "sft", _config(tmp_path, none))
    assert f"{none}: row 0: missing field 'answer'" in err and "[data].answer_key" in err
    named = _jsonl(tmp_path / "named.jsonl", [{"prompt": "1+1=", "sol": "2"}, {"prompt": "2+3=", "sol": None}])
    err = _refused(monkeypatch, capsys, "sft", _config(tmp_path, named, data={"answer_key": "sol"}))
    assert f"{named}: row 1: field 'sol' is missing (null)" in err


def test_sft_conversations_need_no_answer(tmp_path):
    conv = [{"messages": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]}]
    sft = _jsonl(tmp_path / "conv.jsonl", conv)
    config = _config(tmp_path, _jsonl(tmp_path / "train.jsonl", ROWS),
                     data={"sft": {"path": str(sft), "messages_key": "messages"}})
    assert cli.load_run_config(config, mode="sft+rl").data.sft["messages_key"] == "messages"


def test_rl_rows_without_an_answer_are_refused_when_the_set_has_answers(monkeypatch, capsys, tmp_path):
    bad = _jsonl(tmp_path / "train.jsonl", NO_ANSWER)
    err = _refused(monkeypatch, capsys, "rl", _config(tmp_path, bad))
    assert f"{bad}: row 1: field 'answer' is missing (null), and the reward would score that row against None" in err


def test_an_rl_set_without_any_answer_loads_with_a_warning(tmp_path):
    """Whether the reward reads answers cannot be known (a judge or an environment may not): a warning, no error."""
    none = _jsonl(tmp_path / "train.jsonl", [{"prompt": "1+1="}, {"prompt": "2+3="}])
    with pytest.warns(UserWarning, match=rf"\[data\]\.train: {none} has no 'answer' field: the reward gets "
                                         r"answer = None"):
        cli.load_run_config(_config(tmp_path, none), mode="rl")


def test_sft_examples_refuse_a_prompt_without_an_answer():
    from trainer.data.buffer import Prompt

    for fmt in ("chat", "plain"):
        with pytest.raises(ValueError, match=r"SFT example 1 \('2\+3='\) has no answer"):
            cli.sft_examples([Prompt("1+1=", "2"), Prompt("2+3=")], None, fmt)


# ----------------------------------------------------------------------------------------------- item 12
def test_sft_examples_all_cut_by_max_length_are_refused(monkeypatch, capsys, tmp_path):
    """Every example losing its answer to the cut used to run as a no-op (loss 0) with only a warning."""
    rows = [{"prompt": "1+1=", "answer": "the answer is two, written out at length"}, ROWS[1] | {"answer": "x" * 50}]
    config = _config(tmp_path, _jsonl(tmp_path / "sft.jsonl", rows))
    err = _refused(monkeypatch, capsys, "sft", config, "sft.max_length=24")
    assert "[data].sft: every one of the 2 SFT examples loses trained (assistant) tokens to [sft] max_length = 24" \
        in err and f"(the first, {tmp_path / 'sft.jsonl'}: row 0, is 65 tokens)" in err
    assert "raise [sft] max_length to 75 (the longest)" in err
    err = _refused(monkeypatch, capsys, "sft", config, "sft.max_length=24", 'data.format="plain"')
    assert f"[data].sft: {tmp_path / 'sft.jsonl'}: row 0: the example (prompt + answer + eos) is 45 tokens > [sft] " \
           "max_length = 24 (2 of 2 are); raise [sft] max_length to 55" in err
    cfg = cli.load_run_config(config, ["sft.max_length=80"], mode="sft")  # long enough for both: no error
    assert cfg.sft.max_length == 80


def test_an_sft_example_past_the_token_budget_or_the_context_is_refused(monkeypatch, capsys, tmp_path):
    config = _config(tmp_path, _jsonl(tmp_path / "sft.jsonl", [ROWS[0], {"prompt": "y" * 90, "answer": "1"}]))
    err = _refused(monkeypatch, capsys, "sft", config, "sft.max_length=512", "sft.token_budget=64",
                   "sft.micro_batch_buckets=64")
    assert f"[data].sft: {tmp_path / 'sft.jsonl'}: row 1: the example is 112 tokens (after the [sft] max_length cut) " \
           "> [sft] token_budget = 64" in err
    err = _refused(monkeypatch, capsys, "sft", config, "sft.max_length=512", "model.max_position_embeddings=100")
    assert "row 1: the example is 112 tokens (after the [sft] max_length cut) > the model's context " \
           "(max_position_embeddings) = 100; lower [sft] max_length to 100" in err


@pytest.mark.parametrize("key", ["train", "eval"])
def test_a_prompt_that_fills_the_models_context_is_refused(monkeypatch, capsys, tmp_path, key):
    """A 5000-character prompt made a step take > 290 s, far past the tiny model's 512 positions."""
    long = _jsonl(tmp_path / "long.jsonl", [ROWS[0], {"prompt": "9+" * 2500 + "=", "answer": "5"}])
    good = _jsonl(tmp_path / "good.jsonl", ROWS)
    config = _config(tmp_path, long if key == "train" else good, data={"eval": str(long)} if key == "eval" else {})
    err = _refused(monkeypatch, capsys, "rl", config)
    assert f"[data].{key}: {long}: row 1: the prompt is 5020 tokens and the model's context " \
           "(max_position_embeddings) is 512: no room to generate" in err


def test_a_prompt_and_its_response_past_the_rl_token_budget_are_refused(monkeypatch, capsys, tmp_path):
    config = _config(tmp_path, _jsonl(tmp_path / "train.jsonl", [ROWS[0], {"prompt": "z" * 60, "answer": "1"}]))
    err = _refused(monkeypatch, capsys, "rl", config, "rl.token_budget=64", "rl.micro_batch_buckets=64",
                   "rl.rollout.max_new_tokens=32")
    assert f"[data].train: {tmp_path / 'train.jsonl'}: row 1: the prompt is 79 tokens, + [rl.rollout] " \
           "max_new_tokens = 32 is 111 > [rl] token_budget = 64: a sample that long cannot be trained" in err


def test_a_prompt_whose_full_response_would_pass_the_context_is_a_warning(tmp_path):
    config = _config(tmp_path, _jsonl(tmp_path / "train.jsonl", [ROWS[0], {"prompt": "z" * 100, "answer": "1"}]))
    with pytest.warns(UserWarning, match=r"\[data\]\.train: 1 prompts leave less than \[rl\.rollout\] max_new_tokens "
                                         r"= 32 tokens of the model's context \(128\); the first, .*train\.jsonl: "
                                         r"row 1, is 119 tokens.*lower \[rl\.rollout\] max_new_tokens to 9"):
        cli.load_run_config(config, ["model.max_position_embeddings=128", "rl.rollout.max_new_tokens=32"], mode="rl")


def test_the_real_shape_config_passes_the_data_checks(tmp_path, monkeypatch):
    """configs/qwen05b_shape.toml with a model folder of its shape and tokenizer (no weights: the checks read the
    config and the tokenizer only)."""
    from transformers import Qwen2Config

    monkeypatch.syspath_prepend(str(ROOT / "bench"))  # bench_real_shape imports its neighbour _proc
    from bench.bench_real_shape import CONFIG, QWEN05B_SHAPE, build_chatml_tokenizer, training_texts

    folder = tmp_path / "model"
    Qwen2Config(**QWEN05B_SHAPE).save_pretrained(folder)
    build_chatml_tokenizer(training_texts()).save_pretrained(folder)
    for mode in ("sft", "rl", "sft+rl"):
        cli.load_run_config(CONFIG, [f"model.path={json.dumps(str(folder))}"], mode=mode)
