"""Write the GSM8K-style parquet sets (non-default field names: `question`, `solution`, `difficulty`).

    python data/make_gsm8k_style.py            # rewrites data/gsm8k_style_{train,test}.parquet

Word problems with one to two operations whose solutions end, as GSM8K's do, with "#### <answer>" (thousands
separated by commas). A pure function of the seed; the test split shares no question with the train split.
"""

from __future__ import annotations

import argparse
import os
import random

import pyarrow as pa
import pyarrow.parquet as pq

NAMES = ("Ava", "Ben", "Chen", "Dana", "Eli", "Fatima", "Gus", "Hana")
ITEMS = ("apples", "stamps", "marbles", "books", "coins", "shells")


def _problem(rng: random.Random) -> dict:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    kind = rng.randrange(3)
    if kind == 0:
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        q = f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?"
        steps, ans = f"{a} + {b} = {a + b}", a + b
    elif kind == 1:
        a, b = rng.randint(50, 999), rng.randint(2, 49)
        q = f"{name} had {a} {item} and gave away {b}. How many {item} are left?"
        steps, ans = f"{a} - {b} = {a - b}", a - b
    else:
        a, b, c = rng.randint(12, 99), rng.randint(12, 99), rng.randint(1, 50)
        q = f"{name} packs {a} boxes of {b} {item} each, then adds {c} loose ones. How many {item} in total?"
        steps, ans = f"{a} * {b} = {a * b}, {a * b} + {c} = {a * b + c}", a * b + c
    return {"question": q, "solution": f"{steps}\n#### {ans:,}", "difficulty": kind + 1}


def make_sets(n_train: int = 256, n_test: int = 64, seed: int = 0) -> tuple[list[dict], list[dict]]:
    rng = random.Random(seed)
    seen: set[str] = set()
    rows: list[dict] = []
    while len(rows) < n_train + n_test:
        r = _problem(rng)
        if r["question"] not in seen:
            seen.add(r["question"])
            rows.append(r)
    return rows[:n_train], rows[n_train:]


def write_sets(out_dir: str, **kw) -> dict[str, str]:
    train, test = make_sets(**kw)
    paths = {}
    for split, rows in (("train", train), ("test", test)):
        paths[split] = os.path.join(out_dir, f"gsm8k_style_{split}.parquet")
        pq.write_table(pa.Table.from_pylist(rows), paths[split])
    return paths


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
    for split, path in write_sets(ap.parse_args().out).items():
        print(f"{split}: {path}")
