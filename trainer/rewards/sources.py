"""Reward sources: rules, reward models and LLM judges combined into the one reward the RL loop trains on.

    rewards = build_reward_sources(cfg.rewards, default_rule=cfg.data.reward, engines=engines, tokenizer=tok,
                                   device="cuda:0", timeout_s=cfg.data.reward_timeout_s)
    run_rl_training(..., reward_fn=rewards)

One system for both ways a run names its reward. [rewards] sources = [{kind, weight, ...}] builds one source per
entry; with no sources, [data].reward alone is shorthand for one rule source (`RewardSources.shorthand`: the rule's
result is the sample's reward as it is, its "correct" and metadata kept, an environment's own reward allowed, no
batch pass). The built `RewardSources` is what the rollout uses, in a worker thread or in a rollout process alike:
`rollout_reward()` is the manager's reward function and `score_batch` runs after each batch; its `recipe` rebuilds
it in the rollout process ([rl] rollout_worker = "process").

Kinds (SOURCE_KINDS, each with its config class in trainer.config.REWARD_SOURCE_CONFIGS) and where they score:
  rule   per sample, inside the rollout as each group finishes (async, each rule bounded by [data] reward_timeout_s):
         the rollout's reward function (`rule_reward`) runs every rule and returns their weighted sum, reporting
         each rule's raw score as a "source".
  model  per batch, after generation and before the batch goes to the trainer: in the rollout worker, so in async
         mode it overlaps the previous step's training. In the trainer's process on its device
         (trainer.rewards.model.RewardModelScorer) or through a scoring server (`url`:
         trainer.rewards.server).
  judge  per batch, likewise: one batched generate call to the judge's engine (trainer.rewards.judge).
A new kind: its config class in trainer.config (@reward_source_kind) and its entry here (@source_kind: build,
check, describe), whose built object implements `RewardSource`.

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
source is given). An environment that returns its own reward (multi-turn episodes) bypasses the rules; with
[rewards] sources such a sample is FAILED here with an error that says so, since its reward cannot be combined with
the sources'.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import statistics
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, Protocol

import trio

from trainer.config import (
    REWARD_SOURCE_CONFIGS,
    JudgeSourceConfig,
    ModelSourceConfig,
    RewardsConfig,
    RewardSourceConfig,
    RuleSourceConfig,
)
from trainer.rewards.rules import (
    MAX_ABS_REWARD,
    RewardFn,
    load_reward_fn,
    mark_failed,
    no_reward,
    reward_value,
    with_timeout,
)
from trainer.rewards.rules import _clean as strip_special_markers
from trainer.rollout.samples import build_batch_metadata
from trainer.types import RolloutBatch, Sample, Status


class RewardSourceError(RuntimeError):
    """One reward source failed on a sample (the message names the source)."""


class RewardSource(Protocol):
    """One built reward source. per_sample: True, it scores one sample at a time inside the rollout
    (`score_sample`, awaited by the rollout's reward function) and has nothing left to do per batch; False, it
    scores the batch after generation (`score_batch`) and has no per-sample score."""

    kind: str
    label: str
    weight: float
    per_sample: bool

    async def score_sample(self, sample: Sample) -> Any:
        """The sample's score as a reward function returns it (a number, or a dict with "reward")."""

    def score_batch(self, samples: list[Sample], todo: list[int]) -> dict[str, int]:
        """Score samples[i] for i in todo, replacing each with its scored (or FAILED) copy; returns counts to sum
        into the batch's metrics (e.g. judge/judged)."""


@dataclasses.dataclass(frozen=True)
class BuildContext:
    """What a source is built with besides its config. default_rule: [data].reward (a rule without `name` runs it).
    engines: the run's (a judge without `engine` is served by the first). tokenizer: the run's model's. device: where
    in-process reward models run (the trainer's). timeout_s: each rule call's limit. load_models=False: in-process
    reward models are not loaded here (a rollout process loads its own from the recipe); scoring with one raises."""

    default_rule: Any
    engines: Sequence[Any]
    tokenizer: Any
    device: str = "cpu"
    timeout_s: float | None = None
    load_models: bool = True


@dataclasses.dataclass(frozen=True)
class SourceKind:
    """A kind's entry in SOURCE_KINDS. source: the class it builds (a RewardSource; its per_sample says where it
    scores). build(config, label, index, ctx) -> a source. check(config, default_rule): before any work, raise
    ValueError / FileNotFoundError for what would fail at build (a rule that does not load, a folder without a
    model). where(config, default_rule): what it scores with, for `describe_rewards`. name(config, default_rule): its
    derived label (None: kind + index)."""

    source: type
    build: Callable[[Any, str, int, BuildContext], RewardSource]
    check: Callable[[Any, Any], None]
    where: Callable[[Any, Any], str]
    name: Callable[[Any, Any], str | None] = lambda config, default_rule: None


SOURCE_KINDS: dict[str, SourceKind] = {}


def source_kind(config_class: type[RewardSourceConfig], source: type, **entry: Any) -> None:
    """Register what a kind does (SourceKind) under its config class's kind (trainer.config.REWARD_SOURCE_CONFIGS),
    which is also its source class's `kind`."""
    kind = config_class.__dataclass_fields__["kind"].default
    assert REWARD_SOURCE_CONFIGS.get(kind) is config_class, f"register {config_class.__name__} in trainer.config first"
    assert source.kind == kind and kind not in SOURCE_KINDS, f"reward source kind {kind!r}: one class, one entry"
    SOURCE_KINDS[kind] = SourceKind(source=source, **entry)


@dataclasses.dataclass(frozen=True)
class RewardsRecipe:
    """What `build_reward_sources` was given, but the engines and tokenizer: a rollout process ([rl] rollout_worker =
    "process") builds the same sources from it with its own engine clients (`build`). Picklable when the default
    rule is a name or a module-level function."""

    config: RewardsConfig
    default_rule: Any
    device: str = "cpu"
    timeout_s: float | None = None

    def build(self, *, engines: Sequence[Any], tokenizer: Any) -> RewardSources:
        return build_reward_sources(self.config, default_rule=self.default_rule, engines=engines, tokenizer=tokenizer,
                                    device=self.device, timeout_s=self.timeout_s)


@dataclasses.dataclass(frozen=True)
class RewardSources:
    """The sources of a run, built once (rules loaded, reward models loaded, judge engines chosen), and how they
    combine; `recipe` rebuilds them in another process. shorthand: [data].reward alone (one rule source, no
    [rewards] sources): its result is the reward as it is, and there is no batch pass."""

    sources: tuple[RewardSource, ...]
    normalize: str = "none"
    recipe: RewardsRecipe | None = None
    shorthand: bool = False

    def __post_init__(self) -> None:
        labels = [s.label for s in self.sources]
        if len(set(labels)) != len(labels):
            raise ValueError(f"reward source labels {labels} must be unique")
        if self.normalize not in ("none", "batch"):
            raise ValueError(f"normalize={self.normalize!r}: choose 'none' or 'batch'")
        assert not self.shorthand or (len(self.sources) == 1 and isinstance(self.sources[0], RuleSource)), \
            "the [data].reward shorthand is one rule source"

    @property
    def weights(self) -> dict[str, float]:
        return {s.label: s.weight for s in self.sources}

    @property
    def scores_batches(self) -> bool:
        """Whether each batch goes through `score_batch` after the rollout (not for the [data].reward shorthand)."""
        return not self.shorthand

    def rollout_reward(self) -> RewardFn | None:
        """The rollout's reward function: the shorthand's rule as it is, else every per-sample source on one sample
        (None when there is none)."""
        if self.shorthand:
            return self.sources[0].fn
        per_sample = [s for s in self.sources if s.per_sample]
        return rule_reward(per_sample) if per_sample else None


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


def source_labels(configs: Sequence[RewardSourceConfig], default_rule: Any) -> list[str]:
    """The labels of the sources' configs, unique: a source's `label`, else its kind's derived name (a rule's
    function name), else kind + index; a repeated derived one gets its index appended."""
    out: list[str] = []
    given = {c.label for c in configs if c.label}
    for i, c in enumerate(configs):
        label = c.label or SOURCE_KINDS[c.kind].name(c, default_rule) or f"{c.kind}{i}"
        if not c.label and (label in out or label in given):
            label = f"{label}{i}"
        out.append(label)
    return out


# ----------------------------------------------------------------------------------------------- per sample
def rule_reward(sources: Sequence[RewardSource]) -> RewardFn:
    """A reward function (for the rollout manager) that runs every per-sample source on a sample: it returns their
    weighted sum, the first verdict one gives ("correct"), and each one's raw score as "sources". A source that
    raises (or times out, or returns no number) fails the sample with an error naming it."""

    async def reward(sample: Sample) -> dict[str, Any]:
        raw: dict[str, float] = {}
        correct = None
        for src in sources:
            try:
                raw[src.label], verdict = reward_value(await src.score_sample(sample))
            except Exception as e:  # noqa: BLE001 - a failing rule fails its sample, named
                raise RewardSourceError(f"reward source {src.label!r} ({src.kind}) failed: {type(e).__name__}: "
                                        f"{e}") from e
            correct = verdict if correct is None else correct
        return {"reward": math.fsum(s.weight * raw[s.label] for s in sources), "correct": correct, "sources": raw}

    return reward


# ----------------------------------------------------------------------------------------------- batches
def _with_score(sample: Sample, label: str, score: float, **extra: Any) -> Sample:
    sources = {**sample.metadata.get("reward_sources", {}), label: float(score)}
    return dataclasses.replace(sample, metadata={**sample.metadata, **extra, "reward_sources": sources})


def _source_failed(sample: Sample, src: RewardSource, message: str) -> Sample:
    failed = mark_failed(sample, RewardSourceError(f"reward source {src.label!r} ({src.kind}) failed: {message}"))
    return dataclasses.replace(failed, metadata={**failed.metadata, "reward_failed_source": src.label})


def _environment_reward(sample: Sample) -> bool:
    """A finished sample that has a reward but no source scores: its environment (or agent) gave the reward."""
    return sample.status != Status.FAILED and sample.reward is not None and "reward_sources" not in sample.metadata


def score_batch(batch: RolloutBatch, rewards: RewardSources) -> RolloutBatch:
    """The batch with every per-batch source scored, each sample's combined reward, the batch's reward statistics
    recomputed and the sources' metrics in metadata["reward_metrics"] (module docstring). The [data].reward
    shorthand has no batch pass: the batch as it is."""
    if not rewards.scores_batches:
        return batch
    samples = list(batch.samples)
    for i, s in enumerate(samples):
        if _environment_reward(s):
            samples[i] = mark_failed(s, RewardSourceError(
                "the environment gave this sample its own reward, which bypasses the [rewards] rule sources and "
                "cannot be combined with the other sources; score such episodes with rule sources (drop the "
                "environment's reward) or leave [rewards] sources empty"))
    counts: dict[str, int] = {}
    for src in rewards.sources:
        todo = [i for i, s in enumerate(samples) if s.status != Status.FAILED]
        if not todo:
            break
        for k, v in src.score_batch(samples, todo).items():
            counts[k] = counts.get(k, 0) + v
    weights = rewards.weights
    combined = combine_scores([None if s.status == Status.FAILED else s.metadata.get("reward_sources", {})
                               for s in samples], weights, rewards.normalize)
    samples = [s if r is None else dataclasses.replace(s, reward=r) for s, r in zip(samples, combined)]
    metrics = {**source_metrics(samples, list(weights)), **counts}
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
    mode); closing this closes `batches`. Without a batch pass: `batches` as they are."""
    return _scored(batches, rewards) if rewards.scores_batches else batches


def _scored(batches: Iterator[RolloutBatch], rewards: RewardSources) -> Iterator[RolloutBatch]:
    try:
        for batch in batches:
            yield score_batch(batch, rewards)
    finally:
        close = getattr(batches, "close", None)  # a generator (the manager's) or any plain iterator
        if close is not None:
            close()


# ----------------------------------------------------------------------------------------------- rule
@dataclasses.dataclass(frozen=True)
class RuleSource:
    """kind = "rule": a reward function of one sample (bounded by the timeout), scored inside the rollout."""

    label: str
    weight: float
    fn: RewardFn
    kind: ClassVar[str] = "rule"
    per_sample: ClassVar[bool] = True

    async def score_sample(self, sample: Sample) -> Any:
        value = self.fn(sample)
        return await value if inspect.isawaitable(value) else value

    def score_batch(self, samples: list[Sample], todo: list[int]) -> dict[str, int]:
        return {}  # scored in the rollout already


def _rule_spec(config: RuleSourceConfig, default_rule: Any) -> Any:
    spec = config.name or default_rule
    if spec is None:
        raise ValueError("a rule without name runs [data].reward, which is unset; give the rule a name "
                         "(e.g. name = \"arithmetic\") or set [data].reward")
    return spec


def _build_rule(config: RuleSourceConfig, label: str, index: int, ctx: BuildContext) -> RuleSource:
    try:
        spec = _rule_spec(config, ctx.default_rule)
    except ValueError as e:
        raise ValueError(f"[rewards] sources[{index}]: {e}") from e
    return RuleSource(label=label, weight=float(config.weight), fn=with_timeout(load_reward_fn(spec), ctx.timeout_s))


def _rule_name(config: RuleSourceConfig, default_rule: Any) -> str | None:
    spec = config.name or default_rule
    if callable(spec):
        return getattr(spec, "__name__", None)
    return None if spec is None else str(spec).rsplit(":", 1)[-1]


source_kind(RuleSourceConfig, RuleSource, build=_build_rule,
            check=lambda c, default: load_reward_fn(_rule_spec(c, default)),
            where=lambda c, default: c.name or default, name=_rule_name)


# ----------------------------------------------------------------------------------------------- model
@dataclasses.dataclass(frozen=True)
class ModelSource:
    """kind = "model": samples -> one score each (input order), scored per batch after the rollout."""

    label: str
    weight: float
    scorer: Callable[[Sequence[Sample]], list[float]]
    kind: ClassVar[str] = "model"
    per_sample: ClassVar[bool] = False

    async def score_sample(self, sample: Sample) -> Any:
        raise TypeError("a reward model scores whole batches (score_batch), after the rollout")

    def score_batch(self, samples: list[Sample], todo: list[int]) -> dict[str, int]:
        from trainer.rewards.server import RewardServerError

        try:
            scores = self.scorer([samples[i] for i in todo])
        except RewardServerError as e:  # the server's fault, not the samples': the batch goes on without them
            for i in todo:
                samples[i] = _source_failed(samples[i], self, str(e))
            return {}
        for i, x in zip(todo, scores):
            if math.isfinite(x) and abs(x) <= MAX_ABS_REWARD:
                samples[i] = _with_score(samples[i], self.label, x)
            else:
                samples[i] = _source_failed(samples[i], self, f"the reward model scored the sample {x} (non-finite "
                                                              f"or beyond +-{MAX_ABS_REWARD:g})")
        return {}


def model_scorer(config: ModelSourceConfig, *, device: str) -> Callable[[Sequence[Sample]], list[float]]:
    """samples -> scores of a model source: its folder loaded here on `device`, or its scoring server."""
    if config.url is None:
        from trainer.rewards.model import RewardModelScorer

        return RewardModelScorer.from_pretrained(config.path, device=device, batch_size=config.batch_size,
                                                 chat=config.chat, max_length=config.max_length)
    from trainer.rewards.server import read_api_key, score_remote

    api_key = read_api_key(config.api_key_file)

    def score(samples: Sequence[Sample]) -> list[float]:
        return score_remote(config.url, [s.prompt for s in samples],
                            [strip_special_markers(s.response) for s in samples],
                            [s.metadata.get("system_prompt") for s in samples], api_key=api_key,
                            timeout_s=config.timeout_s)

    return score


def _not_loaded(label: str) -> Callable[[Sequence[Sample]], list[float]]:
    def score(samples: Sequence[Sample]) -> list[float]:
        raise RewardSourceError(f"reward source {label!r}: its model was not loaded in this process (the rollout "
                                f"process scores it, [rl] rollout_worker = \"process\")")

    return score


def _build_model(config: ModelSourceConfig, label: str, index: int, ctx: BuildContext) -> ModelSource:
    local = config.url is None
    scorer = model_scorer(config, device=ctx.device) if ctx.load_models or not local else _not_loaded(label)
    return ModelSource(label=label, weight=float(config.weight), scorer=scorer)


def _check_model(config: ModelSourceConfig, default_rule: Any) -> None:
    from trainer.rewards.model import check_reward_model_folder
    from trainer.rewards.server import read_api_key

    if config.path is not None:
        check_reward_model_folder(config.path)
    if config.api_key_file is not None:
        read_api_key(config.api_key_file)


source_kind(ModelSourceConfig, ModelSource, build=_build_model, check=_check_model,
            where=lambda c, default: c.url or f"{c.path}, in the trainer's process")


# ----------------------------------------------------------------------------------------------- judge
@dataclasses.dataclass(frozen=True)
class JudgeSource:
    """kind = "judge": samples -> (judged samples, counts) through the judge's engine, as
    trainer.rewards.judge.judge_samples returns them, scored per batch after the rollout."""

    label: str
    weight: float
    run: Callable[[Sequence[Sample]], Any]
    kind: ClassVar[str] = "judge"
    per_sample: ClassVar[bool] = False

    async def score_sample(self, sample: Sample) -> Any:
        raise TypeError("a judge scores whole batches (score_batch), after the rollout")

    def score_batch(self, samples: list[Sample], todo: list[int]) -> dict[str, int]:
        judged, counts = self.run([samples[i] for i in todo])
        for i, j in zip(todo, judged):
            text = {"judge_text": j.metadata["judge_text"]} if "judge_text" in j.metadata else {}
            if j.status == Status.FAILED:
                # judge_samples printed the error once already: the sample is marked here without printing it again.
                meta = {**samples[i].metadata, **text, "reward_failed_source": self.label,
                        "reward_error": f"reward source {self.label!r} (judge) failed: "
                                        f"{j.metadata.get('reward_error')}",
                        "reward_traceback": j.metadata.get("reward_traceback", "")}
                samples[i] = dataclasses.replace(samples[i], reward=0.0, status=Status.FAILED, metadata=meta)
            else:
                samples[i] = _with_score(samples[i], self.label, j.reward, **text)
        return counts


def judge_runner(engine: Any, judge_config: Any, tokenizer: Any) -> Callable[[Sequence[Sample]], Any]:
    """samples -> (judged samples, counts) through `engine`, in an event loop of its own (the rollout worker's batch
    transform is synchronous); the engine's pooled connections of that loop are closed after."""
    from trainer.rewards.judge import judge_samples

    async def run(samples: Sequence[Sample]) -> Any:
        try:
            return await judge_samples(engine, samples, judge_config, tokenizer)
        finally:
            with trio.move_on_after(2):  # HTTP engines pool connections per event loop
                await engine.aclose()

    return lambda samples: trio.run(run, samples)


def _build_judge(config: JudgeSourceConfig, label: str, index: int, ctx: BuildContext) -> JudgeSource:
    """A judge source: its engine (its own URL, else the run's first), its tokenizer (its folder's, else the run's)."""
    from engines.tokenizer import load_tokenizer

    if config.engine is not None:  # an SGLang-protocol server (a real SGLang, or an embedded engine over HTTP)
        from engines.registry import EngineSpec, build_engine
        from trainer.rewards.server import read_api_key

        engine = build_engine(EngineSpec(kind="sglang", url=config.engine), model_folder=config.path or "",
                              api_key=read_api_key(config.api_key_file), timeout_s=config.timeout_s)
    elif ctx.engines:
        engine = ctx.engines[0]
    else:
        raise ValueError(f"[rewards] sources[{index}]: a judge without engine is served by the run's first engine, "
                         f"and there is none; give the judge's engine URL")
    tokenizer = load_tokenizer(config.path) if config.path is not None else ctx.tokenizer
    return JudgeSource(label=label, weight=float(config.weight), run=judge_runner(engine, config.judge_config(),
                                                                                    tokenizer))


def _check_judge(config: JudgeSourceConfig, default_rule: Any) -> None:
    from trainer.rewards.judge import load_parser
    from trainer.rewards.server import read_api_key

    if config.path is not None:
        from engines.tokenizer import check_tokenizer_files

        check_tokenizer_files(config.path)
    load_parser(config.judge_config())
    if config.api_key_file is not None:
        read_api_key(config.api_key_file)


source_kind(JudgeSourceConfig, JudgeSource, build=_build_judge, check=_check_judge,
            where=lambda c, default: c.engine or "the run's first engine")
assert set(SOURCE_KINDS) == set(REWARD_SOURCE_CONFIGS), "every kind of trainer.config needs its entry here"


# ----------------------------------------------------------------------------------------------- building
def build_reward_sources(config: RewardsConfig, *, default_rule: Any, engines: Sequence[Any], tokenizer: Any,
                         device: str = "cpu", timeout_s: float | None = None,
                         load_models: bool = True) -> RewardSources:
    """The run's RewardSources from a trainer.config.RewardsConfig: its sources, or with none the [data].reward
    shorthand (one rule running `default_rule`; None: trainer.rewards.rules.no_reward, the episodes give their own
    rewards). BuildContext says what the other arguments are."""
    recipe = RewardsRecipe(config=config, default_rule=default_rule, device=device, timeout_s=timeout_s)
    if not config.sources:
        spec = no_reward if default_rule is None else default_rule
        fn, label = with_timeout(load_reward_fn(spec), timeout_s), _rule_name(RuleSourceConfig(), spec) or "reward"
        return RewardSources(sources=(RuleSource(label=label, weight=1.0, fn=fn),), recipe=recipe, shorthand=True)
    ctx = BuildContext(default_rule=default_rule, engines=engines, tokenizer=tokenizer, device=device,
                       timeout_s=timeout_s, load_models=load_models)
    labels = source_labels(config.sources, default_rule)
    built = tuple(SOURCE_KINDS[c.kind].build(c, label, i, ctx)
                  for i, (c, label) in enumerate(zip(config.sources, labels)))
    return RewardSources(sources=built, normalize=config.normalize, recipe=recipe)


def as_reward_sources(reward: Any, *, timeout_s: float | None) -> RewardSources:
    """What run_rl_training's `reward_fn` may be: built RewardSources as they are, else a reward function, its name,
    or None (the episodes' own rewards), as the [data].reward shorthand."""
    if isinstance(reward, RewardSources):
        return reward
    return build_reward_sources(RewardsConfig(), default_rule=reward, engines=(), tokenizer=None, timeout_s=timeout_s)


# ----------------------------------------------------------------------------------------------- checking
# Built-in dynamic filters that read rewards: inside the rollout they would see the rules' sum only.
REWARD_FILTERS = ("check_reward_nonzero_std", "check_min_reward", "check_quality_and_diversity")


def check_reward_sources(config: RewardsConfig, *, default_rule: Any, dynamic_filters: Sequence[Any] = ()) -> None:
    """Before any work (trainer.cli's input check): each source's kind checks what would fail at build (every rule
    loads, every reward-model folder holds a sequence classifier with one output and a tokenizer, every judge's
    tokenizer folder and parser load, every key file reads), and no built-in reward filter runs before the per-batch
    sources score. Errors name the source."""
    for i, c in enumerate(config.sources):
        where = f"[rewards] sources[{i}] (kind = {c.kind!r})"
        try:
            SOURCE_KINDS[c.kind].check(c, default_rule)
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{where}: {e}") from e
        except (ValueError, OSError) as e:  # a bad name or folder, an unreadable key file
            raise ValueError(f"{where}: {e}") from e
    late = [c.kind for c in config.sources if not SOURCE_KINDS[c.kind].source.per_sample]
    bad = [f for f in dynamic_filters if f in REWARD_FILTERS]
    if late and bad:
        raise ValueError(f"[rl.rollout] dynamic_filters = {list(bad)} read each group's rewards inside the rollout, "
                         f"before the [rewards] {' and '.join(sorted(set(late)))} sources score the batch: they would "
                         f"see the rule sources' sum only; drop them, or score with rule sources alone")


def describe_rewards(config: RewardsConfig, default_rule: Any) -> str:
    """One line naming what the RL reward is made of (printed at the start of the RL phase)."""
    labels = source_labels(config.sources, default_rule)
    parts = [f"{c.weight:g} x {label} ({c.kind}: {SOURCE_KINDS[c.kind].where(c, default_rule)})"
             for c, label in zip(config.sources, labels)]
    norm = ", each source z-scored over the batch" if config.normalize == "batch" else ""
    return f"rl reward: {' + '.join(parts)}{norm}; evaluation scores with [data].reward = {default_rule}"
