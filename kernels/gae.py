"""PPO with a value model: per-token GAE advantages and returns, whitening, and the clipped value loss (pure torch).

GAE (Schulman et al. 2016) over the response tokens of each sequence, t = 0 .. T-1:

    δ_t = r_t + γ V_{t'} − V_t            t' = the next *trained* token after t; V_{t'} = 0 when there is none
    A_t = δ_t + γ λ A_{t'}                 (A_{t'} = 0 when there is none: the last trained token is terminal)
    R_t = A_t + V_t                        (the λ-return, the value model's regression target)

Which tokens take part: `mask` [B, T] is 1 on trained response tokens and 0 on environment tokens (a multi-turn
episode's tool outputs inside the response), on prompt tokens and on padding. Positions with mask 0 are skipped,
as verl's multi-turn GAE does: the recursion passes through them unchanged, so the value of the next trained token
bootstraps the previous trained token across a tool output, and γ counts trained tokens, not positions. Their
advantage and return are 0, and their reward and value are never read (a reward placed on an environment token is
ignored: put a sequence's reward on its last trained token). Nothing is read past a sequence's last trained token,
so trailing padding or a trailing tool output cannot leak into it.

Rewards are per token: typically the sequence reward on its last trained token and 0 elsewhere, plus a per-token
KL penalty the caller may add (−β KL_t) before calling.

Shapes and layouts:
    gae(rewards, values, mask)                      padded [B, T]; a reverse loop over T with vectorised ops over B
    gae_packed(rewards, values, mask, cu_seqlens)   packed [N] rows of concatenated sequences (cu_seqlens [S+1],
                                                    int32/int64; tokens past cu_seqlens[-1] are a padding tail);
                                                    unpacks to [S, max_len], runs `gae`, packs back, so the
                                                    recursion never crosses a sequence boundary
    whiten(x, mask)                                 masked (x − mean) / std, optional on the advantages
    masked_mean_std, explained_variance             statistics of a step's tokens (metrics)
    value_loss(values, old_values, returns, mask)   PPO's clipped value loss, any matching shape ([B, T] or [N])

Math runs in float32 whatever the input dtype; the advantages and returns are float32 and carry no gradient (they
are targets). `value_loss` is differentiable w.r.t. `values`. Float64 references written as plain loops:
`gae_reference`, `value_loss_reference` in kernels/reference.py.

Host syncs: `gae` needs none; `gae_packed` reads cu_seqlens on the host (sizes depend on it; the planner builds it
from host lengths, so pass a CPU tensor to make the read free); `value_loss` returns its metrics as 0-d device
tensors.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels.packing import host_lengths, pack, unpack

SumAcross = Callable[[torch.Tensor], torch.Tensor]  # sums a tensor over the processes holding the other tokens

VALUE_LOSS_AGGS = ("token-mean", "seq-mean-token-mean")


def _check_gae_inputs(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float, lam: float,
                      dim: int) -> None:
    layout = "[B, T]" if dim == 2 else "[N]"
    if rewards.dim() != dim:
        raise ValueError(f"rewards must be {layout}, got shape {tuple(rewards.shape)}")
    for name, t in (("values", values), ("mask", mask)):
        if t.shape != rewards.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)} but rewards {tuple(rewards.shape)}; give one entry "
                             f"per token in each")
        if t.device != rewards.device:
            raise ValueError(f"{name} is on {t.device} but rewards on {rewards.device}; use one device")
    for name, t in (("rewards", rewards), ("values", values)):
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a float tensor, got {t.dtype}")
    if not 0.0 <= gamma <= 1.0 or not 0.0 <= lam <= 1.0:
        raise ValueError(f"gamma={gamma} and lam={lam} must lie in [0, 1]")


@torch.no_grad()
def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages [B, T], returns [B, T]) float32 of padded per-token rewards and values [B, T].

    mask [B, T] (bool or numbers; nonzero = a trained token): see the module docstring for the convention on
    environment tokens, padding and the terminal token. Advantages and returns are 0 where mask is 0.
    """
    _check_gae_inputs(rewards, values, mask, gamma=gamma, lam=lam, dim=2)
    B, T = rewards.shape
    r, v, keep = rewards.float(), values.float(), mask.bool()
    advantages = torch.zeros((B, T), dtype=torch.float32, device=rewards.device)
    # The carried state of each row: the value and the advantage of the next trained token (0 past the last one).
    next_value = torch.zeros(B, dtype=torch.float32, device=rewards.device)
    next_adv = torch.zeros_like(next_value)
    for t in reversed(range(T)):  # T = response length; each step is a few ops on [B]
        k = keep[:, t]
        delta = r[:, t] + gamma * next_value - v[:, t]
        adv_t = delta + (gamma * lam) * next_adv
        # where(), not a multiply by the mask: values and rewards off the mask may be anything, even NaN.
        advantages[:, t] = torch.where(k, adv_t, 0.0)
        next_value = torch.where(k, v[:, t], next_value)  # mask 0: pass the next trained token's value through
        next_adv = torch.where(k, adv_t, next_adv)
    returns = torch.where(keep, advantages + v, 0.0)
    return advantages, returns


@torch.no_grad()
def gae_packed(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor, *,
               gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages [N], returns [N]) float32 of a packed row: `gae` on each sequence cu_seqlens[s]:cu_seqlens[s+1].

    rewards, values, mask [N]; cu_seqlens [S+1] int32/int64 starting at 0, every sequence non-empty; tokens past
    cu_seqlens[-1] (a bucketed padding tail) get 0. Implementation: unpack to [S, max_len] (kernels.packing), run
    the padded recursion, pack back, so no sequence's recursion reads another's tokens. A packed row that holds
    whole sequences (prompt and response) works as it is: prompt tokens have mask 0 and are skipped.
    """
    _check_gae_inputs(rewards, values, mask, gamma=gamma, lam=lam, dim=1)
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be a 1-D int32/int64 tensor [S+1], got {tuple(cu_seqlens.shape)} "
                         f"{cu_seqlens.dtype}; build it with kernels.cu_seqlens_from_lengths")
    cu = cu_seqlens.tolist()  # host sync (marked): the padded layout's sizes depend on it
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {cu[:4]}")
    lens = host_lengths([b - a for a, b in zip(cu[:-1], cu[1:])], "cu_seqlens differences (sequence lengths)")
    N = rewards.shape[0]
    if cu[-1] > N:
        raise ValueError(f"cu_seqlens[-1] = {cu[-1]} > {N} tokens in rewards; cu_seqlens does not describe this row")
    if not lens:
        zeros = torch.zeros(N, dtype=torch.float32, device=rewards.device)
        return zeros, zeros.clone()

    def to_padded(x: torch.Tensor) -> torch.Tensor:  # [N] -> [S, max_len], 0 past each length (mask 0 there)
        return unpack(x.contiguous(), lens, fill=0)

    adv, ret = gae(to_padded(rewards.float()), to_padded(values.float()), to_padded(mask.bool()), gamma=gamma,
                   lam=lam)
    return pack(adv, lens, total=N), pack(ret, lens, total=N)


def _masked_moments(x: torch.Tensor, keep: torch.Tensor, sum_across: SumAcross | None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(n, mean, Σ (x − mean)²) over the kept elements, 0-d float32 tensors, two passes (no cancellation).

    sum_across: sums a tensor over the other processes that hold the rest of the elements (called on a [2] and a
    0-d tensor, returns the sum); None: this call's elements are all of them.
    """
    xf = torch.where(keep, x.float(), 0.0)
    n_sum = torch.stack([keep.sum().float(), xf.sum()])  # [2]: one collective for both
    if sum_across is not None:
        n_sum = sum_across(n_sum)
    n, total = n_sum.unbind(0)
    mean = total / n.clamp(min=1.0)
    sq = torch.where(keep, (xf - mean) ** 2, 0.0).sum()
    if sum_across is not None:
        sq = sum_across(sq)
    return n, mean, sq


def masked_mean_std(x: torch.Tensor, mask: torch.Tensor, *,
                    sum_across: SumAcross | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, unbiased std) of x over the tokens where mask is nonzero: 0-d float32 tensors, no host sync.

    sum_across: see `whiten` (the statistics of tokens spread over micro-batches and ranks)."""
    if mask.shape != x.shape:
        raise ValueError(f"mask has shape {tuple(mask.shape)} but x {tuple(x.shape)}; give one entry per element")
    n, mean, sq = _masked_moments(x, mask.bool(), sum_across)
    return mean, (sq / (n - 1.0).clamp(min=1.0)).sqrt()


def whiten(x: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True, eps: float = 1e-8,
           sum_across: SumAcross | None = None) -> torch.Tensor:
    """(x − mean) / sqrt(var + eps) over the tokens where mask is nonzero, 0 elsewhere; float32, any shape.

    mean and the unbiased variance (Bessel's n − 1, as verl's masked_whiten) are over the masked tokens of this
    call: whiten a whole step's advantages at once, not micro-batch by micro-batch. With `sum_across` (a function
    that sums a tensor over the processes holding the rest of the step's tokens, e.g. an all_reduce on the
    trainer's process group) they are over the tokens of every process: each passes its own x and mask, and the
    statistics are global (two collectives). shift_mean=False keeps the mean (scales only). A single masked token
    whitens to 0 (its variance divides by max(n − 1, 1)).
    """
    if mask.shape != x.shape:
        raise ValueError(f"mask has shape {tuple(mask.shape)} but x {tuple(x.shape)}; give one entry per element")
    keep = mask.bool()
    n, mean, sq = _masked_moments(x, keep, sum_across)
    var = sq / (n - 1.0).clamp(min=1.0)
    centered = torch.where(keep, x.float() - mean, 0.0)
    out = centered * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(keep, out, 0.0)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, *,
                       sum_across: SumAcross | None = None) -> torch.Tensor:
    """1 − Var(R − V) / Var(R) over the masked tokens (population variances), a 0-d float32 tensor, no host sync.

    1: the value model predicts the returns exactly; 0: no better than their mean; NaN when the returns do not
    vary (or no token is masked). Compute it on a whole step's tokens: it does not combine across micro-batches
    (concatenate them; `sum_across` as in `whiten` adds the other ranks' tokens).
    """
    keep = mask.bool()
    v, r = values.detach().float(), returns.detach().float()
    n, _, sq_r = _masked_moments(r, keep, sum_across)
    _, _, sq_d = _masked_moments(r - v, keep, sum_across)
    var_r = sq_r / n.clamp(min=1.0)
    return torch.where(var_r > 0, 1.0 - (sq_d / n.clamp(min=1.0)) / var_r, float("nan"))


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, *,
               clip: float | None, agg: str = "token-mean", num_tokens: torch.Tensor | float | None = None,
               num_seqs: torch.Tensor | float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss 0-d, metrics) of PPO's clipped value loss; differentiable w.r.t. `values`.

        ℓ_t = ½ max((V_t − R_t)², (clip(V_t, V_t^old − c, V_t^old + c) − R_t)²)      (c = clip; None: ½ (V_t − R_t)²)

    values, old_values (the value model's predictions when the rollout was scored), returns, mask: one shape,
    [B, T] or packed [N]; math in float32 (a bf16 critic's outputs are upcast). Tokens where mask is 0 contribute
    nothing, whatever values they hold. agg:
        token-mean            Σ_t ℓ_t / num_tokens (default: this call's masked tokens). Pass the step's global
                              count to sum the losses of micro-batches and ranks into the step's token mean.
        seq-mean-token-mean   mean over rows of each row's token mean; [B, T] only (rows are sequences);
                              num_seqs defaults to this call's rows.
    Metrics (detached 0-d tensors, no host sync): critic/value_clip_frac (share of tokens whose clipped branch is
    the larger, i.e. where the clip decides the gradient) and critic/value_mean, both token means over num_tokens,
    so they sum across micro-batches like kernels/objective.py's metrics; critic/explained_variance of this call's
    tokens (`explained_variance`: compute it on the whole step instead when merging micro-batches).
    """
    for name, t in (("old_values", old_values), ("returns", returns), ("mask", mask)):
        if t.shape != values.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)} but values {tuple(values.shape)}; give one entry per "
                             f"token in each")
    if not values.is_floating_point():
        raise ValueError(f"values must be a float tensor, got {values.dtype}")
    if agg not in VALUE_LOSS_AGGS:
        raise ValueError(f"agg={agg!r} is unknown; choose one of {VALUE_LOSS_AGGS}")
    if agg == "seq-mean-token-mean" and values.dim() != 2:
        raise ValueError(f"agg='seq-mean-token-mean' needs [B, T] rows (one sequence per row), got shape "
                         f"{tuple(values.shape)}; use agg='token-mean' for packed [N] inputs")
    if clip is not None and clip <= 0:
        raise ValueError(f"clip={clip} must be > 0, or None for the unclipped loss")
    keep = mask.bool()
    # Off-mask slots are zeroed before any arithmetic: garbage there (NaN at padding) must not reach the gradient.
    v = torch.where(keep, values.float(), 0.0)
    old = torch.where(keep, old_values.float(), 0.0)
    ret = torch.where(keep, returns.float(), 0.0)
    unclipped = (v - ret) ** 2
    if clip is None:
        per_token = 0.5 * unclipped
        clipped_wins = torch.zeros_like(keep)
    else:
        v_clipped = old + (v - old).clamp(-clip, clip)
        clipped = (v_clipped - ret) ** 2
        per_token = 0.5 * torch.maximum(unclipped, clipped)
        clipped_wins = keep & (clipped > unclipped)
    per_token = torch.where(keep, per_token, 0.0)
    w = keep.float()
    # A host number becomes a device scalar by a fill kernel (new_full), not an H2D copy from pageable memory:
    # torch.as_tensor(int, device="cuda") is a synchronizing copy (the H100 run's sync-debug test caught it).
    if num_tokens is None:
        n_tok = w.sum().clamp(min=1.0)
    elif isinstance(num_tokens, torch.Tensor):
        n_tok = num_tokens.to(device=w.device, dtype=torch.float32)
    else:
        n_tok = w.new_full((), float(num_tokens))
    if agg == "token-mean":
        loss = per_token.sum() / n_tok
    else:
        row_tokens = w.sum(-1)
        n_seq = float(values.shape[0]) if num_seqs is None else num_seqs
        loss = (per_token.sum(-1) / row_tokens.clamp(min=1.0)).sum() / n_seq
    metrics = {
        "critic/value_clip_frac": clipped_wins.float().sum() / n_tok,
        "critic/value_mean": v.detach().sum() / n_tok,
        "critic/explained_variance": explained_variance(v, ret, keep),
    }
    return loss, metrics
