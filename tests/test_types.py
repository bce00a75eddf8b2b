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


def test_every_config_field_has_a_default_and_a_help_comment():
    """One place for a generated reference: each field of the run tree has its default and a comment beside it."""
    import inspect

    from trainer import config as config_module
    from trainer.config import RunConfig

    def walk(cls, seen):
        if cls in seen:
            return
        seen.add(cls)
        for f in dataclasses.fields(cls):
            assert f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING, (cls, f.name)
            sub = config_module._hints(cls)[f.name]
            if isinstance(sub, type) and dataclasses.is_dataclass(sub):
                walk(sub, seen)

    seen: set = set()
    walk(RunConfig, seen)
    assert {c.__name__ for c in seen} >= {"RunConfig", "ModelConfig", "DataConfig", "EnginesConfig", "BackendConfig",
                                          "EvalConfig", "SFTTrainingConfig", "RLTrainingConfig", "OptimConfig",
                                          "RolloutConfig"}
    for cls in seen:
        for klass in cls.__mro__:
            if not dataclasses.is_dataclass(klass) or klass is object:
                continue
            lines = inspect.getsource(klass).splitlines()
            for name in klass.__annotations__:
                i = next(i for i, line in enumerate(lines) if line.strip().startswith(f"{name}:"))
                # the help: a comment on the field's line, or the comment lines just above it
                assert "#" in lines[i] or lines[i - 1].strip().startswith("#"), (klass, name)


def test_moved_and_unknown_keys_come_from_one_table():
    from trainer.config import MOVED, ConfigError, RunConfig

    assert MOVED["rl.clip_low"] == "[rl.loss] clip_low" and MOVED["sft.lr"] == "[sft.optim] lr"
    assert MOVED["trainer.temperature"].startswith("[rl.rollout] temperature")
    for table, message in [({"rl": {"kl_coef": 0.1}}, r"rl\.kl_coef moved to \[rl\.loss\] kl_coef"),
                           ({"trainer": {"policy_loss": {}}}, r"trainer\.policy_loss moved to \[rl\.loss\]"),
                           ({"trainer": {"token_budget": 64}}, r"unknown config key\(s\) \['token_budget'\] in "
                                                               r"\[trainer\]"),
                           ({"eval": {"limits": 1}}, r"\['limits'\] in \[eval\]"),
                           ({"model": {"preset": "big"}}, r"\[model\] preset: 'big'"),
                           ({"rl": {"rollout": {"temperature": 0}}}, r"\[rl\.rollout\] temperature")]:
        with pytest.raises(ConfigError, match=message):
            config_from_dict(RunConfig, table, "")


def test_run_config_derives_the_phase_outputs_and_the_chat_template():
    from trainer.config import RunConfig

    run = config_from_dict(RunConfig, {"name": "x", "data": {"format": "plain"}, "rl": {"rollout": {"seed": 3}}}, "")
    assert run.output_dir == "runs/x" and run.sft.output_dir == "runs/x/sft" and run.rl.output_dir == "runs/x/rl"
    assert run.rl.rollout.apply_chat_template is False and run.rl.rollout.seed == 3
    assert dataclasses.replace(run.engines, threads=2).fleet == run.engines.fleet  # one form after parsing
    with pytest.raises(ValueError, match="rl: expected a RLTrainingConfig"):
        RunConfig(rl={"num_steps": 3})


def test_trainer_config_reads_its_phase_and_backend_by_reference():
    from trainer.backend.steps import TrainerConfig, trainer_config_from
    from trainer.config import BackendConfig

    rl = RLTrainingConfig(loss={"kl_coef": 0.1}, rollout=RolloutConfig(temperature=0.7), token_budget=512,
                          micro_batch_buckets=64, seed=3)
    backend = BackendConfig(compile=False, logprob_chunk_tokens=128)
    t = TrainerConfig(phase=rl, backend=backend)
    assert t.policy_loss is rl.loss and t.optim is rl.optim and t.temperature == 0.7 and t.loss == "policy"
    assert t.micro_batch_buckets == 64 and t.token_budget == 512 and t.seed == 3 and t.parallel() is backend
    assert t.logprob_chunk_tokens == 128 and not t.backend.compile
    sft = trainer_config_from(SFTTrainingConfig(), compile_backend="aot_eager")
    assert sft.loss == "nll" and sft.temperature == 1.0 and sft.backend.compile_backend == "aot_eager"
    changed = t.replace(compile=True, keep_last=7)  # each change where its field lives
    assert changed.backend.compile and changed.phase.keep_last == 7 and changed.policy_loss is rl.loss
    assert not t.backend.compile and t.phase.keep_last == 2
    with pytest.raises(ValueError, match="neither the phase"):
        t.replace(bucket_size=32)
    with pytest.raises(ValueError, match="phase"):
        TrainerConfig(phase=OptimConfig())
    with pytest.raises(ValueError, match="backend"):
        TrainerConfig(backend={"compile": False})
    with pytest.raises(ValueError, match="token_budget"):
        TrainerConfig(phase=SFTTrainingConfig(token_budget=64, micro_batch_buckets=128))


def test_fingerprints_of_earlier_checkpoints_still_match():
    """The values the flat TrainerConfig (before the run-config tree) gave: their checkpoints still resume."""
    from trainer.backend.steps import trainer_config_from

    assert trainer_config_from(SFTTrainingConfig()).fingerprint() == "8b4bef38c4e1001b"
    assert trainer_config_from(RLTrainingConfig()).fingerprint() == "80610971ff7be47c"
    rl = RLTrainingConfig(loss={"kl_coef": 0.1}, rollout=RolloutConfig(temperature=0.7), seed=3, token_budget=512,
                          micro_batch_buckets=64, optim=OptimConfig(lr=3e-4, betas=(0.9, 0.98)))
    assert trainer_config_from(rl, logprob_chunk_tokens=128, compile=False).fingerprint() == "b2c2d178c9d12387"


def test_a_resume_that_changes_the_estimator_or_the_group_is_named():
    """Was: advantage_estimator, ppo_epochs and n_samples_per_prompt were not fingerprinted: a resume with grpo ->
    rloo (other loss math) or another group size went on silently. Checkpoints written before they were recorded
    lack them and still resume; any other field missing on one side is still a difference."""
    from trainer.backend.checkpoint import config_differences
    from trainer.backend.steps import trainer_config_from

    base = trainer_config_from(RLTrainingConfig()).fingerprint_fields()
    for change, key in ((dict(advantage_estimator="rloo"), "rl.advantage_estimator"),
                        (dict(ppo_epochs=2), "rl.ppo_epochs"),
                        (dict(rollout=RolloutConfig(n_samples_per_prompt=7)), "rl.n_samples_per_prompt")):
        other = trainer_config_from(RLTrainingConfig(**change)).fingerprint_fields()
        assert list(config_differences(base, other)) == [key], change
        before = {k: v for k, v in base.items() if k != "rl"}  # a checkpoint from before the fields were recorded
        assert config_differences(before, other) == {}
    lora = trainer_config_from(RLTrainingConfig(lora={"rank": 8})).fingerprint_fields()
    assert any(k.startswith("lora.") for k in config_differences(base, lora))  # still refused
