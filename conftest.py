"""Test-wide set-up for tests/ and bench/ (both are collected by `make test`).

TRITON_INTERPRET=1 is set before anything imports triton, so on a CPU machine every Triton kernel can run
through the interpreter; tests pick the path explicitly with `kernels.use_backend` (see kernels/device.py).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device; this machine has none")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


@pytest.fixture(params=["torch", "triton"])
def backend(request):
    """Runs a test once through the torch path and once through the Triton path (interpreted on CPU)."""
    from kernels import use_backend

    with use_backend(request.param):
        yield request.param
