"""`make gpu-check` (bench/gpu_check.py) and the interpreter switch of the root conftest: on this CPU machine the
check refuses with exit status 2 and writes nothing; the compiled-kernel assertion rejects an interpreted kernel;
on a GPU the same assertion passes for a real kernel of ours."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.gpu_check import check_compiled_run, compiled_binaries, markdown

ROOT = Path(__file__).resolve().parent.parent


def _clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTORCH_NVML_BASED_CUDA_CHECK")}
    return {**env, **extra}


@pytest.mark.skipif(torch.cuda.is_available(), reason="exercises the no-CUDA refusal")
def test_gpu_check_without_cuda_exits_2_with_a_clear_message(tmp_path):
    r = subprocess.run([sys.executable, "bench/gpu_check.py", "--out", str(tmp_path)], cwd=ROOT, env=_clean_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "needs a CUDA device" in r.stderr and "make test" in r.stderr
    assert list(tmp_path.iterdir()) == []  # nothing measured, nothing written


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU branch of the switch")
def test_conftest_sets_the_interpreter_only_without_cuda():
    code = ("import os, conftest, sys; print(os.environ.get('TRITON_INTERPRET'), conftest.HAS_CUDA, "
            "'triton' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_clean_env(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["1", "False", "False"]  # set, and before triton was imported


@pytest.mark.skipif(torch.cuda.is_available(), reason="the kernel is compiled on a CUDA machine")
def test_compiled_check_rejects_an_interpreted_kernel(monkeypatch):
    from kernels.scale import _masked_scale_kernel

    assert compiled_binaries(_masked_scale_kernel) == 0
    with pytest.raises(AssertionError, match="TRITON_INTERPRET is set"):
        check_compiled_run(_masked_scale_kernel, lambda: None)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(AssertionError, match="not a compiled triton JITFunction"):
        check_compiled_run(_masked_scale_kernel, lambda: None)


@pytest.mark.gpu
def test_masked_scale_runs_compiled_on_the_gpu(assert_compiled):
    from kernels import masked_scale, use_backend
    from kernels.scale import _masked_scale_kernel

    x = torch.randn(3001, device="cuda")
    mask = torch.rand(3001, device="cuda") > 0.5
    with use_backend("triton"):
        y = assert_compiled(_masked_scale_kernel, lambda: masked_scale(x, mask, 1.7))
    torch.testing.assert_close(y, torch.where(mask, 1.7 * x, 0.0), rtol=0, atol=1e-6)


def test_markdown_report_names_failures_and_figures():
    report = {"date": "d", "status": "failed: gpu_tests", "versions": {"gpu": "H100", "torch": "2.11"},
              "preflight": {"ok": True}, "gpu_tests": {"tests": 3, "failures": 1, "errors": 0, "skipped": 0,
                                                       "seconds": 1.0, "failed": ["tests.test_x::test_y"]},
              "weight_sync": {"colocated_ms": 41.5, "broadcast_skipped": "one GPU"},
              "benchmarks": {"results": [{"name": "bench_a", "median_ms": 1.25, "gbps": 2900.0}]}}
    md = markdown(report)
    assert "# gpu-check on H100" in md and "`tests.test_x::test_y`" in md and "colocated_ms: 41.500" in md
    assert "| `bench_a` | 1.250 | gbps=2.9e+03 |" in md
