"""Speculative decoding by n-gram lookup ([engines] speculative_tokens) against plain decoding, by batch size.

The embedded engine's DecodeBatch generates the same rows with and without drafts (the tokens are the same, the
tests prove it: tests/test_speculative.py); the figure is the time to generate them all (generated tokens/s in
extra_info), and the ratio of the two providers at each batch size is what to compare. Drafts come from the rows'
own contexts and from rows generated before (one warm-up batch of other prompts fills the index, as earlier steps
of a run would).

Model and prompts: with `BENCH_SPEC_MODEL=<folder>` (the agent recipe's SFT model: `python -m trainer sft --config
configs/agent_demo.toml`, then `python -m trainer export`), its chat template over [data].train prompts of
configs/agent_demo.toml, sampled at temperature 1 to its end of turn (a tool call, ~84 tokens); without, the tiny
model with lm_head = 4 x its embedding (it tends to repeat its last token, so drafts are often right; smoke size).

    .venv/bin/python -m pytest bench/bench_speculative.py --benchmark-only
    BENCH_SPEC_MODEL=DIR .venv/bin/python bench/bench_speculative.py --out bench/results/X.json  # interleaved rounds
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import pytest
import torch

if __package__ in (None, ""):  # `python bench/bench_speculative.py`: the repository root on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engines.embedded.drafts import NgramDrafts  # noqa: E402
from engines.embedded.generation import Row, generate_rows  # noqa: E402
from engines.embedded.server import SPECULATIVE_STEP_TOKENS_CPU  # noqa: E402
from kernels import use_backend  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# pytest records every warning, and transformers 5.24 warns on each forward (engines/embedded/generation.py silences
# it outside pytest): recording it would add its cost to every step, most to plain decoding's many steps.
pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
MODEL_ENV = "BENCH_SPEC_MODEL"
ROWS = (4, 16, 64, 128)  # 8 samples a prompt from 16 rows up (a GRPO group), 4 rows: one prompt
SMOKE_ROWS = (4, 16)
DRAFT_TOKENS = 4


def load_setup(folder: str | None):
    """(model, rows(count, seed) -> list[Row]): the folder's model over the agent prompts, or the repeating tiny
    model over random prompts (module docstring)."""
    if folder:
        from engines.embedded.presets import load_engine_model

        model, tok = load_engine_model(folder)
        problems = [json.loads(line) for line in open(ROOT / "data" / "multiply_train.jsonl")]
        stop = frozenset({tok.convert_tokens_to_ids("<|im_end|>")})
        prompts = [tuple(tok.encode(tok.apply_chat_template([{"role": "user", "content": p["prompt"]}],
                                                            add_generation_prompt=True, tokenize=False),
                                    add_special_tokens=False)) for p in problems]
        new_tokens = 96
    else:
        from engines.embedded.presets import build_tiny_model

        model = build_tiny_model(7, arch="qwen2")
        with torch.no_grad():
            model.lm_head.weight.copy_(4.0 * model.model.embed_tokens.weight)
        g = torch.Generator().manual_seed(0)
        prompts = [tuple(torch.randint(4, model.config.vocab_size, (12,), generator=g).tolist()) for _ in range(64)]
        stop, new_tokens = frozenset({3}), 32

    def rows(count: int, first: int) -> list[Row]:
        """`count` rows: 8 samples a prompt (all of them when fewer), prompts from index `first` on."""
        n = min(8, count)
        return [Row(prompts[first + i // n], 1.0, 1.0, -1, new_tokens, stop, 1000 * first + i) for i in range(count)]

    return model, rows


def drafts_after_warm_up(model, rows) -> NgramDrafts:
    """The engine's draft source on the CPU, its index filled by one batch of 16 prompts (not the timed ones)."""
    drafts = NgramDrafts(DRAFT_TOKENS, step_tokens=SPECULATIVE_STEP_TOKENS_CPU)
    generate_rows(model, rows(128, 32), pad_id=0, drafts=drafts)
    return drafts


@pytest.fixture(scope="module")
def setup():
    """The production CPU path (torch sampling, not the Triton interpreter pytest's conftest sets up for tests),
    on the in-process engine's one model thread ([engines] threads = 1)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    with use_backend("torch"):
        model, rows = load_setup(os.environ.get(MODEL_ENV))
        yield model, rows, drafts_after_warm_up(model, rows)
    torch.set_num_threads(before)


@pytest.mark.parametrize("count", ROWS)
@pytest.mark.parametrize("provider", ["plain", "speculative"])
def test_speculative_generate(benchmark, setup, provider, count, request):
    model, rows, drafts = setup
    if count not in SMOKE_ROWS and request.config.getoption("benchmark_disable"):
        pytest.skip("full size only: CI runs this file once at smoke size (--benchmark-disable)")
    batch = rows(count, 0)
    out = benchmark(lambda: generate_rows(model, batch, pad_id=0, drafts=drafts if provider == "speculative" else None))
    tokens = sum(len(r.output_ids) for r in out)
    assert tokens > 0
    benchmark.extra_info.update(rows=count, tokens=tokens, draft_tokens=DRAFT_TOKENS,
                                accepted_tokens=sum(r.accepted_tokens for r in out))
    if benchmark.stats is not None:
        benchmark.extra_info["tokens_per_s"] = tokens / benchmark.stats.stats.median


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    folder = os.environ.get(MODEL_ENV)
    model, rows = load_setup(folder)
    drafts = drafts_after_warm_up(model, rows)
    result = {"model": folder or "tiny repeating (smoke)", "draft_tokens": DRAFT_TOKENS,
              "step_tokens": SPECULATIVE_STEP_TOKENS_CPU, "torch_threads": 1, "rounds": args.rounds, "by_rows": {}}
    for count in ROWS:
        batch = rows(count, 0)
        times: dict[str, list[float]] = {"plain": [], "speculative": []}
        for _ in range(args.rounds):  # interleaved: a slow spell of the machine hits both
            for name in times:
                t = time.perf_counter()
                out = generate_rows(model, batch, pad_id=0, drafts=drafts if name == "speculative" else None)
                times[name].append(time.perf_counter() - t)
        tokens = sum(len(r.output_ids) for r in out)
        med = {k: statistics.median(v) for k, v in times.items()}
        result["by_rows"][str(count)] = {
            "tokens": tokens, "accepted_tokens": sum(r.accepted_tokens for r in out),
            "verify_steps_per_row": statistics.mean(r.verify_steps for r in out),
            "plain_s": med["plain"], "speculative_s": med["speculative"],
            "ratio": med["plain"] / med["speculative"], "plain_all_s": times["plain"],
            "speculative_all_s": times["speculative"]}
        print(count, "rows", json.dumps({k: v for k, v in result["by_rows"][str(count)].items()
                                         if not k.endswith("all_s")}), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
