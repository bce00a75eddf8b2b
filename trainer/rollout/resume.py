"""What a checkpoint resumes the rollouts from: the data position and the rollout manager's state as they were when
batch n was drawn, before batch n+1 was (async generation draws batches n+1 .. n+k while step n trains).

Light on purpose (no torch): the rollout process imports it to read the state it sends with each batch.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any


def rollout_state(data_buffer: Any, manager: Any) -> dict[str, Any]:
    """The rollout side's resumable state, under the names ResumePoints keeps it by (every backend's take returns
    this, read right after drawing the batch)."""
    return {"data_buffer": data_buffer.state_dict(), "rollout_manager": manager.state_dict()}


class ResumePoints:
    """The resumable state of the rollout side (data buffer, rollout manager: anything with state_dict) at the
    step boundaries; `at(step)` is what a checkpoint of `step` must hold so that a resumed run draws exactly the
    batches an uninterrupted one would.

    The live objects are no good for that: while step n trains, batches n+1 .. n+k may already be drawn (async
    generation k steps ahead, or a Ctrl-C after the draw), so their position is ahead of the weights, and a worker
    may be changing them while the checkpoint reads. `record(step, snapshot)` keeps the state the backend read when
    batch `step` was drawn, before batch step+1 was. Mutable (the snapshots): why this is a class.
    """

    def __init__(self, parts: Mapping[str, Any], *, step: int, keep: int = 2) -> None:
        self._parts = dict(parts)
        self._keep = keep  # snapshots kept: the steps a checkpoint may be of, plus the ones drawn ahead
        self._lock = threading.Lock()  # record (the drawing thread) against at (the trainer's)
        self._at = {step: self._snapshot()}  # before the first batch: the state just built or resumed

    def _snapshot(self) -> dict[str, Any]:
        # state_dict() returns new containers (JSON data, not views of the live state): safe to keep as is.
        return {name: part.state_dict() for name, part in self._parts.items()}

    def record(self, step: int, snapshot: dict[str, Any] | None = None) -> None:
        """Batch `step` was drawn with this state after it (None: read the parts now: nothing draws meanwhile)."""
        snap = self._snapshot() if snapshot is None else snapshot
        with self._lock:
            self._at[step] = snap
            for old in sorted(self._at)[:-self._keep]:
                del self._at[old]

    def requeued(self, step: int, groups: list[list[dict[str, Any]]]) -> None:
        """Groups handed back to the rollout manager while batch `step` trains (past the staleness bound: generated
        again later; `groups` as the manager's state holds them, restarted, as dicts). The states recorded for
        `step` and the batches drawn ahead of it were read before: a checkpoint of one of them must still hold
        them, or a resumed run never generates those prompts."""
        with self._lock:
            for at in [s for s in self._at if s >= step]:
                snap = self._at[at]
                if "rollout_manager" in snap:
                    manager = snap["rollout_manager"]
                    self._at[at] = {**snap, "rollout_manager": {**manager,
                                                                "requeued": [*manager.get("requeued", []), *groups]}}

    def at(self, step: int) -> dict[str, Any]:
        with self._lock:
            if step not in self._at:
                raise RuntimeError(f"no resumable state recorded for step {step} (recorded: {sorted(self._at)}); "
                                   f"record(step) must run when batch `step` is drawn")
            return self._at[step]
