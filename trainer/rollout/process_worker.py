"""The async rollout's client side in a process of its own ([rl] rollout_worker = "process").

Why a process: the client side of generation is Python — building requests, parsing responses into Samples,
scoring rewards, the connection pool — about 0.1 s of CPU per batch of 512 short samples on the 2-core machine
(0.4 s before the engine client's pools were split; measured with the embedded engine behind HTTP). In the
trainer's process (the "thread" worker) it holds the same GIL as the training step, whose own Python (module
calls, optimizer, bookkeeping) is most of a small model's step: the two serialize, and async generation on separate
cores measured 0.94x sync with the thread worker, 1.16x with this process, 1.49x once the async step stopped
recomputing old log-probs (docs/results.md). Here the child has
its own interpreter, and one long-lived event loop, so its pooled connections to the engines live across batches.

The child generates exactly what the thread worker would, with the same code (AsyncRolloutManager over the same
data buffer, engines and rewards, rebuilt from a pickled `RolloutRecipe`); only the state lives in the child. It is
the rollout service's process backend (trainer.rollout.service.RolloutBackend): the service says how far it may run
ahead (`limit`), `version()` is the weight version the batches started next are measured against:

    parent (rank 0)                                   child
    take(step, limit)    ──("take", step, limit, version())──►  may generate the batches of steps up to limit
                         ◄─("batch", step, batch, snapshot)  snapshot: rollout_state() right after drawing it
    paused()             ──("pause",)──►               finishes the batches it may generate, then answers
                         ◄─("paused",)                  and starts no other until
                         ──("resume", version())──►
    requeue(groups)      ──("requeue", groups)──►      (stale groups: generated again, first in a later batch)
    close()              ──("close",)──►               cancels what it is doing and exits
                         ◄─("error", exception)        a failure: raised by the parent's next take()

The snapshots are what `ResumePoints` records for checkpoints (the parent's own buffer and manager are only the
starting state). The child ignores SIGINT and SIGTERM (the parent handles Ctrl-C and SIGTERM and closes it) and
exits when the parent's end of the pipe closes. Every wait of the parent polls the child's liveness: a child that
dies is an error, not a hang.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import multiprocessing
import os
import pickle
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from trainer.types import RolloutBatch, Sample


@dataclasses.dataclass(frozen=True)
class RolloutRecipe:
    """Everything the child builds its rollout side from (pickled once, at start).

    data_buffer: the DataBuffer at its current position; manager_state: AsyncRolloutManager.state_dict(); engines:
    HTTP engine clients (they pickle without their connections); rewards: the run's RewardsRecipe
    (trainer.rewards.sources: [rewards] sources, or the [data].reward shorthand), from which the child builds
    the same sources (reward models loaded there, judges on its engine clients) and uses them as the thread worker
    does; cpus: the child's cores (None: the parent's)."""

    data_buffer: Any
    rollout: Any  # trainer.config.RolloutConfig
    engines: tuple[Any, ...]
    tokenizer: Any
    rewards: Any  # trainer.rewards.sources.RewardsRecipe
    deterministic: bool
    manager_state: dict[str, Any]
    first_step: int  # the first step the child generates (state.step + 1 on resume)
    cpus: tuple[int, ...] | None = None


def check_picklable(recipe: RolloutRecipe) -> None:
    """Fail before the child starts, naming the part that cannot travel to it."""
    for field in dataclasses.fields(recipe):
        try:
            pickle.dumps(getattr(recipe, field.name))
        except Exception as e:
            hint = {"engines": "engines living in this process (kind \"local\", [engines] in_process = true) cannot "
                               "move to another process: start them as servers (in_process = false) or give URLs",
                    "rewards": "give the reward ([data] reward, a rule source's name) as a name (\"module:function\") "
                               "or a module-level function, not a lambda or closure"}.get(field.name, "")
            hint = hint or 'use [rl] rollout_worker = "thread"'
            raise ValueError(f"[rl] rollout_worker = \"process\": the rollout's {field.name} cannot be sent to the "
                             f"rollout process ({type(e).__name__}: {e}); {hint}") from e


class RolloutProcess:
    """The parent's handle on the child (see the module docstring). Mutable: the pipe, the child, the batches
    received before they were asked for."""

    def __init__(self, recipe: RolloutRecipe, *, version: Callable[[], int], poll_s: float = 1.0) -> None:
        check_picklable(recipe)
        self._version = version
        self._proc, self._conn = _take_spare() or _spawn()
        self._poll_s = poll_s
        self._send("recipe", recipe)
        self._ready: dict[int, tuple[RolloutBatch, dict[str, Any]]] = {}  # step -> (batch, snapshot)
        self._closed = False

    def _send(self, *msg: Any) -> None:
        try:
            self._conn.send(msg)
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError) as e:
            raise self._died() from e

    def _died(self) -> RuntimeError:
        self._proc.join(timeout=5)
        return RuntimeError(f"the rollout process ([rl] rollout_worker = \"process\") exited with code "
                            f"{self._proc.exitcode} without a word; its output above says why")

    def _receive(self) -> tuple:
        """The child's next message; its error raised here. Polls so that a dead child is an error, not a hang."""
        while not self._conn.poll(self._poll_s):
            if not self._proc.is_alive() and not self._conn.poll(0):
                raise self._died()
        try:
            msg = self._conn.recv()
        except (EOFError, OSError) as e:  # the child's end closed (it exited) or was reset (it was killed)
            raise self._died() from e
        if msg[0] == "error":
            raise msg[1]
        if msg[0] == "batch":
            self._ready[msg[1]] = (msg[2], msg[3])
        return msg

    def take(self, step: int, limit: int) -> tuple[RolloutBatch, dict[str, Any]]:
        """The batch of `step` and the rollout state right after it was drawn; lets the child run on to `limit`."""
        self._send("take", step, limit, self._version())
        while step not in self._ready:
            self._receive()
        return self._ready.pop(step)

    def requeue(self, groups: Sequence[Sequence[Sample]]) -> None:
        self._send("requeue", [list(g) for g in groups])

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The engines idle inside (the batches the child was allowed before it finish first, started or not:
        ThreadBackend.paused says why); `version()` after the block is the weight version the next batches start
        from."""
        self._send("pause")
        while self._receive()[0] != "paused":
            pass
        try:
            yield
        finally:
            if not self._closed:
                self._send("resume", self._version())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self._conn.send(("close",))
        self._proc.join(timeout=10)
        if self._proc.is_alive():  # stuck past its cancellation: no rollout state is lost (the parent has it)
            self._proc.terminate()
            self._proc.join(timeout=5)
        self._conn.close()


# ------------------------------------------------------------------------------------------------------ spares
# A new interpreter takes ~3 s to import torch, transformers and the rollout code: `warm_up()` starts one early
# (the CLI does, before it builds the model and evaluates), waiting for its recipe, and the next RolloutProcess takes
# it. A spare nobody takes exits with the parent (daemon; and its pipe's end of file).
_spare: list[tuple[Any, Any]] = []
_spare_lock = threading.Lock()


def _spawn() -> tuple[Any, Any]:
    ctx = multiprocessing.get_context("spawn")  # never fork a process with torch's and our threads running
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_child_main, args=(child,), name="rollout", daemon=True)
    proc.start()
    child.close()
    return proc, conn


def warm_up() -> None:
    """Start a rollout process now, for the next RolloutProcess to take (its imports overlap the caller's work)."""
    with _spare_lock:
        if not _spare:
            _spare.append(_spawn())


def _take_spare() -> tuple[Any, Any] | None:
    with _spare_lock:
        while _spare:
            proc, conn = _spare.pop()
            if proc.is_alive():
                return proc, conn
            conn.close()
    return None


# ------------------------------------------------------------------------------------------------------ child
def _child_main(conn: Any) -> None:
    # Ctrl-C and SIGTERM are the parent's (a terminal's Ctrl-C, and Slurm's SIGTERM, reach the whole process group):
    # it checkpoints, then closes us. Should the parent die instead, its end of the pipe closes and we exit.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    try:
        # The slow imports, before the recipe arrives. Unpickling it imports the modules of what it holds: the data
        # buffer's (datasets, 0.7 s), the tokenizer's (transformers' backend, and its model package index, 0.5 s)
        # and the engine clients' (httpx); left to the recipe, they delayed the first batch by as much.
        import torch
        import transformers.models  # noqa: F401
        import transformers.tokenization_utils_tokenizers  # noqa: F401
        import trio

        import engines.sglang  # noqa: F401
        import trainer.data.buffer  # noqa: F401
        import trainer.rollout.manager  # noqa: F401

        try:
            kind, recipe = conn.recv()
        except EOFError:  # a spare nobody took: the parent is done
            return
        assert kind == "recipe", kind
        if recipe.cpus:
            os.sched_setaffinity(0, recipe.cpus)
        torch.set_num_threads(len(recipe.cpus) if recipe.cpus else 1)  # tokenizers and rewards: no intra-op pool
        trio.run(_serve, conn, recipe)
    except BaseException as e:  # noqa: BLE001 - every failure goes to the parent, which raises it
        while isinstance(e, BaseExceptionGroup):  # the nursery's wrapping: the real error, as the thread worker's
            e = e.exceptions[0]
        with contextlib.suppress(Exception):
            try:
                conn.send(("error", e))
            except Exception:  # an exception that does not pickle: its text
                conn.send(("error", RuntimeError(f"the rollout process failed: {type(e).__name__}: {e}")))
    finally:
        conn.close()


async def _serve(conn: Any, recipe: RolloutRecipe) -> None:
    import trio

    from trainer.rewards.sources import score_batch
    from trainer.rollout.manager import AsyncRolloutManager
    from trainer.rollout.resume import rollout_state

    sources = recipe.rewards.build(engines=recipe.engines, tokenizer=recipe.tokenizer)  # as the parent's
    manager = AsyncRolloutManager(list(recipe.engines), recipe.rollout, tokenizer=recipe.tokenizer,
                                  reward_fn=sources.rollout_reward(), deterministic=recipe.deterministic)
    manager.load_state_dict(recipe.manager_state)
    buffer = recipe.data_buffer
    gc.freeze()  # what this process keeps for its life, out of the collector's full passes (trainer/backend/heap.py)
    inbox_send, inbox = trio.open_memory_channel(math.inf)
    # pausing: a pause asked for, answered once the batches already allowed (steps up to limit) are generated, so the
    # weights a batch comes from never depend on when the messages arrived (as ThreadBackend.paused)
    ctl = {"limit": 0, "version": manager.weight_version, "paused": False, "pausing": False}

    def apply(msg: tuple) -> None:
        kind = msg[0]
        if kind == "take":
            ctl["limit"], ctl["version"] = max(ctl["limit"], msg[2]), msg[3]
        elif kind == "requeue":
            manager.requeue(msg[1])
        elif kind == "pause":
            ctl["pausing"] = True
        elif kind == "resume":
            ctl["paused"], ctl["version"] = False, msg[1]
        else:
            raise RuntimeError(f"rollout process: unknown message {kind!r}")

    async def read(cancel: trio.CancelScope) -> None:
        # The pipe's blocking recv in a worker thread; "close" (or the parent gone) cancels everything at once.
        while True:
            try:
                msg = await trio.to_thread.run_sync(conn.recv, abandon_on_cancel=True)
            except (EOFError, OSError):
                msg = ("close",)
            if msg[0] == "close":
                cancel.cancel()
                return
            await inbox_send.send(msg)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read, nursery.cancel_scope)
        async with manager:  # one event loop for the whole run: connections pooled across batches
            step = recipe.first_step
            while True:  # until the parent closes: it never asks past the run's last step
                while True:  # every message that arrived, then wait while there is nothing to do
                    try:
                        apply(inbox.receive_nowait())
                        continue
                    except trio.WouldBlock:
                        pass
                    if ctl["pausing"] and step > ctl["limit"]:  # every batch allowed before the pause is out
                        ctl["pausing"], ctl["paused"] = False, True
                        conn.send(("paused",))
                    if not ctl["paused"] and step <= ctl["limit"]:
                        break
                    apply(await inbox.receive())
                manager.set_weight_version(ctl["version"])
                batch = await manager.generate_batch(buffer)
                if sources.scores_batches:  # synchronous (judges run an event loop of their own): in a worker thread
                    batch = await trio.to_thread.run_sync(score_batch, batch, sources)
                conn.send(("batch", step, batch, rollout_state(buffer, manager)))
                step += 1
