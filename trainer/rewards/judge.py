"""Rewards from an LLM judge served by one of the project's engines (any engines.protocol.InferenceEngine).

    config = JudgeConfig(template="Question: {prompt}\\nAnswer: {response}\\nReference: {answer}\\n"
                                  "Is the answer correct? Reply yes or no.", parser="yes_no")
    samples, counts = await judge_samples(judge_engine, samples, config, judge_tokenizer)

For each sample the judge sees `config.template` filled with the sample's prompt (sample.prompt), its response
(sample.response, special markers cut) and the reference answer (sample.metadata["answer"]), as a user turn of the
judge's own chat template (its tokenizer's; a system turn first with `config.system`). All prompts go to the engine
in one batched `generate` call (greedy by default); each answer, decoded without special tokens, goes through the
parser:
    "score"             the first number in the text, clamped to [min_score, max_score] where given
    "yes_no"            the first standalone "yes" (1.0) or "no" (0.0), any case
    "module:function"   (or "path/file.py:function", or a callable) fn(text) -> a number, a bool or
                        {"reward": x, "correct": bool}, as a reward function returns; None or raising = unparseable

A failed judgement marks its sample FAILED, exactly like a failing reward function (trainer/rewards/rules.py:
reward 0.0, metadata["reward_error"], left out of the loss by trainer.rl.trained_samples): an answer the parser
cannot read (the error names the judge's text), and every sample of a batch whose engine call failed (EngineError:
the engine refused or did not answer). Every judged sample keeps the judge's text in metadata["judge_text"].
Samples already FAILED (generation or the environment failed) are passed through unjudged.

Returns (samples in the input order, counts): counts["judge/judged"] samples sent to the judge,
counts["judge/failed"] of those marked FAILED for any reason, counts["judge/unparseable"] of those whose answer came
back but could not be read (a subset of judge/failed).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import re
import string
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from engines.protocol import EngineError, InferenceEngine, SamplingParams
from trainer.rewards.rules import _clean as strip_special_markers
from trainer.rewards.rules import compute_reward
from trainer.rollout.loading import load_callable
from trainer.rollout.samples import prompt_token_ids, stop_token_ids
from trainer.types import Sample, Status

TEMPLATE_FIELDS = ("prompt", "response", "answer")
BUILTIN_PARSERS = ("score", "yes_no")

_NUMBER_RE = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
_YES_NO_RE = re.compile(r"\b(yes|no)\b", re.IGNORECASE)


class UnparseableJudgeAnswer(ValueError):
    """The parser could not turn the judge's text into a reward."""


class JudgeEngineError(RuntimeError):
    """The judge's engine failed on the batch (its EngineError is the cause)."""


@dataclasses.dataclass(frozen=True)
class JudgeConfig:
    """How to ask the judge and read its answer (see the module docstring).

    template: str.format text with the fields {prompt}, {response} and optionally {answer} (write literal braces
    as {{ }}). parser: "score" | "yes_no" | "module:function" | a callable. min_score / max_score: the "score"
    parser's clamp (None: no bound). max_new_tokens, temperature (0 = greedy), seed: the judge's sampling.
    system: a system turn before the judge's prompt."""

    template: str
    parser: str | Callable[[str], Any] = "score"
    min_score: float | None = None
    max_score: float | None = None
    max_new_tokens: int = 64
    temperature: float = 0.0
    seed: int | None = None
    system: str | None = None

    def __post_init__(self) -> None:
        fields = template_fields(self.template)
        unknown = sorted(fields - set(TEMPLATE_FIELDS))
        if unknown:
            raise ValueError(f"judge template: unknown field(s) {unknown}; the fields are {TEMPLATE_FIELDS} (write "
                             f"literal braces as {{{{ }}}})")
        if "response" not in fields:
            raise ValueError("judge template has no {response} field: the judge would never see what it grades")
        if isinstance(self.parser, str) and self.parser not in BUILTIN_PARSERS and ":" not in self.parser:
            raise ValueError(f"judge parser {self.parser!r}: use one of {BUILTIN_PARSERS} or 'module:function'")
        if self.min_score is not None and self.max_score is not None and self.min_score > self.max_score:
            raise ValueError(f"min_score={self.min_score} > max_score={self.max_score}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1: the judge must answer something")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 = greedy)")


def template_fields(template: str) -> set[str]:
    """The {field} names a str.format template uses; a ValueError for a malformed one (a lone brace)."""
    try:
        return {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as e:
        raise ValueError(f"judge template {template[:60]!r}: {e}; write literal braces as {{{{ }}}}") from e


# ----------------------------------------------------------------------------------------------- parsers
def parse_score(text: str, *, min_score: float | None = None, max_score: float | None = None) -> float | None:
    """The first number in `text` ("Score: 7/10" -> 7.0), clamped to [min_score, max_score]; None when none."""
    found = _NUMBER_RE.search(text)
    if found is None:
        return None
    value = float(found.group(0))
    if min_score is not None:
        value = max(value, min_score)
    if max_score is not None:
        value = min(value, max_score)
    return value


def parse_yes_no(text: str) -> float | None:
    """1.0 for the first standalone "yes" in `text`, 0.0 for a first "no" (any case); None when neither."""
    found = _YES_NO_RE.search(text)
    return None if found is None else float(found.group(1).lower() == "yes")


def load_parser(config: JudgeConfig) -> Callable[[str], Any]:
    """The function text -> reward that `config.parser` names."""
    if config.parser == "score":
        return functools.partial(parse_score, min_score=config.min_score, max_score=config.max_score)
    if config.parser == "yes_no":
        return parse_yes_no
    return load_callable(config.parser, "judge parser")


# ----------------------------------------------------------------------------------------------- judging
def render_judge_prompt(sample: Sample, config: JudgeConfig) -> str:
    """The judge's user message for one sample; a ValueError when the template needs an answer the sample lacks."""
    answer = sample.metadata.get("answer")
    if answer is None and "answer" in template_fields(config.template):
        raise ValueError("the judge template uses {answer} but sample.metadata has no 'answer'; map the data set's "
                         "reference column with [data] answer_key, or drop {answer} from the template")
    return config.template.format(prompt=sample.prompt, response=strip_special_markers(sample.response),
                                  answer="" if answer is None else answer)


def _reader(parse: Callable[[str], Any], text: str, finish_reason: str, max_new_tokens: int) -> Callable:
    """A reward function (for rewards.compute_reward) that parses the judge's `text`; its errors name the text."""
    def read(_: Sample) -> Any:
        cut = f" (the judge stopped at max_new_tokens={max_new_tokens})" if finish_reason == "length" else ""
        try:
            value = parse(text)
        except Exception as e:  # noqa: BLE001 - any parser error is an unparseable answer
            raise UnparseableJudgeAnswer(f"the judge parser raised {type(e).__name__}: {e} on the judge's answer "
                                         f"{text[:300]!r}{cut}") from e
        if value is None:
            raise UnparseableJudgeAnswer(f"no reward in the judge's answer {text[:300]!r}{cut}")
        if isinstance(value, numbers.Real) and not math.isfinite(float(value)):
            raise UnparseableJudgeAnswer(f"the judge parser returned {value} for the judge's answer {text[:300]!r}")
        if not isinstance(value, (numbers.Real, Mapping)):
            raise UnparseableJudgeAnswer(f"the judge parser returned {type(value).__name__} {value!r:.40} for the "
                                         f"judge's answer {text[:300]!r}; return a number, a bool or None")
        return value
    return read


def _engine_failed(err: EngineError, url: str) -> Callable:
    def fail(_: Sample) -> Any:
        raise JudgeEngineError(f"the judge engine {url} failed: {type(err).__name__}: {err}") from err
    return fail


async def judge_samples(engine: InferenceEngine, samples: Sequence[Sample], config: JudgeConfig,
                        tokenizer: Any) -> tuple[list[Sample], dict[str, int]]:
    """Score `samples` with the judge served by `engine` (`tokenizer`: the judge model's, with its chat template).

    Returns (the samples in the input order, each with its reward or FAILED, counts): see the module docstring for
    the counts and for what marks a sample FAILED. Engine errors are caught per call (EngineError); cancellation
    and bugs propagate."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the judge's tokenizer ({type(tokenizer).__name__}) has no chat template; load the judge "
                         f"model's own tokenizer (engines.tokenizer.load_tokenizer on its folder)")
    parse = load_parser(config)
    out = list(samples)
    todo: list[int] = []
    prompts: list[list[int]] = []
    failed = 0
    for i, s in enumerate(samples):
        if s.status == Status.FAILED:
            continue
        try:
            text = render_judge_prompt(s, config)
        except ValueError as e:
            out[i] = compute_reward(s, _raise(e))
            failed += 1
            continue
        todo.append(i)
        prompts.append(prompt_token_ids(tokenizer, text, chat=True, system=config.system))
    judged = len(todo) + failed
    if not todo:
        return out, {"judge/judged": judged, "judge/failed": failed, "judge/unparseable": 0}
    params = SamplingParams(temperature=config.temperature, max_new_tokens=config.max_new_tokens,
                            stop_token_ids=tuple(stop_token_ids(tokenizer, chat=True)), seed=config.seed)
    try:
        groups = await engine.generate(prompts, params)
    except EngineError as e:
        for i in todo:
            out[i] = compute_reward(samples[i], _engine_failed(e, engine.url))
        return out, {"judge/judged": judged, "judge/failed": failed + len(todo), "judge/unparseable": 0}
    unparseable = 0
    for i, group in zip(todo, groups):
        completion = group[0]
        text = tokenizer.decode(list(completion.output_ids), skip_special_tokens=True)
        s = dataclasses.replace(samples[i], metadata={**samples[i].metadata, "judge_text": text})
        out[i] = compute_reward(s, _reader(parse, text, completion.finish_reason, config.max_new_tokens))
        if out[i].status == Status.FAILED:
            unparseable += 1
    return out, {"judge/judged": judged, "judge/failed": failed + unparseable, "judge/unparseable": unparseable}


def _raise(err: BaseException) -> Callable:
    def fail(_: Sample) -> Any:
        raise err
    return fail
