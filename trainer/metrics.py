"""Metrics sinks: a `MetricsLogger` protocol and the JSONL logger every run writes (one JSON object per line)."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class MetricsLogger(Protocol):
    """Anything with log(step, metrics) and close(); metrics are host numbers (read from futures first)."""

    def log(self, step: int, metrics: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return repr(v)  # JSON has no nan/inf; keep them visible as strings
    if isinstance(v, (int, float, str, bool)) or v is None:
        return v
    if hasattr(v, "item"):
        return _jsonable(v.item())  # host sync (marked): only host values should reach a logger
    return repr(v)


def truncate_jsonl(path: str | os.PathLike, last_step: int) -> int:
    """Drop the rows of a metrics log whose step is beyond `last_step` (and a torn last line, from a kill mid-write);
    returns how many rows were dropped. A run resumed from its step-5 checkpoint after dying at step 8 logs steps
    6.. again: without this the log would hold them twice. Rewritten through a temporary file and a rename, so a
    kill here leaves the old log or the new one."""
    path = Path(path)
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line) if line.strip() else None
        except json.JSONDecodeError:
            row = None
        if isinstance(row, dict) and int(row.get("step", 0)) <= last_step:
            kept.append(line)
        elif line.strip():
            dropped += 1
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(f"{line}\n" for line in kept), encoding="utf-8")
        os.replace(tmp, path)
    return dropped


class JSONLLogger:
    """Appends {"step": s, "time": t, **metrics} lines to `path` (rank 0 only when `enabled` is False elsewhere).

    `keep_through`: the step the run starts after (0 fresh, the checkpoint's step on resume); rows of later steps
    left by an earlier attempt are removed first, so each step appears in the log once. None appends to the file as
    it is."""

    def __init__(self, path: str | os.PathLike, *, enabled: bool = True, keep_through: int | None = None) -> None:
        self.path = Path(path)
        self.enabled = enabled
        self._fh = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if keep_through is not None:
                truncate_jsonl(self.path, keep_through)
            self._fh = self.path.open("a", encoding="utf-8")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if self._fh is None:
            return
        row = {"step": int(step), "time": time.time(), **{k: _jsonable(v) for k, v in metrics.items()}}
        self._fh.write(json.dumps(row) + "\n")
        self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows a JSONLLogger wrote."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


class _LineProgress:
    """The progress of a run whose stderr is not a terminal (a log file, CI): one plain line every `every` steps and
    at the end, instead of tqdm's redraws (each one a carriage-return line in a file)."""

    def __init__(self, total: int, initial: int, desc: str, every: int) -> None:
        self.total, self.n, self.desc, self.every = total, initial, desc, every
        self.postfix: dict[str, Any] = {}
        self.t0 = time.perf_counter()

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.n % self.every == 0 or self.n == self.total:
            items = "".join(f" {k}={v}" for k, v in self.postfix.items())
            rate = (time.perf_counter() - self.t0) / max(self.n, 1)
            print(f"{self.desc}: step {self.n}/{self.total}{items} ({rate:.2f} s/step)", file=sys.stderr, flush=True)

    def set_postfix(self, **kw: Any) -> None:
        self.postfix = kw

    def __enter__(self) -> _LineProgress:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


def progress(total: int, *, initial: int, desc: str, enabled: bool, stream: Any = None) -> Any:
    """tqdm on a terminal; a line every ~10 % of the steps elsewhere; nothing where not `enabled` (other ranks)."""
    from tqdm import tqdm

    stream = stream or sys.stderr
    if not enabled or stream.isatty():
        return tqdm(total=total, initial=initial, desc=desc, disable=not enabled)
    return _LineProgress(total, initial, desc, every=max(1, total // 10))
