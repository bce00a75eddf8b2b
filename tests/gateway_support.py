"""Helpers of the OpenAI-gateway tests (tests/test_gateway.py, and the gateway in front of the real vLLM in
tests/test_engine_vllm_real.py): a two-turn `openai`-SDK agent with a function tool, and the checks that an
episode's training sample is token-exact against what the engine really returned (a `Recording` of its calls).

Everything expected is written out by hand here (the template's openings, the tool turn's rendering), not by the
code under test.
"""

from __future__ import annotations

import json

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


CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'


def calculator_agent(row, endpoint):
    """A plain (sync) `openai` agent that runs the calculator the model calls: turn 1 must come back as parsed
    `tool_calls`; each call's result goes back as a `tool` message after the SDK's own assistant message; turn 2
    is the answer (at most 8 tokens: a cut the agent asked for, not a truncation). Returns what it saw (the calls,
    the finish reasons) as metadata."""
    client = openai.OpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0)
    messages = [{"role": "user", "content": row["prompt"]}]
    first = client.chat.completions.create(model=endpoint.model, messages=messages, tools=[CALC]).choices[0]
    messages.append(first.message.model_dump(exclude_none=True))
    calls = []
    for call in first.message.tool_calls or ():
        args = json.loads(call.function.arguments)
        calls.append([call.function.name, args])
        a, b = args["expression"].split("*")
        messages.append({"role": "tool", "tool_call_id": call.id, "content": str(int(a) * int(b))})
    second = client.chat.completions.create(model=endpoint.model, messages=messages, tools=[CALC],
                                            max_tokens=8).choices[0]
    return {"reward": 1.0, "metadata": {"calls": calls, "finishes": [first.finish_reason, second.finish_reason]}}


def train_to_write(model, prompt: list[int], target: list[int], *, min_logprob: float, lr: float = 3e-3,
                   steps: int = 1000):
    """`model` trained in place (Adam, one sequence) until every token of `target` after `prompt` has log-prob
    > `min_logprob` under teacher forcing, so sampling writes it (at T = 1 with probability >= exp(len(target) *
    min_logprob)); one torch thread (a [1, ~130] batch: two OpenMP threads on a busy machine were 40x slower)."""
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    ids, want = torch.tensor([prompt + target]), torch.tensor(target)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(steps):
            logp = model(input_ids=ids).logits[0, len(prompt) - 1:-1].log_softmax(-1)  # [len(target), vocab]
            worst = logp.gather(-1, want[:, None]).min().item()
            if worst > min_logprob:
                return model.eval()
            loss = torch.nn.functional.nll_loss(logp, want)
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    raise AssertionError(f"the model did not learn its target in {steps} steps (worst log-prob {worst:.3g})")
