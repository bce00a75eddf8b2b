"""Reward functions: built-in verifiable tasks, user `module:function` loading, and failure-safe application.

A reward function takes one finished `Sample` and returns its reward: a finite number or a bool, or a mapping
{"reward": number, "correct": bool} when "correct" is not simply "the reward reached its maximum" (partial
credit), or an awaitable of either; the mapping may also carry "sources": {name: number}, the parts the reward
was made of, kept in sample.metadata["reward_sources"] (how [rewards] rule sources report each rule's score:
trainer/rewards/sources.py). The sample carries the prompt text (`sample.prompt`), the decoded response
(`sample.response`), its tokens, and in `sample.metadata` the data row: the reference answer under "answer"
(whatever [data] answer_key named in the file) and every other field of the row. A function that raises marks its
sample FAILED (left out of the loss, counted); the first time each distinct error happens, its traceback and the
sample are printed to stderr. So does a result that is not a finite number or a bool (a string "1.0", a tensor,
None), or one beyond +-MAX_ABS_REWARD, and a call that outlasts its timeout (`with_timeout`, [data] reward_timeout_s):
the rollout moves on without it.

Built-in tasks, both small enough for the tiny preset's one-token-per-character vocabulary and a tiny model:
  - arithmetic: "23+17=" -> "40"; reward 1.0 when the last integer in the response equals the answer.
  - countdown: reach a target with +-*/ over given numbers, each used at most once; 1.0 correct,
    0.1 for a well-formed expression over the allowed numbers that misses the target, 0.0 otherwise.
Rewards for users' data sets:
  - gsm8k: GSM8K-style final answers. The reference is the text after the last "####" of the answer field (or the
    whole field); the response's answer is the number after its last "####", else the last number it contains.
    Commas, "$" and trailing zeros do not matter ("#### 1,234.00" == "1234").
  - math: `math-verify` (the checker the open reproductions of R1/DeepSeekMath use): the response's last
    \boxed{} (or last LaTeX / plain expression) against the reference, equal when they match exactly, numerically
    (0.5 == \frac{1}{2}) or symbolically ((x+1)^2 == x^2+2x+1).
A response with no answer in it scores 0.0; a reference answer that cannot be read raises, which marks the sample
FAILED (a data error, counted, never fatal).

The problem generators of the built-in tasks live in examples.tasks.datasets.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import math
import numbers
import re
import sys
import threading
import traceback
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Any

from trainer.rollout.blocking import BlockedCallTimeout, run_bounded
from trainer.rollout.loading import load_callable
from trainer.types import Sample, Status

RewardFn = Callable[[Sample], Any]  # returns float or Awaitable[float]

# The largest reward magnitude accepted. Advantages are group statistics in float32: squares of rewards near 1e19
# overflow, and one reward of 1e9 next to rewards of 1 leaves them no resolution. A reward this large is a bug (an
# unscaled count, a sentinel); a real task rescales it.
MAX_ABS_REWARD = 1e6

_INT_RE = re.compile(r"-?\d+")
# Chat/special markers of the common templates (Qwen/ChatML, Llama 3, ours) that engines may leave in the text.
_SPECIALS_RE = re.compile(r"<\|(?:im_end|im_start|endoftext|eot_id|end_of_text|begin_of_text|start_header_id)\|>"
                          r"|<eos>|<pad>|<bos>|</s>")


def _clean(response: str) -> str:
    """The response text without chat/special markers (engines may or may not strip them)."""
    return _SPECIALS_RE.split(response, maxsplit=1)[0].strip()


# ----------------------------------------------------------------------------------------------- arithmetic
def extract_final_integer(response: str) -> int | None:
    found = _INT_RE.findall(_clean(response))
    return int(found[-1]) if found else None


def arithmetic_reward(sample: Sample) -> float:
    """1.0 when the last integer of the response equals metadata["answer"], else 0.0."""
    answer = sample.metadata.get("answer")
    if answer is None:
        raise ValueError("arithmetic_reward: sample.metadata has no 'answer'; the prompt file needs an answer key")
    got = extract_final_integer(sample.response)
    return 1.0 if got is not None and got == int(answer) else 0.0


# ----------------------------------------------------------------------------------------------- countdown
def _eval_countdown(node: ast.AST, used: list[int]) -> Fraction:
    """Evaluate +-*/ over integer literals exactly; anything else (names, calls, powers) is rejected."""
    if isinstance(node, ast.Expression):
        return _eval_countdown(node.body, used)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
        a, b = _eval_countdown(node.left, used), _eval_countdown(node.right, used)
        if isinstance(node.op, ast.Add):
            return a + b
        if isinstance(node.op, ast.Sub):
            return a - b
        if isinstance(node.op, ast.Mult):
            return a * b
        if b == 0:
            raise ZeroDivisionError("division by zero")
        return a / b
    raise ValueError(f"unsupported expression element {type(node).__name__}")


def countdown_reward(sample: Sample) -> float:
    meta = sample.metadata
    if "numbers" not in meta or "target" not in meta:
        raise ValueError("countdown_reward: sample.metadata needs 'numbers' and 'target'")
    text = _clean(sample.response).split("=")[0].strip()
    if not text or len(text) > 200:
        return 0.0
    used: list[int] = []
    try:
        value = _eval_countdown(ast.parse(text, mode="eval"), used)
    except (SyntaxError, ValueError, ZeroDivisionError):
        return 0.0
    if Counter(used) - Counter(int(x) for x in meta["numbers"]):
        return 0.0  # used a number that was not offered, or one more often than offered
    return 1.0 if value == int(meta["target"]) else 0.1


# ----------------------------------------------------------------------------------------------- gsm8k
_NUMBER_RE = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def _reference(sample: Sample, reward: str) -> str:
    answer = sample.metadata.get("answer")
    if answer is None or not str(answer).strip():
        raise ValueError(f"{reward}: sample.metadata has no 'answer'; map the data set's answer column with "
                         f"[data].answer_key")
    return str(answer)


def parse_number(text: str) -> Decimal | None:
    """'1,234' / '$1,234.00' / '-7' / '.5' -> Decimal; None when `text` holds no number."""
    found = _NUMBER_RE.findall(text)
    if not found:
        return None
    try:
        return Decimal(found[-1].replace(",", "").replace("$", ""))
    except InvalidOperation:
        return None


def extract_gsm8k_answer(response: str) -> Decimal | None:
    """The number after the last "####" of the response, else the last number in it; None when it has none."""
    text = _clean(response)
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        found = _NUMBER_RE.match(tail)
        return parse_number(found.group(0)) if found else None
    return parse_number(text)


def gsm8k_reward(sample: Sample) -> float:
    """1.0 when the response's final number equals the reference's (after its "####"), else 0.0."""
    ref_text = _reference(sample, "gsm8k_reward")
    ref = parse_number(ref_text.rsplit("####", 1)[-1])
    if ref is None:
        raise ValueError(f"gsm8k_reward: reference answer {ref_text[-60:]!r} holds no number")
    got = extract_gsm8k_answer(sample.response)
    return 1.0 if got is not None and got == ref else 0.0


# ----------------------------------------------------------------------------------------------- math
def _math_timeout() -> int | None:
    # math-verify bounds parsing and comparison with signal.alarm, which only the main thread may set. A reward run
    # under `with_timeout` (every rollout's) runs in a worker thread: there math-verify is unbounded, and the
    # caller's reward timeout bounds the wait for it instead.
    return 5 if threading.current_thread() is threading.main_thread() else None


def last_boxed(text: str) -> str | None:
    """The last "\\boxed{...}" of `text` with balanced braces (a model's final answer), or None."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    depth, i = 0, text.find("{", start)
    if i < 0:
        return None
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[start:j + 1]
    return None  # unbalanced: the generation was cut inside the box


def parse_math_reference(answer: str) -> list:
    """math-verify's parse of a reference answer: a bare "\frac{1}{2}" or "0.5" is read as LaTeX in $...$."""
    from math_verify import parse

    text = answer.strip()
    if "\boxed" not in text and "$" not in text:
        text = f"${text}$"
    return parse(text, parsing_timeout=_math_timeout())


def math_reward(sample: Sample) -> float:
    """1.0 when math-verify finds the response's answer equal to the reference (exact, numeric or symbolic)."""
    from math_verify import parse, verify

    ref_text = _reference(sample, "math_reward")
    ref = parse_math_reference(ref_text)
    if not ref:
        raise ValueError(f"math_reward: math-verify cannot read the reference answer {ref_text[:60]!r}")
    response = _clean(sample.response)
    # math-verify reads the first of several boxed answers; a model's answer is its last one.
    got = parse(last_boxed(response) or response, parsing_timeout=_math_timeout())
    if not got:
        return 0.0
    return 1.0 if verify(ref, got, timeout_seconds=_math_timeout()) else 0.0


def no_reward(sample: Sample) -> float:
    """The reward function of a run that names none ([data].reward unset, no [rewards] sources) because its
    environment or agent ([rl.rollout] env / rollout_fn) returns each episode's reward: it is called only for a
    sample given none, and fails it (FAILED, out of the loss, counted), where a missing reward would otherwise have
    counted as 0. An episode cut by a limit before its environment judged it is one of these."""
    cut = sample.metadata.get("truncated_by")
    if cut:
        why = f"its episode was cut (by {cut!r}) before the environment or rollout_fn gave a reward"
        fix = "raise [rl.rollout] max_new_tokens / max_turns / max_context_tokens so that episodes finish"
    else:
        why = "its environment or rollout_fn gave none (every step's reward was None)"
        fix = "return a reward from the environment's step (or the rollout_fn)"
    raise LookupError(f"no reward for this sample: {why}, and the run has no reward function ([data].reward unset); "
                      f"{fix}, or set [data].reward to score such samples")


# ----------------------------------------------------------------------------------------------- loading
BUILTIN_REWARDS: dict[str, RewardFn] = {"arithmetic": arithmetic_reward, "countdown": countdown_reward,
                                        "gsm8k": gsm8k_reward, "math": math_reward}
# Built-ins whose work is one linear regex scan of the response: with_timeout calls them inline. A worker-thread hop
# per sample costs more than they do (~50 us, 512 a step on the demo, in the rollout's Python) and they cannot hang.
INLINE_REWARDS = (arithmetic_reward, gsm8k_reward, no_reward)


def load_reward_fn(spec: str | RewardFn) -> RewardFn:
    """A built-in name (a key of BUILTIN_REWARDS), "package.module:function" or "path/to/file.py:function"."""
    if callable(spec):
        return spec
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    if ":" not in spec:
        raise ValueError(f"reward {spec!r}: use a built-in name {sorted(BUILTIN_REWARDS)} or 'module:function'")
    fn = load_callable(spec, "reward")
    try:  # its signature, not a call: a `def f(prompt, completion)` failed only once the run had started
        inspect.signature(fn).bind(None)
    except TypeError as e:
        raise ValueError(f"reward {spec!r}: it must take one argument, the finished Sample ({e}); e.g. "
                         f"`def score(sample) -> float`") from None
    except ValueError:  # a builtin without an inspectable signature: found out when it is called
        pass
    return fn


# ----------------------------------------------------------------------------------------------- applying
def reward_value(value: Any) -> tuple[float, bool | None]:
    """(reward, correct) of what a reward function returned (the module docstring's forms); a TypeError or
    ValueError that says what was wrong with it otherwise."""
    correct = None
    if isinstance(value, Mapping):
        if "reward" not in value:
            raise TypeError(f"reward function returned a mapping without 'reward' (keys {sorted(value)}); return "
                            f"{{'reward': x, 'correct': bool}}")
        correct, value = value.get("correct"), value["reward"]
        if correct is not None and not isinstance(correct, bool):
            raise TypeError(f"reward function returned correct={correct!r}; give a bool or None")
    if isinstance(value, str) or not isinstance(value, numbers.Real):
        raise TypeError(f"reward function returned {type(value).__name__} {value!r:.40}, expected a number or a bool "
                        f"(a tensor: return .item())")
    reward = float(value)
    if not math.isfinite(reward):
        raise ValueError(f"reward function returned a non-finite value {reward}")
    if abs(reward) > MAX_ABS_REWARD:
        raise ValueError(f"reward function returned {reward:g}, beyond +-{MAX_ABS_REWARD:g} (MAX_ABS_REWARD): the "
                         f"advantages' float32 group statistics would overflow or lose every other reward; scale the "
                         f"reward down")
    return reward, correct


def _finish(sample: Sample, value: Any) -> Sample:
    try:
        reward, correct = reward_value(value)
        sources = _sources(value.get("sources")) if isinstance(value, Mapping) else None
    except (TypeError, ValueError) as e:  # the result's fault, not the function's: no traceback to show
        return _failed(sample, e.with_traceback(None))
    if sources is None:
        return dataclasses.replace(sample, reward=reward, correct=correct)
    return dataclasses.replace(sample, reward=reward, correct=correct,
                               metadata={**sample.metadata, "reward_sources": sources})


def _sources(value: Any) -> dict[str, float] | None:
    """A reward's optional "sources" entry: {name: finite number}, the parts it was made of (None: none given)."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or not all(isinstance(k, str) and isinstance(v, numbers.Real)
                                                 and not isinstance(v, bool) and math.isfinite(v)
                                                 for k, v in value.items()):
        raise TypeError(f"reward function returned sources={value!r:.80}; give {{name: finite number}} or leave it out")
    return {k: float(v) for k, v in value.items()}


# The distinct errors already printed (type and message): each is shown once per process, with its traceback and
# the sample it failed on, the moment it first happens; later ones are only counted.
_REPORTED: set[str] = set()
_MAX_REPORTS = 20


def describe_failure(sample: Sample) -> str:
    """What a user needs to fix a reward function: the sample it failed on and the traceback."""
    meta = {k: v for k, v in sample.metadata.items() if k not in ("reward_error", "reward_traceback")}
    shown = {k: (v if len(repr(v)) <= 80 else f"{repr(v)[:77]}...") for k, v in meta.items()}
    return (f"reward function failed: {sample.metadata.get('reward_error')}\n"
            f"  on the sample: prompt={sample.prompt[-200:]!r}\n"
            f"                 response={sample.response[:200]!r}\n"
            f"                 metadata={shown} (the data row's fields; the reference answer is 'answer')\n"
            f"{sample.metadata.get('reward_traceback', '')}")


def mark_failed(sample: Sample, err: BaseException) -> Sample:
    """`sample` FAILED by `err`, as a failing reward function leaves it (reward 0.0, metadata["reward_error"] and
    ["reward_traceback"]; the first time each distinct error happens it is printed with the sample)."""
    return _failed(sample, err)


def _failed(sample: Sample, err: BaseException) -> Sample:
    # Reward 0.0 (not None) keeps group statistics defined; status FAILED lets the trainer mask the sample.
    message = f"{type(err).__name__}: {err}"
    trace = "".join(traceback.format_exception(err)) if err.__traceback__ is not None else message + "\n"
    meta = {**sample.metadata, "reward_error": message, "reward_traceback": trace}
    failed = dataclasses.replace(sample, reward=0.0, status=Status.FAILED, metadata=meta)
    if message not in _REPORTED and len(_REPORTED) < _MAX_REPORTS:
        _REPORTED.add(message)
        print(describe_failure(failed), file=sys.stderr, flush=True)
    return failed


def compute_reward(sample: Sample, reward_fn: RewardFn) -> Sample:
    """Score one sample; an exception (or a non-finite result) marks it FAILED instead of propagating."""
    try:
        value = reward_fn(sample)
        if inspect.isawaitable(value):
            raise TypeError("reward function is async; use acompute_reward inside the rollout manager")
    except Exception as e:  # noqa: BLE001 - a user reward bug must not crash the run
        return _failed(sample, e)
    return _finish(sample, value)


async def acompute_reward(sample: Sample, reward_fn: RewardFn) -> Sample:
    """Like `compute_reward`, awaiting the result when the reward function is async."""
    try:
        value = reward_fn(sample)
        if inspect.isawaitable(value):
            value = await value
    except Exception as e:  # noqa: BLE001
        return _failed(sample, e)
    return _finish(sample, value)


def with_timeout(reward_fn: RewardFn, timeout_s: float | None) -> RewardFn:
    """`reward_fn` as an async function that raises TimeoutError after `timeout_s` seconds (None: no limit), for
    `acompute_reward` inside trio: a slow call marks its sample FAILED instead of stalling the whole step.

    A plain function runs in a worker thread of the "rewards" pool (trainer.rollout.blocking: so it must be
    thread-safe, as the built-ins are): a thread cannot be stopped, so one past its limit is abandoned, left to
    finish in the background, its result dropped and its pool slot given back, so hung rewards never starve later
    ones of threads. An async function is cancelled. The INLINE_REWARDS built-ins are returned as they are."""
    if timeout_s is None or reward_fn in INLINE_REWARDS:
        return reward_fn
    name = getattr(reward_fn, "__name__", reward_fn)

    @functools.wraps(reward_fn)
    async def bounded(sample: Sample) -> Any:
        try:
            return await run_bounded(reward_fn, sample, timeout_s=timeout_s, pool="rewards",
                                     what=f"reward function {name!r}", hint="raise [data] reward_timeout_s")
        except BlockedCallTimeout:
            raise TimeoutError(f"reward function {name!r} took longer than {timeout_s:g} s ([data] "
                               f"reward_timeout_s); it was abandoned and the sample left out: make it faster or "
                               f"raise the limit") from None

    return bounded


def compute_rewards(samples: Sequence[Sample], reward_fn: RewardFn) -> tuple[list[Sample], int]:
    """Score every sample; returns (scored samples, number whose reward function failed)."""
    scored = [compute_reward(s, reward_fn) for s in samples]
    return scored, sum(1 for s in scored if "reward_error" in s.metadata)
