"""Device policy, in one place.

    CUDA tensor                      -> "triton"  (compiled Triton kernels)
    CPU tensor, TRITON_INTERPRET=1   -> "triton"  (Triton's interpreter: how tests prove kernels without a GPU)
    CPU tensor otherwise             -> "torch"   (plain torch implementation, the production CPU path)

Tests run both paths in one process with `use_backend("torch")` / `use_backend("triton")`. Forcing "triton"
on a CPU tensor without TRITON_INTERPRET=1 is an error, never a silent fallback.

The CPU host's allocator and OpenMP pools are policy too: `tune_host_malloc` (called by the runs and the engine
processes on CPU) and `release_host_threads` (a thread handing its cores to another: the embedded engine's). On
CUDA, `shared_stream` is the one stream a process's trainer computes on and an in-process engine that generates
while the trainer waits queues its work on, so the two share the caching allocator's blocks.

So is how a function whose shapes change call to call is compiled: `dynamic_compile` (the engine's decode step,
the packed rows' FlexAttention), traced once for every size instead of once per coincidence of sizes.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Literal

import torch

Backend = Literal["triton", "torch"]
_BACKENDS = ("triton", "torch")
_forced: list[Backend] = []  # stack of overrides set by use_backend


def triton_interpret() -> bool:
    """True when Triton kernels run through the interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def backend_for(t: torch.Tensor) -> Backend:
    """The implementation a public op uses for tensors on `t.device`."""
    if _forced:
        forced = _forced[-1]
        if forced == "triton" and not t.is_cuda and not triton_interpret():
            raise RuntimeError(
                "use_backend('triton') on a CPU tensor needs TRITON_INTERPRET=1 set before triton is imported; "
                "use a CUDA tensor or use_backend('torch')"
            )
        return forced
    if t.is_cuda:
        return "triton"
    if triton_interpret() and triton_available():
        return "triton"
    return "torch"


def host_sync_is_free(t: torch.Tensor) -> bool:
    """True for CPU tensors: reading a value on the host costs nothing there, so ops may validate data and skip
    masked rows eagerly. Elsewhere a read would stall the device: data checks become device-side flags."""
    return t.device.type == "cpu"


@contextlib.contextmanager
def use_backend(backend: Backend) -> Iterator[None]:
    """Force one implementation inside the block (tests compare both paths this way)."""
    if backend not in _BACKENDS:
        raise ValueError(f"backend={backend!r}: expected one of {_BACKENDS}")
    _forced.append(backend)
    try:
        yield
    finally:
        _forced.pop()


# glibc malloc's parameters (malloc.h: M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD) and the values a CPU run sets.
_MALLOPT = {"M_TRIM_THRESHOLD": -1, "M_TOP_PAD": -2, "M_MMAP_THRESHOLD": -3}
HOST_MALLOC = {"M_MMAP_THRESHOLD": 256 << 20, "M_TRIM_THRESHOLD": 1 << 30, "M_TOP_PAD": 256 << 20}
# Set by the user (glibc's own tunables, or another allocator preloaded): theirs wins, malloc is left alone.
_USER_MALLOC_ENV = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_MMAP_MAX_",
                    "GLIBC_TUNABLES", "LD_PRELOAD")


def tune_host_malloc() -> dict[str, int]:
    """Keep the memory a CPU step frees for the next step: glibc malloc serves blocks above 256 MiB only by mmap
    (default: above 128 KiB, raised as blocks are freed), keeps up to 1 GiB free at the heap's top instead of
    returning it to the OS, and grows the heap 256 MiB at a time. Returns the parameters set ({} when left alone:
    not Linux/glibc, or the user set MALLOC_*_ / GLIBC_TUNABLES / LD_PRELOAD).

    Why: a step allocates and frees the same large tensors every time (an agent step's MLP activations are [7k, 512]
    fp32, 14 MB; logits chunks; the engine's KV rebuilds). With the defaults many of them are fresh mmaps or heap the
    last step trimmed away, so each page faults again and the kernel zeroes it. Measured on the 2-core machine (the
    agent recipe, 8 steps, alternated runs): the kernel's (sys) time of a run 1.1-1.7 s -> 0.9-1.2 s, the first step
    0.97-1.24 s -> 0.87-1.03 s; later steps within the run-to-run noise. The cost: the process keeps its peak heap
    (what a step freed goes back to the OS at exit), which a training process reuses anyway.
    """
    if not sys.platform.startswith("linux") or any(k in os.environ for k in _USER_MALLOC_ENV):
        return {}
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return {}
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return {name: value for name, value in HOST_MALLOC.items() if mallopt(_MALLOPT[name], value) == 1}


_OPENMP_LIBS = ("libgomp", "libiomp5", "libomp.so")  # GNU (torch's Linux wheels), Intel, LLVM


@functools.cache
def _omp_pause() -> Callable[[int], int] | None:
    """omp_pause_resource_all of the OpenMP runtime torch loaded (found in /proc/self/maps); None when there is none
    to find (not Linux, or a runtime before OpenMP 5.0)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if any(n in line for n in _OPENMP_LIBS)}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            fn = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        fn.argtypes, fn.restype = (ctypes.c_int,), ctypes.c_int
        return fn
    return None


_SHARED_STREAMS: dict[int, torch.cuda.Stream] = {}


def shared_stream(device: torch.device | str) -> torch.cuda.Stream:
    """The CUDA stream of `device` that this process's trainer computes on (trainer.backend.futures.DeviceStreams)
    and that an in-process engine generating while the trainer waits (synchronous RL) queues its work on too.

    Why one stream: the caching allocator keeps a freed block for the stream that allocated it. On two streams the
    engine's freed KV cache and the trainer's freed activations each stay reserved for their own stream, so a
    colocated run needs the two peaks side by side instead of the larger one (issue 42: a 7B run on one GPU)."""
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SHARED_STREAMS:
        _SHARED_STREAMS[index] = torch.cuda.Stream(torch.device("cuda", index))
    return _SHARED_STREAMS[index]


def release_host_threads() -> bool:
    """Let the calling thread's OpenMP worker threads exit (omp_pause_resource_all(omp_pause_soft)); its next
    parallel op starts them again (tens of microseconds). True when released (or there was nothing to release).

    Why: OpenMP's thread pool belongs to the thread that ran the parallel region (the trainer's main thread, the
    embedded engine's model thread), and libgomp counts every pool's threads. Once two pools together hold more
    threads than the machine has cores, libgomp stops spinning at its barriers (a spin count of 100 where it is
    300000 otherwise): each worker sleeps in the kernel between two parallel ops and is woken for the next, which
    on small CPU ops costs more than the op. Measured on the 2-core machine: an engine thread decoding 512 rows on 2
    threads ran no faster than on 1 (76 vs 79 ms for 6 steps) while the trainer's thread held a pool of 2, and in
    50 ms once that pool was released; the train step slowed 0.20 -> 0.24 s while the engine's pool of 2 existed.
    So a thread that hands its cores to another (the trainer while an in-process engine generates; the engine when
    its batch drains) releases its pool first."""
    pause = _omp_pause()
    return pause is not None and pause(1) == 0  # 1: omp_pause_soft (the runtime may start them again)


# without_duck_sizing's calls, one at a time where the duck-sizing flag they set is process-wide (torch <= 2.11, the
# GPU image's): two threads' set-and-restore could interleave and leave it off, or restore it under a trace. From
# 2.12 torch's config is per thread (a ContextVar), and the calls (every compiled block's) need not wait on each other.
_CONFIG_PER_THREAD = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 12)
_NO_DUCK_LOCK = contextlib.nullcontext() if _CONFIG_PER_THREAD else threading.RLock()


def dynamic_compile(fn: Callable, *, backend: str | Callable = "inductor") -> Callable:
    """torch.compile(fn, dynamic=True, backend=backend), called with duck sizing off (`without_duck_sizing`).

    A dynamic compile alone still specialises where sizes coincide at its first call: duck sizing gives sizes that
    happen to be equal one symbol (a packed row's block count and the KV heads; a decode batch's rows and its
    cache's), so a later call where they differ recompiles, or a dimension is traced as a constant because its twin
    was (the heads are). Each is an inductor compile: seconds on a cold CUDA machine.

    Left as it is: a size traced at >= 2 guards `2 <= size` (0/1 specialisation), so the first call with a size of
    1 compiles once more. Unbacked sizes would avoid that, but the CUDA SDPA's size checks guard on them."""
    return without_duck_sizing(torch.compile(fn, dynamic=True, backend=backend))


def without_duck_sizing(compiled: Callable) -> Callable:
    """`compiled` (a torch.compile'd callable), each call traced with duck sizing off: a dynamic size gets a symbol
    of its own even where it equals another at that call. Duck sizing is read only while dynamo traces, so each
    call turns it off and back (~4 us, torch's closure patcher): for the calling thread in torch >= 2.12,
    process-wide before, where the calls hold one lock (the engine's decode and the trainer's blocks can run on two
    threads). Another thread's compile may then trace with duck sizing off too: fewer specialisations, the same
    results."""
    import torch.fx.experimental._config as fx_config

    no_duck = fx_config._make_closure_patcher(use_duck_shape=False)

    def call(*args, **kwargs):
        with _NO_DUCK_LOCK:
            restore = no_duck()
            try:
                return compiled(*args, **kwargs)
            finally:
                restore()

    return call
