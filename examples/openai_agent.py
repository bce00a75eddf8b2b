"""The calculator task of configs/agent_demo.toml as an agent written against the official `openai` SDK: its own
loop, its own tool, OpenAI's tool schema. It imports nothing from this project; configs/openai_agent_demo.toml
trains it as it is, through the trainer's recording gateway (`[rl.rollout] agent = "examples/openai_agent.py:solve"`).

The trainer calls `solve(row, endpoint)` once per episode: `row` is the data row ("prompt", "answer", its other
fields), `endpoint` holds what an OpenAI client needs (base_url, api_key, model). The same function runs against
any OpenAI-compatible server:

    import asyncio, types
    endpoint = types.SimpleNamespace(base_url="http://localhost:8000/v1", api_key="...", model="my-model")
    asyncio.run(solve({"prompt": "37*84="}, endpoint))
"""

from __future__ import annotations

import ast
import json
import operator
from fractions import Fraction

import openai

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression over integers with + - * / and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string",
                                          "description": 'The expression to evaluate, for example "37*84".'}},
            "required": ["expression"],
        },
    },
}

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculate(expression: str) -> str:
    """+ - * / and parentheses over integers, exactly (fractions), written as the trainer's built-in tool writes
    its results: an integer as itself, a fraction as a decimal with up to 6 places."""
    if len(expression) > 200:
        raise ValueError(f"expression of {len(expression)} characters; at most 200")

    def value(node: ast.AST) -> Fraction:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ValueError("division by zero")
            return Fraction(_OPS[type(node.op)](left, right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            return -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return Fraction(node.value)
        raise ValueError(f"only integers, + - * / and parentheses are allowed in {expression!r}")

    result = value(ast.parse(expression.strip(), mode="eval").body)
    if result.denominator == 1:
        return str(result.numerator)
    text = f"{float(result):.6f}".rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


async def solve(row: dict, endpoint) -> None:
    """Ask, run each tool call, answer the tool results, until the model answers without a call. Returns None: the
    run's reward ([data] reward = "arithmetic") scores the final answer."""
    async with openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0) as client:
        messages = [{"role": "user", "content": row["prompt"]}]
        while True:
            response = await client.chat.completions.create(model=endpoint.model, messages=messages,
                                                            tools=[CALCULATOR])
            message = response.choices[0].message
            if not message.tool_calls:
                return None
            messages.append(message)
            for call in message.tool_calls:
                try:
                    result = calculate(json.loads(call.function.arguments)["expression"])
                except Exception as e:  # noqa: BLE001 - the model reads the error and may try again
                    result = f"error: {type(e).__name__}: {e}"
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
