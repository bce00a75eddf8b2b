"""`token_logprobs(logits, labels, ...)`: per-token log p(label) (and entropy) without a full log-softmax.

The row-softmax primitives of the project. A plain `log_softmax(logits.float()).gather(...)` materialises an
fp32 copy of [T, V] (2.5 GB at T=4096, V=151936), twice with its gradient; here each row is read once in the
forward and once in the backward. The policy loss (kernels/policy_loss.py) is these kernels under the torch
objective of kernels/objective.py, so both ops share one implementation.

    forward  per kept row: (lse, H, logp) from one read of the row                (_token_logprobs_fwd_kernel)
    backward per row: dlogits = [g_logp (onehot − p) − g_ent p (z − lse + H)] / T from per-row coefficients,
             one read and one write of the row                                       (_token_logprobs_bwd_kernel)

GPU bytes moved (b = bytes per logit, N rows of which N_k are kept, V the vocabulary): forward reads N_k·V·b
(masked rows are skipped); backward reads N_k·V·b and writes N·V·b (exact zeros on masked rows), over the
logits buffer itself with `inplace_backward`. Per-row vectors (labels, keep, lse, H, coefficients) are O(N).

Layers: the Triton kernels, host launchers `_fwd_triton` / `_bwd_triton` and the chunked torch path
`_fwd_torch` / `_bwd_torch`, the autograd Function `_TokenLogprobs` (entry point for ops that checked their own
inputs: `logprob_rows`), and the public `token_logprobs`. Shared math lives in kernels/_softmax_tiles.py.
Label range: checked at once on CPU (a free host read); on an accelerator the check would stall the device, so
an out-of-range label at a kept position gives a NaN log-prob there instead (never an out-of-bounds read).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import device as _device
from kernels._softmax_tiles import (
    M_INIT_TL,
    chunk_logprob_grad_,
    chunk_softmax_stats,
    finalize_softmax_stats,
    logprob_entropy_grad_tile,
    softmax_stats_finalize,
    softmax_tile_update,
)
from kernels.device import backend_for

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # logits / hidden dtypes every op accepts
# Rows per chunk of the torch path: bounds its fp32 temporaries to about 16 MiB whatever T is. Every torch op
# is a parallel region ending in a barrier, so fewer, larger chunks keep that overhead low on busy shared cores.
_TORCH_CHUNK_ELEMS = 1 << 22


# ---------------------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------------------


@triton.jit
def _token_logprobs_fwd_kernel(
    x_ptr,  # [N, V] logits, any float dtype, rows `stride_row` apart, unit column stride
    lab_ptr,  # [N] int64 labels
    keep_ptr,  # [N] bool (as uint8): row takes part (mask & label != ignore_index)
    logp_ptr,  # [N] fp32 out
    ent_ptr,  # [N] fp32 out (only written when HAS_ENT)
    lse_ptr,  # [N] fp32 out, saved for the backward
    V,
    stride_row,
    inv_t,
    HAS_ENT: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    # One program per row. With z = x / T, one pass over vocabulary tiles keeps the online statistics
    #   m = running max, s = Σ exp(z − m), sd = Σ exp(z − m)(z − m)         (see _softmax_tiles.py)
    # and finishes with lse = m + log s, logp = z[label] − lse, H = log s − sd / s.
    # Masked or ignored rows skip the vocabulary loop and write 0 (lse 0, never read by the backward).
    row = tl.program_id(0).to(tl.int64)
    keep = tl.load(keep_ptr + row) != 0
    logp = 0.0
    ent = 0.0
    lse = 0.0
    if keep:
        row_ptr = x_ptr + row * stride_row
        label = tl.load(lab_ptr + row)
        m = M_INIT_TL
        s = 0.0
        sd = 0.0
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V).to(tl.int64)
            valid = cols < V
            z = tl.load(row_ptr + cols, mask=valid, other=0.0).to(tl.float32) * inv_t
            if HAS_ENT:
                m, s, sd = softmax_tile_update(z, valid, m, s, sd)
            else:
                # Without entropy the sd accumulator is dead; skip its multiply-add.
                m_new = tl.maximum(m, tl.max(tl.where(valid, z, float("-inf")), axis=0))
                s = s * tl.exp(m - m_new) + tl.sum(tl.where(valid, tl.exp(z - m_new), 0.0), axis=0)
                m = m_new
        lse, ent = softmax_stats_finalize(m, s, sd)
        # The label's logit by a direct load (the host checked 0 <= label < V for kept rows); logp as
        # (z_label − m) − log s rather than z_label − lse keeps fp32 precision when the logits are large.
        logp = (tl.load(row_ptr + label).to(tl.float32) * inv_t - m) - tl.log(s)
    tl.store(logp_ptr + row, logp)
    tl.store(lse_ptr + row, lse)
    if HAS_ENT:
        tl.store(ent_ptr + row, ent)


@triton.jit
def _token_logprobs_bwd_kernel(
    x_ptr,  # [N, V] logits (read)
    dx_ptr,  # [N, V] dlogits out, contiguous rows; may alias x_ptr (inplace_backward)
    lab_ptr,
    keep_ptr,
    lse_ptr,
    ent_ptr,
    glogp_ptr,  # [N] fp32 upstream gradient of logp
    gent_ptr,  # [N] fp32 upstream gradient of the entropy (only read when HAS_ENT)
    V,
    stride_row,
    stride_drow,
    inv_t,
    HAS_ENT: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    # dlogits_j = [g_logp (onehot_j − p_j) − g_ent p_j (z_j − lse + H)] / T,  p_j = exp(z_j − lse),
    # written tile by tile in the logits' dtype; rows that did not take part get exact zeros.
    row = tl.program_id(0).to(tl.int64)
    keep = tl.load(keep_ptr + row) != 0
    row_ptr = x_ptr + row * stride_row
    drow_ptr = dx_ptr + row * stride_drow
    if keep:
        label = tl.load(lab_ptr + row)
        lse = tl.load(lse_ptr + row)
        g_logp = tl.load(glogp_ptr + row)
        ent = 0.0
        g_ent = 0.0
        if HAS_ENT:
            ent = tl.load(ent_ptr + row)
            g_ent = tl.load(gent_ptr + row)
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V).to(tl.int64)
            valid = cols < V
            z = tl.load(row_ptr + cols, mask=valid, other=0.0).to(tl.float32) * inv_t
            dz = logprob_entropy_grad_tile(z, cols, label, lse, ent, g_logp, g_ent, inv_t, HAS_ENT)
            tl.store(drow_ptr + cols, dz.to(dx_ptr.dtype.element_ty), mask=valid)
    else:
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V).to(tl.int64)
            zeros = tl.zeros([BLOCK_V], dtype=dx_ptr.dtype.element_ty)
            tl.store(drow_ptr + cols, zeros, mask=cols < V)


def _block_v(V: int, dtype: torch.dtype, device: torch.device) -> tuple[int, int]:
    """(BLOCK_V, num_warps): 16-32 KiB of logits per tile keeps the loads wide without spilling on a GPU; the
    interpreter (CPU tensors) is fastest with few wide tiles."""
    cap = (8192 if dtype != torch.float32 else 4096) if device.type == "cuda" else 16384
    block = min(triton.next_power_of_2(V), cap)
    return block, (16 if block >= 8192 else 8 if block >= 2048 else 4)


# ---------------------------------------------------------------------------------------------------------
# Host launchers (Triton) and the chunked torch path
# ---------------------------------------------------------------------------------------------------------


def _fwd_triton(x: torch.Tensor, labels: torch.Tensor, keep: torch.Tensor, inv_t: float, with_ent: bool):
    N, V = x.shape
    logp = torch.empty(N, dtype=torch.float32, device=x.device)
    lse = torch.empty(N, dtype=torch.float32, device=x.device)
    ent = torch.empty(N, dtype=torch.float32, device=x.device) if with_ent else lse  # dummy pointer if unused
    block, warps = _block_v(V, x.dtype, x.device)
    _token_logprobs_fwd_kernel[(N,)](
        x, labels, keep, logp, ent, lse, V, x.stride(0), inv_t, HAS_ENT=with_ent, BLOCK_V=block, num_warps=warps
    )
    return logp, (ent if with_ent else None), lse


def _bwd_triton(x, labels, keep, lse, ent, g_logp, g_ent, inv_t: float, inplace: bool):
    N, V = x.shape
    dx = x if inplace else torch.empty((N, V), dtype=x.dtype, device=x.device)
    with_ent = g_ent is not None
    block, warps = _block_v(V, x.dtype, x.device)
    _token_logprobs_bwd_kernel[(N,)](
        x,
        dx,
        labels,
        keep,
        lse,
        ent if with_ent else lse,
        g_logp,
        g_ent if with_ent else g_logp,
        V,
        x.stride(0),
        dx.stride(0),
        inv_t,
        HAS_ENT=with_ent,
        BLOCK_V=block,
        num_warps=warps,
    )
    return dx


def _scaled_rows(z: torch.Tensor, x: torch.Tensor, inv_t: float) -> torch.Tensor:
    """z [n, V] fp32 <- x · inv_t: one pass for fp32 x; bf16/fp16 are upcast first (a bf16 multiply would round z)."""
    if x.dtype == torch.float32:
        return torch.mul(x, inv_t, out=z)
    return z.copy_(x).mul_(inv_t)


def _row_chunks(N: int, V: int):
    step = max(1, _TORCH_CHUNK_ELEMS // max(V, 1))
    for r0 in range(0, N, step):
        yield r0, min(N, r0 + step)


def _fwd_torch(x: torch.Tensor, labels: torch.Tensor, keep: torch.Tensor, inv_t: float, with_ent: bool):
    # Row chunks of fp32 z = x / T in one reused buffer; the same statistics as the Triton kernel.
    N, V = x.shape
    logp = torch.zeros(N, dtype=torch.float32, device=x.device)
    lse = torch.zeros(N, dtype=torch.float32, device=x.device)
    ent = torch.zeros(N, dtype=torch.float32, device=x.device) if with_ent else None
    safe = torch.where(keep, labels, 0)
    buf = scratch = None
    for r0, r1 in _row_chunks(N, V):
        n = r1 - r0
        if buf is None:
            buf = torch.empty((n, V), dtype=torch.float32, device=x.device)
            scratch = torch.empty_like(buf) if with_ent else None
        z = _scaled_rows(buf[:n], x[r0:r1], inv_t)
        stats = chunk_softmax_stats(z, safe[r0:r1], with_entropy=with_ent, scratch=scratch)
        c_lse, c_logp, c_ent = finalize_softmax_stats(stats)
        k = keep[r0:r1]
        lse[r0:r1] = torch.where(k, c_lse, 0.0)
        logp[r0:r1] = torch.where(k, c_logp, 0.0)
        if with_ent:
            ent[r0:r1] = torch.where(k, c_ent, 0.0)
    return logp, ent, lse


def _bwd_torch(x, labels, keep, lse, ent, g_logp, g_ent, inv_t: float, inplace: bool):
    N, V = x.shape
    dx = x if inplace else torch.empty((N, V), dtype=x.dtype, device=x.device)
    safe = torch.where(keep, labels, 0)
    g_logp = torch.where(keep, g_logp, 0.0)
    g_ent = torch.where(keep, g_ent, 0.0) if g_ent is not None else None
    buf = None
    for r0, r1 in _row_chunks(N, V):
        n = r1 - r0
        if buf is None:
            buf = torch.empty((n, V), dtype=torch.float32, device=x.device)
        z = _scaled_rows(buf[:n], x[r0:r1], inv_t)
        chunk_logprob_grad_(
            z,
            safe[r0:r1],
            lse[r0:r1],
            ent[r0:r1] if g_ent is not None else None,
            g_logp[r0:r1],
            g_ent[r0:r1] if g_ent is not None else None,
            inv_t,
        )
        # Masked rows have zero coefficients; zero them exactly (non-finite padding logits give 0 · inf = NaN).
        masked = (~keep[r0:r1]).nonzero().squeeze(1)  # host sync (torch path); only the masked rows are touched
        if masked.numel():
            z.index_fill_(0, masked, 0.0)
        dx[r0:r1].copy_(z)
    return dx


# ---------------------------------------------------------------------------------------------------------
# autograd and the public function
# ---------------------------------------------------------------------------------------------------------


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, labels, keep, inv_t, with_ent, inplace_backward, backend):
        fwd = _fwd_triton if backend == "triton" else _fwd_torch
        logp, ent, lse = fwd(x, labels, keep, inv_t, with_ent)
        ctx.save_for_backward(x, labels, keep, lse, ent if with_ent else lse)
        ctx.inv_t, ctx.with_ent, ctx.inplace, ctx.backend = inv_t, with_ent, inplace_backward, backend
        # An output that gets no gradient (the entropy when only logged) stays None in backward, not zeros:
        # the backward then skips the entropy term.
        ctx.set_materialize_grads(False)
        if with_ent:
            return logp, ent
        return logp, None

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        x, labels, keep, lse, ent = ctx.saved_tensors
        if g_logp is None:
            g_logp = torch.zeros_like(lse)
        g_logp = g_logp.float().contiguous()
        if ctx.with_ent and g_ent is not None:
            g_ent = g_ent.float().contiguous()
        else:
            g_ent = None
        bwd = _bwd_triton if ctx.backend == "triton" else _bwd_torch
        dx = bwd(x, labels, keep, lse, ent, g_logp, g_ent, ctx.inv_t, ctx.inplace)
        return dx, None, None, None, None, None, None


def logprob_rows(x, labels, keep, inv_t: float, with_ent: bool, inplace_backward: bool, backend: str):
    """The differentiable (logp [N], entropy [N] | None) of logits rows x [N, V] (unit column stride), for ops
    that checked their inputs: labels [N] int64 in [0, V) wherever keep [N] (bool) is True; 0 at the other rows."""
    return _TokenLogprobs.apply(x, labels, keep, inv_t, with_ent, inplace_backward, backend)


def _check_inputs(logits, labels, mask, temperature, ignore_index):
    """Shared preconditions of token_logprobs; returns (logits as [N, V], labels [N], keep [N] bool, and the
    [N] bool rows with an out-of-range label, None when they were checked on the host)."""
    if not isinstance(logits, torch.Tensor) or logits.dtype not in FLOAT_DTYPES:
        raise ValueError(f"logits must be a float32/bfloat16/float16 tensor, got {getattr(logits, 'dtype', logits)}")
    if logits.ndim < 1 or logits.numel() == 0:
        raise ValueError(f"logits must be a non-empty [..., V] tensor, got shape {tuple(logits.shape)}")
    if labels.dtype != torch.int64:
        raise ValueError(f"labels must be int64, got {labels.dtype}; call labels.long()")
    if tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"labels shape {tuple(labels.shape)} must equal logits.shape[:-1] = {tuple(logits.shape[:-1])}"
        )
    if labels.device != logits.device:
        raise ValueError(f"labels are on {labels.device} but logits on {logits.device}; move them to one device")
    if not (temperature > 0):
        raise ValueError(f"temperature must be > 0, got {temperature}")
    V = logits.shape[-1]
    if logits.stride(-1) != 1:
        raise ValueError("logits must have a unit stride on the vocabulary dim; call logits.contiguous()")
    try:
        x = logits.view(-1, V)
    except RuntimeError as err:
        raise ValueError(
            f"logits with shape {tuple(logits.shape)} and strides {logits.stride()} cannot be viewed as rows "
            "without a copy; call logits.contiguous()"
        ) from err
    keep = labels != ignore_index
    if mask is not None:
        if tuple(mask.shape) != tuple(labels.shape):
            raise ValueError(f"mask shape {tuple(mask.shape)} must equal labels shape {tuple(labels.shape)}")
        if mask.device != logits.device:
            raise ValueError(f"mask is on {mask.device} but logits on {logits.device}")
        keep = keep & (mask != 0)
    keep = keep.reshape(-1).contiguous()
    labels = labels.reshape(-1).contiguous()
    bad = keep & ((labels < 0) | (labels >= V))
    if _device.host_sync_is_free(labels):
        # A free host read on CPU: an out-of-range label is an error now.
        if bool(bad.any().item()):
            first = int(bad.nonzero()[0].item())
            raise ValueError(
                f"labels[{first}] (flattened) = {int(labels[first].item())} is outside [0, {V}) and is not "
                f"ignore_index={ignore_index}; fix the labels or mask that position"
            )
        return x, labels, keep, None
    # No host read on an accelerator: the kernels read label 0 instead and the caller marks those rows NaN.
    return x, torch.where(bad, 0, labels), keep, bad


def token_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    mask: torch.Tensor | None = None,
    ignore_index: int = -100,
    return_entropy: bool = False,
    inplace_backward: bool = False,
):
    """fp32 log p(labels) under softmax(logits / temperature) (and the entropy), 0 where masked or ignored.

    logits [..., V] fp32/bf16/fp16 (e.g. [T, V] packed or [B, L, V]); labels [...] int64; mask [...] (nonzero
    keeps a position). Returns logp [...] fp32, or (logp, entropy) with `return_entropy`. Differentiable w.r.t.
    logits through both outputs. `inplace_backward=True` writes the gradient over the logits buffer (saves a
    [..., V] allocation; only when nothing else reads the logits after the backward). An out-of-range label
    at a kept position raises ValueError on CPU; on an accelerator (no host sync) its log-prob is NaN.
    """
    x, labels_flat, keep, bad = _check_inputs(logits, labels, mask, temperature, ignore_index)
    backend = backend_for(x)
    logp, ent = logprob_rows(
        x, labels_flat, keep, 1.0 / float(temperature), bool(return_entropy), bool(inplace_backward), backend
    )
    if bad is not None:
        logp = torch.where(bad, float("nan"), logp)
    out_shape = labels.shape
    if return_entropy:
        return logp.view(out_shape), ent.view(out_shape)
    return logp.view(out_shape)
