"""Shared softmax machinery for the log-prob and policy-loss ops (Triton tile helpers + torch chunk helpers).

Notation, per token row: z = x / T (scaled logits over the vocabulary), lse = log Σ_j exp(z_j),
p = exp(z − lse), logp = z_label − lse, entropy H = −Σ_j p_j log p_j = lse − Σ_j p_j z_j.

Online statistics over vocabulary tiles (one pass, fp32), kept relative to the running max m:
    s  = Σ_j exp(z_j − m)                     (so lse = m + log s)
    sd = Σ_j exp(z_j − m) · (z_j − m)         (so Σ p z − m = sd / s, H = log s − sd / s)
Keeping sd relative to m avoids the cancellation of `lse − Σ p z` when logits are large. When the max moves
from m to m' every term is rescaled by α = exp(m − m'):
    s'  = α s + Σ_tile e,      sd' = α (sd + (m − m') s) + Σ_tile e · (z − m'),   e = exp(z − m').
The running max starts at a large finite negative number (not −inf) so that (m − m')·s is 0·finite, not NaN.

Gradients, for upstream coefficients g_logp (on logp) and g_ent (on H):
    ∂logp/∂z_j = onehot_j − p_j
    ∂H/∂z_j    = −p_j (log p_j + H) = −p_j (z_j − lse + H)
    ∂/∂x_j     = ∂/∂z_j / T
so dlogits_j = [g_logp (onehot_j − p_j) − g_ent p_j (z_j − lse + H)] / T.

Two families live here:
  * `@triton.jit` tile helpers: `softmax_tile_update`, `softmax_stats_finalize`, `logprob_entropy_grad_tile`
    (used by the kernels of kernels/logprobs.py, which every op runs on a GPU).
  * torch chunk helpers for the CPU paths: `chunk_logits`, `chunk_softmax_stats`, `merge_softmax_stats`,
    `finalize_softmax_stats`, `chunk_logprob_grad_` (used by kernels/logprobs.py, kernels/linear_logprobs.py and
    kernels/linear_policy_loss.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Start value of the running max: finite so that (m - m_new) * s stays 0 * finite = 0 on the first tile.
M_INIT = -3.0e38
# The same value for use inside @triton.jit code (compiled Triton only reads globals that are tl.constexpr).
M_INIT_TL = tl.constexpr(M_INIT)


# ---------------------------------------------------------------------------------------------------------
# Triton tile helpers (one token row, one vocabulary tile at a time)
# ---------------------------------------------------------------------------------------------------------


@triton.jit
def softmax_tile_update(z, valid, m, s, sd):
    """Fold one vocabulary tile into the running (m, s, sd) of a row.

    z:     [BLOCK_V] fp32 scaled logits of the tile (values where `valid` is False are ignored).
    valid: [BLOCK_V] bool, False past the end of the vocabulary.
    m, s, sd: fp32 scalars, the running max, Σ exp(z − m) and Σ exp(z − m)(z − m); start at (M_INIT, 0, 0).
    Returns the updated (m, s, sd). Logits equal to −inf contribute exactly 0 (no NaN).
    """
    m_new = tl.maximum(m, tl.max(tl.where(valid, z, float("-inf")), axis=0))
    alpha = tl.exp(m - m_new)
    e = tl.where(valid, tl.exp(z - m_new), 0.0)
    d = tl.where(e > 0.0, z - m_new, 0.0)
    s_new = alpha * s + tl.sum(e, axis=0)
    sd_new = alpha * (sd + (m - m_new) * s) + tl.sum(e * d, axis=0)
    return m_new, s_new, sd_new


@triton.jit
def softmax_stats_finalize(m, s, sd):
    """(lse, entropy) of a row from its running (m, s, sd): lse = m + log s, H = log s − sd / s."""
    log_s = tl.log(s)
    return m + log_s, log_s - sd / s


@triton.jit
def logprob_entropy_grad_tile(z, cols, label, lse, ent, g_logp, g_ent, inv_t, HAS_ENT: tl.constexpr):
    """dlogits of one tile: [g_logp (onehot − p) − g_ent p (z − lse + H)] · inv_t, fp32 [BLOCK_V].

    z: scaled logits of the tile (x · inv_t); cols: absolute vocabulary indices; label: the row's label (int);
    lse, ent: the row's log-sum-exp and entropy from the forward; g_logp, g_ent: upstream coefficients
    (0 for a masked row gives a zero gradient). Columns past V produce garbage the caller must not store.
    With HAS_ENT False the entropy term is dropped at compile time (ent and g_ent are ignored).
    """
    p = tl.exp(z - lse)
    onehot = tl.where(cols == label, 1.0, 0.0)
    dz = g_logp * (onehot - p)
    if HAS_ENT:
        # p = 0 where z = −inf (a banned token): the term is 0, and the where avoids 0 · (−inf) = NaN.
        dz = dz - g_ent * tl.where(p > 0.0, p * (z - lse + ent), 0.0)
    return dz * inv_t


# ---------------------------------------------------------------------------------------------------------
# torch chunk helpers (CPU path of the fused-linear ops; a chunk is [n tokens] x [v vocabulary columns])
# ---------------------------------------------------------------------------------------------------------


def chunk_logits(
    hidden: torch.Tensor, weight: torch.Tensor, inv_temperature: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Scaled fp32 logits of a chunk: z = (hidden @ weight.T) · inv_temperature.

    hidden [n, H] and weight [v, H] (a token chunk and a vocabulary slice of the lm_head, any float dtype,
    upcast to fp32 here if they are not fp32). `out` [n, v] fp32 (contiguous) is reused when given so the hot
    loop allocates nothing. Returns `out` (or a new [n, v] fp32 tensor).
    """
    h = hidden if hidden.dtype == torch.float32 else hidden.float()
    w = weight if weight.dtype == torch.float32 else weight.float()
    if out is None:
        out = torch.empty((h.shape[0], w.shape[0]), dtype=torch.float32, device=h.device)
    # mm(alpha) fuses the temperature into the GEMM: addmm(out, h, w.T, beta=0, alpha=inv_T).
    torch.addmm(out, h, w.t(), beta=0.0, alpha=inv_temperature, out=out)
    return out


def chunk_softmax_stats(
    z: torch.Tensor,
    labels: torch.Tensor,
    vocab_start: int = 0,
    *,
    with_entropy: bool = True,
    scratch: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row partial statistics (m, s, sd, z_label) of a chunk of scaled logits z [n, v] (fp32).

    `labels` [n] int64 are absolute vocabulary ids; z_label is z[label − vocab_start] where the label falls in
    [vocab_start, vocab_start + v), else 0 (so partials over vocabulary slices add up). sd is zeros when
    `with_entropy` is False. `scratch` (fp32, at least n*v elements) is reused for the entropy's temporary.
    DESTROYS z: on return it holds exp(z − m) (the caller reuses the buffer).
    Combine slices with `merge_softmax_stats`, finish with `finalize_softmax_stats`.
    """
    n, v = z.shape
    local = labels - vocab_start
    inside = (local >= 0) & (local < v)
    z_label = z.gather(1, local.clamp(0, v - 1).unsqueeze(1)).squeeze(1).masked_fill_(~inside, 0.0)
    m = z.amax(dim=1)
    z.sub_(m.unsqueeze(1))  # z - m, in place
    if with_entropy:
        # d = z − m must survive the exp: one [n, v] temporary, only when the entropy is asked for.
        d = torch.empty_like(z) if scratch is None else scratch.view(-1)[: n * v].view(n, v)
        # Clamped so a −inf logit (a banned token) gives e = 0 and a finite d, hence e·d = 0, not NaN.
        torch.clamp(z, min=-1e4, out=d)
        z.exp_()
        s = z.sum(dim=1)
        # Σ e·d per row, the product written over d (no second temporary). Not bmm([n,1,v] @ [n,v,1]): its
        # fp32 dot products lose ~1e-5 relative at v = 50k on CPU, against ~1e-7 for the cascade sum.
        sd = d.mul_(z).sum(dim=1)
    else:
        z.exp_()
        s = z.sum(dim=1)
        sd = torch.zeros_like(s)
    return m, s, sd, z_label


def merge_softmax_stats(
    a: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    b: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Combine the (m, s, sd, z_label) partials of two vocabulary slices of the same token rows."""
    m_a, s_a, sd_a, zl_a = a
    m_b, s_b, sd_b, zl_b = b
    m = torch.maximum(m_a, m_b)
    ca, cb = torch.exp(m_a - m), torch.exp(m_b - m)
    # sd relative to the new max: Σ e_a (z − m) = ca (sd_a + (m_a − m) s_a), same for b.
    sd = ca * (sd_a + (m_a - m) * s_a) + cb * (sd_b + (m_b - m) * s_b)
    return m, ca * s_a + cb * s_b, sd, zl_a + zl_b


def finalize_softmax_stats(
    stats: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(lse, logp, entropy) per row from merged (m, s, sd, z_label) over the whole vocabulary."""
    m, s, sd, z_label = stats
    log_s = torch.log(s)
    # logp as (z_label − m) − log s, not z_label − lse: both terms stay small when the logits are large.
    return m + log_s, (z_label - m) - log_s, log_s - sd / s


def chunk_logprob_grad_(
    z: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor | None,
    g_logp: torch.Tensor,
    g_ent: torch.Tensor | None,
    inv_temperature: float,
    vocab_start: int = 0,
) -> torch.Tensor:
    """Overwrite the scaled logits z [n, v] (fp32, a chunk) with dlogits, in place, and return it.

    dlogits = [g_logp (onehot − p) − g_ent p (z − lse + H)] · inv_temperature, with p = exp(z − lse).
    labels [n] absolute ids (a label outside [vocab_start, vocab_start + v) gets no onehot term here);
    lse, entropy, g_logp, g_ent: per-row fp32 [n]. Rows to be ignored must come with g_logp = g_ent = 0.
    entropy/g_ent may be None (no entropy term). Then dlogits = g' · onehot − g' · p with g' = g_logp · inv_T.
    """
    n, v = z.shape
    z.sub_(lse.unsqueeze(1))  # z − lse = log p
    if g_ent is not None:
        # −g_ent p (log p + H) − g_logp p = −p (g_ent (log p + H) + g_logp)
        coef = (g_ent * entropy + g_logp).unsqueeze(1)  # [n, 1]
        p = torch.exp(z)
        z.clamp_min_(-1e4)  # log p of a −inf logit: finite, so p · (log p + H) = 0, not NaN
        z.mul_(g_ent.unsqueeze(1)).add_(coef).mul_(p).mul_(-inv_temperature)
    else:
        z.exp_().mul_((g_logp * -inv_temperature).unsqueeze(1))
    local = labels - vocab_start
    inside = (local >= 0) & (local < v)
    add = torch.where(inside, g_logp * inv_temperature, 0.0)
    z.scatter_add_(1, local.clamp(0, v - 1).unsqueeze(1), add.unsqueeze(1))
    return z


__all__ = [
    "M_INIT",
    "M_INIT_TL",
    "softmax_tile_update",
    "softmax_stats_finalize",
    "logprob_entropy_grad_tile",
    "chunk_logits",
    "chunk_softmax_stats",
    "merge_softmax_stats",
    "finalize_softmax_stats",
    "chunk_logprob_grad_",
]
