"""The OpenAI-compatible recording gateway (trainer/rollout/gateway.py, recording.py, engines/openai_wire.py) driven
by agents that use only the official `openai` SDK: token exactness against what the engine really produced (and
log-probs against a forward of the same weights), tool calls parsed on the server, history rewrites split into exact
sequences, streaming, n > 1, /v1/completions and /v1/models, bad requests, limits and a slow agent.

Every agent here imports nothing from the project: it gets `row` and `endpoint` (base_url, api_key, model).
The exactness tests use the real embedded engine in process; the tool-call tests use `Scripted` (a random tiny
model never writes a tool call).
"""

from __future__ import annotations

import openai
import pytest
import torch
import trio
from episode_support import CHAR_STOPS, Recording, arithmetic_buffer

from engines.embedded.presets import build_tiny_model
from engines.registry import EngineSpec, build_engine
from engines.tiny import IM_END, SPECIAL_TOKENS, build_tokenizer
from trainer.config import RolloutConfig
from trainer.rollout.manager import AsyncRolloutManager
from trainer.types import Status

ENGINE_SEED = 5
TOK = build_tokenizer()
IM_END_ID = SPECIAL_TOKENS.index(IM_END)
CALC = {"type": "function", "function": {"name": "calculator", "description": "Evaluate an arithmetic expression.",
                                         "parameters": {"type": "object",
                                                        "properties": {"expression": {"type": "string"}},
                                                        "required": ["expression"]}}}


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


def opening(messages) -> list[int]:
    return TOK.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]


def after_turn(role: str, content: str) -> list[int]:
    """What the tiny template writes after an assistant turn for one message, through the next generation prompt
    (written out by hand, not by the code under test)."""
    return TOK.encode(f"\n<|im_start|>{role}\n{content}<|im_end|>\n<|im_start|>assistant\n")


def assert_exact(sample, parts, model=None, tol=1e-5) -> float:
    """`parts`: [(token ids, completion or None)]: the sample's tokens are their concatenation, loss mask 1 and
    the engine's log-probs exactly on the completions; with `model`, a float32 forward's log-probs within tol."""
    tokens, mask, lps = [], [], []
    for ids, completion in parts:
        tokens += list(ids)
        if completion is None:
            mask += [0] * len(ids)
        else:
            assert list(ids) == list(completion.output_ids[:len(ids)])
            mask += [1] * len(ids)
            lps += list(completion.logprobs[:len(ids)])
    assert list(sample.tokens) == tokens
    first = next(i for i, (_, c) in enumerate(parts) if c is not None)
    prompt_len = sum(len(ids) for ids, _ in parts[:first])
    assert sample.prompt_length == prompt_len
    assert list(sample.loss_mask) == mask[prompt_len:]
    assert [x for x, m in zip(sample.rollout_logprobs, sample.loss_mask) if m] == lps
    worst = 0.0
    if model is not None:
        with torch.no_grad():
            logp = model(input_ids=torch.tensor([tokens])).logits[0].float().log_softmax(-1)
        for pos in range(prompt_len, len(tokens)):
            if mask[pos]:
                want = sample.rollout_logprobs[pos - prompt_len]
                worst = max(worst, abs(logp[pos - 1, tokens[pos]].item() - want))
        assert worst <= tol, f"engine vs forward log-probs differ by {worst:.2e}"
    return worst


# ----------------------------------------------------------------------------------------------- agents
async def two_turn_agent(row, endpoint):
    client = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0)
    messages = [{"role": "user", "content": row["prompt"]}]
    first = await client.chat.completions.create(model=endpoint.model, messages=messages, tools=[CALC])
    messages.append(first.choices[0].message)  # the SDK's own message object, sent back as it came
    messages.append({"role": "tool", "tool_call_id": "call-0", "content": "408"})
    second = await client.chat.completions.create(model=endpoint.model, messages=messages, tools=[CALC])
    return {"reward": float(len(second.choices[0].message.content or "")), "metadata": {"seen": row["prompt"]}}


def test_a_two_turn_agent_is_token_exact_on_the_embedded_engine(local, model):
    rec = Recording(local)
    batch = run_batch([rec], two_turn_agent, stop_token_ids=CHAR_STOPS[10:])
    assert len(batch) == 4 and all(s.status == Status.COMPLETED for s in batch.samples)
    by_prompt = {}
    for prompt, c in rec.calls:
        by_prompt.setdefault(prompt, []).append(c)
    worst = 0.0
    for s in batch.samples:
        start = opening([{"role": "user", "content": s.prompt}])
        first = [c for c in by_prompt[tuple(start)] if list(s.tokens[len(start):len(start) + len(c.output_ids)])
                 == c.output_ids]
        assert first, "the sample does not continue with what the engine returned for its opening"
        c1 = first[0]
        glue = [] if c1.output_ids[-1] in (IM_END_ID, 2) else [IM_END_ID]  # a turn cut by a char stop gets its end
        middle = glue + after_turn("tool", "408")
        prefix = tuple(start + c1.output_ids + middle)
        c2 = [c for c in by_prompt[prefix] if list(s.tokens[len(prefix):]) == c.output_ids][0]
        worst = max(worst, assert_exact(s, [(start, None), (c1.output_ids, c1), (middle, None),
                                            (c2.output_ids, c2)], model))
        assert s.metadata["turns"] == 2 and s.metadata["seen"] == s.prompt
        assert s.reward == float(len(TOK.decode(c2.output_ids, skip_special_tokens=True).strip()))
    assert batch.metadata["turns_mean"] == 2.0 and batch.metadata["agent_splits"] == 0
    assert batch.metadata["agent_errors"] == 0 and batch.metadata["agent_time_s"] > 0
    print(f"engine vs forward log-probs: max diff {worst:.2e}")
