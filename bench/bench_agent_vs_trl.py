"""The agent recipe's GRPO work (configs/agent_demo.toml: two-digit products with a calculator tool) through TRL's
`GRPOTrainer(tools=[calculator])` and through ours, side by side; the JSON shape of bench/bench_rl_vs_trl.py.

    python bench/bench_agent_vs_trl.py --model DIR [--steps 5] [--seeds 3] [--out bench/results/X.json]

`--model DIR`: the agent recipe's SFT model (`python -m trainer sft --config configs/agent_demo.toml`, then
`python -m trainer export`), the folder both sides start from. Both train on [data].train's prompts (chat format),
16 prompts x 8 episodes a step, at the run's temperature, learning rate, KL coefficient, clipping and AdamW settings
(bench_rl_vs_trl.trl_args: every TRL default that differs from ours is set to ours), scored by the config's reward
(the last integer of the whole episode).

Sides: "trl" (transformers' `generate` in TRL's own tool loop, `_tool_call_loop`); "ours-sync" (`python -m trainer
rl`, the tools recipe, one in-process engine); "ours-async-http" (async rollouts one step ahead, the embedded engine
as its own process behind HTTP, the rollout client in a process of its own). Each runs in its own subprocess; a
round runs every side once per seed, and the order of the sides rotates from one seed to the next, so a slow spell
of the shared machine hits each side.

How TRL's tool loop is matched to ours (`agent_tokenizer`, `trl_agent_args`):
  episode        one tool call, its result as a `tool` message, the answer; at most [rl.rollout] max_turns
                 assistant turns = TRL's first generation + max_tool_calling_iterations (max_turns - 1)
  tokens         TRL's prompt ids are the same chat template's (the project tokenizer's, given a rendering of
                 `tool_calls` for TRL's checks); the tool result's tokens come from the template on both sides
                 ("\\n<|im_start|>tool\\n3108<|im_end|>\\n<|im_start|>assistant\\n" after the model's <|im_end|>:
                 TRL's eos is set to <|im_end|>, the turn end it slices at); calls are parsed by TRL's Qwen3
                 response template (`<tool_call>{json}</tool_call>`), ours by engines.tool_calls.parse_hermes
  length         ours: max_new_tokens per assistant turn; TRL has only a budget for the whole completion (model and
                 tool tokens): max_completion_length = max_turns x max_new_tokens (the most an episode of ours
                 can generate), each of its generate calls also capped by it
  reward         the config's reward on the episode's text (TRL: its messages joined back into the text they
                 rendered from: content, tool calls, tool results), so "the last integer" is the same integer
  accuracy       both sides' final weights are evaluated by our evaluator (trainer.evaluation.evaluate: greedy
                 episodes with the same tools, max_new_tokens per turn and reward, on an in-process engine built
                 from the folder TRL saved), as is the initial model (equal on both sides by construction)
Figures per side: samples/s (episodes per second of the training loop; TRL: between optimizer steps, generation
included), tokens/s (the model's own tokens, loss mask 1: TRL's completions/mean_length counts these, its tool_mask
= 1; ours also reports completion_tokens_per_s with the tool results' tokens), seconds per step, the training
reward per step, held-out accuracy, peak RSS of the process tree, and ours' parts of a step
(generate / train / sync, the environment's summed time).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python bench/bench_agent_vs_trl.py`: the repository root on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_rl_vs_trl as single  # noqa: E402  (bench/ is on the path: script or pytest)
from _proc import run_with_peak_rss  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
AGENT_CONFIG = str(ROOT / "configs" / "agent_demo.toml")
SIDES = ("trl", "ours-sync", "ours-async-http")

# The chat template of engines/tiny.py plus a rendering of an assistant's `tool_calls` in the Qwen2.5 / Hermes
# format the SFT data writes as text. Only TRL's checks (supports_tool_calling, its tool-suffix slicing) render
# `tool_calls`; every conversation without them renders token for token as with the project template.
TOOL_CALLS_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] or '' }}"
    "{% for call in message['tool_calls'] or [] %}"
    "{{ '<tool_call>{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' "
    "+ (call['function']['arguments'] | tojson) + '}</tool_call>' }}"
    "{% endfor %}{{ '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}"
    "{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def agent_bench_config(**kw: Any) -> single.BenchConfig:
    """The agent recipe's step: 16 prompts x 8 episodes, 96 new tokens a turn (configs/agent_demo.toml). The async
    side's rollout client runs in a process of its own ([rl] rollout_worker = "process"): its episodes' Python
    (tool calls, rendering, HTTP) then leaves the trainer's interpreter alone (measured, one seed, 8 steps: a step
    of 1.24 s median against 1.48 s with the client in a thread of the trainer's process)."""
    base = dict(config=AGENT_CONFIG, prompts_per_step=16, group_size=8, max_new_tokens=96, rollout_worker="process")
    return single.BenchConfig(**{**base, **kw})


def agent_tokenizer(tokenizer: Any) -> Any:
    """The project tokenizer as TRL's tool loop needs it: a template that renders `tool_calls`, <|im_end|> as eos
    (the end of turn TRL slices the tool suffix at and masks completions after) and TRL's Qwen3 response template
    (its parser of `<tool_call>{json}</tool_call>`)."""
    from trl.chat_template_utils import qwen3_template

    tok = tokenizer
    tok.chat_template = TOOL_CALLS_TEMPLATE
    tok.eos_token = "<|im_end|>"
    tok.response_template = qwen3_template
    return tok


def episode_text(messages: list[dict[str, Any]]) -> str:
    """TRL's completion messages joined into the text they rendered from (the reward reads its last integer)."""
    parts = []
    for m in messages:
        parts.append(m.get("content") or "")
        for call in m.get("tool_calls") or ():
            f = call["function"]
            parts.append("<tool_call>" + json.dumps({"name": f["name"], "arguments": f["arguments"]}) + "</tool_call>")
    return "\n".join(parts)


def trl_agent_reward_fn(reward: str):
    """Our reward in TRL's calling convention, on the whole episode's text."""
    from trainer.rewards.rules import compute_rewards, load_reward_fn
    from trainer.types import Sample, Status

    fn = load_reward_fn(reward)

    def episode_reward(prompts, completions, answer, **_):
        samples = [Sample(prompt=str(p), tokens=(), response=episode_text(c) if isinstance(c, list) else c,
                          metadata={"answer": a}, status=Status.COMPLETED)
                   for p, c, a in zip(prompts, completions, answer)]
        scored, _ = compute_rewards(samples, fn)
        return [s.reward or 0.0 for s in scored]

    episode_reward.__name__ = str(reward).rsplit(":", 1)[-1]
    return episode_reward


def trl_agent_args(bc: single.BenchConfig, cfg: Any, output_dir: str | Path) -> Any:
    """bench_rl_vs_trl.trl_args plus the tool loop's bounds (module doc: length, episode)."""
    from trainer.preflight import phase_configs

    rollout = phase_configs(cfg).rl.rollout
    args = single.trl_args(bc, cfg, output_dir)
    args.max_completion_length = rollout.max_turns * bc.max_new_tokens
    args.max_tool_calling_iterations = rollout.max_turns - 1
    return args


def our_accuracy(cfg: Any, folder: Path, tokenizer: Any) -> float:
    """Greedy held-out accuracy of the model in `folder` by our evaluator (the episodes of the run's tools)."""
    from engines.registry import build_engine
    from trainer.evaluation import eval_sets, evaluate
    from trainer.preflight import phase_configs
    from trainer.run import prefix_cache_tokens

    (ev, *_) = eval_sets(cfg, tokenizer=tokenizer)
    engine = build_engine(cfg.engines.fleet[0], model_folder=folder, seed=cfg.seed, threads=cfg.engines.threads,
                          prefix_cache_tokens=prefix_cache_tokens(cfg))
    try:
        out = evaluate([engine], ev.prompts, tokenizer=tokenizer, reward_fn=ev.reward,
                       max_new_tokens=cfg.eval.max_new_tokens, chat=True, rollout=phase_configs(cfg).rl.rollout)
    finally:
        engine.close()
    return out["accuracy"]


def build_trl_agent_trainer(bc: single.BenchConfig, cfg: Any, folder: Path, out: Path, *,
                            callbacks: list[Any] = ()) -> Any:
    """TRL's GRPOTrainer(tools=[...]) on the model in `folder`, the config's prompts, tools and reward, and the
    bench's hyper-parameters (module doc)."""
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from engines.tokenizer import load_tokenizer
    from trainer.data.buffer import config_prompts
    from trainer.preflight import phase_configs
    from trainer.rollout.loading import load_callable

    data, rollout = cfg.data, phase_configs(cfg).rl.rollout
    if data.format != "chat" or not rollout.tools:
        raise ValueError(f"{bc.config}: the TRL agent side runs chat prompts with [rl.rollout] tools; got format = "
                         f"{data.format!r}, tools = {list(rollout.tools)!r}")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.generation_config.eos_token_id = single._stop_ids(load_tokenizer(folder))
    train = config_prompts(data.train, data.mapping(), where="[data].train", seed=cfg.seed)
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": p.prompt}], "answer": str(p.answer)}
                            for p in train])
    tools = [load_callable(t, "[rl.rollout] tools:") for t in rollout.tools]
    return trl.GRPOTrainer(model=model, reward_funcs=trl_agent_reward_fn(data.reward),
                           args=trl_agent_args(bc, cfg, out / "trl"), train_dataset=ds,
                           processing_class=agent_tokenizer(load_tokenizer(folder)), tools=tools,
                           callbacks=list(callbacks))


def run_trl_agent(bc: single.BenchConfig, out: Path) -> dict[str, Any]:
    """TRL's side: train, then the figures; accuracy before and after by our evaluator (module doc)."""
    import trl

    from engines.tokenizer import load_tokenizer
    from trainer.run import prepare_model_folder

    t0 = time.perf_counter()
    cfg = single.run_config(bc, out, in_process=True)
    folder = prepare_model_folder(cfg)
    acc_initial = our_accuracy(cfg, folder, load_tokenizer(folder))
    times = _StepTimes()
    trainer = build_trl_agent_trainer(bc, cfg, folder, out, callbacks=[times.callback()])
    gen_seconds = _time_method(trainer, "_generate_and_score_completions")
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    final = out / "trl_final"
    trainer.model.save_pretrained(final)
    load_tokenizer(folder).save_pretrained(final)  # the project tokenizer, unchanged, beside the weights
    acc = our_accuracy(cfg, final, load_tokenizer(final))
    n = bc.prompts_per_step * bc.group_size
    res = single.loop_figures(times.seconds, [n] * len(times.seconds))
    lengths = [float(h.get("completions/mean_length", 0.0)) for h in logs]
    res.update(wall_s=time.perf_counter() - t0, steps=len(times.seconds), accuracy=acc, accuracy_initial=acc_initial,
               reward_mean_last=logs[-1]["reward"] if logs else None,
               reward_per_step=[round(float(h["reward"]), 4) for h in logs],
               step_s=[round(x, 3) for x in times.seconds],
               generate_score_s_per_step=[round(x, 3) for x in gen_seconds],
               response_length_mean=statistics.mean(lengths) if lengths else 0.0,
               tokens_per_s=sum(x * n for x in lengths) / res["loop_s"] if res["loop_s"] > 0 else 0.0,
               tool_calls_per_episode=[round(float(h.get("tools/call_frequency", 0.0)), 3) for h in logs],
               tool_failure_frequency=[round(float(h.get("tools/failure_frequency", 0.0)), 3) for h in logs],
               optim=str(trainer.args.optim), trl_version=trl.__version__)
    return res


class _StepTimes:
    """Seconds between consecutive optimizer steps (the first from the start of training), from a callback."""

    def __init__(self) -> None:
        self.seconds: list[float] = []

    def callback(self) -> Any:
        from transformers import TrainerCallback

        seconds, last = self.seconds, [0.0]

        class StepTimes(TrainerCallback):
            def on_train_begin(self, *a, **k):
                last[0] = time.perf_counter()

            def on_step_end(self, *a, **k):
                now = time.perf_counter()
                seconds.append(now - last[0])
                last[0] = now

        return StepTimes()


def _time_method(obj: Any, name: str) -> list[float]:
    """Wrap obj.name to append each call's seconds to the returned list."""
    seconds: list[float] = []
    inner = getattr(obj, name)

    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            seconds.append(time.perf_counter() - t)

    setattr(obj, name, timed)
    return seconds


def run_ours_agent(bc: single.BenchConfig, out: Path, side: str, *, profile: bool = False) -> dict[str, Any]:
    """bench_rl_vs_trl.run_ours on the agent config, plus completion tokens/s, the model's own tokens a step
    (loss mask 1: what the engine generated) and the parts of a step; `profile` also times the in-process engine's
    batch steps and model forwards (where the time goes: engine vs client)."""
    from trainer.metrics import read_jsonl

    async_rollout, in_process = single.OURS[side]
    engine_times = _patch_engine_timers() if profile else None
    res = single.run_ours(bc, out, async_rollout=async_rollout, in_process=in_process)
    rows = [r for r in read_jsonl(out / "rl" / "metrics.jsonl") if "loss" in r]
    tokens = [float(r["response_length_mean"]) * float(r["num_samples"]) for r in rows]
    generated = [float(r.get("rollout/generated_tokens", 0.0)) for r in rows]

    def mean(key: str) -> float:
        return statistics.mean(float(r.get(key, 0.0)) for r in rows) if rows else 0.0

    loop = res["loop_s"]
    res.update(tokens_per_s=sum(generated) / loop if loop > 0 else 0.0,  # the model's tokens, as TRL counts them
               completion_tokens_per_s=sum(tokens) / loop if loop > 0 else 0.0,  # with the tool results' tokens
               generated_tokens_per_step=generated,
               ms_per_generated_token=[round(1e3 * float(r["time_step_s"]) / g, 4) if g else None
                                       for r, g in zip(rows, generated)],
               step_s=[round(float(r["time_step_s"]), 3) for r in rows],
               env_s_per_step=[round(float(r.get("rollout/env_time_s", 0.0)), 3) for r in rows],
               turns_mean=mean("rollout/turns_mean"), tool_calls_mean=mean("rollout/tool_calls_mean"),
               tool_errors_per_step=mean("rollout/tool_errors"), truncated_fraction=mean("rollout/truncated_fraction"),
               prefill_tokens_reused_per_step=[float(r.get("rollout/prefill_tokens_reused", 0.0)) for r in rows])
    if engine_times is not None:
        res["engine_s"] = {k: round(v, 3) for k, v in engine_times.items()}
    return res


def _patch_engine_timers() -> dict[str, float]:
    """Accumulate the seconds of the embedded engine's DecodeBatch.step (all of the engine's batch work: model
    forwards, sampling, bookkeeping) and of its model forwards (prefill, decode) in the returned dict, with the
    number of steps; the rest of a rollout's time is the client side (episodes, rendering, tools, scheduling) and
    waiting. Evaluation requests count too (the run's before/after evaluations go through the same engine)."""
    import threading

    from engines.embedded import generation

    acc = {"step": 0.0, "prefill": 0.0, "decode": 0.0, "steps": 0.0}
    lock = threading.Lock()

    def wrap(name: str, key: str) -> None:
        inner = getattr(generation.DecodeBatch, name)

        def timed(self, *a, **k):
            t = time.perf_counter()
            try:
                return inner(self, *a, **k)
            finally:
                with lock:
                    acc[key] += time.perf_counter() - t
                    if key == "step":
                        acc["steps"] += 1

        setattr(generation.DecodeBatch, name, timed)

    wrap("step", "step")
    wrap("_decode", "decode")
    wrap("_prefills", "prefill")  # every joining row's prefill forwards, prefix-cache lookups included
    return acc


# ----------------------------------------------------------------------------------------------- driver
def measure(side: str, bc: single.BenchConfig, workdir: Path, *, timeout_s: float = 3600.0,
            profile: bool = False) -> dict[str, Any]:
    """One side in a fresh subprocess; its result plus the peak RSS of its process tree."""
    if side not in SIDES:
        raise ValueError(f"side={side!r}: choose one of {SIDES}")
    out = workdir / side
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", side, "--worker-out", str(out),
           "--bench-config", json.dumps(dataclasses.asdict(bc))] + (["--profile"] if profile else [])
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    rc, peak = run_with_peak_rss(cmd, log=out / "worker.log", timeout_s=timeout_s, cwd=ROOT, env=env)
    result = out / "result.json"
    if rc != 0 or not result.is_file():
        tail = (out / "worker.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"bench side {side!r} exited with code {rc}; the end of {out / 'worker.log'}:\n{tail}")
    return {**json.loads(result.read_text()), "peak_rss_mb": peak / 2**20}


def rotated(sides: tuple[str, ...], k: int) -> tuple[str, ...]:
    """The order of the sides in round k: rotated by k, so each side runs first, second, ... in turn."""
    k %= max(len(sides), 1)
    return sides[k:] + sides[:k]


def spread(values: list[float]) -> dict[str, float]:
    """Median, min, max of per-seed figures."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else {}


def compare(bc: single.BenchConfig, sides: tuple[str, ...] = SIDES, workdir: Path | None = None,
            seeds: int = 1, measure_side: Any = None) -> dict[str, Any]:
    """Every side once per seed (bc.seed ... bc.seed + seeds - 1), the order rotating from seed to seed; the JSON
    shape of bench_rl_vs_trl.compare plus per-seed ratios and their spread. `measure_side(side, bc, workdir)`:
    how one side runs (default: this script's `measure`; bench_long_answers.py gives its own)."""
    measure_side = measure_side or measure
    with tempfile.TemporaryDirectory(prefix="agent_vs_trl_") as tmp:
        work = Path(workdir or tmp)
        before = single.machine_info()
        runs: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
        for k in range(seeds):
            seeded = dataclasses.replace(bc, seed=bc.seed + k)
            for side in rotated(sides, k):
                runs[side].append(measure_side(side, seeded, work / f"seed{seeded.seed}", **(
                    {"profile": side == "ours-sync"} if measure_side is measure else {})))
        res = {side: single.aggregate(r) for side, r in runs.items()}
        for r in res.values():  # tokens/s over all seeds' loops
            per = r.get("per_seed", [r])
            loop = sum(x["loop_s"] for x in per)
            r["tokens_per_s"] = sum(x["tokens_per_s"] * x["loop_s"] for x in per) / loop if loop > 0 else 0.0
    out: dict[str, Any] = {"bench": {**dataclasses.asdict(bc), "seeds": seeds, "task": "agent",
                                     "side_order_per_seed": [list(rotated(sides, k)) for k in range(seeds)]},
                           "machine": before,
                           "load_1_5_15_after": [round(x, 2) for x in os.getloadavg()]}
    if "trl" in res:
        out.update(trl_samples_per_s=res["trl"]["samples_per_s"], trl_accuracy=res["trl"]["accuracy"],
                   trl_tokens_per_s=res["trl"]["tokens_per_s"])
    for side in sides:
        if side == "trl":
            continue
        r, mode = res[side], side.removeprefix("ours-").replace("-", "_")
        out[f"ours_{mode}_samples_per_s"], out[f"ours_{mode}_accuracy"] = r["samples_per_s"], r["accuracy"]
        out[f"ours_{mode}_tokens_per_s"] = r["tokens_per_s"]
        if "trl" in res and res["trl"]["samples_per_s"] > 0:
            out[f"ratio_{mode}"] = r["samples_per_s"] / res["trl"]["samples_per_s"]
            per_seed = [o["samples_per_s"] / t["samples_per_s"] for o, t in zip(runs[side], runs["trl"])]
            out[f"ratio_{mode}_per_seed"] = per_seed
            out[f"ratio_{mode}_spread"] = spread(per_seed)
            diffs = [o["accuracy"] - t["accuracy"] for o, t in zip(runs[side], runs["trl"])]
            out[f"accuracy_diff_{mode}_per_seed"] = diffs  # ours - TRL, paired by seed
            out[f"accuracy_diff_{mode}_mean"] = statistics.mean(diffs)
            out[f"accuracy_diff_{mode}_stderr"] = (statistics.stdev(diffs) / len(diffs) ** 0.5
                                                   if len(diffs) > 1 else None)
    return single.with_default_side(out, res)


def table(result: dict[str, Any]) -> str:
    rows = ["| side | samples/s | tokens/s | s/step (median) | loop s | wall s | peak RSS MB | accuracy (initial) |",
            "|---|---|---|---|---|---|---|---|"]
    for side, r in result["sides"].items():
        rows.append(f"| {side} | {r['samples_per_s']:.1f} | {r['tokens_per_s']:.0f} | {r['s_per_step']:.2f} | "
                    f"{r['loop_s']:.1f} | {r['wall_s']:.1f} | {r['peak_rss_mb']:.0f} | {r['accuracy']:.3f} "
                    f"({r['accuracy_initial']:.3f}) |")
    for key, value in result.items():
        if key.startswith("ratio_") and not key.endswith(("_per_seed", "_spread")):
            rows.append(f"{key}: {value:.2f}x {result.get(key + '_spread', '')}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="the agent recipe's SFT model folder (python -m trainer export)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--prompts-per-step", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96, help="per assistant turn (TRL: x max_turns per episode)")
    ap.add_argument("--eval-limit", type=int, default=0, help="held-out prompts to evaluate (0: all)")
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated subset of {SIDES}")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=None, help="also write the JSON object to this file")
    ap.add_argument("--workdir", default=None, help="keep each side's outputs (logs, metrics.jsonl) here")
    ap.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    ap.add_argument("--bench-config", help=argparse.SUPPRESS)
    ap.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        bc = single.BenchConfig(**json.loads(args.bench_config))
        out = Path(args.worker_out)
        res = (run_trl_agent(bc, out) if args.worker == "trl"
               else run_ours_agent(bc, out, args.worker, profile=args.profile))
        (out / "result.json").write_text(json.dumps(res))
        return
    if args.seeds < 1:
        ap.error("--seeds must be >= 1")
    bc = agent_bench_config(steps=args.steps, prompts_per_step=args.prompts_per_step, group_size=args.group_size,
                            max_new_tokens=args.max_new_tokens, eval_limit=args.eval_limit, model=args.model)
    sides = tuple(s.strip() for s in args.sides.split(",") if s.strip())
    bad = [s for s in sides if s not in SIDES]
    if bad:
        ap.error(f"--sides {args.sides}: unknown {bad}; choose from {SIDES}")
    result = compare(bc, sides, Path(args.workdir) if args.workdir else None, seeds=args.seeds)
    single.emit(result, args.out, args.json, table)


if __name__ == "__main__":
    main()
