"""`policy_loss`: the clipped GRPO/PPO policy loss fused with the log-softmax gather over the vocabulary.

Math, per token t (mask m_t, advantage A_t, temperature T, z = logits / T):
    logp  = z[label] − lse(z),  H = lse − Σ_j p_j z_j                     (entropy only when asked for)
    δ     = logp − old (old = logp.detach() on-policy),  lr = clamp(δ, −20, 20),  r = exp(lr)
    pg    = max(−A r, −A clip(r, 1 − clip_low, 1 + clip_high))             (PPO clip)
    pg    = min(pg, −A c)  where A < 0                                     (dual clip, c = clip_ratio_c)
    pg    = pg · min(exp(old − rollout), tis_cap)                           (TIS weight, a constant)
    kl    = k1: logp − ref | k2: ½ (logp − ref)² | k3: clamp(e^{ref − logp} − (ref − logp) − 1, −10, 10)
    ℓ_t   = pg + kl_coef · kl − entropy_coef · H

ℓ_t is a function of (logp_t, H_t) only, so with a per-token aggregation weight w_t the loss is
    loss = Σ_t w_t ℓ_t,   w_t = m_t / N_tok                  token-mean (DAPO)
                              m_t / (len_s · N_seq)          seq-mean-token-mean (GRPO), len_s = Σ_{t∈s} m_t
                              m_t / N_seq                    seq-mean-token-sum
                              m_t / (N_seq · max_seq_len)    seq-mean-token-sum-norm (Dr.GRPO)
and its gradient is the log-prob backward tile with per-token coefficients (see kernels/_softmax_tiles.py):
    ∂loss/∂logits_t = [w_t ∂ℓ/∂logp (onehot − p) + w_t ∂ℓ/∂H ∂H/∂z] / T,    ∂ℓ/∂H = −entropy_coef
    ∂ℓ/∂logp = −A r [δ in range] · [PPO branch unclipped or r inside the clip range] · [dual clip inactive] · tis
               + kl_coef · (1 | logp − ref | (1 − e^{ref − logp}) [k3 ≤ 10])
Closed-form derivatives follow autograd's conventions (clamp passes the gradient on the closed interval).
Because loss and metrics are weighted sums, passing the global `num_tokens` / `num_seqs` of a step makes the
losses (and gradients, and metrics) of micro-batches and data-parallel ranks add up exactly to the full batch.

Forward: one pass over the vocabulary per token row gives lse, H, logp, then ℓ, ∂ℓ/∂logp and the per-token
metric values; backward: one pass writes dlogits. Labels equal to -100 count as masked.
Host syncs: input validation (non-finite advantages, labels out of range, bad cu_seqlens) reads one combined
flag vector; the torch (CPU) paths also count the kept rows to skip padding. Metrics stay on the device.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from kernels._softmax_tiles import (
    M_INIT,
    chunk_logprob_grad_,
    chunk_softmax_stats,
    finalize_softmax_stats,
    logprob_entropy_grad_tile,
    softmax_stats_finalize,
    softmax_tile_update,
    tile_label_value,
)
from kernels.device import backend_for

LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_TYPES = ("k1", "k2", "k3")
IGNORE_INDEX = -100
# Rows of the per-token metric values [N_METRICS, N]; metrics are Σ_t metric_weight_t · value_t.
METRIC_NAMES = ("clip_frac_low", "clip_frac_high", "approx_kl", "ratio_mean", "dual_clip_frac", "entropy", "kl")
N_METRICS = len(METRIC_NAMES)
_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Compiled Triton reads module globals only as constexprs (the interpreter does not check this).
_M_START = tl.constexpr(M_INIT)


@dataclasses.dataclass(frozen=True)
class PolicyLossConfig:
    """Options of the GRPO/PPO policy loss (see the module docstring for the math).

    loss_agg: token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm (needs max_seq_len).
    clip_ratio_c: dual-clip bound (> 1) for negative advantages, None = off.
    tis_cap: truncation of the TIS weight exp(old − rollout) when rollout_logprobs are given, None = no cap.
    log_entropy: compute the `entropy` metric even when entropy_coef is 0 (costs one more pass on the torch path).
    """

    loss_agg: str = "seq-mean-token-mean"
    clip_low: float = 0.2
    clip_high: float = 0.2
    clip_ratio_c: float | None = None
    kl_coef: float = 0.0
    kl_type: str = "k3"
    entropy_coef: float = 0.0
    tis_cap: float | None = None
    temperature: float = 1.0
    max_seq_len: int | None = None
    log_entropy: bool = False

    def __post_init__(self) -> None:
        if self.loss_agg not in LOSS_AGGS:
            raise ValueError(f"loss_agg={self.loss_agg!r} is unknown; choose one of {LOSS_AGGS}")
        if self.kl_type not in KL_TYPES:
            raise ValueError(f"kl_type={self.kl_type!r} is unknown; choose one of {KL_TYPES}")
        if self.loss_agg == "seq-mean-token-sum-norm" and (self.max_seq_len is None or self.max_seq_len <= 0):
            raise ValueError("max_seq_len must be a positive int for loss_agg='seq-mean-token-sum-norm' (Dr.GRPO); "
                             "pass the generation length limit")
        if not (0.0 <= self.clip_low < 1.0) or self.clip_high < 0.0:
            raise ValueError(f"clip_low={self.clip_low}, clip_high={self.clip_high}: need 0 <= clip_low < 1 and "
                             "clip_high >= 0")
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c={self.clip_ratio_c}: dual clip needs a value > 1 (or None to disable)")
        if self.tis_cap is not None and self.tis_cap <= 0.0:
            raise ValueError(f"tis_cap={self.tis_cap}: must be > 0 (or None for an uncapped TIS weight)")
        if not self.temperature > 0.0:
            raise ValueError(f"temperature={self.temperature}: must be > 0")

    @property
    def needs_entropy(self) -> bool:
        return self.entropy_coef != 0.0 or self.log_entropy


@dataclasses.dataclass(frozen=True)
class TokenInputs:
    """Flat per-token inputs [N] of one call, shared by policy_loss and linear_policy_loss.

    labels int64 (clamped to 0 where not kept, so they index safely); keep bool; advantages/old/ref/rollout fp32
    (None when absent); weight: the loss aggregation weight w_t; metric_weight: m_t / N_tok.
    """

    labels: torch.Tensor
    keep: torch.Tensor
    advantages: torch.Tensor
    old: torch.Tensor | None
    ref: torch.Tensor | None
    rollout: torch.Tensor | None
    weight: torch.Tensor
    metric_weight: torch.Tensor

    def rows(self, start: int, stop: int) -> TokenInputs:
        """The same inputs for tokens [start, stop) (views, no copies)."""
        return self.take(slice(start, stop))

    def take(self, rows: slice | torch.Tensor) -> TokenInputs:
        """The same inputs for the tokens `rows` (a slice, or an index tensor)."""
        fields = (getattr(self, f.name) for f in dataclasses.fields(self))
        return TokenInputs(*(None if t is None else t[rows] for t in fields))


def kept_row_chunks(tok: TokenInputs, chunk: int):
    """Yield (rows, inputs of those rows) over the kept tokens, `chunk` at a time, for the torch paths.

    Masked and ignored tokens are skipped, so padding costs nothing; rows is a slice when every token is kept,
    else an index tensor. Counting the kept tokens is a host sync: fine on the CPU path these loops serve.
    """
    n = tok.keep.numel()
    if bool(tok.keep.all()):  # host sync (torch path)
        for a in range(0, n, chunk):
            yield slice(a, min(a + chunk, n)), tok.rows(a, min(a + chunk, n))
    else:
        kept = tok.keep.nonzero().squeeze(1)
        for a in range(0, kept.numel(), chunk):
            idx = kept[a : a + chunk]
            yield idx, tok.take(idx)


# ---------------------------------------------------------------------------------------------------------
# Input checks and per-token aggregation weights (shared by both paths and by linear_policy_loss)
# ---------------------------------------------------------------------------------------------------------


def _raise_on_bad_values(checks: list[tuple[torch.Tensor, str]]) -> None:
    """Raise the message of the first check whose 0-d bool tensor is True. One host sync for all of them."""
    if not checks:
        return
    flags = torch.stack([c.reshape(()).bool() for c, _ in checks])
    for bad, (_, msg) in zip(flags.tolist(), checks):  # .tolist(): the one host sync of input validation
        if bad:
            raise ValueError(msg)


def _as_count(x, name: str, device: torch.device) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        if x.numel() != 1:
            raise ValueError(f"{name} must be a scalar (python number or 0-d tensor), got shape {tuple(x.shape)}")
        return x.reshape(()).to(device=device, dtype=torch.float32)
    if not x >= 0:
        raise ValueError(f"{name}={x!r}: must be a non-negative count (the global count of the step)")
    return torch.tensor(float(x), dtype=torch.float32, device=device)


def prepare_token_inputs(
    labels: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    config: PolicyLossConfig,
    vocab_size: int,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    rollout_logprobs: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    num_tokens=None,
    num_seqs=None,
) -> TokenInputs:
    """Check the per-token arguments and flatten them to [N]; compute the aggregation weights.

    labels [B, L] (rows are sequences) or [T] packed (sequences from cu_seqlens [S+1]); every other per-token
    tensor has the labels' shape. Raises ValueError naming the bad argument.
    """
    if not isinstance(config, PolicyLossConfig):
        raise ValueError(f"config must be a PolicyLossConfig, got {type(config).__name__}")
    if labels.dim() not in (1, 2):
        raise ValueError(f"labels must be [B, L] (padded rows) or [T] (packed), got shape {tuple(labels.shape)}")
    if labels.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"labels must be int64 (or int32) token ids, got {labels.dtype}")
    shape = labels.shape
    device = labels.device
    named = {"mask": mask, "advantages": advantages, "old_logprobs": old_logprobs, "ref_logprobs": ref_logprobs,
             "rollout_logprobs": rollout_logprobs}
    for name, t in named.items():
        if t is None:
            continue
        if t.shape != shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} does not match labels shape {tuple(shape)}; "
                             "pass one value per token")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but labels are on {device}; move it to the same device")
    if config.kl_coef != 0.0 and ref_logprobs is None:
        raise ValueError(f"kl_coef={config.kl_coef} needs ref_logprobs (the reference policy's log-probs)")
    if not advantages.is_floating_point():
        raise ValueError(f"advantages must be a float tensor, got {advantages.dtype}")

    flat_labels = labels.reshape(-1).long()
    keep = (mask.reshape(-1) != 0) & (flat_labels != IGNORE_INDEX)
    adv = advantages.reshape(-1).float()
    checks = [
        ((~torch.isfinite(adv) & keep).any(), "advantages contain NaN or inf at unmasked tokens; fix the reward or "
                                               "advantage computation (or mask those tokens)"),
        ((((flat_labels < 0) | (flat_labels >= vocab_size)) & keep).any(),
         f"labels out of range [0, {vocab_size}) at unmasked tokens (use -100 or mask 0 for ignored tokens)"),
    ]

    n = flat_labels.numel()
    keep_f = keep.float()
    if labels.dim() == 2:
        if cu_seqlens is not None:
            raise ValueError("cu_seqlens is only for packed [T] labels; padded [B, L] labels use rows as sequences")
        n_local_seqs = shape[0]
        seq_len_of_token = keep_f.view(shape).sum(1, keepdim=True).expand(shape).reshape(-1)
    elif cu_seqlens is not None:
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
            raise ValueError(f"cu_seqlens must be a 1-D integer tensor [S+1], got shape {tuple(cu_seqlens.shape)} "
                             f"and dtype {cu_seqlens.dtype}")
        cu = cu_seqlens.to(device=device, dtype=torch.int64)
        checks.append(((cu[0] != 0) | (cu[-1] != n) | (cu[1:] < cu[:-1]).any(),
                       f"cu_seqlens must start at 0, be non-decreasing (increasing offsets) and end at T={n}"))
        n_local_seqs = cu.numel() - 1
        seq_index = torch.searchsorted(cu[1:], torch.arange(n, device=device), right=True).clamp_(max=n_local_seqs - 1)
        seq_lens = torch.zeros(n_local_seqs, device=device).index_add_(0, seq_index, keep_f)
        seq_len_of_token = seq_lens[seq_index]
    else:
        if config.loss_agg != "token-mean":
            raise ValueError(f"loss_agg={config.loss_agg!r} needs sequences: pass cu_seqlens for packed [T] labels "
                             "(or use [B, L] labels)")
        n_local_seqs = 1
        seq_len_of_token = None
    _raise_on_bad_values(checks)

    n_tok = (keep_f.sum() if num_tokens is None else _as_count(num_tokens, "num_tokens", device)).clamp(min=1.0)
    n_seq = float(n_local_seqs) if num_seqs is None else _as_count(num_seqs, "num_seqs", device)
    if config.loss_agg == "token-mean":
        weight = keep_f / n_tok
    elif config.loss_agg == "seq-mean-token-mean":
        weight = keep_f / (seq_len_of_token.clamp(min=1.0) * n_seq)
    elif config.loss_agg == "seq-mean-token-sum":
        weight = keep_f / n_seq
    else:
        weight = keep_f / (n_seq * float(config.max_seq_len))

    def flat(t):
        return None if t is None else t.reshape(-1).float().contiguous()

    return TokenInputs(
        labels=torch.where(keep, flat_labels, 0).contiguous(),
        keep=keep,
        advantages=adv.contiguous(),
        old=flat(old_logprobs),
        ref=flat(ref_logprobs),
        rollout=flat(rollout_logprobs),
        weight=weight.contiguous(),
        metric_weight=(keep_f / n_tok).contiguous(),
    )


def metrics_dict(metric_sums: torch.Tensor, config: PolicyLossConfig, has_ref: bool) -> dict[str, torch.Tensor]:
    """Name the [N_METRICS] device vector; drop the metrics this configuration does not compute."""
    skip = set()
    if config.clip_ratio_c is None:
        skip.add("dual_clip_frac")
    if not config.needs_entropy:
        skip.add("entropy")
    if not has_ref:
        skip.add("kl")
    return {name: metric_sums[i] for i, name in enumerate(METRIC_NAMES) if name not in skip}


# ---------------------------------------------------------------------------------------------------------
# The per-token loss ℓ(logp, H) and ∂ℓ/∂logp, in torch (the Triton twin is _policy_token_terms below)
# ---------------------------------------------------------------------------------------------------------


def policy_token_terms(
    logp: torch.Tensor, entropy: torch.Tensor | None, tok: TokenInputs, config: PolicyLossConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ℓ [n], ∂ℓ/∂logp [n], metric values [N_METRICS, n]) for fp32 logp/entropy [n] of the tokens in `tok`.

    Values at tokens that are not kept are zeroed (their inputs may be garbage: padding)."""
    c = config
    adv = tok.advantages
    delta = logp - tok.old if tok.old is not None else torch.zeros_like(logp)
    log_ratio = delta.clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    dratio = torch.where((delta >= -20.0) & (delta <= 20.0), ratio, 0.0)
    lo, hi = 1.0 - c.clip_low, 1.0 + c.clip_high
    pg_unclipped, pg_clipped = -adv * ratio, -adv * ratio.clamp(lo, hi)
    dpg_unclipped = -adv * dratio
    dpg_clipped = torch.where((ratio >= lo) & (ratio <= hi), dpg_unclipped, 0.0)
    use_unclipped = pg_unclipped >= pg_clipped
    pg = torch.where(use_unclipped, pg_unclipped, pg_clipped)
    dpg = torch.where(use_unclipped, dpg_unclipped, dpg_clipped)
    dual = torch.zeros_like(adv, dtype=torch.bool)
    if c.clip_ratio_c is not None:
        pg_dual = -adv * c.clip_ratio_c
        dual = (adv < 0) & (pg_dual < pg)
        pg = torch.where(dual, pg_dual, pg)
        dpg = torch.where(dual, 0.0, dpg)
    if tok.rollout is not None:
        old = tok.old if tok.old is not None else logp
        tis = torch.exp((old - tok.rollout).clamp(-20.0, 20.0))
        if c.tis_cap is not None:
            tis = tis.clamp(max=c.tis_cap)
        pg, dpg = pg * tis, dpg * tis
    loss, dloss = pg, dpg
    kl = torch.zeros_like(logp)
    if tok.ref is not None:
        diff = logp - tok.ref
        if c.kl_type == "k1":
            kl, dkl = diff, torch.ones_like(diff)
        elif c.kl_type == "k2":
            kl, dkl = 0.5 * diff * diff, diff
        else:
            e = torch.exp(-diff)
            raw = e + diff - 1.0
            kl = raw.clamp(-10.0, 10.0)
            dkl = torch.where(raw <= 10.0, 1.0 - e, 0.0)
        loss, dloss = loss + c.kl_coef * kl, dloss + c.kl_coef * dkl
    ent = entropy if entropy is not None else torch.zeros_like(logp)
    if c.entropy_coef != 0.0:
        loss = loss - c.entropy_coef * ent
    values = torch.stack([
        ((ratio < lo) & (adv < 0)).float(),
        ((ratio > hi) & (adv > 0)).float(),
        ratio - 1.0 - log_ratio,
        ratio,
        dual.float(),
        ent,
        kl,
    ])
    keep = tok.keep
    return torch.where(keep, loss, 0.0), torch.where(keep, dloss, 0.0), torch.where(keep, values, 0.0)


# ---------------------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------------------


@triton.jit
def _policy_token_terms(logp, ent, adv, old, ref, roll, clip_lo, clip_hi, clip_c, tis_cap, kl_coef, ent_coef,
                        HAS_OLD: tl.constexpr, HAS_REF: tl.constexpr, HAS_ROLLOUT: tl.constexpr,
                        HAS_DUAL: tl.constexpr, HAS_CAP: tl.constexpr, KL_TYPE: tl.constexpr):
    """Scalar twin of `policy_token_terms`: returns ℓ, ∂ℓ/∂logp and the metric values of one token."""
    if HAS_OLD:
        delta = logp - old
    else:
        delta = logp * 0.0
        old = logp
    log_ratio = tl.minimum(tl.maximum(delta, -20.0), 20.0)
    ratio = tl.exp(log_ratio)
    dratio = tl.where((delta >= -20.0) & (delta <= 20.0), ratio, 0.0)
    lo = 1.0 - clip_lo
    hi = 1.0 + clip_hi
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * tl.minimum(tl.maximum(ratio, lo), hi)
    dpg_unclipped = -adv * dratio
    dpg_clipped = tl.where((ratio >= lo) & (ratio <= hi), dpg_unclipped, 0.0)
    use_unclipped = pg_unclipped >= pg_clipped
    pg = tl.where(use_unclipped, pg_unclipped, pg_clipped)
    dpg = tl.where(use_unclipped, dpg_unclipped, dpg_clipped)
    dual = 0.0
    if HAS_DUAL:
        pg_dual = -adv * clip_c
        is_dual = (adv < 0) & (pg_dual < pg)
        pg = tl.where(is_dual, pg_dual, pg)
        dpg = tl.where(is_dual, 0.0, dpg)
        dual = tl.where(is_dual, 1.0, 0.0)
    if HAS_ROLLOUT:
        tis = tl.exp(tl.minimum(tl.maximum(old - roll, -20.0), 20.0))
        if HAS_CAP:
            tis = tl.minimum(tis, tis_cap)
        pg = pg * tis
        dpg = dpg * tis
    loss = pg
    dloss = dpg
    kl = 0.0
    if HAS_REF:
        diff = logp - ref
        if KL_TYPE == 1:
            kl = diff
            dkl = 1.0
        elif KL_TYPE == 2:
            kl = 0.5 * diff * diff
            dkl = diff
        else:
            e = tl.exp(-diff)
            raw = e + diff - 1.0
            kl = tl.minimum(tl.maximum(raw, -10.0), 10.0)
            dkl = tl.where(raw <= 10.0, 1.0 - e, 0.0)
        loss = loss + kl_coef * kl
        dloss = dloss + kl_coef * dkl
    loss = loss - ent_coef * ent
    clip_low = tl.where((ratio < lo) & (adv < 0), 1.0, 0.0)
    clip_high = tl.where((ratio > hi) & (adv > 0), 1.0, 0.0)
    approx_kl = ratio - 1.0 - log_ratio
    return loss, dloss, clip_low, clip_high, approx_kl, ratio, dual, kl


@triton.jit
def _policy_loss_fwd_kernel(
    x_ptr, labels_ptr, keep_ptr, w_ptr, adv_ptr, old_ptr, ref_ptr, roll_ptr,
    wloss_ptr, glogp_ptr, lse_ptr, ent_ptr, vals_ptr,
    N, V, inv_t, clip_lo, clip_hi, clip_c, tis_cap, kl_coef, ent_coef,
    HAS_OLD: tl.constexpr, HAS_REF: tl.constexpr, HAS_ROLLOUT: tl.constexpr, HAS_DUAL: tl.constexpr,
    HAS_CAP: tl.constexpr, KL_TYPE: tl.constexpr, BLOCK_V: tl.constexpr,
):
    # One program per token row. Outputs are zero-initialised by the host, so masked rows just return
    # (they skip the vocabulary loop entirely).
    row = tl.program_id(0).to(tl.int64)
    if tl.load(keep_ptr + row) == 0:
        return
    label = tl.load(labels_ptr + row)
    x_row = x_ptr + row * V  # int64 offsets: N * V exceeds 2**31 at 16k tokens x 152k vocabulary
    m = _M_START
    s = 0.0
    sd = 0.0
    z_label = 0.0
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        valid = cols < V
        z = tl.load(x_row + cols, mask=valid, other=0.0).to(tl.float32) * inv_t
        m, s, sd = softmax_tile_update(z, valid, m, s, sd)
        z_label += tile_label_value(z, cols, label)
    lse, ent = softmax_stats_finalize(m, s, sd)
    logp = z_label - lse
    adv = tl.load(adv_ptr + row)
    old = 0.0
    ref = 0.0
    roll = 0.0
    if HAS_OLD:
        old = tl.load(old_ptr + row)
    if HAS_REF:
        ref = tl.load(ref_ptr + row)
    if HAS_ROLLOUT:
        roll = tl.load(roll_ptr + row)
    loss, dloss, clip_low, clip_high, approx_kl, ratio, dual, kl = _policy_token_terms(
        logp, ent, adv, old, ref, roll, clip_lo, clip_hi, clip_c, tis_cap, kl_coef, ent_coef,
        HAS_OLD, HAS_REF, HAS_ROLLOUT, HAS_DUAL, HAS_CAP, KL_TYPE,
    )
    w = tl.load(w_ptr + row)
    tl.store(wloss_ptr + row, w * loss)
    tl.store(glogp_ptr + row, w * dloss)
    tl.store(lse_ptr + row, lse)
    tl.store(ent_ptr + row, ent)
    tl.store(vals_ptr + 0 * N + row, clip_low)
    tl.store(vals_ptr + 1 * N + row, clip_high)
    tl.store(vals_ptr + 2 * N + row, approx_kl)
    tl.store(vals_ptr + 3 * N + row, ratio)
    tl.store(vals_ptr + 4 * N + row, dual)
    tl.store(vals_ptr + 5 * N + row, ent)
    tl.store(vals_ptr + 6 * N + row, kl)


@triton.jit
def _policy_loss_bwd_kernel(
    x_ptr, dx_ptr, labels_ptr, keep_ptr, w_ptr, glogp_ptr, lse_ptr, ent_ptr, grad_out_ptr,
    V, inv_t, ent_coef, HAS_ENT: tl.constexpr, BLOCK_V: tl.constexpr,
):
    # dlogits_j = go · [w ∂ℓ/∂logp (onehot_j − p_j) − w entropy_coef · p_j (log p_j + H)] / T; zeros on masked rows.
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * V
    dx_row = dx_ptr + row * V
    if tl.load(keep_ptr + row) == 0:
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            tl.store(dx_row + cols, tl.zeros([BLOCK_V], dtype=dx_ptr.dtype.element_ty), mask=cols < V)
    else:
        go = tl.load(grad_out_ptr).to(tl.float32)
        label = tl.load(labels_ptr + row)
        lse = tl.load(lse_ptr + row)
        ent = tl.load(ent_ptr + row)
        g_logp = tl.load(glogp_ptr + row) * go
        g_ent = -ent_coef * tl.load(w_ptr + row) * go
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            valid = cols < V
            z = tl.load(x_row + cols, mask=valid, other=0.0).to(tl.float32) * inv_t
            dz = logprob_entropy_grad_tile(z, cols, label, lse, ent, g_logp, g_ent, inv_t, HAS_ENT)
            tl.store(dx_row + cols, dz.to(dx_ptr.dtype.element_ty), mask=valid)


def _block_v(vocab: int, device: torch.device) -> int:
    # GPU: 4096-wide tiles keep registers in check; the interpreter is fastest with few, wide tiles.
    return min(triton.next_power_of_2(vocab), 4096 if device.type == "cuda" else 16384)


def _kl_type_id(config: PolicyLossConfig) -> int:
    return KL_TYPES.index(config.kl_type) + 1


def policy_loss_fwd_triton(x: torch.Tensor, tok: TokenInputs, config: PolicyLossConfig):
    """x [N, V] contiguous logits. Returns (w·ℓ [N], w·∂ℓ/∂logp [N], lse [N], H [N], values [N_METRICS, N])."""
    n, vocab = x.shape
    f32 = dict(dtype=torch.float32, device=x.device)
    wloss, glogp, lse, ent = (torch.zeros(n, **f32) for _ in range(4))
    vals = torch.zeros(N_METRICS, n, **f32)
    if n == 0:
        return wloss, glogp, lse, ent, vals
    dummy = tok.advantages
    c = config
    _policy_loss_fwd_kernel[(n,)](
        x, tok.labels, tok.keep.view(torch.uint8), tok.weight, tok.advantages,
        tok.old if tok.old is not None else dummy,
        tok.ref if tok.ref is not None else dummy,
        tok.rollout if tok.rollout is not None else dummy,
        wloss, glogp, lse, ent, vals,
        n, vocab, 1.0 / c.temperature, c.clip_low, c.clip_high,
        c.clip_ratio_c or 0.0, c.tis_cap or 0.0, c.kl_coef, c.entropy_coef,
        HAS_OLD=tok.old is not None, HAS_REF=tok.ref is not None, HAS_ROLLOUT=tok.rollout is not None,
        HAS_DUAL=c.clip_ratio_c is not None, HAS_CAP=c.tis_cap is not None, KL_TYPE=_kl_type_id(c),
        BLOCK_V=_block_v(vocab, x.device),
    )
    return wloss, glogp, lse, ent, vals


def policy_loss_bwd_triton(x, tok, glogp, lse, ent, grad_out, config, out=None) -> torch.Tensor:
    """dlogits [N, V] in x's dtype (written into `out` when given, which may be x itself)."""
    n, vocab = x.shape
    dx = torch.empty_like(x) if out is None else out
    if n == 0:
        return dx
    _policy_loss_bwd_kernel[(n,)](
        x, dx, tok.labels, tok.keep.view(torch.uint8), tok.weight, glogp, lse, ent,
        grad_out.reshape(()).float().contiguous(),
        vocab, 1.0 / config.temperature, config.entropy_coef,
        HAS_ENT=config.entropy_coef != 0.0, BLOCK_V=_block_v(vocab, x.device),
    )
    return dx


# ---------------------------------------------------------------------------------------------------------
# torch path (CPU production path): chunks of token rows, fp32 math, the shared chunk helpers
# ---------------------------------------------------------------------------------------------------------


def _scaled_rows_(z: torch.Tensor, x: torch.Tensor, rows, inv_t: float) -> torch.Tensor:
    """z [k, V] fp32 <- x[rows] · inv_t: one pass for fp32 x; bf16/fp16 are upcast first (the product in fp32)."""
    if x.dtype == torch.float32:
        return torch.mul(x[rows], inv_t, out=z)
    return z.copy_(x[rows]).mul_(inv_t)


def _row_chunk(vocab: int) -> int:
    return max(1, (1 << 22) // max(vocab, 1))  # ~16 MB of fp32 scratch per chunk


def policy_loss_fwd_torch(x: torch.Tensor, tok: TokenInputs, config: PolicyLossConfig):
    """Same outputs as `policy_loss_fwd_triton`, by chunks of rows through the torch chunk helpers.

    Every row is processed (gathering the kept rows would cost a copy of the logits: this path is memory-bound);
    the per-token terms of masked rows are zeroed by `policy_token_terms`, whatever their logits hold."""
    n, vocab = x.shape
    lse, logp, ent = (torch.zeros(n, dtype=torch.float32, device=x.device) for _ in range(3))
    step = _row_chunk(vocab)
    buf = torch.empty(min(step, n) * vocab, dtype=torch.float32, device=x.device)
    scratch = torch.empty_like(buf) if config.needs_entropy else None
    for a in range(0, n, step):
        b = min(a + step, n)
        z = _scaled_rows_(buf[: (b - a) * vocab].view(b - a, vocab), x, slice(a, b), 1.0 / config.temperature)
        stats = chunk_softmax_stats(z, tok.labels[a:b], with_entropy=config.needs_entropy, scratch=scratch)
        lse[a:b], logp[a:b], ent[a:b] = finalize_softmax_stats(stats)
    loss, dloss, vals = policy_token_terms(logp, ent if config.needs_entropy else None, tok, config)
    return tok.weight * loss, tok.weight * dloss, lse, ent, vals


def policy_loss_bwd_torch(x, tok, glogp, lse, ent, grad_out, config, out=None) -> torch.Tensor:
    n, vocab = x.shape
    dx = torch.empty_like(x) if out is None else out
    inv_t = 1.0 / config.temperature
    go = grad_out.reshape(()).float()
    g_logp_all = glogp * go
    has_ent = config.entropy_coef != 0.0
    g_ent_all = tok.weight * (-config.entropy_coef) * go if has_ent else None
    step = _row_chunk(vocab)
    buf = torch.empty(min(step, n) * vocab, dtype=torch.float32, device=x.device)
    for a in range(0, n, step):
        b = min(a + step, n)
        z = _scaled_rows_(buf[: (b - a) * vocab].view(b - a, vocab), x, slice(a, b), inv_t)
        chunk_logprob_grad_(z, tok.labels[a:b], lse[a:b], ent[a:b] if has_ent else None, g_logp_all[a:b],
                            g_ent_all[a:b] if has_ent else None, inv_t)
        # Masked rows have zero coefficients; zero them exactly (non-finite padding logits give 0 · inf = NaN).
        masked = (~tok.keep[a:b]).nonzero().squeeze(1)  # host sync (torch path); only the masked rows are touched
        if masked.numel():
            z.index_fill_(0, masked, 0.0)
        dx[a:b] = z
    return dx


class _PolicyLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tok, config, backend):
        fwd = policy_loss_fwd_triton if backend == "triton" else policy_loss_fwd_torch
        wloss, glogp, lse, ent, vals = fwd(x, tok, config)
        ctx.save_for_backward(x, glogp, lse, ent)
        ctx.tok, ctx.config, ctx.backend = tok, config, backend
        metric_sums = vals @ tok.metric_weight  # [N_METRICS]
        ctx.mark_non_differentiable(metric_sums)
        return wloss.sum(), metric_sums

    @staticmethod
    def backward(ctx, grad_loss, _grad_metrics):
        x, glogp, lse, ent = ctx.saved_tensors
        bwd = policy_loss_bwd_triton if ctx.backend == "triton" else policy_loss_bwd_torch
        return bwd(x, ctx.tok, glogp, lse, ent, grad_loss, ctx.config), None, None, None


def policy_loss(
    logits: torch.Tensor,
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
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO/PPO policy loss from logits: (scalar loss, {metric name: 0-d device tensor}).

    logits [B, L, V] (rows are sequences) or [T, V] packed with cu_seqlens [S+1]; labels, advantages, mask and
    the optional old/ref/rollout log-probs are shaped like labels ([B, L] or [T]). num_tokens / num_seqs: the
    counts that normalise the loss (default: this call's kept tokens and sequences); pass the global counts of
    the step so that micro-batches and ranks sum to the full-batch loss. Metrics (clip_frac_low, clip_frac_high,
    approx_kl, ratio_mean, and dual_clip_frac / entropy / kl when they apply) are token means over num_tokens.
    """
    if logits.dim() != labels.dim() + 1 or logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits shape {tuple(logits.shape)} must be labels shape {tuple(labels.shape)} + [V]")
    if logits.dtype not in _LOGIT_DTYPES:
        raise ValueError(f"logits dtype {logits.dtype} is not supported; use one of {_LOGIT_DTYPES}")
    if not logits.is_contiguous():
        raise ValueError("logits must be contiguous; call .contiguous() (e.g. after slicing off the last position)")
    vocab = logits.shape[-1]
    tok = prepare_token_inputs(
        labels, advantages, mask, config=config, vocab_size=vocab, old_logprobs=old_logprobs,
        ref_logprobs=ref_logprobs, rollout_logprobs=rollout_logprobs, cu_seqlens=cu_seqlens,
        num_tokens=num_tokens, num_seqs=num_seqs,
    )
    loss, metric_sums = _PolicyLossFunction.apply(logits.view(-1, vocab), tok, config, backend_for(logits))
    return loss, metrics_dict(metric_sums, config, ref_logprobs is not None)
