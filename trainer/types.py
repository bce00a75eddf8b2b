"""The shared vocabulary of the trainer: samples, batches, configs, training state.

Everything is a frozen dataclass; change one with `dataclasses.replace`. Validation happens in
`__post_init__` and every message names the bad field and says how to fix it.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping
from typing import Any

LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
ADVANTAGE_ESTIMATORS = ("grpo", "rloo", "reinforce")


class Status(enum.StrEnum):
    """Life cycle of one sample: a rollout request may finish, hit the length limit, be cut, or fail."""

    PENDING = "pending"  # submitted, not yet answered
    COMPLETED = "completed"  # stopped on EOS / a stop token
    TRUNCATED = "truncated"  # hit max_new_tokens
    ABORTED = "aborted"  # cut off because the batch filled (may be resumed as a partial sample)
    FAILED = "failed"  # the engine or the reward function raised


def _check(cond: bool, field: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{field}: {msg}")


def _positive(obj: Any, *names: str) -> None:
    for n in names:
        v = getattr(obj, n)
        _check(v is not None and v > 0, n, f"must be > 0, got {v!r}")


def _non_negative(obj: Any, *names: str) -> None:
    for n in names:
        v = getattr(obj, n)
        _check(v is not None and v >= 0, n, f"must be >= 0, got {v!r}")


@dataclasses.dataclass(frozen=True)
class Sample:
    """One prompt + response trajectory.

    tokens = prompt tokens followed by response tokens; loss_mask has one entry per *response* token
    (1 = trained on, 0 = e.g. a tool output in a multi-turn trajectory); rollout_logprobs are the engine's
    log-probs of the response tokens (for truncated importance sampling).
    """

    prompt: str
    tokens: tuple[int, ...]
    response: str = ""
    response_length: int = 0
    loss_mask: tuple[int, ...] | None = None
    reward: float | None = None
    group_index: int = 0
    index: int = 0
    rollout_logprobs: tuple[float, ...] | None = None
    weight_version: int = 0
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    status: Status = Status.PENDING

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", tuple(int(t) for t in self.tokens))
        if self.loss_mask is not None:
            object.__setattr__(self, "loss_mask", tuple(int(m) for m in self.loss_mask))
        if self.rollout_logprobs is not None:
            object.__setattr__(self, "rollout_logprobs", tuple(float(x) for x in self.rollout_logprobs))
        object.__setattr__(self, "status", Status(self.status))
        _check(0 <= self.response_length <= len(self.tokens), "response_length",
               f"must be in [0, len(tokens)={len(self.tokens)}], got {self.response_length}")
        if self.loss_mask is not None:
            _check(len(self.loss_mask) == self.response_length, "loss_mask",
                   f"needs one entry per response token ({self.response_length}), got {len(self.loss_mask)}")
            _check(all(m in (0, 1) for m in self.loss_mask), "loss_mask", "entries must be 0 or 1")
        if self.rollout_logprobs is not None:
            _check(len(self.rollout_logprobs) == self.response_length, "rollout_logprobs",
                   f"needs one entry per response token ({self.response_length}), "
                   f"got {len(self.rollout_logprobs)}")
        if self.reward is not None:
            _check(math.isfinite(self.reward), "reward", f"must be finite, got {self.reward!r}")
        _non_negative(self, "group_index", "weight_version")

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    @property
    def effective_loss_mask(self) -> tuple[int, ...]:
        return self.loss_mask if self.loss_mask is not None else (1,) * self.response_length


@dataclasses.dataclass(frozen=True)
class RolloutBatch:
    """The samples of one training step plus what the rollout learnt while producing them."""

    samples: tuple[Sample, ...]
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "samples", tuple(self.samples))
        _check(len(self.samples) > 0, "samples", "a rollout batch needs at least one sample")

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def rewards(self) -> list[float]:
        return [float("nan") if s.reward is None else s.reward for s in self.samples]


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
    dynamic_filters: tuple[str, ...] = ()  # names of trainer.rollout filters, e.g. "check_reward_nonzero_std"
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
class _OptimConfig:
    """Fields shared by SFT and RL training configs."""

    lr: float = 1e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    max_grad_norm: float = 1.0
    num_steps: int = 10
    token_budget: int = 4096  # tokens per packed micro-batch
    micro_batch_buckets: int = 256  # packed rows are padded to a multiple of this (compile-stable shapes)
    save_every: int = 0  # 0 = only at the end
    keep_last: int = 2
    seed: int = 0
    output_dir: str = "runs/default"

    def __post_init__(self) -> None:
        object.__setattr__(self, "betas", tuple(self.betas))
        _positive(self, "lr", "num_steps", "token_budget", "micro_batch_buckets", "keep_last")
        _non_negative(self, "warmup_steps", "weight_decay", "save_every", "max_grad_norm")
        _check(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")
        _check(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "betas",
               f"must be two numbers in [0, 1), got {self.betas}")
        _check(self.token_budget % self.micro_batch_buckets == 0 or self.token_budget < self.micro_batch_buckets,
               "token_budget", f"must be a multiple of micro_batch_buckets={self.micro_batch_buckets}, "
                               f"got {self.token_budget}")


@dataclasses.dataclass(frozen=True)
class SFTTrainingConfig(_OptimConfig):
    """Supervised fine-tuning on chat conversations (assistant-only loss)."""

    batch_size: int = 16  # conversations per step
    max_length: int = 512

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive(self, "batch_size", "max_length")


@dataclasses.dataclass(frozen=True)
class RLTrainingConfig(_OptimConfig):
    """GRPO/PPO training: the loss, the advantages, weight sync and the rollout schedule."""

    loss_agg: str = "seq-mean-token-mean"
    advantage_estimator: str = "grpo"
    clip_low: float = 0.2
    clip_high: float = 0.2
    clip_ratio_c: float | None = None
    kl_coef: float = 0.0
    kl_type: str = "k3"
    entropy_coef: float = 0.0
    tis_cap: float | None = None
    log_entropy: bool = False  # compute and log the policy entropy even when entropy_coef = 0
    ppo_epochs: int = 1  # optimizer steps per rollout batch (>1 makes old != current policy)
    sync_every: int = 1  # weight sync to engines every N steps
    async_rollout: bool = False  # generate step n+1 while step n trains
    verify_sync: bool = False
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(self.loss_agg in LOSS_AGGS, "loss_agg", f"unknown {self.loss_agg!r}; choose one of {LOSS_AGGS}")
        _check(self.advantage_estimator in ADVANTAGE_ESTIMATORS, "advantage_estimator",
               f"unknown {self.advantage_estimator!r}; choose one of {ADVANTAGE_ESTIMATORS}")
        _check(self.kl_type in ("k1", "k2", "k3"), "kl_type", f"unknown {self.kl_type!r}; choose k1, k2 or k3")
        _non_negative(self, "clip_low", "clip_high", "kl_coef", "entropy_coef")
        if self.clip_ratio_c is not None:
            _check(self.clip_ratio_c > 1.0, "clip_ratio_c", f"dual clip needs a value > 1, got {self.clip_ratio_c}")
        if self.tis_cap is not None:
            _check(self.tis_cap > 0, "tis_cap", f"must be > 0, got {self.tis_cap}")
        _positive(self, "ppo_epochs", "sync_every")
        if not isinstance(self.rollout, RolloutConfig):
            raise ValueError(f"rollout: expected a RolloutConfig, got {type(self.rollout).__name__}")


@dataclasses.dataclass(frozen=True)
class TrainingState:
    """What changes from step to step, threaded explicitly: `fut, state = optim_step(components, state, cfg)`."""

    step: int = 0
    weight_version: int = 0
    tokens_seen: int = 0

    def __post_init__(self) -> None:
        _non_negative(self, "step", "weight_version", "tokens_seen")


def config_from_dict(cls: type, values: Mapping[str, Any]) -> Any:
    """Build a (possibly nested) config dataclass from a dict, naming any key that does not exist."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        if key not in fields:
            raise ValueError(f"unknown config key {key!r} for {cls.__name__}; known keys: {sorted(fields)}")
        ftype = fields[key].type
        if key == "rollout" and isinstance(value, Mapping):
            value = config_from_dict(RolloutConfig, value)
        elif isinstance(value, list) and "tuple" in str(ftype):
            value = tuple(value)
        kwargs[key] = value
    return cls(**kwargs)

