"""`linear_policy_loss`: the GRPO/PPO policy loss from the last hidden states and the lm_head, never holding [T, V].

Same math as kernels/policy_loss.py with logits_t = hidden_t · Wᵀ (W = lm_head [V, H]). The loss is a scalar,
so its gradient can be produced while the chunk's logits are at hand: for a chunk of n tokens

    z   = h_c Wᵀ / T                                  [n, V] fp32     (GEMM 1)
    (lse, logp, H) by one pass over z; ℓ, ∂ℓ/∂logp per token (closed form, policy_token_terms)
    dz  = w ∂ℓ/∂logp (onehot − p) − w entropy_coef ∂H/∂z, over T        (in place of z)
    ∂L/∂h_c = dz W                                    [n, H]           (GEMM 2)
    ∂L/∂W  += dzᵀ h_c                                 [V, H]           (GEMM 3)

Three GEMMs per chunk instead of the four of "recompute the logits in backward" (forward GEMM, then recompute,
then two gradient GEMMs), and, without the entropy term, no second exp pass: p = exp(z − m) / s is already in
the buffer from the statistics pass. Backward only scales the stored gradients by the upstream scalar. Peak
memory is one chunk [n, V] fp32 (up to three with entropy) plus the gradients of hidden and W, which autograd
needs anyway. On the torch path masked tokens are skipped (no GEMM rows for padding).
When no gradient is needed (no_grad, or neither input requires grad) only the forward work runs.
"""

from __future__ import annotations

import torch

from kernels._softmax_tiles import chunk_logits, chunk_logprob_grad_, chunk_softmax_stats, finalize_softmax_stats
from kernels.device import backend_for
from kernels.policy_loss import (
    N_METRICS,
    PolicyLossConfig,
    kept_row_chunks,
    metrics_dict,
    policy_loss_bwd_triton,
    policy_loss_fwd_triton,
    policy_token_terms,
    prepare_token_inputs,
)

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _default_chunk_tokens(vocab: int, device: torch.device) -> int:
    # CPU: ~32 MB of fp32 logits per chunk stays near the caches' reach and keeps GEMMs efficient (n >= 64);
    # GPU: ~1 GiB per chunk, so the GEMMs are large and few.
    budget = (1 << 28) if device.type == "cuda" else (1 << 23)
    return max(64, min(8192, budget // max(vocab, 1)) // 64 * 64)


def _logprob_grad_from_exp_(e, labels, s, g_logp, inv_t):
    """dlogits = g_logp (onehot − p) · inv_t written over e = exp(z − m) [n, V] (what `chunk_softmax_stats`
    leaves in its buffer), with s = Σ_j e_j over the whole row: p = e / s, so no second exp pass."""
    e.mul_((g_logp * (-inv_t) / s).unsqueeze(1))
    return e.scatter_add_(1, labels.unsqueeze(1), (g_logp * inv_t).unsqueeze(1))


def _forward_torch(h, w, tok, config, need_h, need_w, chunk):
    """CPU path: chunked torch GEMMs + the shared chunk helpers. Returns (w·ℓ [N], values, grad_h, grad_w)."""
    n, vocab = h.shape[0], w.shape[0]
    inv_t = 1.0 / config.temperature
    need_grad = need_h or need_w
    ent_term = config.entropy_coef != 0.0
    w32 = w if w.dtype == torch.float32 else w.float()  # one upcast, not one per chunk
    wloss = torch.zeros(n, dtype=torch.float32, device=h.device)
    vals = torch.zeros(N_METRICS, n, dtype=torch.float32, device=h.device)
    grad_h = torch.zeros(h.shape, dtype=torch.float32, device=h.device) if need_h else None
    grad_w = torch.zeros(w.shape, dtype=torch.float32, device=h.device) if need_w else None
    buf = torch.empty(min(chunk, n) * vocab, dtype=torch.float32, device=h.device)
    scratch = torch.empty_like(buf) if config.needs_entropy else None
    # With the entropy term the gradient needs log p as well: keep a copy of z for `chunk_logprob_grad_`.
    z_copy = torch.empty_like(buf) if ent_term and need_grad else None
    for rows, tc in kept_row_chunks(tok, chunk):  # padding tokens are skipped: they cost nothing
        k = tc.labels.numel()
        h_c = h[rows] if h.dtype == torch.float32 else h[rows].float()
        z = chunk_logits(h_c, w32, inv_t, out=buf[: k * vocab].view(k, vocab))
        if z_copy is not None:
            zc = z_copy[: k * vocab].view(k, vocab).copy_(z)
        m, s, sd, z_label = chunk_softmax_stats(z, tc.labels, with_entropy=config.needs_entropy, scratch=scratch)
        lse, logp, ent = finalize_softmax_stats((m, s, sd, z_label))
        loss_t, dloss, vals[:, rows] = policy_token_terms(logp, ent if config.needs_entropy else None, tc, config)
        wloss[rows] = tc.weight * loss_t
        if not need_grad:
            continue
        if ent_term:
            dz = chunk_logprob_grad_(zc, tc.labels, lse, ent, tc.weight * dloss, tc.weight * (-config.entropy_coef),
                                     inv_t)
        else:  # z now holds exp(z − m): p = e / s without another exp pass
            dz = _logprob_grad_from_exp_(z, tc.labels, s, tc.weight * dloss, inv_t)
        if need_h:
            grad_h[rows] = torch.mm(dz, w32)
        if need_w:
            grad_w.addmm_(dz.t(), h_c)
    return wloss, vals, grad_h, grad_w


def _forward_triton(h, w, tok, config, need_h, need_w, chunk):
    """CUDA (or interpreter) path: GEMMs in the inputs' dtype, the fused Triton kernels on each logits chunk."""
    n, vocab = h.shape[0], w.shape[0]
    need_grad = need_h or need_w
    wloss = torch.zeros(n, dtype=torch.float32, device=h.device)
    vals = torch.zeros(N_METRICS, n, dtype=torch.float32, device=h.device)
    # Gradients in the inputs' dtype, accumulated in place by the GEMMs (no [V, H] temporary per chunk); with
    # bf16 the lm_head gradient adds a few chunk partials in bf16, as Liger's fused linear losses do.
    grad_h = torch.empty(h.shape, dtype=h.dtype, device=h.device) if need_h else None
    grad_w = torch.zeros(w.shape, dtype=w.dtype, device=h.device) if need_w else None
    one = torch.ones((), dtype=torch.float32, device=h.device)
    buf = torch.empty(min(chunk, n) * vocab, dtype=h.dtype, device=h.device)
    for a in range(0, n, chunk):
        b = min(a + chunk, n)
        tc = tok.rows(a, b)
        x = torch.mm(h[a:b], w.t(), out=buf[: (b - a) * vocab].view(b - a, vocab))
        wloss[a:b], glogp, lse, ent, vals[:, a:b] = policy_loss_fwd_triton(x, tc, config)
        if not need_grad:
            continue
        dz = policy_loss_bwd_triton(x, tc, glogp, lse, ent, one, config, out=x)  # in place over the logits
        if need_h:
            torch.mm(dz, w, out=grad_h[a:b])
        if need_w:
            grad_w.addmm_(dz.t(), h[a:b])
    return wloss, vals, grad_h, grad_w


class _LinearPolicyLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w, tok, config, backend, need_h, need_w, chunk):
        fwd = _forward_triton if backend == "triton" else _forward_torch
        wloss, vals, grad_h, grad_w = fwd(h, w, tok, config, need_h, need_w, chunk)
        ctx.grads = (grad_h, grad_w)
        ctx.dtypes = (h.dtype, w.dtype)
        metric_sums = vals @ tok.metric_weight
        ctx.mark_non_differentiable(metric_sums)
        return wloss.sum(), metric_sums

    @staticmethod
    def backward(ctx, grad_loss, _grad_metrics):
        grad_h, grad_w = ctx.grads
        ctx.grads = None  # free the stored gradients with the graph
        go = grad_loss.reshape(()).float()
        out_h = None if grad_h is None else grad_h.mul_(go).to(ctx.dtypes[0])
        out_w = None if grad_w is None else grad_w.mul_(go).to(ctx.dtypes[1])
        return out_h, out_w, None, None, None, None, None, None


def linear_policy_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    config: PolicyLossConfig,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    rollout_logprobs: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    num_tokens=None,
    num_seqs=None,
    chunk_tokens: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`policy_loss(hidden @ weight.T, ...)` without materialising the logits.

    hidden [T, H] (or [B, L, H]) with labels [T] (packed, cu_seqlens [S+1]) or [B, L] (padded rows); weight
    [V, H] the lm_head, same dtype as hidden. Every other argument as in `kernels.policy_loss`. chunk_tokens:
    tokens per chunk (default: ~32 MB of fp32 logits on CPU, ~1 GiB on CUDA).
    """
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden shape {tuple(hidden.shape)} must be labels shape {tuple(labels.shape)} + [H]")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be the lm_head [V, H={hidden.shape[-1]}], got shape {tuple(weight.shape)}")
    if hidden.dtype not in _DTYPES or weight.dtype != hidden.dtype:
        raise ValueError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must share one dtype of {_DTYPES}")
    if weight.device != hidden.device:
        raise ValueError(f"weight on {weight.device} but hidden on {hidden.device}; use one device")
    if not (hidden.is_contiguous() and weight.is_contiguous()):
        raise ValueError("hidden and weight must be contiguous; call .contiguous() on them first")
    if chunk_tokens is not None and chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens={chunk_tokens}: must be a positive number of tokens")
    vocab = weight.shape[0]
    tok = prepare_token_inputs(
        labels, advantages, mask, config=config, vocab_size=vocab, old_logprobs=old_logprobs,
        ref_logprobs=ref_logprobs, rollout_logprobs=rollout_logprobs, cu_seqlens=cu_seqlens,
        num_tokens=num_tokens, num_seqs=num_seqs,
    )
    grad_on = torch.is_grad_enabled()
    need_h, need_w = grad_on and hidden.requires_grad, grad_on and weight.requires_grad
    chunk = chunk_tokens or _default_chunk_tokens(vocab, hidden.device)
    h2d = hidden.view(-1, hidden.shape[-1])
    loss, metric_sums = _LinearPolicyLossFunction.apply(
        h2d, weight, tok, config, backend_for(hidden), need_h, need_w, chunk
    )
    return loss, metrics_dict(metric_sums, config, ref_logprobs is not None)


__all__ = ["linear_policy_loss"]
