"""trainer.types: frozen, validated, with messages that name the bad field."""

import dataclasses

import pytest

from trainer.types import (
    RLTrainingConfig,
    RolloutBatch,
    RolloutConfig,
    Sample,
    SFTTrainingConfig,
    Status,
    TrainingState,
    config_from_dict,
)


def test_sample_is_frozen_and_normalised():
    s = Sample(prompt="1+1=", tokens=[5, 6, 7, 8], response_length=2, loss_mask=[1, 0], rollout_logprobs=[-0.5, -1])
    assert s.tokens == (5, 6, 7, 8) and s.prompt_length == 2 and s.status is Status.PENDING
    assert s.rollout_logprobs == (-0.5, -1.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.reward = 1.0  # type: ignore[misc]
    s2 = dataclasses.replace(s, reward=1.0, status="completed")
    assert s2.reward == 1.0 and s2.status is Status.COMPLETED and s.reward is None
    assert Sample(prompt="", tokens=[1, 2], response_length=2).effective_loss_mask == (1, 1)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(response_length=5), "response_length"),
        (dict(response_length=2, loss_mask=[1]), "loss_mask"),
        (dict(response_length=2, loss_mask=[1, 2]), "loss_mask"),
        (dict(response_length=2, rollout_logprobs=[0.0]), "rollout_logprobs"),
        (dict(reward=float("nan")), "reward"),
        (dict(weight_version=-1), "weight_version"),
    ],
)
def test_sample_validation_names_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        Sample(prompt="p", tokens=[1, 2, 3], **kwargs)


def test_rollout_batch():
    b = RolloutBatch(samples=[Sample(prompt="a", tokens=[1], reward=0.5), Sample(prompt="b", tokens=[2])])
    assert len(b) == 2 and b.rewards[0] == 0.5 and b.rewards[1] != b.rewards[1]
    with pytest.raises(ValueError, match="samples"):
        RolloutBatch(samples=[])


@pytest.mark.parametrize(
    "cls, kwargs, field",
    [
        (RolloutConfig, dict(n_samples_per_prompt=0), "n_samples_per_prompt"),
        (RolloutConfig, dict(over_sampling_factor=0.5), "over_sampling_factor"),
        (RolloutConfig, dict(top_p=0.0), "top_p"),
        (RolloutConfig, dict(top_k=0), "top_k"),
        (RLTrainingConfig, dict(loss_agg="mean"), "loss_agg"),
        (RLTrainingConfig, dict(kl_type="k4"), "kl_type"),
        (RLTrainingConfig, dict(clip_ratio_c=0.5), "clip_ratio_c"),
        (RLTrainingConfig, dict(lr=0.0), "lr"),
        (RLTrainingConfig, dict(token_budget=1000), "token_budget"),
        (SFTTrainingConfig, dict(max_length=0), "max_length"),
        (SFTTrainingConfig, dict(betas=(0.9, 1.0)), "betas"),
        (TrainingState, dict(step=-1), "step"),
    ],
)
def test_config_validation_names_field(cls, kwargs, field):
    with pytest.raises(ValueError, match=field):
        cls(**kwargs)


def test_config_from_dict_nested_and_unknown_key():
    cfg = config_from_dict(RLTrainingConfig, {"lr": 3e-4, "rollout": {"n_samples_per_prompt": 8,
                                                                        "stop_token_ids": [2]}})
    assert cfg.lr == 3e-4 and cfg.rollout.n_samples_per_prompt == 8 and cfg.rollout.stop_token_ids == (2,)
    with pytest.raises(ValueError, match="'lrr'"):
        config_from_dict(RLTrainingConfig, {"lrr": 1})
    with pytest.raises(ValueError, match="'nope'"):
        config_from_dict(RLTrainingConfig, {"rollout": {"nope": 1}})
