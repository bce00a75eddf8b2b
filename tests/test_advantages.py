"""Advantage estimators against plain-Python loops over groups (statistics module, float64)."""

import statistics

import pytest
import torch

from kernels import grpo_advantages, reinforce_advantages, rloo_advantages


def random_groups(seed, n_groups=6, max_size=5):
    """Shuffled samples of groups with arbitrary (non-contiguous) ids; sizes 1..max_size (1 = a singleton)."""
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, max_size + 1, (n_groups,), generator=g)
    sizes[0] = 1
    ids = torch.repeat_interleave(torch.randperm(1000, generator=g)[:n_groups], sizes)
    perm = torch.randperm(ids.numel(), generator=g)
    rewards = torch.randn(ids.numel(), generator=g) * 2 + 0.5
    rewards[:3] = torch.round(rewards[:3])  # some ties, as with 0/1 rewards
    return rewards[perm], ids[perm]


def loop_reference(rewards, ids, kind, eps=1e-6):
    r, ids = rewards.double().tolist(), ids.tolist()
    out = []
    for i, (ri, gi) in enumerate(zip(r, ids)):
        group = [rj for rj, gj in zip(r, ids) if gj == gi]
        if len(group) == 1:
            out.append(0.0)
        elif kind == "grpo-std":
            out.append((ri - statistics.mean(group)) / (statistics.stdev(group) + eps))
        elif kind == "grpo-none":
            out.append(ri - statistics.mean(group))
        else:  # rloo: the mean of the others
            others = [rj for j, (rj, gj) in enumerate(zip(r, ids)) if gj == gi and j != i]
            out.append(ri - statistics.mean(others))
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_grpo_std_and_none(seed):
    rewards, ids = random_groups(seed)
    adv = grpo_advantages(rewards, ids)
    assert adv.dtype == rewards.dtype and adv.shape == rewards.shape
    torch.testing.assert_close(adv.double(), loop_reference(rewards, ids, "grpo-std"), rtol=1e-5, atol=1e-6)
    adv_none = grpo_advantages(rewards.double(), ids, scale="none")
    torch.testing.assert_close(adv_none, loop_reference(rewards, ids, "grpo-none"), rtol=1e-12, atol=1e-12)


def test_grpo_eps_and_constant_group():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 2.0])
    ids = torch.tensor([7, 7, 7, 3, 3])
    adv = grpo_advantages(rewards, ids, eps=0.5)
    # a constant group has no signal (0/eps = 0); the other: ±1 / (sqrt(2) + 0.5)
    expected = torch.tensor([0.0, 0.0, 0.0, -1 / (2**0.5 + 0.5), 1 / (2**0.5 + 0.5)])
    torch.testing.assert_close(adv, expected)


@pytest.mark.parametrize("seed", [3, 4])
def test_rloo(seed):
    rewards, ids = random_groups(seed)
    adv = rloo_advantages(rewards, ids)
    torch.testing.assert_close(adv.double(), loop_reference(rewards, ids, "rloo"), rtol=1e-5, atol=1e-6)


def test_reinforce_baseline():
    g = torch.Generator().manual_seed(5)
    rewards = torch.randn(9, generator=g)
    baseline = torch.randn(9, generator=g)
    torch.testing.assert_close(reinforce_advantages(rewards, 0.25), rewards - 0.25)
    torch.testing.assert_close(reinforce_advantages(rewards, baseline), rewards - baseline)
    torch.testing.assert_close(reinforce_advantages(rewards), rewards)


def test_bad_inputs():
    rewards, ids = torch.tensor([1.0, float("nan")]), torch.tensor([0, 0])
    with pytest.raises(ValueError, match="rewards"):
        grpo_advantages(rewards, ids)
    with pytest.raises(ValueError, match="rewards"):
        rloo_advantages(torch.tensor([1.0, float("inf")]), ids)
    with pytest.raises(ValueError, match="group_ids"):
        grpo_advantages(torch.ones(3), ids)
    with pytest.raises(ValueError, match="group_ids"):
        grpo_advantages(torch.ones(2), ids.float())
    with pytest.raises(ValueError, match="scale"):
        grpo_advantages(torch.ones(2), ids, scale="mad")
    with pytest.raises(ValueError, match="rewards"):
        grpo_advantages(torch.ones(2, 1), ids)
    with pytest.raises(ValueError, match="baseline"):
        reinforce_advantages(torch.ones(3), torch.ones(2))


def test_registry_names_each_estimator_and_whether_it_needs_groups():
    # The trainer picks estimators by name from this table (config validation, compute_advantages, and the
    # samples left out of the loss for lack of a group baseline): no other list of names exists.
    from kernels.advantages import ADVANTAGE_ESTIMATORS, advantage_estimator, register_estimator

    assert {name: (e.needs_groups, e.per_token, e.needs_critic) for name, e in ADVANTAGE_ESTIMATORS.items()} == \
        {"grpo": (True, False, False), "rloo": (True, False, False), "reinforce": (False, False, False),
         "gae": (False, True, True)}
    from kernels.gae import gae_packed

    assert advantage_estimator("gae").fn is gae_packed
    rewards, ids = random_groups(7)
    assert torch.equal(advantage_estimator("grpo").fn(rewards, ids), grpo_advantages(rewards, ids))
    assert torch.equal(advantage_estimator("rloo").fn(rewards, ids), rloo_advantages(rewards, ids))
    # reinforce: the batch's mean reward as the baseline; groups play no part
    assert torch.equal(advantage_estimator("reinforce").fn(rewards, ids), rewards - rewards.mean())
    with pytest.raises(ValueError, match="advantage_estimator='ppo' is unknown; choose one of"):
        advantage_estimator("ppo")
    with pytest.raises(ValueError, match="registered twice"):
        register_estimator("grpo", needs_groups=True)(rloo_advantages)
    assert ADVANTAGE_ESTIMATORS["grpo"].fn is grpo_advantages
