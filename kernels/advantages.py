"""Advantage estimators for outcome rewards (pure torch; one value per sample).

    grpo:      A_i = (r_i − mean_g) / (std_g + eps)      scale="std" (GRPO); scale="none": r_i − mean_g (Dr.GRPO)
    rloo:      A_i = r_i − mean_{j ∈ g, j ≠ i} r_j = n/(n−1) · (r_i − mean_g)      (leave-one-out baseline)
    reinforce: A_i = r_i − baseline                       (a constant or per-sample baseline, e.g. a moving mean)

g is the group of sample i (the samples drawn for the same prompt), std_g the unbiased standard deviation.
A group of one sample has no baseline to compare against: its advantage is 0 for grpo and rloo.
Rewards must be finite (a failed sample needs a reward, or must be dropped, before this point).
Per-token advantages for the policy loss: `kernels.packing.broadcast_to_tokens` (packed) or `adv[:, None]` (padded).

The trainer picks an estimator by name from `ADVANTAGE_ESTIMATORS` (`advantage_estimator`), filled by
`@register_estimator` (verl's `register_adv_est` pattern). Each entry declares what the trainer must provide:
`needs_groups` (its baseline is the group's, so a group needs two scored samples), `per_token` (one advantage per
token, computed in the step after packing, instead of one per sample before it) and `needs_critic` (a value model:
the trainer builds the critic component, trains it beside the policy and checkpoints it). A per-sample
estimator's fn is fn(rewards [N], group_ids [N]) -> [N]; "gae", the per-token one, is kernels.gae.gae_packed. A new
estimator is one registered function; the trainer reads only these declarations, never the name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from kernels.gae import gae_packed


@dataclasses.dataclass(frozen=True)
class Estimator:
    """A registered advantage estimator. Per sample: fn(rewards [N] float, group_ids [N] int) -> advantages [N]
    (rewards' dtype). needs_groups: the baseline comes from the sample's group, so a group of one sample has none.
    per_token: fn is the step's per-token function of packed rows (kernels.gae.gae_packed: rewards, values, mask,
    cu_seqlens -> advantages, returns). needs_critic: the run needs a value model ([rl.critic])."""

    fn: Callable[..., torch.Tensor]
    needs_groups: bool
    per_token: bool = False
    needs_critic: bool = False


ADVANTAGE_ESTIMATORS: dict[str, Estimator] = {}  # name -> Estimator, filled by @register_estimator below


def register_estimator(name: str, *, needs_groups: bool, per_token: bool = False,
                       needs_critic: bool = False) -> Callable:
    """Decorator: register fn as the advantage estimator `name`, with what it needs of the trainer (Estimator)."""
    assert not (per_token and needs_groups), "a per-token estimator's baseline is a value, not a group's"

    def add(fn: Callable[..., torch.Tensor]) -> Callable:
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is registered twice; pick another name for the new one")
        ADVANTAGE_ESTIMATORS[name] = Estimator(fn=fn, needs_groups=needs_groups, per_token=per_token,
                                               needs_critic=needs_critic)
        return fn
    return add


def advantage_estimator(name: str) -> Estimator:
    """The registered estimator `name`; a ValueError naming the choices otherwise."""
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"advantage_estimator={name!r} is unknown; choose one of {tuple(ADVANTAGE_ESTIMATORS)}")
    return ADVANTAGE_ESTIMATORS[name]


def _check_rewards(rewards: torch.Tensor, group_ids: torch.Tensor | None = None) -> None:
    if rewards.dim() != 1 or not rewards.is_floating_point():
        raise ValueError(f"rewards must be a 1-D float tensor [N], got shape {tuple(rewards.shape)} {rewards.dtype}")
    if group_ids is not None:
        if group_ids.shape != rewards.shape or group_ids.is_floating_point():
            raise ValueError(f"group_ids must be an integer tensor shaped like rewards {tuple(rewards.shape)}, got "
                             f"shape {tuple(group_ids.shape)} {group_ids.dtype}")
        if group_ids.device != rewards.device:
            raise ValueError(f"group_ids on {group_ids.device} but rewards on {rewards.device}; use one device")
    if not bool(torch.isfinite(rewards).all()):  # host sync: advantages are computed once per step, on [N]
        raise ValueError("rewards contain NaN or inf; give failed samples a reward or drop them first")


def _group_stats(rewards: torch.Tensor, group_ids: torch.Tensor):
    """(group index of each sample [N], count [G], mean [G], unbiased std [G]; std = 0 for groups of one)."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    r = rewards.double()  # sums in float64: exact for the small groups of RL, no catastrophic cancellation
    count = torch.zeros(n_groups, dtype=torch.float64, device=r.device).index_add_(0, inverse, torch.ones_like(r))
    mean = torch.zeros_like(count).index_add_(0, inverse, r) / count
    sq = torch.zeros_like(count).index_add_(0, inverse, (r - mean[inverse]) ** 2)
    std = torch.where(count > 1, (sq / (count - 1).clamp(min=1)).sqrt(), 0.0)
    return inverse, count, mean, std


@register_estimator("grpo", needs_groups=True)
def grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, *, scale: str = "std",
                    eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantages [N]: reward minus its group mean, over the group std when scale="std"."""
    if scale not in ("std", "none"):
        raise ValueError(f"scale={scale!r}: choose 'std' (GRPO) or 'none' (Dr.GRPO, no std normalisation)")
    if eps < 0:
        raise ValueError(f"eps={eps}: must be >= 0")
    _check_rewards(rewards, group_ids)
    inverse, count, mean, std = _group_stats(rewards, group_ids)
    adv = rewards.double() - mean[inverse]
    if scale == "std":
        adv = adv / (std[inverse] + eps)
    adv = torch.where(count[inverse] > 1, adv, 0.0)
    return adv.to(rewards.dtype)


@register_estimator("rloo", needs_groups=True)
def rloo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Leave-one-out advantages [N]: reward minus the mean reward of the other samples of its group."""
    _check_rewards(rewards, group_ids)
    inverse, count, mean, _ = _group_stats(rewards, group_ids)
    n = count[inverse]
    adv = torch.where(n > 1, (rewards.double() - mean[inverse]) * n / (n - 1).clamp(min=1), 0.0)
    return adv.to(rewards.dtype)


def reinforce_advantages(rewards: torch.Tensor, baseline: float | torch.Tensor = 0.0) -> torch.Tensor:
    """REINFORCE with a baseline: reward − baseline ([N]; baseline a number or a tensor broadcastable to [N])."""
    _check_rewards(rewards)
    if isinstance(baseline, torch.Tensor) and baseline.dim() > 0 and baseline.shape != rewards.shape:
        raise ValueError(f"baseline shape {tuple(baseline.shape)}: pass a scalar or one value per reward "
                         f"{tuple(rewards.shape)}")
    return rewards - baseline



@register_estimator("reinforce", needs_groups=False)
def reinforce_batch_mean_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """REINFORCE with the batch's mean reward as the baseline (what the trainer's "reinforce" runs; groups unused)."""
    return reinforce_advantages(rewards, rewards.mean())


# PPO with a value model: GAE over each sequence's tokens from the critic's values (kernels/gae.py), per token.
register_estimator("gae", needs_groups=False, per_token=True, needs_critic=True)(gae_packed)
