"""The run's configuration: frozen dataclasses, validated in `__post_init__`, every message naming the bad field.

Change one with `dataclasses.replace`; build one from a TOML table with `config_from_dict`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from kernels import PolicyLossConfig
from trainer.types import _check, _non_negative, _positive

ADVANTAGE_ESTIMATORS = ("grpo", "rloo", "reinforce")

@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """How rollouts are generated: batch shape, sampling, over-sampling, filters, timeouts."""

    rollout_batch_size: int = 8  # prompts per step
    n_samples_per_prompt: int = 4  # group size (GRPO)
    over_sampling_factor: float = 1.0  # submit this many times the prompts needed, stop once the batch is full
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = off (SGLang's convention)
    stop_token_ids: tuple[int, ...] = ()
    max_concurrency: int = 64  # in-flight HTTP requests over all engines
    request_timeout_s: float = 120.0
    max_retries: int = 3
    dynamic_filters: tuple[str, ...] = ()  # names of trainer.rollout.samples filters, e.g. "check_reward_nonzero_std"
    max_staleness: int = 1  # async mode: a sample may lag the trainer by this many weight versions
    seed: int = 0
    apply_chat_template: bool = False  # wrap each prompt as a user turn with the tokenizer's chat template
    connect_timeout_s: float = 5.0  # an engine that does not accept a connection within this is "not answering"
    retry_backoff_s: float = 0.2  # wait before retry k is retry_backoff_s * 2**k
    abort_grace_s: float = 5.0  # after /abort_request, wait this long for engines to return partial samples
    max_filtered_groups: int = 0  # give up after this many groups dropped by filters in one batch (0 = 10 x batch)

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "dynamic_filters", tuple(self.dynamic_filters))
        _positive(self, "rollout_batch_size", "n_samples_per_prompt", "max_new_tokens", "max_concurrency",
                  "request_timeout_s")
        _check(self.over_sampling_factor >= 1.0, "over_sampling_factor",
               f"must be >= 1.0 (1.0 = no over-sampling), got {self.over_sampling_factor}")
        _check(self.temperature > 0, "temperature", f"must be > 0, got {self.temperature}")
        _check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k == -1 or self.top_k > 0, "top_k", f"must be -1 (off) or > 0, got {self.top_k}")
        _non_negative(self, "max_retries", "max_staleness", "retry_backoff_s", "abort_grace_s", "max_filtered_groups")
        _positive(self, "connect_timeout_s")

@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warmup then cosine decay: the one optimiser config of SFT and RL ([sft.optim], [rl.optim])."""

    lr: float = 1e-4
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio (1.0 = constant after warmup)
    warmup_steps: int = 0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    max_grad_norm: float = 1.0  # 0 = no clipping (the norm is still reported)

    def __post_init__(self) -> None:
        object.__setattr__(self, "betas", tuple(self.betas))
        _positive(self, "lr", "eps")
        _non_negative(self, "warmup_steps", "weight_decay", "max_grad_norm")
        _check(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")
        _check(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "betas",
               f"must be two numbers in [0, 1), got {self.betas}")

def _optim(value: Any) -> OptimConfig:
    if isinstance(value, OptimConfig):
        return value
    if isinstance(value, Mapping):
        return config_from_dict(OptimConfig, value)
    raise ValueError(f"optim: expected an OptimConfig or a table of its keys, got {type(value).__name__}")

@dataclasses.dataclass(frozen=True)
class _PhaseConfig:
    """What SFT and RL both need besides the optimiser: length, packing, checkpoints, seed, outputs."""

    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    num_steps: int = 10  # also the length of the LR schedule
    token_budget: int = 4096  # tokens per packed micro-batch
    micro_batch_buckets: int = 256  # packed rows are padded to a multiple of this (compile-stable shapes)
    save_every: int = 0  # 0 = only at the end
    keep_last: int = 2
    seed: int = 0
    output_dir: str = "runs/default"

    def __post_init__(self) -> None:
        object.__setattr__(self, "optim", _optim(self.optim))
        _positive(self, "num_steps", "token_budget", "micro_batch_buckets", "keep_last")
        _non_negative(self, "save_every")
        _check(self.token_budget % self.micro_batch_buckets == 0 or self.token_budget < self.micro_batch_buckets,
               "token_budget", f"must be a multiple of micro_batch_buckets={self.micro_batch_buckets}, "
                               f"got {self.token_budget}")

@dataclasses.dataclass(frozen=True)
class SFTTrainingConfig(_PhaseConfig):
    """Supervised fine-tuning on chat conversations (assistant-only loss)."""

    batch_size: int = 16  # conversations per step
    max_length: int = 512

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive(self, "batch_size", "max_length")

def resolve_loss(loss: Any, rollout: RolloutConfig, *, off_policy: bool) -> Any:
    """The policy-loss config an RL run trains with: a kernels.PolicyLossConfig, or a table of its keys.

    From a table, two keys are derived when absent: `rollout_correction` is "tis" for off-policy runs (async
    rollouts, or engines that lag because sync_every > 1) and "none" for synchronous on-policy runs; and
    `max_seq_len` (the Dr.GRPO normaliser of loss_agg = "seq-mean-token-sum-norm") is the generation limit
    rollout.max_new_tokens. A PolicyLossConfig object is taken as given (its fields are explicit choices).
    """
    if loss is None:
        loss = {}
    if isinstance(loss, PolicyLossConfig):
        return loss
    if not isinstance(loss, Mapping):
        raise ValueError(f"loss: expected a kernels.PolicyLossConfig or a table of its keys, got "
                         f"{type(loss).__name__}")
    values = dict(loss)
    values.setdefault("rollout_correction", "tis" if off_policy else "none")
    if values.get("loss_agg") == "seq-mean-token-sum-norm":
        values.setdefault("max_seq_len", rollout.max_new_tokens)
    return config_from_dict(PolicyLossConfig, values, "loss")

@dataclasses.dataclass(frozen=True)
class RLTrainingConfig(_PhaseConfig):
    """GRPO/PPO training: the loss ([rl.loss]), the advantages, weight sync and the rollout schedule.

    `loss` accepts a table (dict) of kernels.PolicyLossConfig keys and is resolved here (see `resolve_loss`):
    leaving `rollout_correction` unset means "tis" when the rollouts are off-policy (async_rollout or
    sync_every > 1) and "none" otherwise. The rollout's temperature is the run's only temperature: the engines
    sample with it and the trainer computes its log-probs with it.
    """

    advantage_estimator: str = "grpo"
    loss: Any = None  # kernels.PolicyLossConfig (a dict of its keys is resolved in __post_init__)
    ppo_epochs: int = 1  # optimizer steps per rollout batch (>1 makes old != current policy)
    sync_every: int = 1  # weight sync to engines every N steps (>1: the engines lag the trainer)
    async_rollout: bool = False  # generate step n+1 while step n trains
    verify_sync: bool = False
    # Reproducible from the seeds whatever the arrival order of requests: each engine runs one request (one
    # group) at a time, so its batch composition is fixed; costs the batching across groups (see the README).
    deterministic: bool = False
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.rollout, Mapping):
            object.__setattr__(self, "rollout", config_from_dict(RolloutConfig, self.rollout))
        if not isinstance(self.rollout, RolloutConfig):
            raise ValueError(f"rollout: expected a RolloutConfig, got {type(self.rollout).__name__}")
        # Over-sampled groups still running when the batch fills are cut wherever they are at that moment.
        _check(not self.deterministic or self.rollout.over_sampling_factor == 1.0, "deterministic",
               f"needs rollout.over_sampling_factor = 1.0 (got {self.rollout.over_sampling_factor}): groups cut "
               f"when the batch fills depend on timing; set it to 1.0 or deterministic = false")
        _check(self.advantage_estimator in ADVANTAGE_ESTIMATORS, "advantage_estimator",
               f"unknown {self.advantage_estimator!r}; choose one of {ADVANTAGE_ESTIMATORS}")
        _positive(self, "ppo_epochs", "sync_every")
        object.__setattr__(self, "loss", resolve_loss(self.loss, self.rollout, off_policy=self.off_policy))

    @property
    def off_policy(self) -> bool:
        """The engines may sample with weights older than the ones being trained."""
        return self.async_rollout or self.sync_every > 1

_OPTIM_KEYS = ("lr", "min_lr_ratio", "warmup_steps", "weight_decay", "betas", "eps", "max_grad_norm")

_LOSS_KEYS = ("loss_agg", "clip_low", "clip_high", "clip_ratio_c", "kl_coef", "kl_type", "entropy_coef", "tis_cap",
              "log_entropy", "rollout_correction", "objective", "max_seq_len")

# Keys that used to sit at the top of a config and now live in one of its tables: key -> table.
_MOVED: dict[str, dict[str, str]] = {
    "SFTTrainingConfig": dict.fromkeys(_OPTIM_KEYS, "optim"),
    "RLTrainingConfig": {**dict.fromkeys(_OPTIM_KEYS, "optim"), **dict.fromkeys(_LOSS_KEYS, "loss")},
}

def config_from_dict(cls: type, values: Mapping[str, Any], where: str | None = None) -> Any:
    """Build a (possibly nested) config dataclass from a dict (a TOML table), naming any key that does not exist.

    `where` is the table's name in messages (e.g. "rl"); a key that moved into a nested table says where it went.
    Nested dataclass fields (optim, rollout) are built from their sub-tables; `loss` stays a dict that
    RLTrainingConfig resolves (some of its keys are derived from the rest of the config).
    """
    where = where or cls.__name__
    fields = {f.name: f for f in dataclasses.fields(cls)}
    nested = {"optim": OptimConfig, "rollout": RolloutConfig}
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        moved = _MOVED.get(cls.__name__, {}).get(key)
        if moved is not None:
            raise ValueError(f"{where}.{key} moved to [{where}.{moved}] {key}")
        if key not in fields:
            raise ValueError(f"unknown config key {key!r} in [{where}]; known keys: {sorted(fields)}")
        if key in nested and isinstance(value, Mapping):
            value = config_from_dict(nested[key], value, f"{where}.{key}")
        elif isinstance(value, list) and "tuple" in str(fields[key].type):
            value = tuple(value)
        kwargs[key] = value
    try:
        return cls(**kwargs)
    except ValueError as e:
        if str(e).startswith("["):  # already names its table
            raise
        raise ValueError(f"[{where}] {e}") from e
