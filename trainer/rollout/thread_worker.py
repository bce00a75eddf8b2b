"""The rollout service's thread backend ([rl] rollout_worker = "thread"): rank 0's batch generator (e.g.
trainer.rollout.manager.generate_rollout_batches) run in one worker thread of the trainer's process, or, when not
`threaded` (synchronous mode), in the caller's thread when a batch is taken.

It implements trainer.rollout.service.RolloutBackend; the service decides how far to run ahead (the `limit` of each
take), how to pause for a weight sync and how batches reach the other ranks.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import queue
import sys
import threading
from collections.abc import Callable, Generator, Iterator
from typing import Any

from trainer.types import RolloutBatch, Sample

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


class ThreadBackend:
    """Batches from `batches`, generated in order; with `threaded`, in a worker thread up to the `limit` each take
    allows, with the engine weights of the moment each starts (the engines are separate processes or release the
    GIL, so generation really runs beside training and the thread mostly waits on them).

    state(): the resumable rollout state (trainer.rollout.service.rollout_state), read in the drawing thread right
    after each batch and before the next (nothing changes it then) and returned with the batch. worker_cpus: the
    worker thread's own cores (Linux affinity is per thread): its Python (requests, parsing, rewards) then stops
    taking the trainer's core from the step. requeue: where stale groups go back (AsyncRolloutManager.requeue).
    cancel (AsyncRolloutManager.cancel): stops the batch being generated ahead when the backend closes. Mutable state
    (the generator, the queued futures, the pause lock) is why this is a class.
    """

    def __init__(self, batches: Generator[RolloutBatch, None, None], *, threaded: bool,
                 state: Callable[[], dict[str, Any] | None] = lambda: None,
                 worker_cpus: tuple[int, ...] | None = None,
                 requeue: Callable[[list[list[Sample]]], None] | None = None,
                 cancel: Callable[[], None] = lambda: None) -> None:
        self._batches = batches
        self._state = state
        self._requeue = requeue
        self._cancel = cancel
        pin = (lambda: os.sched_setaffinity(0, worker_cpus)) if worker_cpus else None
        self._pool = _Worker(initializer=pin) if threaded else None
        self._pending: dict[int, concurrent.futures.Future] = {}  # step -> its (batch, state), generated in order
        self._engines = threading.Lock()  # held while a batch generates, and by paused() for its block
        self.close_grace_s = CLOSE_GRACE_S

    def _generate(self, step: int) -> tuple[RolloutBatch, dict[str, Any] | None]:
        with self._engines:
            batch = next(self._batches)
            return batch, self._state()

    def take(self, step: int, limit: int) -> tuple[RolloutBatch, dict[str, Any] | None]:
        if self._pool is None:
            return self._generate(step)
        for s in range(step, limit + 1):  # step's own first (queued by an earlier take, but for the first step)
            if s not in self._pending:
                self._pending[s] = self._pool.submit(self._generate, s)
        return self._pending.pop(step).result()

    def requeue(self, groups: list[list[Sample]]) -> None:
        if self._requeue is None:
            raise RuntimeError("this ThreadBackend was built without requeue=")
        self._requeue(groups)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The batches queued before the block (generating or not started yet) finish first (they stay queued for
        their take); no other starts in the block. Waiting for a queued batch that has not started yet keeps the
        weights each batch is generated from independent of thread timing: a batch queued before a sync is always
        generated before it (under load the worker could otherwise start it after the sync, and `[rl]
        deterministic` runs differed in the version a batch came from)."""
        concurrent.futures.wait(list(self._pending.values()))
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
        self._batches.close()
