"""Agent / multi-turn trajectories: chat messages (with tool calls) -> one training `Sample`.

The prompt is everything before the first assistant turn (rendered with the generation prompt, exactly what the
engine was given); the response is the rest of the conversation. The loss mask is 1 only on tokens the model
produced itself (assistant contents and their closing <|im_end|>), 0 on tool results, user turns and the
template's role headers, so the policy is never trained to imitate its environment.

Tool calls are rendered into the assistant content Qwen-style, `<tool_call>{"name": ..., "arguments": ...}
</tool_call>`, because the project's chat template only knows `content`; pass `render_tool_calls` to change it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from trainer.types import Sample, Status


def default_render_tool_calls(tool_calls: Sequence[Mapping[str, Any]]) -> str:
    parts = []
    for call in tool_calls:
        fn = call.get("function", call)
        args = fn.get("arguments", {})
        if isinstance(args, str):  # OpenAI style sends arguments as a JSON string
            args = json.loads(args) if args.strip() else {}
        parts.append("<tool_call>" + json.dumps({"name": fn["name"], "arguments": args}, sort_keys=True)
                     + "</tool_call>")
    return "".join(parts)


def _normalise(messages: Sequence[Mapping[str, Any]], render: Callable[[Sequence[Mapping]], str]) -> list[dict]:
    out = []
    for i, m in enumerate(messages):
        if "role" not in m:
            raise ValueError(f"messages[{i}]: missing 'role'")
        content = m.get("content") or ""
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}]: content must be a string, got {type(content).__name__}")
        if m.get("tool_calls"):
            if m["role"] != "assistant":
                raise ValueError(f"messages[{i}]: only assistant turns may carry tool_calls, got role {m['role']!r}")
            content = content + render(m["tool_calls"])
        out.append({"role": m["role"], "content": content})
    return out


def trajectory_to_sample(messages: Sequence[Mapping[str, Any]], tokenizer: Any, *, reward: float | None = None,
                         metadata: Mapping[str, Any] | None = None,
                         render_tool_calls: Callable[[Sequence[Mapping]], str] = default_render_tool_calls,
                         max_length: int | None = None) -> Sample:
    """Turn a conversation into a Sample whose loss mask covers only the assistant's own tokens.

    Needs a chat template that marks assistant spans with `{% generation %}` (the project tokenizer's does).
    `max_length` truncates the response (mask and tokens together) and marks the sample TRUNCATED.
    """
    msgs = _normalise(messages, render_tool_calls)
    first_assistant = next((i for i, m in enumerate(msgs) if m["role"] == "assistant"), None)
    if first_assistant is None:
        raise ValueError("messages: a trajectory needs at least one assistant turn to train on")
    if first_assistant == 0:
        raise ValueError("messages: the first turn is the assistant's; a prompt (system/user turn) must come first")

    full = tokenizer.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = list(full["input_ids"]), list(full["assistant_masks"])
    if not any(mask):
        raise ValueError("tokenizer: its chat template returned no assistant mask; it needs {% generation %} "
                         "markers around assistant content")
    prompt_ids = list(tokenizer.apply_chat_template(msgs[:first_assistant], tokenize=True,
                                                    add_generation_prompt=True, return_dict=True)["input_ids"])
    if ids[: len(prompt_ids)] != prompt_ids:
        raise ValueError("tokenizer: rendering the prompt alone does not give a prefix of the full conversation; "
                         "the chat template must render turns append-only")
    response_ids, response_mask = ids[len(prompt_ids):], mask[len(prompt_ids):]
    # Trailing template glue after the last model token (e.g. the "\n" after <|im_end|>) is not the model's
    # output and not needed as context for anything: drop it.
    while response_mask and response_mask[-1] == 0 and msgs[-1]["role"] == "assistant":
        response_ids.pop()
        response_mask.pop()
    status = Status.COMPLETED
    if max_length is not None and len(response_ids) > max_length:
        response_ids, response_mask, status = response_ids[:max_length], response_mask[:max_length], Status.TRUNCATED
    return Sample(
        prompt=tokenizer.decode(prompt_ids, skip_special_tokens=False),
        tokens=tuple(prompt_ids + response_ids),
        response=tokenizer.decode(response_ids, skip_special_tokens=False),
        response_length=len(response_ids),
        loss_mask=tuple(int(m) for m in response_mask),
        reward=reward,
        metadata=dict(metadata or {}),
        status=status,
    )
