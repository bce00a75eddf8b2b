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


def open_logger(logger: MetricsLogger | Any, path: str | os.PathLike, *, enabled: bool,
                keep_through: int) -> MetricsLogger:
    """A loop's logger: the one given; or a factory's, called with the step the run starts after (0 fresh, the
    checkpoint's step on resume: each backend drops what an earlier attempt logged past it); or the JSONL log at
    `path`."""
    if logger is None:
        return JSONLLogger(path, enabled=enabled, keep_through=keep_through)
    if isinstance(logger, MetricsLogger):
        return logger
    return logger(keep_through)


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows a JSONLLogger wrote."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def step_fields(metrics: dict[str, Any], last_eval: tuple[str, float] | None) -> dict[str, str]:
    """What the progress line shows of a step: reward and loss, the latest eval figure (the first set's greedy
    accuracy, from whichever step last evaluated) and where the step's time went (generate / train / sync)."""
    out = {}
    if isinstance(metrics.get("reward_mean"), (int, float)):
        out["reward"] = f"{metrics['reward_mean']:.3f}"
    if isinstance(metrics.get("loss"), (int, float)):
        out["loss"] = f"{metrics['loss']:.4g}"  # RL losses sit near 0: significant digits, not decimals
    if last_eval is not None:
        out[last_eval[0]] = f"{last_eval[1]:.3f}"
    times = [(name, metrics.get(f"time_{name}_s")) for name in ("generate", "train", "sync")]
    if any(isinstance(t, (int, float)) for _, t in times):
        out["time"] = "/".join(f"{t:.2f}" for _, t in times if isinstance(t, (int, float))) + " s (gen/train/sync)"
    return out


class StepProgress:
    """A phase's progress: tqdm on a terminal; off a terminal (a log file, CI) one plain line per step instead of
    tqdm's redraws (each a carriage-return line in a file); nothing where not `enabled` (other ranks).

    `step(metrics)` advances by one step and shows step_fields; the latest eval figure stays on the line until the
    next evaluation (the mutable state that makes this a class)."""

    def __init__(self, total: int, *, initial: int, desc: str, enabled: bool, stream: Any = None) -> None:
        from tqdm import tqdm

        stream = stream or sys.stderr
        self.total, self.n, self.initial, self.desc, self.enabled = total, initial, initial, desc, enabled
        self.stream = stream
        self.last_eval: tuple[str, float] | None = None
        self.t0 = time.perf_counter()
        self._bar = tqdm(total=total, initial=initial, desc=desc, file=stream) \
            if enabled and stream.isatty() else None

    def step(self, metrics: dict[str, Any]) -> None:
        evals = [k for k in metrics if k.startswith("eval/") and k.endswith("/accuracy")]
        if evals:
            name = evals[0].removeprefix("eval/").removesuffix("/accuracy")
            self.last_eval = (f"{name}_acc", float(metrics[evals[0]]))
        fields = step_fields(metrics, self.last_eval)
        self.n += 1
        if self._bar is not None:
            self._bar.set_postfix(fields, refresh=False)
            self._bar.update(1)
        elif self.enabled:
            rate = (time.perf_counter() - self.t0) / max(self.n - self.initial, 1)
            items = "".join(f" {k}={v}" for k, v in fields.items())
            print(f"{self.desc}: step {self.n}/{self.total}{items} ({rate:.2f} s/step)", file=self.stream, flush=True)

    def warn(self, text: str) -> None:
        """A line on the progress line's stream (above the bar on a terminal, so the bar is not torn)."""
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        elif self.enabled:
            print(text, file=self.stream, flush=True)

    def __enter__(self) -> StepProgress:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            self._bar.close()


def progress(total: int, *, initial: int, desc: str, enabled: bool, stream: Any = None) -> StepProgress:
    return StepProgress(total, initial=initial, desc=desc, enabled=enabled, stream=stream)
