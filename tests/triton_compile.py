"""Shared by the kernel tests: compile Triton kernels for an H100 (sm_90) in a fresh process, no GPU needed.

The interpreter accepts code that compiled Triton rejects (non-constexpr globals, mismatched branch types), so
every kernel module also compiles its real kernels with Triton's bundled toolchain.
"""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def compile_in_subprocess(script: str, **env: str) -> None:
    """Run `script` (it compiles kernels and prints "compiled") with the interpreter off; skip, with the reason,
    when this Triton build cannot target NVIDIA."""
    try:
        from triton.backends import backends
    except ImportError:
        pytest.skip("this triton has no backend registry")
    if "nvidia" not in backends:
        pytest.skip("this triton build has no NVIDIA backend to compile with")
    full_env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": ROOT, **env}
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=full_env, capture_output=True, text=True,
                         timeout=300)
    if out.returncode != 0 and "ptxas" in out.stderr and "not found" in out.stderr.lower():
        pytest.skip("this Triton build ships no ptxas")
    assert out.returncode == 0 and "compiled" in out.stdout, out.stderr[-3000:]
