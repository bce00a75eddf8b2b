"""Multi-turn episodes, token-exact: environments (`[rl.rollout] env`), tools (`tools`) and agent functions
(`rollout_fn`) turned into one training `Sample` each.

An episode is a conversation the model takes part in. Its trained tokens are exactly

    opening prompt (the environment's first messages, rendered with the generation prompt)
    + turn 1 as the engine generated it (loss_mask 1, the engine's log-probs, its weight version)
    + the environment's answer, rendered as it follows an assistant turn (loss_mask 0)
    + turn 2 ... and so on,

so the model's own tokens are never decoded and re-encoded (the decode of a turn is only read, by the tool-call
parser), and each new turn's prompt is the previous tokens plus the rendering of the new messages only.

`Episode` is the one object that grows a trajectory: `await episode.chat(messages)` takes the whole conversation
so far (it must extend the previous call's, with the assistant messages `chat` returned left as they were), renders
the new messages, asks the engine for one turn and returns the assistant message (`{"role": "assistant",
"content", "tool_calls"?}`). An environment loop (`run_env`) and a user's agent function both drive it. An episode
ends by the driver returning, or by `EpisodeEnd` out of `chat`: a limit (`max_turns`, `max_context_tokens`, a turn
cut by `max_new_tokens`: TRUNCATED) or an abort (the batch filled: ABORTED; the group is cached and the episode
starts again with the next batch, because a live environment cannot be checkpointed).

An environment is any object with `reset(prompt, metadata) -> list[message]` and `step(assistant_message) ->
EnvStep | {"messages", "reward", "done", "info"?}`, either of them plain or async; its factory is called once per
episode with no arguments. The episode's reward is the sum of the environment's rewards, or, when it gave none,
the run's reward function's on the final sample, whose `response` is the model's last message (the whole
conversation is `metadata["messages"]`). An environment that raises fails the episode (FAILED: out of the
loss and of its group's statistics), never the run.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import math
import sys
import time
import traceback
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import trio

from engines.protocol import Completion, SamplingParams
from trainer.rewards.rules import acompute_reward
from trainer.rollout.blocking import BlockedCallTimeout, enter_user_code, run_bounded, user_code
from trainer.rollout.loading import load_callable
from trainer.rollout.samples import data_row, extend_sample, stop_token_ids
from trainer.rollout.tools import ToolEnv, load_tool_parser, load_tools
from trainer.types import Sample, Status

# (tokens so far, new-token budget, segment number) -> the engine's turn, or None when the batch filled first.
GenerateFn = Callable[[tuple[int, ...], int, int], Awaitable[Completion | None]]
# (episode, the sample it started from) -> the episode's reward (a number, {"reward", "correct"}) or None.
Driver = Callable[["Episode", Sample], Awaitable[Any]]


@dataclasses.dataclass(frozen=True)
class EnvStep:
    """What an environment answers to one assistant message: the messages that follow it (user, tool or system
    turns), a reward for this step (None: none), whether the episode is over, and counters for the metrics
    (`tool_errors`)."""

    messages: tuple[Mapping[str, Any], ...] = ()
    reward: float | None = None
    done: bool = False
    info: Mapping[str, float] = dataclasses.field(default_factory=dict)


def as_env_step(value: Any) -> EnvStep:
    """An EnvStep from what `step` returned (an EnvStep, or a dict of its fields: no import from this project)."""
    if isinstance(value, EnvStep):
        return value
    if not isinstance(value, Mapping):
        raise TypeError(f"env.step returned {type(value).__name__}; return a dict {{'messages': [...], 'reward': "
                        f"float | None, 'done': bool}} or a trainer.rollout.episodes.EnvStep")
    unknown = set(value) - {f.name for f in dataclasses.fields(EnvStep)}
    if unknown:
        raise TypeError(f"env.step returned unknown keys {sorted(unknown)}; known: messages, reward, done, info")
    step = EnvStep(messages=tuple(value.get("messages") or ()), reward=value.get("reward"),
                   done=bool(value.get("done", False)), info=dict(value.get("info") or {}))
    _check_messages(step.messages, "env.step")
    if step.reward is not None and (isinstance(step.reward, bool) or not isinstance(step.reward, int | float)
                                    or not math.isfinite(step.reward)):
        raise TypeError(f"env.step returned reward {step.reward!r}; give a finite number or None")
    return step


def _check_messages(messages: Sequence[Any], where: str) -> None:
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise TypeError(f"{where}: message {i} is {m!r:.80}; each message is a dict with a 'role' and a "
                            f"string 'content'")
        if m["role"] == "assistant":
            raise ValueError(f"{where}: message {i} has role 'assistant'; the model writes the assistant turns "
                             f"(the environment answers with user, tool or system messages)")


class EpisodeEnd(BaseException):
    """Raised out of `Episode.chat` when the episode cannot go on: reason "max_turns", "context", "length" (a limit:
    the episode is TRUNCATED) or "abort" (the batch filled). A BaseException, so that an agent function's
    `except Exception` does not swallow it."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


# ----------------------------------------------------------------------------------------------- rendering
_PLACEHOLDER = ({"role": "user", "content": "x"}, {"role": "assistant", "content": "y"})


@functools.lru_cache(maxsize=256)
def _tool_schema(tool: Callable) -> dict:
    """A tool function's JSON schema, as apply_chat_template derives it (from its signature and docstring)."""
    from transformers.utils import get_json_schema

    return get_json_schema(tool)


@functools.lru_cache(maxsize=4096)
def _rendered(tokenizer: Any, template: Any, key: str, generation_prompt: bool) -> tuple[int, ...]:
    """The tokens of the conversation `key` (JSON [messages, tool schemas]) under `template` (the tokenizer's
    chat_template, part of the key so that a changed template renders anew)."""
    messages, tools = json.loads(key)
    out = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=generation_prompt,
                                        tokenize=True, return_dict=True)
    return tuple(out["input_ids"])


def _render(tokenizer: Any, messages: Sequence[Mapping[str, Any]], tools: Sequence[Callable | dict] | None, *,
            generation_prompt: bool) -> list[int]:
    """apply_chat_template's token ids, rendered once per distinct conversation: the samples of a group open alike
    and often get the same tool output, and rendering (the Jinja template, each tool's JSON schema from its
    docstring, the tokenizer) was most of an agent step's client CPU, held under the GIL beside the engine's
    thread (the agent recipe: 57 % of the episodes' Python)."""
    # Functions become their schemas as apply_chat_template makes them; anything else goes to it as given.
    schemas = [_tool_schema(t) if inspect.isfunction(t) or inspect.ismethod(t) else t for t in tools or ()]
    try:
        key = json.dumps([[dict(m) for m in messages], schemas])  # key order kept: a template may print it
    except (TypeError, ValueError):  # not JSON (a message holding another object): render it as it is
        out = tokenizer.apply_chat_template([dict(m) for m in messages], tools=schemas or None,
                                            add_generation_prompt=generation_prompt, tokenize=True, return_dict=True)
        return list(out["input_ids"])
    return list(_rendered(tokenizer, repr(getattr(tokenizer, "chat_template", None)), key, generation_prompt))


def render_opening(tokenizer: Any, messages: Sequence[Mapping[str, Any]], tools: Sequence[Callable] = ()) -> list[int]:
    """The tokens of an episode's opening messages, up to and including the assistant's generation prompt."""
    return _render(tokenizer, messages, tools, generation_prompt=True)


@functools.lru_cache(maxsize=64)
def _after_turn(tokenizer: Any, tools: tuple[Callable, ...],
                turn_end_ids: frozenset[int]) -> tuple[tuple[int, ...], int]:
    """A placeholder conversation ending with an assistant turn, rendered, and where the model's part of that turn
    ends in it: just after the template's end-of-turn token (the last of `turn_end_ids` in the assistant's part). What
    the template writes after it (Qwen's "\\n") is glue the environment's rendering starts with."""
    base = _render(tokenizer, _PLACEHOLDER, tools, generation_prompt=False)
    header = _render(tokenizer, _PLACEHOLDER[:1], tools, generation_prompt=True)
    ends = [i for i in range(len(header), len(base)) if base[i] in turn_end_ids]
    return tuple(base), (ends[-1] + 1 if ends else len(base))


def render_continuation(tokenizer: Any, messages: Sequence[Mapping[str, Any]], *, turn_end_ids: frozenset[int],
                        tools: Sequence[Callable] = ()) -> list[int]:
    """The tokens `messages` render to right after a finished assistant turn, through the next assistant
    generation prompt: the template's rendering of [placeholder turns + messages] minus that of the placeholder
    turns. `turn_end_ids`: the tokenizer's eos and the template's end-of-turn token (trainer.rollout.samples
    .stop_token_ids without a run's extra stop tokens). Needs a template that renders turns append-only."""
    base, cut = _after_turn(tokenizer, tuple(tools), turn_end_ids)
    full = _render(tokenizer, list(_PLACEHOLDER) + list(messages), tools, generation_prompt=True)
    if tuple(full[:len(base)]) != base:
        raise ValueError("tokenizer: its chat template renders earlier turns differently once more messages follow; "
                         "multi-turn episodes need a template that renders turns append-only")
    return full[cut:]


# ----------------------------------------------------------------------------------------------- the episode
class Episode:
    """One episode's growing trajectory (the only mutable state of a multi-turn rollout); see the module docstring.

    `sample` is the trajectory so far: tokens, loss_mask (1 on the model's tokens), the engine's log-probs (0.0 on
    the environment's tokens, which the loss never reads), the weight version of each turn
    (`metadata["weight_versions"]`). `messages` is the conversation as the driver sees it.
    """

    def __init__(self, sample: Sample, *, tokenizer: Any, generate: GenerateFn, turn_end_ids: frozenset[int],
                 parse: Callable[[str], Any], max_turns: int, max_new_tokens: int, max_context_tokens: int = 0,
                 tools: Sequence[Callable] = ()) -> None:
        self.sample = sample
        self.tokenizer, self.generate, self.turn_end_ids, self.parse = tokenizer, generate, turn_end_ids, parse
        self.max_turns, self.max_new_tokens, self.max_context_tokens = max_turns, max_new_tokens, max_context_tokens
        self.tools = tuple(tools)
        self.messages: list[dict] = []
        self.turns = 0
        self.tool_calls = 0  # calls the model wrote, malformed ones included
        self.tool_errors = 0.0  # the environment's count (EnvStep.info["tool_errors"])
        self.env_seconds = 0.0  # time spent in the environment's reset and step

    @property
    def row(self) -> dict[str, Any]:
        """The data row the episode started from: its fields, "prompt" and "answer" (samples.data_row)."""
        return {**data_row(self.sample), "prompt": self.sample.prompt}

    async def chat(self, messages: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """One assistant turn after `messages` (the whole conversation so far); see the module docstring."""
        messages = [dict(m) for m in messages]
        if self.turns >= self.max_turns:
            raise EpisodeEnd("max_turns")
        if not self.messages:
            _check_messages(messages, "the opening messages")
            if not messages:
                raise ValueError("the opening messages are empty; an episode starts with at least a user message")
            ids = render_opening(self.tokenizer, messages, self.tools)
            self.sample = dataclasses.replace(self.sample, tokens=tuple(ids), response="", response_length=0,
                                              loss_mask=(), rollout_logprobs=())
        else:
            n = len(self.messages)
            if messages[:n] != self.messages:
                raise ValueError("chat(messages): the conversation must extend the previous call's (its messages and "
                                 "the assistant message chat returned, unchanged), so the trained tokens stay exact")
            _check_messages(messages[n:], "the new messages")
            ids = render_continuation(self.tokenizer, messages[n:], turn_end_ids=self.turn_end_ids, tools=self.tools)
            if self.max_context_tokens and len(self.sample.tokens) + len(ids) >= self.max_context_tokens:
                raise EpisodeEnd("context")
            self.sample = extend_sample(self.sample, ids, [0.0] * len(ids), status=self.sample.status,
                                        weight_version=None, loss_mask_value=0)
        budget = self.max_new_tokens
        if self.max_context_tokens:
            budget = min(budget, self.max_context_tokens - len(self.sample.tokens))
        if budget <= 0:
            raise EpisodeEnd("context")
        segment = len(self.sample.metadata.get("weight_versions", ()))
        out = await self.generate(self.sample.tokens, budget, segment)
        if out is None:
            raise EpisodeEnd("abort")
        self.sample = extend_sample(self.sample, out.output_ids, out.logprobs, status=self.sample.status,
                                    weight_version=out.oldest_version, spans=out.weight_versions, loss_mask_value=1,
                                    cached_tokens=out.cached_tokens, spec_accepted_tokens=out.spec_accepted_tokens)
        self.turns += out.finish_reason != "abort"  # a turn cut by a limit is still one the model took
        if out.finish_reason == "length" and budget < self.max_new_tokens:
            raise EpisodeEnd("context")  # cut by the context limit, not by the turn's own
        if out.finish_reason != "stop":
            raise EpisodeEnd(out.finish_reason)  # "abort", or "length": the turn was cut mid-way
        turn = self.parse(self.tokenizer.decode(list(out.output_ids), skip_special_tokens=True))
        reply = turn.message()
        self.tool_calls += len(turn.calls) + len(turn.errors)
        self.messages = messages + [reply]
        await enter_user_code()  # a cancelled episode (Ctrl-C) goes back into a user's rollout_fn no more
        return dict(reply)


# ----------------------------------------------------------------------------------------------- drivers
async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def env_driver(factory: Callable[[], Any], timeout_s: float | None = None) -> Driver:
    """The episode loop of an environment: reset, then chat / step until the environment says done.

    Each reset and step runs within `timeout_s` ([rl.rollout] env_timeout_s; None: the environment bounds its own
    calls, as the tool environment does with each tool's timeout): a plain method in a worker thread of the
    environments' own pool (trainer.rollout.blocking), so a blocking one never stalls the event loop, the other
    episodes or a Ctrl-C; an async one in the loop. Past the limit the episode fails (BlockedCallTimeout, naming
    the environment's method) and a plain method's thread is abandoned."""

    async def call(env: Any, method: str, *args: Any) -> Any:
        fn = getattr(env, method)
        if timeout_s is None:
            await enter_user_code()
            return await _maybe_await(fn(*args))
        return await run_bounded(fn, *args, timeout_s=timeout_s, pool="env",
                                 what=f"environment {type(env).__name__}.{method}",
                                 hint="make it faster (or async) or raise [rl.rollout] env_timeout_s")

    async def drive(episode: Episode, sample: Sample) -> Any:
        env = factory()
        t0 = time.perf_counter()
        try:
            messages = list(await call(env, "reset", sample.prompt, data_row(sample)))
        finally:
            episode.env_seconds += time.perf_counter() - t0
        rewards = []
        while True:
            reply = await episode.chat(messages)
            t0 = time.perf_counter()
            try:
                step = as_env_step(await call(env, "step", reply))
            finally:
                episode.env_seconds += time.perf_counter() - t0
            episode.tool_errors += float(step.info.get("tool_errors", 0))
            if step.reward is not None:
                rewards.append(float(step.reward))
            messages = messages + [reply] + [dict(m) for m in step.messages]
            if step.done:
                return sum(rewards) if rewards else None

    return drive


class ThreadClient:
    """What a plain `def fn(client, row)` rollout function gets: the episode's `chat` as a blocking call, run on
    the rollout's trio loop from the function's worker thread (trio.from_thread), and its read-only state."""

    def __init__(self, episode: Episode) -> None:
        self._episode = episode

    def chat(self, messages: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        return trio.from_thread.run(self._episode.chat, messages)

    @property
    def row(self) -> dict[str, Any]:
        return self._episode.row

    @property
    def messages(self) -> list[dict]:
        return list(self._episode.messages)


def fn_driver(fn: Callable[..., Any]) -> Driver:
    """A user's agent: `async def fn(client, row)` drives the episode through `await client.chat(messages)` and
    returns its reward (a number, {"reward", "correct"}) or None (the run's reward function scores the final
    sample). A plain `def fn(client, row)` (the seeds accept either) runs in a worker thread of its own, where
    `client.chat(messages)` blocks (ThreadClient); a cancelled episode (Ctrl-C) abandons the thread, whose next
    `chat` then raises."""
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError as e:
        raise ValueError(f"[rl.rollout] rollout_fn {getattr(fn, '__name__', fn)!r} must take (client, row): "
                         f"`async def fn(client, row)` or a plain `def fn(client, row)` ({e})") from e
    except ValueError:  # no signature to read (a builtin): it is called as it is
        pass
    if inspect.iscoroutinefunction(fn):
        async def drive(episode: Episode, sample: Sample) -> Any:
            return await fn(episode, episode.row)

        return drive

    async def drive_in_thread(episode: Episode, sample: Sample) -> Any:
        await enter_user_code()
        client = ThreadClient(episode)
        value = await trio.to_thread.run_sync(fn, client, client.row, abandon_on_cancel=True,
                                              limiter=trio.CapacityLimiter(1))  # one thread an episode
        if inspect.isawaitable(value):
            raise ValueError(f"[rl.rollout] rollout_fn {getattr(fn, '__name__', fn)!r} returned an awaitable from a "
                             f"plain def; make it `async def` (then it awaits client.chat) or return the reward")
        return value

    return drive_in_thread


def build_driver(config: Any) -> tuple[Driver | None, tuple[Callable, ...]]:
    """From a RolloutConfig: the episode driver (None: single-turn rollouts) and the tools the chat template gets."""
    if config.tools:
        tools = load_tools(config.tools)
        # No env_timeout_s around the tool environment's step: each of its tool calls has tool_timeout_s, and a step
        # with several calls may rightly take longer than one.
        return env_driver(lambda: ToolEnv(tools, timeout_s=config.tool_timeout_s)), tuple(tools.values())
    if config.env:
        return env_driver(load_callable(config.env, "[rl.rollout] env"), config.env_timeout_s), ()
    if config.rollout_fn:
        return fn_driver(load_callable(config.rollout_fn, "[rl.rollout] rollout_fn")), ()
    return None, ()


async def score_finished(sample: Sample, reward_fn: Callable[[Sample], Any] | None, given: Any = None) -> Sample:
    """A finished sample (COMPLETED or TRUNCATED) with its reward: `given` (an environment's or an agent's) when
    there is one, else `reward_fn`'s (None: left unscored); any other status is returned as it is (a FAILED one
    has no reward to learn from)."""
    if sample.status not in (Status.COMPLETED, Status.TRUNCATED):
        return sample
    if given is not None:
        return await acompute_reward(sample, lambda _: given)
    return sample if reward_fn is None else await acompute_reward(sample, reward_fn)


_REPORTED: set[str] = set()


async def run_episode(sample: Sample, driver: Driver, **episode_kw: Any) -> tuple[Sample, Any]:
    """Run one episode from `sample` (its prompt and metadata); returns the finished sample and the reward its
    driver gave (None: the run's reward function scores it). Status: COMPLETED, TRUNCATED (a limit), ABORTED (the
    batch filled) or FAILED (the environment or agent raised: `metadata["env_error"]`, its traceback printed once
    per distinct error)."""
    episode = Episode(sample, **episode_kw)
    reward, status, extra = None, Status.COMPLETED, {}
    try:
        with user_code():
            reward = await driver(episode, sample)
    except EpisodeEnd as end:
        status = Status.ABORTED if end.reason == "abort" else Status.TRUNCATED
        extra["truncated_by"] = end.reason
    except Exception as e:  # noqa: BLE001 - a failing environment fails its episode, not the run
        status, message = Status.FAILED, f"{type(e).__name__}: {e}"
        extra["env_error"] = message
        if isinstance(e, BlockedCallTimeout):
            extra["env_timed_out"] = True  # counted apart in the batch's metrics (env_timeouts)
        if message not in _REPORTED and len(_REPORTED) < 20:
            _REPORTED.add(message)
            print(f"environment failed on prompt {sample.prompt[-200:]!r}:\n{''.join(traceback.format_exception(e))}",
                  file=sys.stderr, flush=True)
    done = episode.sample
    # What a reward function reads: the model's final message (built-in rewards look for the answer there); the
    # whole conversation is metadata["messages"]. Before any finished turn: the text of what was generated.
    finals = [m["content"] for m in episode.messages if m["role"] == "assistant"]
    response = finals[-1] if finals else episode.tokenizer.decode(list(done.tokens[done.prompt_length:]),
                                                                  skip_special_tokens=True)
    meta = {**done.metadata, **extra, "turns": episode.turns, "tool_calls": episode.tool_calls,
            "tool_errors": episode.tool_errors, "env_seconds": episode.env_seconds, "messages": episode.messages}
    done = dataclasses.replace(done, response=response, status=status, metadata=meta,
                               reward=0.0 if status == Status.FAILED else None)
    return done, reward


async def run_eval_episodes(engine: Any, samples: Sequence[Sample], config: Any, *, tokenizer: Any,
                            max_new_tokens: int, score: Callable[[Sample], Any], temperature: float = 0.0,
                            seeds: Sequence[int] | None = None) -> list[Sample]:
    """Evaluation's episodes: each sample's episode (turns of `max_new_tokens` at `temperature`: greedy by default;
    sampled turns of episode i are seeded seeds[i] + 1009 * turn) with the environment / tools / agent of the
    RolloutConfig `config`, all in flight together so the engine batches their turns; each scored by its
    environment's reward or else by `score` (a reward function)."""
    driver, tools = build_driver(config)
    assert driver is not None, "run_eval_episodes needs a config with env, tools or rollout_fn"
    assert temperature == 0.0 or (seeds is not None and len(seeds) == len(samples)), "sampled episodes need seeds"
    stops = tuple(stop_token_ids(tokenizer, chat=True, extra=config.stop_token_ids))
    kw = dict(tokenizer=tokenizer, turn_end_ids=frozenset(stop_token_ids(tokenizer, chat=True)),
              parse=load_tool_parser(config.tool_parser), max_turns=config.max_turns, max_new_tokens=max_new_tokens,
              max_context_tokens=config.max_context_tokens, tools=tools)

    def generator(i: int) -> Callable[..., Any]:
        async def generate(tokens: tuple[int, ...], budget: int, segment: int) -> Completion:
            seed = None if temperature == 0.0 else (seeds[i] + 1009 * segment) % (2 ** 31)
            params = SamplingParams(temperature=temperature, max_new_tokens=budget, stop_token_ids=stops, seed=seed)
            return (await engine.generate([tokens], params))[0][0]
        return generate

    out: list[Any] = [None] * len(samples)

    async def one(i: int) -> None:
        done, reward = await run_episode(samples[i], driver, generate=generator(i), **kw)
        out[i] = await score_finished(done, score, reward)

    async with trio.open_nursery() as nursery:
        for i in range(len(samples)):
            nursery.start_soon(one, i)
    return out
