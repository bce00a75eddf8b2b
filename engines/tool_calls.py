"""Reading tool calls out of a model's text: the parsed turn, and the Qwen2.5 / Hermes format
(`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`), the default of the trainer's tool environment
(trainer/rollout/tools.py) and of the OpenAI routes (the recording gateway, the embedded engine's own server).

Pure functions of the text: the trained tokens are the engine's, the text is decoded for reading only.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class ParsedTurn:
    """One assistant turn read for its tool calls: `calls` are OpenAI-style {"type": "function", "function":
    {"name", "arguments": dict}}; `errors` describe the calls that could not be read."""

    content: str
    calls: tuple[dict, ...] = ()
    errors: tuple[str, ...] = ()

    def message(self) -> dict[str, Any]:
        """The assistant message an environment's `step` receives."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.calls:
            msg["tool_calls"] = [dict(c) for c in self.calls]
        if self.errors:
            msg["tool_call_errors"] = list(self.errors)
        return msg


_HERMES = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> ParsedTurn:
    """Qwen2.5 / Hermes tool calls: each `<tool_call>{"name": str, "arguments": object}</tool_call>` (arguments may
    also be a JSON string, as OpenAI sends them). An unclosed tag or malformed JSON is an error, not a call."""
    calls, errors = [], []
    first = text.find("<tool_call>")
    content = text if first < 0 else text[:first]
    for m in _HERMES.finditer(text):
        body = m.group(1).strip()
        if not m.group(2):
            errors.append(f"unclosed <tool_call>: {body[:80]!r}")
            continue
        try:
            call = json.loads(body)
            name, args = call["name"], call.get("arguments", {})
            if isinstance(args, str):
                args = json.loads(args) if args.strip() else {}
            if not isinstance(name, str) or not isinstance(args, Mapping):
                raise TypeError("'name' must be a string and 'arguments' an object")
        except (ValueError, KeyError, TypeError) as e:
            errors.append(f"malformed tool call {body[:80]!r}: {type(e).__name__}: {e}")
            continue
        calls.append({"type": "function", "function": {"name": name, "arguments": dict(args)}})
    return ParsedTurn(content=content.strip(), calls=tuple(calls), errors=tuple(errors))
