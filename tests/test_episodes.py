"""Multi-turn episodes (trainer/rollout/episodes.py, tools.py) in the rollout manager: token exactness on the embedded
engine (in process and over HTTP), tools, limits, failures as data, agent functions, aborts mid-episode, and a user's
environment through the CLI.

The token-exactness tests use the real embedded engine; the tool and failure tests use `Scripted`, an engine
stand-in that answers with chosen texts (a random tiny model never writes a tool call): what they test is what the
rollout does with the answers, not the engine.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio
from device_support import cpu_child_env
from episode_support import CHAR_STOPS, AsyncTalk, Recording, Scripted, Talk, arithmetic_buffer, check_token_exact

from engines.embedded.presets import build_tiny_model
from engines.registry import EngineSpec, build_engine
from engines.sglang import SGLangEngine
from engines.tiny import IM_END, SPECIAL_TOKENS, build_tokenizer
from trainer.config import RolloutConfig
from trainer.rl import compute_advantages, trained_samples
from trainer.rollout.episodes import _rendered, as_env_step, render_continuation, render_opening
from trainer.rollout.manager import AsyncRolloutManager
from trainer.rollout.tools import parse_hermes
from trainer.types import Status

ROOT = Path(__file__).resolve().parents[1]
ENGINE_SEED = 3  # the `engine` fixture (tests/conftest.py): the same weights as the local engine and the reference
TOK = build_tokenizer()
IM_END_ID = SPECIAL_TOKENS.index(IM_END)


@pytest.fixture(scope="module")
def local():
    eng = build_engine(EngineSpec(kind="local"), model_folder="tiny", seed=ENGINE_SEED)
    yield eng
    eng.close()


def one_batch(engines, cfg, buffer, *, reward="arithmetic", manager=None, check_health=False):
    manager = manager or AsyncRolloutManager(engines, cfg, tokenizer=TOK, reward_fn=reward, check_health=check_health)

    async def run():
        async with manager:
            return await manager.generate_batch(buffer)

    return trio.run(run), manager


def talk_config(env, **kw) -> RolloutConfig:
    base = dict(rollout_batch_size=2, n_samples_per_prompt=3, max_new_tokens=4, env=env, stop_token_ids=CHAR_STOPS,
                max_turns=4, seed=1)
    return RolloutConfig(**{**base, **kw})


# ----------------------------------------------------------------------------------------------- token exactness
@pytest.mark.parametrize("env", [Talk, AsyncTalk], ids=["sync-env", "async-env"])
def test_episodes_on_the_in_process_engine_are_token_exact(local, env):
    rec = Recording(local)
    batch, _ = one_batch([rec], talk_config(env), arithmetic_buffer())
    assert len(batch) == 6 and all(s.status == Status.COMPLETED for s in batch.samples)
    # A group's episodes have 1, 2 and 3 turns; the environment's reward (1.0) is the episode's.
    assert sorted(s.metadata["turns"] for s in batch.samples) == [1, 1, 2, 2, 3, 3]
    assert all(s.reward == 1.0 for s in batch.samples)
    worst = check_token_exact(batch.samples, rec, TOK, build_tiny_model(seed=ENGINE_SEED))
    assert batch.metadata["turns_mean"] == 2.0 and batch.metadata["env_errors"] == 0
    print(f"engine vs trainer log-prob max diff {worst:.2e}")


def test_episodes_over_http_are_token_exact_and_equal_the_in_process_ones(local, engine):
    http = Recording(SGLangEngine(engine.url, timeout_s=60))
    batch, _ = one_batch([http], talk_config(Talk), arithmetic_buffer())
    check_token_exact(batch.samples, http, TOK, build_tiny_model(seed=ENGINE_SEED))
    again, _ = one_batch([local], talk_config(Talk), arithmetic_buffer())  # the same seeds, the same episodes
    assert [s.tokens for s in batch.samples] == [s.tokens for s in again.samples]


def test_continuation_rendering_is_what_the_template_writes_after_a_turn():
    turn_end = frozenset({SPECIAL_TOKENS.index("<eos>"), IM_END_ID})
    ids = render_continuation(TOK, [{"role": "tool", "content": "408"}, {"role": "user", "content": "ok?"}],
                              turn_end_ids=turn_end)
    assert TOK.decode(ids) == ("\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>user\nok?<|im_end|>\n"
                               "<|im_start|>assistant\n")


def test_a_conversation_renders_once_per_template_and_as_the_template_writes_it():
    """The samples of a group open alike: the second rendering comes from the cache, equal to apply_chat_template's
    (tools as schemas from the function); another template, or other tools, render anew."""
    tok = build_tokenizer()
    opening = [{"role": "user", "content": f"{time.perf_counter_ns()} * 2 ="}]  # a conversation no test rendered
    want = tok.apply_chat_template(opening, tools=[calculator], add_generation_prompt=True, tokenize=True,
                                   return_dict=True)["input_ids"]
    before = _rendered.cache_info()
    assert render_opening(tok, opening, [calculator]) == list(want)
    assert render_opening(tok, opening, [calculator]) == list(want)
    after = _rendered.cache_info()
    assert (after.misses - before.misses, after.hits - before.hits) == (1, 1)
    assert render_opening(tok, opening) == list(tok.apply_chat_template(
        opening, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
    tok.chat_template = "{% for m in messages %}[{{ m.content }}]{% endfor %}"
    assert TOK.decode(render_opening(tok, opening, [calculator])) == f"[{opening[0]['content']}]"


# ----------------------------------------------------------------------------------------------- a scripted engine
CALL = '<tool_call>{"name": "%s", "arguments": {"expression": "%s"}}</tool_call>'


def calculator(expression: str) -> str:
    """Multiply two integers.

    Args:
        expression: two integers joined by '*', e.g. 12*34
    """
    a, b = expression.split("*")
    return str(int(a) * int(b))


def broken(expression: str) -> str:
    """Always fails.

    Args:
        expression: ignored
    """
    raise RuntimeError("the tool is broken")


def sleepy(expression: str) -> str:
    """Takes too long.

    Args:
        expression: ignored
    """
    time.sleep(3)
    return "late"


def tool_batch(first_reply: str, tools=(calculator,), **kw):
    """One group of two episodes on "12*34?": the model says `first_reply`, then answers 408 after a tool message."""
    eng = Scripted(lambda text: "408" if "<|im_start|>tool" in text else first_reply)
    cfg = RolloutConfig(rollout_batch_size=1, n_samples_per_prompt=2, max_new_tokens=128, tools=tuple(tools),
                        **{"tool_timeout_s": 0.5, **kw})
    from trainer.data.buffer import DataBuffer, Prompt

    batch, _ = one_batch([eng], cfg, DataBuffer([Prompt("12*34?", "408")], seed=0))
    return batch


def tool_messages(sample) -> list[str]:
    return [m["content"] for m in sample.metadata["messages"] if m["role"] == "tool"]


def test_a_tool_call_runs_and_its_answer_is_masked():
    batch = tool_batch(CALL % ("calculator", "12*34"))
    for s in batch.samples:
        assert s.status == Status.COMPLETED and s.reward == 1.0
        assert s.metadata["turns"] == 2 and s.metadata["tool_calls"] == 1 and s.metadata["tool_errors"] == 0
        assert tool_messages(s) == ["408"]
        # The tool's message is rendered after the call and is 0 in the loss mask; the model's tokens are 1.
        tool_text = "\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n"
        resp = list(s.tokens[s.prompt_length:])
        n_tool = len(TOK.encode(tool_text))
        call = TOK.encode(CALL % ("calculator", "12*34")) + [IM_END_ID]
        assert resp == call + TOK.encode(tool_text) + TOK.encode("408") + [IM_END_ID]
        assert list(s.loss_mask) == [1] * len(call) + [0] * n_tool + [1] * 4
        assert all(lp == -0.5 for lp, m in zip(s.rollout_logprobs, s.loss_mask) if m)
    assert batch.metadata["tool_calls_mean"] == 1.0 and batch.metadata["turns_mean"] == 2.0


@pytest.mark.parametrize("reply, tools, error", [
    ('<tool_call>{"name": calculator</tool_call>', (calculator,), "error: malformed tool call"),
    ("<tool_call>" + '{"name": "calculator"', (calculator,), "error: unclosed <tool_call>"),
    (CALL % ("nope", "1*2"), (calculator,), "error: LookupError: unknown tool 'nope'"),
    (CALL % ("broken", "1*2"), (broken,), "error: RuntimeError: the tool is broken"),
    (CALL % ("sleepy", "1*2"), (sleepy,), "error: sleepy timed out after 0.5s"),
], ids=["malformed", "unclosed", "unknown-tool", "tool-raises", "tool-timeout"])
def test_tool_failures_answer_the_model_and_are_counted(reply, tools, error):
    t0 = time.monotonic()
    batch = tool_batch(reply, tools=tools)
    assert time.monotonic() - t0 < 2.5  # a slow tool is cut at its timeout, not waited for
    for s in batch.samples:
        assert s.status == Status.COMPLETED and s.reward == 1.0  # the episode goes on: the model answers 408
        (msg,) = tool_messages(s)
        assert msg.startswith(error), msg
        assert s.metadata["tool_errors"] == 1 and s.metadata["tool_calls"] == 1
    assert batch.metadata["tool_errors"] == 2


def test_max_turns_truncates_and_mask_truncated_keeps_them_out_of_the_loss():
    eng = Scripted(lambda text: CALL % ("calculator", "1*2"))  # calls the tool for ever
    cfg = RolloutConfig(rollout_batch_size=1, n_samples_per_prompt=2, max_new_tokens=128, tools=(calculator,),
                        max_turns=3)
    batch, _ = one_batch([eng], cfg, arithmetic_buffer(1))
    for s in batch.samples:
        assert s.status == Status.TRUNCATED and s.metadata["truncated_by"] == "max_turns"
        # The third call's answer never reaches the model: the episode ends before a fourth turn.
        assert s.metadata["turns"] == 3 and tool_messages(s) == ["2", "2"]
    assert batch.metadata["truncated_fraction"] == 1.0
    keep, _ = trained_samples(batch.samples, "grpo", mask_truncated=True)
    assert keep == []
    keep, _ = trained_samples(batch.samples, "grpo")
    assert keep == [0, 1]


def test_context_limit_truncates_before_the_engine_is_asked_past_it():
    eng = Scripted(lambda text: CALL % ("calculator", "1*2"))
    cfg = RolloutConfig(rollout_batch_size=1, n_samples_per_prompt=1, max_new_tokens=128, tools=(calculator,),
                        max_turns=10, max_context_tokens=200)
    batch, _ = one_batch([eng], cfg, arithmetic_buffer(1))
    (s,) = batch.samples
    assert s.status == Status.TRUNCATED and s.metadata["truncated_by"] == "context"
    assert len(s.tokens) <= 200 and all(len(TOK.encode(p)) < 200 for p in eng.prompts)


class RaisingEnv:
    def reset(self, prompt, metadata):
        self.index = metadata["sample_index"]
        return [{"role": "user", "content": prompt}]

    def step(self, message):
        if self.index == 0:
            raise KeyError("the environment lost its state")
        return {"messages": [], "reward": 0.5 + self.index, "done": True}


class BadStepEnv(RaisingEnv):
    def step(self, message):
        return {"messages": [], "score": 1.0, "done": True}


def test_an_environment_that_raises_fails_its_episode_only(capsys):
    cfg = talk_config(RaisingEnv, stop_token_ids=(), rollout_batch_size=1)
    batch, _ = one_batch([Scripted(lambda text: "7")], cfg, arithmetic_buffer(1))
    s0, s1, s2 = batch.samples
    assert s0.status == Status.FAILED and "KeyError" in s0.metadata["env_error"]
    assert (s1.status, s1.reward, s2.reward) == (Status.COMPLETED, 1.5, 2.5)
    assert batch.metadata["env_errors"] == 1
    assert "the environment lost its state" in capsys.readouterr().err  # the traceback, printed once
    # The failed episode is out of the loss and out of its group's baseline: advantages of the others only.
    keep, metrics = trained_samples(batch.samples, "grpo")
    assert keep == [1, 2] and metrics["rollout/failed_fraction"] == pytest.approx(1 / 3)
    adv = compute_advantages(batch.samples, "grpo")
    assert adv[0] == 0.0 and adv[1] == pytest.approx(-adv[2]) and adv[1] < 0


def test_a_malformed_env_step_is_named():
    cfg = talk_config(BadStepEnv, stop_token_ids=(), rollout_batch_size=1)
    batch, _ = one_batch([Scripted(lambda text: "7")], cfg, arithmetic_buffer(1))
    assert all(s.status == Status.FAILED and "unknown keys ['score']" in s.metadata["env_error"]
               for s in batch.samples)
    with pytest.raises(TypeError, match="string 'content'"):
        as_env_step({"messages": [{"role": "user"}]})
    with pytest.raises(ValueError, match="the model writes the assistant turns"):
        as_env_step({"messages": [{"role": "assistant", "content": "x"}]})


# ----------------------------------------------------------------------------------------------- agent functions
async def two_turn_agent(client, row):
    reply = await client.chat([{"role": "user", "content": row["prompt"]}])
    reply2 = await client.chat([{"role": "user", "content": row["prompt"]}, reply,
                                {"role": "user", "content": "sure?"}])
    return 1.0 if reply2["content"] == row["answer"] else 0.0


async def rewriting_agent(client, row):
    await client.chat([{"role": "user", "content": row["prompt"]}])
    await client.chat([{"role": "user", "content": "something else"}])


def test_a_rollout_fn_drives_its_episode_token_exact():
    eng = Scripted(lambda text: "1" if "sure?" in text else "0")
    cfg = RolloutConfig(rollout_batch_size=1, n_samples_per_prompt=2, max_new_tokens=8, rollout_fn=two_turn_agent)
    batch, _ = one_batch([eng], cfg, arithmetic_buffer(1))  # 0+1= -> "1"
    for s in batch.samples:
        assert s.status == Status.COMPLETED and s.reward == 1.0 and s.metadata["turns"] == 2
        assert TOK.decode(list(s.tokens[s.prompt_length:])) == (
            "0<|im_end|>\n<|im_start|>user\nsure?<|im_end|>\n<|im_start|>assistant\n1<|im_end|>")
        assert sum(s.loss_mask) == 4  # "0", <|im_end|>, "1", <|im_end|>


def test_a_rollout_fn_that_rewrites_history_fails_with_a_reason():
    cfg = RolloutConfig(rollout_batch_size=1, n_samples_per_prompt=2, max_new_tokens=8, rollout_fn=rewriting_agent)
    batch, _ = one_batch([Scripted(lambda text: "0")], cfg, arithmetic_buffer(1))
    assert all(s.status == Status.FAILED and "must extend the previous call's" in s.metadata["env_error"]
               for s in batch.samples)


def sync_two_turn_agent(client, row):
    # the seeds' plain def: client.chat blocks in this worker thread while the rollout's trio loop generates
    reply = client.chat([{"role": "user", "content": row["prompt"]}])
    reply2 = client.chat([{"role": "user", "content": row["prompt"]}, reply, {"role": "user", "content": "sure?"}])
    return 1.0 if reply2["content"] == row["answer"] else 0.0


def test_a_plain_def_rollout_fn_drives_the_same_episode_from_a_thread():
    script = lambda text: "1" if "sure?" in text else "0"  # noqa: E731
    cfg = RolloutConfig(rollout_batch_size=1, n_samples_per_prompt=2, max_new_tokens=8, rollout_fn=two_turn_agent)
    want, _ = one_batch([Scripted(script)], cfg, arithmetic_buffer(1))
    cfg = RolloutConfig(rollout_batch_size=1, n_samples_per_prompt=2, max_new_tokens=8, rollout_fn=sync_two_turn_agent)
    got, _ = one_batch([Scripted(script)], cfg, arithmetic_buffer(1))
    for a, b in zip(got.samples, want.samples, strict=True):
        assert a.status == b.status == Status.COMPLETED and a.reward == b.reward == 1.0
        assert list(a.tokens) == list(b.tokens) and list(a.loss_mask) == list(b.loss_mask)
        assert a.metadata["turns"] == 2


def test_a_rollout_fn_that_cannot_take_client_and_row_is_refused_before_any_work():
    def agent(row):
        return 1.0

    with pytest.raises(ValueError, match=r"must take \(client, row\)"):
        AsyncRolloutManager([Scripted(str)], RolloutConfig(rollout_fn=agent), tokenizer=TOK, check_health=False)


def test_only_one_episode_source_and_only_chat_format():
    with pytest.raises(ValueError, match="give one of env, tools, rollout_fn and agent"):
        RolloutConfig(env="a:b", tools=("c:d",))
    with pytest.raises(ValueError, match='format = "chat"'):
        RolloutConfig(env="a:b", apply_chat_template=False)


def test_a_tool_without_a_schema_is_refused_naming_it():
    def bare(x):
        return x

    with pytest.raises(ValueError, match="has no JSON schema"):
        AsyncRolloutManager([Scripted(str)], RolloutConfig(tools=(bare,)), tokenizer=TOK, check_health=False)


def test_hermes_parser_reads_calls_and_content():
    turn = parse_hermes('let me see <tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>'
                        '<tool_call>{"name": "g", "arguments": {}}</tool_call>')
    assert turn.content == "let me see" and not turn.errors
    assert [c["function"] for c in turn.calls] == [{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}]
    assert parse_hermes("just 42").message() == {"role": "assistant", "content": "just 42"}


# ----------------------------------------------------------------------------------------------- aborts
def test_an_abort_stops_episodes_mid_way_and_they_start_again_next_batch():
    """Two prompts, one group needed, over-sampled x2: prompt 1's episodes wait at their second turn until the
    batch fills with prompt 0's group and the abort comes; that group is cached and restarts from its opening
    prompt in the next batch (its environment did not survive), with nothing of the cut attempt left in it."""
    def reply(text):
        return CALL % ("calculator", "1*2") if "<|im_start|>tool" not in text else "3"

    eng = Scripted(reply, hold=lambda text: "1+2=" in text and "<|im_start|>tool" in text)
    cfg = RolloutConfig(rollout_batch_size=1, n_samples_per_prompt=2, max_new_tokens=128, tools=(calculator,),
                        over_sampling_factor=2.0, abort_grace_s=2.0)
    buffer = arithmetic_buffer(2)
    first, manager = one_batch([eng], cfg, buffer)
    assert {s.prompt for s in first.samples} == {"0+1="}
    assert first.metadata["samples_aborted"] == 2 and len(manager.partial_groups) == 1
    cut = manager.partial_groups[0]
    assert all(s.status == Status.ABORTED and s.prompt == "1+2=" and s.metadata["turns"] == 1 for s in cut)
    # Only the cached group runs next (no over-sampling: no new prompt races it), with no holds. The first batch
    # sent the engine an abort only if a held request was in flight when it filled; if the episodes were between
    # turns then, their next request was never sent (the manager was stopping) and no abort was needed, so the
    # stand-in's hold would still be armed and the restarted episode would wait out every retry (seen once in 2).
    eng.aborted = True
    manager.config = dataclasses.replace(cfg, over_sampling_factor=1.0)
    second, _ = one_batch([eng], cfg, buffer, manager=manager)
    s = second.samples[0]
    assert s.prompt == "1+2=" and s.group_index == cut[0].group_index
    assert s.status == Status.COMPLETED and s.metadata["turns"] == 2 and s.metadata["tool_calls"] == 1
    assert TOK.decode(list(s.tokens[s.prompt_length:])).count("<tool_call>") == 1  # restarted, not appended
    assert len(s.metadata["weight_versions"]) == 2


# ----------------------------------------------------------------------------------------------- the CLI
USER_ENV = '''
class Guess:
    """A user's environment: no import from the project, dict steps, async step."""

    def reset(self, prompt, metadata):
        self.answer = metadata["answer"]
        self.tries = 0
        return [{"role": "user", "content": prompt}]

    async def step(self, message):
        self.tries += 1
        if message["content"].strip() == self.answer or self.tries == 2:
            return {"messages": [], "reward": float(message["content"].strip() == self.answer), "done": True}
        return {"messages": [{"role": "user", "content": "no, again"}], "reward": None, "done": False}
'''


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_user_environment_runs_through_the_cli(tmp_path, mode):
    """A user's environment file named in the config, in a synchronous run and in an async one (episodes of step
    n+1 generated while step n trains, TIS on)."""
    (tmp_path / "guess_env.py").write_text(USER_ENV)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "trainer", "rl", "--config", "configs/demo.toml",
           "--set", f"output_dir=\"{out}\"", "--set", "rl.num_steps=3", "--set", "rl.rollout.rollout_batch_size=4",
           "--set", "rl.rollout.n_samples_per_prompt=4", "--set", f"rl.rollout.env=\"{tmp_path}/guess_env.py:Guess\"",
           "--set", "rl.rollout.max_turns=2", "--set", "eval.limit=8",
           "--set", f"rl.async_rollout={str(mode == 'async').lower()}",
           # A random model rarely ends a turn within the demo's 6 tokens: every episode is truncated, which stops
           # a run after 3 such steps. Here the environment running is what is tested; the warnings must show.
           "--set", "rl.rollout.max_truncated_steps=0"]
    proc = subprocess.run(cmd, cwd=ROOT, env=cpu_child_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]  # the training steps (step 0 holds the evaluation before RL)
    assert len(rows) == 3
    warned = [r["step"] for r in rows if r["rollout/truncated_fraction"] + r["rollout/failed_fraction"] > 0.5]
    assert [f"warning: step {step}: " in proc.stderr for step in warned] == [True] * len(warned)
    assert [r["staleness/max"] for r in rows] == ([0.0, 1.0, 1.0] if mode == "async" else [0.0] * 3)
    for row in rows:
        assert 1.0 <= row["rollout/turns_mean"] <= 2.0 and row["rollout/env_errors"] == 0
        assert row["rollout/env_time_s"] >= 0 and row["rollout/tool_calls_mean"] == 0
        assert 0.0 <= row["rollout/truncated_fraction"] <= 1.0
    assert os.path.exists(out / "config.toml") and "guess_env.py:Guess" in (out / "config.toml").read_text()


def test_evaluation_runs_the_same_episodes_greedily():
    """trainer.cli.evaluate with a rollout config that names tools: each prompt is one greedy episode (temperature
    0 on every turn), scored by the run's reward on the final message."""
    from trainer.cli import evaluate
    from trainer.data.buffer import Prompt

    calls = []

    class Greedy(Scripted):
        async def generate(self, prompts, params, *, rids=None):
            calls.append(params.temperature)
            return await super().generate(prompts, params, rids=rids)

    eng = Greedy(lambda text: ("408" if "12*34" in text else "1") if "<|im_start|>tool" in text
                 else CALL % ("calculator", "12*34"))
    prompts = [Prompt("12*34?", "408"), Prompt("3*4?", "12")]
    rollout = RolloutConfig(tools=(calculator,), max_turns=3)
    got = evaluate([eng], prompts, tokenizer=TOK, reward_fn="arithmetic", max_new_tokens=128, rollout=rollout)
    assert got == {"reward_mean": 0.5, "accuracy": 0.5, "n": 2, "failed": 0}
    assert calls == [0.0] * 4  # two turns per episode, all greedy
    single = evaluate([eng], prompts, tokenizer=TOK, reward_fn="arithmetic", max_new_tokens=128)
    assert single["accuracy"] == 0.0  # without the episode, the tool call is the answer
