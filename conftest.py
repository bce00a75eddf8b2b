"""Test-wide set-up for tests/ and bench/ (both are collected by `make test`).

Interpreter switch: without CUDA, TRITON_INTERPRET=1 is set before anything imports triton, so every Triton kernel
runs through the interpreter on CPU; with CUDA it is left unset, so GPU tests and benchmarks run compiled kernels
(`assert_compiled` proves it). Tests pick the path explicitly with `kernels.use_backend` (kernels/device.py).

How CUDA is detected: `torch.cuda.is_available()` with PYTORCH_NVML_BASED_CUDA_CHECK=1, which asks NVML instead of
initialising the CUDA runtime in this process, so fork-started workers (DataLoader, multiprocessing "fork") can
still use CUDA; a CPU-only torch build answers False without touching any driver. Importing torch does not
import triton, so the variable is still read in time.

End of the run (`pytest_sessionfinish`, here so that it covers the bench/ suites that gpu-check runs on their own
too): what tests leave alive in this process is released before the interpreter exits, where CUDA processes have
died of SIGSEGV after pytest's summary (`release_test_leftovers`).
"""

import gc
import os
import sys

os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (`make test` runs `-n 2`) every worker is one of several processes on the machine's cores: each
# computes on one torch thread, and so do the processes its tests start with this environment (CLI runs, torchrun
# ranks, engines), or two workers' thread pools oversubscribe the cores and spin against each other. A test that
# needs another count sets it (and restores it) itself.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)


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


def release_test_leftovers() -> dict:
    """Close what the tests left alive in this process; returns what it found ({"local_engines": n, "senders": n,
    "process_group": bool, "errors": [...]}).

    - in-process engines (engines.local.LocalEngine, also the tiny preset's): their event-loop thread is a daemon
      that would still be running when the interpreter tears CUDA down under it; close() stops it and the model
      thread (idempotent);
    - weight-sync senders never closed (trainer.weight_sync.WeightSyncSender): their broadcast groups and slots;
    - the default torch.distributed group that build_components / init_distributed create in this process (on CUDA
      an NCCL communicator, destroyed here rather than by a destructor at exit).
    Each is closed the way the project closes it, which is safe on the CPU as well. Modules that were never imported
    are not imported here, and a failure to close one thing is recorded and the rest still closed."""
    found: dict = {"local_engines": 0, "senders": 0, "process_group": False, "errors": []}
    # senders first: their groups go before the engines that receive on them
    for key, module, name in (("senders", "trainer.weight_sync.sender", "WeightSyncSender"),
                              ("local_engines", "engines.local", "LocalEngine")):
        if module not in sys.modules:
            continue
        cls = getattr(sys.modules[module], name)
        # type(), not isinstance(): isinstance also asks an object's __class__, which some of torch's deprecated
        # module attributes answer with a warning
        for obj in [o for o in gc.get_objects() if issubclass(type(o), cls)]:
            found[key] += 1
            try:
                obj.close()
            except Exception as e:  # noqa: BLE001 - recorded; the rest is still released
                found["errors"].append(f"{name}.close(): {type(e).__name__}: {e}")
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        found["process_group"] = True
        try:
            dist.destroy_process_group()
        except Exception as e:  # noqa: BLE001
            found["errors"].append(f"destroy_process_group(): {type(e).__name__}: {e}")
    return found


@pytest.hookimpl(trylast=True)  # after the junitxml plugin has written its report (gpu-check's verdict)
def pytest_sessionfinish(session, exitstatus):
    for error in release_test_leftovers()["errors"]:
        print(f"conftest.py, releasing what the tests left: {error}", file=sys.stderr)
