"""Rollouts written out for inspection and replay: one JSONL file a step, one row a sample.

    <rl output_dir>/rollouts/step_000025.jsonl

A row holds what a person reads (prompt and completion text, token counts, reward, advantage, status, group,
weight version, the engine-vs-trainer log-prob mismatch) and what replay needs to train on the step again without
an engine (the token ids, the loss mask, the engine's log-probs, the metadata the reward and the grouping read).
`read_rollouts` turns a file back into the RolloutBatch it came from: JSON keeps Python floats exactly, so the
replayed step sees the same rewards and log-probs.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainer.types import RolloutBatch, Sample, Status


@dataclasses.dataclass(frozen=True)
class RolloutDumps:
    """Which RL steps' samples are written (every `every`-th; 0: none), where, and how many go to table views."""

    every: int
    folder: Path
    table_rows: int = 3

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def path(self, step: int) -> Path:
        return self.folder / f"step_{step:06d}.jsonl"


def _jsonable(v: Any) -> Any:
    """Metadata as JSON: containers walked, anything else JSON has no type for kept as its repr."""
    if isinstance(v, float) and not math.isfinite(v):
        return repr(v)
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return repr(v)


def _mismatch(trainer: Sequence[float | None], engine: Sequence[float] | None) -> float | None:
    """Mean |log pi_trainer - log pi_engine| over the sample's trained tokens (None without engine log-probs)."""
    if engine is None:
        return None
    diffs = [abs(t - e) for t, e in zip(trainer, engine) if t is not None]
    return sum(diffs) / len(diffs) if diffs else None


def rollout_rows(batch: RolloutBatch, *, step: int, advantages: Sequence[float], trained: Sequence[bool],
                 trainer_logprobs: Sequence[Sequence[float | None]] | None, tokenizer: Any) -> list[dict[str, Any]]:
    """One JSON-ready row per sample of the batch of `step`. trainer_logprobs: per sample, the trainer's log-prob
    of each response token before the step's update (None on tokens the loss does not train)."""
    rows = []
    for i, s in enumerate(batch.samples):
        lps = trainer_logprobs[i] if trainer_logprobs is not None else None
        completion = tokenizer.decode(list(s.tokens[s.prompt_length:])) if tokenizer is not None else s.response
        rows.append({
            "step": step, "index": i, "group": s.group_index,
            "prompt": s.prompt, "completion": completion, "response": s.response,
            "prompt_tokens": s.prompt_length, "completion_tokens": s.response_length,
            "reward": s.reward, "correct": s.correct, "advantage": advantages[i], "trained": bool(trained[i]),
            "status": str(s.status), "weight_version": s.weight_version,
            "logprob_mismatch": _mismatch(lps, s.rollout_logprobs) if lps is not None else None,
            # replay's part: the sample itself
            "tokens": list(s.tokens), "response_length": s.response_length,
            "loss_mask": list(s.loss_mask) if s.loss_mask is not None else None,
            "rollout_logprobs": list(s.rollout_logprobs) if s.rollout_logprobs is not None else None,
            "trainer_logprobs": list(lps) if lps is not None else None,
            "sample_index": s.index, "metadata": _jsonable(dict(s.metadata)),
        })
    return rows


def write_rollouts(path: str | os.PathLike, rows: Sequence[dict[str, Any]]) -> Path:
    """The rows as JSONL, through a temporary file and a rename (a kill leaves no half file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    os.replace(tmp, path)
    return path


def read_rollouts(path: str | os.PathLike) -> tuple[int, RolloutBatch]:
    """(step, the RolloutBatch) of a file write_rollouts wrote."""
    path = Path(path)
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{path}: no samples (a rollouts file has one JSON row per sample)")
    need = ("tokens", "response_length", "reward", "status", "weight_version", "metadata")
    for k, r in enumerate(rows):
        missing = [key for key in need if key not in r]
        if missing:
            raise ValueError(f"{path}:{k + 1}: row lacks {missing}; replay reads files written by [logging] "
                             f"rollouts_every or `python -m trainer generate`")
    samples = tuple(Sample(prompt=r["prompt"], tokens=tuple(r["tokens"]), response=r.get("response", ""),
                           response_length=r["response_length"], loss_mask=r["loss_mask"], reward=r["reward"],
                           group_index=r["group"], index=r["sample_index"],
                           rollout_logprobs=r["rollout_logprobs"], weight_version=r["weight_version"],
                           metadata=r["metadata"], status=Status(r["status"]), correct=r["correct"])
                    for r in rows)
    return int(rows[0]["step"]), RolloutBatch(samples=samples)


def rollout_files(folder: str | os.PathLike) -> list[Path]:
    """The step files of a rollouts folder, in step order."""
    files = sorted(Path(folder).glob("step_*.jsonl"))
    if not files:
        raise FileNotFoundError(f"{folder}: no step_*.jsonl files; write them with [logging] rollouts_every = N or "
                                f"`python -m trainer generate`")
    return files


def table_rows(rows: Sequence[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """A few samples to look at: the best, the median and the worst reward (then the next best, ...), short
    columns only."""
    scored = sorted((r for r in rows if r["reward"] is not None), key=lambda r: -r["reward"])
    if not scored or n <= 0:
        return []
    picks = [0, len(scored) // 2, len(scored) - 1] + list(range(1, len(scored)))
    seen: list[int] = []
    for p in picks:
        if p not in seen:
            seen.append(p)
    cols = ("step", "group", "reward", "advantage", "status", "completion_tokens", "prompt", "completion")
    return [{c: scored[p][c] for c in cols} for p in seen[:n]]

