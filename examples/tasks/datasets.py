"""Problem generators of the built-in tasks (arithmetic, countdown; the agent recipe's products are in
examples.tasks.agent_task) and the shipped data sets.

`python -m examples.tasks.datasets --out data` regenerates the shipped data sets deterministically; each generator
is a pure function of its arguments. The rewards that score these tasks are in trainer.rewards.rules.
"""

from __future__ import annotations

import argparse
import os
import random
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

from examples.tasks.agent_task import make_direct_sft_examples, make_multiply_problems, make_tool_sft_conversations
from trainer.data.buffer import write_jsonl


def make_arithmetic_problems(n: int, *, seed: int = 0, max_operand: int = 50, ops: str = "+-",
                             exclude: set[str] | None = None) -> list[dict[str, Any]]:
    """`n` distinct problems "a<op>b=" with operands in [0, max_operand); a pure function of the arguments.

    `exclude` holds prompts to skip (to make a held-out set disjoint from the training set).
    """
    if n > len(ops) * max_operand * max_operand - len(exclude or ()):
        raise ValueError(f"n={n}: only {len(ops) * max_operand ** 2} distinct problems exist with "
                         f"max_operand={max_operand}, ops={ops!r}; raise max_operand or lower n")
    bad = set(ops) - set("+-*")
    if bad:
        raise ValueError(f"ops={ops!r}: unsupported operators {sorted(bad)}; use a subset of '+-*'")
    rng = random.Random(seed)
    seen = set(exclude or ())
    out = []
    while len(out) < n:
        a, b, op = rng.randrange(max_operand), rng.randrange(max_operand), rng.choice(ops)
        prompt = f"{a}{op}{b}="
        if prompt in seen:
            continue
        seen.add(prompt)
        value = a + b if op == "+" else a - b if op == "-" else a * b
        out.append({"prompt": prompt, "answer": str(value), "task": "arithmetic"})
    return out



def make_countdown_problems(n: int, *, seed: int = 0, num_numbers: int = 3, max_number: int = 10) -> list[dict]:
    """Problems "nums 3 5 7 target 22 :" whose target is reachable (built from a random expression)."""
    rng = random.Random(seed)
    out, seen = [], set()
    while len(out) < n:
        nums = [rng.randint(1, max_number) for _ in range(num_numbers)]
        # Target from a random left-to-right expression over a random subset (>= 2 numbers), kept positive int.
        used = rng.sample(nums, rng.randint(2, num_numbers))
        value = Fraction(used[0])
        for x in used[1:]:
            value = {"+": value + x, "-": value - x, "*": value * x}[rng.choice("+-*")]
        if value.denominator != 1 or value <= 0:
            continue
        prompt = f"nums {' '.join(map(str, nums))} target {int(value)} :"
        if prompt in seen:
            continue
        seen.add(prompt)
        out.append({"prompt": prompt, "answer": str(int(value)), "numbers": nums, "target": int(value),
                    "task": "countdown"})
    return out



def write_demo_data(out_dir: str, *, n_train: int = 700, n_test: int = 200, seed: int = 0,
                    max_operand: int = 30, ops: str = "+") -> dict[str, str]:
    """Write the arithmetic (and a small countdown) train / held-out sets; held-out never overlaps train."""
    train = make_arithmetic_problems(n_train, seed=seed, max_operand=max_operand, ops=ops)
    test = make_arithmetic_problems(n_test, seed=seed + 1, max_operand=max_operand, ops=ops,
                                    exclude={r["prompt"] for r in train})
    cd = make_countdown_problems(n_train // 2 + n_test // 2, seed=seed)
    paths = {
        "arithmetic_train": os.path.join(out_dir, "arithmetic_train.jsonl"),
        "arithmetic_test": os.path.join(out_dir, "arithmetic_test.jsonl"),
        "countdown_train": os.path.join(out_dir, "countdown_train.jsonl"),
        "countdown_test": os.path.join(out_dir, "countdown_test.jsonl"),
    }
    write_jsonl(paths["arithmetic_train"], train)
    write_jsonl(paths["arithmetic_test"], test)
    write_jsonl(paths["countdown_train"], cd[: n_train // 2])
    write_jsonl(paths["countdown_test"], cd[n_train // 2:])
    return paths


def write_agent_data(out_dir: str, *, n_train: int = 700, n_test: int = 200, n_sft: int = 700,
                     seed: int = 0) -> dict[str, str]:
    """The agent recipe's two-digit products (configs/agent_demo*.toml): RL prompts, a disjoint held-out set, and
    two SFT sets over the same first `n_sft` training problems: tool-use conversations ("messages") and, for the
    no-tool baseline, prompt -> answer pairs."""
    train = make_multiply_problems(n_train, seed=seed)
    test = make_multiply_problems(n_test, seed=seed + 1, exclude={r["prompt"] for r in train})
    sft = train[:n_sft]
    paths = {name: os.path.join(out_dir, f"{name}.jsonl")
             for name in ("multiply_train", "multiply_test", "multiply_tool_sft", "multiply_sft")}
    write_jsonl(paths["multiply_train"], train)
    write_jsonl(paths["multiply_test"], test)
    write_jsonl(paths["multiply_tool_sft"], make_tool_sft_conversations(sft))
    write_jsonl(paths["multiply_sft"], make_direct_sft_examples(sft))
    return paths


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Regenerate the shipped demo data sets (deterministic).")
    p.add_argument("--out", default="data")
    p.add_argument("--n-train", type=int, default=700)
    p.add_argument("--n-test", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    # The demo's difficulty: a+b with operands below 30 (900 problems: 700 train, 200 held out). A tiny model
    # reaches ~40 % greedy accuracy after a short SFT, which leaves RL room to show its effect.
    p.add_argument("--max-operand", type=int, default=30)
    p.add_argument("--ops", default="+")
    # The agent recipe: SFT on tool-use conversations over the first --n-agent-sft training problems (all).
    p.add_argument("--n-agent-sft", type=int, default=700)
    a = p.parse_args(argv)
    paths = write_demo_data(a.out, n_train=a.n_train, n_test=a.n_test, seed=a.seed, max_operand=a.max_operand,
                            ops=a.ops)
    paths |= write_agent_data(a.out, n_train=a.n_train, n_test=a.n_test, n_sft=a.n_agent_sft, seed=a.seed)
    for name, path in paths.items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
