"""Prompt data: JSONL loaders and `DataBuffer`, the one stateful object that hands prompts to the rollout.

A prompt record is `{"prompt": str, "answer": str (optional), ...any other keys}`; other keys travel as
metadata to the reward function. The buffer walks the records epoch by epoch in a seeded shuffle, so the
order only depends on (seed, epoch_id, sample_offset) and a run resumed from `state_dict()` sees exactly the
prompts an uninterrupted run would have seen.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One data-set record: the prompt text, the reference answer (verifiable tasks) and free metadata.

    `index` is the record's position in the data set; the rollout uses it for seeds and bookkeeping.
    """

    prompt: str
    answer: str | None = None
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    index: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.prompt, str):
            raise ValueError(f"prompt: must be a string, got {type(self.prompt).__name__}")
        if self.answer is not None and not isinstance(self.answer, str):
            object.__setattr__(self, "answer", str(self.answer))


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
    """Read a JSONL prompt file. Blank lines are skipped; every error names the file and the 1-based line."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: prompt file does not exist")
    prompts: list[Prompt] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
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


def write_jsonl(path: str | os.PathLike, records: Sequence[Mapping[str, Any]]) -> None:
    """Write records one JSON object per line (sorted keys, so regenerated files diff cleanly)."""
    os.makedirs(os.path.dirname(os.fspath(path)) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(dict(r), sort_keys=True) + "\n")


def epoch_permutation(num_prompts: int, seed: int, epoch_id: int, shuffle: bool = True) -> np.ndarray:
    """The order of epoch `epoch_id`: a fresh permutation per epoch, a pure function of (seed, epoch_id)."""
    if not shuffle:
        return np.arange(num_prompts)
    return np.random.default_rng([seed, epoch_id]).permutation(num_prompts)


class DataBuffer:
    """Hands out prompts in seeded, per-epoch shuffled order; its whole state is (epoch_id, sample_offset).

    `get_prompts(n)` returns the next n prompts, crossing into the next epoch (with a new shuffle) when the
    current one runs out, so every prompt is seen once per epoch.
    """

    def __init__(self, prompts: Sequence[Prompt], *, seed: int = 0, shuffle: bool = True) -> None:
        if len(prompts) == 0:
            raise ValueError("prompts: the data buffer needs at least one prompt (check the prompt file)")
        self.prompts = list(prompts)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.epoch_id = 0
        self.sample_offset = 0  # position inside the current epoch's permutation
        self._order = epoch_permutation(len(self.prompts), self.seed, 0, self.shuffle)

    @classmethod
    def from_jsonl(cls, path: str | os.PathLike, *, seed: int = 0, shuffle: bool = True, **kw: Any) -> DataBuffer:
        return cls(load_jsonl(path, **kw), seed=seed, shuffle=shuffle)

    def __len__(self) -> int:
        return len(self.prompts)

    def get_prompts(self, n: int) -> list[Prompt]:
        if n < 0:
            raise ValueError(f"n: must be >= 0, got {n}")
        out: list[Prompt] = []
        while len(out) < n:
            if self.sample_offset == len(self.prompts):
                self.epoch_id += 1
                self.sample_offset = 0
                self._order = epoch_permutation(len(self.prompts), self.seed, self.epoch_id, self.shuffle)
            take = min(n - len(out), len(self.prompts) - self.sample_offset)
            idx = self._order[self.sample_offset:self.sample_offset + take]
            out.extend(self.prompts[i] for i in idx)
            self.sample_offset += take
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"epoch_id": self.epoch_id, "sample_offset": self.sample_offset, "seed": self.seed,
                "shuffle": self.shuffle, "num_prompts": len(self.prompts)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        missing = {"epoch_id", "sample_offset", "seed", "num_prompts"} - set(state)
        if missing:
            raise ValueError(f"state: missing keys {sorted(missing)}; pass a dict from DataBuffer.state_dict()")
        if int(state["num_prompts"]) != len(self.prompts):
            raise ValueError(f"state: saved for {state['num_prompts']} prompts but this buffer holds "
                             f"{len(self.prompts)}; resume with the same prompt file")
        if not 0 <= int(state["sample_offset"]) <= len(self.prompts):
            raise ValueError(f"state: sample_offset={state['sample_offset']} outside [0, {len(self.prompts)}]")
        self.seed = int(state["seed"])
        self.shuffle = bool(state.get("shuffle", True))
        self.epoch_id = int(state["epoch_id"])
        self.sample_offset = int(state["sample_offset"])
        self._order = epoch_permutation(len(self.prompts), self.seed, self.epoch_id, self.shuffle)
