"""The token-exact record of one agent episode served through the OpenAI-compatible gateway (trainer/rollout/
gateway.py): which tokens the engine was asked to continue, what it produced, with its log-probs and weight versions.

Every engine completion (each of a request's `n` choices) is one `Call`: the sample of its whole context (prompt
tokens, loss mask 0; the completion, loss mask 1, the engine's log-probs). A request whose messages extend an earlier
call's messages + the assistant message that call returned (matched by `same_assistant_turn`, never re-encoded)
continues that call's tokens: its prompt is the call's tokens + the rendering of the new messages only (as
trainer.rollout.episodes does), so the engine sees exactly the trajectory that is trained. A request that extends
no call (the agent edited, summarised or truncated its history; a first request) starts a new sequence from the
chat template's rendering of its messages. At the end, each call no later call continued (a leaf) is one training
sequence: a linear agent gives one, an agent that rewrote its history one more per rewrite (`splits`).

A `/v1/completions` request continues a call when its prompt text starts with that call's prompt text + completion
text: the rest is encoded and appended to the call's tokens.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

from engines.openai_wire import WireError, same_assistant_turn, template_messages
from engines.protocol import Completion
from trainer.rollout.episodes import _after_turn, render_continuation, render_opening
from trainer.rollout.samples import extend_sample
from trainer.types import Sample


class Schema(dict):
    """A tool's JSON schema that can key a cache (the template renderings are cached per tool set). Equal only with
    its keys in the same order, nested ones too: a template's `tojson` renders them in order, so the same keys in
    another order are another rendering (and another prompt)."""

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(json.dumps(self))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, dict) and json.dumps(self) == json.dumps(other)

    def __ne__(self, other: object) -> bool:
        return not self == other


@dataclasses.dataclass(frozen=True)
class Call:
    """One engine completion and its whole context. `messages`/`tools`: the chat request's (None for a completions
    request); `reply`: the assistant message returned for it; `text`: the prompt + the recorded tokens' text, stop
    strings and special tokens kept (completions only); `ended`: it ends with the template's end-of-turn token."""

    sample: Sample
    parent: int | None
    messages: tuple[dict, ...] | None = None
    tools: tuple[Schema, ...] = ()
    reply: dict | None = None
    text: str | None = None
    ended: bool = True
    cut: str | None = None  # a limit cut this completion ("length" or "context": Gateway._complete)


class AgentRecorder:
    """One episode's calls (the only mutable state of an agent episode; used from the rollout's trio thread only).

    `base`: the sample the episode started from (prompt text, metadata); limits: `max_turns` requests,
    `max_context_tokens` tokens in one sequence (0: none), `max_new_tokens` per completion. A request past a limit
    is refused (WireError 400) and the episode marked truncated (`truncated_by`)."""

    def __init__(self, base: Sample, *, tokenizer: Any, turn_end_ids: frozenset[int], max_turns: int,
                 max_new_tokens: int, max_context_tokens: int = 0) -> None:
        self.base, self.tokenizer, self.turn_end_ids = base, tokenizer, turn_end_ids
        self.max_turns, self.max_new_tokens, self.max_context_tokens = max_turns, max_new_tokens, max_context_tokens
        self.calls: list[Call] = []
        self.requests = 0  # requests answered or in flight (the turns)
        self.tool_calls = 0  # calls the model wrote, malformed ones included
        self.truncated_by: str | None = None
        self.aborted = False

    # ------------------------------------------------------------------------------------------- prompts
    def chat_prompt(self, messages: Sequence[dict], tools: Sequence[dict]) -> tuple[int | None, Sample]:
        """(the call continued or None, the prompt's sample) for a chat request; counts the request as a turn."""
        tools = tuple(Schema(t) for t in tools)
        self._take_turn()
        parent = self._extended(messages, tools)
        if parent is None:
            ids = render_opening(self.tokenizer, template_messages(messages), tools)
            return None, self._check_context(self._root(ids))
        call = self.calls[parent]
        n = len(call.messages) + 1
        glue = [] if call.ended else [self._turn_end(tools)]
        ids = glue + render_continuation(self.tokenizer, template_messages(messages[n:]),
                                         turn_end_ids=self.turn_end_ids, tools=tools)
        return parent, self._check_context(self._extend(call.sample, ids))

    def completion_prompt(self, prompt: str | tuple[int, ...]) -> tuple[int | None, Sample]:
        """(the call continued or None, the prompt's sample) for a completions request (text or token ids)."""
        self._take_turn()
        if isinstance(prompt, tuple):
            return None, self._check_context(self._root(list(prompt)))
        best = None
        for i, c in enumerate(self.calls):
            if c.text is not None and prompt.startswith(c.text) and (best is None or len(c.text) >
                                                                       len(self.calls[best].text)):
                best = i
        if best is None:
            return None, self._check_context(self._root(self._encode(prompt)))
        call = self.calls[best]
        return best, self._check_context(self._extend(call.sample, self._encode(prompt[len(call.text):])))

    def budget(self, prompt: Sample, asked: int | None) -> int:
        """New tokens a completion of `prompt` may take: the request's max_tokens, the run's max_new_tokens and
        what max_context_tokens leaves, whichever is least."""
        out = min(asked or self.max_new_tokens, self.max_new_tokens)
        if self.max_context_tokens:
            out = min(out, self.max_context_tokens - len(prompt.tokens))
        return out

    def _take_turn(self) -> None:
        if self.requests >= self.max_turns:
            self.truncated_by = "max_turns"
            raise WireError(f"this episode made its max_turns={self.max_turns} requests ([rl.rollout] max_turns); it "
                            f"is over (marked truncated): end the agent's loop, or raise max_turns", param="messages")
        self.requests += 1

    def _check_context(self, prompt: Sample) -> Sample:
        if self.max_context_tokens and len(prompt.tokens) >= self.max_context_tokens:
            self.truncated_by = "context"
            raise WireError(f"the conversation is {len(prompt.tokens)} tokens, at or past [rl.rollout] "
                            f"max_context_tokens={self.max_context_tokens}; the episode is over (marked truncated): "
                            f"shorten the history or raise max_context_tokens", param="messages")
        return prompt

    def _extended(self, messages: Sequence[dict], tools: tuple[Schema, ...]) -> int | None:
        """The call whose messages + reply the request's messages extend (the longest such), or None."""
        best = None
        for i, c in enumerate(self.calls):
            if c.messages is None or c.tools != tools:
                continue
            n = len(c.messages)
            if (len(messages) > n + 1 and tuple(messages[:n]) == c.messages and messages[n]["role"] == "assistant"
                    and same_assistant_turn(messages[n], c.reply)
                    and (best is None or n > len(self.calls[best].messages))):
                best = i
        return best

    def _turn_end(self, tools: tuple[Schema, ...]) -> int:
        """The template's end-of-turn token (what an assistant turn cut by a stop string or a length limit lacks
        before the next message)."""
        base, cut = _after_turn(self.tokenizer, tools, self.turn_end_ids)
        return base[cut - 1]

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _root(self, ids: Sequence[int]) -> Sample:
        return dataclasses.replace(self.base, tokens=tuple(ids), response="", response_length=0, loss_mask=(),
                                   rollout_logprobs=(), metadata={k: v for k, v in self.base.metadata.items()
                                                                   if k not in ("weight_versions", "token_versions")})

    @staticmethod
    def _extend(sample: Sample, ids: Sequence[int]) -> Sample:
        return extend_sample(sample, ids, [0.0] * len(ids), status=sample.status, weight_version=None,
                             loss_mask_value=0)

    # ------------------------------------------------------------------------------------------- results
    def record(self, parent: int | None, prompt: Sample, out: Completion, keep: int, **call: Any) -> int:
        """Record the first `keep` tokens of the engine's completion `out` of `prompt` (fewer than it generated when
        a stop string cut it); returns the call's index."""
        ids, lps = list(out.output_ids[:keep]), list(out.logprobs[:keep])
        spans = tuple((i, v) for i, v in out.weight_versions if i < max(keep, 1))
        sample = extend_sample(prompt, ids, lps, status=prompt.status, weight_version=out.oldest_version,
                               spans=spans, loss_mask_value=1, cached_tokens=out.cached_tokens,
                               spec_accepted_tokens=out.spec_accepted_tokens)
        ended = bool(ids) and ids[-1] in self.turn_end_ids
        self.calls.append(Call(sample=sample, parent=parent, ended=ended, **call))
        return len(self.calls) - 1

    def sequences(self) -> list[tuple[Sample, str | None]]:
        """The episode's training sequences: the sample of each call no other call continued, in call order, with
        what cut a completion it holds (the first from its root; None: no limit cut it)."""
        parents = {c.parent for c in self.calls}
        out = []
        for i, leaf in enumerate(self.calls):
            if i in parents:
                continue
            cut, j = None, i
            while j is not None:
                cut, j = self.calls[j].cut or cut, self.calls[j].parent
            out.append((leaf.sample, cut))
        return out

    def counters(self) -> Mapping[str, Any]:
        return {"turns": self.requests, "tool_calls": self.tool_calls}
