"""How a run stops: on an error that explains itself, on Ctrl-C, on SIGTERM.

`RunStopped` is a run-time stop whose message says what happened and what to do next: every sample of a batch
failed, a resume whose config differs from the checkpoint's, the rollout failing on another rank. The training code
raises it where it knows the cause (a subclass may add a built-in base, e.g. `class X(RunStopped, ValueError)`, so
that callers catching that base keep working). `python -m trainer` prints such a stop as one line, `error: <the
message>`, and exits 1; the traceback is for bugs, and for a stop only with RLKERNELS_DEBUG=1 in the environment.
Errors of the engines' layer (engines.protocol.EngineError, engines.weight_sync.wire.WeightSyncError) cannot derive
from it (engines/ does not import trainer/); trainer.cli counts them as stops too.

SIGTERM is what stops a job under a scheduler: Slurm (scancel, the time limit), Kubernetes (a pod deleted or
evicted) and torchrun's agent (which forwards it to every rank) send it, then SIGKILL after a grace period (Slurm's
KillWait, 30 s by default; Kubernetes' terminationGracePeriodSeconds, 30 s). `sigterm_as_interrupt` makes it do
what Ctrl-C does: KeyboardInterrupt in the main thread, so the one path that checkpoints on Ctrl-C
(trainer.backend.checkpoint.Checkpointer, also through trio's nurseries) checkpoints on SIGTERM, and the engines
the run started are stopped on the way out. The command line says which signal it was and exits 143 (128 + 15,
the status a shell reports for SIGTERM), 130 for Ctrl-C.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator, Mapping

DEBUG_ENV = "RLKERNELS_DEBUG"  # set to 1: a run-time stop prints its traceback too
SIGTERM_EXIT = 128 + signal.SIGTERM  # 143
SIGINT_EXIT = 128 + signal.SIGINT  # 130


class RunStopped(RuntimeError):
    """The run cannot go on, for the reason (and with the way on) its message gives; not a bug."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C's KeyboardInterrupt would be (a KeyboardInterrupt: every Ctrl-C path takes it)."""


def debug_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether RLKERNELS_DEBUG asks for tracebacks of run-time stops (any value but empty and "0")."""
    return environ.get(DEBUG_ENV, "") not in ("", "0")


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[threading.Event]:
    """Within the block, SIGTERM interrupts the main thread as Ctrl-C does; yields an Event that is set once it has
    (how the caller tells the two apart: trio turns its own Ctrl-C handling into a plain KeyboardInterrupt).

    Where Ctrl-C has a handler of its own installed (trio's, while trio.run is on the main thread), SIGTERM goes
    through it: trio then delivers the interrupt at a safe point of its loop instead of inside its bookkeeping.
    Otherwise (Python's default, or Ctrl-C ignored: a background job without job control) it raises Terminated.
    Only the first SIGTERM interrupts: a second one would break off the checkpoint being written, and the
    scheduler's SIGKILL after its grace period is the hard stop anyway. Outside the main thread, where Python cannot
    set signal handlers, nothing changes."""
    received = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def on_sigterm(signum: int, frame: object) -> None:
        if received.is_set():
            return
        received.set()
        ctrl_c = signal.getsignal(signal.SIGINT)
        if callable(ctrl_c) and ctrl_c is not signal.default_int_handler:
            ctrl_c(signal.SIGINT, frame)
            return
        raise Terminated

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield received
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def interrupts_held() -> Iterator[Callable[[], None]]:
    """Within the block, Ctrl-C (SIGINT) and SIGTERM wait: the handlers the block replaced run when it ends, as if the
    signal came then, or earlier where the block calls the function it is given (`release`: from there signals
    arrive as usual). A second one while held stops the block at once (the way out of a step that hangs).

    For a training step. An interrupt raises where the main thread happens to be; inside a step that is between
    FSDP's unshard and reshard of a block, or inside the optimizer's update, and the checkpoint Ctrl-C writes on the
    way out then failed (torch's get_state_dict: a KeyError on a parameter FSDP had swapped out, seen in the CLI's
    Ctrl-C test of an async run) or held a step half applied. Held, the interrupt comes after the step, and the
    checkpoint holds the whole step. Outside the main thread (where no signal is delivered) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return
    held: list[tuple[int, object]] = []
    released = False  # one thread (the main one) reads and writes it: signal handlers run there

    def release() -> None:
        """Put the handlers back, then run the first held signal's (it raises KeyboardInterrupt / Terminated)."""
        nonlocal released
        if released:
            return
        released = True
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum, frame in held[:1]:
            handler = previous[signum]
            if callable(handler):
                handler(signum, frame)
            elif handler == signal.SIG_DFL:
                signal.raise_signal(signum)

    def hold(signum: int, frame: object) -> None:
        held.append((signum, frame))
        if len(held) > 1:  # the second: now
            release()

    previous = {s: signal.signal(s, hold) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield release
    finally:
        release()

