"""The OpenAI-compatible recording gateway (trainer/rollout/gateway.py, recording.py, engines/openai_wire.py) driven
by agents that use only the official `openai` SDK: token exactness against what the engine really produced (and
log-probs against a forward of the same weights), tool calls parsed on the server, history rewrites split into exact
sequences, streaming, n > 1, /v1/completions and /v1/models, bad requests, limits and a slow agent.

Every agent here imports nothing from the project: it gets `row` and `endpoint` (base_url, api_key, model).
The exactness tests use the real embedded engine in process; the tool-call tests use `Scripted` (a random tiny
model never writes a tool call).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from pathlib import Path

import openai
import pytest
import trio
from episode_support import CHAR_STOPS, Recording, Scripted, arithmetic_buffer
from gateway_support import (
    CALC,
    IM_END_ID,
    TOK,
    after_turn,
    assert_exact,
    check_two_turn_batch,
    opening,
    two_turn_agent,
)

from engines.embedded.presets import build_tiny_model
from engines.protocol import Completion
from engines.registry import EngineSpec, build_engine
from engines.sglang import SGLangEngine
from engines.tiny import build_tokenizer
from trainer.config import RolloutConfig
from trainer.rollout.manager import AsyncRolloutManager
from trainer.types import Status

ENGINE_SEED = 5


@pytest.fixture(scope="module")
def local():
    eng = build_engine(EngineSpec(kind="local"), model_folder="tiny", seed=ENGINE_SEED)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def model():
    return build_tiny_model(seed=ENGINE_SEED)


def run_batch(engines, agent, *, reward=None, **kw):
    base = dict(rollout_batch_size=2, n_samples_per_prompt=2, max_new_tokens=6, agent=agent, max_turns=4, seed=1,
                agent_timeout_s=30.0)
    cfg = RolloutConfig(**{**base, **kw})
    manager = AsyncRolloutManager(engines, cfg, tokenizer=TOK, reward_fn=reward, check_health=False)

    async def run():
        async with manager:
            return await manager.generate_batch(arithmetic_buffer())

    return trio.run(run)


def test_a_two_turn_agent_is_token_exact_on_the_embedded_engine(local, model):
    rec = Recording(local)
    batch = run_batch([rec], two_turn_agent, stop_token_ids=CHAR_STOPS[10:])
    assert len(batch) == 4
    worst = check_two_turn_batch(batch, rec, model, tol=1e-5)
    print(f"engine vs forward log-probs: max diff {worst:.2e}")


def test_the_gateway_over_the_http_engine_gives_the_same_exact_episodes(local, engine, model):
    """The same gateway code in front of the embedded engine's HTTP server (engines.sglang.SGLangEngine, the client of
    SGLang too): the same seeds give the same tokens as in process, and the log-probs match a forward."""
    http = Recording(SGLangEngine(engine.url, timeout_s=60))
    over_http = run_batch([http], two_turn_agent, stop_token_ids=CHAR_STOPS[10:])
    in_process = run_batch([local], two_turn_agent, stop_token_ids=CHAR_STOPS[10:])
    assert [s.tokens for s in over_http.samples] == [s.tokens for s in in_process.samples]
    assert [s.loss_mask for s in over_http.samples] == [s.loss_mask for s in in_process.samples]
    for a, b in zip(over_http.samples, in_process.samples):
        assert max(abs(x - y) for x, y in zip(a.rollout_logprobs, b.rollout_logprobs)) <= 1e-5
        assert_exact(a, [(a.tokens[:a.prompt_length], None)] + [
            (a.tokens[a.prompt_length + i:a.prompt_length + i + 1], _One(a.tokens[a.prompt_length + i],
                                                                         a.rollout_logprobs[i]) if m else None)
            for i, m in enumerate(a.loss_mask)], model)
    assert len(http.calls) == 8  # two requests per episode, each one engine row


class _One:
    """One recorded token as a completion (assert_exact's checks, token by token)."""

    def __init__(self, token, logprob):
        self.output_ids, self.logprobs = [token], [logprob]


# ----------------------------------------------------------------------------------------------- tool calls
CALL_TEXT = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'


def scripted_tools(text: str) -> str:
    return "It is 42." if "<|im_start|>tool\n" in text else "Let me compute. " + CALL_TEXT


def tool_agent(row, endpoint):
    """A plain (sync) agent: the openai client's own loop, the tool run by the agent, OpenAI's tool schema."""
    client = openai.OpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0)
    messages = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": row["prompt"]}]
    seen = []
    while True:
        r = client.chat.completions.create(model=endpoint.model, messages=messages, tools=[CALC], tool_choice="auto")
        choice = r.choices[0]
        seen.append(choice.finish_reason)
        if not choice.message.tool_calls:
            return {"reward": 1.0 if "42" in choice.message.content else 0.0, "metadata": {"finishes": seen}}
        messages.append(choice.message.model_dump(exclude_none=True))
        for call in choice.message.tool_calls:
            args = json.loads(call.function.arguments)
            assert call.function.name == "calculator" and args == {"expression": "6*7"}
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(6 * 7)})


def test_tool_calls_are_parsed_on_the_server_and_the_tool_answer_is_masked():
    engine = Scripted(scripted_tools)
    batch = run_batch([engine], tool_agent, max_new_tokens=200)
    assert len(batch) == 4
    asked = []
    for s in batch.samples:
        assert s.status == Status.COMPLETED and s.reward == 1.0
        assert s.metadata["finishes"] == ["tool_calls", "stop"] and s.metadata["tool_calls"] == 1
        start = opening([{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": s.prompt}])
        turn1 = TOK.encode("Let me compute. " + CALL_TEXT) + [IM_END_ID]
        middle = after_turn("tool", "42")
        turn2 = TOK.encode("It is 42.") + [IM_END_ID]
        assert list(s.tokens) == start + turn1 + middle + turn2
        assert list(s.loss_mask) == [1] * len(turn1) + [0] * len(middle) + [1] * len(turn2)
        assert [x for x, m in zip(s.rollout_logprobs, s.loss_mask) if m] == [-0.5] * (len(turn1) + len(turn2))
        asked += [TOK.decode(start), TOK.decode(start + turn1 + middle)]
    # The engine was asked exactly the recorded prefixes: turn 1 as it produced it, not the agent's copy re-encoded.
    assert sorted(engine.prompts) == sorted(asked)
    assert batch.metadata["tool_calls_mean"] == 1.0 and batch.metadata["turns_mean"] == 2.0


# ----------------------------------------------------------------------------------------------- splits
async def rewriting_agent(row, endpoint):
    client = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0)
    await client.chat.completions.create(model=endpoint.model, messages=[{"role": "user", "content": row["prompt"]}])
    summary = [{"role": "system", "content": "summary"}, {"role": "user", "content": "go on"}]
    await client.chat.completions.create(model=endpoint.model, messages=summary)
    return 0.5


def by_prompt(rec):
    out = {}
    for prompt, c in rec.calls:
        out.setdefault(prompt, []).append(c)
    return out


def test_an_agent_that_rewrites_its_history_splits_into_exact_sequences(local, model):
    rec = Recording(local)
    batch = run_batch([rec], rewriting_agent, stop_token_ids=CHAR_STOPS[10:])
    assert len(batch) == 8 and batch.metadata["agent_splits"] == 4
    calls = by_prompt(rec)
    summary = opening([{"role": "system", "content": "summary"}, {"role": "user", "content": "go on"}])
    for s in batch.samples:
        first = "agent_part" not in s.metadata
        start = opening([{"role": "user", "content": s.prompt}]) if first else summary
        c = [c for c in calls[tuple(start)] if list(s.tokens[len(start):]) == c.output_ids]
        assert c, "a sequence is not an engine call's prompt + its completion"
        assert_exact(s, [(start, None), (c[0].output_ids, c[0])], model)
        assert s.reward == 0.5 and s.status == Status.COMPLETED
    # Both sequences of an episode are in its group (same uid): 2 groups of 2 episodes x 2 sequences.
    uids = [s.group_index for s in batch.samples]
    assert sorted(uids.count(u) for u in set(uids)) == [4, 4]


# ----------------------------------------------------------------------------------------------- n, streaming
async def n_agent(row, endpoint):
    """n = 3 choices; the agent continues from the second one."""
    client = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0)
    messages = [{"role": "user", "content": row["prompt"]}]
    r = await client.chat.completions.create(model=endpoint.model, messages=messages, n=3, logprobs=True)
    assert [c.index for c in r.choices] == [0, 1, 2]
    lps = [[t.logprob for t in c.logprobs.content] for c in r.choices]
    messages += [r.choices[1].message, {"role": "user", "content": "again"}]
    await client.chat.completions.create(model=endpoint.model, messages=messages)
    return {"reward": 1.0, "metadata": {"choice_logprobs": lps, "usage": r.usage.completion_tokens}}


def test_n_choices_are_each_recorded_exactly_and_the_chosen_one_is_continued(local, model):
    rec = Recording(local)
    batch = run_batch([rec], n_agent, stop_token_ids=CHAR_STOPS[10:], n_samples_per_prompt=1)
    assert len(batch) == 6 and batch.metadata["agent_splits"] == 4  # per episode: 2 leaves + the continued chain
    calls = by_prompt(rec)
    for s in [s for s in batch.samples if "agent_part" not in s.metadata]:
        start = opening([{"role": "user", "content": s.prompt}])
        choices = calls[tuple(start)]
        assert len(choices) == 3
        assert s.metadata["choice_logprobs"] == [list(c.logprobs) for c in choices]
        assert s.metadata["usage"] == sum(len(c.output_ids) for c in choices)
    seqs = [s for s in batch.samples]
    for s in seqs:
        start = opening([{"role": "user", "content": s.prompt}])
        c1 = [c for c in calls[tuple(start)] if list(s.tokens[len(start):len(start) + len(c.output_ids)])
              == c.output_ids][0]
        if len(s.tokens) == len(start) + len(c1.output_ids):
            assert_exact(s, [(start, None), (c1.output_ids, c1)], model)
            continue
        glue = [] if c1.output_ids[-1] in (IM_END_ID, 2) else [IM_END_ID]
        middle = glue + after_turn("user", "again")
        prefix = tuple(start + c1.output_ids + middle)
        c2 = [c for c in calls[prefix] if list(s.tokens[len(prefix):]) == c.output_ids][0]
        assert_exact(s, [(start, None), (c1.output_ids, c1), (middle, None), (c2.output_ids, c2)], model)
    assert sum(s.metadata.get("turns", 0) for s in seqs) == 4  # 2 requests per episode, counted on its first sequence


async def streaming_agent(row, endpoint):
    client = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0)
    stream = await client.chat.completions.create(model=endpoint.model, stream=True,
                                                  stream_options={"include_usage": True},
                                                  messages=[{"role": "user", "content": row["prompt"]}])
    text, finish, usage, roles = "", None, None, []
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        for c in chunk.choices:
            roles += [c.delta.role] if c.delta.role else []
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    return {"reward": 1.0, "metadata": {"text": text, "finish": finish, "usage": usage, "roles": roles}}


def test_a_streamed_answer_is_the_recorded_completion(local):
    rec = Recording(local)
    batch = run_batch([rec], streaming_agent, stop_token_ids=CHAR_STOPS[10:])
    for s in batch.samples:
        completion = list(s.tokens[s.prompt_length:])
        assert s.metadata["text"] == TOK.decode(completion, skip_special_tokens=True)
        assert s.metadata["usage"] == len(completion) and s.metadata["roles"] == ["assistant"]
        assert s.metadata["finish"] == ("length" if len(completion) == 6 and completion[-1] not in CHAR_STOPS[10:]
                                        else "stop")


# ----------------------------------------------------------------------------------------------- bad requests, limits
async def probing_agent(row, endpoint):
    """Every refusal the API gives, each caught and written down; then one good chat and one completion."""
    client = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0)
    user = [{"role": "user", "content": row["prompt"]}]
    errors = {}

    async def refused(name, **kw):
        try:
            await client.chat.completions.create(**{"model": endpoint.model, "messages": user, **kw})
        except openai.APIStatusError as e:
            errors[name] = (e.status_code, e.body.get("param") if isinstance(e.body, dict) else None, str(e))

    await refused("unknown", extra_body={"frobnicate": 1})
    await refused("top_logprobs", logprobs=True, top_logprobs=2)
    await refused("tool_choice", tools=[CALC], tool_choice="required")
    await refused("role", messages=[{"role": "wizard", "content": "hi"}])
    await refused("temperature", temperature=7.0)
    await refused("model", model="gpt-4o")
    root = endpoint.base_url.split("/episodes/")[0] + "/v1"  # the key in the path, or else as the API key
    stranger = openai.AsyncOpenAI(base_url=root, api_key="not-an-episode", max_retries=0)
    try:
        await stranger.chat.completions.create(model=endpoint.model, messages=user)
    except openai.AuthenticationError as e:
        errors["key"] = (e.status_code, None, str(e))
    by_key = openai.AsyncOpenAI(base_url=root, api_key=endpoint.api_key, max_retries=0)
    assert [m.id async for m in by_key.models.list()] == [endpoint.model]
    models = [m.id async for m in client.models.list()]
    own_key = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key="sk-the-agents-own", max_retries=0)
    done = await own_key.completions.create(model=endpoint.model, prompt=row["prompt"], max_tokens=3, logprobs=0)
    return {"reward": 1.0, "metadata": {"errors": errors, "models": models, "text": done.choices[0].text,
                                        "lps": done.choices[0].logprobs.token_logprobs}}


def test_bad_requests_are_refused_naming_the_field(local):
    batch = run_batch([local], probing_agent, n_samples_per_prompt=1)
    for s in [s for s in batch.samples if "errors" in s.metadata]:
        errors = s.metadata["errors"]
        assert {k: v[0] for k, v in errors.items()} == {"unknown": 400, "top_logprobs": 400, "tool_choice": 400,
                                                        "role": 400, "temperature": 400, "model": 404, "key": 401}
        assert errors["unknown"][1] == "frobnicate" and "frobnicate" in errors["unknown"][2]
        assert errors["top_logprobs"][1] == "top_logprobs" and errors["tool_choice"][1] == "tool_choice"
        assert "messages[0]" in errors["role"][1] and "temperature" in errors["temperature"][2]
        assert s.metadata["models"] == ["policy"]
        # The refused requests never reached the engine: the one completion is the episode's one sequence.
        assert s.metadata["turns"] == 1 and s.status == Status.COMPLETED
        assert s.metadata["text"] == TOK.decode(list(s.tokens[s.prompt_length:]), skip_special_tokens=True)
        assert s.metadata["lps"] == list(s.rollout_logprobs) and len(s.rollout_logprobs) == 3
        assert list(s.tokens[:s.prompt_length]) == TOK.encode(s.prompt)  # /v1/completions: no chat template


async def looping_agent(row, endpoint):
    """Talks until the gateway refuses; returns a reward all the same (the episode is truncated)."""
    client = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0)
    messages = [{"role": "user", "content": row["prompt"]}]
    while True:
        try:
            r = await client.chat.completions.create(model=endpoint.model, messages=messages)
        except openai.BadRequestError as e:
            return {"reward": 0.25, "metadata": {"refusal": str(e)}}
        messages += [r.choices[0].message, {"role": "user", "content": "more"}]


@pytest.mark.parametrize("limit, why", [({"max_turns": 3}, "max_turns"), ({"max_context_tokens": 60}, "context")])
def test_limits_are_enforced_at_the_gateway_and_truncate_the_episode(local, limit, why):
    batch = run_batch([local], looping_agent, stop_token_ids=CHAR_STOPS[10:], n_samples_per_prompt=1, **limit)
    assert batch.metadata["truncated_fraction"] == 1.0 and batch.metadata["agent_splits"] == 0
    for s in batch.samples:
        assert s.status == Status.TRUNCATED and s.metadata["truncated_by"] == why and s.reward == 0.25
        assert why in s.metadata["refusal"]
        if why == "max_turns":
            assert s.metadata["turns"] == 3 and sum(1 for v in s.metadata["weight_versions"]) == 3
        else:
            assert len(s.tokens) <= 60


# ----------------------------------------------------------------------------------------------- failures
async def slow_async_agent(row, endpoint):
    client = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0)
    await client.chat.completions.create(model=endpoint.model, messages=[{"role": "user", "content": row["prompt"]}])
    await asyncio.sleep(30)
    return 1.0


def slow_sync_agent(row, endpoint):
    time.sleep(3)  # abandoned at the deadline: the thread ends on its own a little later
    return 1.0


def raising_agent(row, endpoint):
    raise RuntimeError(f"no luck with {row['prompt']}")


@pytest.mark.parametrize("agent, error", [(slow_async_agent, "took longer than 0.5 s"),
                                          (slow_sync_agent, "took longer than"),
                                          (raising_agent, "RuntimeError: no luck")])
def test_a_failing_or_slow_agent_fails_its_samples_only(local, agent, error):
    t0 = time.monotonic()
    batch = run_batch([local], agent, agent_timeout_s=0.5, stop_token_ids=CHAR_STOPS[10:])
    assert time.monotonic() - t0 < 10
    assert len(batch) == 4 and all(s.status == Status.FAILED and s.reward == 0.0 for s in batch.samples)
    assert all(error in s.metadata["agent_error"] for s in batch.samples)
    assert batch.metadata["agent_errors"] == 4 and batch.metadata["failed_fraction"] == 1.0
    assert batch.metadata["env_timeouts"] == (0 if agent is raising_agent else 4)


def test_a_bad_agent_spec_is_refused_before_any_work():
    from trainer.preflight import check_rollout_functions

    with pytest.raises((ImportError, AttributeError, ValueError), match="agent"):
        check_rollout_functions(RolloutConfig(agent="test_gateway:no_such_agent"), filters=False)
    with pytest.raises(ValueError, match=r"async def fn\(row, endpoint\)"):
        check_rollout_functions(RolloutConfig(agent=lambda row: 1.0), filters=False)
    with pytest.raises(ValueError, match="one of env, tools, rollout_fn and agent"):
        RolloutConfig(agent=two_turn_agent, env="x:y")


def test_evaluation_runs_the_agent_greedily_and_scores_its_final_answer():
    """trainer.cli.evaluate with a rollout config that names an agent: each prompt is one greedy episode through a
    gateway (temperature 0 on every request), scored by the run's reward on the final message."""
    from trainer.cli import evaluate
    from trainer.data.buffer import Prompt

    temperatures = []

    class Greedy(Scripted):
        async def generate(self, prompts, params, *, rids=None):
            temperatures.append(params.temperature)
            return await super().generate(prompts, params, rids=rids)

    eng = Greedy(lambda text: "It is 42." if "<|im_start|>tool\n" in text and "6*7" in text else
                 ("It is 7." if "<|im_start|>tool\n" in text else "Let me compute. " + CALL_TEXT))
    prompts = [Prompt("6*7?", "42"), Prompt("3*4?", "12")]

    def plain_agent(row, endpoint):  # the tool agent, without its own reward: the run's reward scores the answer
        tool_agent(row, endpoint)

    rollout = RolloutConfig(agent=plain_agent, max_turns=3)
    got = evaluate([eng], prompts, tokenizer=TOK, reward_fn="arithmetic", max_new_tokens=128, rollout=rollout)
    assert got == {"reward_mean": 0.5, "accuracy": 0.5, "n": 2, "failed": 0}
    assert temperatures == [0.0] * 4  # two requests per episode, all greedy


# ----------------------------------------------------------------------------------------------- the recipe
AGENT = f"{Path(__file__).resolve().parents[1]}/examples/openai_agent.py:solve"


@pytest.mark.parametrize("engine_kind", ["embedded", "scripted"])
def test_the_openai_agent_gives_the_tools_recipes_episodes_token_for_token(local, engine_kind):
    """examples/openai_agent.py through the gateway vs the built-in tool environment (`tools`, configs/agent_demo
    .toml) on the same engine, seeds and limits: the same tokens, masks, log-probs, statuses and rewards. So the
    agent recipe's accuracy is the tools recipe's, and an existing agent trains like a native environment."""
    from examples.tasks.agent_task import calculator

    eng = local if engine_kind == "embedded" else Scripted(
        lambda text: ("It is 42." if "<|im_start|>tool\n42" in text else "7") if "<|im_start|>tool" in text
        else "Let me compute. " + CALL_TEXT)
    kw = dict(max_new_tokens=100 if engine_kind == "scripted" else 8, max_turns=3, reward="arithmetic")
    native = run_batch([eng], None, tools=("examples.tasks.agent_task:calculator",), **kw)
    agent = run_batch([eng], AGENT, **kw)
    assert calculator("6*7") == "42"
    assert len(native) == len(agent) == 4
    for a, b in zip(native.samples, agent.samples):
        assert (a.tokens, a.loss_mask) == (b.tokens, b.loss_mask)
        # Equal up to the engine's batching (which requests shared a forward differs with the timing): float32 noise.
        assert max(abs(x - y) for x, y in zip(a.rollout_logprobs, b.rollout_logprobs)) <= 1e-5
        assert (a.status, a.reward, a.metadata["turns"]) == (b.status, b.reward, b.metadata["turns"])
    if engine_kind == "scripted":
        assert all(s.metadata["turns"] == 2 and s.metadata["tool_calls"] == 1 for s in agent.samples)


def test_the_openai_agent_recipe_trains_through_the_cli(tmp_path):
    """configs/openai_agent_demo.toml at a tiny budget, async rollouts (the gateway in the rollout worker's thread):
    examples/openai_agent.py (only `openai` imported) drives every episode through the gateway; the trainer's
    log-probs of the recorded tokens before the first update equal the engine's (the tokens trained are the tokens
    the engine produced), and the agent metrics are logged."""
    import subprocess
    import sys

    from device_support import cpu_child_env

    root = Path(__file__).resolve().parents[1]
    assert "import trainer" not in (root / "examples/openai_agent.py").read_text()
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "trainer", "rl", "--config", "configs/openai_agent_demo.toml",
           "--set", f"output_dir=\"{out}\"", "--set", "rl.num_steps=2", "--set", "rl.rollout.rollout_batch_size=2",
           "--set", "rl.rollout.n_samples_per_prompt=2", "--set", "eval.limit=2", "--set", "logging.rollouts_every=1",
           "--set", "rl.rollout.max_truncated_steps=0", "--set", "rl.async_rollout=true"]
    proc = subprocess.run(cmd, cwd=root, env=cpu_child_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    assert len(rows) == 2
    for r in rows:
        assert r["rollout/agent_errors"] == 0 and r["rollout/turns_mean"] >= 1 and r["rollout/agent_time_s"] > 0
        assert "rollout/agent_splits" in r and "rollout/tool_calls_mean" in r
    dumped = [json.loads(x) for x in (out / "rl" / "rollouts" / "step_000001.jsonl").read_text().splitlines()]
    assert len(dumped) == 4
    for d in dumped:
        assert d["metadata"]["turns"] >= 1 and d["status"] in ("completed", "truncated")
        mask = d["loss_mask"]
        assert len(mask) == d["response_length"] and sum(mask) > 0
        if d["logprob_mismatch"] is not None:  # trained samples: the trainer's forward vs the engine's log-probs
            assert d["logprob_mismatch"] <= 1e-5, d["logprob_mismatch"]


def test_an_abort_cuts_agent_episodes_and_they_start_again_next_batch():
    """Two prompts, one group needed, over-sampled x2: prompt 1's agents wait at their second request until the
    batch fills with prompt 0's group; the batch does not wait for them, their keys are revoked, the group is
    cached and its episodes start again from the opening in the next batch."""
    import dataclasses

    eng = Scripted(scripted_tools, hold=lambda text: "1+2=" in text and "<|im_start|>tool" in text)
    cfg = RolloutConfig(rollout_batch_size=1, n_samples_per_prompt=2, max_new_tokens=128, agent=tool_agent,
                        over_sampling_factor=2.0, abort_grace_s=2.0, agent_timeout_s=30.0)
    manager = AsyncRolloutManager([eng], cfg, tokenizer=TOK, check_health=False)
    buffer = arithmetic_buffer(2)

    async def run():
        async with manager:
            return await manager.generate_batch(buffer)

    t0 = time.monotonic()
    first = trio.run(run)
    assert time.monotonic() - t0 < 8
    assert {s.prompt for s in first.samples} == {"0+1="} and len(manager.partial_groups) == 1
    assert all(s.prompt == "1+2=" and s.status in (Status.ABORTED, Status.PENDING) for s in manager.partial_groups[0])
    eng.aborted = True  # no more holds
    manager.config = dataclasses.replace(cfg, over_sampling_factor=1.0)
    second = trio.run(run)
    assert all(s.prompt == "1+2=" and s.status == Status.COMPLETED and s.metadata["turns"] == 2
               for s in second.samples)
    assert all(TOK.decode(list(s.tokens)).count("<tool_call>") == 1 for s in second.samples)  # restarted


async def stopping_agent(row, endpoint):
    client = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0)
    messages = [{"role": "user", "content": row["prompt"]}]
    cut = await client.chat.completions.create(model=endpoint.model, messages=messages, stop=["compute"])
    short = await client.chat.completions.create(model=endpoint.model, messages=messages, max_tokens=3, seed=123)
    messages += [cut.choices[0].message, {"role": "user", "content": "next"}]
    last = await client.chat.completions.create(model=endpoint.model, messages=messages)
    return {"reward": 1.0, "metadata": {"got": [[c.choices[0].message.content, c.choices[0].finish_reason]
                                                for c in (cut, short, last)]}}


def test_stop_strings_and_max_tokens_cut_the_recorded_tokens_exactly():
    """A stop string cuts the completion after the fewest tokens that hold it (the text stops before it); the turn
    continued gets the template's end-of-turn token; max_tokens cuts at that many tokens (finish "length")."""
    engine = Scripted(lambda text: "done" if "next" in text else "Let me compute it.")
    batch = run_batch([engine], stopping_agent, max_new_tokens=50, n_samples_per_prompt=1)
    assert len(batch) == 4 and batch.metadata["agent_splits"] == 2  # the max_tokens call is a leaf of its own
    for prompt in ("0+1=", "1+2="):
        short, full = sorted((s for s in batch.samples if s.prompt == prompt), key=lambda s: len(s.tokens))
        assert short.metadata["got"] == [["Let me ", "stop"], ["Let", "length"], ["done", "stop"]]  # the first leaf
        start = opening([{"role": "user", "content": prompt}])
        assert list(short.tokens) == start + TOK.encode("Let") and list(short.loss_mask) == [1, 1, 1]
        turn1 = TOK.encode("Let me compute")
        middle = [IM_END_ID] + after_turn("user", "next")
        turn2 = TOK.encode("done") + [IM_END_ID]
        assert list(full.tokens) == start + turn1 + middle + turn2 and full.status == Status.COMPLETED
        assert list(full.loss_mask) == [1] * len(turn1) + [0] * len(middle) + [1] * len(turn2)


# ----------------------------------------------------------------------------------------------- a tool-aware template
QWEN_LIKE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n"
    "</tools><|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content }}"
    "{%- for tc in message.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ tc.function.name }}\", \"arguments\": "
    "{{ tc.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def editing_agent(row, endpoint):
    """Runs the tool call, then sends its history back with its own copy of the assistant turn edited (the call
    kept, the text before it dropped): the gateway must start a new sequence, rendered by the template."""
    client = openai.OpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0)
    messages = [{"role": "user", "content": row["prompt"]}]
    first = client.chat.completions.create(model=endpoint.model, messages=messages, tools=[CALC]).choices[0].message
    edited = {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in first.tool_calls]}
    messages += [edited, {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "42"}]
    last = client.chat.completions.create(model=endpoint.model, messages=messages, tools=[CALC]).choices[0].message
    return 1.0 if last.content == "It is 42." else 0.0


def test_a_tool_aware_template_renders_the_tools_and_an_edited_history_exactly():
    """With a Qwen-like template that renders the tools and the assistant's tool calls: the opening holds the
    tools' schemas, and an edited history is a new sequence whose prompt is the template's rendering of it (tool
    call arguments as objects), followed by exactly the engine's tokens."""
    tok = build_tokenizer()
    tok.chat_template = QWEN_LIKE
    engine = Scripted(lambda text: "It is 42." if "<tool_response>" in text else "Let me compute. " + CALL_TEXT)
    cfg = RolloutConfig(rollout_batch_size=1, n_samples_per_prompt=1, max_new_tokens=200, agent=editing_agent,
                        seed=1, agent_timeout_s=30.0)
    manager = AsyncRolloutManager([engine], cfg, tokenizer=tok, check_health=False)

    async def run():
        async with manager:
            return await manager.generate_batch(arithmetic_buffer(1))

    batch = trio.run(run)
    assert len(batch) == 2 and batch.metadata["agent_splits"] == 1
    first, second = batch.samples
    assert first.reward == second.reward == 1.0
    opening_ids = tok.apply_chat_template([{"role": "user", "content": "0+1="}], tools=[CALC],
                                          add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert json.dumps(CALC) in tok.decode(opening_ids)
    turn1 = TOK.encode("Let me compute. " + CALL_TEXT) + [IM_END_ID]
    assert list(first.tokens) == opening_ids + turn1 and list(first.loss_mask) == [1] * len(turn1)
    history = [{"role": "user", "content": "0+1="},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "6*7"}}}]},
               {"role": "tool", "content": "42"}]
    prompt2 = tok.apply_chat_template(history, tools=[CALC], add_generation_prompt=True, tokenize=True,
                                      return_dict=True)["input_ids"]
    assert '"arguments": {"expression": "6*7"}' in tok.decode(prompt2)
    turn2 = TOK.encode("It is 42.") + [IM_END_ID]
    assert list(second.tokens) == prompt2 + turn2 and list(second.loss_mask) == [1] * len(turn2)
    # The same agent without the edit: one sequence, the tool answer rendered after the engine's turn as the
    # template writes it (its `{%-` tags leave no newline after <|im_end|>; the tool turn is a user turn).
    manager = AsyncRolloutManager([engine], dataclasses.replace(cfg, agent=tool_agent), tokenizer=tok,
                                  check_health=False)
    (one,) = trio.run(run).samples
    opening2 = tok.apply_chat_template([{"role": "system", "content": "Use the calculator."},
                                        {"role": "user", "content": "0+1="}], tools=[CALC],
                                       add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    middle = TOK.encode("<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|><|im_start|>assistant\n")
    assert list(one.tokens) == opening2 + turn1 + middle + turn2
    assert list(one.loss_mask) == [1] * len(turn1) + [0] * len(middle) + [1] * len(turn2)


async def error_reporting_agent(row, endpoint):
    client = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0)
    messages = [{"role": "user", "content": row["prompt"]}]
    r = await client.chat.completions.create(model=endpoint.model, messages=messages)
    try:
        await client.chat.completions.create(model=endpoint.model, messages=messages + [
            r.choices[0].message, {"role": "user", "content": "more"}])
    except openai.InternalServerError as e:
        return {"reward": 0.0, "metadata": {"error": str(e)}}
    return 1.0


def test_a_template_that_rewrites_earlier_turns_is_a_clear_500_not_a_wrong_sequence():
    tok = build_tokenizer()
    tok.chat_template = "{{ messages | length }}" + tok.chat_template  # earlier turns change as messages grow
    cfg = RolloutConfig(rollout_batch_size=1, n_samples_per_prompt=1, max_new_tokens=20, agent=error_reporting_agent,
                        agent_timeout_s=30.0)
    manager = AsyncRolloutManager([Scripted(lambda text: "ok")], cfg, tokenizer=tok, check_health=False)

    async def run():
        async with manager:
            return await manager.generate_batch(arithmetic_buffer(1))

    (s,) = trio.run(run).samples
    assert "append-only" in s.metadata["error"] and s.metadata["turns"] == 2 and len(s.metadata["weight_versions"]) == 1


def test_sampled_evaluation_of_an_agent_is_seeded_and_reproducible(local):
    """pass@k of an agent: k sampled episodes a prompt at the evaluation's temperature, each request seeded from
    (seed, prompt, sample, request number): two evaluations with one seed send the same requests and score alike."""
    from trainer.cli import evaluate
    from trainer.data.buffer import Prompt

    asked = []

    class Seen(Recording):
        async def generate(self, prompts, params, *, rids=None):
            asked.append((params.temperature, params.seed, tuple(prompts[0])))
            return await super().generate(prompts, params, rids=rids)

    prompts = [Prompt("1+2=", "3"), Prompt("2+2=", "4")]
    rollout = RolloutConfig(agent=two_turn_agent, max_turns=3, stop_token_ids=CHAR_STOPS[10:])
    runs = []
    for _ in range(2):
        asked.clear()
        got = evaluate([Seen(local)], prompts, tokenizer=TOK, reward_fn="arithmetic", max_new_tokens=6,
                       rollout=rollout, k=2, temperature=1.0, seed=7)
        runs.append((got, sorted(a for a in asked if a[0] == 1.0)))
    assert runs[0] == runs[1]
    sampled = runs[0][1]
    assert len(sampled) == 8 and len({s for _, s, _ in sampled}) == 8  # 2 prompts x 2 samples x 2 requests
    assert "pass@1" in runs[0][0] and runs[0][0]["n"] == 2


# ----------------------------------------------------------------------------------------------- found by review
def continuing_completions_agent(row, endpoint):
    """/v1/completions with a stop string, then the agent's own continuation of the text it got back: once with the
    stop string written back (the recorded tokens continue) and once without it (a new root: the engine must see
    exactly the agent's text, not the recorded tokens' stop string)."""
    client = openai.OpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0)
    first = f"Q: {row['prompt']}\nA:"
    text = client.completions.create(model=endpoint.model, prompt=first, stop=["\n"], max_tokens=20).choices[0].text
    prompts = [first + text + "\nQ: again\nA:", first + text + " Q: again\nA:"]
    for prompt in prompts:
        client.completions.create(model=endpoint.model, prompt=prompt, max_tokens=20)
    return {"reward": 1.0, "metadata": {"got": [text] + prompts}}


def test_a_completion_cut_by_a_stop_string_is_continued_only_by_a_prompt_that_holds_its_tokens():
    """Was: the call's text was the returned text (the stop string cut off), so a prompt without the stop string
    continued the recorded tokens, and the engine saw a newline the agent never sent."""
    engine = Scripted(lambda text: " 1\nQ: junk")
    batch = run_batch([engine], continuing_completions_agent, max_new_tokens=20, n_samples_per_prompt=1)
    for s in batch.samples:
        if "agent_part" in s.metadata:
            continue
        text, with_stop, without = s.metadata["got"]
        assert text == " 1"
        seen = [p for p in engine.prompts if p.startswith(f"Q: {s.prompt}\nA:") and "again" in p]
        assert sorted(seen) == sorted([with_stop, without]), (seen, with_stop, without)
    assert batch.metadata["agent_splits"] == 2  # per episode: the first call continued, the second a new root


def n_choice_agent(row, endpoint):
    client = openai.OpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0)
    messages = [{"role": "user", "content": row["prompt"]}]
    both = client.chat.completions.create(model=endpoint.model, messages=messages, n=2)
    messages += [both.choices[1].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
    client.chat.completions.create(model=endpoint.model, messages=messages)
    return {"reward": 1.0, "metadata": {"got": [c.finish_reason for c in both.choices]}}


class TwoLengths(Scripted):
    """With n = 2, choice 0 runs to the budget ("length") and choice 1 ends; one choice otherwise."""

    async def generate(self, prompts, params, *, rids=None):
        out = []
        for p in prompts:
            self.prompts.append(TOK.decode(list(p)))
            row = []
            for k in range(params.n):
                ids = TOK.encode("x" * 50)[:params.max_new_tokens] if params.n > 1 and k == 0 else \
                    TOK.encode("ok") + [IM_END_ID]
                row.append(Completion(ids, [-0.5] * len(ids), "length" if len(ids) > 3 else "stop", 0, list(p)))
            out.append(row)
        return out


def test_with_n_choices_only_the_sequence_a_limit_cut_is_truncated():
    """Was: one of n choices cut at max_new_tokens marked every sequence of the episode TRUNCATED (masked out of the
    loss with mask_truncated), the sibling the agent went on with and finished too."""
    batch = run_batch([TwoLengths(lambda text: "")], n_choice_agent, max_new_tokens=20, n_samples_per_prompt=1)
    for prompt in ("0+1=", "1+2="):
        seqs = {s.metadata.get("agent_part", 0): s for s in batch.samples if s.prompt == prompt}
        assert len(seqs) == 2
        cut = next(s for s in seqs.values() if TOK.decode(list(s.tokens)).endswith("x" * 20))
        went_on = next(s for s in seqs.values() if s is not cut)
        assert cut.status == Status.TRUNCATED and cut.metadata["truncated_by"] == "length"
        assert went_on.status == Status.COMPLETED and "truncated_by" not in went_on.metadata
        assert TOK.decode(list(went_on.tokens)).endswith("more<|im_end|>\n<|im_start|>assistant\nok<|im_end|>")


def tool_turn_agent(row, endpoint):
    """A streamed turn of tool calls only (no text before the call), with log-probs; then reordered schema keys in a
    second conversation, continued once; then requests the gateway must refuse in OpenAI's error shape."""
    client = openai.OpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0)
    messages = [{"role": "user", "content": row["prompt"]}]
    plain = client.chat.completions.create(model=endpoint.model, messages=messages, tools=[CALC], logprobs=True)
    stream = client.chat.completions.create(model=endpoint.model, messages=messages, tools=[CALC], logprobs=True,
                                            stream=True)
    streamed = [lp.logprob for chunk in stream for c in chunk.choices if c.logprobs is not None
                for lp in c.logprobs.content or []]
    reordered = {"function": dict(reversed(list(CALC["function"].items()))), "type": "function"}
    chains = []
    for tools, prompt in (([CALC], row["prompt"]), ([reordered], "other " + row["prompt"])):
        chat = [{"role": "user", "content": prompt}]
        m = client.chat.completions.create(model=endpoint.model, messages=chat, tools=tools).choices[0].message
        chat += [m.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "42"}]
        chains.append(client.chat.completions.create(model=endpoint.model, messages=chat, tools=tools)
                      .choices[0].message.content)
    errors = []
    for call in (lambda: client.chat.completions.create(model=endpoint.model, messages=messages, stop=5),
                 lambda: client.models.retrieve(endpoint.model),
                 lambda: client.post("/responses", body={"model": endpoint.model}, cast_to=object)):
        try:
            call()
            errors.append(None)
        except openai.APIStatusError as e:
            errors.append((e.status_code, e.body["message"] if isinstance(e.body, dict) else e.body))
    return {"reward": 1.0, "metadata": {"got": [[lp.logprob for lp in plain.choices[0].logprobs.content], streamed,
                                                chains, errors]}}


def test_a_tool_only_turn_streams_its_logprobs_schemas_key_by_order_and_errors_are_openais():
    """Was: a streamed turn of tool calls only lost its log-probs; a tool schema with its keys in another order was
    served the other order's cached rendering (a 500 at the next turn); stop=5 was a plain-text 500 (which the SDK
    retries) and unserved paths Starlette's plain-text 404."""
    tok = build_tokenizer()
    tok.chat_template = QWEN_LIKE
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>'
    engine = Scripted(lambda text: "It is 42." if "<tool_response>" in text else call)
    cfg = RolloutConfig(rollout_batch_size=1, n_samples_per_prompt=1, max_new_tokens=100, agent=tool_turn_agent,
                        max_turns=8, seed=1, agent_timeout_s=30.0)
    manager = AsyncRolloutManager([engine], cfg, tokenizer=tok, check_health=False)

    async def run():
        async with manager:
            return await manager.generate_batch(arithmetic_buffer(1))

    (sample, *_) = trio.run(run).samples
    plain, streamed, chains, errors = sample.metadata["got"]
    assert len(plain) == len(TOK.encode(call)) + 1 and streamed == plain  # and <|im_end|>: streamed with the calls
    assert chains == ["It is 42.", "It is 42."]
    assert errors[0][0] == 400 and "stop=5" in errors[0][1]
    assert [e[0] for e in errors[1:]] == [404, 404] and all("is not served here" in e[1] for e in errors[1:])
