"""Prompt and SFT data: Hugging Face `datasets` loaders with field mapping, and `DataBuffer`, the one stateful object
that hands prompts to the rollout.

A data set is a local JSON / JSONL / parquet file or a `Dataset.save_to_disk` folder, read through `datasets`
(memory-mapped Arrow: a million rows cost a few Python objects, not a million). `DataSpec` says where it is and which
fields hold what: `prompt_key` (the prompt text), `answer_key` (the reference answer of verifiable tasks),
`messages_key` (SFT conversations: a list of {role, content}), an optional `system_prompt`, and the set's `weight`
in a mixture. Every other field travels as metadata to the reward function. Field checks run once, vectorised over
the Arrow columns, and every error names the file, the row and the field.

`PromptSet` is a read-only view of one loaded set that builds a `Prompt` only when a row is read. The buffer walks
each set epoch by epoch in a seeded shuffle (one index array per set) and, for a mixture, draws the set of every
prompt from a seeded stream, so the order depends only on (seed, number drawn) and a run resumed from
`state_dict()` sees exactly the prompts an uninterrupted run would have seen.

`load_jsonl` (a list of Prompts, errors by line) stays for small files and tests.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import threading
import warnings
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

ROLES = ("system", "user", "assistant", "tool")


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One data-set record: the prompt text, the reference answer (verifiable tasks) and free metadata.

    `index` is the record's position in the data (offset by the sizes of the sets before it in a mixture); the
    rollout uses it for bookkeeping. `system` is the system prompt of a chat-format run (None: no system turn).
    """

    prompt: str
    answer: str | None = None
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    index: int = 0
    system: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.prompt, str):
            raise ValueError(f"prompt: must be a string, got {type(self.prompt).__name__}")
        if self.answer is not None and not isinstance(self.answer, str):
            object.__setattr__(self, "answer", str(self.answer))


# ----------------------------------------------------------------------------------------------- JSONL (small)
def parse_prompt_record(record: Any, *, where: str, prompt_key: str = "prompt", answer_key: str = "answer",
                        index: int = 0) -> Prompt:
    """Turn one decoded JSON value into a `Prompt`; `where` ("file:line") prefixes every error."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object with a {prompt_key!r} key, got {type(record).__name__}")
    if prompt_key not in record:
        raise ValueError(f"{where}: missing key {prompt_key!r} (keys present: {sorted(record)}); "
                         f"pass prompt_key= if the data set names it differently")
    prompt = record[prompt_key]
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"{where}: {prompt_key!r} must be a non-empty string, got {prompt!r}")
    answer = record.get(answer_key)
    metadata = {k: v for k, v in record.items() if k not in (prompt_key, answer_key)}
    return Prompt(prompt=prompt, answer=None if answer is None else str(answer), metadata=metadata, index=index)


def load_jsonl(path: str | os.PathLike, *, prompt_key: str = "prompt", answer_key: str = "answer") -> list[Prompt]:
    """Read a small JSONL prompt file into a list. Blank lines are skipped; errors name the file and 1-based line."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: prompt file does not exist")
    prompts: list[Prompt] = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            line = _decode_line(raw, where)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: malformed JSON ({e.msg} at column {e.colno}): {line.strip()[:80]!r}") \
                    from None
            prompts.append(parse_prompt_record(record, where=where, prompt_key=prompt_key, answer_key=answer_key,
                                               index=len(prompts)))
    if not prompts:
        raise ValueError(f"{path}: no prompts found (the file is empty or only blank lines); "
                         f"expected one JSON object per line with a {prompt_key!r} key")
    return prompts


def _decode_line(raw: bytes, where: str) -> str:
    """One line of a data file as text; bytes that are not UTF-8 are an error naming the line and the byte."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{where}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); data files "
                         f"are read as UTF-8: re-save the file as UTF-8 or drop the line") from None


def write_jsonl(path: str | os.PathLike, records: Sequence[Mapping[str, Any]]) -> None:
    """Write records one JSON object per line (sorted keys, so regenerated files diff cleanly)."""
    os.makedirs(os.path.dirname(os.fspath(path)) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(dict(r), sort_keys=True) + "\n")


# ----------------------------------------------------------------------------------------------- specs
@dataclasses.dataclass(frozen=True)
class DataSpec:
    """One data set and its field mapping (a `[data]` entry of the run config).

    answer_key None: the answer is read when an "answer" field exists; a name given explicitly must exist.
    messages_key: SFT conversations; the prompt field is then optional (the first user turn is the prompt).
    split: the split of a `DatasetDict.save_to_disk` folder (default "train").
    """

    path: str
    prompt_key: str = "prompt"
    answer_key: str | None = None
    messages_key: str | None = None
    system_prompt: str | None = None
    weight: float = 1.0
    split: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", os.fspath(self.path))
        for name in ("path", "prompt_key"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"{name}: must be a non-empty string, got {getattr(self, name)!r}")
        for name in ("answer_key", "messages_key", "system_prompt", "split"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, str):
                raise ValueError(f"{name}: must be a string, got {v!r}")
        if not isinstance(self.weight, int | float) or not self.weight > 0:
            raise ValueError(f"weight: must be a number > 0, got {self.weight!r}")


SPEC_KEYS = tuple(f.name for f in dataclasses.fields(DataSpec))
MAPPING_KEYS = ("prompt_key", "answer_key", "messages_key", "system_prompt", "split")


def data_specs(value: Any, defaults: Mapping[str, Any] | None = None, *, where: str = "[data].train") -> list[DataSpec]:
    """Specs from a config value: a path, a list of paths, or a list of tables {path, weight, <mapping keys>}.

    `defaults` holds the [data]-level mapping keys (prompt_key, ...); a table's own keys override them.
    """
    defaults = {k: v for k, v in (defaults or {}).items() if k in MAPPING_KEYS}
    items = value if isinstance(value, list) else [value]
    if not items:
        raise ValueError(f"{where}: empty list; give a data file, or a list of {{path = ..., weight = ...}} tables")
    specs = []
    for i, item in enumerate(items):
        at = f"{where}[{i}]" if isinstance(value, list) else where
        if isinstance(item, str | os.PathLike):
            item = {"path": item}
        if not isinstance(item, Mapping):
            raise ValueError(f"{at}: expected a path or a table with a 'path' key, got {type(item).__name__}")
        unknown = sorted(set(item) - set(SPEC_KEYS))
        if unknown:
            raise ValueError(f"{at}: unknown key(s) {unknown}; known: {sorted(SPEC_KEYS)}")
        if "path" not in item:
            raise ValueError(f"{at}: missing 'path' (the data file or save_to_disk folder)")
        try:
            specs.append(DataSpec(**{**defaults, **item}))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{at}.{e}") from None
    return specs


# ----------------------------------------------------------------------------------------------- loading
_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def _file_format(path: Path) -> str:
    suffixes = [s for s in path.suffixes if s not in (".gz", ".bz2", ".xz", ".zst")]
    fmt = _FORMATS.get(suffixes[-1] if suffixes else "")
    if fmt is None:
        raise ValueError(f"{path}: unsupported data file type {''.join(path.suffixes) or '(no extension)'!r}; "
                         f"use .json, .jsonl, .parquet or a Dataset.save_to_disk folder")
    return fmt


def _first_bad_utf8_line(path: Path) -> str | None:
    """The error naming the first line of a text file that is not UTF-8 (None: every line is)."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                _decode_line(raw, f"{path}: line {lineno}")
            except ValueError as e:
                return str(e)
    return None


def _locate_json_error(path: Path) -> str:
    """Why `datasets` could not read a JSON/JSONL file, by row (1-based line for JSONL): bytes that are not UTF-8, a
    bad line, a non-object row, or a field whose type differs from its first occurrence."""
    bad_text = _first_bad_utf8_line(path)
    if bad_text is not None:
        return bad_text
    text = path.read_text(encoding="utf-8", errors="replace")
    if text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            return f"{path}: line {e.lineno}: malformed JSON ({e.msg} at column {e.colno})"
        numbered = list(enumerate(rows))
        label = "row"
    else:
        numbered, label = [], "line"
        for lineno, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                numbered.append((lineno, json.loads(line)))
            except json.JSONDecodeError as e:
                return f"{path}: line {lineno}: malformed JSON ({e.msg} at column {e.colno}): {line.strip()[:80]!r}"
    if not numbered:
        return f"{path}: the data set has no rows (the file is empty or blank); give one JSON object per line"
    seen: dict[str, tuple[int, str]] = {}
    for n, row in numbered:
        if not isinstance(row, dict):
            return f"{path}: {label} {n}: expected a JSON object, got {type(row).__name__}"
        for k, v in row.items():
            kind = type(v).__name__
            if v is None or kind in ("int", "float") and seen.get(k, (0, kind))[1] in ("int", "float"):
                continue
            if k in seen and seen[k][1] != kind:
                return (f"{path}: {label} {n}: field {k!r} is a {kind}, but {label} {seen[k][0]} has a "
                        f"{seen[k][1]}; a field must have one type in every row")
            seen.setdefault(k, (n, kind))
    return f"{path}: not a readable JSON/JSONL data set"


def load_dataset_file(path: str | os.PathLike, *, split: str | None = None,
                      cache_dir: str | None = None) -> datasets.Dataset:
    """A local data file or save_to_disk folder as a memory-mapped `datasets.Dataset`.

    JSON/JSONL/parquet are converted once into `datasets`' Arrow cache (cache_dir, default HF_DATASETS_CACHE).
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: data file does not exist")
    if p.is_dir():
        if not any((p / f).is_file() for f in ("dataset_dict.json", "dataset_info.json", "state.json")):
            raise ValueError(f"{p}: a folder that is not a Dataset.save_to_disk folder (no state.json or "
                             f"dataset_dict.json); give the data file itself")
        ds = datasets.load_from_disk(str(p))
        if isinstance(ds, datasets.DatasetDict):
            name = split or "train"
            if name not in ds:
                raise ValueError(f"{p}: no split {name!r} (splits: {sorted(ds)}); set split = \"...\"")
            ds = ds[name]
    else:
        fmt = _file_format(p)
        if fmt == "parquet":  # the footer names a corrupt or empty file before `datasets` builds anything
            try:
                rows = pq.read_metadata(p).num_rows
            except (pa.ArrowException, OSError) as e:
                raise ValueError(f"{p}: not a readable parquet file ({e})") from e
            if rows == 0:
                raise ValueError(f"{p}: the data set has no rows")
        try:
            ds = datasets.load_dataset(fmt, data_files=str(p), split="train", cache_dir=cache_dir)
        except Exception as e:  # noqa: BLE001 - any reader failure becomes one message naming the file and row
            if fmt == "json":
                raise ValueError(_locate_json_error(p)) from e
            raise ValueError(f"{p}: not a readable {fmt} file ({type(e).__name__}: {str(e)[:200]})") from e
    if len(ds) == 0:
        raise ValueError(f"{p}: the data set has no rows")
    _check_utf8(ds, p)
    return ds


def _check_utf8(ds: datasets.Dataset, path: Path) -> None:
    """Every text of the set is valid UTF-8. The JSON reader keeps bytes that are not, and a row holding them would
    fail with a UnicodeDecodeError only when it is read, mid-run; one vectorised pass over the Arrow data finds it
    now, then the error path names the line (JSON files) or the row and field (parquet, save_to_disk folders)."""
    try:
        ds.data.table.validate(full=True)
    except pa.ArrowInvalid as e:
        raise ValueError(_locate_bad_utf8(ds, path) or f"{path}: the data set's Arrow data is invalid ({e})") from None


def _locate_bad_utf8(ds: datasets.Dataset, path: Path) -> str | None:
    """Where the first text that is not UTF-8 is: its 1-based line in a JSON/JSONL file, else its row and field."""
    if path.is_file() and _file_format(path) == "json":
        return _first_bad_utf8_line(path)
    for key in ds.column_names:
        col = ds.data.table.column(key)
        if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
            continue
        for row, value in enumerate(col.cast(pa.large_binary()).to_pylist()):
            if value is not None:
                try:
                    _decode_line(value, f"{path}: row {row}: field {key!r}")
                except ValueError as e:
                    return str(e)
    return None


def _first_row(mask: pa.ChunkedArray | pa.Array) -> int | None:
    """Index of the first True of a boolean Arrow array (None when none is)."""
    hits = pc.indices_nonzero(pc.fill_null(mask, False))
    return int(hits[0].as_py()) if len(hits) else None


def _check_text(ds: datasets.Dataset, key: str, where: str, *, allow_numbers: bool = False, why: str = "") -> None:
    """Field `key` exists, is text (or a number when allowed) and is set in every row; `why` (why every row needs
    it) is added to the messages of a missing field or row."""
    if key not in ds.column_names:
        raise ValueError(f"{where}: row 0: missing field {key!r} (fields: {ds.column_names}){why}; map it with "
                         f"[data].{'answer_key' if allow_numbers else 'prompt_key'} = \"<field>\"")
    col = ds.data.column(key)
    text = pa.types.is_string(col.type) or pa.types.is_large_string(col.type)
    # A JSON field whose rows mix types (text in some, numbers in others) arrives as a JSON-typed column.
    mixed = getattr(col.type, "extension_name", None) == "arrow.json"
    numbers = pa.types.is_integer(col.type) or pa.types.is_floating(col.type) or mixed
    if not text and not (allow_numbers and numbers) and not pa.types.is_null(col.type):
        for row, value in enumerate(ds[key]):  # error path only: find the first row that is not text
            if not isinstance(value, str):
                raise ValueError(f"{where}: row {row}: field {key!r} must be text, got {type(value).__name__} "
                                 f"{str(value)[:60]!r}")
        raise ValueError(f"{where}: row 0: field {key!r} must be text, got Arrow type {col.type}")
    if mixed:
        col = pa.chunked_array([c.storage for c in col.chunks], type=col.type.storage_type)
    row = _first_row(pc.is_null(col))
    if row is not None:
        raise ValueError(f"{where}: row {row}: field {key!r} is missing (null){why}")
    if text:
        row = _first_row(pc.equal(pc.utf8_length(col), 0))
        if row is not None:
            raise ValueError(f"{where}: row {row}: field {key!r} is an empty string")


def _check_messages(ds: datasets.Dataset, key: str, where: str) -> None:
    """Field `key` holds a non-empty list of {role, content} per row, with known roles and an assistant turn."""
    if key not in ds.column_names:
        raise ValueError(f"{where}: row 0: missing field {key!r} (fields: {ds.column_names}); map it with "
                         f"[data].messages_key = \"<field>\"")
    col = ds.data.column(key).combine_chunks()
    if not (pa.types.is_list(col.type) or pa.types.is_large_list(col.type)) or \
            not pa.types.is_struct(col.type.value_type) or \
            {"role", "content"} - {f.name for f in col.type.value_type}:
        raise ValueError(f"{where}: row 0: field {key!r} must be a list of {{role, content}} messages, got Arrow "
                         f"type {col.type}")
    row = _first_row(pc.is_null(col))
    if row is not None:
        raise ValueError(f"{where}: row {row}: field {key!r} is missing (null)")
    lengths = pc.list_value_length(col).to_numpy(zero_copy_only=False)
    row = _first_row(pa.array(lengths == 0))
    if row is not None:
        raise ValueError(f"{where}: row {row}: field {key!r} is an empty conversation")
    flat = pc.list_flatten(col)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    roles = flat.field("role")
    bad = _first_row(pc.invert(pc.is_in(roles, value_set=pa.array(ROLES))))
    if bad is not None:
        row = int(np.searchsorted(offsets, bad, side="right") - 1)
        raise ValueError(f"{where}: row {row}: field {key!r} message {bad - offsets[row]}: role "
                         f"{roles[bad].as_py()!r} is not one of {ROLES}")
    bad = _first_row(pc.is_null(flat.field("content")))
    if bad is not None:
        row = int(np.searchsorted(offsets, bad, side="right") - 1)
        raise ValueError(f"{where}: row {row}: field {key!r} message {bad - offsets[row]}: no content")
    is_assistant = pc.equal(roles, "assistant").to_numpy(zero_copy_only=False).astype(np.int64)
    per_row = np.add.reduceat(is_assistant, offsets[:-1]) if len(is_assistant) else np.zeros(0)
    row = _first_row(pa.array(per_row == 0))
    if row is not None:
        raise ValueError(f"{where}: row {row}: field {key!r} has no assistant message, so nothing to train on")


@dataclasses.dataclass(frozen=True)
class PromptSet:
    """A read-only `Sequence[Prompt]` over one loaded data set; rows become Prompts only when read.

    `offset` shifts `Prompt.index` (the set's position in a mixture).
    """

    dataset: datasets.Dataset
    spec: DataSpec
    offset: int = 0

    def __len__(self) -> int:
        return len(self.dataset)

    @property
    def has_answers(self) -> bool:
        """The set has an answer field (checked when it loaded: then every row has one)."""
        key = self.spec.answer_key or "answer"
        return key in self.dataset.column_names and not pa.types.is_null(self.dataset.data.column(key).type)

    def __getitem__(self, i: int) -> Prompt:
        if not -len(self) <= i < len(self):
            raise IndexError(f"row {i} outside a data set of {len(self)} rows ({self.spec.path})")
        return self.take([i % len(self)])[0]

    def __iter__(self):
        for start in range(0, len(self), 1024):
            yield from self.take(range(start, min(start + 1024, len(self))))

    def take(self, rows: Sequence[int] | np.ndarray) -> list[Prompt]:
        """The Prompts of these rows (one columnar read for the whole list)."""
        rows = [int(r) for r in rows]
        if not rows:
            return []
        cols = self.dataset[rows]  # {field: [value per row]}
        return [self._prompt({k: v[j] for k, v in cols.items()}, r) for j, r in enumerate(rows)]

    def _prompt(self, row: dict[str, Any], index: int) -> Prompt:
        s = self.spec
        answer_key = s.answer_key or "answer"
        used = {s.prompt_key, answer_key, s.messages_key}
        meta = {k: v for k, v in row.items() if k not in used}
        answer = row.get(answer_key)
        if s.messages_key is not None:
            messages = [{"role": m["role"], "content": m["content"]} for m in row[s.messages_key]]
            if s.system_prompt and messages[0]["role"] != "system":
                messages = [{"role": "system", "content": s.system_prompt}, *messages]
            meta["messages"] = messages
            prompt = row.get(s.prompt_key) or next((m["content"] for m in messages if m["role"] == "user"), "")
        else:
            prompt = row[s.prompt_key]
            if s.system_prompt and answer is not None:
                meta["messages"] = [{"role": "system", "content": s.system_prompt},
                                    {"role": "user", "content": prompt},
                                    {"role": "assistant", "content": str(answer)}]
        return Prompt(prompt=prompt, answer=None if answer is None else str(answer), metadata=meta,
                      index=self.offset + index, system=s.system_prompt)


def _check_answers(ds: datasets.Dataset, spec: DataSpec, where: str, *, required: bool) -> None:
    """The answer field. A named `answer_key` must be set in every row. The default "answer" field, when the set has
    it, too: a row without one would be scored against None, or (SFT) trained on the text "None". `required` (SFT
    from prompt/answer pairs: the answer is the target) needs the field whatever its name. A set with no answer
    field at all is left to the caller: a reward may not read one."""
    key = spec.answer_key or "answer"
    absent = key not in ds.column_names or pa.types.is_null(ds.data.column(key).type)
    if absent and spec.answer_key is None and not required:
        return
    why = (", and SFT from prompt/answer pairs trains on the answer (without one it would train on the text \"None\"); "
           "give every row an answer or SFT on conversations ([data].messages_key)") if required else \
        ", and the reward would score that row against None; give every row an answer or drop the row"
    _check_text(ds, key, where, allow_numbers=True, why=why)


def load_prompts(spec: DataSpec | str | os.PathLike, *, offset: int = 0, cache_dir: str | None = None,
                 require_answer: bool = False) -> PromptSet:
    """Load and check one data set: its fields exist, have the right types and are set in every row (the answer:
    see `_check_answers`; `require_answer` is for SFT examples, and a set of conversations needs none)."""
    if not isinstance(spec, DataSpec):
        spec = DataSpec(path=spec)
    ds = load_dataset_file(spec.path, split=spec.split, cache_dir=cache_dir)
    where = spec.path
    if spec.messages_key is not None:
        _check_messages(ds, spec.messages_key, where)
        if spec.prompt_key in ds.column_names:
            _check_text(ds, spec.prompt_key, where)
    else:
        _check_text(ds, spec.prompt_key, where)
    _check_answers(ds, spec, where, required=require_answer and spec.messages_key is None)
    return PromptSet(dataset=ds, spec=spec, offset=offset)


def load_mixture(specs: Sequence[DataSpec], *, cache_dir: str | None = None,
                 require_answer: bool = False) -> list[PromptSet]:
    """Load every set of a mixture; Prompt indices run on across the sets (set k starts after sets 0..k-1)."""
    sets, offset = [], 0
    for spec in specs:
        sets.append(load_prompts(spec, offset=offset, cache_dir=cache_dir, require_answer=require_answer))
        offset += len(sets[-1])
    return sets


# ----------------------------------------------------------------------------------------------- buffer
def epoch_permutation(num_prompts: int, seed: int, epoch_id: int, shuffle: bool = True) -> np.ndarray:
    """The order of epoch `epoch_id`: a fresh permutation per epoch, a pure function of (seed, epoch_id)."""
    if not shuffle:
        return np.arange(num_prompts)
    return np.random.default_rng([seed, epoch_id]).permutation(num_prompts)


_MIX_BLOCK = 4096  # mixture choices are drawn in seeded blocks of this many prompts


def mixture_choices(weights: Sequence[float], seed: int, block: int) -> np.ndarray:
    """Which set each prompt of draw block `block` comes from: a pure function of (weights, seed, block)."""
    p = np.asarray(weights, dtype=np.float64)
    return np.random.default_rng([seed, 0x6D6978, block]).choice(len(p), size=_MIX_BLOCK, p=p / p.sum())


def as_prompts(items: Sequence[Any], *, offset: int = 0) -> Sequence[Prompt]:
    """A set as `Prompt`s: a loaded PromptSet or a list of Prompts as they are; plain strings (the seeds'
    `DataBuffer(["1+1=", ...])`) and dicts with a "prompt" key (and "answer", metadata) become Prompts whose index is
    their position (+ `offset`, the rows of the sets before this one in a mixture)."""
    if isinstance(items, PromptSet) or all(isinstance(x, Prompt) for x in items):
        return items
    out = []
    for i, x in enumerate(items):
        if isinstance(x, Prompt):
            out.append(x)
        elif isinstance(x, str):
            if not x:
                raise ValueError(f"prompts[{i}]: an empty prompt; give a non-empty string")
            out.append(Prompt(prompt=x, index=offset + i))
        elif isinstance(x, Mapping):
            out.append(parse_prompt_record(dict(x), where=f"prompts[{i}]", index=offset + i))
        else:
            raise ValueError(f"prompts[{i}]: expected a string, a dict with a \"prompt\" key or a Prompt, got "
                             f"{type(x).__name__}")
    return out


class DataBuffer:
    """Hands out prompts in seeded, per-epoch shuffled order, from one set or a weighted mixture of sets.

    Each set keeps its own (epoch_id, sample_offset) and a shuffled index array (8 bytes per row); `get_prompts(n)`
    reads the next n rows, crossing into the set's next epoch (a new shuffle) when it runs out, so every prompt of
    a set is seen once per epoch of that set. In a mixture, prompt k comes from set `mixture_choices(...)[k]`, so a
    set of weight w supplies a fraction w / sum(weights) of the prompts whatever its size.
    """

    def __init__(self, prompts: Sequence[Prompt], *, seed: int = 0, shuffle: bool = True) -> None:
        self._init([prompts], [1.0], seed, shuffle)

    @classmethod
    def mixture(cls, sets: Sequence[Sequence[Prompt]], weights: Sequence[float] | None = None, *, seed: int = 0,
                shuffle: bool = True) -> DataBuffer:
        """A buffer over several sets drawn with probabilities proportional to `weights` (default: equal)."""
        weights = [1.0] * len(sets) if weights is None else [float(w) for w in weights]
        if len(weights) != len(sets):
            raise ValueError(f"weights: {len(weights)} weights for {len(sets)} data sets; give one per set")
        if not all(w > 0 for w in weights):
            raise ValueError(f"weights: must all be > 0, got {weights}")
        buf = cls.__new__(cls)
        buf._init(sets, weights, seed, shuffle)
        return buf

    @classmethod
    def from_jsonl(cls, path: str | os.PathLike, *, seed: int = 0, shuffle: bool = True, **kw: Any) -> DataBuffer:
        return cls(load_jsonl(path, **kw), seed=seed, shuffle=shuffle)

    @classmethod
    def from_specs(cls, specs: Sequence[DataSpec], *, seed: int = 0, shuffle: bool = True,
                   cache_dir: str | None = None) -> DataBuffer:
        """Load the sets of `specs` (see `data_specs`) and mix them by their weights."""
        return cls.mixture(load_mixture(specs, cache_dir=cache_dir), [s.weight for s in specs], seed=seed,
                           shuffle=shuffle)

    def _init(self, sets: Sequence[Sequence[Prompt]], weights: list[float], seed: int, shuffle: bool) -> None:
        if not sets or any(len(s) == 0 for s in sets):
            raise ValueError("prompts: the data buffer needs at least one prompt in every set (check the data files)")
        offsets = np.cumsum([0] + [len(s) for s in sets[:-1]]).tolist()
        self.sets = [as_prompts(s, offset=o) for s, o in zip(sets, offsets, strict=True)]
        self.weights = weights
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.draws = 0  # prompts handed out so far (selects the mixture block)
        self.positions = [[0, 0] for _ in self.sets]  # per set: [epoch_id, sample_offset]
        self._orders = [epoch_permutation(len(s), self.seed, 0, self.shuffle) for s in self.sets]
        self._block: tuple[int, np.ndarray] | None = None
        # Async rollouts draw in a worker thread while the trainer's thread checkpoints: the position must never be
        # read and advanced at once (ResumePoints snapshots it in the drawing thread). A second reader is a bug,
        # raised at once rather than a checkpoint of a torn position.
        self._reading = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:  # copies and pickles (a process pool) get their own lock
        return {k: v for k, v in self.__dict__.items() if k != "_reading"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reading = threading.Lock()

    @contextlib.contextmanager
    def _exclusive(self, what: str) -> Iterator[None]:
        if not self._reading.acquire(blocking=False):
            raise RuntimeError(f"DataBuffer.{what}: another thread is reading or advancing this buffer; its position "
                               f"must be read where it is drawn (trainer.rollout.resume.ResumePoints)")
        try:
            yield
        finally:
            self._reading.release()

    @property
    def prompts(self) -> Sequence[Prompt]:
        """The first (for a single set: the only) set."""
        return self.sets[0]

    @property
    def epoch_id(self) -> int:
        return self.positions[0][0]

    @property
    def sample_offset(self) -> int:
        return self.positions[0][1]

    def __len__(self) -> int:
        return sum(len(s) for s in self.sets)

    def _choice(self, k: int) -> int:
        if len(self.sets) == 1:
            return 0
        block = k // _MIX_BLOCK
        if self._block is None or self._block[0] != block:
            self._block = (block, mixture_choices(self.weights, self.seed, block))
        return int(self._block[1][k % _MIX_BLOCK])

    def _next_rows(self, s: int, take: int) -> np.ndarray:
        """The next `take` rows of set s (within its current epoch), advancing its position."""
        epoch, offset = self.positions[s]
        size = len(self.sets[s])
        if offset == size:
            epoch, offset = epoch + 1, 0
            self._orders[s] = epoch_permutation(size, self.seed, epoch, self.shuffle)
        take = min(take, size - offset)
        rows = self._orders[s][offset:offset + take]
        self.positions[s] = [epoch, offset + take]
        return rows

    def get_prompts(self, n: int) -> list[Prompt]:
        if n < 0:
            raise ValueError(f"n: must be >= 0, got {n}")
        with self._exclusive("get_prompts"):
            return self._get_prompts(n)

    def _get_prompts(self, n: int) -> list[Prompt]:
        picks = [self._choice(self.draws + k) for k in range(n)]
        out: list[Prompt | None] = [None] * n
        for s in sorted(set(picks)):
            slots = [k for k, c in enumerate(picks) if c == s]
            rows: list[int] = []
            while len(rows) < len(slots):
                rows.extend(int(r) for r in self._next_rows(s, len(slots) - len(rows)))
            src = self.sets[s]
            got = src.take(rows) if isinstance(src, PromptSet) else [src[r] for r in rows]
            for k, p in zip(slots, got):
                out[k] = p
        self.draws += n
        return out  # type: ignore[return-value]

    def state_dict(self) -> dict[str, Any]:
        with self._exclusive("state_dict"):
            return self._state_dict()

    def _state_dict(self) -> dict[str, Any]:
        return {"epoch_id": self.epoch_id, "sample_offset": self.sample_offset, "seed": self.seed,
                "shuffle": self.shuffle, "num_prompts": len(self), "draws": self.draws,
                "sets": [{"epoch_id": e, "sample_offset": o, "num_prompts": len(s)}
                         for (e, o), s in zip(self.positions, self.sets)]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        missing = {"epoch_id", "sample_offset", "seed", "num_prompts"} - set(state)
        if missing:
            raise ValueError(f"state: missing keys {sorted(missing)}; pass a dict from DataBuffer.state_dict()")
        if int(state["num_prompts"]) != len(self):
            raise ValueError(f"state: saved for {state['num_prompts']} prompts but this buffer holds "
                             f"{len(self)}; resume with the same prompt file(s)")
        sets = state.get("sets") or [{"epoch_id": state["epoch_id"], "sample_offset": state["sample_offset"],
                                      "num_prompts": state["num_prompts"]}]
        if len(sets) != len(self.sets):
            raise ValueError(f"state: saved for {len(sets)} data sets, this buffer mixes {len(self.sets)}; resume "
                             f"with the same [data].train list")
        for i, (saved, s) in enumerate(zip(sets, self.sets)):
            if int(saved["num_prompts"]) != len(s) or not 0 <= int(saved["sample_offset"]) <= len(s):
                raise ValueError(f"state: set {i} saved with {saved['num_prompts']} prompts at sample_offset="
                                 f"{saved['sample_offset']}, this set holds {len(s)}; resume with the same files")
        self.seed = int(state["seed"])
        self.shuffle = bool(state.get("shuffle", True))
        self.draws = int(state.get("draws", 0))
        self.positions = [[int(s["epoch_id"]), int(s["sample_offset"])] for s in sets]
        self._orders = [epoch_permutation(len(s), self.seed, e, self.shuffle)
                        for s, (e, _) in zip(self.sets, self.positions)]
        self._block = None


# ----------------------------------------------------------------------------------------------- run config
def config_prompts(value: Any, data: Mapping[str, Any], *, where: str, seed: int = 0,
                   cache_dir: str | None = None, require_answer: bool = False) -> list[Prompt]:
    """The prompts of a [data] entry as a list (evaluation and SFT sets, which are read whole; `require_answer`:
    SFT examples, see `load_prompts`).

    One set: its rows in order. A mixture: one weighted pass, sum of the set sizes long, drawn as the buffer draws
    (a set of weight 2 appears twice as often as its size alone would give).
    """
    specs = data_specs(value, data, where=where)
    sets = load_mixture(specs, cache_dir=cache_dir, require_answer=require_answer)
    if len(sets) == 1:
        return list(sets[0])
    buf = DataBuffer.mixture(sets, [s.weight for s in specs], seed=seed)
    return buf.get_prompts(len(buf))


def config_buffer(value: Any, data: Mapping[str, Any], *, where: str, seed: int = 0,
                  cache_dir: str | None = None) -> DataBuffer:
    """The DataBuffer of a [data] entry (RL prompts): one set or a weighted mixture, rows read on demand."""
    return DataBuffer.from_specs(data_specs(value, data, where=where), seed=seed, cache_dir=cache_dir)


# ----------------------------------------------------------------------------------------------- vocabulary
def unknown_characters(tokenizer: Any, texts: Sequence[str]) -> Counter[str]:
    """The text the tokenizer has no token for, with counts: each span it encodes to its unk token (a character, for
    the character and SentencePiece vocabularies that have one; byte-level vocabularies never produce it). A slow
    tokenizer, which gives no offsets, counts the unk tokens under their own name."""
    unk = tokenizer.unk_token_id
    if unk is None or not texts:
        return Counter()
    fast = tokenizer.is_fast
    enc = tokenizer(list(texts), add_special_tokens=False, return_offsets_mapping=fast)
    found: Counter[str] = Counter()
    for i, ids in enumerate(enc["input_ids"]):
        spans = enc["offset_mapping"][i] if fast else [None] * len(ids)
        found.update(texts[i][span[0]:span[1]] if span else tokenizer.unk_token
                     for tid, span in zip(ids, spans) if tid == unk)
    return found


def warn_unknown_characters(tokenizer: Any, texts: Sequence[str], *, where: str) -> int:
    """One warning for a data set whose text holds characters outside the tokenizer's vocabulary (they become its
    unk token, and the model never sees what they were); returns how many there are."""
    found = unknown_characters(tokenizer, texts)
    total = sum(found.values())
    if total:
        common = ", ".join(f"{c!r} x{n}" for c, n in found.most_common(5))
        warnings.warn(f"{where}: {total} characters are outside the tokenizer's vocabulary and become "
                      f"{tokenizer.unk_token} (most common: {common}); the model cannot tell them apart: clean the "
                      f"data or use a tokenizer that covers them", stacklevel=2)
    return total
