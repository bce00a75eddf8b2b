"""The agent recipe's task (configs/agent_demo.toml): two-digit products, which the tiny model cannot compute
reliably alone but can with a calculator tool.

- `calculator`: the tool (`[rl.rollout] tools = ["examples.tasks.agent_task:calculator"]`), a safe evaluator of
  + - * / and parentheses over integers (a small recursive-descent parser; no eval).
- `make_multiply_problems`: prompts "37*84=" with the product as the answer (scored by the built-in "arithmetic"
  reward, the last integer of the response).
- `make_tool_sft_conversations`: the SFT warm start, one tool call then the answer:
      user       37*84=
      assistant  <tool_call>{"name": "calculator", "arguments": {"expression": "37*84"}}</tool_call>
      tool       3108
      assistant  3108
  The tool call is the Qwen2.5 / Hermes format, its JSON written by `json.dumps` (84 tokens with <|im_end|> in the
  tiny preset's byte-level tokenizer: one token per character). The answer comes in the last turn, after the
  tool call's numbers, so the last integer of the whole episode is the answer.

`python -m examples.tasks.datasets --out data` writes the shipped files (examples.tasks.datasets.write_agent_data).
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterable, Sequence
from fractions import Fraction
from typing import Any

MAX_EXPRESSION_CHARS = 200  # bounds the work (and the size of a product) of one call
_TOKEN_RE = re.compile(r"\s*(?:(\d+)|([-+*/()]))")
_PROMPT_RE = re.compile(r"^(\d+)\*(\d+)=$")


# ----------------------------------------------------------------------------------------------- the tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression over integers with + - * / and parentheses.

    Args:
        expression: The expression to evaluate, for example "37*84" or "(12+5)*3".
    """
    if not isinstance(expression, str):
        raise ValueError(f"calculator: expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"calculator: expression of {len(expression)} characters; at most {MAX_EXPRESSION_CHARS}")
    tokens = _tokenize(expression)
    if not tokens:
        raise ValueError("calculator: empty expression")
    value, pos = _sum(tokens, 0)
    if pos != len(tokens):
        raise ValueError(f"calculator: unexpected {tokens[pos]!r} after a complete expression in {expression!r}")
    return _format(value)


def _tokenize(expression: str) -> list[str]:
    """Integers and the operators + - * / ( ); anything else (names, dots, '**' is caught by the parser) fails."""
    if "**" in expression:
        raise ValueError(f"calculator: powers ('**') are not supported in {expression!r}; only + - * / and "
                         f"parentheses")
    tokens, pos = [], 0
    while pos < len(expression):
        if expression[pos:].strip() == "":
            break
        m = _TOKEN_RE.match(expression, pos)
        if m is None:
            bad = expression[pos:].lstrip()[0]
            raise ValueError(f"calculator: unexpected character {bad!r} in {expression!r}; only integers, "
                             f"+ - * / and parentheses are allowed")
        tokens.append(m.group(1) or m.group(2))
        pos = m.end()
    return tokens


# Grammar: sum := product (("+" | "-") product)*; product := unary (("*" | "/") unary)*;
# unary := "-" unary | "+" unary | INT | "(" sum ")". Exact rational arithmetic (Fraction).
def _sum(tokens: Sequence[str], pos: int) -> tuple[Fraction, int]:
    value, pos = _product(tokens, pos)
    while pos < len(tokens) and tokens[pos] in "+-":
        op = tokens[pos]
        rhs, pos = _product(tokens, pos + 1)
        value = value + rhs if op == "+" else value - rhs
    return value, pos


def _product(tokens: Sequence[str], pos: int) -> tuple[Fraction, int]:
    value, pos = _unary(tokens, pos)
    while pos < len(tokens) and tokens[pos] in ("*", "/"):
        op = tokens[pos]
        rhs, pos = _unary(tokens, pos + 1)
        if op == "/" and rhs == 0:
            raise ValueError("calculator: division by zero")
        value = value * rhs if op == "*" else value / rhs
    return value, pos


def _unary(tokens: Sequence[str], pos: int) -> tuple[Fraction, int]:
    if pos >= len(tokens):
        raise ValueError("calculator: the expression ends where a number was expected")
    tok = tokens[pos]
    if tok in ("-", "+"):
        value, pos = _unary(tokens, pos + 1)
        return (-value if tok == "-" else value), pos
    if tok == "(":
        value, pos = _sum(tokens, pos + 1)
        if pos >= len(tokens) or tokens[pos] != ")":
            raise ValueError("calculator: missing ')'")
        return value, pos + 1
    if tok.isdigit():
        return Fraction(int(tok)), pos + 1
    raise ValueError(f"calculator: unexpected {tok!r} where a number was expected")


def _format(value: Fraction) -> str:
    """An integer as itself; a fraction as a decimal with up to 6 places ("3.5", "0.333333")."""
    if value.denominator == 1:
        return str(value.numerator)
    text = f"{float(value):.6f}".rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


# ----------------------------------------------------------------------------------------------- the data
def make_multiply_problems(n: int, seed: int = 0, exclude: Iterable[str] | None = None) -> list[dict[str, Any]]:
    """`n` distinct problems "a*b=" with two-digit a, b (8100 exist), answer str(a*b); a pure function of the
    arguments. `exclude` holds prompts to skip (a held-out set disjoint from the training set)."""
    seen = set(exclude or ())
    if n > 90 * 90 - len(seen):
        raise ValueError(f"n={n}: only {90 * 90} two-digit products exist ({len(seen)} excluded)")
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        prompt = f"{a}*{b}="
        if prompt in seen:
            continue
        seen.add(prompt)
        out.append({"prompt": prompt, "answer": str(a * b), "task": "multiply"})
    return out


def problem_expression(prompt: str) -> str:
    """"37*84=" -> "37*84" (the tool call's argument)."""
    m = _PROMPT_RE.match(prompt)
    if m is None:
        raise ValueError(f"prompt {prompt!r}: expected 'a*b=' with integers a, b")
    return f"{m.group(1)}*{m.group(2)}"


def tool_call_text(expression: str) -> str:
    """The assistant's tool call, exactly as the model is trained to write it (Qwen2.5 / Hermes format)."""
    return "<tool_call>" + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + "</tool_call>"


def make_tool_sft_conversations(problems: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One tool-use conversation per problem, under "messages" (with the prompt and answer beside it)."""
    out = []
    for p in problems:
        expression = problem_expression(p["prompt"])
        result = calculator(expression)
        if result != str(p["answer"]):
            raise ValueError(f"problem {p['prompt']!r}: answer {p['answer']!r} but the calculator gives {result!r}")
        out.append({"prompt": p["prompt"], "answer": str(p["answer"]), "messages": [
            {"role": "user", "content": p["prompt"]},
            {"role": "assistant", "content": tool_call_text(expression)},
            {"role": "tool", "content": result},
            {"role": "assistant", "content": result},
        ]})
    return out


def make_direct_sft_examples(problems: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The no-tool baseline's SFT examples: prompt -> the answer directly."""
    return [{"prompt": p["prompt"], "answer": str(p["answer"])} for p in problems]
