"""KV reuse across turns (engines/embedded/prefix_cache.py, issue 43 item 2): an agent_demo-sized step through the
in-process engine with its prefix cache on and off.

The work of one RL step of configs/agent_demo.toml's shape, on its model's shape (qwen2, hidden 128, 2 layers, 4
heads, 2 KV heads; random weights, so every turn runs to its token budget: `ignore_eos`): 16 prompts x 8 episodes
of two turns. Turn 1: the opening prompt (25 tokens), 95 generated (the tool call and its header); turn 2: the
same conversation + the tool result (12 tokens), 17 generated (the answer). All 128 episodes' turn-2 requests go
to the engine together, as the rollout sends them. Measured per round, sides interleaved: the engine's prefill
tokens (prompt tokens minus those it reported as `cached_tokens`), reused tokens, and the wall time of each turn.

    .venv/bin/python bench/bench_prefix_cache.py --rounds 5 --out bench/results/prefix_cache_agent-cpu-2core.json

`--single-turn`: the cost where nothing is reused, the single-turn demo's step shape (64 prompts x 8 samples, 13
prompt tokens, 6 generated): the time of keeping every finished row's KV (the run turns the cache off for
single-turn rollouts; trainer.run.prefix_cache_tokens).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engines.local import LocalEngine  # noqa: E402
from engines.protocol import SamplingParams  # noqa: E402

PROMPTS, EPISODES, OPENING, CALL, RESULT, ANSWER = 16, 8, 25, 95, 12, 17


def _engine(cache_tokens: int, folder: str) -> LocalEngine:
    return LocalEngine(folder, seed=0, threads=1, prefix_cache_tokens=cache_tokens)


def _save_model(folder: Path) -> str:
    """The agent demo's model shape ([model] of configs/agent_demo.toml), random weights, with the project's
    tokenizer, as a Hugging Face folder."""
    from engines.embedded.presets import build_tiny_model
    from engines.tiny import build_tokenizer

    build_tiny_model(0, arch="qwen2", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2).save_pretrained(
        folder)
    build_tokenizer().save_pretrained(folder)
    return str(folder)


def one_step(engine: LocalEngine, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    opening = [[1] + torch.randint(4, 200, (OPENING - 1,), generator=g).tolist() for _ in range(PROMPTS)]
    t0 = time.perf_counter()
    first = trio.run(engine.generate, opening,
                     SamplingParams(temperature=1.0, max_new_tokens=CALL, n=EPISODES, seed=seed, ignore_eos=True))
    t1 = time.perf_counter()
    turn2 = [p + c.output_ids + torch.randint(4, 200, (RESULT,), generator=g).tolist()
             for p, group in zip(opening, first) for c in group]
    second = trio.run(engine.generate, turn2,
                      SamplingParams(temperature=1.0, max_new_tokens=ANSWER, seed=seed + 1, ignore_eos=True))
    t2 = time.perf_counter()
    outs = [c for g_ in second for c in g_]
    prompt2 = sum(len(p) for p in turn2)
    reused = sum(c.cached_tokens for c in outs)
    return {"turn1_s": t1 - t0, "turn2_s": t2 - t1, "step_s": t2 - t0, "turn2_prompt_tokens": prompt2,
            "turn2_reused_tokens": reused, "turn2_prefill_tokens": prompt2 - reused,
            "turn1_prefill_tokens": PROMPTS * OPENING,  # one prefill row per prompt (its 8 episodes share it)
            "generated_tokens": sum(len(c.output_ids) for g_ in first for c in g_) + sum(len(c.output_ids)
                                                                                       for c in outs)}


def single_turn_step(engine: LocalEngine, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    prompts = [[1] + torch.randint(4, 200, (12,), generator=g).tolist() for _ in range(64)]
    t0 = time.perf_counter()
    trio.run(engine.generate, prompts, SamplingParams(temperature=1.0, max_new_tokens=6, n=8, seed=seed,
                                                      ignore_eos=True))
    return {"step_s": time.perf_counter() - t0}


def _paired(rows: dict, key: str) -> dict:
    ratios = [b[key] / a[key] for a, b in zip(rows["reuse"], rows["no_reuse"])]
    return {"median": statistics.median(ratios), "all": [round(r, 3) for r in ratios]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--single-turn", action="store_true", help="the single-turn demo's shape: the cost alone")
    args = ap.parse_args(argv)
    step = single_turn_step if args.single_turn else one_step
    torch.set_num_threads(1)
    tmp = tempfile.TemporaryDirectory()
    folder = _save_model(Path(tmp.name))
    sides = ({"reuse": LocalEngine("tiny", seed=0, threads=1), "no_reuse": LocalEngine("tiny", seed=0, threads=1,
                                                                                       prefix_cache_tokens=0)}
             if args.single_turn else {"reuse": _engine(32768, folder), "no_reuse": _engine(0, folder)})
    try:
        for eng in sides.values():
            step(eng, 999)  # warm-up
        rows = {k: [] for k in sides}
        for r in range(args.rounds):
            for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):  # interleaved, alternating order
                rows[name].append(step(sides[name], 100 + r))
    finally:
        for eng in sides.values():
            eng.close()
        tmp.cleanup()
    if args.single_turn:
        result = {"bench": "bench/bench_prefix_cache.py --single-turn", "rounds": args.rounds,
                  "shape": dict(prompts=64, samples=8, prompt=13, new=6, model="tiny llama h64 L2 fp32", threads=1),
                  "step_s": {k: statistics.median(r["step_s"] for r in rs) for k, rs in rows.items()},
                  "reuse_over_no_reuse_paired": {k: 1 / v if k == "median" else [round(1 / x, 3) for x in v]
                                                 for k, v in _paired(rows, "step_s").items()}}
        print(json.dumps(result, indent=1))
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        return
    summary = {}
    for name, rs in rows.items():
        summary[name] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        summary[name]["step_s_all"] = [round(r["step_s"], 4) for r in rs]
        summary[name]["turn2_s_all"] = [round(r["turn2_s"], 4) for r in rs]
        for k in ("turn2_prefill_tokens", "turn2_reused_tokens", "turn1_prefill_tokens", "generated_tokens"):
            summary[name][k] = int(summary[name][k])
        summary[name]["step_prefill_tokens"] = summary[name]["turn1_prefill_tokens"] + summary[name][
            "turn2_prefill_tokens"]
        summary[name]["s_per_generated_token_ms"] = 1000 * summary[name]["step_s"] / summary[name]["generated_tokens"]
    result = {"bench": "bench/bench_prefix_cache.py", "rounds": args.rounds,
              "shape": dict(prompts=PROMPTS, episodes=EPISODES, opening=OPENING, call=CALL, result=RESULT,
                            answer=ANSWER, model="qwen2 h128 L2 heads 4/2 fp32", threads=1),
              "machine": f"{platform.machine()} {torch.get_num_threads()} torch thread(s), shared 2-core host",
              "sides": summary,
              "turn2_speedup": summary["no_reuse"]["turn2_s"] / summary["reuse"]["turn2_s"],
              "step_speedup": summary["no_reuse"]["step_s"] / summary["reuse"]["step_s"],
              # per round, the two sides run back to back: the ratio of each pair, then their median (the host is
              # shared, so rounds differ more than sides)
              "turn2_speedup_paired": _paired(rows, "turn2_s"), "step_speedup_paired": _paired(rows, "step_s")}
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
