"""The training loop's source of rollout batches: the same batch on every rank, generated ahead in async mode.

Rank 0 drives the rollouts (a generator such as trainer.rollout.manager.generate_rollout_batches) and hands each
batch to the other ranks, which must pack the same samples. When rank 0's rollout raises (engine gone, filters
starving the batch, ...), the other ranks are waiting in that hand-off: they get a `RolloutFailed` marker instead
of a batch, every rank runs the caller's `on_failure` (a collective checkpoint), and every rank raises.

`ResumePoints` keeps what a checkpoint of step n resumes rollouts from: the data position and the rollout manager's
state as they were when batch n was drawn, before batch n+1 was (async prefetch draws it while step n trains).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Callable, Generator, Mapping
from typing import Any

from trainer.backend.steps import broadcast_from_rank0
from trainer.types import RolloutBatch


@dataclasses.dataclass(frozen=True)
class RolloutFailed:
    """What rank 0 broadcasts instead of a batch when its rollout raised: the error, as text."""

    error: str


class ResumePoints:
    """The resumable state of the rollout side (data buffer, rollout manager: anything with state_dict) at the
    last step boundaries; `at(step)` is what a checkpoint of `step` must hold so that a resumed run draws exactly
    the batches an uninterrupted one would.

    The live objects are no good for that: while step n trains, batch n+1 may already be drawn (async prefetch, or
    a Ctrl-C after the draw), so their position is one batch ahead of the weights, and in async mode a worker
    thread may be changing them while the checkpoint reads. `record(step)` runs when batch `step` was handed out
    and before batch step+1 is drawn, when nothing changes them. Mutable (the snapshots): why this is a class.
    """

    def __init__(self, parts: Mapping[str, Any], *, step: int) -> None:
        self._parts = dict(parts)
        self._at = {step: self._snapshot()}  # before the first batch: the state just built or resumed

    def _snapshot(self) -> dict[str, Any]:
        # state_dict() returns new containers (JSON data, not views of the live state): safe to keep as is.
        return {name: part.state_dict() for name, part in self._parts.items()}

    def record(self, step: int) -> None:
        """Batch `step` was just handed out and batch step+1 not drawn yet: this is the state after step `step`."""
        self._at[step] = self._snapshot()
        for old in [s for s in self._at if s < step - 1]:  # a checkpoint is of step-1 (mid-step) or step
            del self._at[old]

    def at(self, step: int) -> dict[str, Any]:
        if step not in self._at:
            raise RuntimeError(f"no resumable state recorded for step {step} (recorded: {sorted(self._at)}); "
                               f"record(step) must run when batch `step` is handed out")
        return self._at[step]


class RolloutSource:
    """`next(step)` gives the batch of training step `step` on every rank; a context manager that closes it.

    batches: rank 0's batch generator (None on the other ranks). prefetch (async mode): as soon as the batch of
    step n is taken, the batch of step n+1 is generated in a worker thread, with the engine weights of that
    moment, while step n trains; the engines are separate processes, so generation really runs in parallel and
    the thread only waits on HTTP. No batch is generated past `num_steps`. `on_drawn(step)` runs on every rank
    once batch `step` is handed out, before batch step+1 is drawn (ResumePoints.record). Mutable state (the
    generator, the pending future) is why this is a class.
    """

    def __init__(self, batches: Generator[RolloutBatch, None, None] | None, *, num_steps: int,
                 prefetch: bool = False, on_failure: Callable[[], None] = lambda: None,
                 on_drawn: Callable[[int], None] = lambda step: None) -> None:
        self._batches = batches
        self._num_steps = num_steps
        self._on_failure = on_failure
        self._on_drawn = on_drawn
        self._pool = (concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout")
                      if prefetch and batches is not None else None)
        self._pending: concurrent.futures.Future | None = None

    def next(self, step: int) -> RolloutBatch:
        """The batch of training step `step` (1-based), the same on every rank. Collective: every rank calls it."""
        failure: Exception | None = None
        try:
            batch = self._take() if self._batches is not None else None
        except Exception as e:
            failure, batch = e, RolloutFailed(f"{type(e).__name__}: {e}")
        batch = broadcast_from_rank0(batch)
        if isinstance(batch, RolloutFailed):
            # The trainer state is consistent: every rank runs on_failure (a checkpoint: collective), then every
            # rank raises, rank 0 its own exception.
            self._on_failure()
            if failure is not None:
                raise failure
            raise RuntimeError(f"the rollout on rank 0 failed at step {step}: {batch.error}")
        self._on_drawn(step)
        if self._pool is not None and step < self._num_steps:
            self._pending = self._pool.submit(next, self._batches)  # step + 1 generates while `step` trains
        return batch

    def _take(self) -> RolloutBatch:
        if self._pool is None:
            return next(self._batches)
        fut = self._pending or self._pool.submit(next, self._batches)  # the first batch has none pending
        self._pending = None
        return fut.result()

    def wait_idle(self) -> None:
        """Block until the batch in flight is generated (it stays queued for `next`): the engines are idle after,
        so their weights may change (an engine must not change weights mid-request)."""
        if self._pending is not None:
            concurrent.futures.wait([self._pending])

    def close(self) -> None:
        if self._pending is not None:
            self._pending.cancel()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        if self._batches is not None:
            self._batches.close()

    def __enter__(self) -> RolloutSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
