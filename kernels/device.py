"""Device policy, in one place.

    CUDA tensor                      -> "triton"  (compiled Triton kernels)
    CPU tensor, TRITON_INTERPRET=1   -> "triton"  (Triton's interpreter: how tests prove kernels without a GPU)
    CPU tensor otherwise             -> "torch"   (plain torch implementation, the production CPU path)

Tests run both paths in one process with `use_backend("torch")` / `use_backend("triton")`. Forcing "triton"
on a CPU tensor without TRITON_INTERPRET=1 is an error, never a silent fallback.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
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
