"""Fixtures shared by the test modules (the root conftest.py holds the device policy and the `backend` fixture)."""

import signal

import pytest
import torch

# Ctrl-C as a terminal run has it. A test runner started in the background by a non-interactive shell inherits SIGINT
# ignored (POSIX: its asynchronous commands ignore SIGINT), and Python then installs no KeyboardInterrupt handler: the
# tests of Ctrl-C would see nothing, and every run they start would inherit the ignored signal too.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

from engines.embedded.launch import EngineProcess


@pytest.fixture
def one_torch_thread():
    """One torch thread for the test, restored after: the tiny model's steps are microseconds, and two threads on a
    shared, loaded machine make each op wait for the other thread (25x slower here)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def engine(request):
    """One embedded engine subprocess (the tiny preset) per test module, killed when the module is done; on the CPU
    on every machine, in float32, like the CPU tests that use it (a CUDA machine's default would be its GPU, in bf16).

    A module chooses the engine's seed and API key with module-level constants ENGINE_SEED (default 0) and
    ENGINE_API_KEY (default None: no key)."""
    seed = getattr(request.module, "ENGINE_SEED", 0)
    api_key = getattr(request.module, "ENGINE_API_KEY", None)
    with EngineProcess("tiny", seed=seed, api_key=api_key, device="cpu") as proc:
        yield proc
