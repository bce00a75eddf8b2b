"""The device policy: CUDA -> Triton, CPU -> torch, TRITON_INTERPRET=1 -> Triton's interpreter; the host's malloc."""

import json
import subprocess
import sys

import pytest
import torch
from device_support import cpu_child_env

from kernels import backend_for, masked_scale, use_backend
from kernels.device import HOST_MALLOC, triton_interpret


def test_interpreter_is_on_for_tests():
    # conftest.py sets it before triton is imported; every Triton kernel test relies on it.
    assert triton_interpret()


def test_cpu_tensor_routes_to_triton_under_interpreter_and_torch_when_forced():
    x = torch.randn(3)
    assert backend_for(x) == "triton"
    with use_backend("torch"):
        assert backend_for(x) == "torch"
    assert backend_for(x) == "triton"


def test_cpu_without_interpreter_routes_to_torch(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert backend_for(torch.randn(3)) == "torch"
    with use_backend("triton"), pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        backend_for(torch.randn(3))


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="backend"), use_backend("cuda"):  # type: ignore[arg-type]
        pass


@pytest.mark.parametrize("n", [1, 1000, 1025, 4099])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_scale_triton_interpreter_matches_torch(n, dtype):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g).to(dtype)
    m = (torch.rand(n, generator=g) < 0.7).to(torch.int32)
    alpha = float(torch.rand((), generator=g)) * 3 - 1.5
    with use_backend("triton"):
        y_triton = masked_scale(x, m, alpha)
    with use_backend("torch"):
        y_torch = masked_scale(x, m, alpha)
    expected = torch.where(m.bool(), x.double() * alpha, 0.0)
    assert y_triton.dtype == torch.float32
    torch.testing.assert_close(y_triton.double(), expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(y_torch.double(), expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(y_triton[m == 0], torch.zeros_like(y_triton[m == 0]))


def test_masked_scale_bad_input_names_argument():
    with pytest.raises(ValueError, match="mask shape"):
        masked_scale(torch.randn(4), torch.ones(5, dtype=torch.int32))
    with pytest.raises(ValueError, match="contiguous"):
        masked_scale(torch.randn(4, 4).t(), torch.ones(4, 4, dtype=torch.int32).t())


@pytest.mark.gpu
def test_masked_scale_compiled_triton_on_cuda():
    x = torch.randn(10_000, device="cuda")
    m = (torch.rand(10_000, device="cuda") < 0.5).int()
    assert backend_for(x) == "triton"
    torch.testing.assert_close(masked_scale(x, m, 2.0), torch.where(m.bool(), 2 * x, 0.0))


_MALLOC_CHILD = r"""
import json, os, torch
from kernels.device import tune_host_malloc

def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

applied = tune_host_malloc()
base = rss_mb()
x = torch.ones(16 << 20)  # 64 MiB, every page touched
held = rss_mb()
del x
print(json.dumps({"applied": applied, "grew": held - base, "kept": rss_mb() - base}))
"""


def _malloc_child(env: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", _MALLOC_CHILD], env={**cpu_child_env(), **env}, check=True,
                         capture_output=True, text=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc: Linux only")
def test_tuned_host_malloc_keeps_a_freed_step_buffer_and_the_user_setting_wins():
    """In a fresh process: tune_host_malloc sets glibc's three parameters, and a freed 64 MiB tensor stays in the
    process (the next step reuses it) where glibc's defaults give its pages back (an mmap of its own). A user's own
    malloc setting (here LD_PRELOAD, empty) leaves malloc alone."""
    tuned = _malloc_child({})
    assert tuned["applied"] == HOST_MALLOC
    assert tuned["grew"] > 60 and tuned["kept"] > 60, tuned
    left = _malloc_child({"LD_PRELOAD": ""})
    assert left["applied"] == {}
    assert left["grew"] > 60 and left["kept"] < 8, left


def test_without_duck_sizing_locks_only_where_torchs_config_is_process_wide():
    """kernels.device.without_duck_sizing holds a lock around each call only where a config flag set by one thread is
    seen by another (torch <= 2.11); the version rule it uses must agree with what this torch does. Its calls turn
    duck sizing off inside and leave it as it was."""
    import threading

    import torch.fx.experimental._config as fx_config

    from kernels import device

    seen = {}
    restore = fx_config._make_closure_patcher(use_duck_shape=False)()
    try:
        other = threading.Thread(target=lambda: seen.setdefault("other", fx_config.use_duck_shape))
        other.start()
        other.join()
        seen["self"] = fx_config.use_duck_shape
    finally:
        restore()
    assert seen["self"] is False
    assert device._CONFIG_PER_THREAD == (seen["other"] is True), seen  # per thread: the other thread kept duck sizing
    assert isinstance(device._NO_DUCK_LOCK, type(threading.RLock())) != device._CONFIG_PER_THREAD
    inside = device.without_duck_sizing(lambda: fx_config.use_duck_shape)()
    assert inside is False and fx_config.use_duck_shape is True
