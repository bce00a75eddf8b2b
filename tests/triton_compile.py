"""Shared by the kernel tests: compile Triton kernels for an H100 (sm_90) in a fresh process, no GPU needed.

The interpreter accepts code that compiled Triton rejects (non-constexpr globals, mismatched branch types), so
every kernel module also compiles its real kernels with Triton's bundled toolchain. `ptxas_usage` (run inside
that process) compiles one launch as a GPU would specialize it and reads its registers and spills from ptxas.
"""

import os
import subprocess
import sys

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)


def compile_in_subprocess(script: str, **env: str) -> None:
    """Run `script` (it compiles kernels and prints "compiled") with the interpreter off; skip, with the reason,
    when this Triton build cannot target NVIDIA."""
    try:
        from triton.backends import backends
    except ImportError:
        pytest.skip("this triton has no backend registry")
    if "nvidia" not in backends:
        pytest.skip("this triton build has no NVIDIA backend to compile with")
    full_env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join([ROOT, TESTS]), **env}
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=full_env, capture_output=True, text=True,
                         timeout=300)
    if out.returncode != 0 and "ptxas" in out.stderr and "not found" in out.stderr.lower():
        pytest.skip("this Triton build ships no ptxas")
    assert out.returncode == 0 and "compiled" in out.stdout, out.stderr[-3000:]


# --- used inside the subprocess: what a CUDA launch of a kernel compiles to, and what ptxas says of it ---------

_POINTER_TYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "int64": "i64", "int32": "i32",
                  "uint8": "u8", "bool": "i1"}


def launch_signature(fn, args: dict, constexprs: dict) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) that Triton's launcher gives `fn` when called with `args`, so an offline
    compile sees what a GPU launch would: a torch dtype stands for a tensor of that dtype (16-byte aligned, as
    every torch allocation is), an int is specialized by value (1 becomes a constant; a multiple of 16 carries
    the divisibility hint that lets loads be 16 bytes wide), a float is fp32."""
    signature, attrs = {}, {}
    for name, value in args.items():
        hinted = False
        if isinstance(value, int) and not isinstance(value, bool) and value == 1:
            constexprs = {**constexprs, name: 1}
            continue
        if isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            hinted = value % 16 == 0
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:  # a torch.dtype: a tensor argument
            signature[name] = "*" + _POINTER_TYPES[str(value).removeprefix("torch.")]
            hinted = True
        if hinted:
            attrs[(fn.arg_names.index(name),)] = [["tt.divisibility", 16]]
    signature.update({name: "constexpr" for name in constexprs})
    return signature, constexprs, attrs


def ptxas_usage(fn, args: dict, constexprs: dict, num_warps: int = 4) -> tuple[int, int, int]:
    """(registers, spill store bytes, spill load bytes) per thread of `fn` compiled for an H100 (sm_90a, the
    target Triton picks there) at this launch, from the bundled ptxas's `-v` report."""
    import re
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    signature, constexprs, attrs = launch_signature(fn, args, constexprs)
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    with tempfile.TemporaryDirectory() as d:
        with open(f"{d}/k.ptx", "w") as f:
            f.write(kernel.asm["ptx"])
        out = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name", "sm_90a", f"{d}/k.ptx", "-o", f"{d}/k.cubin"],
                             capture_output=True, text=True, check=True).stderr
    stores = sum(int(x) for x in re.findall(r"(\d+) bytes spill stores", out))
    loads = sum(int(x) for x in re.findall(r"(\d+) bytes spill loads", out))
    return max(int(x) for x in re.findall(r"Used (\d+) registers", out)), stores, loads
