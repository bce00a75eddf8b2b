"""PPO with a value model ([rl] advantage_estimator = "gae"): the critic, and the step's per-token GAE targets.

One step (trainer.rl.train_on_batch):

    critic = build_critic(policy, tcfg)                    # once: kind "model" -> its own TrainingComponents
    rewards = [token_rewards(mb, sample_rewards) for mb in mbs]   # host preparation
    values = compute_values(critic or policy, mbs)         # trainer.backend.steps: [L] per micro-batch, no grad
    mbs, stats = attach_gae(mbs, values, rewards, ...)     # advantages, old values, returns per token
    forward_backward(policy, mbs) -> optim_step(policy)    # the policy loss on per-token advantages
    forward_backward(critic, mbs) -> optim_step(critic)    # the clipped value loss (kind "head": inside the
                                                           # policy's loss, value_loss_coef x)

The reward of a sample sits on its last trained token (its last loss-mask 1 position) and every other token's
reward is 0: no KL in the reward (the KL to the reference stays in the policy loss, [rl.loss] kl_coef). GAE runs
per sample over its loss rows (`kernels.gae.gae_packed` on the micro-batch's `segments`, the per-sample offsets of
both the plain and the shared-prompt layout), so the recursion never crosses from one packed sequence into the
next, and loss-mask-0 rows (prompt positions, a multi-turn episode's environment tokens, padding) are skipped:
they get advantage 0 and return 0, and the value of the next trained token bootstraps the previous one across a
tool output. The last trained token bootstraps from 0 (a truncated sample too). Returns are the λ-returns A + V of
the values before the update; advantages are whitened (optional) over the step's trained tokens on every rank
(global statistics: two all_reduce sums), after the returns are taken.

Nothing here reads a device value on the host (tests/test_sync_free.py): the rewards are placed from host data
before the step's device work, `gae_packed` reads only the host `segments`, the statistics stay 0-d device tensors
until the step's futures are read. The recursion is a loop over the longest response with a few [S] ops per
token: cheap next to a forward on these lengths, launch-bound for responses of thousands of tokens (a fused scan
kernel would be the next step there).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from kernels.gae import SumAcross, explained_variance, gae_packed, masked_mean_std, whiten
from kernels.packing import host_to_device
from trainer.backend.steps import TrainerConfig, TrainingComponents, build_components
from trainer.batching.micro_batches import MicroBatch


def build_critic(policy: TrainingComponents, tcfg: TrainerConfig) -> TrainingComponents | None:
    """The separate critic of a "gae" phase with [rl.critic] kind = "model" (None for any other phase).

    Its trunk starts from [rl.critic] path when given, else from the policy's weights as they are now (the start
    of RL: after SFT in a demo run); a fresh value head either way. Built on the policy's mesh by the same
    build_components (FSDP2, compiled when the policy is), with the optimiser [rl.critic.optim] and the policy's
    schedule length. The lm_head stays in the module (it is the architecture's) but is frozen: the value loss never
    reads it, and a frozen parameter has no optimiser state (a checkpoint's optimiser state then matches a fresh
    critic's, whose state torch.distributed.checkpoint initialises for every trainable parameter). A tied lm_head is
    the input embedding, which trains.
    """
    config = tcfg.critic
    if config is None or config.kind != "model":
        return None
    critic = build_components(config.path or policy.root, tcfg.for_critic(), mesh=policy.mesh)
    head = critic.model.get_output_embeddings().weight
    if head is not critic.model.get_input_embeddings().weight:
        head.requires_grad_(False)
    return critic


def sum_across_ranks(components: TrainingComponents) -> SumAcross | None:
    """A function that sums a tensor over the trainer's ranks (an all_reduce on its process group), for
    statistics over the step's tokens of every rank; None on one rank."""
    if components.world_size == 1:
        return None
    group = components.mesh.get_group()

    def total(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()  # all_reduce works in place; the caller's tensor stays its own
        dist.all_reduce(t, group=group)
        return t

    return total


def token_rewards(mb: MicroBatch, rewards: Sequence[float]) -> torch.Tensor:
    """[L] float32 host tensor: each sample's reward on its last trained loss row, 0 elsewhere (host preparation,
    from the micro-batch as the planner built it, before it reaches the device).

    rewards: one per sample of the step (indexed by mb.sample_index). The micro-batch's host tensors give the
    layout: sample k of the row owns loss rows segments[k]:segments[k+1] (plain or shared-prompt layout alike).
    A sample without a trained token gets no reward (and no advantage).
    """
    assert mb.loss_mask.device.type == "cpu" and mb.segments is not None, "token_rewards reads the host micro-batch"
    mask, cu = mb.loss_mask.tolist(), mb.segments.tolist()  # host tensors: free
    out = [0.0] * len(mask)
    for k, i in enumerate(mb.sample_index):
        last = max((t for t in range(cu[k], cu[k + 1]) if mask[t]), default=None)
        if last is not None:
            out[last] = float(rewards[i])
    return torch.tensor(out, dtype=torch.float32)


def attach_gae(micro_batches: Sequence[MicroBatch], values: Sequence[torch.Tensor], rewards: Sequence[torch.Tensor], *,
               gamma: float, lam: float, whiten_advantages: bool, sum_across: SumAcross | None = None,
               estimator: Callable[..., tuple[torch.Tensor, torch.Tensor]] = gae_packed,
               ) -> tuple[list[MicroBatch], dict[str, torch.Tensor]]:
    """The micro-batches with per-token advantages, old values and returns, and the step's statistics.

    micro_batches: this rank's host micro-batches (trainer.batching); values: compute_values' [L] per
    micro-batch (on the device); rewards: `token_rewards` of each micro-batch (host). sum_across
    (`sum_across_ranks`) makes the whitening and the statistics span every rank's tokens. estimator: the per-token
    estimator's function from the registry (kernels.advantages: rewards, values, mask, cu_seqlens, gamma, lam ->
    advantages, returns), gae_packed for "gae".

    Returns (micro-batches whose advantages, old_values and returns are device tensors, {critic/explained_variance,
    critic/returns_mean, critic/advantages_mean, critic/advantages_std}: 0-d device tensors over the step's trained
    tokens; the advantages' before whitening, the explained variance of the values before the update).
    """
    assert len(values) == len(micro_batches) == len(rewards), "one values and one rewards tensor per micro-batch"
    advs, rets, masks = [], [], []
    for mb, v, r in zip(micro_batches, values, rewards):
        dev = v.device
        mask = host_to_device(mb.loss_mask, dev)  # pinned: a non_blocking copy from pageable memory still syncs
        # segments stays on the host: gae_packed reads the sequence lengths from it
        adv, ret = estimator(host_to_device(r, dev), v, mask, mb.segments, gamma=gamma, lam=lam)
        advs.append(adv)
        rets.append(ret)
        masks.append(mask)
    # Whole-step statistics: the micro-batches concatenated, the other ranks' tokens added by sum_across.
    all_adv, all_ret, all_mask, all_v = torch.cat(advs), torch.cat(rets), torch.cat(masks), torch.cat(list(values))
    adv_mean, adv_std = masked_mean_std(all_adv, all_mask, sum_across=sum_across)
    ret_mean, _ = masked_mean_std(all_ret, all_mask, sum_across=sum_across)
    stats = {"critic/explained_variance": explained_variance(all_v, all_ret, all_mask, sum_across=sum_across),
             "critic/returns_mean": ret_mean, "critic/advantages_mean": adv_mean, "critic/advantages_std": adv_std}
    if whiten_advantages:
        advs = list(whiten(all_adv, all_mask, sum_across=sum_across).split([a.shape[0] for a in advs]))
    out = [dataclasses.replace(mb, advantages=a, old_values=v.detach().float(), returns=r)
           for mb, a, v, r in zip(micro_batches, advs, values, rets)]
    return out, stats
