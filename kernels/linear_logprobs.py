"""`linear_token_logprobs(hidden, weight, labels, ...)`: token log-probs (and entropy) straight from hidden states.

The same result as `token_logprobs(hidden @ weight.T, labels, ...)` without ever holding the [T, V] logits:
the lm_head matmul runs chunk by chunk, each chunk's logits are reduced to per-token statistics at once, and the
backward recomputes them (one extra GEMM per chunk) instead of storing them.

    forward : z_c = h_c W_v^T / T  ->  online (m, s, sd, z_label) per token  ->  lse, logp, H
    backward: z_c again -> dz_c = [g_logp (onehot - p) - g_ent p (z - lse + H)] / T
              dh_c += dz_c W_v,   dW_v += dz_c^T h_c

Two implementations of the chunk loop (device policy, kernels/device.py):
  * "torch" (CPU): fp32 chunks of [chunk_tokens x chunk_vocab] in one reused buffer (addmm out=, in-place
    softmax math from kernels/_softmax_tiles.py); vocabulary outer, tokens inner, so a weight slice and its
    gradient slice stay in cache while the (small) hidden states stream past.
  * "triton" (CUDA, or the interpreter): token chunks with the full vocabulary; the matmuls go through
    cuBLAS (torch.mm in the input dtype), the softmax epilogue and dlogits through the Triton kernels of
    kernels/logprobs.py, the gradient written over the chunk's logits buffer.
Rows that are masked or ignored get 0 and no gradient. On CPU they are dropped before any matmul (finding them
is a host read, free there); on an accelerator every row goes through the GEMMs and the kernels skip the masked
ones, so the call needs only sizes the host knows (no host sync).

GPU bytes per chunk of n rows (b = bytes per logit): forward, the GEMM writes n·V·b and the statistics kernel
reads them; backward, the recomputing GEMM writes n·V·b and the gradient kernel reads and rewrites them in place.
"""

from __future__ import annotations

import torch

from kernels import device as _device
from kernels._softmax_tiles import (
    chunk_logits,
    chunk_logprob_grad_,
    chunk_softmax_stats,
    finalize_softmax_stats,
    merge_softmax_stats,
)
from kernels.device import backend_for
from kernels.logprobs import FLOAT_DTYPES, _bwd_triton, _fwd_triton

# CPU chunk shape. One thread: a [256 x 2048] fp32 chunk is 2 MiB and the weight slice [2048 x H] 2 MiB at
# H=256, so chunk, slice and slice gradient stay in L2 while the GEMMs still see large enough operands (measured
# best single-threaded). Several threads: every torch op is a parallel region ending in a barrier, and with
# ~3000 small ops per call a descheduled thread stalls the others (2-3x slower on a shared 2-core machine), so
# the chunk grows to [1024 x 8192] (32 MiB, L3-resident): ~100 ops, same memory order.
_CPU_CHUNK_TOKENS = 256
_CPU_CHUNK_VOCAB = 2048
_CPU_CHUNK_TOKENS_MT = 1024
_CPU_CHUNK_VOCAB_MT = 8192
# CUDA: token chunks whose [n, V] logits take about 256 MiB in the input dtype.
_GPU_CHUNK_BYTES = 1 << 28


# (device type, input dtype) -> whether addmm accumulates low-precision products into an fp32 tensor in one GEMM.
_FP32_ADDMM: dict[tuple[str, torch.dtype], bool] = {}


def fp32_addmm_supported(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether `torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)` runs with fp32 `acc` and `dtype` inputs
    on `device`'s backend. CUDA with a recent torch: yes. CPU has no kernel for it, older torch has no out_dtype
    (TypeError) or wants `acc` in the inputs' dtype (RuntimeError). Probed once per (device type, dtype) on 1x1
    tensors: the checks run on the host before any launch, so the probe never synchronises."""
    key = (torch.device(device).type, dtype)
    if key not in _FP32_ADDMM:
        acc = torch.zeros(1, 1, dtype=torch.float32, device=device)
        one = torch.ones(1, 1, dtype=dtype, device=device)
        try:
            torch.addmm(acc, one, one, out_dtype=torch.float32, out=acc)
            _FP32_ADDMM[key] = True
        except (RuntimeError, TypeError):  # NotImplementedError (no kernel) is a RuntimeError
            _FP32_ADDMM[key] = False
    return _FP32_ADDMM[key]


def addmm_acc_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """acc [M, N] += a [M, K] @ b [K, N], in place; acc in a's dtype or fp32 (a and b share a dtype).

    Same dtype: one in-place GEMM. fp32 acc with bf16/fp16 inputs: one GEMM that accumulates into acc in fp32
    where the backend supports addmm's out_dtype, else the product goes through an [M, N] temporary in the
    inputs' dtype (one rounding of each partial to bf16/fp16, then an fp32 add)."""
    if acc.dtype == a.dtype:
        return acc.addmm_(a, b)
    if acc.dtype == torch.float32 and fp32_addmm_supported(acc.device, a.dtype):
        return torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    return acc.add_(a @ b)


def _cpu_chunks(chunk_tokens: int | None) -> tuple[int, int]:
    """(tokens, vocabulary) of a CPU chunk; `chunk_tokens` (the public argument) overrides the token count."""
    if torch.get_num_threads() > 1:
        return (chunk_tokens or _CPU_CHUNK_TOKENS_MT), _CPU_CHUNK_VOCAB_MT
    return (chunk_tokens or _CPU_CHUNK_TOKENS), _CPU_CHUNK_VOCAB


# ---------------------------------------------------------------------------------------------------------
# torch path (CPU): 2-D chunks, vocabulary outer
# ---------------------------------------------------------------------------------------------------------


def _fwd_torch(h, w, labels, inv_t, with_ent, chunk_tokens):
    """h [N, H] (kept rows only), w [V, H], labels [N]; returns fp32 (logp, ent | None, lse) [N]."""
    N, V = h.shape[0], w.shape[0]
    n_tok, n_voc = _cpu_chunks(chunk_tokens)
    n_tok, n_voc = min(n_tok, N), min(n_voc, V)
    buf = torch.empty(n_tok * n_voc, dtype=torch.float32, device=h.device)
    scratch = torch.empty_like(buf) if with_ent else None
    stats: list = [None] * ((N + n_tok - 1) // n_tok)
    h = h if h.dtype == torch.float32 else h.float()  # upcast once ([N, H] is small), not per chunk
    for v0 in range(0, V, n_voc):
        w_v = w[v0 : v0 + n_voc].float()  # a no-op for fp32; one upcast per slice for bf16/fp16
        v = w_v.shape[0]
        for i, t0 in enumerate(range(0, N, n_tok)):
            h_c = h[t0 : t0 + n_tok]
            z = chunk_logits(h_c, w_v, inv_t, out=buf[: h_c.shape[0] * v].view(h_c.shape[0], v))
            part = chunk_softmax_stats(z, labels[t0 : t0 + n_tok], v0, with_entropy=with_ent, scratch=scratch)
            stats[i] = part if stats[i] is None else merge_softmax_stats(stats[i], part)
    lse, logp, ent = (torch.cat(t) for t in zip(*(finalize_softmax_stats(s) for s in stats)))
    return logp, (ent if with_ent else None), lse


def _bwd_torch(h, w, labels, lse, ent, g_logp, g_ent, inv_t, chunk_tokens, need_dh, need_dw):
    """fp32 (dh [N, H] | None, dw [V, H] | None) for kept rows; g_ent None drops the entropy term."""
    N, V = h.shape[0], w.shape[0]
    n_tok, n_voc = _cpu_chunks(chunk_tokens)
    n_tok, n_voc = min(n_tok, N), min(n_voc, V)
    h32 = h if h.dtype == torch.float32 else h.float()
    w32 = w if w.dtype == torch.float32 else w.float()
    dh = torch.zeros(h.shape, dtype=torch.float32, device=h.device) if need_dh else None
    dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need_dw else None
    buf = torch.empty(n_tok * n_voc, dtype=torch.float32, device=h.device)
    for v0 in range(0, V, n_voc):
        w_v = w32[v0 : v0 + n_voc]
        v = w_v.shape[0]
        for t0 in range(0, N, n_tok):
            t1 = min(N, t0 + n_tok)
            h_c = h32[t0:t1]
            z = chunk_logits(h_c, w_v, inv_t, out=buf[: (t1 - t0) * v].view(t1 - t0, v))
            dz = chunk_logprob_grad_(
                z,
                labels[t0:t1],
                lse[t0:t1],
                None if g_ent is None else ent[t0:t1],
                g_logp[t0:t1],
                None if g_ent is None else g_ent[t0:t1],
                inv_t,
                v0,
            )
            if need_dh:
                dh[t0:t1].addmm_(dz, w_v)
            if need_dw:
                dw[v0 : v0 + v].addmm_(dz.t(), h_c)
    return dh, dw


# ---------------------------------------------------------------------------------------------------------
# Triton path (CUDA or interpreter): token chunks, cuBLAS matmuls, Triton softmax epilogue
# ---------------------------------------------------------------------------------------------------------


def _gpu_chunk_tokens(N: int, V: int, dtype: torch.dtype, chunk_tokens: int | None) -> int:
    if chunk_tokens:
        return min(chunk_tokens, N)
    elsize = torch.empty((), dtype=dtype).element_size()
    return max(1, min(N, _GPU_CHUNK_BYTES // (V * elsize)))


def _fwd_triton_linear(h, w, labels, keep, inv_t, with_ent, chunk_tokens):
    """keep [N] bool: rows the kernels compute (the others get 0)."""
    N, V = h.shape[0], w.shape[0]
    n_tok = _gpu_chunk_tokens(N, V, h.dtype, chunk_tokens)
    logp = torch.empty(N, dtype=torch.float32, device=h.device)
    lse = torch.empty_like(logp)
    ent = torch.empty_like(logp) if with_ent else None
    buf = torch.empty((n_tok, V), dtype=h.dtype, device=h.device)
    for t0 in range(0, N, n_tok):
        t1 = min(N, t0 + n_tok)
        x = torch.mm(h[t0:t1], w.t(), out=buf[: t1 - t0])
        c_logp, c_ent, c_lse = _fwd_triton(x, labels[t0:t1], keep[t0:t1], inv_t, with_ent)
        logp[t0:t1], lse[t0:t1] = c_logp, c_lse
        if with_ent:
            ent[t0:t1] = c_ent
    return logp, ent, lse


def _bwd_triton_linear(h, w, labels, keep, lse, ent, g_logp, g_ent, inv_t, chunk_tokens, need_dh, need_dw):
    N, V = h.shape[0], w.shape[0]
    n_tok = _gpu_chunk_tokens(N, V, h.dtype, chunk_tokens)
    buf = torch.empty((n_tok, V), dtype=h.dtype, device=h.device)
    dh = torch.empty(h.shape, dtype=h.dtype, device=h.device) if need_dh else None
    # fp32 accumulator for the weight gradient across token chunks (addmm_acc_: fp32 inside the GEMM where the
    # backend can, else one rounding per chunk partial in the inputs' dtype); cast once to the weight's dtype.
    dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need_dw else None
    for t0 in range(0, N, n_tok):
        t1 = min(N, t0 + n_tok)
        x = torch.mm(h[t0:t1], w.t(), out=buf[: t1 - t0])
        dz = _bwd_triton(
            x,
            labels[t0:t1],
            keep[t0:t1],
            lse[t0:t1],
            None if ent is None else ent[t0:t1],
            g_logp[t0:t1],
            None if g_ent is None else g_ent[t0:t1],
            inv_t,
            True,  # dlogits over the recomputed logits: nothing else reads them
        )
        if need_dh:
            torch.mm(dz, w, out=dh[t0:t1])
        if need_dw:
            addmm_acc_(dw, dz.t(), h[t0:t1])
    return dh, dw


# ---------------------------------------------------------------------------------------------------------
# autograd and the public function
# ---------------------------------------------------------------------------------------------------------


class _LinearTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, keep, keep_idx, inv_t, with_ent, chunk_tokens, backend):
        # hidden [T, H], weight [V, H], labels [T] (valid wherever kept), keep [T] bool. keep_idx [K]: the kept
        # rows when they were compacted on the host (CPU), else None and every row is computed, masked ones as 0.
        T = hidden.shape[0]
        if keep_idx is not None:
            h, lab, row_keep = hidden.index_select(0, keep_idx), labels.index_select(0, keep_idx), None
        else:
            h, lab, row_keep = hidden, labels, keep
        if backend == "triton":
            k = row_keep if row_keep is not None else torch.ones_like(lab, dtype=torch.bool)
            logp_k, ent_k, lse_k = _fwd_triton_linear(h, weight, lab, k, inv_t, with_ent, chunk_tokens)
        else:
            logp_k, ent_k, lse_k = _fwd_torch(h, weight, lab, inv_t, with_ent, chunk_tokens)
            if row_keep is not None:  # the torch path computes masked rows too: zero them
                logp_k = torch.where(row_keep, logp_k, 0.0)
                ent_k = torch.where(row_keep, ent_k, 0.0) if with_ent else None
        ctx.save_for_backward(h, weight, lab, lse_k, ent_k if with_ent else lse_k)
        ctx.keep_idx, ctx.row_keep, ctx.T = keep_idx, row_keep, T
        ctx.inv_t, ctx.with_ent, ctx.chunk_tokens, ctx.backend = inv_t, with_ent, chunk_tokens, backend
        ctx.set_materialize_grads(False)

        def scatter(v):
            if keep_idx is None:
                return v
            return torch.zeros(T, dtype=v.dtype, device=v.device).index_copy_(0, keep_idx, v)

        return scatter(logp_k), (scatter(ent_k) if with_ent else None)

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        h, weight, lab, lse, ent = ctx.saved_tensors
        keep_idx, row_keep = ctx.keep_idx, ctx.row_keep

        def gather(g):
            g = g.float()
            g = g if keep_idx is None else g.index_select(0, keep_idx)
            return (g if row_keep is None else torch.where(row_keep, g, 0.0)).contiguous()

        g_logp = torch.zeros_like(lse) if g_logp is None else gather(g_logp)
        g_ent = gather(g_ent) if (ctx.with_ent and g_ent is not None) else None
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if ctx.backend == "triton":
            k = row_keep if row_keep is not None else torch.ones_like(lab, dtype=torch.bool)
            dh_k, dw = _bwd_triton_linear(h, weight, lab, k, lse, ent, g_logp, g_ent, ctx.inv_t, ctx.chunk_tokens,
                                          need_dh, need_dw)
        else:
            dh_k, dw = _bwd_torch(h, weight, lab, lse, ent, g_logp, g_ent, ctx.inv_t, ctx.chunk_tokens, need_dh,
                                  need_dw)
        dh = None
        if need_dh:
            if keep_idx is None:
                dh = dh_k.to(h.dtype)
            else:
                dh = torch.zeros((ctx.T, h.shape[1]), dtype=h.dtype, device=h.device)
                dh.index_copy_(0, keep_idx, dh_k.to(h.dtype))
        dw = dw.to(weight.dtype) if need_dw else None
        return dh, dw, None, None, None, None, None, None, None


def linear_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    mask: torch.Tensor | None = None,
    ignore_index: int = -100,
    return_entropy: bool = False,
    chunk_tokens: int | None = None,
):
    """`token_logprobs(hidden @ weight.T, labels, ...)` without materialising the [T, V] logits.

    hidden [T, H] and weight [V, H] (the lm_head) of one float dtype (fp32/bf16/fp16); labels [T] int64;
    mask [T] (nonzero keeps a token). Returns fp32 logp [T] (and entropy [T] with `return_entropy`), 0 where
    masked or ignored; differentiable w.r.t. hidden and weight. `chunk_tokens` overrides the token chunk size
    (default: ~256 MiB of logits per chunk on CUDA; 256 tokens single-threaded, 1024 multi-threaded on CPU).
    An out-of-range label at a kept position raises ValueError on CPU; on an accelerator (no host sync) its
    log-prob is NaN.
    """
    if not isinstance(hidden, torch.Tensor) or hidden.dtype not in FLOAT_DTYPES:
        raise ValueError(f"hidden must be a float32/bfloat16/float16 tensor, got {getattr(hidden, 'dtype', hidden)}")
    if weight.dtype != hidden.dtype:
        raise ValueError(f"weight dtype {weight.dtype} != hidden dtype {hidden.dtype}; cast one of them")
    if hidden.ndim != 2 or weight.ndim != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"expected hidden [T, H] and weight [V, H], got {tuple(hidden.shape)} and {tuple(weight.shape)}; "
            "flatten leading dims of hidden with hidden.reshape(-1, H)"
        )
    if hidden.numel() == 0 or weight.numel() == 0:
        raise ValueError(f"empty input: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}")
    if not (hidden.is_contiguous() and weight.is_contiguous()):
        raise ValueError("hidden and weight must be contiguous; call .contiguous() on them")
    if labels.dtype != torch.int64 or tuple(labels.shape) != (hidden.shape[0],):
        raise ValueError(f"labels must be int64 of shape [{hidden.shape[0]}], got {labels.dtype} {tuple(labels.shape)}")
    if labels.device != hidden.device or weight.device != hidden.device:
        raise ValueError("hidden, weight and labels must be on one device")
    if not (temperature > 0):
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_tokens is not None and chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be a positive int or None, got {chunk_tokens}")
    V = weight.shape[0]
    keep = labels != ignore_index
    if mask is not None:
        if tuple(mask.shape) != tuple(labels.shape) or mask.device != labels.device:
            raise ValueError(f"mask must have labels' shape {tuple(labels.shape)} and device")
        keep = keep & (mask != 0)
    bad = keep & ((labels < 0) | (labels >= V))
    keep_idx = None
    if _device.host_sync_is_free(labels):
        # Host reads are free on CPU: check the labels now, and compact the kept rows, which saves the matmuls of
        # masked tokens (prompts, padding).
        if bool(bad.any().item()):
            first = int(bad.nonzero()[0].item())
            raise ValueError(
                f"labels[{first}] = {int(labels[first].item())} is outside [0, {V}) and is not "
                f"ignore_index={ignore_index}; fix the labels or mask that position"
            )
        n_keep = int(keep.sum().item())
        if n_keep == 0:
            # Nothing to compute; still return differentiable zeros so .backward() works.
            zero = (hidden[:, :1] * 0.0).sum(1).float() + (weight[:1, :1] * 0.0).sum().float()
            return (zero, zero.clone()) if return_entropy else zero
        keep_idx = None if n_keep == labels.shape[0] else keep.nonzero().squeeze(1)
        bad = None
    backend = backend_for(hidden)
    logp, ent = _LinearTokenLogprobs.apply(
        hidden,
        weight,
        # Without a host check an out-of-range label reads column 0 instead (never out of bounds); NaN below.
        labels.contiguous() if bad is None else torch.where(keep & ~bad, labels, 0),
        keep,
        keep_idx,
        1.0 / float(temperature),
        bool(return_entropy),
        chunk_tokens,
        backend,
    )
    if bad is not None:
        logp = torch.where(bad, float("nan"), logp)
    return (logp, ent) if return_entropy else logp
