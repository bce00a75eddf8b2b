"""Data sets through Hugging Face `datasets`: formats, field mapping, mixtures, errors by file/row/field, and a
million prompts without a million Python objects."""

import gc
import json
import random
import time
import tracemalloc

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from trainer.data.buffer import DataBuffer, DataSpec, PromptSet, data_specs, load_mixture, load_prompts


@pytest.fixture()
def cache(tmp_path):
    return str(tmp_path / "hf_cache")


def _records(n, seed):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        out.append({"question": f"What is {a} plus {b}?", "solution": f"{a} + {b} = {a + b}\n#### {a + b:,}",
                    "level": rng.randint(1, 5), "id": f"q{i}"})
    return out


def _write(path, records, fmt):
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    elif fmt == "json":
        path.write_text(json.dumps(records, indent=1))
    elif fmt == "parquet":
        pq.write_table(pa.Table.from_pylist(records), path)
    elif fmt == "disk":
        datasets.Dataset.from_list(records).save_to_disk(str(path))
    elif fmt == "disk_dict":
        datasets.DatasetDict({"train": datasets.Dataset.from_list(records),
                              "test": datasets.Dataset.from_list(records[:2])}).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("fmt, name", [("jsonl", "d.jsonl"), ("json", "d.json"), ("parquet", "d.parquet"),
                                       ("disk", "d_disk"), ("disk_dict", "d_dict")])
def test_every_format_reads_the_same_prompts_with_mapped_fields(tmp_path, cache, fmt, name):
    records = _records(random.randint(5, 40), seed=random.randint(0, 10_000))
    path = _write(tmp_path / name, records, fmt)
    spec = DataSpec(path=str(path), prompt_key="question", answer_key="solution", system_prompt="Be brief.")
    ps = load_prompts(spec, cache_dir=cache)
    assert isinstance(ps, PromptSet) and len(ps) == len(records)
    for i, r in enumerate(records):
        p = ps[i]
        assert (p.prompt, p.answer, p.index, p.system) == (r["question"], r["solution"], i, "Be brief.")
        assert p.metadata["level"] == r["level"] and p.metadata["id"] == r["id"]
        assert "question" not in p.metadata and "solution" not in p.metadata
        # The system prompt travels with the SFT conversation built from the pair.
        assert p.metadata["messages"][0] == {"role": "system", "content": "Be brief."}
        assert p.metadata["messages"][2] == {"role": "assistant", "content": r["solution"]}
    assert [p.prompt for p in ps] == [r["question"] for r in records]
    assert ps[-1].prompt == records[-1]["question"]


def test_messages_field_for_sft(tmp_path, cache):
    rows = [{"conv": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": f"yo {i}"}],
             "src": "chat"} for i in range(7)]
    path = _write(tmp_path / "c.parquet", rows, "parquet")
    ps = load_prompts(DataSpec(path=str(path), messages_key="conv", system_prompt="S"), cache_dir=cache)
    p = ps[3]
    assert p.prompt == "hi 3" and p.answer is None and p.metadata["src"] == "chat"
    assert p.metadata["messages"] == [{"role": "system", "content": "S"}, {"role": "user", "content": "hi 3"},
                                      {"role": "assistant", "content": "yo 3"}]


def test_numeric_and_mixed_answers_become_text(tmp_path, cache):
    path = tmp_path / "m.jsonl"
    path.write_text('{"q": "a", "a": "7"}\n{"q": "b", "a": 8}\n{"q": "c", "a": 9.5}\n')
    assert [p.answer for p in load_prompts(DataSpec(str(path), prompt_key="q", answer_key="a"), cache_dir=cache)] \
        == ["7", "8", "9.5"]


# ----------------------------------------------------------------------------------------------- errors
def _jsonl(tmp_path, lines, name="bad.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


GOOD = '{"question": "q", "solution": "s"}'


@pytest.mark.parametrize("lines, spec_kw, where, msg", [
    ([GOOD, GOOD, '{"question": "q", "solution": ', GOOD], {}, "line 3", "malformed JSON"),
    ([GOOD, '["a list"]', GOOD], {}, "line 2", "expected a JSON object"),
    ([GOOD, GOOD, '{"question": 5, "solution": "s"}'], {}, "row 2", "field 'question' must be text, got int"),
    ([GOOD, '{"solution": "s"}', GOOD], {}, "row 1", "field 'question' is missing"),
    ([GOOD, GOOD, GOOD, '{"question": "", "solution": "s"}'], {}, "row 3", "field 'question' is an empty string"),
    ([GOOD, '{"question": "q"}'], {}, "row 1", "field 'solution' is missing"),
    ([GOOD, GOOD], {"prompt_key": "problem"}, "row 0", "missing field 'problem'"),
    ([GOOD, GOOD], {"answer_key": "final"}, "row 0", "missing field 'final'"),
    ([GOOD, '{"question": {"nested": 1}, "solution": "s"}'], {}, "row 1", "'question' must be text, got dict"),
])
def test_bad_rows_name_file_row_and_field(tmp_path, cache, lines, spec_kw, where, msg):
    path = _jsonl(tmp_path, lines)
    spec = DataSpec(str(path), **{"prompt_key": "question", "answer_key": "solution", **spec_kw})
    with pytest.raises(ValueError, match=msg) as e:
        load_prompts(spec, cache_dir=cache)
    assert str(e.value).startswith(f"{path}: {where}:"), str(e.value)


@pytest.mark.parametrize("conv, where, msg", [
    ([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}], "row 2", "message 1: role 'robot'"),
    ([{"role": "user", "content": "a"}], "row 2", "no assistant message"),
    ([], "row 2", "empty conversation"),
    (None, "row 2", "field 'conv' is missing"),
])
def test_bad_conversations_name_the_row(tmp_path, cache, conv, where, msg):
    ok = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    rows = [{"conv": ok}, {"conv": ok}, {"conv": conv}, {"conv": ok}]
    path = _write(tmp_path / "c.parquet", rows, "parquet")
    with pytest.raises(ValueError, match=msg) as e:
        load_prompts(DataSpec(str(path), messages_key="conv"), cache_dir=cache)
    assert str(e.value).startswith(f"{path}: {where}:"), str(e.value)


def test_bad_files_are_named(tmp_path, cache):
    with pytest.raises(FileNotFoundError, match="nope.parquet: data file does not exist"):
        load_prompts(DataSpec(str(tmp_path / "nope.parquet")), cache_dir=cache)
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=r"x\.csv: unsupported data file type '\.csv'"):
        load_prompts(DataSpec(str(tmp_path / "x.csv")), cache_dir=cache)
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(ValueError, match=r"broken\.parquet: not a readable parquet file"):
        load_prompts(DataSpec(str(tmp_path / "broken.parquet")), cache_dir=cache)
    (tmp_path / "folder").mkdir()
    with pytest.raises(ValueError, match="folder: a folder that is not a Dataset.save_to_disk folder"):
        load_prompts(DataSpec(str(tmp_path / "folder")), cache_dir=cache)
    d = _write(tmp_path / "dd", _records(3, 0), "disk_dict")
    with pytest.raises(ValueError, match=r"dd: no split 'validation' \(splits: \['test', 'train'\]\)"):
        load_prompts(DataSpec(str(d), prompt_key="question", split="validation"), cache_dir=cache)
    assert len(load_prompts(DataSpec(str(d), prompt_key="question", split="test"), cache_dir=cache)) == 2
    pq.write_table(pa.table({"question": pa.array([], pa.string())}), tmp_path / "empty.parquet")
    with pytest.raises(ValueError, match=r"empty\.parquet: the data set has no rows"):
        load_prompts(DataSpec(str(tmp_path / "empty.parquet"), prompt_key="question"), cache_dir=cache)


def test_data_specs_from_config_values():
    specs = data_specs([{"path": "a.parquet", "weight": 3}, "b.jsonl"], {"prompt_key": "question", "train": "x"})
    assert [(s.path, s.weight, s.prompt_key) for s in specs] == [("a.parquet", 3, "question"),
                                                                 ("b.jsonl", 1.0, "question")]
    assert data_specs("a.jsonl")[0] == DataSpec("a.jsonl")
    over = data_specs([{"path": "a", "prompt_key": "problem"}], {"prompt_key": "question"})
    assert over[0].prompt_key == "problem"
    with pytest.raises(ValueError, match=r"\[data\].train\[1\].weight: must be a number > 0"):
        data_specs(["a", {"path": "b", "weight": 0}])
    with pytest.raises(ValueError, match=r"\[data\].train\[0\]: unknown key\(s\) \['wieght'\]"):
        data_specs([{"path": "a", "wieght": 2}])
    with pytest.raises(ValueError, match=r"\[data\].train\[0\]: missing 'path'"):
        data_specs([{"weight": 2}])
    with pytest.raises(ValueError, match="empty list"):
        data_specs([])


# ----------------------------------------------------------------------------------------------- mixture
def _parquet_set(tmp_path, name, n, tag):
    rows = [{"text": f"{tag}{i}", "gold": str(i)} for i in range(n)]
    return DataSpec(str(_write(tmp_path / f"{name}.parquet", rows, "parquet")), prompt_key="text", answer_key="gold")


def test_mixture_follows_weights_and_covers_each_set_per_epoch(tmp_path, cache):
    rng = random.Random(7)
    na, nb = rng.randint(30, 60), rng.randint(200, 300)
    wa, wb = 3.0, 1.0
    specs = [dataclasses_replace(_parquet_set(tmp_path, "a", na, "a"), weight=wa),
             dataclasses_replace(_parquet_set(tmp_path, "b", nb, "b"), weight=wb)]
    buf = DataBuffer.from_specs(specs, seed=rng.randint(0, 999), cache_dir=cache)
    assert len(buf) == na + nb
    drawn = []
    while len(drawn) < 8000:
        drawn += buf.get_prompts(rng.randint(1, 64))
    from_a = [p for p in drawn if p.prompt.startswith("a")]
    frac = len(from_a) / len(drawn)
    assert abs(frac - wa / (wa + wb)) < 0.02, frac  # binomial std at n=8000 is 0.005
    # Within a set, every prompt once per epoch of that set; indices run on across the sets.
    first_epoch_a = [p.index for p in from_a[:na]]
    assert sorted(first_epoch_a) == list(range(na))
    from_b = [p.index for p in drawn if p.prompt.startswith("b")][:nb]
    assert sorted(from_b) == list(range(na, na + nb))


def test_mixture_resume_continues_the_same_stream(tmp_path, cache):
    specs = [_parquet_set(tmp_path, "a", 13, "a"), dataclasses_replace(_parquet_set(tmp_path, "b", 29, "b"), weight=2)]
    sets = load_mixture(specs, cache_dir=cache)
    ref = DataBuffer.mixture(sets, [1, 2], seed=3)
    stream = [p.prompt for p in ref.get_prompts(5000)]
    a = DataBuffer.mixture(sets, [1, 2], seed=3)
    head = [p.prompt for p in a.get_prompts(4321)]  # crosses a mixture block (4096) and many epochs
    state = json.loads(json.dumps(a.state_dict()))
    b = DataBuffer.mixture(sets, [1, 2], seed=99)
    b.load_state_dict(state)
    assert head + [p.prompt for p in b.get_prompts(5000 - 4321)] == stream
    with pytest.raises(ValueError, match="saved for 2 data sets"):
        DataBuffer.mixture(sets + [sets[0]], [1, 1, 1]).load_state_dict({**state, "num_prompts": 13 * 2 + 29})
    with pytest.raises(ValueError, match="one per set"):
        DataBuffer.mixture(sets, [1])


def dataclasses_replace(spec, **kw):
    import dataclasses

    return dataclasses.replace(spec, **kw)


# ----------------------------------------------------------------------------------------------- scale
def test_a_million_prompts_cost_no_python_object_per_row(tmp_path, cache):
    n = 1_000_000
    ids = pa.array(np.arange(n))
    table = pa.table({
        "problem": pc.binary_join_element_wise("What is ", pc.cast(ids, pa.string()), " squared?", ""),
        "final": pc.cast(pc.multiply(ids, ids), pa.string()),
    })
    path = tmp_path / "million.parquet"
    pq.write_table(table, path)
    del table, ids
    spec = DataSpec(str(path), prompt_key="problem", answer_key="final")
    gc.collect()
    tracemalloc.start()
    objects_before = len(gc.get_objects())
    t0 = time.perf_counter()
    buf = DataBuffer.from_specs([spec], seed=1, cache_dir=cache)
    batch = buf.get_prompts(256)
    load_s = time.perf_counter() - t0
    gc.collect()
    objects_after = len(gc.get_objects())
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(buf) == n
    for p in batch:
        k = int(p.prompt.split()[2])
        assert p.answer == str(k * k) and p.index == k
    # A list of Prompts would be >= 1M objects (and ~300 MB); the buffer holds the memory-mapped table and one
    # int64 order array (8 MB) per set.
    grown = objects_after - objects_before
    print(f"\n1M-row parquet: load + first batch {load_s:.1f} s, +{grown} gc objects, traced peak "
          f"{peak / 2**20:.1f} MiB")
    assert grown < 20_000, grown
    assert peak < 64 * 2**20, peak


# ----------------------------------------------------------------------------------------------- run config
@pytest.mark.parametrize("data_toml, msg", [
    ('train = [{path = "data/gsm8k_style_train.parquet", weight = -1}]', r"\[data\].train\[0\].weight: must be"),
    ('train = ["data/gsm8k_style_train.parquet", "data/nope.parquet"]',
     r"\[data\].train: 'data/nope.parquet': no such file or folder in .+ \(relative paths are read from there\)"),
    ('train = "data/gsm8k_style_train.parquet"\neval = [{path = "data/gsm8k_style_test.parquet", key = 1}]',
     r"\[data\].eval\[0\]: unknown key\(s\) \['key'\]"),
    ('train = "data/gsm8k_style_train.parquet"\nprompt_kee = "question"', r"unknown config key\(s\) \['prompt_kee'\]"),
])
def test_bad_data_config_is_a_config_error_before_any_work(tmp_path, data_toml, msg):
    from trainer.cli import ConfigError, load_run_config

    path = tmp_path / "run.toml"
    path.write_text(f"[data]\n{data_toml}\nreward = \"gsm8k\"\n")
    with pytest.raises(ConfigError, match=msg):
        load_run_config(path, mode="rl")


def test_config_prompts_and_buffer_follow_the_data_table(tmp_path, cache):
    from trainer.data.buffer import config_buffer, config_prompts

    a, b = _parquet_set(tmp_path, "a", 10, "a"), _parquet_set(tmp_path, "b", 30, "b")
    data = {"prompt_key": "text", "answer_key": "gold", "system_prompt": "S"}
    one = config_prompts(a.path, data, where="[data].eval", cache_dir=cache)
    assert [p.prompt for p in one] == [f"a{i}" for i in range(10)] and one[0].system == "S"
    mix = config_prompts([{"path": a.path, "weight": 3}, b.path], data, where="[data].sft", cache_dir=cache)
    assert len(mix) == 40 and sum(p.prompt.startswith("a") for p in mix) > 20  # weight 3 beats the size 10:30
    buf = config_buffer([a.path, b.path], data, where="[data].train", seed=1, cache_dir=cache)
    assert len(buf) == 40 and {p.system for p in buf.get_prompts(50)} == {"S"}


def test_shipped_gsm8k_style_sets_are_what_the_script_writes(tmp_path):
    import importlib.util
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("make_gsm8k_style", os.path.join(root, "data", "make_gsm8k_style.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for path in mod.write_sets(str(tmp_path)).values():
        shipped = pq.read_table(os.path.join(root, "data", os.path.basename(path)))
        assert shipped.equals(pq.read_table(path)), f"data/{os.path.basename(path)} is stale: rerun the script"
    train = set(pq.read_table(os.path.join(root, "data", "gsm8k_style_train.parquet")).column("question").to_pylist())
    test = pq.read_table(os.path.join(root, "data", "gsm8k_style_test.parquet")).to_pylist()
    assert not train & {r["question"] for r in test}
    from trainer.rewards.rules import gsm8k_reward
    from trainer.types import Sample

    for r in test:  # the reference solution earns the reward; its answer is the arithmetic of the question
        assert gsm8k_reward(Sample(prompt="", tokens=(1,), response=r["solution"], metadata={"answer": r["solution"]}))
