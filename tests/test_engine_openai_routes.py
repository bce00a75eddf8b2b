"""OpenAI's API on the embedded engine's own server (engines/embedded/openai_routes.py), driven by the official
`openai` SDK over loopback against a real engine subprocess (the tiny preset): answers equal the engine's own
/generate answers for the same rendered prompt (greedy, and seeded sampling with n > 1), log-probs included; tool
calls written by the model are parsed into `tool_calls` (a model trained here to write one); streaming gives the same
text; bad requests are refused naming the field.

References are computed with plain HTTP calls of /generate and the chat template applied by hand here, not by the
code under test. Prompts are fresh random texts each run (printed in assertion messages).
"""

from __future__ import annotations

import json
import random
import string

import httpx
import openai
import pytest
from gateway_support import CALC, CALL, IM_END_ID, TOK, train_to_write

from engines.embedded.presets import build_tiny_model

ENGINE_SEED = 7
EOS_ID = TOK.eos_token_id


@pytest.fixture(scope="module")
def client(engine):
    return openai.OpenAI(base_url=f"{engine.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model_name(engine):
    return httpx.get(f"{engine.url}/get_model_info", timeout=30).json()["model_path"]


def random_text(rng: random.Random, n: int = 12) -> str:
    return "".join(rng.choice(string.ascii_letters + string.digits + " +*=?") for _ in range(n))


def chat_ids(messages, tools=None) -> list[int]:
    return TOK.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                   return_dict=True)["input_ids"]


def generate(engine, ids, **sampling) -> list[dict]:
    """The engine's own /generate answers (plain HTTP): [{output_ids, logprobs, finish}] per sample."""
    r = httpx.post(f"{engine.url}/generate", json={"input_ids": [ids], "sampling_params": sampling}, timeout=120)
    r.raise_for_status()
    return [{"ids": o["output_ids"], "logprobs": [x[0] for x in o["meta_info"]["output_token_logprobs"]],
             "finish": o["meta_info"]["finish_reason"]["type"]} for o in r.json()]


def text_of(ids) -> str:
    return TOK.decode(ids, skip_special_tokens=True)


def test_models_lists_the_engine_model(client, model_name):
    assert [m.id for m in client.models.list()] == [model_name]


def test_greedy_chat_and_completions_equal_the_engines_generate(engine, client, model_name):
    rng = random.Random()
    for _ in range(2):
        messages = [{"role": "system", "content": random_text(rng, 6)}, {"role": "user", "content": random_text(rng)}]
        ref = generate(engine, chat_ids(messages), temperature=0.0, max_new_tokens=12,
                       stop_token_ids=[IM_END_ID])[0]
        r = client.chat.completions.create(model=model_name, messages=messages, temperature=0, max_tokens=12,
                                           logprobs=True)
        choice = r.choices[0]
        assert choice.message.content == text_of(ref["ids"]), messages
        assert choice.finish_reason == ("stop" if ref["finish"] == "stop" else "length")
        got = [t.logprob for t in choice.logprobs.content]
        assert len(got) == len(ref["ids"]) and max(abs(a - b) for a, b in zip(got, ref["logprobs"])) <= 1e-5
        assert r.usage.prompt_tokens == len(chat_ids(messages)) and r.usage.completion_tokens == len(ref["ids"])

        prompt = random_text(rng)
        ref = generate(engine, TOK(prompt)["input_ids"], temperature=0.0, max_new_tokens=10)[0]
        c = client.completions.create(model=model_name, prompt=prompt, temperature=0, max_tokens=10, logprobs=0)
        assert c.choices[0].text == text_of(ref["ids"]), prompt
        assert max(abs(a - b) for a, b in zip(c.choices[0].logprobs.token_logprobs, ref["logprobs"])) <= 1e-5


def test_seeded_sampling_with_n_choices_equals_the_engines_generate(engine, client, model_name):
    messages = [{"role": "user", "content": random_text(random.Random())}]
    seed = random.randrange(2 ** 20)
    refs = generate(engine, chat_ids(messages), temperature=0.8, top_p=0.9, max_new_tokens=8, n=3, seed=seed,
                    stop_token_ids=[IM_END_ID])
    r = client.chat.completions.create(model=model_name, messages=messages, temperature=0.8, top_p=0.9, max_tokens=8,
                                       n=3, seed=seed)
    assert [c.message.content for c in r.choices] == [text_of(x["ids"]) for x in refs], (messages, seed)
    assert len({c.message.content for c in r.choices}) > 1  # three draws (seed + j), not one three times
    assert r.usage.completion_tokens == sum(len(x["ids"]) for x in refs)


def test_streaming_gives_the_same_answer_and_usage(client, model_name):
    messages = [{"role": "user", "content": random_text(random.Random())}]
    whole = client.chat.completions.create(model=model_name, messages=messages, temperature=0, max_tokens=10)
    chunks = list(client.chat.completions.create(model=model_name, messages=messages, temperature=0, max_tokens=10,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [whole.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    prompt = random_text(random.Random())
    whole = client.completions.create(model=model_name, prompt=prompt, temperature=0, max_tokens=6)
    streamed = list(client.completions.create(model=model_name, prompt=prompt, temperature=0, max_tokens=6,
                                              stream=True))
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text


def train_to_call(messages):
    """The engine's tiny model, trained here to answer `messages` with "Let me see. " + CALL (a random model never
    writes a tool call), until every target token has probability > 0.9 under teacher forcing: then each is the
    argmax by a wide margin, so greedy decoding writes it (about 60 Adam steps, a second)."""
    target = TOK.encode("Let me see. " + CALL) + [IM_END_ID]
    return train_to_write(build_tiny_model(seed=ENGINE_SEED), chat_ids(messages, [CALC]), target, min_logprob=-0.1)


def test_tool_calls_are_parsed_into_openai_tool_calls(engine, client, model_name, tmp_path):
    messages = [{"role": "user", "content": "What is 6*7?"}]
    train_to_call(messages).save_pretrained(tmp_path / "caller", safe_serialization=True)
    r = httpx.post(f"{engine.url}/update_weights_from_disk", json={"model_path": str(tmp_path / "caller")},
                   timeout=120)
    assert r.status_code == 200, r.text
    ask = dict(model=model_name, messages=messages, tools=[CALC], temperature=0, max_tokens=120)
    ref = generate(engine, chat_ids(messages, [CALC]), temperature=0.0, max_new_tokens=120,
                   stop_token_ids=[IM_END_ID])[0]
    assert text_of(ref["ids"]) == "Let me see. " + CALL  # the engine writes the call (the reference path)

    choice = client.chat.completions.create(**ask).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me see."
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "calculator"
    assert json.loads(call.function.arguments) == {"expression": "6*7"}

    chunks = list(client.chat.completions.create(**ask, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "Let me see."
    streamed = [t for d in deltas for t in (d.tool_calls or ())]
    assert [(t.function.name, json.loads(t.function.arguments)) for t in streamed] == \
        [("calculator", {"expression": "6*7"})]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    raw = client.chat.completions.create(**ask, tool_choice="none").choices[0]  # not parsed: the text as written
    assert raw.message.content == "Let me see. " + CALL and raw.message.tool_calls is None
    assert raw.finish_reason == "stop"


@pytest.mark.parametrize(("field", "kw"), [
    ("top_logprobs", dict(logprobs=True, top_logprobs=2)),
    ("frobnicate", dict(extra_body={"frobnicate": 1})),
    ("tool_choice", dict(tools=[CALC], tool_choice="required")),
    ("max_tokens", dict(max_tokens=10 ** 6)),
    ("messages[0]", dict(messages=[{"role": "wizard", "content": "hi"}])),
])
def test_bad_requests_are_refused_naming_the_field(client, model_name, field, kw):
    args = {"model": model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kw}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**args)
    assert err.value.status_code == 400 and err.value.param == field and field in err.value.message


def test_an_unknown_model_is_a_404_naming_the_served_ones(client, model_name):
    with pytest.raises(openai.NotFoundError, match=model_name):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
