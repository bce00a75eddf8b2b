"""`linear_policy_loss`: the policy loss from the last hidden states and the lm_head, never holding [T, V].

Same result as `policy_loss(hidden @ W.T, ...)` (W = lm_head [V, H]): the logits exist one chunk of n tokens at
a time, each chunk is reduced to per-token (lse, logp, H) by the row-softmax primitives, and the objective of
kernels/objective.py works on the [N] vectors. The loss is a scalar, so the gradients are produced inside the
forward while the logits are at hand; backward only scales them by the upstream scalar.

Token-local objectives (ppo, cispo: ℓ_t depends on token t only; `token_local` in their registry entry), one
pass, 3 GEMMs per chunk:
    z   = h_c Wᵀ / T                                  [n, V]           (GEMM 1)
    (lse, logp, H) by one read of z; the objective on the chunk's tokens gives g_logp, g_ent (autograd on [n])
    dz  = [g_logp (onehot − p) − g_ent ∂H/∂z] / T     (over z, in place)
    ∂L/∂h_c = dz W                                    [n, H]           (GEMM 2)
    ∂L/∂W  += dzᵀ h_c                                 [V, H]           (GEMM 3)
GSPO: a token's gradient depends on every token of its sequence (s_i is a mean over the sequence), and a
sequence may span chunks. Two passes, 4 GEMMs per chunk: pass 1 computes z (GEMM 1) and keeps only the [n]
statistics; the objective runs once on all [N] tokens; pass 2 recomputes z (GEMM 1 again) and applies dz and
GEMMs 2-3 as above. In both cases at most one chunk of logits exists at a time.

Paths (device policy, kernels/device.py):
  * "triton" (CUDA, or the interpreter): GEMMs in the inputs' dtype through cuBLAS, the chunk's logits read by
    the Triton kernels of kernels/logprobs.py, the gradient written over the logits buffer; every row goes
    through the GEMMs (the row count is known to the host: no sync), masked rows get zero coefficients.
  * "torch" (CPU): fp32 GEMMs and the torch chunk helpers of kernels/_softmax_tiles.py; masked tokens are
    skipped (no GEMM rows for padding, found with a host read that is free on CPU); without an entropy term
    the gradient reuses exp(z − m) left by the statistics pass (p = e / s, no second exp).

GPU bytes per chunk of n rows (b = bytes per logit): the GEMM writes n·V·b, the statistics kernel reads n·V·b,
the backward kernel reads and writes n·V·b; GSPO's pass 2 adds one more GEMM write. Peak memory: one chunk of
logits (torch path: fp32, up to three chunk buffers with entropy) plus the gradients of hidden and W.
"""

from __future__ import annotations

import torch

from kernels._softmax_tiles import chunk_logits, chunk_logprob_grad_, chunk_softmax_stats, finalize_softmax_stats
from kernels.device import backend_for
from kernels.linear_logprobs import addmm_acc_, fp32_addmm_supported
from kernels.logprobs import FLOAT_DTYPES, _bwd_triton, _fwd_triton
from kernels.objective import (
    LossInputs,
    PolicyLossConfig,
    TokenInputs,
    check_loss_inputs,
    merge_metrics,
    objective_coefficients,
    prepare_token_inputs,
)
from kernels.policy_loss import check_temperature


def _default_chunk_tokens(vocab: int, device: torch.device) -> int:
    # CPU: ~32 MB of fp32 logits per chunk stays near the caches' reach and keeps GEMMs efficient (n >= 64);
    # GPU: ~1 GiB per chunk, so the GEMMs are large and few.
    budget = (1 << 28) if device.type == "cuda" else (1 << 23)
    return max(64, min(8192, budget // max(vocab, 1)) // 64 * 64)


def kept_row_chunks(tok: TokenInputs, chunk: int):
    """Yield (rows, inputs of those rows) over the kept tokens, `chunk` at a time, for the torch path.

    Masked and ignored tokens are skipped, so padding costs nothing; rows is a slice when every token is kept,
    else an index tensor. Counting the kept tokens is a host read: free on the CPU path these loops serve.
    """
    n = tok.keep.numel()
    if bool(tok.keep.all()):  # host read (torch path)
        for a in range(0, n, chunk):
            yield slice(a, min(a + chunk, n)), tok.take(slice(a, min(a + chunk, n)))
    else:
        kept = tok.keep.nonzero().squeeze(1)
        for a in range(0, kept.numel(), chunk):
            idx = kept[a : a + chunk]
            yield idx, tok.take(idx)


def _all_row_chunks(tok: TokenInputs, chunk: int):
    """Yield (rows, inputs of those rows) over every token, `chunk` at a time (Triton path: sizes the host knows)."""
    n = tok.keep.numel()
    for a in range(0, n, chunk):
        yield slice(a, min(a + chunk, n)), tok.take(slice(a, min(a + chunk, n)))


def _logprob_grad_from_exp_(e, labels, s, g_logp, inv_t):
    """dlogits = g_logp (onehot − p) · inv_t written over e = exp(z − m) [n, V] (what `chunk_softmax_stats`
    leaves in its buffer), with s = Σ_j e_j over the whole row: p = e / s, so no second exp pass."""
    e.mul_((g_logp * (-inv_t) / s).unsqueeze(1))
    return e.scatter_add_(1, labels.unsqueeze(1), (g_logp * inv_t).unsqueeze(1))


class _ChunkLoop:
    """Buffers and gradient accumulators of one linear_policy_loss call, and its per-chunk steps on one path.

    Mutable state (reused chunk buffers, the running hidden/weight gradients), hence a class.
    torch path: fp32 GEMMs, stats destroy the chunk (it then holds exp(z − m)). triton path: GEMMs in the inputs'
    dtype, Triton statistics and in-place backward over the chunk.
    """

    def __init__(self, h, w, config, inv_t, backend, need_h, need_w, chunk):
        self.torch_path = backend == "torch"
        self.h, self.config, self.inv_t, self.chunk = h, config, inv_t, chunk
        n, vocab = h.shape[0], w.shape[0]
        rows = min(chunk, n)
        self.ent_grad = config.entropy_coef != 0.0 and (need_h or need_w)
        if self.torch_path:
            self.w = w if w.dtype == torch.float32 else w.float()  # one upcast, not one per chunk
            acc = dict(dtype=torch.float32, device=h.device)
            self.buf = torch.empty(rows * vocab, **acc)
            self.scratch = torch.empty_like(self.buf) if config.needs_entropy else None
            # With the entropy term the fused gradient needs log p as well: a copy of z made before the stats.
            self.z_copy = torch.empty_like(self.buf) if self.ent_grad and config.token_local else None
            self.grad_h = torch.zeros(h.shape, **acc) if need_h else None
            self.grad_w = torch.zeros(w.shape, **acc) if need_w else None
        else:
            self.w = w
            self.scratch = self.z_copy = None  # the Triton kernels need no chunk temporaries
            self.buf = torch.empty(rows * vocab, dtype=h.dtype, device=h.device)
            # Gradients accumulated in place by the GEMMs (no [V, H] temporary per chunk). The lm_head gradient
            # sums every chunk's partial: in fp32 where addmm can write bf16/fp16 products into fp32 (CUDA), else
            # in the inputs' dtype; cast once to the weight's dtype in backward.
            self.grad_h = torch.empty(h.shape, dtype=h.dtype, device=h.device) if need_h else None
            w_acc = torch.float32 if fp32_addmm_supported(h.device, h.dtype) else w.dtype
            self.grad_w = torch.zeros(w.shape, dtype=w_acc, device=h.device) if need_w else None

    def chunks(self, tok: TokenInputs):
        return kept_row_chunks(tok, self.chunk) if self.torch_path else _all_row_chunks(tok, self.chunk)

    def logits(self, rows, k: int):
        """(h_c, z): the chunk's hidden rows and its logits [k, V] (GEMM 1) in the reused buffer."""
        vocab = self.w.shape[0]
        out = self.buf[: k * vocab].view(k, vocab)
        if self.torch_path:
            h_c = self.h[rows] if self.h.dtype == torch.float32 else self.h[rows].float()
            return h_c, chunk_logits(h_c, self.w, self.inv_t, out=out)
        h_c = self.h[rows]
        return h_c, torch.mm(h_c, self.w.t(), out=out)

    def stats(self, z, tc: TokenInputs):
        """(logp, entropy | None, lse, exp_sum | None) [k] of the chunk. The torch path leaves exp(z − m) in z
        (exp_sum = Σ_j exp(z_j − m)); the triton path leaves z intact."""
        with_ent = self.config.needs_entropy
        if not self.torch_path:
            logp, ent, lse = _fwd_triton(z, tc.labels, tc.keep, self.inv_t, with_ent)
            return logp, ent, lse, None
        m, s, sd, z_label = chunk_softmax_stats(z, tc.labels, with_entropy=with_ent, scratch=self.scratch)
        lse, logp, ent = finalize_softmax_stats((m, s, sd, z_label))
        return logp, (ent if with_ent else None), lse, s

    def grad_(self, z, tc, lse, ent, g_logp, g_ent, exp_sum=None):
        """dz over the chunk buffer z: the scaled logits (or, with exp_sum on the torch path, exp(z − m))."""
        if not self.torch_path:
            return _bwd_triton(z, tc.labels, tc.keep, lse, ent, g_logp, g_ent, self.inv_t, True)
        if exp_sum is not None and g_ent is None:
            return _logprob_grad_from_exp_(z, tc.labels, exp_sum, g_logp, self.inv_t)
        return chunk_logprob_grad_(z, tc.labels, lse, ent if g_ent is not None else None, g_logp, g_ent, self.inv_t)

    def accumulate(self, dz, h_c, rows) -> None:
        """GEMMs 2 and 3: ∂L/∂h of the chunk's rows, ∂L/∂W += dzᵀ h_c."""
        if self.grad_h is not None:
            if self.torch_path:
                self.grad_h[rows] = torch.mm(dz, self.w)
            else:
                torch.mm(dz, self.w, out=self.grad_h[rows])
        if self.grad_w is not None:
            addmm_acc_(self.grad_w, dz.t(), h_c)


def _fused_pass(loop: _ChunkLoop, tok: TokenInputs, need_grad: bool):
    """Token-local objectives: per chunk, statistics, the objective on the chunk's tokens and its gradient."""
    loss, metrics = None, None
    for rows, tc in loop.chunks(tok):
        k = tc.labels.numel()
        h_c, z = loop.logits(rows, k)
        zc = loop.z_copy[: z.numel()].view_as(z).copy_(z) if loop.z_copy is not None else None
        logp, ent, lse, exp_sum = loop.stats(z, tc)
        res = objective_coefficients(logp, ent, tc, loop.config, need_grad=need_grad)
        loss = res.loss if loss is None else loss + res.loss
        metrics = merge_metrics(metrics, res.metrics)
        if need_grad:
            target = zc if zc is not None else z  # torch path with entropy: the copy of z, not exp(z − m)
            dz = loop.grad_(target, tc, lse, ent, res.g_logp, res.g_ent, exp_sum=exp_sum if zc is None else None)
            loop.accumulate(dz, h_c, rows)
    return loss, metrics


def _two_pass(loop: _ChunkLoop, tok: TokenInputs, need_grad: bool):
    """Sequence-level objectives: statistics of every token first, the objective once, then the gradient with
    the chunk logits recomputed."""
    n = tok.keep.numel()
    f32 = dict(dtype=torch.float32, device=tok.keep.device)
    logp, lse = torch.zeros(n, **f32), torch.zeros(n, **f32)
    ent = torch.zeros(n, **f32) if loop.config.needs_entropy else None
    for rows, tc in loop.chunks(tok):
        _, z = loop.logits(rows, tc.labels.numel())
        c_logp, c_ent, c_lse, _ = loop.stats(z, tc)
        logp[rows], lse[rows] = c_logp, c_lse
        if ent is not None:
            ent[rows] = c_ent
    res = objective_coefficients(logp, ent, tok, loop.config, need_grad=need_grad)
    if need_grad:
        for rows, tc in loop.chunks(tok):
            h_c, z = loop.logits(rows, tc.labels.numel())  # GEMM 1 again: the pass-1 chunk is gone
            g_ent = None if res.g_ent is None else res.g_ent[rows]
            dz = loop.grad_(z, tc, lse[rows], None if ent is None else ent[rows], res.g_logp[rows], g_ent)
            loop.accumulate(dz, h_c, rows)
    return res.loss, res.metrics


class _AttachGradients(torch.autograd.Function):
    """loss → (hidden, weight) with the gradients computed in the forward; backward scales them."""

    @staticmethod
    def forward(ctx, h, w, loss, grad_h, grad_w):
        ctx.grads = (grad_h, grad_w)
        ctx.dtypes = (h.dtype, w.dtype)
        return loss.clone()

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.grads
        ctx.grads = None  # free the stored gradients with the graph
        go = grad_loss.reshape(()).float()
        out_h = None if grad_h is None else grad_h.mul_(go).to(ctx.dtypes[0])
        out_w = None if grad_w is None else grad_w.mul_(go).to(ctx.dtypes[1])
        return out_h, out_w, None, None, None


def linear_policy_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    inputs: LossInputs,
    *,
    config: PolicyLossConfig,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`policy_loss(hidden @ weight.T, inputs, ...)` without materialising the logits.

    hidden [T, H] (or [B, L, H]) with inputs.labels [T] (packed, cu_seqlens [S+1]) or [B, L] (padded rows); weight
    [V, H] the lm_head, same dtype as hidden. Every other argument, and the metrics (with `input_errors`), as in
    `kernels.policy_loss`. chunk_tokens: tokens per chunk (default: ~32 MB of fp32 logits on CPU, ~1 GiB on CUDA).
    When no gradient is needed (no_grad, or neither input requires grad) only the forward work runs.
    """
    labels = check_loss_inputs(inputs).labels
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden shape {tuple(hidden.shape)} must be labels shape {tuple(labels.shape)} + [H]")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be the lm_head [V, H={hidden.shape[-1]}], got shape {tuple(weight.shape)}")
    if hidden.dtype not in FLOAT_DTYPES or weight.dtype != hidden.dtype:
        raise ValueError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must share one dtype of "
                         f"{FLOAT_DTYPES}")
    if weight.device != hidden.device:
        raise ValueError(f"weight on {weight.device} but hidden on {hidden.device}; use one device")
    if not (hidden.is_contiguous() and weight.is_contiguous()):
        raise ValueError("hidden and weight must be contiguous; call .contiguous() on them first")
    if chunk_tokens is not None and chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens={chunk_tokens}: must be a positive number of tokens")
    inv_t = check_temperature(temperature)
    vocab = weight.shape[0]
    tok, errors = prepare_token_inputs(inputs, config=config, vocab_size=vocab)
    grad_on = torch.is_grad_enabled()
    need_h, need_w = grad_on and hidden.requires_grad, grad_on and weight.requires_grad
    chunk = chunk_tokens or _default_chunk_tokens(vocab, hidden.device)
    h2d = hidden.view(-1, hidden.shape[-1])
    with torch.no_grad():
        loop = _ChunkLoop(h2d.detach(), weight.detach(), config, inv_t, backend_for(hidden), need_h, need_w, chunk)
        run = _fused_pass if config.token_local else _two_pass
        loss, metrics = run(loop, tok, need_h or need_w)
        if loss is None:  # no kept token reached a chunk: the objective of zero tokens (loss 0, metrics 0)
            empty = torch.zeros(0, dtype=torch.float32, device=hidden.device)
            res = objective_coefficients(empty, empty if config.needs_entropy else None, tok.take(slice(0, 0)),
                                         config, need_grad=False)
            loss, metrics = res.loss, res.metrics
    if need_h or need_w:
        loss = _AttachGradients.apply(h2d, weight, loss, loop.grad_h, loop.grad_w)
    metrics["input_errors"] = errors
    return loss, metrics


__all__ = ["linear_policy_loss"]
