"""Test-wide set-up for tests/ and bench/ (both are collected by `make test`).

Interpreter switch: without CUDA, TRITON_INTERPRET=1 is set before anything imports triton, so every Triton kernel
runs through the interpreter on CPU; with CUDA it is left unset, so GPU tests and benchmarks run compiled kernels
(`assert_compiled` proves it). Tests pick the path explicitly with `kernels.use_backend` (kernels/device.py).

How CUDA is detected: `torch.cuda.is_available()` with PYTORCH_NVML_BASED_CUDA_CHECK=1, which asks NVML instead of
initialising the CUDA runtime in this process, so fork-started workers (DataLoader, multiprocessing "fork") can
still use CUDA; a CPU-only torch build answers False without touching any driver. Importing torch does not
import triton, so the variable is still read in time.
"""

import os

os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device; this machine has none")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture(params=["torch", "triton"])
def backend(request):
    """Runs a test once through the torch path and once through the Triton path (interpreted on CPU)."""
    from kernels import use_backend

    with use_backend(request.param):
        yield request.param


@pytest.fixture
def assert_compiled():
    """`assert_compiled(kernel, run)` for GPU tests: runs `run()` and asserts `kernel` ran as a compiled
    `triton.runtime.jit.JITFunction` (not the interpreter) with a binary in its cache (bench/gpu_check.py)."""
    if not HAS_CUDA:
        pytest.skip("compiled Triton kernels need a CUDA device")
    from bench.gpu_check import check_compiled_run

    return check_compiled_run
