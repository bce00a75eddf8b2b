"""Reward sources: rules, reward models and LLM judges combined into the one reward the RL loop trains on.

    rewards = build_reward_sources(cfg.rewards, default_rule=cfg.data.reward, engines=engines, tokenizer=tok,
                                   device="cuda:0", timeout_s=cfg.data.reward_timeout_s)
    run_rl_training(..., reward_fn=None, rewards=rewards)

[rewards] sources = [{kind, weight, ...}] (trainer.config.RewardSourceConfig). Where each kind is scored:
  rule   per sample, inside the rollout as each group finishes (async, each rule bounded by [data] reward_timeout_s),
         exactly where [data].reward is scored without sources: the rollout's reward function (`rule_reward`) runs
         every rule and returns their weighted sum, reporting each rule's raw score as a "source".
  model  per batch, after generation and before the batch goes to the trainer: in the rollout worker, so in async
         mode it overlaps the previous step's training. In the trainer's process on its device
         (trainer.rollout.reward_model.RewardModelScorer) or through a scoring server (`url`:
         trainer.rollout.reward_server).
  judge  per batch, likewise: one batched generate call to the judge's engine (trainer.rollout.judge).

Combination (`combine_scores`): each sample's reward is the sum over sources of weight x score. With normalize =
"batch" each source's scores are first z-scored over the batch's scored samples, (score - mean) / std with the
population mean and std computed exactly (statistics.mean / pstdev on the floats); a source whose scores are all
equal in the batch (std 0: it tells no sample from another) gives every sample 0. Each source's raw score stays in
sample.metadata["reward_sources"] ({label: score}); Sample.reward is the combined one.

Failures: a sample on which any source fails is FAILED (reward 0, left out of the loss and of every source's batch
statistics, counted in rollout/failed_fraction), metadata["reward_error"] naming the source ("reward source
'model1' (model) failed: ..."): a rule that raised or timed out, a judge's unparseable answer or engine error, a
scoring server that did not answer (every sample of that batch), a non-finite model score. Later sources skip a
sample that is already FAILED.

Metrics (batch.metadata["reward_metrics"], logged with the step): reward/<label>_mean (the mean of the source's raw
scores over the samples it scored this batch), reward/<label>_failed (samples it failed), and for judges
judge/judged, judge/failed, judge/unparseable (summed over the judge sources). Labels: the source's `label`, else a
rule's function name ("arithmetic_reward"), else kind + its index in the list ("model0", "judge2").

Limits: dynamic filters ([rl.rollout] dynamic_filters) run inside the rollout, per group, before models and judges
score: they see the rules' weighted sum (trainer.cli refuses the built-in reward filters when a model or judge
source is given). An environment that returns its own reward (multi-turn episodes) bypasses the rules; such a sample
is FAILED here with an error that says so, since its reward cannot be combined with the sources'.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import statistics
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import trio

from trainer.rollout.rewards import (
    MAX_ABS_REWARD,
    RewardFn,
    load_reward_fn,
    mark_failed,
    reward_value,
    with_timeout,
)
from trainer.rollout.rewards import _clean as strip_special_markers
from trainer.rollout.samples import build_batch_metadata
from trainer.types import RolloutBatch, Sample, Status


class RewardSourceError(RuntimeError):
    """One reward source failed on a sample (the message names the source)."""


@dataclasses.dataclass(frozen=True)
class Source:
    """One built reward source. score: rule: a reward function of one sample (async, bounded by the timeout);
    model: samples -> one float each (input order); judge: samples -> (judged samples, counts), as
    trainer.rollout.judge.judge_samples returns them."""

    label: str
    kind: str
    weight: float
    score: Callable[..., Any]


@dataclasses.dataclass(frozen=True)
class RewardsRecipe:
    """What `build_reward_sources` was given, but the engines and tokenizer: a rollout process ([rl] rollout_worker =
    "process") builds the same sources from it with its own engine clients (`build`). Picklable when the default
    rule is a name or a module-level function."""

    config: Any  # trainer.config.RewardsConfig
    default_rule: Any
    device: str = "cpu"
    timeout_s: float | None = None

    def build(self, *, engines: Sequence[Any], tokenizer: Any) -> RewardSources | None:
        return build_reward_sources(self.config, default_rule=self.default_rule, engines=engines, tokenizer=tokenizer,
                                    device=self.device, timeout_s=self.timeout_s)


@dataclasses.dataclass(frozen=True)
class RewardSources:
    """The sources of a run, built once (reward models loaded, judge engines chosen), and how they combine; `recipe`
    rebuilds them in another process."""

    sources: tuple[Source, ...]
    normalize: str = "none"
    recipe: RewardsRecipe | None = None

    def __post_init__(self) -> None:
        labels = [s.label for s in self.sources]
        if len(set(labels)) != len(labels):
            raise ValueError(f"reward source labels {labels} must be unique")
        if self.normalize not in ("none", "batch"):
            raise ValueError(f"normalize={self.normalize!r}: choose 'none' or 'batch'")

    @property
    def weights(self) -> dict[str, float]:
        return {s.label: s.weight for s in self.sources}

    def rule_reward(self) -> RewardFn | None:
        """The rollout's reward function: every rule source on one sample (None when there is no rule source)."""
        rules = [s for s in self.sources if s.kind == "rule"]
        return rule_reward(rules) if rules else None


# ----------------------------------------------------------------------------------------------- combining
def combine_scores(scores: Sequence[Mapping[str, float] | None], weights: Mapping[str, float],
                   normalize: str = "none") -> list[float | None]:
    """The combined reward of each sample: sum over sources of weights[label] x score (z-scored over the scored
    samples with normalize="batch"; a source with std 0 gives 0). scores[i]: sample i's raw score per label, every
    label of `weights` present; None: the sample failed (its combined reward is None, and it is in no statistic)."""
    scored = [i for i, s in enumerate(scores) if s is not None]
    missing = [(i, k) for i in scored for k in weights if k not in scores[i]]
    if missing:
        raise ValueError(f"sample {missing[0][0]} has no score from source {missing[0][1]!r}")
    if normalize not in ("none", "batch"):
        raise ValueError(f"normalize={normalize!r}: choose 'none' or 'batch'")
    shift = {k: 0.0 for k in weights}
    scale: dict[str, float | None] = {k: 1.0 for k in weights}  # None: std 0, the source adds 0
    if normalize == "batch" and scored:
        for k in weights:
            xs = [scores[i][k] for i in scored]
            # Exact (Fraction-based) statistics: equal scores give std exactly 0, never rounding noise that a
            # division would blow up into +-1.
            shift[k], std = statistics.mean(xs), statistics.pstdev(xs)
            scale[k] = 1.0 / std if std > 0 else None
    out: list[float | None] = [None] * len(scores)
    for i in scored:
        out[i] = math.fsum(w * (scores[i][k] - shift[k]) * scale[k] for k, w in weights.items()
                           if scale[k] is not None)
    return out


def source_label(index: int, kind: str, label: str | None, name: Any) -> str:
    """A source's name in the metrics: its label, else a rule's function name, else kind + index."""
    if label:
        return label
    if kind == "rule":
        if callable(name):
            return getattr(name, "__name__", f"rule{index}")
        return str(name).rsplit(":", 1)[-1]
    return f"{kind}{index}"


def source_labels(configs: Sequence[Any], default_rule: Any) -> list[str]:
    """The labels of RewardSourceConfigs, unique (a repeated derived one gets its index appended)."""
    out: list[str] = []
    given = {c.label for c in configs if c.label}
    for i, c in enumerate(configs):
        label = source_label(i, c.kind, c.label, c.name or default_rule)
        if not c.label and (label in out or label in given):
            label = f"{label}{i}"
        out.append(label)
    return out


# ----------------------------------------------------------------------------------------------- rules
def rule_reward(rules: Sequence[Source]) -> RewardFn:
    """A reward function (for the rollout manager) that runs every rule source on a sample: it returns their
    weighted sum, the first verdict a rule gives ("correct"), and each rule's raw score as "sources". A rule that
    raises (or times out, or returns no number) fails the sample with an error naming it."""

    async def reward(sample: Sample) -> dict[str, Any]:
        raw: dict[str, float] = {}
        correct = None
        for src in rules:
            try:
                value = src.score(sample)
                if inspect.isawaitable(value):
                    value = await value
                raw[src.label], verdict = reward_value(value)
            except Exception as e:  # noqa: BLE001 - a failing rule fails its sample, named
                raise RewardSourceError(f"reward source {src.label!r} (rule) failed: {type(e).__name__}: {e}") from e
            correct = verdict if correct is None else correct
        return {"reward": math.fsum(s.weight * raw[s.label] for s in rules), "correct": correct, "sources": raw}

    return reward


# ----------------------------------------------------------------------------------------------- batches
def _with_score(sample: Sample, label: str, score: float, **extra: Any) -> Sample:
    sources = {**sample.metadata.get("reward_sources", {}), label: float(score)}
    return dataclasses.replace(sample, metadata={**sample.metadata, **extra, "reward_sources": sources})


def _source_failed(sample: Sample, src: Source, message: str) -> Sample:
    failed = mark_failed(sample, RewardSourceError(f"reward source {src.label!r} ({src.kind}) failed: {message}"))
    return dataclasses.replace(failed, metadata={**failed.metadata, "reward_failed_source": src.label})


def _score_with_model(src: Source, samples: list[Sample], todo: list[int]) -> None:
    from trainer.rollout.reward_server import RewardServerError

    try:
        scores = src.score([samples[i] for i in todo])
    except RewardServerError as e:  # the server's fault, not the samples': the batch goes on without them
        for i in todo:
            samples[i] = _source_failed(samples[i], src, str(e))
        return
    for i, x in zip(todo, scores):
        if math.isfinite(x) and abs(x) <= MAX_ABS_REWARD:
            samples[i] = _with_score(samples[i], src.label, x)
        else:
            samples[i] = _source_failed(samples[i], src, f"the reward model scored the sample {x} (non-finite or "
                                                         f"beyond +-{MAX_ABS_REWARD:g})")


def _score_with_judge(src: Source, samples: list[Sample], todo: list[int]) -> dict[str, int]:
    judged, counts = src.score([samples[i] for i in todo])
    for i, j in zip(todo, judged):
        text = {"judge_text": j.metadata["judge_text"]} if "judge_text" in j.metadata else {}
        if j.status == Status.FAILED:
            # judge_samples printed the error once already: the sample is marked here without printing it again.
            meta = {**samples[i].metadata, **text, "reward_failed_source": src.label,
                    "reward_error": f"reward source {src.label!r} (judge) failed: {j.metadata.get('reward_error')}",
                    "reward_traceback": j.metadata.get("reward_traceback", "")}
            samples[i] = dataclasses.replace(samples[i], reward=0.0, status=Status.FAILED, metadata=meta)
        else:
            samples[i] = _with_score(samples[i], src.label, j.reward, **text)
    return counts


def _environment_reward(sample: Sample) -> bool:
    """A finished sample that has a reward but no source scores: its environment (or agent) gave the reward."""
    return sample.status != Status.FAILED and sample.reward is not None and "reward_sources" not in sample.metadata


def score_batch(batch: RolloutBatch, rewards: RewardSources) -> RolloutBatch:
    """The batch with every model and judge source scored, each sample's combined reward, the batch's reward
    statistics recomputed and the sources' metrics in metadata["reward_metrics"] (module docstring)."""
    samples = list(batch.samples)
    for i, s in enumerate(samples):
        if _environment_reward(s):
            samples[i] = mark_failed(s, RewardSourceError(
                "the environment gave this sample its own reward, which bypasses the [rewards] rule sources and "
                "cannot be combined with the other sources; score such episodes with rule sources (drop the "
                "environment's reward) or leave [rewards] sources empty"))
    judge_counts: dict[str, int] = {}
    for src in rewards.sources:
        if src.kind == "rule":  # scored in the rollout already
            continue
        todo = [i for i, s in enumerate(samples) if s.status != Status.FAILED]
        if not todo:
            break
        if src.kind == "model":
            _score_with_model(src, samples, todo)
        else:
            for k, v in _score_with_judge(src, samples, todo).items():
                judge_counts[k] = judge_counts.get(k, 0) + v
    weights = rewards.weights
    combined = combine_scores([None if s.status == Status.FAILED else s.metadata.get("reward_sources", {})
                               for s in samples], weights, rewards.normalize)
    samples = [s if r is None else dataclasses.replace(s, reward=r) for s, r in zip(samples, combined)]
    metrics = {**source_metrics(samples, list(weights)), **judge_counts}
    stats = build_batch_metadata(samples)
    newly_failed = sum(s.status == Status.FAILED for s in samples) - sum(
        s.status == Status.FAILED for s in batch.samples)
    meta = {**batch.metadata, **{k: stats[k] for k in ("reward_mean", "reward_std", "failed_fraction")},
            "reward_failed": batch.metadata.get("reward_failed", 0) + newly_failed, "reward_metrics": metrics}
    return RolloutBatch(samples=tuple(samples), metadata=meta)


def source_metrics(samples: Sequence[Sample], labels: Sequence[str]) -> dict[str, float]:
    """reward/<label>_mean over the samples each source scored (absent when it scored none), and
    reward/<label>_failed (samples it failed)."""
    out: dict[str, float] = {}
    for label in labels:
        xs = [s.metadata["reward_sources"][label] for s in samples if label in s.metadata.get("reward_sources", {})]
        if xs:  # none when every sample failed before this source
            out[f"reward/{label}_mean"] = statistics.fmean(xs)
        out[f"reward/{label}_failed"] = float(sum(s.metadata.get("reward_failed_source") == label for s in samples))
    return out


def scored_batches(batches: Iterator[RolloutBatch], rewards: RewardSources) -> Iterator[RolloutBatch]:
    """`score_batch` on each batch of a rollout generator, in the thread that draws it (the rollout worker in async
    mode); closing this closes `batches`."""
    try:
        for batch in batches:
            yield score_batch(batch, rewards)
    finally:
        close = getattr(batches, "close", None)  # a generator (the manager's) or any plain iterator
        if close is not None:
            close()


# ----------------------------------------------------------------------------------------------- building
def model_scorer(config: Any, *, device: str) -> Callable[[Sequence[Sample]], list[float]]:
    """samples -> scores of a model source: its folder loaded here on `device`, or its scoring server."""
    if config.url is None:
        from trainer.rollout.reward_model import RewardModelScorer

        return RewardModelScorer.from_pretrained(config.path, device=device, batch_size=config.batch_size,
                                                 chat=config.chat, max_length=config.max_length)
    from trainer.rollout.reward_server import read_api_key, score_remote

    api_key = read_api_key(config.api_key_file)

    def score(samples: Sequence[Sample]) -> list[float]:
        return score_remote(config.url, [s.prompt for s in samples],
                            [strip_special_markers(s.response) for s in samples],
                            [s.metadata.get("system_prompt") for s in samples], api_key=api_key,
                            timeout_s=config.timeout_s)

    return score


def judge_runner(engine: Any, judge_config: Any, tokenizer: Any) -> Callable[[Sequence[Sample]], Any]:
    """samples -> (judged samples, counts) through `engine`, in an event loop of its own (the rollout worker's batch
    transform is synchronous); the engine's pooled connections of that loop are closed after."""
    from trainer.rollout.judge import judge_samples

    async def run(samples: Sequence[Sample]) -> Any:
        try:
            return await judge_samples(engine, samples, judge_config, tokenizer)
        finally:
            with trio.move_on_after(2):  # HTTP engines pool connections per event loop
                await engine.aclose()

    return lambda samples: trio.run(run, samples)


def build_reward_sources(config: Any, *, default_rule: Any, engines: Sequence[Any], tokenizer: Any,
                         device: str = "cpu", timeout_s: float | None = None,
                         load_models: bool = True) -> RewardSources | None:
    """The run's RewardSources from a trainer.config.RewardsConfig (None when it has no sources: [data].reward alone).

    default_rule: the reward function a rule source without `name` runs ([data].reward). engines: the run's (a
    judge without `engine` is served by the first). tokenizer: the run's model's (a judge without `path` uses it).
    device: where in-process reward models run (the trainer's). timeout_s: each rule call's limit. load_models=False:
    in-process reward models are not loaded here (a rollout process loads its own from `recipe`); scoring with one
    raises."""
    if not config.sources:
        return None
    recipe = RewardsRecipe(config=config, default_rule=default_rule, device=device, timeout_s=timeout_s)
    labels = source_labels(config.sources, default_rule)
    built = []
    for i, (c, label) in enumerate(zip(config.sources, labels)):
        if c.kind == "rule":
            spec = c.name or default_rule
            if spec is None:
                raise ValueError(f"[rewards] sources[{i}]: a rule without name runs [data].reward, which is unset; "
                                 f"give the rule a name (e.g. name = \"arithmetic\") or set [data].reward")
            score = with_timeout(load_reward_fn(spec), timeout_s)
        elif c.kind == "model":
            score = model_scorer(c, device=device) if load_models or c.url is not None else _not_loaded(label)
        else:
            score = judge_runner(*_judge_engine(c, i, engines, tokenizer))
        built.append(Source(label=label, kind=c.kind, weight=float(c.weight), score=score))
    return RewardSources(sources=tuple(built), normalize=config.normalize, recipe=recipe)


def _not_loaded(label: str) -> Callable[[Sequence[Sample]], list[float]]:
    def score(samples: Sequence[Sample]) -> list[float]:
        raise RewardSourceError(f"reward source {label!r}: its model was not loaded in this process (the rollout "
                                f"process scores it, [rl] rollout_worker = \"process\")")

    return score


def _judge_engine(c: Any, index: int, engines: Sequence[Any], tokenizer: Any) -> tuple[Any, Any, Any]:
    """(engine, JudgeConfig, tokenizer) of a judge source."""
    from engines.tokenizer import load_tokenizer

    if c.engine is not None:  # an SGLang-protocol server (a real SGLang, or an embedded engine over HTTP)
        from engines.registry import EngineSpec, build_engine
        from trainer.rollout.reward_server import read_api_key

        engine = build_engine(EngineSpec(kind="sglang", url=c.engine), model_folder=c.path or "",
                              api_key=read_api_key(c.api_key_file), timeout_s=c.timeout_s)
    elif engines:
        engine = engines[0]
    else:
        raise ValueError(f"[rewards] sources[{index}]: a judge without engine is served by the run's first engine, "
                         f"and there is none; give the judge's engine URL")
    return engine, c.judge_config(), load_tokenizer(c.path) if c.path is not None else tokenizer


# ----------------------------------------------------------------------------------------------- checking
# Built-in dynamic filters that read rewards: inside the rollout they would see the rules' sum only.
REWARD_FILTERS = ("check_reward_nonzero_std", "check_min_reward", "check_quality_and_diversity")


def check_reward_sources(config: Any, *, default_rule: Any, dynamic_filters: Sequence[Any] = ()) -> None:
    """Before any work (trainer.cli's input check): every rule loads, every reward-model folder holds a sequence
    classifier with one output and a tokenizer, every judge's tokenizer folder and parser load, every key file
    reads, and no built-in reward filter would run before the models and judges score. Errors name the source."""
    from trainer.rollout.judge import load_parser
    from trainer.rollout.reward_model import check_reward_model_folder
    from trainer.rollout.reward_server import read_api_key

    for i, c in enumerate(config.sources):
        where = f"[rewards] sources[{i}] (kind = {c.kind!r})"
        try:
            if c.kind == "rule":
                if (c.name or default_rule) is None:
                    raise ValueError("a rule without name runs [data].reward, which is unset; give the rule a name "
                                     "(e.g. name = \"arithmetic\") or set [data].reward")
                load_reward_fn(c.name or default_rule)
            if c.kind == "model" and c.path is not None:
                check_reward_model_folder(c.path)
            if c.kind == "judge":
                if c.path is not None:
                    from engines.tokenizer import check_tokenizer_files

                    check_tokenizer_files(c.path)
                load_parser(c.judge_config())
            if c.api_key_file is not None:
                read_api_key(c.api_key_file)
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{where}: {e}") from e
        except (ValueError, OSError) as e:  # a bad name or folder, an unreadable key file
            raise ValueError(f"{where}: {e}") from e
    late = [c.kind for c in config.sources if c.kind != "rule"]
    bad = [f for f in dynamic_filters if f in REWARD_FILTERS]
    if late and bad:
        raise ValueError(f"[rl.rollout] dynamic_filters = {list(bad)} read each group's rewards inside the rollout, "
                         f"before the [rewards] {' and '.join(sorted(set(late)))} sources score the batch: they would "
                         f"see the rule sources' sum only; drop them, or score with rule sources alone")


def describe_rewards(config: Any, default_rule: Any) -> str:
    """One line naming what the RL reward is made of (printed at the start of the RL phase)."""
    labels = source_labels(config.sources, default_rule)
    where = {"rule": lambda c: c.name or default_rule, "judge": lambda c: c.engine or "the run's first engine",
             "model": lambda c: c.url or f"{c.path}, in the trainer's process"}
    parts = [f"{c.weight:g} x {label} ({c.kind}: {where[c.kind](c)})" for c, label in zip(config.sources, labels)]
    norm = ", each source z-scored over the batch" if config.normalize == "batch" else ""
    return f"rl reward: {' + '.join(parts)}{norm}; evaluation scores with [data].reward = {default_rule}"
