"""The training loop's source of rollout batches: the same batch on every rank, generated ahead in async mode.

Rank 0 drives the rollouts (a generator such as trainer.rollout.manager.generate_rollout_batches) and hands each
batch to the other ranks, which must pack the same samples. When rank 0's rollout raises (engine gone, filters
starving the batch, ...), the other ranks are waiting in that hand-off: they get a `RolloutFailed` marker instead
of a batch, every rank runs the caller's `on_failure` (a collective checkpoint), and every rank raises.

`ResumePoints` keeps what a checkpoint of step n resumes rollouts from: the data position and the rollout manager's
state as they were when batch n was drawn, before batch n+1 was (async generation draws batches n+1 .. n+k while
step n trains).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import queue
import sys
import threading
from collections.abc import Callable, Generator, Iterator, Mapping
from typing import Any

from trainer.backend.steps import broadcast_from_rank0
from trainer.stops import RunStopped
from trainer.types import RolloutBatch


@dataclasses.dataclass(frozen=True)
class RolloutFailed:
    """What rank 0 broadcasts instead of a batch when its rollout raised: the error, as text."""

    error: str


class ResumePoints:
    """The resumable state of the rollout side (data buffer, rollout manager: anything with state_dict) at the
    step boundaries; `at(step)` is what a checkpoint of `step` must hold so that a resumed run draws exactly the
    batches an uninterrupted one would.

    The live objects are no good for that: while step n trains, batches n+1 .. n+k may already be drawn (async
    generation k steps ahead, or a Ctrl-C after the draw), so their position is ahead of the weights, and a worker
    thread may be changing them while the checkpoint reads. `record(step)` runs when batch `step` was drawn and
    before batch step+1 is (in the thread that draws: nothing changes them then). Mutable (the snapshots): why
    this is a class.
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
        """Batch `step` was just drawn and batch step+1 not yet: this is the state after step `step` (`snapshot`:
        that state taken elsewhere, e.g. by the rollout process, in place of the parts' own)."""
        snap = self._snapshot() if snapshot is None else snapshot
        with self._lock:
            self._at[step] = snap
            for old in sorted(self._at)[:-self._keep]:
                del self._at[old]

    def at(self, step: int) -> dict[str, Any]:
        with self._lock:
            if step not in self._at:
                raise RuntimeError(f"no resumable state recorded for step {step} (recorded: {sorted(self._at)}); "
                                   f"record(step) must run when batch `step` is drawn")
            return self._at[step]


CLOSE_GRACE_S = 10.0  # how long close() waits for the worker to leave a cancelled batch before abandoning it


class _Worker:
    """One daemon thread running submitted calls in order: a ThreadPoolExecutor's threads are joined at interpreter
    exit, so a worker stuck in user code that blocks its event loop (a `time.sleep` inside an `async def step`: no
    cancellation can reach it) kept the process alive after Ctrl-C had written the checkpoint."""

    def __init__(self, initializer: Callable[[], None] | None = None) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()  # (future, fn, args), or None: stop
        self._thread = threading.Thread(target=self._run, args=(initializer,), name="rollout", daemon=True)
        self._thread.start()

    def _run(self, initializer: Callable[[], None] | None) -> None:
        failed: BaseException | None = None
        try:
            if initializer is not None:
                initializer()
        except BaseException as e:  # noqa: BLE001 - every call then fails with it (none waits forever)
            failed = e
        while (item := self._calls.get()) is not None:
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                if failed is not None:
                    raise failed
                fut.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - delivered to the caller through the future
                fut.set_exception(e)

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((fut, fn, args))
        return fut

    def shutdown(self, timeout_s: float) -> bool:
        """Stop after the running call (queued ones are the caller's to cancel first); whether the thread ended
        within `timeout_s`."""
        self._calls.put(None)
        self._thread.join(timeout_s)
        return not self._thread.is_alive()


class RolloutSource:
    """`next(step)` gives the batch of training step `step` on every rank; a context manager that closes it.

    batches: rank 0's batch generator (None on the other ranks). ahead = k >= 1 (async mode): batches are
    generated in one worker thread up to k steps ahead of training — when the batch of step n is taken, the
    batches of steps n+1 .. n+k are queued — with the engine weights of the moment each starts; the engines are
    separate processes (or release the GIL), so generation really runs beside training and the thread mostly
    waits on them. ahead = 0: each batch is generated when asked for. No batch is generated past `num_steps`.
    `on_drawn(step)` runs once batch `step` is drawn, before batch step+1 is (ResumePoints.record): in the worker
    on rank 0, in `next` on the other ranks. `paused()` holds the worker between two batches (a weight sync, an
    evaluation: an engine must not change weights mid-request). Mutable state (the generator, the queued futures,
    the pause lock) is why this is a class. `cancel()` (AsyncRolloutManager.cancel) stops the batch being generated
    ahead when the source closes.
    """

    def __init__(self, batches: Generator[RolloutBatch, None, None] | None, *, num_steps: int, ahead: int = 0,
                 on_failure: Callable[[], None] = lambda: None,
                 on_drawn: Callable[[int], None] = lambda step: None,
                 worker_cpus: tuple[int, ...] | None = None,
                 requeue: Callable[[list[list[Any]]], None] | None = None,
                 cancel: Callable[[], None] = lambda: None) -> None:
        assert ahead >= 0, ahead
        self._cancel = cancel
        self._batches = batches
        self._num_steps = num_steps
        self._ahead = ahead
        self._on_failure = on_failure
        self._on_drawn = on_drawn
        self._requeue = requeue
        # worker_cpus: the worker thread's own cores (Linux affinity is per thread): its Python (requests, parsing,
        # rewards) then stops taking the trainer's core from the step.
        pin = (lambda: os.sched_setaffinity(0, worker_cpus)) if worker_cpus else None
        self._pool = _Worker(initializer=pin) if ahead and batches is not None else None
        self._pending: dict[int, concurrent.futures.Future] = {}  # step -> its batch, generated in order
        self.close_grace_s = CLOSE_GRACE_S
        self._engines = threading.Lock()  # held by the worker while it generates, by paused() while held

    def _generate(self, step: int) -> RolloutBatch:
        with self._engines:
            batch = next(self._batches)
            self._on_drawn(step)
        return batch

    def next(self, step: int) -> RolloutBatch:
        """The batch of training step `step` (1-based), the same on every rank. Collective: every rank calls it."""
        failure: Exception | None = None
        try:
            batch = self._take(step) if self._leads else None
        except Exception as e:
            failure, batch = e, RolloutFailed(f"{type(e).__name__}: {e}")
        batch = broadcast_from_rank0(batch)
        if isinstance(batch, RolloutFailed):
            # The trainer state is consistent: every rank runs on_failure (a checkpoint: collective), then every
            # rank raises, rank 0 its own exception.
            self._on_failure()
            if failure is not None:
                raise failure
            raise RunStopped(f"the rollout on rank 0 failed at step {step}: {batch.error}")
        if not self._leads:
            self._on_drawn(step)  # the other ranks: their (unused) copies are what rank 0's were
        self._prefetch(step)
        return batch

    @property
    def _leads(self) -> bool:
        """Whether this rank generates (rank 0) rather than receives the batches."""
        return self._batches is not None

    def _prefetch(self, step: int) -> None:
        if self._pool is not None:  # steps step+1 .. step+k generate while `step` trains
            for ahead in range(step + 1, min(step + self._ahead, self._num_steps) + 1):
                if ahead not in self._pending:
                    self._pending[ahead] = self._pool.submit(self._generate, ahead)

    def requeue(self, groups: list[list[Any]]) -> None:
        """Hand groups back to the rollout side (past the staleness bound: generated again, later)."""
        if self._requeue is None:
            raise RuntimeError("this RolloutSource was built without requeue=")
        self._requeue(groups)

    def _take(self, step: int) -> RolloutBatch:
        if self._pool is None:
            return self._generate(step)
        fut = self._pending.pop(step, None) or self._pool.submit(self._generate, step)  # the first has none queued
        return fut.result()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The engines are idle inside: the batch being generated finishes first (it stays queued for `next`), and
        no other starts until the block ends."""
        with self._engines:
            yield

    def close(self) -> None:
        for fut in self._pending.values():
            fut.cancel()
        if self._pool is not None:
            # The batch the worker may be generating is one nobody will train on: `cancel` ends it now (a Ctrl-C
            # must not wait out a whole batch, or a hung environment's timeout), then the worker is joined.
            self._cancel()
            if not self._pool.shutdown(timeout_s=self.close_grace_s):
                # Its generator is still running in that thread: closing it here would raise; the daemon thread
                # ends with the process.
                print(f"warning: the rollout worker did not leave its batch within {self.close_grace_s:g} s of the "
                      f"stop (user code blocking its event loop, e.g. time.sleep in an async env step?); it is "
                      f"abandoned", file=sys.stderr, flush=True)
                return
        if self._batches is not None:
            self._batches.close()

    def __enter__(self) -> RolloutSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ProcessRolloutSource(RolloutSource):
    """RolloutSource whose batches come from a rollout process (trainer.rollout.process_worker.RolloutProcess,
    [rl] rollout_worker = "process"), on rank 0: the child generates up to `ahead` steps past the one taken, with
    the weight version `version()` read at each take and after each pause; the rollout state it sends with each
    batch is what `on_drawn(step, snapshot)` records. The hand-off to the other ranks and the failure path are
    RolloutSource's."""

    def __init__(self, process: Any, *, num_steps: int, version: Callable[[], int],
                 on_failure: Callable[[], None] = lambda: None,
                 on_drawn: Callable[..., None] = lambda step, snapshot=None: None) -> None:
        super().__init__(None, num_steps=num_steps, on_failure=on_failure, on_drawn=on_drawn,
                         requeue=process.requeue)
        self._process = process
        self._version = version

    @property
    def _leads(self) -> bool:
        return True

    def _take(self, step: int) -> RolloutBatch:
        batch, snapshot = self._process.take(step, self._version())
        self._on_drawn(step, snapshot)
        return batch

    def _prefetch(self, step: int) -> None:
        pass  # the take told the child how far it may run ahead

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        with self._process.paused(self._version):
            yield

    def close(self) -> None:
        self._process.close()
