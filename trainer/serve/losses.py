"""Tinker's built-in losses, per datum: fn(logp [T], inputs {name: [T] float32}, config) -> (loss, outputs).

logp is the trainer's log pi(target_tokens[t]) [T] with autograd. Tinker's definitions, followed here where they
differ from this project's objectives (kernels/objective.py):
- Every loss is a SUM over tokens and datums (Tinker's "loss:sum"), never a token mean: the caller scales
  advantages / weights. The project's objectives aggregate (token-mean, sequence-mean) and normalise by the step.
- No mask: a token counts through its weight (cross_entropy) or its advantage (RL losses); a prompt token has
  advantage 0. The project's objectives take an explicit loss_mask.
- importance_sampling is the unclipped ratio x advantage (the project has no unclipped objective); ppo clips the
  ratio to [clip_low_threshold, clip_high_threshold] (defaults 0.8, 1.2: absolute bounds, where the project's
  ppo takes eps_low / eps_high around 1) with no dual clip and no KL or entropy term.
- cispo: -sg(clip(ratio, low, high)) x logp x A (the project's cispo clips only above).
- dro: -(logp x A - beta / 2 x (logp - sampling_logp)^2) (the project has no dro).
- gspo: the sequence's ratio exp(mean_t(logp - sampling_logp)) over the tokens of `sequence_ratio_mask` (every
  token without one), per token sg(s) x pi / sg(pi), clipped as ppo (defaults 1 -+ 3e-4 / 4e-4, GSPO's paper);
  the project's gspo uses its own loss_mask and eps.
Per-datum thresholds may come as loss inputs (clip_low_threshold / clip_high_threshold [T]), as in Tinker's Datum.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

LossFn = Callable[[torch.Tensor, dict[str, torch.Tensor], dict], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def _need(inputs: dict[str, torch.Tensor], loss: str, *names: str) -> list[torch.Tensor]:
    missing = [n for n in names if n not in inputs]
    if missing:
        raise ValueError(f"loss_fn {loss!r} needs loss_fn_inputs {list(names)}; missing {missing}")
    return [inputs[n] for n in names]


def _bounds(inputs: dict, config: dict, low: float, high: float) -> tuple:
    lo = inputs.get("clip_low_threshold", config.get("clip_low_threshold", low))
    hi = inputs.get("clip_high_threshold", config.get("clip_high_threshold", high))
    return lo, hi


def cross_entropy(logp, inputs, config):
    weights = inputs.get("weights", torch.ones_like(logp))
    elementwise = -logp * weights
    return elementwise.sum(), {"elementwise_loss": elementwise}


def importance_sampling(logp, inputs, config):
    old, adv = _need(inputs, "importance_sampling", "logprobs", "advantages")
    return -(torch.exp(logp - old) * adv).sum(), {}


def ppo(logp, inputs, config):
    old, adv = _need(inputs, "ppo", "logprobs", "advantages")
    lo, hi = _bounds(inputs, config, 0.8, 1.2)
    ratio = torch.exp(logp - old)
    return -torch.minimum(ratio * adv, torch.clamp(ratio, lo, hi) * adv).sum(), {}


def cispo(logp, inputs, config):
    old, adv = _need(inputs, "cispo", "logprobs", "advantages")
    lo, hi = _bounds(inputs, config, 0.8, 1.2)
    ratio = torch.clamp(torch.exp(logp - old), lo, hi).detach()
    return -(ratio * logp * adv).sum(), {}


def dro(logp, inputs, config):
    old, adv = _need(inputs, "dro", "logprobs", "advantages")
    beta = float(config.get("beta", 0.05))
    return -(logp * adv - 0.5 * beta * (logp - old) ** 2).sum(), {}


def gspo(logp, inputs, config):
    old, adv = _need(inputs, "gspo", "logprobs", "advantages")
    mask = inputs.get("sequence_ratio_mask", torch.ones_like(logp))
    lo, hi = _bounds(inputs, config, 1 - 3e-4, 1 + 4e-4)
    seq = torch.exp(((logp - old) * mask).sum() / mask.sum().clamp(min=1))
    ratio = seq.detach() * torch.exp(logp - logp.detach())  # value sg(s), gradient s x d logp
    return -(torch.minimum(ratio * adv, torch.clamp(ratio, lo, hi) * adv) * mask).sum(), {}


LOSSES: dict[str, LossFn] = {"cross_entropy": cross_entropy, "importance_sampling": importance_sampling,
                             "ppo": ppo, "cispo": cispo, "dro": dro, "gspo": gspo}
