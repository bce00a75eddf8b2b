"""OpenAI's wire format, as pure functions: request validation, chat-template rendering of OpenAI messages, and the
shapes of the answers (chat completions, completions, their SSE chunks, the model list, errors).

No server and no engine here: the recording gateway (trainer/rollout/gateway.py) serves these shapes in front of any
`engines.protocol.InferenceEngine`, and the embedded engine's own server serves them too
(engines/embedded/openai_routes.py); this module imports nothing of trainer/. Both shape an engine completion into
an answer with `chat_choice` / `completion_choice` and `chat_answer` / `completion_answer`.

A request that OpenAI's API accepts but this project cannot honour exactly (a field it does not know, `top_logprobs`,
a forced `tool_choice`) is refused with a `WireError` naming the field: silently ignoring it would hand an agent
answers it did not ask for.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

ROLES = ("system", "user", "assistant", "tool", "developer")
# Fields of an assistant message the openai SDK sends back as it received them (model_dump of the message): read,
# or accepted when empty.
_ASSISTANT_KEYS = {"role", "content", "tool_calls", "name", "refusal", "annotations", "audio", "function_call",
                   "reasoning_content"}
_MESSAGE_KEYS = {"role", "content", "name", "tool_call_id"}


class WireError(ValueError):
    """A request the API refuses: `status` (400: a bad request, 401: no such credential), `param` the field at
    fault (OpenAI's error shape names it)."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.status = param, status

    def body(self) -> dict[str, Any]:
        kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}.get(self.status,
                                                                                                   "api_error")
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": None}}


@dataclasses.dataclass(frozen=True)
class SamplingRequest:
    """What a request asks of the sampler (OpenAI's names): None where it did not say."""

    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: bool = False
    stream: bool = False
    include_usage: bool = False


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    """A validated `POST /v1/chat/completions` body. `messages` are plain dicts (assistant tool calls with
    `arguments` as the JSON string OpenAI sends); `tools` OpenAI function schemas; `parse_tools` False for
    tool_choice "none" (the model's text is returned as it is)."""

    model: str
    messages: tuple[dict, ...]
    tools: tuple[dict, ...]
    parse_tools: bool
    sampling: SamplingRequest


@dataclasses.dataclass(frozen=True)
class CompletionRequest:
    """A validated `POST /v1/completions` body: the prompt as text, or as token ids."""

    model: str
    prompt: str | tuple[int, ...]
    sampling: SamplingRequest


_SAMPLING_KEYS = {"n", "temperature", "top_p", "max_tokens", "max_completion_tokens", "stop", "seed", "logprobs",
                  "top_logprobs", "stream", "stream_options", "user", "frequency_penalty", "presence_penalty"}


def _check(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise WireError(message, param=param)


def _number(body: Mapping[str, Any], key: str, lo: float, hi: float) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    _check(isinstance(v, int | float) and not isinstance(v, bool) and lo <= v <= hi,
           f"{key}={v!r}: give a number in [{lo}, {hi}]", key)
    return float(v)


def _int(body: Mapping[str, Any], key: str, lo: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    _check(isinstance(v, int) and not isinstance(v, bool) and v >= lo, f"{key}={v!r}: give an integer >= {lo}", key)
    return v


def json_body(raw: bytes) -> Any:
    """A request's body as JSON; a WireError (400) naming the body otherwise."""
    try:
        return json.loads(raw)
    except ValueError as e:
        raise WireError(f"the body is not JSON: {e}", param="body") from e


def parse_sampling(body: Mapping[str, Any], *, logprobs_is_int: bool = False) -> SamplingRequest:
    """The sampling fields of a chat or completions body. Penalties are accepted only at 0 (their neutral value):
    the engine protocol has none. `top_logprobs` > 0 is refused (the engines return the sampled token's log-prob
    only). `logprobs_is_int`: /v1/completions' `logprobs` is a count of alternatives (0: the sampled token's)."""
    for key in ("frequency_penalty", "presence_penalty"):
        _check(body.get(key) in (None, 0, 0.0), f"{key}={body.get(key)!r}: the engines apply no penalty; leave it "
               f"unset or 0", key)
    _check(not body.get("top_logprobs"), "top_logprobs: the engines return the log-prob of the sampled token only; "
           "leave top_logprobs unset or 0 (logprobs=true gives each token's)", "top_logprobs")
    stop = body.get("stop")
    stop = (stop,) if isinstance(stop, str) else tuple(stop) if isinstance(stop, list) else () if stop is None else None
    _check(stop is not None and all(isinstance(s, str) and s for s in stop) and len(stop) <= 4,
           f"stop={body.get('stop')!r}: give a string or a list of up to 4 non-empty strings", "stop")
    max_tokens = _int(body, "max_completion_tokens", 1)
    max_tokens = _int(body, "max_tokens", 1) if max_tokens is None else max_tokens
    options = body.get("stream_options") or {}
    _check(isinstance(options, Mapping) and set(options) <= {"include_usage"},
           f"stream_options={options!r}: only include_usage is supported", "stream_options")
    lp = body.get("logprobs")
    if logprobs_is_int:
        _check(lp in (None, 0), f"logprobs={lp!r}: the engines return the sampled token's log-prob only: give 0 "
               f"(each token's) or leave it unset", "logprobs")
        want_lp = lp == 0
    else:
        _check(lp is None or isinstance(lp, bool), f"logprobs={lp!r}: give true or false", "logprobs")
        want_lp = bool(lp)
    seed = body.get("seed")
    _check(seed is None or (isinstance(seed, int) and not isinstance(seed, bool)), f"seed={seed!r}: give an integer",
           "seed")
    return SamplingRequest(n=_int(body, "n", 1) or 1, temperature=_number(body, "temperature", 0.0, 2.0),
                           top_p=_number(body, "top_p", 1e-9, 1.0), max_tokens=max_tokens, stop=stop, seed=seed,
                           logprobs=want_lp, stream=bool(body.get("stream")),
                           include_usage=bool(options.get("include_usage")))


def _content(value: Any, where: str) -> str | None:
    """A message's content as text: a string, null, or a list of text parts (images are refused)."""
    if value is None or isinstance(value, str):
        return value
    _check(isinstance(value, list), f"{where}.content: give a string or a list of text parts", f"{where}.content")
    parts = []
    for p in value:
        _check(isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str),
               f"{where}.content: only text parts ({{'type': 'text', 'text': ...}}) are supported", f"{where}.content")
        parts.append(p["text"])
    return "".join(parts)


def _tool_calls(value: Any, where: str) -> list[dict] | None:
    if not value:
        return None
    _check(isinstance(value, list), f"{where}.tool_calls: give a list", f"{where}.tool_calls")
    out = []
    for k, c in enumerate(value):
        fn = c.get("function") if isinstance(c, Mapping) else None
        ok = isinstance(fn, Mapping) and isinstance(fn.get("name"), str) and isinstance(fn.get("arguments"), str)
        _check(ok, f"{where}.tool_calls[{k}]: give {{'id', 'type': 'function', 'function': {{'name', 'arguments': "
               f"<JSON string>}}}}", f"{where}.tool_calls")
        out.append({"id": str(c.get("id", "")), "type": "function",
                    "function": {"name": fn["name"], "arguments": fn["arguments"]}})
    return out


def parse_messages(value: Any) -> tuple[dict, ...]:
    """OpenAI chat messages as plain dicts: {"role", "content": str | None} (+ "tool_calls" on an assistant turn,
    "tool_call_id" on a tool result, "name"). Unknown roles and fields are refused, naming them."""
    _check(isinstance(value, list) and len(value) > 0, "messages: give a non-empty list of messages", "messages")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        _check(isinstance(m, Mapping) and m.get("role") in ROLES, f"{where}: each message needs a role among {ROLES}",
               where)
        role = m["role"]
        allowed = _ASSISTANT_KEYS if role == "assistant" else _MESSAGE_KEYS
        extra = sorted(set(m) - allowed)
        _check(not extra, f"{where}: unsupported field(s) {extra} for role {role!r}", f"{where}.{extra[0]}"
               if extra else where)
        if role == "assistant":
            for key in ("audio", "function_call"):
                _check(not m.get(key), f"{where}.{key}: not supported (use tool_calls)", f"{where}.{key}")
            for key in ("refusal", "annotations", "reasoning_content"):  # never in our answers; the prompt drops them
                _check(not m.get(key), f"{where}.{key}: not supported (the chat template is given content and "
                       f"tool_calls only): leave it empty", f"{where}.{key}")
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role,
                               "content": _content(m.get("content"), where)}
        if role == "tool":
            _check(isinstance(m.get("tool_call_id"), str), f"{where}: a tool message needs its tool_call_id",
                   f"{where}.tool_call_id")
            msg["tool_call_id"] = m["tool_call_id"]
        calls = _tool_calls(m.get("tool_calls"), where) if role == "assistant" else None
        if calls:
            msg["tool_calls"] = calls
        _check(msg["content"] is not None or calls, f"{where}: give a content", f"{where}.content")
        if m.get("name") is not None:
            msg["name"] = str(m["name"])
        out.append(msg)
    return tuple(out)


def parse_tools(body: Mapping[str, Any]) -> tuple[tuple[dict, ...], bool]:
    """The request's function tools, and whether to read tool calls out of the model's text (tool_choice "auto",
    the default, or "none"; a forced call needs constrained decoding the engines do not do)."""
    tools = body.get("tools") or []
    _check(isinstance(tools, list), "tools: give a list of {'type': 'function', 'function': {...}}", "tools")
    for k, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, Mapping) else None
        _check(isinstance(t, Mapping) and t.get("type") == "function" and isinstance(fn, Mapping)
               and isinstance(fn.get("name"), str), f"tools[{k}]: give {{'type': 'function', 'function': {{'name', "
               f"'description', 'parameters'}}}}", "tools")
    choice = body.get("tool_choice", "auto")
    _check(choice in ("auto", "none"), f"tool_choice={choice!r}: only 'auto' and 'none' are supported (a forced call "
           f"needs constrained decoding)", "tool_choice")
    return tuple(dict(t) for t in tools), choice == "auto"


def _refuse_unknown(body: Mapping[str, Any], known: set[str]) -> None:
    unknown = sorted(set(body) - known)
    _check(not unknown, f"unsupported field(s) {unknown}; supported: {sorted(known)}", unknown[0] if unknown else "")


def parse_chat_request(body: Any) -> ChatRequest:
    """A `POST /v1/chat/completions` body, validated (WireError naming the first bad field)."""
    _check(isinstance(body, Mapping), "the body must be a JSON object", "body")
    _refuse_unknown(body, {"model", "messages", "tools", "tool_choice", "parallel_tool_calls", "metadata", "store"}
                    | _SAMPLING_KEYS)
    _check(isinstance(body.get("model"), str), "model: give the model's name (GET /v1/models lists it)", "model")
    tools, parse = parse_tools(body)
    return ChatRequest(model=body["model"], messages=parse_messages(body.get("messages")), tools=tools,
                       parse_tools=parse, sampling=parse_sampling(body))


def parse_completion_request(body: Any) -> CompletionRequest:
    """A `POST /v1/completions` body: one prompt, text or token ids (a list of prompts is refused)."""
    _check(isinstance(body, Mapping), "the body must be a JSON object", "body")
    _refuse_unknown(body, {"model", "prompt", "echo", "suffix", "best_of"} | _SAMPLING_KEYS)
    for key in ("echo", "suffix"):
        _check(not body.get(key), f"{key}: not supported", key)
    _check(body.get("best_of") in (None, 1), "best_of: not supported (use n)", "best_of")
    _check(isinstance(body.get("model"), str), "model: give the model's name (GET /v1/models lists it)", "model")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompt = tuple(prompt)
    _check(isinstance(prompt, str | tuple) and len(prompt) > 0,
           "prompt: give one non-empty string or one list of token ids", "prompt")
    return CompletionRequest(model=body["model"], prompt=prompt, sampling=parse_sampling(body, logprobs_is_int=True))


# ----------------------------------------------------------------------------------------------- rendering
def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict]:
    """OpenAI messages as Hugging Face chat templates read them: tool-call arguments as objects (OpenAI sends JSON
    strings; Qwen's and Llama's templates `tojson` them) and null content as ""."""
    out = []
    for m in messages:
        msg = {k: v for k, v in m.items() if k != "tool_calls"}
        msg["content"] = m.get("content") or ""
        if m.get("tool_calls"):
            msg["tool_calls"] = [{"type": "function", "id": c.get("id", ""),
                                  "function": {"name": c["function"]["name"],
                                               "arguments": _arguments(c["function"]["arguments"])}}
                                 for c in m["tool_calls"]]
        out.append(msg)
    return out


def _arguments(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value) if value.strip() else {}
    except ValueError:
        return value


def same_assistant_turn(sent: Mapping[str, Any], returned: Mapping[str, Any]) -> bool:
    """Whether the assistant message an agent sent back is the one the server returned: the same text (null and ""
    alike) and the same calls (names and arguments as JSON values: key order and whitespace aside; ids, which
    templates do not render, aside). Arguments compare as canonical JSON text, not as Python values, where true, 1
    and 1.0 are equal."""
    def calls(m: Mapping[str, Any]) -> list[tuple[str, str]]:
        return [(c["function"]["name"], json.dumps(_arguments(c["function"]["arguments"]), sort_keys=True))
                for c in m.get("tool_calls") or ()]

    return (sent.get("content") or "") == (returned.get("content") or "") and calls(sent) == calls(returned)


def render_chat(tokenizer: Any, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] = ()
                ) -> list[int]:
    """The token ids of a chat request's opening: its messages through the chat template (OpenAI's messages made
    template-ready by `template_messages`, the tool schemas given to the template), up to the assistant's
    generation prompt."""
    out = tokenizer.apply_chat_template(template_messages(messages), tools=[dict(t) for t in tools] or None,
                                        add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(out["input_ids"])


def end_of_turn_ids(tokenizer: Any) -> list[int]:
    """The special token the chat template closes an assistant turn with ([] when it writes none): a chat answer
    ends there (`<|im_end|>` for Qwen, `<|eot_id|>` for Llama 3), whether or not it is the tokenizer's eos."""
    marker = "x7q"
    text = tokenizer.apply_chat_template([{"role": "user", "content": "1"}, {"role": "assistant", "content": marker}],
                                         tokenize=False)
    tail = text[text.rindex(marker) + len(marker):]
    special = set(getattr(tokenizer, "all_special_ids", ()))
    special |= {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False)}
    for t in tokenizer(tail, add_special_tokens=False)["input_ids"]:
        if t in special:
            return [int(t)]
    return []


def cut_at_stop(decode: Any, ids: Sequence[int], stops: Sequence[str]) -> tuple[int, str] | None:
    """Where the first of the `stops` strings appears in the text of `ids`: (tokens to keep: the fewest whose text
    holds it, the text before it), or None. `decode(ids) -> str`. The kept tokens are a prefix of the engine's, so
    their log-probs stay the engine's; the text past the stop string is dropped (OpenAI leaves the stop out)."""
    if not stops:
        return None
    for k in range(1, len(ids) + 1):
        text = decode(list(ids[:k]))
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return k, text[:min(hits)]
    return None


def _text(tokenizer: Any, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=True)


def cut_completion(tokenizer: Any, ids: Sequence[int], finish_reason: str,
                   stop: Sequence[str]) -> tuple[int, str, str]:
    """(tokens kept, their text, finish reason) of an engine completion under the request's stop strings: cut after
    the fewest tokens that hold a stop string (finish "stop"), else all of it with the engine's reason."""
    hit = cut_at_stop(functools.partial(_text, tokenizer), ids, stop)
    if hit is not None:
        return hit[0], hit[1], "stop"
    return len(ids), _text(tokenizer, ids), finish_reason


def stream_pieces(tokenizer: Any, ids: Sequence[int], keep: int, text: str) -> list[str]:
    """`text` (the answer of the first `keep` tokens of `ids`) cut at token boundaries: a stream's content deltas,
    one per kept token, summing to `text`. A character whose UTF-8 bytes span several tokens (byte-level
    tokenizers) decodes to U+FFFD until its last byte: its tokens' pieces stay empty until the character is whole,
    so a delta never holds a replacement character that the final text does not."""
    pieces, sent = [], ""
    for k in range(1, keep + 1):
        now = _text(tokenizer, ids[:k])[:len(text)]
        if now.endswith("\ufffd") or not now.startswith(sent):  # an unfinished character: wait for its last byte
            pieces.append("")
            continue
        pieces.append(now[len(sent):])
        sent = now
    if pieces and sent != text:  # what is left (a stop string cut inside a token, a last unfinished character)
        if not text.startswith(sent):  # prefixes that do not decode as the whole does: the text in one piece
            pieces, sent = [""] * len(pieces), ""
        pieces[-1] += text[len(sent):]
    return pieces


@dataclasses.dataclass(frozen=True)
class ShapedChoice:
    """One engine completion as an answer's choice. `keep`: how many of its tokens the answer holds (a stop string
    cuts the rest: a prefix, so its log-probs stay the engine's); `choice`: OpenAI's choice object; `pieces`: its
    stream's content deltas ([] when not streaming); `tool_calls`: the calls the model wrote, unreadable ones
    included."""

    keep: int
    choice: dict
    pieces: tuple[str, ...] = ()
    tool_calls: int = 0


def chat_choice(index: int, ids: Sequence[int], logprobs: Sequence[float], finish_reason: str, req: ChatRequest, *,
                tokenizer: Any, parse: Callable[[str], Any]) -> ShapedChoice:
    """A chat choice from an engine completion (`ids`, their `logprobs`, its finish reason): cut at the request's
    stop strings; with `tools` (and tool_choice "auto"), a finished turn's text read by `parse` (text ->
    engines.tool_calls.ParsedTurn): readable calls become `tool_calls` (finish "tool_calls"); a turn with an
    unreadable call keeps its raw text, so the agent sees what went wrong."""
    keep, text, finish = cut_completion(tokenizer, ids, finish_reason, req.sampling.stop)
    message: dict[str, Any] = {"role": "assistant", "content": text}
    pieces = stream_pieces(tokenizer, ids, keep, text) if req.sampling.stream else []
    written = 0
    if req.tools and req.parse_tools and finish == "stop":
        turn = parse(text)
        written = len(turn.calls) + len(turn.errors)
        if turn.calls and not turn.errors:
            message = {"role": "assistant", "content": turn.content or None,
                       "tool_calls": tool_call_entries(turn.calls)}
            finish = "tool_calls"
            pieces = [turn.content] if turn.content and req.sampling.stream else []
    lps = None
    if req.sampling.logprobs:
        tokens = [tokenizer.decode([t]) for t in ids[:keep]]
        lps = {"content": logprob_entries(tokens, logprobs[:keep]), "refusal": None}
    return ShapedChoice(keep, {"index": index, "message": message, "finish_reason": finish, "logprobs": lps},
                        tuple(pieces), written)


def completion_choice(index: int, ids: Sequence[int], logprobs: Sequence[float], finish_reason: str,
                      req: CompletionRequest, *, tokenizer: Any) -> ShapedChoice:
    """A text_completion choice from an engine completion, cut at the request's stop strings."""
    keep, text, finish = cut_completion(tokenizer, ids, finish_reason, req.sampling.stop)
    lps = None
    if req.sampling.logprobs:
        lps = {"tokens": [tokenizer.decode([t]) for t in ids[:keep]],
               "token_logprobs": [float(x) for x in logprobs[:keep]], "top_logprobs": None, "text_offset": None}
    return ShapedChoice(keep, {"index": index, "text": text, "finish_reason": finish, "logprobs": lps})


def chat_answer(model: str, shaped: Sequence[ShapedChoice], prompt_tokens: int,
                sampling: SamplingRequest) -> tuple[dict[str, Any], list[str]]:
    """(the chat.completion, its SSE events when the request streams, else [])."""
    response = chat_response(model, [c.choice for c in shaped], prompt_tokens, sum(c.keep for c in shaped))
    if not sampling.stream:
        return response, []
    return response, list(chat_chunks(response, [list(c.pieces) for c in shaped],
                                      include_usage=sampling.include_usage))


def completion_answer(model: str, shaped: Sequence[ShapedChoice], prompt_tokens: int,
                      sampling: SamplingRequest) -> tuple[dict[str, Any], list[str]]:
    """(the text_completion, its SSE events when the request streams, else [])."""
    response = completion_response(model, [c.choice for c in shaped], prompt_tokens, sum(c.keep for c in shaped))
    if not sampling.stream:
        return response, []
    return response, list(completion_chunks(response, include_usage=sampling.include_usage))


# ----------------------------------------------------------------------------------------------- answers
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def tool_call_entries(calls: Sequence[Mapping[str, Any]]) -> list[dict]:
    """OpenAI's `tool_calls` from parsed calls ({"function": {"name", "arguments": dict}}): arguments as JSON text."""
    return [{"id": new_id("call"), "type": "function",
             "function": {"name": c["function"]["name"], "arguments": json.dumps(c["function"]["arguments"])}}
            for c in calls]


def logprob_entries(tokens: Sequence[str], logprobs: Sequence[float]) -> list[dict]:
    """Chat `choices[i].logprobs.content`: one entry per generated token (no alternatives: top_logprobs [])."""
    return [{"token": t, "logprob": float(lp), "bytes": list(t.encode()), "top_logprobs": []}
            for t, lp in zip(tokens, logprobs)]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chat_response(model: str, choices: Sequence[Mapping[str, Any]], prompt_tokens: int,
                  completion_tokens: int) -> dict[str, Any]:
    """A chat.completion object; each choice {"index", "message", "finish_reason", "logprobs"}."""
    return {"id": new_id("chatcmpl"), "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [dict(c) for c in choices], "usage": usage(prompt_tokens, completion_tokens)}


def chat_chunks(response: Mapping[str, Any], pieces: Sequence[Sequence[str]], *,
                include_usage: bool) -> Iterator[str]:
    """A finished chat.completion as the SSE events of a stream: per choice, a role chunk, one content chunk per
    token piece (`pieces[i]`: the text of choice i cut at token boundaries, summing to its content), its tool calls
    and its finish reason; then the usage chunk (stream_options.include_usage) and `[DONE]`."""
    base = {"id": response["id"], "object": "chat.completion.chunk", "created": response["created"],
            "model": response["model"]}

    def event(choices: list[dict], **extra: Any) -> str:
        return f"data: {json.dumps({**base, 'choices': choices, **extra})}\n\n"

    for c, parts in zip(response["choices"], pieces):
        i, msg = c["index"], c["message"]
        yield event([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
        lps = (c.get("logprobs") or {}).get("content")
        per_token = lps is not None and len(lps) == len(parts)  # else the log-probs come with the last chunk
        for k, part in enumerate(parts):
            lp = {"content": [lps[k]]} if per_token else ({"content": lps} if lps and k == len(parts) - 1 else None)
            yield event([{"index": i, "delta": {"content": part}, "logprobs": lp, "finish_reason": None}])
        rest = {"content": lps} if lps and not parts else None  # no content chunk carried them: a turn of calls only
        if msg.get("tool_calls"):
            calls = [{"index": k, **t} for k, t in enumerate(msg["tool_calls"])]
            yield event([{"index": i, "delta": {"tool_calls": calls}, "logprobs": rest, "finish_reason": None}])
            rest = None
        yield event([{"index": i, "delta": {}, "logprobs": rest, "finish_reason": c["finish_reason"]}])
    if include_usage:
        yield event([], usage=response["usage"])
    yield "data: [DONE]\n\n"


def completion_response(model: str, choices: Sequence[Mapping[str, Any]], prompt_tokens: int,
                        completion_tokens: int) -> dict[str, Any]:
    """A text_completion object; each choice {"index", "text", "finish_reason", "logprobs"}."""
    return {"id": new_id("cmpl"), "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [dict(c) for c in choices], "usage": usage(prompt_tokens, completion_tokens)}


def completion_chunks(response: Mapping[str, Any], *, include_usage: bool) -> Iterator[str]:
    """A finished text_completion as SSE events: one per choice, then usage and `[DONE]`."""
    base = {k: response[k] for k in ("id", "object", "created", "model")}
    for c in response["choices"]:
        yield f"data: {json.dumps({**base, 'choices': [c]})}\n\n"
    if include_usage:
        yield f"data: {json.dumps({**base, 'choices': [], 'usage': response['usage']})}\n\n"
    yield "data: [DONE]\n\n"


def models_response(names: Sequence[str]) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": n, "object": "model", "created": 0, "owned_by": "trainer"}
                                       for n in names]}
