"""Tool calls: parsing them from the model's text, and the built-in tool environment (`[rl.rollout] tools`).

A tool is a plain Python function (sync or async) with type hints and a docstring that documents its arguments;
its JSON schema is what transformers' `get_json_schema` makes of it, and the chat template gets the functions
themselves (`apply_chat_template(..., tools=...)`), as transformers documents.

Parsers (engines/tool_calls.py: the OpenAI routes of the engines use them too) read the text of one assistant turn
(decoded for reading only: the trained tokens are the engine's) and return a `ParsedTurn`: the content before the
first call, the calls, and the calls that could not be read. The built-in one is the Qwen2.5 / Hermes format,
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; any function `text -> ParsedTurn` can replace it
(`[rl.rollout] tool_parser = "module:function"`).

`ToolEnv` is an environment like any user's (trainer.rollout.episodes): `reset` opens with the prompt as a user
turn, `step` runs the assistant's calls (each with a timeout) and answers with one `tool` message per call; a
turn without a call ends the episode. A bad call, an unknown tool, a tool that raises or runs past its timeout is
answered with an error message (the model can recover) and counted in `info["tool_errors"]`.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from engines.tool_calls import ParsedTurn, parse_hermes
from trainer.rollout.blocking import BlockedCallTimeout, run_bounded
from trainer.rollout.loading import load_callable

TOOL_PARSERS: dict[str, Callable[[str], ParsedTurn]] = {"hermes": parse_hermes}


def load_tool_parser(spec: str | Callable[[str], ParsedTurn]) -> Callable[[str], ParsedTurn]:
    if isinstance(spec, str) and spec in TOOL_PARSERS:
        return TOOL_PARSERS[spec]
    return load_callable(spec, f"[rl.rollout] tool_parser (built-in: {sorted(TOOL_PARSERS)})")


def load_tools(specs: Sequence[str | Callable[..., Any]]) -> dict[str, Callable[..., Any]]:
    """name -> function for `[rl.rollout] tools`; each must have a JSON schema (type hints, documented arguments):
    checked here, before any work, because the chat template needs it."""
    from transformers.utils import get_json_schema

    tools: dict[str, Callable[..., Any]] = {}
    for spec in specs:
        fn = load_callable(spec, "[rl.rollout] tools:")
        try:
            name = get_json_schema(fn)["function"]["name"]
        except Exception as e:  # noqa: BLE001 - transformers raises several types; all mean the same fix
            raise ValueError(f"[rl.rollout] tools: {spec!r} has no JSON schema ({type(e).__name__}: {e}); give it type "
                             f"hints and a docstring with an Args: section describing every argument") from e
        if name in tools:
            raise ValueError(f"[rl.rollout] tools: two tools are named {name!r}")
        tools[name] = fn
    if not tools:
        raise ValueError("[rl.rollout] tools: give at least one 'module:function'")
    return tools


async def call_tool(fn: Callable[..., Any], args: Mapping[str, Any], timeout_s: float, *, name: str = "") -> str:
    """Run one tool within `timeout_s` (an async one in this event loop, a sync one in a thread of the tools' own pool,
    trainer.rollout.blocking: a hung tool gives its slot back at its deadline and never starves the reward
    functions' threads); its result as the text of a tool message (a str as is, anything else as JSON). Raises
    trainer.rollout.blocking.BlockedCallTimeout, naming the tool, past the limit."""
    name = name or getattr(fn, "__name__", repr(fn))
    result = await run_bounded(functools.partial(fn, **args), timeout_s=timeout_s, pool="tools",
                               what=f"tool {name!r}", hint="make the tool faster or raise [rl.rollout] tool_timeout_s")
    return result if isinstance(result, str) else json.dumps(result)


class ToolEnv:
    """The built-in environment of `[rl.rollout] tools`: one per episode (state: nothing but the tools)."""

    def __init__(self, tools: Mapping[str, Callable[..., Any]], *, timeout_s: float) -> None:
        self.tools = dict(tools)
        self.timeout_s = timeout_s

    def reset(self, prompt: str, metadata: Mapping[str, Any]) -> list[dict]:
        system = metadata.get("system_prompt")
        return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]

    async def step(self, message: Mapping[str, Any]) -> dict:
        calls, bad = message.get("tool_calls") or [], message.get("tool_call_errors") or []
        if not calls and not bad:  # an answer without a tool call ends the episode; the run's reward scores it
            return {"messages": [], "reward": None, "done": True}
        replies = [{"role": "tool", "content": f"error: {e}"} for e in bad]
        errors = len(bad)
        for call in calls:
            name, args = call["function"]["name"], call["function"]["arguments"]
            try:
                if name not in self.tools:
                    raise LookupError(f"unknown tool {name!r}; the tools are {sorted(self.tools)}")
                content = await call_tool(self.tools[name], args, self.timeout_s, name=name)
            except BlockedCallTimeout:
                content, errors = f"error: {name} timed out after {self.timeout_s:g}s", errors + 1
            except Exception as e:  # noqa: BLE001 - a failing tool is the model's problem to handle, not the run's
                content, errors = f"error: {type(e).__name__}: {e}", errors + 1
            replies.append({"role": "tool", "name": name, "content": content})
        return {"messages": replies, "reward": None, "done": False, "info": {"tool_errors": errors}}
