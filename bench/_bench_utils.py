"""Helpers shared by the kernel benchmarks (bench_logprobs.py, bench_policy_loss.py)."""

import contextlib

import pytest
import torch

from kernels import use_backend


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _shape(sizes, size, small_shape, device, small):
    """The shape of this parametrisation, or a skip: the CI smoke run (--benchmark-disable) runs one small shape."""
    if small:
        if size != next(iter(sizes)):
            pytest.skip("the smoke run (--benchmark-disable) measures one small shape")
        return small_shape
    if sizes[size][0] != device:
        pytest.skip(f"size {size} is for {sizes[size][0]}; this machine is {device}")
    return sizes[size][1]


def _backend_ctx(device, small):
    # On CPU time the torch path: conftest.py sets TRITON_INTERPRET=1, which would time the interpreter.
    return use_backend("torch") if device == "cpu" and not small else contextlib.nullcontext()
