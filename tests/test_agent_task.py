"""The agent recipe's task (examples.tasks.agent_task): the calculator tool, the two-digit product data, the
tool-use SFT conversations, and the built-in arithmetic reward on a tool episode's text."""

import json
import random
import re
from fractions import Fraction

import pytest

from engines.tiny import build_tokenizer
from examples.tasks.agent_task import (
    calculator,
    make_direct_sft_examples,
    make_multiply_problems,
    make_tool_sft_conversations,
    problem_expression,
)
from examples.tasks.datasets import write_agent_data
from trainer.data.buffer import DataSpec, load_jsonl, load_prompts
from trainer.rewards.rules import arithmetic_reward
from trainer.types import Sample


def _random_expression(rng: random.Random, depth: int = 0) -> str:
    if depth > 3 or rng.random() < 0.3:
        return str(rng.randint(0, 999))
    left, right = _random_expression(rng, depth + 1), _random_expression(rng, depth + 1)
    text = f"{left}{rng.choice('+-*/')}{right}"
    return f"({text})" if rng.random() < 0.5 else text


def _python_value(expression: str) -> Fraction:
    """Python's own arithmetic on the same expression, exactly (integer literals as Fractions)."""
    return eval(re.sub(r"\d+", lambda m: f"Fraction({m.group()})", expression), {"Fraction": Fraction})  # noqa: S307


def test_calculator_matches_python_arithmetic_on_random_expressions():
    rng = random.Random(random.randint(0, 10_000))
    checked = 0
    while checked < 300:
        expr = _random_expression(rng)
        try:
            want = _python_value(expr)
        except ZeroDivisionError:
            with pytest.raises(ValueError, match="division by zero"):
                calculator(expr)
            continue
        got = calculator(expr)
        if want.denominator == 1:
            assert got == str(want.numerator), expr
        else:
            assert abs(float(got) - float(want)) <= 5e-7 * max(1.0, abs(float(want))), (expr, got, want)
        checked += 1


@pytest.mark.parametrize("expr, want", [("37*84", "3108"), (" 12 + 5 * 3 ", "27"), ("(12+5)*3", "51"),
                                        ("-4*-(2+1)", "12"), ("7/2", "3.5"), ("1/3", "0.333333"), ("10-25", "-15")])
def test_calculator_examples(expr, want):
    assert calculator(expr) == want


@pytest.mark.parametrize("expr, message", [
    ("__import__('os').system('true')", "unexpected character '_'"),
    ("abs(-3)", "unexpected character 'a'"),
    ("x*2", "unexpected character 'x'"),
    ("2**10", r"powers \('\*\*'\)"),
    ("2^3", "unexpected character '\\^'"),
    ("1.5*2", "unexpected character '.'"),
    ("3/0", "division by zero"),
    ("(1+2", "missing '\\)'"),
    ("1+", "ends where a number was expected"),
    ("1 2", "unexpected '2' after a complete expression"),
    ("", "empty expression"),
    ("1+" * 150 + "1", "at most 200"),
])
def test_calculator_refuses_everything_else(expr, message):
    with pytest.raises(ValueError, match=message):
        calculator(expr)


def test_calculator_schema_for_the_chat_template():
    from transformers.utils import get_json_schema

    schema = get_json_schema(calculator)["function"]
    assert schema["name"] == "calculator"
    assert schema["parameters"]["required"] == ["expression"]
    assert schema["parameters"]["properties"]["expression"]["type"] == "string"


def test_multiply_problems_are_deterministic_distinct_and_correct():
    a = make_multiply_problems(300, seed=5)
    assert a == make_multiply_problems(300, seed=5) and a != make_multiply_problems(300, seed=6)
    assert len({p["prompt"] for p in a}) == 300
    for p in a:
        x, y = map(int, problem_expression(p["prompt"]).split("*"))
        assert 10 <= x <= 99 and 10 <= y <= 99 and p["answer"] == str(x * y)
    held_out = make_multiply_problems(200, seed=6, exclude={p["prompt"] for p in a})
    assert not {p["prompt"] for p in held_out} & {p["prompt"] for p in a}


def test_tool_sft_conversations_call_the_tool_on_the_problem():
    problems = make_multiply_problems(50, seed=random.randint(0, 10_000))
    for p, conv in zip(problems, make_tool_sft_conversations(problems), strict=True):
        roles = [m["role"] for m in conv["messages"]]
        assert roles == ["user", "assistant", "tool", "assistant"]
        user, call, tool, final = (m["content"] for m in conv["messages"])
        assert user == p["prompt"] and tool == final == p["answer"]
        body = re.fullmatch(r"<tool_call>(.*)</tool_call>", call).group(1)
        assert body == json.dumps({"name": "calculator", "arguments": {"expression": problem_expression(p["prompt"])}})
        parsed = json.loads(body)
        assert calculator(**parsed["arguments"]) == p["answer"]
        x, y = map(int, parsed["arguments"]["expression"].split("*"))
        assert str(x * y) == p["answer"]
    assert make_direct_sft_examples(problems[:2]) == [{"prompt": p["prompt"], "answer": p["answer"]}
                                                     for p in problems[:2]]


def test_shipped_agent_data_regenerates_exactly_and_is_disjoint(tmp_path):
    paths = write_agent_data(str(tmp_path))
    for name, path in paths.items():
        assert open(path).read() == open(f"data/{name}.jsonl").read(), f"data/{name}.jsonl is out of date"
    train = {p.prompt for p in load_jsonl(paths["multiply_train"])}
    test = {p.prompt for p in load_jsonl(paths["multiply_test"])}
    assert (len(train), len(test)) == (700, 200) and not train & test
    sft = {p.prompt for p in load_jsonl(paths["multiply_sft"])}
    tool_sft = load_prompts(DataSpec(path=paths["multiply_tool_sft"], messages_key="messages"),
                            cache_dir=str(tmp_path / "cache"))
    assert {p.prompt for p in tool_sft} == sft and sft <= train
    assert [m["role"] for m in tool_sft[0].metadata["messages"]] == ["user", "assistant", "tool", "assistant"]


def test_sft_masks_the_tool_turn_and_fits_max_length():
    from trainer.sft import compute_loss_mask

    tok = build_tokenizer()
    conv = make_tool_sft_conversations(make_multiply_problems(1, seed=1))[0]["messages"]
    ids, mask = compute_loss_mask(tok, conv)
    trained = tok.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert trained == conv[1]["content"] + "<|im_end|>" + conv[3]["content"] + "<|im_end|>"
    assert len(ids) <= 160  # configs/agent_demo.toml [sft] max_length
    call_tokens = tok(conv[1]["content"] + "<|im_end|>", add_special_tokens=False)["input_ids"]
    assert len(call_tokens) <= 96  # [rl.rollout] max_new_tokens, per turn


def _episode_sample(answer_turn: str, answer: str, *, skip_special_tokens: bool) -> Sample:
    # A tool episode as the engine and the environment left it: the prompt rendered with the generation prompt,
    # then every later token of the conversation's rendering (the model's turns, the tool's result) as the response.
    tok = build_tokenizer()
    messages = [{"role": "user", "content": "37*84="},
                {"role": "assistant", "content": '<tool_call>{"name": "calculator", "arguments": {"expression": '
                                                 '"37*84"}}</tool_call>'},
                {"role": "tool", "content": "3108"}, {"role": "assistant", "content": answer_turn}]
    prompt = tok.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=True, return_dict=False)
    full = tok.apply_chat_template(messages, tokenize=True, return_dict=False)
    assert full[:len(prompt)] == prompt
    response = full[len(prompt):]
    text = tok.decode(response, skip_special_tokens=skip_special_tokens)
    return Sample(prompt="37*84=", tokens=full, response_length=len(response), response=text,
                  metadata={"answer": answer})


def test_arithmetic_reward_on_a_tool_episode_without_special_tokens():
    # The answer comes after the tool call's numbers, so the last integer of the episode's text is the answer.
    assert arithmetic_reward(_episode_sample("3108", "3108", skip_special_tokens=True)) == 1.0
    assert arithmetic_reward(_episode_sample("3100", "3108", skip_special_tokens=True)) == 0.0
