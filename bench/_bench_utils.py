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


# ---------------------------------------------------------------------------------------------------------
# Device memory plans: each bench_<op>.py sizes its cases with one function, used both by the run (a case that
# cannot fit is skipped with the reason) and by `bench/gpu_check.py --dry-run` (every CUDA case listed with its
# planned bytes against --memory-gb), so the two cannot disagree.
# ---------------------------------------------------------------------------------------------------------
MEMORY_FRACTION = 0.9  # of the device's memory a case may plan for: the CUDA context, allocator fragmentation
TOKEN_VECTOR_BYTES = 64  # per token, generously: labels int64, mask, upstream grads, old/ref/adv, [T] outputs


def fit_reason(nbytes: int, memory_bytes: float) -> str | None:
    """None when a case planning `nbytes` fits MEMORY_FRACTION of `memory_bytes`, else why it is skipped."""
    budget = MEMORY_FRACTION * memory_bytes
    if nbytes <= budget:
        return None
    return (f"plans {nbytes / 1e9:.1f} GB of device memory, more than {budget / 1e9:.1f} GB "
            f"({MEMORY_FRACTION:.0%} of {memory_bytes / 1e9:.1f} GB): run it on a larger device")


def device_memory_bytes() -> int | None:
    """Bytes this process can still get on the current CUDA device (free, plus what the caching allocator holds
    unused from earlier cases); None without CUDA (CPU sizes are not planned)."""
    if not torch.cuda.is_available():
        return None
    free, _ = torch.cuda.mem_get_info()
    return free + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()


def skip_unless_fits(nbytes: int) -> None:
    """Skip the running case, with the reason, when its planned bytes do not fit this device."""
    memory = device_memory_bytes()
    if memory is not None and (why := fit_reason(nbytes, memory)) is not None:
        pytest.skip(why)


def planned_suite_cases(memory_bytes: float, suites, case_bytes) -> list[dict]:
    """Every case of a provider x mode x size suite at its CUDA sizes, with its planned bytes (`case_bytes(op,
    provider, mode, shape)`) against `memory_bytes`. suites: (op, sizes {id: (device, shape)}, providers, test name)."""
    return [plan_entry(f"{test}[{provider}-{mode}-{size}]", case_bytes(op, provider, mode, shape), memory_bytes)
            for op, sizes, providers, test in suites
            for size, (device, shape) in sizes.items() if device == "cuda"
            for provider in providers for mode in ("fwd", "full")]


def plan_entry(case: str, nbytes: int, memory_bytes: float) -> dict:
    """One line of a dry-run plan: the case, its planned bytes, and the skip reason where it does not fit."""
    entry: dict = {"case": case, "bytes": int(nbytes), "GB": round(nbytes / 1e9, 2)}
    if (why := fit_reason(nbytes, memory_bytes)) is not None:
        entry["skipped"] = why
    return entry
