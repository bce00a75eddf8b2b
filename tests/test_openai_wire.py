"""engines/openai_wire.py: OpenAI request validation and answer shapes as pure functions (no server, no engine)."""

from __future__ import annotations

import json

import pytest

from engines.openai_wire import (
    WireError,
    chat_chunks,
    chat_response,
    cut_at_stop,
    parse_chat_request,
    parse_completion_request,
    parse_messages,
    same_assistant_turn,
    template_messages,
)

USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("body, param", [
    ({"model": "m", "messages": USER, "logit_bias": {"1": 2}}, "logit_bias"),
    ({"model": "m", "messages": []}, "messages"),
    ({"model": "m", "messages": [{"role": "user"}]}, "messages[0].content"),
    ({"model": "m", "messages": [{"role": "user", "content": "x", "foo": 1}]}, "messages[0].foo"),
    ({"model": "m", "messages": [{"role": "tool", "content": "4"}]}, "messages[0].tool_call_id"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content"),
    ({"model": "m", "messages": USER, "n": 0}, "n"),
    ({"model": "m", "messages": USER, "top_p": 0}, "top_p"),
    ({"model": "m", "messages": USER, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"model": "m", "messages": USER, "presence_penalty": 0.5}, "presence_penalty"),
    ({"model": "m", "messages": USER, "tools": [{"type": "function"}]}, "tools"),
    ({"model": "m", "messages": USER, "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tool_choice"),
    ({"messages": USER}, "model"),
])
def test_a_bad_chat_request_names_its_field(body, param):
    with pytest.raises(WireError) as e:
        parse_chat_request(body)
    assert e.value.param == param and e.value.status == 400
    assert e.value.body()["error"]["param"] == param and e.value.body()["error"]["type"] == "invalid_request_error"


def test_a_chat_request_reads_openai_shapes():
    req = parse_chat_request({
        "model": "m", "n": 2, "max_completion_tokens": 7, "max_tokens": 99, "stop": "##", "seed": 3,
        "logprobs": True, "stream": True, "stream_options": {"include_usage": True}, "tool_choice": "none",
        "messages": [{"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text",
                                                                                          "text": "brief"}]},
                     {"role": "user", "content": "2+2?"},
                     {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
                         {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": '{"e": "2+2"}'}}]},
                     {"role": "tool", "tool_call_id": "c1", "content": "4"}]})
    assert req.messages[0] == {"role": "system", "content": "be brief"}
    assert req.messages[2]["tool_calls"][0]["function"] == {"name": "calc", "arguments": '{"e": "2+2"}'}
    assert not req.parse_tools and req.sampling.max_tokens == 7 and req.sampling.stop == ("##",)
    assert (req.sampling.n, req.sampling.seed, req.sampling.logprobs, req.sampling.include_usage) == (2, 3, True, True)
    # What a chat template gets: arguments as objects, null content as "".
    rendered = template_messages(req.messages)
    assert rendered[2]["content"] == "" and rendered[2]["tool_calls"][0]["function"]["arguments"] == {"e": "2+2"}


def test_a_completion_request_takes_text_or_token_ids():
    assert parse_completion_request({"model": "m", "prompt": [5, 6, 7]}).prompt == (5, 6, 7)
    assert parse_completion_request({"model": "m", "prompt": "ab", "logprobs": 0}).sampling.logprobs
    for body, param in (({"model": "m", "prompt": ["a", "b"]}, "prompt"), ({"model": "m", "prompt": "a",
                                                                           "logprobs": 5}, "logprobs"),
                        ({"model": "m", "prompt": "a", "echo": True}, "echo")):
        with pytest.raises(WireError) as e:
            parse_completion_request(body)
        assert e.value.param == param


def test_the_assistant_turn_sent_back_is_matched_by_meaning_not_by_ids():
    returned = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call-1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1, "b": [2]}'}}]}
    sent = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "other", "type": "function", "function": {"name": "f", "arguments": '{"b": [2], "a": 1}'}}]}
    assert same_assistant_turn(sent, returned)
    changed = json.loads(json.dumps(sent))
    changed["tool_calls"][0]["function"]["arguments"] = '{"a": 2, "b": [2]}'
    assert not same_assistant_turn(changed, returned)
    assert not same_assistant_turn({"role": "assistant", "content": "x"}, returned)
    for other in ('{"a": true, "b": [2]}', '{"a": 1.0, "b": [2]}', '{"a": 1, "b": [2.0]}', '{"a": "1", "b": [2]}'):
        changed["tool_calls"][0]["function"]["arguments"] = other  # equal to 1 / 2 in Python, another JSON value
        assert not same_assistant_turn(changed, returned), other


def test_a_stop_string_keeps_the_fewest_tokens_that_hold_it():
    pieces = ["He", "llo", " wo", "rld", "!"]
    decode = lambda ids: "".join(pieces[i] for i in ids)  # noqa: E731
    assert cut_at_stop(decode, [0, 1, 2, 3, 4], ["o w"]) == (3, "Hell")
    assert cut_at_stop(decode, [0, 1, 2, 3, 4], ["rld", "llo"]) == (2, "He")
    assert cut_at_stop(decode, [0, 1, 2, 3, 4], ["xyz"]) is None and cut_at_stop(decode, [0], []) is None


def test_a_stream_is_the_response_in_chunks():
    message = {"role": "assistant", "content": "ab"}
    lp = [{"token": t, "logprob": -1.0, "bytes": [], "top_logprobs": []} for t in "ab"]
    response = chat_response("m", [{"index": 0, "message": message, "finish_reason": "stop",
                                    "logprobs": {"content": lp}}], 3, 2)
    events = list(chat_chunks(response, [["a", "b"]], include_usage=True))
    assert events[-1] == "data: [DONE]\n\n"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == "ab"
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == response["id"] for c in chunks)


def test_stream_pieces_never_split_a_character_across_deltas():
    """The tiny tokenizer is byte-level: 'é' and '€' are 2 and 3 tokens, each prefix of them decodes to U+FFFD.
    The deltas hold whole characters only, one piece per token, and sum to the text (also when a stop string cut
    the text inside a token)."""
    import random

    from engines.openai_wire import stream_pieces
    from engines.tiny import build_tokenizer

    tok = build_tokenizer()
    rng = random.Random()
    text = "".join(rng.choice(["a", "é", "€", "7", " ", "ü"]) for _ in range(12))  # fresh each run
    ids = tok.encode(text)
    assert len(ids) > len(text)  # some characters span several tokens
    pieces = stream_pieces(tok, ids, len(ids), text)
    assert len(pieces) == len(ids) and "".join(pieces) == text, text
    assert not any("\ufffd" in p for p in pieces), pieces
    cut = text[:5]  # a stop string's cut: the kept tokens hold more than the text returned
    keep = next(k for k in range(1, len(ids) + 1) if tok.decode(ids[:k]).startswith(cut))
    assert "".join(stream_pieces(tok, ids, keep, cut)) == cut


def test_assistant_fields_the_prompt_would_drop_are_refused_unless_empty():
    """Was: an assistant message's reasoning_content, refusal or annotations were dropped whatever they held (the
    template is given content and tool_calls only): the engine's context silently differed from the agent's."""
    from openai.types.chat import ChatCompletionMessage

    sdk = ChatCompletionMessage(role="assistant", content="4").model_dump()  # as the SDK sends a reply back
    assert {"refusal", "annotations"} <= set(sdk)
    user = {"role": "user", "content": "2+2="}
    assert parse_messages([user, sdk])[1] == {"role": "assistant", "content": "4"}
    for key, value in (("reasoning_content", "let me think"), ("refusal", "no"),
                       ("annotations", [{"type": "url_citation"}])):
        with pytest.raises(WireError, match=rf"messages\[1\]\.{key}: not supported") as e:
            parse_messages([user, {**sdk, key: value}])
        assert e.value.param == f"messages[1].{key}"
