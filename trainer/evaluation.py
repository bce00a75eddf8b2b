"""Evaluation on held-out sets through the engines: greedy accuracy, pass@k and avg@k, before, during and after
training.

    got = evaluate(engines, prompts, tokenizer=tok, reward_fn="arithmetic", max_new_tokens=16, k=8)
    got["accuracy"], got["pass@1"], got["pass@8"], got["avg@8"]

One greedy (temperature 0) answer per prompt gives `accuracy` and `reward_mean`; with k > 0, k sampled answers per
prompt (eval-only temperature, seeds derived from the eval seed and the prompt's position: the training stream's
seeds and data order are never touched) give pass@j for j = 1, 2, 4, ..., k by the unbiased estimator of Chen et
al. (2021), and avg@k, the mean correctness of the k answers. A sample is correct by the reward's own verdict when
it returns one ({"reward": r, "correct": bool}), else when its reward reaches `max_reward`.

`Evaluator` runs every set of a run ([data].eval, named "eval", and each [[eval.sets]] entry) and keeps the last
and best figures of each for the summary; the training loops call it through an `Evaluation` (every N steps, after
the weight sync, and at the ends of each phase).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import trio

from engines.protocol import InferenceEngine
from trainer.config import DataConfig, RunConfig
from trainer.stops import RunStopped


# ----------------------------------------------------------------------------------------------- pass@k
def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from n answers of which c are correct: 1 - C(n-c, k) / C(n, k), the
    probability that k answers drawn without replacement from the n hold at least one correct one. Written as a
    product (no big binomials): C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i)."""
    assert 0 <= c <= n and 1 <= k <= n, (n, c, k)
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def pass_ks(k: int) -> list[int]:
    """The j of the pass@j figures reported for k answers a prompt: the powers of two below k, and k."""
    return [j for j in (2 ** e for e in range(k.bit_length())) if j < k] + [k] if k > 0 else []


def _sample_seed(seed: int, index: int) -> int:
    """The seed of prompt `index`'s k answers (answer j: seed + j, SamplingParams' rule): fixed by the eval seed and
    the prompt's position alone, so an evaluation is the same whenever it runs."""
    return (seed * 1_000_003 + index * 7_919 + 104_729) % (2 ** 31)


# ----------------------------------------------------------------------------------------------- one set
def evaluate(engines: Sequence[InferenceEngine], prompts: Sequence[Any], *, tokenizer: Any, reward_fn: Any,
             max_new_tokens: int, chat: bool = True, max_reward: float = 1.0,
             reward_timeout_s: float | None = DataConfig.reward_timeout_s, rollout: Any = None, k: int = 0,
             temperature: float = 1.0, seed: int = 0) -> dict[str, float]:
    """Evaluate `prompts` (trainer.data.buffer.Prompt records) on the whole fleet `engines` (engine objects, built by
    engines.registry like every other; prompt i on engines[i % len(engines)], all at once): {"reward_mean",
    "accuracy", "n", "failed"} from one greedy answer a prompt, and with k > 0 also "pass@j" (j in pass_ks(k)),
    "avg@k" and "reward_mean@k" from k sampled answers. The figures do not depend on the fleet's size: each prompt's
    answers are seeded by the eval seed and its position.

    Samples whose reward function raised, or outlasted `reward_timeout_s`, count as wrong with reward 0 (their
    errors are printed as they happen). With a `rollout` config that names an env, tools or a rollout_fn, each
    answer is one multi-turn episode of it (trainer.rollout.episodes), scored as in training (reward_fn None: by
    the environment's or rollout_fn's own reward; an episode given none is FAILED and counts as wrong).
    """
    from trainer.rewards.rules import describe_failure, load_reward_fn, no_reward, with_timeout
    from trainer.rollout.samples import prompt_token_ids

    if not engines or isinstance(engines[0], str):
        raise TypeError(f"evaluate: engines = {list(engines)[:1]!r}: give engine objects (engines.registry.build_engine"
                        f" or trainer.run.build_engines), not URLs")
    ids = [prompt_token_ids(tokenizer, p.prompt, chat=chat, system=p.system) for p in prompts]
    # No reward function: each episode's environment or rollout_fn gives its reward; one given none is FAILED.
    score = with_timeout(load_reward_fn(no_reward if reward_fn is None else reward_fn), reward_timeout_s)
    answer = _Answerer(tuple(engines), prompts, ids, tokenizer=tokenizer, chat=chat, score=score,
                       max_new_tokens=max_new_tokens, rollout=rollout)
    greedy = trio.run(answer.greedy)
    n_failed = sum(1 for s in greedy if "reward_error" in s.metadata)
    if greedy and n_failed == len(greedy):
        # The error itself, not "see above": an error printed once per process (an earlier evaluation, the rollouts)
        # is not printed again.
        # A run-time stop: `python -m trainer` prints it as one `error:` line (its traceback with RLKERNELS_DEBUG=1).
        raise RunStopped(f"evaluation: the reward function failed on all {n_failed} samples; the first: "
                         f"{describe_failure(greedy[0])}")
    n = max(len(greedy), 1)
    out = {"reward_mean": sum(s.reward or 0.0 for s in greedy) / n,
           "accuracy": sum(_correct(s, max_reward) for s in greedy) / n, "n": len(greedy), "failed": n_failed}
    if k > 0 and prompts:
        groups = trio.run(answer.sampled, k, temperature, seed)  # [len(prompts)][k]
        right = [sum(_correct(s, max_reward) for s in g) for g in groups]
        out.update({f"pass@{j}": sum(pass_at_k(k, c, j) for c in right) / len(right) for j in pass_ks(k)})
        out[f"avg@{k}"] = sum(right) / (k * len(right))
        out[f"reward_mean@{k}"] = sum(s.reward or 0.0 for g in groups for s in g) / (k * len(groups))
    return out


def _correct(sample: Any, max_reward: float) -> bool:
    from trainer.types import Status

    if sample.correct is not None:
        return bool(sample.correct)
    return sample.status != Status.FAILED and sample.reward is not None and sample.reward >= max_reward


@dataclasses.dataclass(frozen=True)
class _Answerer:
    """The answers of one evaluation: greedy (one a prompt) or sampled (k a prompt), single-turn or episodes, spread
    over the fleet (`over_fleet`)."""

    engines: tuple[Any, ...]
    prompts: Sequence[Any]
    ids: Sequence[list[int]]
    tokenizer: Any
    chat: bool
    score: Callable[[Any], Any]
    max_new_tokens: int
    rollout: Any

    @property
    def episodes(self) -> bool:
        r = self.rollout
        return r is not None and bool(r.env or r.tools or r.rollout_fn or r.agent)

    @property
    def run_episodes(self) -> Any:
        """The episodes' runner: an OpenAI-client agent's through the gateway, else an env / tools / rollout_fn's."""
        if self.rollout.agent:
            from trainer.rollout.gateway import run_eval_agents

            return run_eval_agents
        from trainer.rollout.episodes import run_eval_episodes

        return run_eval_episodes

    def _opening(self, i: int, j: int) -> Any:
        from trainer.types import Sample

        p = self.prompts[i]
        return Sample(prompt=p.prompt, tokens=tuple(self.ids[i]), group_index=i, index=j, metadata={
            **p.metadata, "answer": p.answer, **({"system_prompt": p.system} if p.system else {})})

    async def over_fleet(self, n: int, run: Callable[[Any, list[int]], Any]) -> list[Any]:
        """`await run(engine, items)` for each engine's share of items 0 .. n-1 (item i on engines[i % len]), all in
        flight together; one result an item, in item order."""
        out: list[Any] = [None] * n

        async def share(engine: Any, items: list[int]) -> None:
            for i, got in zip(items, await run(engine, items), strict=True):
                out[i] = got

        async with trio.open_nursery() as nursery:
            for e, engine in enumerate(self.engines):
                if items := list(range(e, n, len(self.engines))):
                    nursery.start_soon(share, engine, items)
        return out

    async def greedy(self) -> list[Any]:
        if self.episodes:
            return await self.over_fleet(len(self.prompts), lambda engine, items: self.run_episodes(
                engine, [self._opening(i, 0) for i in items], self.rollout, tokenizer=self.tokenizer,
                max_new_tokens=self.max_new_tokens, score=self.score))
        from engines.protocol import SamplingParams

        params = SamplingParams(temperature=0.0, max_new_tokens=self.max_new_tokens, stop_token_ids=self._stops())
        outs = await self.over_fleet(len(self.prompts),
                                     lambda engine, items: engine.generate([self.ids[i] for i in items], params))
        return [g[0] for g in await self._scored([[g[0]] for g in outs])]

    async def sampled(self, k: int, temperature: float, seed: int) -> list[list[Any]]:
        """k answers a prompt at `temperature`, prompt i's seeded by _sample_seed(seed, i): [len(prompts)][k]."""
        if self.episodes:  # item i * k + j: prompt i's answer j
            flat = await self.over_fleet(len(self.prompts) * k, lambda engine, items: self.run_episodes(
                engine, [self._opening(x // k, x % k) for x in items], self.rollout, tokenizer=self.tokenizer,
                max_new_tokens=self.max_new_tokens, score=self.score, temperature=temperature,
                seeds=[_sample_seed(seed, x // k) + x % k for x in items]))
            return [flat[i * k:(i + 1) * k] for i in range(len(self.prompts))]
        from engines.protocol import SamplingParams

        async def answers(engine: Any, items: list[int]) -> list[Any]:
            async def one(i: int) -> None:
                params = SamplingParams(temperature=temperature, max_new_tokens=self.max_new_tokens,
                                        stop_token_ids=self._stops(), n=k, seed=_sample_seed(seed, i))
                got[i] = (await engine.generate([self.ids[i]], params))[0]

            got: dict[int, Any] = {}
            async with trio.open_nursery() as nursery:  # in flight together: the engine batches them
                for i in items:
                    nursery.start_soon(one, i)
            return [got[i] for i in items]

        return await self._scored(await self.over_fleet(len(self.prompts), answers))

    def _stops(self) -> tuple[int, ...]:
        from trainer.rollout.samples import stop_token_ids

        return tuple(stop_token_ids(self.tokenizer, chat=self.chat))

    async def _scored(self, groups: Sequence[Sequence[Any]]) -> list[list[Any]]:
        """The completions of each prompt (one group a prompt) as scored Samples: [len(prompts)][len(group)]."""
        from trainer.rewards.rules import acompute_reward
        from trainer.types import Sample, Status

        out = []
        for p, prompt_ids, group in zip(self.prompts, self.ids, groups):
            samples = [Sample(prompt=p.prompt, tokens=tuple(prompt_ids) + tuple(c.output_ids),
                              response=self.tokenizer.decode(c.output_ids), response_length=len(c.output_ids),
                              metadata={**p.metadata, "answer": p.answer}, status=Status.COMPLETED) for c in group]
            out.append([await acompute_reward(s, self.score) for s in samples])
        return out


# ----------------------------------------------------------------------------------------------- a run's sets
@dataclasses.dataclass(frozen=True)
class EvalSet:
    """One held-out set of a run: its prompts and how they are scored."""

    name: str  # metrics: eval/<name>/...
    prompts: tuple[Any, ...]  # trainer.data.buffer.Prompt records
    reward: Any  # a reward function or its name (trainer.rewards.rules.load_reward_fn)
    reward_timeout_s: float | None


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """What a training loop needs to evaluate as it goes: `run(step)` returns the eval/... metrics of the weights the
    engines serve (the RL loop calls it right after a weight sync; SFT's `run` syncs first), at step 0 when
    `at_start`, every `every` steps (0: never in between) and at the phase's last step when `at_end` (SFT followed
    by RL leaves that to RL's step 0: the same weights)."""

    every: int
    run: Callable[[int], dict[str, float]]
    at_start: bool = True
    at_end: bool = True

    def due(self, step: int, num_steps: int) -> bool:
        if step == num_steps:
            return self.at_end
        return self.every > 0 and step % self.every == 0


def eval_sets(cfg: RunConfig, *, tokenizer: Any = None) -> list[EvalSet]:
    """The run's held-out sets: [data].eval as "eval" (when given), then each [[eval.sets]] entry, each cut to its
    limit ([[eval.sets]] limit, else [eval] limit). With a tokenizer, text it has no token for is warned about."""
    from trainer.data.buffer import config_prompts, warn_unknown_characters

    data, ev = cfg.data, cfg.eval
    entries = ([("eval", data.eval, data.mapping(), data.reward, data.reward_timeout_s, ev.limit)]
               if data.eval is not None else [])
    for s in ev.sets:
        entries.append((s.name, s.path, s.mapping(data), s.reward or data.reward,
                        s.reward_timeout_s or data.reward_timeout_s, ev.limit if s.limit is None else s.limit))
    out = []
    for name, path, mapping, reward, timeout, limit in entries:
        where = "[data].eval" if name == "eval" and path is data.eval else f"[[eval.sets]] {name!r}"
        prompts = config_prompts(path, mapping, where=where)[: limit or None]
        if tokenizer is not None:
            warn_unknown_characters(tokenizer, [p.prompt for p in prompts], where=where)
        out.append(EvalSet(name=name, prompts=tuple(prompts), reward=reward, reward_timeout_s=timeout))
    return out


class Evaluator:
    """Evaluates every set of a run on the whole fleet and remembers the last and the best figures of each (by
    greedy accuracy) for the summary. `evaluator(phase, step, label=None)` -> {"eval/<set>/<figure>": value}; a
    `label` ("before_sft", "after_rl", ...) also records the first set's accuracy and mean reward under it, the
    summary's older keys (accuracy_<label>). Mutable (the figures kept): why this is a class."""

    def __init__(self, sets: Sequence[EvalSet], engines: Sequence[InferenceEngine], cfg: RunConfig, *,
                 tokenizer: Any, rollout: Any) -> None:
        self.sets, self.engines, self.tokenizer, self.rollout = list(sets), list(engines), tokenizer, rollout
        self.settings = dict(max_new_tokens=cfg.eval.max_new_tokens or cfg.rl.rollout.max_new_tokens,
                             chat=cfg.data.format == "chat", max_reward=cfg.eval.max_reward, k=cfg.eval.k,
                             temperature=cfg.eval.temperature, seed=cfg.eval.seed)
        self.last: dict[str, dict[str, Any]] = {}
        self.best: dict[str, dict[str, Any]] = {}
        self.labelled: dict[str, dict[str, float]] = {}

    def __bool__(self) -> bool:
        return bool(self.sets and self.engines)

    def __call__(self, phase: str, step: int, *, label: str | None = None) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for s in self.sets if self else ():
            got = evaluate(self.engines, s.prompts, tokenizer=self.tokenizer, reward_fn=s.reward,
                           reward_timeout_s=s.reward_timeout_s, rollout=self.rollout, **self.settings)
            figures = {k: float(v) for k, v in got.items() if k not in ("n", "failed")}
            metrics.update({f"eval/{s.name}/{k}": v for k, v in figures.items()})
            mark = {**figures, "phase": phase, "step": step}
            self.last[s.name] = mark
            if s.name not in self.best or figures["accuracy"] > self.best[s.name]["accuracy"]:
                self.best[s.name] = mark
            extra = "".join(f", {k} {v:.3f}" for k, v in figures.items() if "@" in k)
            print(f"[{label or f'{phase} step {step}'}] {s.name}: accuracy {figures['accuracy']:.3f}, mean reward "
                  f"{figures['reward_mean']:.3f}{extra} on {got['n']} problems", flush=True)
            if label is not None and s is self.sets[0]:
                self.labelled[label] = {"accuracy": figures["accuracy"], "reward_mean": figures["reward_mean"]}
        return metrics

    def summary(self) -> dict[str, Any]:
        """The summary file's part: accuracy_<label> / reward_mean_<label> of the first set, and per set the last
        and the best evaluation ({"last": {figures, phase, step}, "best": ...})."""
        out: dict[str, Any] = {}
        for label, figs in self.labelled.items():
            out[f"accuracy_{label}"] = figs["accuracy"]
            out[f"reward_mean_{label}"] = figs["reward_mean"]
        if self.last:
            out["eval"] = {name: {"last": self.last[name], "best": self.best[name]} for name in self.last}
        return out
