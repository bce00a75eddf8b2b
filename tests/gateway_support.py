"""Helpers of the OpenAI-gateway tests (tests/test_gateway.py, and the gateway in front of the real vLLM in
tests/test_engine_vllm_real.py): a two-turn `openai`-SDK agent with a function tool, and the checks that an
episode's training sample is token-exact against what the engine really returned (a `Recording` of its calls).

Everything expected is written out by hand here (the template's openings, the tool turn's rendering), not by the
code under test.
"""

from __future__ import annotations

import openai
import torch

from engines.tiny import IM_END, SPECIAL_TOKENS, build_tokenizer
from trainer.types import Status

TOK = build_tokenizer()
IM_END_ID = SPECIAL_TOKENS.index(IM_END)
CALC = {"type": "function", "function": {"name": "calculator", "description": "Evaluate an arithmetic expression.",
                                         "parameters": {"type": "object",
                                                        "properties": {"expression": {"type": "string"}},
                                                        "required": ["expression"]}}}


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


async def two_turn_agent(row, endpoint):
    """An agent as people write them (imports only `openai`): a function tool offered on every request, the
    model's message sent back as the SDK returned it, then a tool result."""
    client = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0)
    messages = [{"role": "user", "content": row["prompt"]}]
    first = await client.chat.completions.create(model=endpoint.model, messages=messages, tools=[CALC])
    messages.append(first.choices[0].message)  # the SDK's own message object, sent back as it came
    messages.append({"role": "tool", "tool_call_id": "call-0", "content": "408"})
    second = await client.chat.completions.create(model=endpoint.model, messages=messages, tools=[CALC])
    return {"reward": float(len(second.choices[0].message.content or "")), "metadata": {"seen": row["prompt"]}}


def check_two_turn_batch(batch, recording, model, *, tol: float) -> float:
    """Every sample of a `two_turn_agent` batch is: the opening the engine was asked for + what it answered
    (loss mask 1, its log-probs) + the tool turn as the template writes it (mask 0) + the engine's answer to exactly
    that prefix; log-probs within `tol` of a forward of `model`. Returns the worst log-prob difference."""
    assert all(s.status == Status.COMPLETED for s in batch.samples), [s.status for s in batch.samples]
    by_prompt = {}
    for prompt, c in recording.calls:
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
                                            (c2.output_ids, c2)], model, tol))
        assert s.metadata["turns"] == 2 and s.metadata["seen"] == s.prompt
        assert s.reward == float(len(TOK.decode(c2.output_ids, skip_special_tokens=True).strip()))
    assert batch.metadata["turns_mean"] == 2.0 and batch.metadata["agent_splits"] == 0
    assert batch.metadata["agent_errors"] == 0 and batch.metadata["agent_time_s"] > 0
    return worst
