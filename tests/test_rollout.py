"""Pure rollout functions: dynamic filters, transforms, batch conversion and statistics."""

import dataclasses
import json
import random
import statistics

import pytest

from trainer.rollout.samples import (
    FILTERS,
    apply_sample_transforms,
    build_batch_metadata,
    check_min_reward,
    check_quality_and_diversity,
    check_reasonable_length,
    check_response_diversity,
    check_reward_nonzero_std,
    compute_response_lengths,
    convert_to_batch,
    get_filter,
    group_ids,
    resolve_filters,
    sample_from_dict,
    sample_to_dict,
)
from trainer.types import Sample, Status


def _s(resp, reward, status=Status.COMPLETED, prompt=(1, 2, 3), version=0):
    return Sample(prompt="p", tokens=tuple(prompt) + tuple(resp), response_length=len(resp), reward=reward,
                  status=status, rollout_logprobs=tuple(-0.1 * (i + 1) for i in range(len(resp))),
                  weight_version=version)


def test_filters_on_hand_built_groups():
    same = [_s((7, 8), 1.0), _s((7, 9), 1.0), _s((6,), 1.0)]
    mixed = [_s((7, 8), 1.0), _s((7, 9), 0.0), _s((6,), 0.0)]
    assert not check_reward_nonzero_std(same) and check_reward_nonzero_std(mixed)
    assert check_min_reward(mixed, min_reward=0.3) and not check_min_reward(mixed, min_reward=0.4)
    clones = [_s((7, 8), 1.0), _s((7, 8), 0.0), _s((7, 8), 0.0)]
    assert not check_response_diversity(clones) and check_response_diversity(mixed)
    assert not check_reasonable_length([_s((), 0.0), _s((1,), 1.0)])
    trunc = [_s((7,), 0.0, Status.TRUNCATED), _s((8,), 1.0, Status.TRUNCATED), _s((9,), 0.0)]
    assert not check_reasonable_length(trunc) and check_reasonable_length(trunc[1:] + [_s((5,), 0.0)] * 2)
    assert check_quality_and_diversity(mixed)
    assert not check_quality_and_diversity(same) and not check_quality_and_diversity(clones)


def test_nonzero_std_filter_matches_statistics_on_random_groups():
    rng = random.Random(0)
    for _ in range(200):
        rewards = [rng.choice([0.0, 1.0]) for _ in range(rng.randint(2, 6))]
        group = [_s((i + 4,), r) for i, r in enumerate(rewards)]
        assert check_reward_nonzero_std(group) == (statistics.pstdev(rewards) > 0)


def test_filter_registry_by_name():
    assert set(FILTERS) == {"check_reward_nonzero_std", "check_min_reward", "check_response_diversity",
                            "check_reasonable_length", "check_quality_and_diversity"}
    assert get_filter("check_min_reward") is check_min_reward
    assert get_filter("trainer.rollout.samples:check_min_reward") is check_min_reward
    assert [n for n, _ in resolve_filters(["check_min_reward", check_response_diversity])] == [
        "check_min_reward", "check_response_diversity"]
    with pytest.raises(ValueError, match="unknown filter 'check_typo'"):
        get_filter("check_typo")


def test_convert_to_batch_keeps_each_samples_identity_and_summarises():
    rng = random.Random(5)
    uids = rng.sample(range(100), 3)  # the manager's run-wide group numbers, in the order the groups were accepted
    groups = [[dataclasses.replace(_s(tuple(rng.randint(6, 60) for _ in range(rng.randint(1, 9))),
                                      float(rng.random() < 0.5), version=rng.randint(0, 3)), group_index=u, index=j)
               for j in range(4)] for u in uids]
    batch = convert_to_batch(groups, current_weight_version=3, counters={"groups_filtered": 2})
    flat = [s for g in groups for s in g]
    # One identity: a sample's group and its number in it, the same before and after (issue 41 item 7; the batch
    # used to renumber group_index 0..G-1 beside the manager's metadata["group_uid"]).
    assert list(batch.samples) == flat and group_ids(batch.samples) == [u for u in uids for _ in range(4)]
    assert [s.index for s in batch.samples] == [0, 1, 2, 3] * 3 and not any("group_uid" in s.metadata for s in flat)
    m = batch.metadata
    rewards = [s.reward for s in flat]
    assert m["reward_mean"] == pytest.approx(sum(rewards) / 12)
    assert m["reward_std"] == pytest.approx(statistics.pstdev(rewards))
    assert m["response_length_max"] == max(compute_response_lengths(flat))
    assert m["weight_version"] == 3 and not any("staleness" in k for k in m)  # the lag: staleness/* (the loop's)
    assert m["groups_filtered"] == 2 and m["num_groups"] == 3
    json.dumps(m)  # loggable as JSONL


def test_transforms_and_serialisation():
    samples = [_s((9, 10), 1.0), dataclasses.replace(_s((11,), 0.0), loss_mask=(0,))]
    # The effective mask is all ones when the sample has none, so the trainer never special-cases None.
    assert [list(s.effective_loss_mask) for s in samples] == [[1, 1], [0]]
    drop_zero = lambda xs: [s for s in xs if s.reward > 0]
    double = lambda xs: [dataclasses.replace(s, reward=2 * s.reward) for s in xs]
    out = apply_sample_transforms(samples, [drop_zero, double])
    assert [s.reward for s in out] == [2.0]
    assert apply_sample_transforms(samples, []) == samples
    for s in samples:
        assert sample_from_dict(json.loads(json.dumps(sample_to_dict(s)))) == s
    assert build_batch_metadata(samples)["failed_fraction"] == 0.0
