"""trainer.types: frozen, validated, with messages that name the bad field."""

import dataclasses

import pytest

from kernels import PolicyLossConfig
from trainer.config import OptimConfig, RLTrainingConfig, RolloutConfig, SFTTrainingConfig, config_from_dict
from trainer.types import RolloutBatch, Sample, Status, TrainingState


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
        (RLTrainingConfig, dict(loss={"loss_agg": "mean"}), "loss_agg"),
        (RLTrainingConfig, dict(loss={"kl_type": "k4"}), "kl_type"),
        (RLTrainingConfig, dict(loss={"clip_ratio_c": 0.5}), "clip_ratio_c"),
        (RLTrainingConfig, dict(loss={"clip_low": 1.5}), "clip_low"),
        (RLTrainingConfig, dict(loss={"rollout_correction": "is"}), "rollout_correction"),
        (RLTrainingConfig, dict(optim={"lr": 0.0}), "lr"),
        (RLTrainingConfig, dict(token_budget=1000), "token_budget"),
        (RLTrainingConfig, dict(sync_every=0), "sync_every"),
        (SFTTrainingConfig, dict(max_length=0), "max_length"),
        (SFTTrainingConfig, dict(optim={"betas": (0.9, 1.0)}), "betas"),
        (OptimConfig, dict(eps=0.0), "eps"),
        (TrainingState, dict(step=-1), "step"),
    ],
)
def test_config_validation_names_field(cls, kwargs, field):
    with pytest.raises(ValueError, match=field):
        cls(**kwargs)


def test_config_from_dict_nested_and_unknown_key():
    cfg = config_from_dict(RLTrainingConfig, {"optim": {"lr": 3e-4, "betas": [0.9, 0.98]}, "loss": {"clip_high": 0.28},
                                              "rollout": {"n_samples_per_prompt": 8, "stop_token_ids": [2]}})
    assert cfg.optim == OptimConfig(lr=3e-4, betas=(0.9, 0.98)) and cfg.loss.clip_high == 0.28
    assert cfg.rollout.n_samples_per_prompt == 8 and cfg.rollout.stop_token_ids == (2,)
    assert isinstance(cfg.loss, PolicyLossConfig)
    with pytest.raises(ValueError, match="'lrr'"):
        config_from_dict(RLTrainingConfig, {"lrr": 1})
    with pytest.raises(ValueError, match="'nope'"):
        config_from_dict(RLTrainingConfig, {"rollout": {"nope": 1}})


def test_sft_and_rl_share_one_optimiser_config():
    optim = OptimConfig(lr=2e-3, warmup_steps=3, betas=(0.8, 0.9))
    assert SFTTrainingConfig(optim=optim).optim is RLTrainingConfig(optim=optim).optim
    assert config_from_dict(SFTTrainingConfig, {"optim": {"lr": 2e-3, "warmup_steps": 3, "betas": [0.8, 0.9]}}).optim \
        == optim


@pytest.mark.parametrize("key, value, table", [
    ("clip_low", 0.1, "loss"), ("clip_high", 0.3, "loss"), ("loss_agg", "token-mean", "loss"), ("kl_coef", 0.1, "loss"),
    ("tis_cap", 2.0, "loss"), ("log_entropy", True, "loss"), ("lr", 1e-3, "optim"), ("betas", [0.9, 0.9], "optim"),
])
def test_old_top_level_keys_name_their_new_table(key, value, table):
    with pytest.raises(ValueError, match=rf"rl\.{key} moved to \[rl\.{table}\] {key}"):
        config_from_dict(RLTrainingConfig, {key: value}, "rl")
    if table == "optim":
        with pytest.raises(ValueError, match=rf"sft\.{key} moved to \[sft\.optim\] {key}"):
            config_from_dict(SFTTrainingConfig, {key: value}, "sft")


@pytest.mark.parametrize("kw, expected", [
    ({}, "none"),  # synchronous and on-policy
    ({"async_rollout": True}, "tis"),
    ({"sync_every": 2}, "tis"),  # the engines lag the trainer between syncs
    ({"async_rollout": True, "loss": {"rollout_correction": "none"}}, "none"),  # an explicit choice stays
    ({"loss": {"rollout_correction": "mis"}}, "mis"),
])
def test_rollout_correction_defaults_to_tis_only_off_policy(kw, expected):
    assert RLTrainingConfig(**kw).loss.rollout_correction == expected


def test_dr_grpo_normaliser_is_the_generation_limit():
    cfg = RLTrainingConfig(loss={"loss_agg": "seq-mean-token-sum-norm"}, rollout=RolloutConfig(max_new_tokens=77))
    assert cfg.loss.max_seq_len == 77
    assert RLTrainingConfig(loss={"loss_agg": "seq-mean-token-sum-norm", "max_seq_len": 9}).loss.max_seq_len == 9
    assert RLTrainingConfig().loss.max_seq_len is None
    given = PolicyLossConfig(kl_coef=0.3)
    assert RLTrainingConfig(loss=given, async_rollout=True).loss is given  # an object is taken as given
