"""The staleness bound, derived in one place: how far rollouts run ahead, which version they are measured against,
which samples are past the bound, and the one metric family that reports it (staleness/*).

A sample's lag is the trainer's weight version minus the version of its oldest token. [rl] max_staleness = k bounds
it. Where lag comes from: the engines get new weights every sync_every steps, so they sample with weights up to
sync_every - 1 versions behind the trainer (`engine_lag`); async generation adds the steps it runs ahead (`ahead`).
Fresh samples therefore lag at most ahead + engine_lag, and the policy sets ahead = k - engine_lag so that this is k:
the bound holds by construction. `within_staleness` checks it before every step, counted, for what construction does
not see (cached partial samples, requeued groups, a resumed run); the rollout manager restarts cached partial samples
with `past_bound` against `train_version`, the version their batch will train at, at the latest.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from trainer.rollout.samples import group_ids
from trainer.stops import RunStopped
from trainer.types import RolloutBatch, Sample


@dataclasses.dataclass(frozen=True)
class StalenessPolicy:
    """[rl] max_staleness, sync_every, async_rollout and stale_policy, and what follows from them
    (trainer.config.RLTrainingConfig.staleness builds it)."""

    max_staleness: int  # k
    sync_every: int = 1
    async_rollout: bool = False
    stale_policy: str = "regenerate"  # a sample past the bound: its group "regenerate"d later, or "drop"ped

    @property
    def engine_lag(self) -> int:
        """Versions the engines may be behind the trainer between two syncs."""
        return self.sync_every - 1

    @property
    def ahead(self) -> int:
        """Steps the rollouts run ahead of training: 0 synchronous; async, what the bound leaves past engine_lag."""
        return self.max_staleness - self.engine_lag if self.async_rollout else 0

    def problem(self) -> str | None:
        """Why fresh samples could not fit the bound (the config's error), or None."""
        s, k = self.sync_every, self.max_staleness
        if self.async_rollout and self.ahead < 1:
            return (f"async_rollout generates at least one step ahead of training with engines up to sync_every - 1 = "
                    f"{s - 1} versions behind, so samples are up to {s} versions old; set max_staleness >= {s} (got "
                    f"{k}), or async_rollout = false")
        if k < self.engine_lag:
            return (f"with sync_every = {s} the engines sample with weights up to {s - 1} versions old; set "
                    f"max_staleness >= {s - 1} (got {k}) or lower sync_every")
        return None

    def train_version(self, engines_version: int) -> int:
        """The trainer version a batch started now trains at, at the latest (the engines serve `engines_version`):
        what the rollout side measures its cached samples' lag against."""
        return engines_version + self.ahead + self.engine_lag


def past_bound(trainer_version: int, sample_version: int, max_staleness: int) -> bool:
    """Whether a sample whose oldest token came from `sample_version` is too old to train at `trainer_version`."""
    return trainer_version - sample_version > max_staleness


def within_staleness(batch: RolloutBatch, version: int, policy: StalenessPolicy, *,
                     requeue: Callable[[list[list[Sample]]], None]) -> tuple[RolloutBatch, dict[str, float]]:
    """The batch without the samples past the bound at trainer version `version`, and the staleness metrics:
    staleness/frac_0 .. frac_k (the lags' distribution), max, mean, past_bound, and regenerated or dropped (fractions
    of the batch as drawn).

    stale_policy "drop" leaves the stale samples out (their groups' baselines are the rest); "regenerate" takes their
    whole groups out and hands them back to the rollout side (`requeue`), which generates them again, from their
    prompts, first in a later batch. A batch left empty is an error."""
    lags = [version - s.weight_version for s in batch.samples]
    k = policy.max_staleness
    stale = {i for i, s in enumerate(batch.samples) if past_bound(version, s.weight_version, k)}
    if stale and policy.stale_policy == "regenerate":
        ids = group_ids(batch.samples)
        uids = {ids[i] for i in stale}
        groups: dict[Any, list[Sample]] = {}
        for uid, s in zip(ids, batch.samples):
            if uid in uids:
                groups.setdefault(uid, []).append(s)
        requeue(list(groups.values()))
        stale = {i for i, uid in enumerate(ids) if uid in uids}
    metrics = staleness_metrics(lags, k)
    metrics[f"staleness/{'regenerated' if policy.stale_policy == 'regenerate' else 'dropped'}"] = \
        len(stale) / len(lags)
    if not stale:
        return batch, metrics
    kept = tuple(s for i, s in enumerate(batch.samples) if i not in stale)
    if not kept:
        raise RunStopped(f"every sample of this batch is past [rl] max_staleness = {k} (lags {sorted(set(lags))}); "
                         f"raise max_staleness or lower sync_every")
    return RolloutBatch(samples=kept, metadata=batch.metadata), metrics


def staleness_metrics(lags: Sequence[int], max_staleness: int) -> dict[str, float]:
    """The staleness/* family of one batch's lags (in versions behind the weights it trains from)."""
    n = len(lags)
    k = max_staleness
    return {**{f"staleness/frac_{j}": sum(lag == j for lag in lags) / n for j in range(k + 1)},
            "staleness/max": float(max(lags)), "staleness/mean": sum(lags) / n,
            "staleness/past_bound": sum(lag > k for lag in lags) / n}
