"""Plain-torch references, written for clarity, not speed.

Tests evaluate these in float64 and compare both the Triton and the torch paths of every op against them.
Each section belongs to one op; keep them readable: log_softmax + gather, explicit formulas, no fusion.
"""

from __future__ import annotations

import torch

# ---------------------------------------------------------------------------------------------------------
# Token log-probs and entropy (kernels/logprobs.py, kernels/linear_logprobs.py)
# ---------------------------------------------------------------------------------------------------------


def token_logprobs_ref(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    mask: torch.Tensor | None = None,
    ignore_index: int = -100,
    return_entropy: bool = False,
    dtype: torch.dtype = torch.float32,
):
    """log p(label) under softmax(logits / temperature), and optionally the entropy, per position.

    logits [..., V], labels [...] int64, mask [...] (nonzero = keep). Masked or ignored positions give 0.
    Math runs in `dtype` (tests pass float64). Returns logp [...] (and entropy [...]).
    """
    z = logits.to(dtype) / temperature
    logp_all = torch.log_softmax(z, dim=-1)
    keep = labels != ignore_index
    if mask is not None:
        keep = keep & mask.bool()
    safe = torch.where(keep, labels, torch.zeros_like(labels))
    logp = torch.gather(logp_all, -1, safe.unsqueeze(-1)).squeeze(-1)
    logp = torch.where(keep, logp, torch.zeros_like(logp))
    if not return_entropy:
        return logp
    # H = -sum p log p, with 0 log 0 = 0 (a -inf logit, i.e. a banned token, contributes nothing).
    p = logp_all.exp()
    entropy = -torch.where(p > 0, p * logp_all, torch.zeros_like(p)).sum(-1)
    entropy = torch.where(keep, entropy, torch.zeros_like(entropy))
    return logp, entropy


def linear_token_logprobs_ref(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, dtype: torch.dtype = torch.float32, **kw
):
    """`token_logprobs_ref(hidden @ weight.T, labels, **kw)`, materialising the full [T, V] logits."""
    logits = hidden.to(dtype) @ weight.to(dtype).t()
    return token_logprobs_ref(logits, labels, dtype=dtype, **kw)


# ---------------------------------------------------------------------------------------------------------
# Policy loss (kernels/policy_loss.py, kernels/linear_policy_loss.py)
# ---------------------------------------------------------------------------------------------------------


def sequence_slices_ref(shape_or_mask: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> list[tuple]:
    """Index tuples selecting each sequence: rows of a [B, L] tensor, or cu_seqlens segments of a [T] one (one
    sequence when cu_seqlens is None)."""
    if shape_or_mask.dim() == 2:
        return [(b, slice(None)) for b in range(shape_or_mask.shape[0])]
    cu = [int(c) for c in cu_seqlens] if cu_seqlens is not None else [0, shape_or_mask.shape[0]]
    return [(slice(cu[s], cu[s + 1]),) for s in range(len(cu) - 1)]


def policy_token_weights_ref(
    mask: torch.Tensor,
    *,
    loss_agg: str,
    cu_seqlens: torch.Tensor | None = None,
    num_tokens=None,
    num_seqs=None,
    max_seq_len: int | None = None,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Aggregation weight of every token, so that loss = Σ_t weight_t · ℓ_t for every loss_agg.

    mask [B, L] (rows are sequences) or [T] packed with cu_seqlens [S+1]. Written with an explicit loop over
    sequences. num_tokens / num_seqs default to the local counts (masked tokens; rows or segments).
    """
    m = mask.to(dtype)
    bounds = sequence_slices_ref(mask, cu_seqlens)
    n_tok = float(m.sum()) if num_tokens is None else float(num_tokens)
    n_seq = float(len(bounds)) if num_seqs is None else float(num_seqs)
    weights = torch.zeros_like(m)
    for idx in bounds:
        seq_mask = m[idx]
        if loss_agg == "token-mean":
            weights[idx] = seq_mask / max(n_tok, 1.0)
        elif loss_agg == "seq-mean-token-mean":
            weights[idx] = seq_mask / max(float(seq_mask.sum()), 1.0) / n_seq
        elif loss_agg == "seq-mean-token-sum":
            weights[idx] = seq_mask / n_seq
        elif loss_agg == "seq-mean-token-sum-norm":
            weights[idx] = seq_mask / (n_seq * max_seq_len)
        else:
            raise ValueError(f"loss_agg={loss_agg!r}")
    return weights


# The objectives' per-token terms. Each returns (ℓ_t, the objective's ratio, clipped low, clipped high, dual-clipped
# or None) from logp, old, adv (all in the reference dtype, 0 off the kept tokens), keep and the call's inputs.
# kernels/objective.py registers each one with its objective (`register_objective(..., reference=...)`), and
# `policy_loss_ref` runs the one of config.objective from that entry.


def clipped_surrogate_ref(ratio, adv, c):
    """max(−A r, −A clip(r, 1 − clip_low, 1 + clip_high)), and with clip_ratio_c the dual clip: the loss of a
    negative-advantage token is bounded by −A c."""
    lo, hi = 1.0 - c.clip_low, 1.0 + c.clip_high
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * torch.clamp(ratio, lo, hi)
    pg_ppo = torch.maximum(pg_unclipped, pg_clipped)
    pg, dual = pg_ppo, None
    if c.clip_ratio_c is not None:  # dual clip: bound the loss of negative-advantage tokens
        pg = torch.where(adv < 0, torch.minimum(pg_ppo, -adv * c.clip_ratio_c), pg_ppo)
        dual = (adv < 0) & (-adv * c.clip_ratio_c < pg_ppo)
    return pg, ratio, (ratio < lo) & (adv < 0), (ratio > hi) & (adv > 0), dual


def ppo_term_ref(logp, old, adv, keep, inputs, c):
    """PPO: the clipped surrogate of the token ratio r = exp(clamp(logp − old, ±20))."""
    return clipped_surrogate_ref(torch.exp(torch.clamp(logp - old, -20.0, 20.0)), adv, c)


def gspo_term_ref(logp, old, adv, keep, inputs, c):
    """GSPO: one ratio and one advantage per sequence: s = exp(mean of (logp − old) over its kept tokens), A = mean
    of its advantages; every token of the sequence carries them into the clipped surrogate."""
    ratio = torch.ones_like(logp)
    seq_adv = torch.zeros_like(adv)
    for idx in sequence_slices_ref(inputs.labels, inputs.cu_seqlens):
        k = keep[idx].to(logp.dtype)
        n = max(float(k.sum()), 1.0)
        ratio[idx] = torch.exp(torch.clamp(((logp[idx] - old[idx]) * k).sum() / n, -20.0, 20.0))
        seq_adv[idx] = (adv[idx] * k).sum() / n
    return clipped_surrogate_ref(ratio, seq_adv, c)


def cispo_term_ref(logp, old, adv, keep, inputs, c):
    """CISPO: −sg(clip(r)) A logp: the IS weight is clipped and detached; every token keeps its gradient."""
    lo, hi = 1.0 - c.clip_low, 1.0 + c.clip_high
    ratio = torch.exp(torch.clamp(logp - old, -20.0, 20.0)).detach()
    pg = -torch.clamp(ratio, lo, hi) * adv * logp
    return pg, ratio, ratio < lo, ratio > hi, None


def policy_loss_ref(logits: torch.Tensor, inputs, *, config, temperature: float = 1.0,
                    dtype: torch.dtype = torch.float64):
    """The policy loss (any registered objective) and its metrics, by autograd through plain torch (math in
    `dtype`).

    Same arguments as `kernels.policy_loss`: `inputs` is a kernels.objective.LossInputs (labels equal to -100
    count as masked). Returns (loss, metrics dict) without `input_errors`.
    """
    c = config
    labels, mask, cu_seqlens = inputs.labels, inputs.mask, inputs.cu_seqlens
    num_tokens, num_seqs = inputs.num_tokens, inputs.num_seqs
    keep = (mask != 0) & (labels != -100)
    z = logits.to(dtype) / temperature
    logp_all = torch.log_softmax(z, dim=-1)
    logp = logp_all.gather(-1, torch.where(keep, labels, 0).unsqueeze(-1)).squeeze(-1)
    logp = torch.where(keep, logp, 0.0)  # masked tokens: a finite placeholder (label 0 may be a −inf logit)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    adv = inputs.advantages.to(dtype)

    def kept(x):  # padding values never reach the math (they may be garbage)
        return torch.where(keep, x.to(dtype), 0.0)

    old = logp.detach() if inputs.old_logprobs is None else kept(inputs.old_logprobs)
    log_ratio = torch.clamp(logp - old, -20.0, 20.0)
    token_ratio = torch.exp(log_ratio)
    # The objective's term through its registry entry (kernels/objective.py), reached from the config: this module
    # imports nothing of kernels/.
    pg, ratio, clipped_low, clipped_high, dual = c.objective_spec.reference(logp, old, adv, keep, inputs, c)

    metrics = {}
    n_tok = max(float(keep.sum()) if num_tokens is None else float(num_tokens), 1.0)

    def token_mean(x):  # metrics: token means over the kept tokens, normalised by num_tokens
        return torch.where(keep, x.detach().to(dtype), 0.0).sum() / n_tok

    if inputs.rollout_logprobs is not None:
        trainer = old.detach()  # the trainer's side of the mismatch: old log-probs, else the current ones
        engine = kept(inputs.rollout_logprobs)
        diff = trainer - engine
        rho = torch.exp(torch.clamp(diff, -20.0, 20.0))  # importance weight trainer / engine
        metrics["mismatch/logprob_abs_diff_mean"] = token_mean(diff.abs())
        metrics["mismatch/logprob_abs_diff_max"] = torch.where(keep, diff.abs(), 0.0).max()
        metrics["mismatch/kl_k3"] = token_mean(rho - 1.0 - torch.log(rho))
        if c.rollout_correction == "tis":  # truncated importance sampling
            weight = torch.clamp(rho, max=c.tis_cap)
            cut = rho > c.tis_cap
        elif c.rollout_correction == "mis":  # masked importance sampling: drop tokens outside [1/cap, cap]
            cut = (rho < 1.0 / c.tis_cap) | (rho > c.tis_cap)
            weight = torch.where(cut, 0.0, rho)
        if c.rollout_correction != "none":
            pg = pg * weight
            metrics["mismatch/tis_weight_mean"] = token_mean(weight)
            metrics["mismatch/tis_clip_frac"] = token_mean(cut.to(dtype))
    per_token = pg
    kl = None
    if inputs.ref_logprobs is not None:
        diff = logp - kept(inputs.ref_logprobs)
        if c.kl_type == "k1":
            kl = diff
        elif c.kl_type == "k2":
            kl = 0.5 * diff**2
        else:
            kl = torch.clamp(torch.exp(-diff) + diff - 1.0, -10.0, 10.0)
        per_token = per_token + c.kl_coef * kl
    if c.entropy_coef != 0.0:
        per_token = per_token - c.entropy_coef * entropy

    weights = policy_token_weights_ref(
        keep, loss_agg=c.loss_agg, cu_seqlens=cu_seqlens, num_tokens=num_tokens, num_seqs=num_seqs,
        max_seq_len=c.max_seq_len, dtype=dtype,
    )
    loss = (weights * torch.where(keep, per_token, 0.0)).sum()

    metrics.update({
        "clip_frac_low": token_mean(clipped_low.to(dtype)),
        "clip_frac_high": token_mean(clipped_high.to(dtype)),
        "approx_kl": token_mean(token_ratio - 1.0 - log_ratio),
        "ratio_mean": token_mean(ratio),
    })
    if dual is not None:
        metrics["dual_clip_frac"] = token_mean(dual.to(dtype))
    if c.entropy_coef != 0.0 or c.log_entropy:
        metrics["entropy"] = token_mean(entropy)
    if kl is not None:
        metrics["kl"] = token_mean(kl)
    return loss, metrics

# ---------------------------------------------------------------------------------------------------------
# Packing (kernels/packing.py)
# ---------------------------------------------------------------------------------------------------------


def pack_reference(padded: torch.Tensor, lengths: list[int], total: int | None = None, fill: float = 0) -> torch.Tensor:
    """[B, L, ...] -> [total, ...]: the first lengths[b] rows of each padded[b] in order, then `fill` rows."""
    rows = [padded[b, :n] for b, n in enumerate(lengths)]
    flat = torch.cat(rows, dim=0)
    total = flat.shape[0] if total is None else total
    tail = torch.full((total - flat.shape[0], *padded.shape[2:]), fill, dtype=padded.dtype)
    return torch.cat([flat, tail], dim=0)


def unpack_reference(flat: torch.Tensor, lengths: list[int], max_len: int, fill: float = 0) -> torch.Tensor:
    """[N, ...] -> [B, max_len, ...]: sequence b is flat[start_b : start_b + lengths[b]], then `fill`."""
    out = torch.full((len(lengths), max_len, *flat.shape[1:]), fill, dtype=flat.dtype)
    start = 0
    for b, n in enumerate(lengths):
        out[b, :n] = flat[start : start + n]
        start += n
    return out


def packed_layout_reference(lengths: list[int], total: int | None = None) -> tuple[list[int], list[int], list[int]]:
    """Plain-Python (cu_seqlens, position_ids, seq_index) of a packed row; the padding tail is sequence -1 with
    positions restarting at 0."""
    cu, pos, seq = [0], [], []
    for s, n in enumerate(lengths):
        cu.append(cu[-1] + n)
        pos.extend(range(n))
        seq.extend([s] * n)
    tail = (cu[-1] if total is None else total) - cu[-1]
    pos.extend(range(tail))
    seq.extend([-1] * tail)
    return cu, pos, seq


def broadcast_to_tokens_reference(values: list[float], seq_index: list[int], fill: float = 0) -> list[float]:
    """Per-token values: values[s] for a token of sequence s, `fill` for padding (s == -1)."""
    return [values[s] if s >= 0 else fill for s in seq_index]


def block_causal_mask_reference(seq_index: list[int]) -> torch.Tensor:
    """[N, N] bool: query i may attend key j iff j <= i and both tokens belong to the same sequence (padding,
    index -1, is its own causal block so no softmax row is empty)."""
    n = len(seq_index)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        for j in range(i + 1):
            mask[i, j] = seq_index[i] == seq_index[j]
    return mask


# ---------------------------------------------------------------------------------------------------------
# GAE and the clipped value loss (kernels/gae.py)
# ---------------------------------------------------------------------------------------------------------


def _gae_sequence_ref(rewards: list[float], values: list[float], mask: list[bool], gamma: float,
                      lam: float) -> tuple[list[float], list[float]]:
    """GAE of one sequence, walking its tokens backwards. Tokens with mask 0 are skipped: the recursion carries the
    next trained token's value and advantage across them, and they get advantage and return 0. The last trained
    token bootstraps from 0 (terminal)."""
    T = len(rewards)
    advantages, returns = [0.0] * T, [0.0] * T
    next_value, next_advantage = 0.0, 0.0
    for t in reversed(range(T)):
        if not mask[t]:
            continue
        delta = rewards[t] + gamma * next_value - values[t]
        advantage = delta + gamma * lam * next_advantage
        advantages[t], returns[t] = advantage, advantage + values[t]
        next_value, next_advantage = values[t], advantage
    return advantages, returns


def gae_reference(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float, lam: float,
                  cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) float64: padded [B, T] inputs (rows are sequences), or packed [N] with cu_seqlens
    [S+1] (tokens past cu_seqlens[-1] get 0). A plain loop over sequences and their tokens."""
    r, v, m = rewards.double(), values.double(), mask.bool()
    advantages, returns = torch.zeros_like(r), torch.zeros_like(r)
    for idx in sequence_slices_ref(r, cu_seqlens):
        a, g = _gae_sequence_ref(r[idx].tolist(), v[idx].tolist(), m[idx].tolist(), gamma, lam)
        advantages[idx] = torch.tensor(a, dtype=torch.float64)
        returns[idx] = torch.tensor(g, dtype=torch.float64)
    return advantages, returns


def value_loss_reference(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
                         *, clip: float | None, agg: str = "token-mean", num_tokens=None) -> torch.Tensor:
    """PPO's clipped value loss in float64, token by token: ½ max((v − R)², (clip(v, old − c, old + c) − R)²)
    (½ (v − R)² without a clip), then the token mean (over num_tokens, default the masked tokens) or the mean over
    rows of each row's token mean ([B, T] only). Differentiable w.r.t. `values` (pass a float64 leaf)."""
    flat_v, flat_old = values.reshape(-1, values.shape[-1]), old_values.reshape(-1, values.shape[-1])
    flat_r, flat_m = returns.reshape(-1, values.shape[-1]).double(), mask.reshape(-1, values.shape[-1]).bool()
    total, n_tok, row_means = 0.0, 0, []
    for b in range(flat_v.shape[0]):
        row_total, row_tok = 0.0, 0
        for t in range(flat_v.shape[1]):
            if not flat_m[b, t]:
                continue
            v, old, ret = flat_v[b, t].double(), flat_old[b, t].double(), flat_r[b, t]
            loss = 0.5 * (v - ret) ** 2
            if clip is not None:
                v_clipped = old + torch.clamp(v - old, -clip, clip)
                loss = torch.maximum(loss, 0.5 * (v_clipped - ret) ** 2)
            row_total, row_tok = row_total + loss, row_tok + 1
        total, n_tok = total + row_total, n_tok + row_tok
        row_means.append(row_total / max(row_tok, 1))
    if agg == "token-mean":
        denominator = max(n_tok, 1) if num_tokens is None else float(num_tokens)
        return torch.as_tensor(total / denominator, dtype=torch.float64)
    if agg == "seq-mean-token-mean":
        return torch.as_tensor(sum(row_means) / len(row_means), dtype=torch.float64)
    raise ValueError(f"agg={agg!r}")


# ---------------------------------------------------------------------------------------------------------
# Seeded sampling (kernels/sampling.py)
# ---------------------------------------------------------------------------------------------------------


def philox4x32_reference(counter: tuple[int, int, int, int], key: tuple[int, int]) -> tuple[int, int, int, int]:
    """Philox4x32-10 in Python integers, as Random123 defines it: ten rounds of two 32 x 32 -> 64-bit products
    (high words mixed with the other counter words and the key, low words kept), the key bumped by the Weyl
    constants between rounds."""
    mask = 0xFFFFFFFF
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & mask, (p0 >> 32) ^ c3 ^ k1, p0 & mask
        k0, k1 = (k0 + 0x9E3779B9) & mask, (k1 + 0xBB67AE85) & mask
    return c0, c1, c2, c3


def sample_tokens_reference(probs: torch.Tensor, seeds: list[int], positions: list[int]) -> list[int]:
    """Row by row: u = the top 52 bits of Philox(counter = (position low, high, 0, 0), key = seed's low, high words)
    over 2^52, then the first token whose float64 prefix sum exceeds u times the row's sum."""
    out = []
    for row, seed, pos in zip(probs.to(torch.float64), seeds, positions):
        s = seed % (1 << 64)
        w0, w1, _, _ = philox4x32_reference((pos & 0xFFFFFFFF, pos >> 32, 0, 0), (s & 0xFFFFFFFF, s >> 32))
        u = ((w0 >> 12) << 32 | w1) / 2.0 ** 52
        cdf = torch.cumsum(row, 0)
        target = u * float(cdf[-1])
        out.append(int((cdf <= target).sum()))
    return out
