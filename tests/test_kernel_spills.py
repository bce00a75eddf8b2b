"""Every Triton kernel the project launches on CUDA compiles for an H100 at its real launch configuration without
register spills: a spill turns a pass over the logits (or a copy) into extra local-memory traffic.

No GPU needed: in one fresh process (interpreter off), each kernel is compiled for sm_90 with Triton's toolchain at
the block sizes and num_warps its host launcher picks on CUDA, for the dtypes and sizes users run, with the
argument specialization a GPU launch gets (tests/triton_compile.py: launch_signature), and Triton's bundled ptxas
reports the registers and spill bytes of each (`ptxas -v`).

Sizes: vocabularies of Llama 2 (32000), GPT-2 (50257: not a multiple of 16, so no wide loads) and Qwen2
(151936); hidden sizes of Qwen2-0.5B (896), 7-8B models (4096) and 70B models (8192), an odd width (1000), and
D = 1 (token ids, masks, log-probs: what the trainer packs).
"""

from triton_compile import compile_in_subprocess

_SPILL_CHILD = r"""
import torch
from triton_compile import ptxas_usage
from kernels.logprobs import FLOAT_DTYPES, _block_v, _token_logprobs_bwd_kernel, _token_logprobs_fwd_kernel
from kernels.packing import (_TOKEN_BLOCK, _broadcast_kernel, _copy_tiles, _layout_kernel, _pack_kernel,
                             _unpack_kernel)
from kernels.scale import _masked_scale_kernel
from kernels.sampling import _launch_config, _sample_kernel

f32, i64 = torch.float32, torch.int64
cuda = torch.device("cuda")
launches = []  # (name, kernel, args, constexprs, num_warps): what the host launchers pass on CUDA

# kernels/logprobs.py (also under linear_logprobs, linear_policy_loss, policy_loss): one program per row.
for V in (32000, 50257, 151936):
    for dt in FLOAT_DTYPES:
        block, warps = _block_v(V, dt, cuda)
        for ent in (True, False):
            rows = dict(lab_ptr=i64, keep_ptr=torch.bool, V=V, stride_row=V, inv_t=0.7)
            consts = dict(HAS_ENT=ent, BLOCK_V=block)
            fwd = dict(x_ptr=dt, logp_ptr=f32, ent_ptr=f32, lse_ptr=f32, **rows)
            bwd = dict(x_ptr=dt, dx_ptr=dt, lse_ptr=f32, ent_ptr=f32, glogp_ptr=f32, gent_ptr=f32, stride_drow=V,
                       **rows)
            for fn, args in ((_token_logprobs_fwd_kernel, fwd), (_token_logprobs_bwd_kernel, bwd)):
                launches.append((f"{fn.__name__} V={V} {dt} ent={ent} BLOCK_V={block}", fn, args, consts, warps))

# kernels/packing.py: pack/unpack copy any dtype (bool as uint8); only the element size reaches the code. The
# layout and broadcast kernels launch at the default 4 warps.
for D, L in ((1, 1000), (1, 4096), (50, 1000), (100, 300), (896, 1000), (1000, 300), (4096, 4096), (8192, 2048)):
    block_t, block_d, warps = _copy_tiles(D)
    for dt in (torch.uint8, torch.bfloat16, torch.float16, torch.float32, torch.int32, i64):
        rows = dict(len_ptr=torch.int32, cu_ptr=torch.int32, L=L, D=D)
        tiles = dict(BLOCK_T=block_t, BLOCK_D=block_d)
        name = f"D={D} L={L} {dt} BLOCK_T={block_t} BLOCK_D={block_d}"
        launches.append((f"_pack_kernel {name}", _pack_kernel, dict(pad_ptr=dt, flat_ptr=dt, **rows), tiles,
                         warps))
        launches.append((f"_unpack_kernel {name}", _unpack_kernel, dict(flat_ptr=dt, pad_ptr=dt, **rows),
                         dict(FILL=0, **tiles), warps))
for cu in (torch.int32, i64):
    launches.append((f"_layout_kernel cu={cu}", _layout_kernel, dict(cu_ptr=cu, pos_ptr=i64, seq_ptr=i64, N=4099, S=37),
                     dict(N_ITERS=(37).bit_length(), BLOCK=_TOKEN_BLOCK), 4))
for dt in (f32, torch.bfloat16, i64):
    launches.append((f"_broadcast_kernel {dt}", _broadcast_kernel, dict(val_ptr=dt, seq_ptr=i64, out_ptr=dt, N=4099),
                     dict(FILL=0, BLOCK=_TOKEN_BLOCK), 4))

# kernels/scale.py launches BLOCK=1024 at the default 4 warps (bench/gpu_check.py's preflight runs it).
for dt in FLOAT_DTYPES:
    launches.append((f"_masked_scale_kernel {dt}", _masked_scale_kernel,
                     dict(x_ptr=dt, m_ptr=torch.bool, y_ptr=f32, n=4099, alpha=0.37), dict(BLOCK=1024), 4))

# kernels/sampling.py: one row a program on CUDA (the engine's decode step; fp32 probabilities).
for V in (32000, 50257, 151936):
    rows, block, warps = _launch_config(64, V, cuda)
    launches.append((f"_sample_kernel V={V} ROWS={rows} BLOCK={block}", _sample_kernel,
                     dict(p_ptr=f32, key_ptr=i64, pos_ptr=i64, out_ptr=i64, B=64, V=V, stride_row=V),
                     dict(ROWS=rows, BLOCK=block), warps))

report = []
for name, fn, args, consts, warps in launches:
    regs, stores, loads = ptxas_usage(fn, args, consts, warps)
    report.append((f"{name} warps={warps}", regs, stores, loads))
    print(f"{name} warps={warps}: {regs} registers, spill stores {stores} B, spill loads {loads} B", flush=True)
bad = [r for r in report if r[2] or r[3]]
assert not bad, "register spills (name, registers, store bytes, load bytes): " + repr(bad)
print(f"compiled {len(report)}")
"""


def test_every_launched_kernel_compiles_for_sm90_without_register_spills():
    compile_in_subprocess(_SPILL_CHILD)
