"""The log-prob kernels (the row-softmax primitives every loss runs on) compile for an H100 at their real launch
configuration without register spills: a spill turns the one pass over the logits into local-memory traffic.

No GPU needed: the kernels are compiled for sm_90 with Triton's toolchain in a fresh process (interpreter off), at
the BLOCK_V / num_warps that `kernels.logprobs._block_v` picks on CUDA for the vocabularies users run, and Triton's
bundled ptxas reports the registers and spill bytes of each (`ptxas -v`).
"""

from triton_compile import compile_in_subprocess

_SPILL_CHILD = r"""
import re, subprocess, tempfile, torch, triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource
from kernels.logprobs import _block_v, _token_logprobs_bwd_kernel, _token_logprobs_fwd_kernel

ptxas = get_ptxas(90).path
common = {"lab_ptr": "*i64", "keep_ptr": "*i1", "V": "i32", "stride_row": "i32", "inv_t": "fp32",
          "HAS_ENT": "constexpr", "BLOCK_V": "constexpr"}
report = []
for V in (32000, 151936):
    for tdt, dt in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        block, warps = _block_v(V, tdt, torch.device("cuda"))
        for ent in (True, False):
            consts = {"HAS_ENT": ent, "BLOCK_V": block}
            fwd = {"x_ptr": f"*{dt}", "logp_ptr": "*fp32", "ent_ptr": "*fp32", "lse_ptr": "*fp32", **common}
            bwd = {"x_ptr": f"*{dt}", "dx_ptr": f"*{dt}", "lse_ptr": "*fp32", "ent_ptr": "*fp32",
                   "glogp_ptr": "*fp32", "gent_ptr": "*fp32", "stride_drow": "i32", **common}
            for fn, sig in ((_token_logprobs_fwd_kernel, fwd), (_token_logprobs_bwd_kernel, bwd)):
                k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts),
                                   target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
                with tempfile.TemporaryDirectory() as d:  # Triton targets sm_90a on an H100
                    open(f"{d}/k.ptx", "w").write(k.asm["ptx"])
                    out = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", f"{d}/k.ptx", "-o", f"{d}/k.cubin"],
                                         capture_output=True, text=True, check=True).stderr
                stores = sum(int(x) for x in re.findall(r"(\d+) bytes spill stores", out))
                loads = sum(int(x) for x in re.findall(r"(\d+) bytes spill loads", out))
                regs = max(int(x) for x in re.findall(r"Used (\d+) registers", out))
                name = f"{fn.__name__} V={V} {dt} ent={ent} BLOCK_V={block} warps={warps}"
                report.append((name, regs, stores, loads))
for name, regs, stores, loads in report:
    print(f"{name}: {regs} registers, spill stores {stores} B, spill loads {loads} B")
bad = [r for r in report if r[2] or r[3]]
assert not bad, f"register spills: {bad}"
assert len(report) == 16
print("compiled")
"""


def test_logprob_kernels_compile_for_sm90_without_register_spills():
    compile_in_subprocess(_SPILL_CHILD)
