"""[logging] profile_steps = [first, last]: torch.profiler over those steps of each training phase.

Where a step's time goes is what the step's timers (time_generate_s, time_train_s, time_sync_s) cannot say on a GPU:
the host enqueues work and returns, and whatever reads a device value next waits for it. A trace shows both sides:
the host's ops (of every thread where torch can record them all: the in-process engine's and the rollout worker's
too; `profile_all_threads`) and, on CUDA, each kernel and each synchronisation (`enable_cuda_sync_events`) on one
timeline. The window's steps run slower than the others (CUPTI's cost on every launch): read the trace for where the
time goes, the metrics of other steps for how much. Not tried on a GPU yet with [engines] cuda_graphs (CUPTI
started after a graph's capture has had problems in some CUDA versions).

`StepProfiler` is one more of the phase's metrics loggers (trainer.tracking.build_logger), so neither loop changes:
it starts when step first - 1 is logged (at once when the phase starts at or after it: step first is the next to
run; a window from step 1 then also holds the phase's setup, first sync and step-0 evaluation) and stops when step
`last` is logged, then writes into <phase output_dir>/profile/:
    steps_<first>-<last>.trace.json.gz  the Chrome trace, gzipped (https://ui.perfetto.dev, chrome://tracing)
    steps_<first>-<last>.txt            the ops by self CPU time, and on CUDA by self device time (key_averages)
A phase that ends (or stops) inside the window writes what it traced; one that traced no step (a finished phase
resumed) writes nothing, so an earlier trace stays. A trace that cannot be written is a warning, never the run's
end. The main rank only; a trace of a few steps of a small model is a few MB, of a large one much more: keep the
window short.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

TABLE_ROWS = 40  # ops listed per table


def _experimental_config() -> Any:
    """Kineto's options: every thread's ops and CUDA's synchronisations, where this torch has them (2.13 does; an
    older one gets what it knows)."""
    from torch._C._profiler import _ExperimentalConfig

    for options in (dict(profile_all_threads=True, enable_cuda_sync_events=True), dict(enable_cuda_sync_events=True),
                    {}):
        try:
            return _ExperimentalConfig(**options)
        except TypeError:
            continue
    return None


class StepProfiler:
    """A metrics logger (log / close) that traces steps [first, last] of its phase. Mutable (the running profiler):
    a class."""

    def __init__(self, first: int, last: int, folder: str | Path, *, start_after: int = 0) -> None:
        """start_after: the step the phase starts after (0 fresh, the checkpoint's on resume)."""
        assert 1 <= first <= last, (first, last)
        self.first, self.last, self.folder = first, last, Path(folder)
        self.prof: Any = None
        self.traced: list[int] = []  # the steps logged while tracing
        self.written: list[Path] = []
        self._t0 = 0.0
        if start_after >= first - 1 and start_after < last:  # step `first` (or a later one of the window) is next
            self._start()

    def _start(self) -> None:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self.prof = profile(activities=activities, record_shapes=True, with_stack=False,
                            experimental_config=_experimental_config())
        self.prof.__enter__()
        self._t0 = time.perf_counter()

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if self.prof is None:
            if step == self.first - 1:
                self._start()
            return
        if step >= self.first:
            self.traced.append(step)
        if step >= self.last:
            self._stop()

    def close(self) -> None:
        if self.prof is not None:
            self._stop()

    def _stop(self) -> None:
        prof, self.prof = self.prof, None
        try:
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # the window's kernels end inside it
        finally:
            wall = time.perf_counter() - self._t0
            prof.__exit__(None, None, None)
        if not self.traced:  # a finished phase resumed inside its window: keep the trace its run wrote
            return
        try:
            self._write(prof, wall)
        except Exception as e:  # noqa: BLE001 - a trace is an aid: the run goes on without it
            warnings.warn(f"[logging] profile_steps: writing the trace of steps {self.traced} to {self.folder} failed "
                          f"({type(e).__name__}: {e}); the run goes on", RuntimeWarning, stacklevel=2)

    def _write(self, prof: Any, wall: float) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        stem = self.folder / f"steps_{self.first}-{self.last}"
        trace, table = stem.with_suffix(".trace.json.gz"), stem.with_suffix(".txt")
        prof.export_chrome_trace(str(trace))
        averages = prof.key_averages()
        parts = [f"steps {self.traced} of [{self.first}, {self.last}] traced: {wall:.3f} s wall, "
                 f"{wall / len(self.traced):.3f} s a step",
                 "by self CPU time:", averages.table(sort_by="self_cpu_time_total", row_limit=TABLE_ROWS)]
        if torch.cuda.is_available():
            parts += ["by self CUDA time:", averages.table(sort_by="self_cuda_time_total", row_limit=TABLE_ROWS)]
        table.write_text("\n".join(parts) + "\n")
        self.written = [trace, table]
