"""Blocking user code of an episode (sync tools, a sync environment's reset and step, sync reward functions: trainer.
trainer.rewards.rules.with_timeout) run in worker threads, with a time limit, without starving anything else of threads.

A thread cannot be stopped. `trio.to_thread.run_sync(..., abandon_on_cancel=True)` lets the waiting task leave at
its deadline, but the thread keeps the limiter slot it ran under until it really ends (trio releases it then, and
never when it ends after its `trio.run`). On one shared limiter (trio's default: 40 threads per run) a few hung tools
would hold every slot, and each later reward would wait out its own timeout and fail, blamed for a hang that was not
its own. So each call here:

  - takes a slot of its pool's own CapacityLimiter (POOL_THREADS per pool and trio run: "tools", "env",
    "rewards") in the waiting task, and gives it back when the task leaves, in time or not: a hung call frees its
    slot at its deadline;
  - runs its thread under a limiter of its own that nobody else waits on, so an abandoned thread holds nothing;
  - is counted while its thread runs on abandoned (`abandoned_threads()`: the rollout's `abandoned_threads` metric),
    so a run that leaks threads says so.

Past the deadline `run_blocking` raises `BlockedCallTimeout` naming the part that hung (the caller's `what`). The
abandoned threads are trio's daemon threads: they never keep the process from exiting, and a cancelled rollout
(Ctrl-C) leaves them at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import threading
from collections.abc import Callable, Iterator
from typing import Any

import trio
from trio.lowlevel import RunVar

# Threads one pool runs at once. A slot is held only while its call runs in time (a call past its deadline gives its
# slot back), so this bounds the working threads, not the hung ones. 32 is about trio's own default (40), which sync
# user code has always had; a queue beyond it waits at most its share of the calls ahead, each bounded by its timeout.
POOL_THREADS = 32
POOLS = ("tools", "env", "rewards")
_SLOTS: dict[str, RunVar] = {name: RunVar(f"trainer.rollout.blocking.{name}") for name in POOLS}


class BlockedCallTimeout(TimeoutError):
    """A blocking call ran past its time limit; its thread was abandoned (it runs on, its result dropped)."""


@dataclasses.dataclass
class _Call:
    """One call's state, read and written under _LOCK: its thread is running; its task has left."""

    running: bool = False
    left: bool = False


_LOCK = threading.Lock()
_abandoned = [0]  # threads still running whose task has left (a list: one mutable cell, changed under _LOCK)


def abandoned_threads() -> int:
    """Threads of this process still running a call whose caller stopped waiting (a timeout or a cancellation)."""
    with _LOCK:
        return _abandoned[0]


def _slots(pool: str) -> trio.CapacityLimiter:
    """The pool's limiter in the current trio run (a limiter belongs to one run: each batch is its own run)."""
    var = _SLOTS[pool]
    try:
        return var.get()
    except LookupError:
        limiter = trio.CapacityLimiter(POOL_THREADS)
        var.set(limiter)
        return limiter


def _in_thread(call: _Call, fn: Callable[..., Any], args: tuple[Any, ...]) -> Callable[[], Any]:
    """`fn(*args)` marking `call` running while it runs (and counted abandoned when its task left meanwhile)."""

    def run() -> Any:
        with _LOCK:
            call.running = True
            _abandoned[0] += call.left
        try:
            return fn(*args)
        finally:
            with _LOCK:
                call.running = False
                _abandoned[0] -= call.left

    return run


async def run_blocking(fn: Callable[..., Any], *args: Any, timeout_s: float, pool: str, what: str,
                       hint: str) -> Any:
    """`fn(*args)` in a worker thread of pool `pool`, within `timeout_s` seconds of its start (not counting the wait
    for a slot); past it a BlockedCallTimeout "`what` took longer than `timeout_s` s ... `hint`". A cancellation
    (Ctrl-C, a batch that filled) leaves at once; either way the thread is abandoned and counted until it ends."""
    call = _Call()
    try:
        async with _slots(pool):
            with trio.move_on_after(timeout_s):
                return await trio.to_thread.run_sync(_in_thread(call, fn, args), abandon_on_cancel=True,
                                                     limiter=trio.CapacityLimiter(1))
    finally:
        with _LOCK:
            call.left = True
            _abandoned[0] += call.running
    raise BlockedCallTimeout(f"{what} took longer than {timeout_s:g} s; its thread was abandoned (it runs on, its "
                             f"result dropped): {hint}")


# Set in a trio run once a Ctrl-C (KeyboardInterrupt) came out of a user's code in it (`user_code`).
_INTERRUPTED = RunVar("trainer.rollout.blocking.interrupted", default=False)


async def enter_user_code() -> None:
    """Called before a user's function starts: trio.Cancelled when the calling task is cancelled, KeyboardInterrupt
    when a Ctrl-C already came out of a user's code in this trio run (`user_code`).

    Why: an async method that blocks the event loop (a plain time.sleep in an `async def step`) cannot be cancelled
    or timed out, only interrupted by Ctrl-C, which trio raises in it. The cancellation that follows reaches the
    other episodes' nurseries one by one, and an episode whose engine reply had arrived went on into its own
    blocking step first: the run hung again after every Ctrl-C."""
    if _INTERRUPTED.get():
        raise KeyboardInterrupt
    await trio.lowlevel.checkpoint_if_cancelled()


@contextlib.contextmanager
def user_code() -> Iterator[None]:
    """Around a user's async code in a trio run: a KeyboardInterrupt out of it is remembered (`enter_user_code`)."""
    try:
        yield
    except KeyboardInterrupt:
        _INTERRUPTED.set(True)
        raise


async def run_bounded(fn: Callable[..., Any], *args: Any, timeout_s: float, pool: str, what: str, hint: str) -> Any:
    """`fn(*args)` within `timeout_s`: an async `fn` awaited in this event loop (cancelled at the deadline), a plain
    one through `run_blocking` (its result awaited, by the same deadline, when it is an awaitable).
    BlockedCallTimeout past the deadline, as `run_blocking`'s.

    A cancelled caller never starts `fn` (`enter_user_code`): an async `fn` that blocks the event loop (a plain
    time.sleep in an `async def`) cannot be cancelled once it runs, only interrupted by Ctrl-C, which ends one call."""
    await enter_user_code()
    deadline = trio.current_time() + timeout_s
    if inspect.iscoroutinefunction(fn):
        value = fn(*args)
    else:
        value = await run_blocking(fn, *args, timeout_s=timeout_s, pool=pool, what=what, hint=hint)
    if not inspect.isawaitable(value):
        return value
    with trio.move_on_at(deadline), user_code():
        return await value
    raise BlockedCallTimeout(f"{what} took longer than {timeout_s:g} s: {hint}")
