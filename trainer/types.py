"""The shared vocabulary of the trainer: samples, batches, training state (configs: trainer.config).

Everything is a frozen dataclass; change one with `dataclasses.replace`. Validation happens in
`__post_init__` and every message names the bad field and says how to fix it.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping
from typing import Any


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
    # A sample's identity, its only one: its group (the samples of one prompt: the rollout manager numbers the groups
    # of a run as it draws them, and a group keeps its number across batches) and its number in that group.
    group_index: int = 0
    index: int = 0
    rollout_logprobs: tuple[float, ...] | None = None
    weight_version: int = 0
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    status: Status = Status.PENDING
    # The reward function's verdict when it gives one ({"reward": r, "correct": bool}); None: evaluation counts a
    # sample correct when its reward reaches [eval] max_reward.
    correct: bool | None = None

    def __post_init__(self) -> None:
        # map() rather than generators: rollouts build ~10k Samples per step (each segment is a replace()).
        object.__setattr__(self, "tokens", tuple(map(int, self.tokens)))
        if self.loss_mask is not None:
            object.__setattr__(self, "loss_mask", tuple(map(int, self.loss_mask)))
        if self.rollout_logprobs is not None:
            object.__setattr__(self, "rollout_logprobs", tuple(map(float, self.rollout_logprobs)))
        object.__setattr__(self, "status", Status(self.status))
        _check(0 <= self.response_length <= len(self.tokens), "response_length",
               f"must be in [0, len(tokens)={len(self.tokens)}], got {self.response_length}")
        if self.loss_mask is not None:
            _check(len(self.loss_mask) == self.response_length, "loss_mask",
                   f"needs one entry per response token ({self.response_length}), got {len(self.loss_mask)}")
            _check(set(self.loss_mask) <= {0, 1}, "loss_mask", "entries must be 0 or 1")
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
class TrainingState:
    """What changes from step to step, threaded explicitly: `opt_fut, state = optim_step(components, state, cfg,
    num_tokens=fut.num_tokens)`."""

    step: int = 0
    weight_version: int = 0
    tokens_seen: int = 0

    def __post_init__(self) -> None:
        _non_negative(self, "step", "weight_version", "tokens_seen")


