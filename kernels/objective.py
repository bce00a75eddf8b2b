"""The RL policy objective: one small torch layer on per-token [N] vectors, shared by every kernel path.

The kernels reduce each token row of logits to (lse, logp, H) (kernels/logprobs.py from logits; the chunked
lm_head drivers from hidden states) and turn per-row coefficients back into logit gradients. Everything specific
to RL lives here, on [N] vectors:

    inputs      logp, H from the kernels; old, ref, rollout (engine) log-probs, advantages A, aggregation weights
                w_t, metric weights m_t / N_tok and the sequence index of each token (`prepare_token_inputs`)
    objective   ppo    ℓ_t = max(−A r, −A clip(r, 1 − clip_low, 1 + clip_high)),  r = exp(clamp(logp − old, ±20))
                       dual clip (c = clip_ratio_c): ℓ_t = min(ℓ_t, −A c) where A < 0
                gspo   the same per sequence i, for each of its tokens: r → s_i = exp(clamp(mean_{t∈i}(logp − old),
                       ±20)), A → A_i = mean_{t∈i} A_t (means over the sequence's kept tokens); the gradient flows
                       through the mean, so every token of a sequence gets s_i / |i| of it
                cispo  ℓ_t = −sg(clip(r, 1 − clip_low, 1 + clip_high)) · A · logp   (the weight is clipped, never
                       the gradient: no token is dropped)
    correction  ρ = exp(clamp(old − rollout, ±20)) (old = logp.detach() on-policy), a constant that multiplies ℓ_t:
                none: 1;  tis: min(ρ, tis_cap);  mis: ρ where 1/tis_cap ≤ ρ ≤ tis_cap, else 0 (token dropped)
    per token   ℓ_t ρ_t + kl_coef KL_t − entropy_coef H_t,   KL_t = k1: logp − ref | k2: ½ (logp − ref)²
                | k3: clamp(e^{ref − logp} − (ref − logp) − 1, −10, 10)
    loss        Σ_t w_t · per-token term (w_t encodes loss_agg and the global counts, see `prepare_token_inputs`)

The kernels' backward needs g_logp = ∂loss/∂logp and g_ent = ∂loss/∂H per token. They come from torch.autograd
on the [N] vectors (`objective_coefficients`), not from hand-derived formulas: the objective is written once,
a new one needs no derivation (GSPO's gradient flows through a per-sequence mean), and the conventions at clamp
and max boundaries are autograd's, exactly those of the float64 reference. The price is a few dozen elementwise
ops on [N] vectors, nothing next to one pass over the [N, V] logits.

ppo and cispo are token-local (ℓ_t depends on token t only): they can be evaluated on any subset of tokens and
the results added, which the chunked lm_head driver uses to produce gradients while a chunk's logits are at hand.
gspo needs all tokens of a sequence at once.

Objectives are registered by name (`register_objective`, verl's `register_policy_loss` pattern) with what the rest of
the code needs to know about them: token locality (the chunked driver's one or two passes), whether the dual clip
applies, and their float64 reference term (kernels/reference.py, which `policy_loss_ref` dispatches to through the
same entry). A new objective is one registered term here plus its reference term there.

The per-token inputs of a call travel as one `LossInputs` (labels, advantages, mask, old / ref / rollout log-probs,
cu_seqlens, the global counts), the same bundle for `policy_loss`, `linear_policy_loss` and the reference; a packed
micro-batch builds it with `MicroBatch.loss_inputs()` (trainer/batching/micro_batches.py).

Metrics are 0-d device tensors (no host sync). Token means over the global num_tokens: clip_frac_low/high
(tokens whose gradient the clip changed: ratio below/above the range with A < 0 / A > 0 for ppo and gspo, any
clipped weight for cispo), approx_kl (E[r − 1 − log r], token ratio), ratio_mean (the objective's ratio: s_i
for gspo), dual_clip_frac, entropy, kl when they apply; with rollout log-probs:
mismatch/logprob_abs_diff_mean, mismatch/logprob_abs_diff_max, mismatch/kl_k3 (engine vs trainer, trainer = old
when given, else logp), and with a correction mismatch/tis_weight_mean, mismatch/tis_clip_frac (tokens truncated
by tis, dropped by mis). Combining across
chunks, micro-batches and ranks (`merge_metrics`): names ending in `_max` by max, `input_errors` by bitwise or,
every other one by sum.

Data-dependent validation never reads a value on the host where that would stall an accelerator: the checks
form the int32 bitmask `input_errors` (0 = fine) that travels with the metrics; `raise_on_input_errors` turns
it into the ValueError once the caller reads its results. On CPU tensors a read is free, so the error is raised
at once (kernels.device.host_sync_is_free).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from kernels import device as _device
from kernels.reference import cispo_term_ref, gspo_term_ref, ppo_term_ref

LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_TYPES = ("k1", "k2", "k3")
ROLLOUT_CORRECTIONS = ("none", "tis", "mis")
IGNORE_INDEX = -100  # a label that is not trained (the Hugging Face / torch cross-entropy convention)
# Bits of the `input_errors` metric and the error each one raises.
INPUT_ERRORS = {
    1: "advantages contain NaN or inf at unmasked tokens; fix the reward or advantage computation (or mask "
       "those tokens)",
    2: "labels out of range [0, vocab_size) at unmasked tokens (use -100 or mask 0 for ignored tokens)",
    4: "cu_seqlens must start at 0, be non-decreasing (increasing offsets) and end at T, the number of tokens",
}
_ADV_BIT, _LABEL_BIT, _CU_BIT = 1, 2, 4
_LOG_RATIO_CLAMP = 20.0  # exp(20) ~ 5e8: a ratio that far out is clipped anyway; no inf downstream
_K3_CLAMP = 10.0


@dataclasses.dataclass(frozen=True)
class Objective:
    """A registered policy objective.

    fn(logp [n], log_ratio [n], tok: TokenInputs, config) -> _PolicyTerm: the per-token term ℓ_t and the values its
        metrics need (log_ratio = clamp(logp − old, ±20), the token's own log-ratio).
    token_local: ℓ_t depends on token t alone, so the objective may run chunk by chunk (else: on all tokens at once).
    dual_clip: the dual clip (clip_ratio_c) applies: ℓ_t is a clipped surrogate with a negative-advantage bound.
    reference: the same term in plain float64 torch (kernels/reference.py), what `policy_loss_ref` runs.
    """

    fn: Callable
    token_local: bool
    dual_clip: bool
    reference: Callable


OBJECTIVES: dict[str, Objective] = {}  # name -> Objective, filled by @register_objective below


def register_objective(name: str, *, token_local: bool, dual_clip: bool, reference: Callable) -> Callable:
    """Decorator: register the per-token term `fn` as the objective `name` (see `Objective` for the fields)."""
    def add(fn: Callable) -> Callable:
        if name in OBJECTIVES:
            raise ValueError(f"objective {name!r} is registered twice; pick another name for the new objective")
        OBJECTIVES[name] = Objective(fn=fn, token_local=token_local, dual_clip=dual_clip, reference=reference)
        return fn
    return add


@dataclasses.dataclass(frozen=True)
class PolicyLossConfig:
    """Options of the policy objective (see the module docstring for the math).

    objective: ppo | gspo (sequence-level ratio) | cispo (clipped, stop-gradient IS weight on logp).
    loss_agg: token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm (needs max_seq_len).
    clip_ratio_c: dual-clip bound (> 1) for negative advantages (ppo, gspo), None = off.
    rollout_correction: none | tis | mis, against the engine's log-probs (rollout_logprobs, then required).
    tis_cap: tis truncates the weight at tis_cap; mis keeps tokens whose weight is in [1/tis_cap, tis_cap].
    log_entropy: compute the `entropy` metric even when entropy_coef is 0.
    """

    objective: str = "ppo"  # ppo | gspo (sequence-level ratio) | cispo (clipped stop-gradient IS weight)
    loss_agg: str = "seq-mean-token-mean"  # token-mean | seq-mean-token-mean (GRPO) | seq-mean-token-sum[-norm]
    clip_low: float = 0.2  # the ratio is clipped below at 1 - clip_low
    clip_high: float = 0.2  # ... and above at 1 + clip_high (DAPO's clip-higher: > clip_low)
    clip_ratio_c: float | None = None  # dual-clip bound (> 1) for negative advantages (ppo, gspo); None = off
    kl_coef: float = 0.0  # weight of the KL to the frozen reference policy (0 = no reference model)
    kl_type: str = "k3"  # the KL estimator: k1 | k2 | k3 (Schulman's)
    entropy_coef: float = 0.0  # entropy bonus weight (subtracted from the loss)
    rollout_correction: str = "none"  # none | tis | mis, against the engine's log-probs (a run file derives it)
    tis_cap: float = 2.0  # tis: weights truncated at this; mis: tokens kept where the weight is in [1/cap, cap]
    max_seq_len: int | None = None  # seq-mean-token-sum-norm's normaliser (a run file: rollout.max_new_tokens)
    log_entropy: bool = False  # compute the `entropy` metric even when entropy_coef is 0

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective={self.objective!r} is unknown; choose one of {tuple(OBJECTIVES)}")
        for name in ("kl_coef", "entropy_coef"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name}={getattr(self, name)!r}: must be a finite number")
        if self.loss_agg not in LOSS_AGGS:
            raise ValueError(f"loss_agg={self.loss_agg!r} is unknown; choose one of {LOSS_AGGS}")
        if self.kl_type not in KL_TYPES:
            raise ValueError(f"kl_type={self.kl_type!r} is unknown; choose one of {KL_TYPES}")
        if self.rollout_correction not in ROLLOUT_CORRECTIONS:
            raise ValueError(f"rollout_correction={self.rollout_correction!r} is unknown; choose one of "
                             f"{ROLLOUT_CORRECTIONS}")
        if self.loss_agg == "seq-mean-token-sum-norm" and (self.max_seq_len is None or self.max_seq_len <= 0):
            raise ValueError("max_seq_len must be a positive int for loss_agg='seq-mean-token-sum-norm' (Dr.GRPO); "
                             "pass the generation length limit")
        if not (0.0 <= self.clip_low < 1.0) or self.clip_high < 0.0:
            raise ValueError(f"clip_low={self.clip_low}, clip_high={self.clip_high}: need 0 <= clip_low < 1 and "
                             "clip_high >= 0")
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c={self.clip_ratio_c}: dual clip needs a value > 1 (or None to disable)")
        if self.clip_ratio_c is not None and not self.objective_spec.dual_clip:
            clipped = tuple(name for name, o in OBJECTIVES.items() if o.dual_clip)
            raise ValueError(f"clip_ratio_c (dual clip) bounds the clipped surrogate loss of {clipped}; "
                             f"objective={self.objective!r} has none (cispo clips its weight instead): set "
                             "clip_ratio_c=None")
        if not isinstance(self.tis_cap, (int, float)) or math.isnan(self.tis_cap) or self.tis_cap < 1.0:
            raise ValueError(f"tis_cap={self.tis_cap!r}: must be a number >= 1 (float('inf') for no truncation)")

    @property
    def needs_entropy(self) -> bool:
        return self.entropy_coef != 0.0 or self.log_entropy

    @property
    def objective_spec(self) -> Objective:
        """The registered entry of `objective` (its term, token locality, dual clip, float64 reference)."""
        return OBJECTIVES[self.objective]

    @property
    def token_local(self) -> bool:
        """True when ℓ_t depends on token t alone, so the objective can be evaluated chunk by chunk."""
        return self.objective_spec.token_local


@dataclasses.dataclass(frozen=True, eq=False)
class LossInputs:
    """The per-token inputs of one policy-loss call (`policy_loss`, `linear_policy_loss`, `policy_loss_ref`).

    labels [B, L] int64 (rows are sequences) or [T] packed; every other tensor has the labels' shape, except
    cu_seqlens [S+1] (packed labels: the sequence offsets, starting at 0 and ending at T).
        labels            next-token ids; IGNORE_INDEX (-100) counts as masked
        advantages        float, per token (a sequence's advantage broadcast to its tokens)
        mask              the loss mask, nonzero = trained
        old_logprobs      log pi_old(label); None = on-policy (old = the current log-probs, detached)
        ref_logprobs      log pi_ref(label) for the KL term and metric; None = no KL
        rollout_logprobs  the engine's log-probs, for the mismatch metrics and the rollout correction
        num_tokens / num_seqs  the counts that normalise the loss (python numbers or 0-d tensors); None: this
                          call's kept tokens and sequences. The step's global counts make the losses of
                          micro-batches and ranks sum to the full batch's.
    A packed micro-batch builds one with `trainer.batching.micro_batches.MicroBatch.loss_inputs()`.
    """

    labels: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    rollout_logprobs: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    num_tokens: int | float | torch.Tensor | None = None
    num_seqs: int | float | torch.Tensor | None = None


@dataclasses.dataclass(frozen=True)
class TokenInputs:
    """Flat per-token inputs [N] of one call, shared by every path.

    labels int64 (0 where not kept or out of range, so they index safely); keep bool; advantages, old, ref,
    rollout fp32 (None when absent; 0 where not kept, so padding garbage never reaches the math); weight: the
    aggregation weight w_t; metric_weight: keep / N_tok; seq_index int64: the sequence of each token, in
    [0, n_seqs) (n_seqs: the local number of sequences, a host int).
    """

    labels: torch.Tensor
    keep: torch.Tensor
    advantages: torch.Tensor
    old: torch.Tensor | None
    ref: torch.Tensor | None
    rollout: torch.Tensor | None
    weight: torch.Tensor
    metric_weight: torch.Tensor
    seq_index: torch.Tensor
    n_seqs: int

    def take(self, rows: slice | torch.Tensor) -> TokenInputs:
        """The same inputs for the tokens `rows` (a slice: views; an index tensor: copies)."""
        def pick(t):
            return None if t is None else t[rows]
        return TokenInputs(pick(self.labels), pick(self.keep), pick(self.advantages), pick(self.old),
                           pick(self.ref), pick(self.rollout), pick(self.weight), pick(self.metric_weight),
                           pick(self.seq_index), self.n_seqs)


# ---------------------------------------------------------------------------------------------------------
# Input checks and per-token aggregation weights
# ---------------------------------------------------------------------------------------------------------


def check_loss_inputs(inputs) -> LossInputs:
    """`inputs`, after checking that it is a LossInputs (the losses take their per-token tensors bundled)."""
    if not isinstance(inputs, LossInputs):
        raise ValueError(f"inputs must be a kernels.LossInputs(labels, advantages, mask, ...), got "
                         f"{type(inputs).__name__}")
    return inputs


def raise_on_input_errors(flags) -> None:
    """Raise the ValueError named by a nonzero `input_errors` bitmask (a 0-d int tensor or an int); 0 passes.

    Reading a CUDA tensor here is a host sync: call it where the step's results are read anyway."""
    bits = int(flags)  # the one host read of the data-dependent validation
    if bits == 0:
        return
    messages = [msg for bit, msg in INPUT_ERRORS.items() if bits & bit]
    unknown = bits & ~sum(INPUT_ERRORS)
    if unknown:
        messages.append(f"unknown input error bits {unknown:#x}")
    raise ValueError("; ".join(messages))


def _as_count(x, name: str, device: torch.device) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        if x.numel() != 1:
            raise ValueError(f"{name} must be a scalar (python number or 0-d tensor), got shape {tuple(x.shape)}")
        # non_blocking: a host count reaches the device without waiting for the queued work.
        return x.reshape(()).to(device=device, dtype=torch.float32, non_blocking=True)
    if not x >= 0:
        raise ValueError(f"{name}={x!r}: must be a non-negative count (the global count of the step)")
    return torch.full((), float(x), dtype=torch.float32, device=device)  # a fill kernel, not a host copy


def _sequence_index(labels: torch.Tensor, cu_seqlens: torch.Tensor | None, config: PolicyLossConfig):
    """(seq_index [N] int64, n_seqs, cu_seqlens error flag or None) from the layout of the labels."""
    shape, device, n = labels.shape, labels.device, labels.numel()
    if labels.dim() == 2:
        if cu_seqlens is not None:
            raise ValueError("cu_seqlens is only for packed [T] labels; padded [B, L] labels use rows as sequences")
        rows = torch.arange(shape[0], device=device)
        return rows.unsqueeze(1).expand(shape).reshape(-1), shape[0], None
    if cu_seqlens is None:
        if config.loss_agg != "token-mean" or not config.token_local:
            needs = (f"loss_agg={config.loss_agg!r}" if config.loss_agg != "token-mean"
                     else f"objective={config.objective!r}")
            raise ValueError(f"{needs} needs sequences: pass cu_seqlens for packed [T] labels (or use [B, L] labels)")
        return torch.zeros(n, dtype=torch.int64, device=device), 1, None
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
        raise ValueError(f"cu_seqlens must be a 1-D integer tensor [S+1], got shape {tuple(cu_seqlens.shape)} "
                         f"and dtype {cu_seqlens.dtype}")
    cu = cu_seqlens.to(device=device, dtype=torch.int64, non_blocking=True)
    bad = (cu[0] != 0) | (cu[-1] != n) | (cu[1:] < cu[:-1]).any()
    n_seqs = cu.numel() - 1
    seq_index = torch.searchsorted(cu[1:], torch.arange(n, device=device), right=True).clamp_(max=n_seqs - 1)
    return seq_index, n_seqs, bad


def prepare_token_inputs(
    inputs: LossInputs, *, config: PolicyLossConfig, vocab_size: int
) -> tuple[TokenInputs, torch.Tensor]:
    """Check the per-token inputs, flatten them to [N] and compute the aggregation weights.

    labels [B, L] (rows are sequences) or [T] packed (sequences from cu_seqlens [S+1]); every other per-token
    tensor has the labels' shape. Returns (inputs, input_errors: 0-d int32 bitmask on the labels' device).
    Host-known problems (shapes, devices, dtypes, options) raise ValueError naming the argument; data-dependent
    ones set bits of input_errors, raised at once on CPU. Aggregation weights, so that loss = Σ_t w_t ℓ_t:
        token-mean (DAPO)                 w_t = m_t / N_tok
        seq-mean-token-mean (GRPO)        w_t = m_t / (len_s · N_seq),  len_s = Σ_{t∈s} m_t
        seq-mean-token-sum                w_t = m_t / N_seq
        seq-mean-token-sum-norm (Dr.GRPO) w_t = m_t / (N_seq · max_seq_len)
    With the step's global num_tokens / num_seqs, micro-batches and ranks add up to the full batch.
    """
    if not isinstance(config, PolicyLossConfig):
        raise ValueError(f"config must be a PolicyLossConfig, got {type(config).__name__}")
    labels, advantages, mask = check_loss_inputs(inputs).labels, inputs.advantages, inputs.mask
    old_logprobs, ref_logprobs, rollout_logprobs = inputs.old_logprobs, inputs.ref_logprobs, inputs.rollout_logprobs
    cu_seqlens, num_tokens, num_seqs = inputs.cu_seqlens, inputs.num_tokens, inputs.num_seqs
    if labels.dim() not in (1, 2):
        raise ValueError(f"labels must be [B, L] (padded rows) or [T] (packed), got shape {tuple(labels.shape)}")
    if labels.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"labels must be int64 (or int32) token ids, got {labels.dtype}")
    shape, device = labels.shape, labels.device
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
    if config.rollout_correction != "none" and rollout_logprobs is None:
        raise ValueError(f"rollout_correction={config.rollout_correction!r} needs rollout_logprobs (the engine's "
                         "log-probs of the sampled tokens); pass them or set rollout_correction='none'")
    if not advantages.is_floating_point():
        raise ValueError(f"advantages must be a float tensor, got {advantages.dtype}")

    flat_labels = labels.reshape(-1).long()
    keep = (mask.reshape(-1) != 0) & (flat_labels != IGNORE_INDEX)
    in_range = (flat_labels >= 0) & (flat_labels < vocab_size)
    adv = advantages.reshape(-1).float()
    seq_index, n_local_seqs, cu_bad = _sequence_index(labels, cu_seqlens, config)
    # One int32 bitmask of every data-dependent check; no host read on an accelerator.
    errors = ((~torch.isfinite(adv) & keep).any().int() * _ADV_BIT
              + (~in_range & keep).any().int() * _LABEL_BIT)
    if cu_bad is not None:
        errors = errors + cu_bad.int() * _CU_BIT
    errors = errors.to(torch.int32)
    if _device.host_sync_is_free(labels):
        raise_on_input_errors(errors)

    keep_f = keep.float()
    seq_lens = torch.zeros(n_local_seqs, device=device).index_add_(0, seq_index, keep_f)
    n_tok = (keep_f.sum() if num_tokens is None else _as_count(num_tokens, "num_tokens", device)).clamp(min=1.0)
    n_seq = float(n_local_seqs) if num_seqs is None else _as_count(num_seqs, "num_seqs", device)
    if config.loss_agg == "token-mean":
        weight = keep_f / n_tok
    elif config.loss_agg == "seq-mean-token-mean":
        weight = keep_f / (seq_lens.clamp(min=1.0)[seq_index] * n_seq)
    elif config.loss_agg == "seq-mean-token-sum":
        weight = keep_f / n_seq
    else:
        weight = keep_f / (n_seq * float(config.max_seq_len))

    def flat(t):  # 0 off the mask: garbage at padding (even NaN) must not reach the math or its gradient
        return None if t is None else torch.where(keep, t.reshape(-1).float(), 0.0)

    tok = TokenInputs(
        labels=torch.where(keep & in_range, flat_labels, 0),
        keep=keep,
        advantages=flat(adv),
        old=flat(old_logprobs),
        ref=flat(ref_logprobs),
        rollout=flat(rollout_logprobs),
        weight=weight.contiguous(),
        metric_weight=(keep_f / n_tok).contiguous(),
        seq_index=seq_index,
        n_seqs=n_local_seqs,
    )
    return tok, errors


# ---------------------------------------------------------------------------------------------------------
# The objectives: per-token policy-gradient term ℓ_t and the values its metrics need
# ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _PolicyTerm:
    loss: torch.Tensor  # ℓ_t [n], differentiable w.r.t. logp
    ratio: torch.Tensor  # the objective's ratio per token (r_t, or s_i of the token's sequence) [n]
    clipped_low: torch.Tensor  # bool [n]: the clip (lower bound) changed this token's gradient
    clipped_high: torch.Tensor  # bool [n]
    dual: torch.Tensor | None  # bool [n]: the dual clip bound applies (None without dual clip)


def _clipped_surrogate(ratio, adv, c: PolicyLossConfig) -> _PolicyTerm:
    """max(−A r, −A clip(r)) and the dual clip, shared by ppo (token ratio) and gspo (sequence ratio)."""
    lo, hi = 1.0 - c.clip_low, 1.0 + c.clip_high
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(lo, hi))
    dual = None
    if c.clip_ratio_c is not None:
        dual = (adv < 0) & (-adv * c.clip_ratio_c < pg)
        pg = torch.where(adv < 0, torch.minimum(pg, -adv * c.clip_ratio_c), pg)
    r = ratio.detach()
    return _PolicyTerm(pg, r, (r < lo) & (adv < 0), (r > hi) & (adv > 0), dual)


@register_objective("ppo", token_local=True, dual_clip=True, reference=ppo_term_ref)
def _ppo(logp, log_ratio, tok, c) -> _PolicyTerm:
    return _clipped_surrogate(torch.exp(log_ratio), tok.advantages, c)


@register_objective("gspo", token_local=False, dual_clip=True, reference=gspo_term_ref)
def _gspo(logp, log_ratio, tok, c) -> _PolicyTerm:
    # Sequence means over the kept tokens, by segment sums over seq_index; every token gets its sequence's value.
    keep_f = tok.keep.float()
    zeros = torch.zeros(tok.n_seqs, dtype=logp.dtype, device=logp.device)
    count = zeros.index_add(0, tok.seq_index, keep_f).clamp(min=1.0)
    delta = logp - tok.old if tok.old is not None else logp - logp.detach()
    mean_delta = zeros.index_add(0, tok.seq_index, delta * keep_f) / count
    seq_ratio = torch.exp(mean_delta.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))[tok.seq_index]
    seq_adv = (zeros.index_add(0, tok.seq_index, tok.advantages * keep_f) / count)[tok.seq_index]
    return _clipped_surrogate(seq_ratio, seq_adv, c)


@register_objective("cispo", token_local=True, dual_clip=False, reference=cispo_term_ref)
def _cispo(logp, log_ratio, tok, c) -> _PolicyTerm:
    lo, hi = 1.0 - c.clip_low, 1.0 + c.clip_high
    r = torch.exp(log_ratio).detach()
    return _PolicyTerm(-r.clamp(lo, hi) * tok.advantages * logp, r, r < lo, r > hi, None)


def _kl(logp, ref, kl_type: str) -> torch.Tensor:
    diff = logp - ref
    if kl_type == "k1":
        return diff
    if kl_type == "k2":
        return 0.5 * diff * diff
    return (torch.exp(-diff) + diff - 1.0).clamp(-_K3_CLAMP, _K3_CLAMP)


# ---------------------------------------------------------------------------------------------------------
# The layer: loss and metrics (differentiable), coefficients for the kernels, metric merging
# ---------------------------------------------------------------------------------------------------------


def policy_objective(
    logp: torch.Tensor, entropy: torch.Tensor | None, tok: TokenInputs, config: PolicyLossConfig
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, metrics) of fp32 logp / entropy [n] (0 where not kept) for the tokens of `tok`.

    The loss is differentiable w.r.t. logp and entropy (entropy may be None unless entropy_coef != 0); metrics
    are detached 0-d tensors (see the module docstring for names and how they combine)."""
    c = config
    if c.entropy_coef != 0.0 and entropy is None:
        raise ValueError("entropy_coef != 0 needs the per-token entropy")
    mw = tok.metric_weight
    delta = logp - tok.old if tok.old is not None else logp - logp.detach()
    log_ratio = delta.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    term = c.objective_spec.fn(logp, log_ratio, tok, c)
    per_token = term.loss
    metrics = {}
    if tok.rollout is not None:
        trainer = tok.old if tok.old is not None else logp.detach()
        log_rho = (trainer - tok.rollout).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)  # log(trainer / engine)
        rho = torch.exp(log_rho)
        abs_diff = (trainer - tok.rollout).abs()
        metrics["mismatch/logprob_abs_diff_mean"] = (mw * abs_diff).sum()
        metrics["mismatch/logprob_abs_diff_max"] = _masked_max(abs_diff, tok.keep)
        metrics["mismatch/kl_k3"] = (mw * (rho - 1.0 - log_rho)).sum()  # k3 estimate of KL(engine ‖ trainer)
        if c.rollout_correction == "tis":
            weight, cut = rho.clamp(max=c.tis_cap), rho > c.tis_cap
        elif c.rollout_correction == "mis":
            cut = (rho < 1.0 / c.tis_cap) | (rho > c.tis_cap)
            weight = torch.where(cut, 0.0, rho)
        if c.rollout_correction != "none":
            per_token = per_token * weight
            metrics["mismatch/tis_weight_mean"] = (mw * weight).sum()
            metrics["mismatch/tis_clip_frac"] = (mw * cut.float()).sum()
    kl = None
    if tok.ref is not None:
        kl = _kl(logp, tok.ref, c.kl_type)
        if c.kl_coef != 0.0:
            per_token = per_token + c.kl_coef * kl
    if c.entropy_coef != 0.0:
        per_token = per_token - c.entropy_coef * entropy
    loss = (tok.weight * per_token).sum()

    ratio = torch.exp(log_ratio.detach())
    metrics.update({
        "clip_frac_low": (mw * term.clipped_low.float()).sum(),
        "clip_frac_high": (mw * term.clipped_high.float()).sum(),
        "approx_kl": (mw * (ratio - 1.0 - log_ratio.detach())).sum(),
        "ratio_mean": (mw * term.ratio).sum(),
    })
    if term.dual is not None:
        metrics["dual_clip_frac"] = (mw * term.dual.float()).sum()
    if c.needs_entropy and entropy is not None:
        metrics["entropy"] = (mw * entropy.detach()).sum()
    if kl is not None:
        metrics["kl"] = (mw * kl.detach()).sum()
    return loss, {k: v.detach() for k, v in metrics.items()}


def _masked_max(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """max of x over the kept tokens (0 when none is kept); no host sync."""
    if x.numel() == 0:
        return x.new_zeros(())
    return torch.where(keep, x, 0.0).amax()


@dataclasses.dataclass(frozen=True)
class ObjectiveResult:
    """The objective at given (logp, entropy): loss (detached 0-d), g_logp = ∂loss/∂logp [n],
    g_ent = ∂loss/∂H [n] or None (no entropy term), metrics."""

    loss: torch.Tensor
    g_logp: torch.Tensor | None
    g_ent: torch.Tensor | None
    metrics: dict[str, torch.Tensor]


def objective_coefficients(
    logp: torch.Tensor, entropy: torch.Tensor | None, tok: TokenInputs, config: PolicyLossConfig,
    *, need_grad: bool = True,
) -> ObjectiveResult:
    """The loss, metrics and the per-row coefficients (g_logp, g_ent) for the kernels' backward, by autograd on
    the [n] vectors. Without `need_grad` only the loss and metrics are computed."""
    with torch.enable_grad():
        lp = logp.detach().requires_grad_(need_grad)
        ent_term = need_grad and config.entropy_coef != 0.0
        ent = None if entropy is None else entropy.detach().requires_grad_(ent_term)
        loss, metrics = policy_objective(lp, ent, tok, config)
        if not need_grad:
            return ObjectiveResult(loss.detach(), None, None, metrics)
        inputs = [lp, ent] if ent_term else [lp]
        grads = torch.autograd.grad(loss, inputs, allow_unused=True)
    grads = [torch.zeros_like(x) if g is None else g for g, x in zip(grads, inputs)]
    return ObjectiveResult(loss.detach(), grads[0], grads[1] if ent_term else None, metrics)


def merge_metrics(a: dict[str, torch.Tensor] | None, b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Combine the metrics of two disjoint sets of tokens: `_max` names by max, `input_errors` by bitwise or,
    every other name by sum (each is already normalised by the global counts)."""
    if a is None:
        return dict(b)
    out = {}
    for name, value in b.items():
        if name.endswith("_max"):
            out[name] = torch.maximum(a[name], value)
        elif name == "input_errors":
            out[name] = torch.bitwise_or(a[name], value)
        else:
            out[name] = a[name] + value
    return out


__all__ = [
    "OBJECTIVES", "Objective", "register_objective", "LOSS_AGGS", "KL_TYPES", "ROLLOUT_CORRECTIONS", "INPUT_ERRORS",
    "IGNORE_INDEX", "PolicyLossConfig", "LossInputs", "check_loss_inputs", "TokenInputs", "prepare_token_inputs",
    "raise_on_input_errors", "policy_objective", "objective_coefficients", "ObjectiveResult", "merge_metrics",
]
