"""Launch-config sweep of the from-logits kernels (issue 42 item 9): `python bench/tune_logits.py [--json OUT]`.

Times `kernels.logprobs`' forward and backward kernels at each (BLOCK_V, num_warps) candidate, a forward variant
with per-lane accumulators (no cross-warp reduction inside the vocabulary loop: each lane keeps its own running
(m, s, sd) and the lanes merge once at the end), the public `token_logprobs` forward and forward+backward, Liger's
`fused_selective_log_softmax` and a device copy of the same bytes, at the bench's CUDA sizes (bf16). Each variant's
log-prob and entropy are checked against torch's fp32 log_softmax first (a variant that is wrong is reported, not
timed). Medians of `triton.testing.do_bench` (CUDA events); GB/s counts the logits read (fwd) or read twice and
written once (bwd). `--small` runs tiny sizes under TRITON_INTERPRET=1 on a CPU (the correctness half only).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels._softmax_tiles import M_INIT_TL, softmax_stats_finalize  # noqa: E402
from kernels.logprobs import (  # noqa: E402
    _block_v,
    _token_logprobs_bwd_kernel,
    _token_logprobs_fwd_kernel,
    token_logprobs,
)

# Candidates besides the shipped config (kernels.logprobs._block_v for the size, always swept first).
FWD_CONFIGS = [(8192, 8), (16384, 16), (16384, 32), (32768, 32)]
VEC_CONFIGS = [(1024, 4), (2048, 4), (2048, 8), (4096, 8), (4096, 16), (8192, 16)]
BWD_CONFIGS = [(4096, 8), (2048, 4), (16384, 16), (16384, 32)]


@triton.jit
def _fwd_lanes_kernel(x_ptr, lab_ptr, keep_ptr, logp_ptr, ent_ptr, lse_ptr, V, stride_row, inv_t,
                      HAS_ENT: tl.constexpr, BLOCK_V: tl.constexpr):
    # Per-lane online statistics: lane i folds columns i, i + BLOCK_V, ... into its own (m_i, s_i, sd_i) with
    # elementwise ops only; one merge at the end: M = max m_i, S = Σ s_i e^(m_i − M),
    # SD = Σ e^(m_i − M) (sd_i + (m_i − M) s_i). Two exps per element instead of one, no block barrier per tile.
    row = tl.program_id(0).to(tl.int64)
    keep = tl.load(keep_ptr + row) != 0
    logp = 0.0
    ent = 0.0
    lse = 0.0
    if keep:
        row_ptr = x_ptr + row * stride_row
        label = tl.load(lab_ptr + row)
        m = tl.full([BLOCK_V], M_INIT_TL, tl.float32)
        s = tl.zeros([BLOCK_V], tl.float32)
        sd = tl.zeros([BLOCK_V], tl.float32)
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V).to(tl.int64)
            valid = cols < V
            z = tl.load(row_ptr + cols, mask=valid, other=float("-inf")).to(tl.float32) * inv_t
            m_new = tl.maximum(m, z)
            alpha = tl.exp(m - m_new)
            e = tl.exp(z - m_new)
            if HAS_ENT:
                d = tl.where(e > 0.0, z - m_new, 0.0)
                sd = alpha * (sd + (m - m_new) * s) + e * d
            s = alpha * s + e
            m = m_new
        mx = tl.max(m, axis=0)
        w = tl.exp(m - mx)
        s_all = tl.sum(s * w, axis=0)
        sd_all = 0.0
        if HAS_ENT:
            sd_all = tl.sum(w * (sd + (m - mx) * s), axis=0)
        lse, ent = softmax_stats_finalize(mx, s_all, sd_all)
        logp = (tl.load(row_ptr + label).to(tl.float32) * inv_t - mx) - tl.log(s_all)
    tl.store(logp_ptr + row, logp)
    tl.store(lse_ptr + row, lse)
    if HAS_ENT:
        tl.store(ent_ptr + row, ent)


def _launch_fwd(kernel, x, labels, keep, with_ent, block, warps):
    N, V = x.shape
    logp, lse, ent = (torch.empty(N, dtype=torch.float32, device=x.device) for _ in range(3))
    kernel[(N,)](x, labels, keep, logp, ent, lse, V, x.stride(0), 1.0, HAS_ENT=with_ent, BLOCK_V=block,
                 num_warps=warps)
    return logp, ent, lse


def _launch_bwd(x, dx, labels, keep, lse, ent, g, ge, with_ent, block, warps):
    N, V = x.shape
    _token_logprobs_bwd_kernel[(N,)](x, dx, labels, keep, lse, ent, g, ge, V, x.stride(0), dx.stride(0), 1.0,
                                     HAS_ENT=with_ent, BLOCK_V=block, num_warps=warps)


def _bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def run_size(T: int, V: int, dtype, device: str, timed: bool) -> dict:
    g = torch.Generator(device="cpu").manual_seed(T * 7 + V)
    x = (2 * torch.randn(T, V, generator=g)).to(dtype).to(device)
    labels = torch.randint(0, V, (T,), generator=g).to(device)
    keep = (torch.rand(T, generator=g) < 0.9).to(device)
    gl, ge = torch.randn(T, generator=g).to(device), torch.randn(T, generator=g).to(device)
    ref = torch.log_softmax(x.float(), -1)
    ref_logp = torch.where(keep, ref.gather(1, labels[:, None])[:, 0], 0.0)
    ref_ent = torch.where(keep, -(ref.exp() * ref).sum(-1), 0.0)
    del ref
    e = x.element_size()
    shipped = _block_v(V, dtype, x.device)  # (BLOCK_V, num_warps) the op launches at this size
    out = {"T": T, "V": V, "dtype": str(dtype), "shipped": f"tiles-{shipped[0]}-{shipped[1]}", "fwd": {}, "bwd": {}}
    if timed:
        src = torch.empty(T * V * e, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        t = _bench(lambda: dst.copy_(src))
        out["copy_GBps"] = 2 * src.numel() / t / 1e6
        del src, dst
    fwd_bytes, bwd_bytes = T * V * e, 3 * T * V * e
    tiles, bwd_configs = ([shipped] + [c for c in configs if c != shipped] for configs in (FWD_CONFIGS, BWD_CONFIGS))
    for name, kernel, configs in (("tiles", _token_logprobs_fwd_kernel, tiles),
                                  ("lanes", _fwd_lanes_kernel, VEC_CONFIGS)):
        for block, warps in configs:
            for with_ent in (False, True):
                key = f"{name}-{block}-{warps}{'-ent' if with_ent else ''}"
                launch = functools.partial(_launch_fwd, kernel, x, labels, keep, with_ent, block, warps)
                logp, ent, _ = launch()
                err = (logp - ref_logp).abs().max().item()
                if with_ent:
                    err = max(err, (ent - ref_ent).abs().max().item())
                row = {"max_abs_err": err}
                if err > 1e-3 or err != err:
                    row["wrong"] = True
                elif timed:
                    ms = _bench(launch)
                    row.update(ms=ms, GBps=fwd_bytes / ms / 1e6)
                out["fwd"][key] = row
    _, ent, lse = _launch_fwd(_token_logprobs_fwd_kernel, x, labels, keep, True, *shipped)
    dx_ref = None  # the shipped config's gradient, which the others are compared with
    for block, warps in bwd_configs:
        dx = torch.empty_like(x)
        launch = functools.partial(_launch_bwd, x, dx, labels, keep, lse, ent, gl, ge, True, block, warps)
        launch()
        if dx_ref is None:
            dx_ref = dx.float()
            err = 0.0
        else:
            err = (dx.float() - dx_ref).abs().max().item()
        row = {"max_abs_diff_vs_first": err}
        if timed:
            ms = _bench(launch)
            row.update(ms=ms, GBps=bwd_bytes / ms / 1e6)
        out["bwd"][f"tiles-{block}-{warps}-ent"] = row
    if timed:
        out["public_fwd_ms"] = _bench(lambda: token_logprobs(x, labels, mask=keep))
        xl = x.clone().requires_grad_(True)

        def full():
            xl.grad = None
            lp, en = token_logprobs(xl, labels, mask=keep, return_entropy=True)
            ((lp * gl).sum() + (en * ge).sum()).backward()

        out["public_full_ms"] = _bench(full)
        try:
            from liger_kernel.ops.grpo_loss import fused_selective_log_softmax

            x3 = torch.cat([x, x[:1]])[None]  # [1, T+1, V]: Liger drops the last position
            lg = fused_selective_log_softmax(x3, labels[None], temperature=1.0, mask=keep[None])
            out["liger_max_abs_err"] = (torch.where(keep, lg[0].float(), 0.0) - ref_logp).abs().max().item()
            ms = _bench(lambda: fused_selective_log_softmax(x3, labels[None], temperature=1.0, mask=keep[None]))
            out["liger_fwd"] = {"ms": ms, "GBps": fwd_bytes / ms / 1e6}
        except Exception as exc:  # Liger absent or failing: recorded, the sweep goes on
            out["liger_fwd"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--small", action="store_true", help="tiny sizes, correctness only (CPU + TRITON_INTERPRET)")
    args = ap.parse_args()
    if args.small:
        assert os.environ.get("TRITON_INTERPRET") == "1", "--small runs under TRITON_INTERPRET=1"
        sizes, device, timed = [(6, 1271), (5, 300)], "cpu", False
    else:
        sizes, device, timed = [(4096, 32000), (4096, 151936), (16384, 32000), (16384, 151936)], "cuda", True
    results = [run_size(T, V, torch.bfloat16, device, timed) for T, V in sizes]
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    for r in results:
        print(f"T{r['T']}-V{r['V']}: copy {r.get('copy_GBps', 0):.0f} GB/s, liger {r.get('liger_fwd')}, "
              f"public fwd {r.get('public_fwd_ms', 0):.3f} ms full {r.get('public_full_ms', 0):.3f} ms")
        for part in ("fwd", "bwd"):
            best = sorted(((v.get("ms", 9e9), k, v) for k, v in r[part].items()), key=lambda t: t[0])
            for ms, k, v in best[:12]:
                err = v.get("max_abs_err", v.get("max_abs_diff_vs_first"))
                print(f"  {part} {k:22s} {ms:8.3f} ms {v.get('GBps', 0):7.0f} GB/s err {err}")


if __name__ == "__main__":
    main()
