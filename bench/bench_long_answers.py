"""Long answers (issue 43 item 3): the single-turn GRPO comparison of bench/bench_rl_vs_trl.py with every response
running to max_new_tokens (256 by default), ours (sync, in-process engine) against TRL's GRPOTrainer.

    python bench/bench_long_answers.py [--max-new-tokens 256] [--steps 3] [--seeds 2] [--out X.json]

The demo's task and random initial model (configs/demo.toml), 16 prompts x 8 samples a step (the demo's 64 x 8 at 256
tokens would make one TRL step minutes long on two cores). End of turn is suppressed for the benchmark only, on both
sides, so every completion is exactly max_new_tokens long: ours through the engine's `ignore_eos` and no stop ids
(the rollout manager's SamplingParams, patched in the worker), TRL through `generation_kwargs={"suppress_tokens":
<eos>, <|im_end|>}` (transformers' logits processor). Everything else as bench_rl_vs_trl (its module doc lists what is
matched); held-out accuracy is not a figure here (a random model, --eval-limit prompts only so the run stays short).
tokens/s = samples/s x max_new_tokens on both sides.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_agent_vs_trl as agent  # noqa: E402
import bench_rl_vs_trl as single  # noqa: E402
from _proc import run_with_peak_rss  # noqa: E402

SIDES = ("trl", "ours-sync")


def suppress_stops_ours() -> None:
    """Every rollout request of this process runs to its max_new_tokens: ignore_eos, no stop ids."""
    from engines.protocol import SamplingParams
    from trainer.rollout import manager

    def no_stop(**kw: Any) -> SamplingParams:
        return SamplingParams(**{**kw, "stop_token_ids": (), "ignore_eos": True})

    manager.SamplingParams = no_stop


def suppress_stops_trl() -> None:
    """TRL's generate never samples <eos> or <|im_end|> (transformers' suppress_tokens)."""
    trl_args = single.trl_args

    def args_without_stops(bc: single.BenchConfig, cfg: Any, output_dir: Any) -> Any:
        from engines.tokenizer import load_tokenizer
        from trainer.run import prepare_model_folder

        args = trl_args(bc, cfg, output_dir)
        args.generation_kwargs = {"suppress_tokens": single._stop_ids(load_tokenizer(prepare_model_folder(cfg)))}
        return args

    single.trl_args = args_without_stops


def run_side(side: str, bc: single.BenchConfig, out: Path) -> dict[str, Any]:
    if side == "trl":
        suppress_stops_trl()
        res = single.run_trl(bc, out)
    else:
        suppress_stops_ours()
        res = single.run_ours(bc, out, async_rollout=False)
    res["tokens_per_s"] = res["samples_per_s"] * bc.max_new_tokens
    return res


def measure(side: str, bc: single.BenchConfig, workdir: Path, *, timeout_s: float = 3600.0) -> dict[str, Any]:
    if side not in SIDES:
        raise ValueError(f"side={side!r}: choose one of {SIDES}")
    out = workdir / side
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", side, "--worker-out", str(out),
           "--bench-config", json.dumps(dataclasses.asdict(bc))]
    env = {**os.environ, "PYTHONPATH": str(agent.ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    rc, peak = run_with_peak_rss(cmd, log=out / "worker.log", timeout_s=timeout_s, cwd=agent.ROOT, env=env)
    if rc != 0 or not (out / "result.json").is_file():
        tail = (out / "worker.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"bench side {side!r} exited with code {rc}; the end of {out / 'worker.log'}:\n{tail}")
    return {**json.loads((out / "result.json").read_text()), "peak_rss_mb": peak / 2**20}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts-per-step", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--eval-limit", type=int, default=8)
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--out", default=None)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    ap.add_argument("--bench-config", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        bc = single.BenchConfig(**json.loads(args.bench_config))
        out = Path(args.worker_out)
        (out / "result.json").write_text(json.dumps(run_side(args.worker, bc, out)))
        return
    if args.seeds < 1 or args.eval_limit < 1:
        ap.error("--seeds and --eval-limit must be >= 1")
    bc = single.BenchConfig(steps=args.steps, prompts_per_step=args.prompts_per_step, group_size=args.group_size,
                            max_new_tokens=args.max_new_tokens, eval_limit=args.eval_limit)
    result = agent.compare(bc, SIDES, Path(args.workdir) if args.workdir else None, seeds=args.seeds,
                           measure_side=measure)
    result["bench"]["task"] = f"single-turn demo, random init, end of turn suppressed: {bc.max_new_tokens} tokens"
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(agent.table(result), flush=True)


if __name__ == "__main__":
    main()
