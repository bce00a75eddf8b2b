"""The same GRPO work through TRL's `GRPOTrainer` and through ours (embedded engine), side by side in one run.

    python bench/bench_rl_vs_trl.py [--steps 5] [--model DIR] [--json] [--out bench/results/rl_vs_trl-cpu-2core.json]

Both sides start from the demo's initial model (configs/demo.toml [model]: the seeded random tiny Qwen2 that
`trainer.run.prepare_model_folder` writes, the project tokenizer of engines/tiny.py), or from `--model DIR`, a
Hugging Face folder with that tokenizer (the demo's SFT model exported with `python -m trainer export`: from
there GRPO moves held-out accuracy within a few steps, so "accuracy no lower" is a comparison), train on the prompts of
[data].train (chat format) with the reward of [data].reward, for the same number of steps of
`rollout_batch_size` prompts x `n_samples_per_prompt` samples, at most `max_new_tokens` new tokens, at the run's
temperature, with the same learning rate, KL coefficient and seed. Ours runs `python -m trainer rl` on that config
(`trainer.run.run`, an embedded engine process, HTTP rollouts), once synchronous and once with async_rollout;
TRL generates with transformers' `generate` in its own process, as it does without vLLM. Each side runs in its
own subprocess; the peak RSS is sampled over the whole process tree (for ours: trainer + engine process).

Where TRL's defaults differ from ours they are set to ours (`trl_args`):
  loss aggregation  loss_type="grpo" (per-sequence token mean, then the mean over sequences) = our
                    loss_agg "seq-mean-token-mean" (TRL's default "dapo" is a global token mean)
  KL                beta = our kl_coef (TRL's default 0 loads no reference model); both use the k3 estimator
                    exp(ref - logp) - (ref - logp) - 1 added per token before aggregation (ours clamps it to
                    +-10, which these runs never reach), the reference being the frozen initial weights
  clipping          epsilon = clip_low, epsilon_high = clip_high (0.2 / 0.2), token-level ratios
                    (importance_sampling_level="token"), one update per batch (num_iterations=1, ppo_epochs=1):
                    on-policy, ratio 1 at the update for both
  advantages        scale_rewards="group": (r - group mean) / (unbiased group std + eps); TRL's eps is 1e-4,
                    ours 1e-6 (not configurable on either side; a relative difference < 3e-4 for 0/1 rewards in
                    groups of 8), 0 for groups whose rewards are all equal on both sides
  stop tokens       the model's generation_config.eos_token_id is set to our chat stop ids (<eos>, <|im_end|>),
                    so TRL stops and masks completions where our engine does (TRL's default is the tokenizer's
                    <eos> only, which the chat template never writes after an answer)
  optimiser         AdamW with our betas, eps, weight decay and gradient-norm clip; constant learning rate
                    (TRL's default schedule decays linearly to 0); fp32 (bf16=False), as our CPU trainer
  sampling          top_p = 1, top_k off, no repetition penalty on both sides; truncated completions stay in
                    the loss (mask_truncated_completions=False), as ours
Not matched (cannot be): the prompt order (each side shuffles the same prompt set with the same seed through its
own sampler) and the sampled tokens.

Reported per side: samples/s and seconds per step over the training loop (ours: generate + train + weight sync
from metrics.jsonl, where async mode's generate is the wait for the prefetched batch; TRL: the time between
consecutive optimizer steps, from a callback, generation included; its generation phase, which also scores
and computes the reference log-probs, timed around `_generate_and_score_completions`), the wall time of the
whole process (model build, engine start, evaluations), peak RSS, and greedy held-out accuracy on [data].eval
after the last step (ours: `trainer.cli.evaluate` through the engine; TRL: `hf_greedy_accuracy`, transformers'
greedy `generate` with the same prompt ids, stop ids, max_new_tokens and reward). Both also evaluate the initial
model: the two figures must be equal (same weights, same greedy decoding), a check that the evaluations agree.
Each run also keeps its training reward per step (`reward_per_step`: the batch's mean reward, TRL's logged
"reward"), and each side its mean over the second half of the steps (`reward_mean_second_half`): how well the
policy does on the training prompts as it samples, a steadier signal than one greedy evaluation of 200 problems.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python bench/bench_rl_vs_trl.py`: the repository root on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _proc import run_with_peak_rss  # noqa: E402  (bench/ is on the path: script or pytest)

ROOT = Path(__file__).resolve().parent.parent
SIDES = ("trl", "ours-sync", "ours-sync-http", "ours-async", "ours-async-http", "ours-sync-disaggregated",
         "ours-async-disaggregated")
# Our sides: (async_rollout, engines.in_process). None keeps the config's choice (the demo: one in-process engine);
# "ours-sync-http" / "ours-async-http" run the same work through the embedded engine as its own process behind
# HTTP (on the shared cores; --rollout-worker picks where the client side runs). The
# "-disaggregated" sides give the engine process and the trainer their own cores (`disaggregated_overrides`: config
# only; --engine-cpus / --trainer-cpus, cores 0 and 1 by default), a stand-in for engines and trainer on separate
# GPUs; their async side runs [rl] max_staleness (--max-staleness) steps ahead.
OURS = {"ours-sync": (False, None), "ours-sync-http": (False, False), "ours-async": (True, None),
        "ours-async-http": (True, False),
        "ours-sync-disaggregated": (False, False), "ours-async-disaggregated": (True, False)}


def disaggregated_overrides(engine_cpus: tuple[int, ...], trainer_cpus: tuple[int, ...]) -> tuple[str, ...]:
    """The --set overrides that pin the engine process (and the rollout client beside it) to `engine_cpus` and the
    trainer to `trainer_cpus`."""
    assert engine_cpus and trainer_cpus and not set(engine_cpus) & set(trainer_cpus), (engine_cpus, trainer_cpus)
    eng = ", ".join(map(str, engine_cpus))
    return (f"engines.fleet=[{{kind = \"embedded\", cpus = [{eng}]}}]",
            f"trainer.cpus=[{', '.join(map(str, trainer_cpus))}]", f"trainer.rollout_cpus=[{eng}]")


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """The GRPO work both sides do; everything else comes from `config` (the demo's run config)."""

    config: str = str(ROOT / "configs" / "demo.toml")
    steps: int = 5
    prompts_per_step: int = 64
    group_size: int = 8
    max_new_tokens: int = 6
    temperature: float = 1.0
    lr: float | None = None  # None: the config's [rl.optim] lr (the demo's 3e-4)
    beta: float = 0.001
    seed: int = 0
    eval_limit: int = 0  # 0: the whole [data].eval set
    model: str = ""  # a Hugging Face folder both sides start from ([model].path); "": the config's model
    max_staleness: int = 1  # ours, async: [rl] max_staleness (generation runs this many steps ahead)
    update_in_flight: bool = False  # ours, async: [rl] update_in_flight (syncs land while a batch generates)
    rollout_worker: str = "thread"  # ours, async, engines behind HTTP: [rl] rollout_worker ("thread" | "process")
    engine_cpus: tuple[int, ...] = (0,)  # the "-disaggregated" sides: the engine process's cores
    trainer_cpus: tuple[int, ...] = (1,)  # ... and the trainer's

    def __post_init__(self) -> None:
        for name in ("steps", "prompts_per_step", "group_size", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"BenchConfig.{name} = {getattr(self, name)}: must be >= 1")
        if self.group_size < 2:
            raise ValueError(f"BenchConfig.group_size = {self.group_size}: GRPO needs >= 2 samples per prompt")
        if self.eval_limit < 0:
            raise ValueError(f"BenchConfig.eval_limit = {self.eval_limit}: must be >= 0 (0 = the whole eval set)")


def run_config(bc: BenchConfig, output_dir: str | Path, *, async_rollout: bool = False,
               in_process: bool | None = None, disaggregated: bool = False) -> Any:
    """The demo's run config (a trainer.config.RunConfig) with the bench's GRPO work set through --set overrides
    (validated like the CLI)."""
    from trainer.cli import load_run_config

    over = [f"output_dir={json.dumps(str(output_dir))}", f"seed={bc.seed}", f"rl.num_steps={bc.steps}",
            f"rl.async_rollout={'true' if async_rollout else 'false'}",
            f"rl.rollout.rollout_batch_size={bc.prompts_per_step}",
            f"rl.rollout.n_samples_per_prompt={bc.group_size}", f"rl.rollout.max_new_tokens={bc.max_new_tokens}",
            f"rl.rollout.temperature={bc.temperature}", f"rl.loss.kl_coef={bc.beta}",
            f"eval.max_new_tokens={bc.max_new_tokens}"]
    if bc.lr is not None:
        over.append(f"rl.optim.lr={bc.lr}")
    if bc.eval_limit:
        over.append(f"eval.limit={bc.eval_limit}")
    if in_process is not None:
        over.append(f"engines.in_process={'true' if in_process else 'false'}")
    if bc.model:
        over.append(f"model.path={json.dumps(str(Path(bc.model).resolve()))}")
    if async_rollout:
        over += [f"rl.max_staleness={bc.max_staleness}",
                 f"rl.update_in_flight={'true' if bc.update_in_flight else 'false'}"]
    if in_process is False and async_rollout:  # engines behind HTTP: the client side may run in its own process
        over.append(f"rl.rollout_worker={json.dumps(bc.rollout_worker)}")  # (synchronous: in the step's thread)
    if disaggregated:
        over.extend(disaggregated_overrides(tuple(bc.engine_cpus), tuple(bc.trainer_cpus)))
    return load_run_config(bc.config, over, mode="rl")


def loop_figures(step_seconds: list[float], samples_per_step: list[float]) -> dict[str, float]:
    """samples/s over the whole loop, median seconds per step."""
    total = sum(step_seconds)
    return {"samples_per_s": sum(samples_per_step) / total if total > 0 else 0.0,
            "s_per_step": statistics.median(step_seconds) if step_seconds else 0.0,
            "loop_s": total, "samples": sum(samples_per_step)}


# ----------------------------------------------------------------------------------------------- ours
def run_ours(bc: BenchConfig, out: Path, *, async_rollout: bool, in_process: bool | None = None,
             disaggregated: bool = False) -> dict[str, Any]:
    """`python -m trainer rl` on the bench config; figures from its summary and metrics.jsonl."""
    from engines.registry import engine_kind
    from trainer.cli import run
    from trainer.metrics import read_jsonl

    cfg = run_config(bc, out, async_rollout=async_rollout, in_process=in_process, disaggregated=disaggregated)
    t0 = time.perf_counter()
    summary = run("rl", cfg)
    wall = time.perf_counter() - t0
    rows = [r for r in read_jsonl(out / "rl" / "metrics.jsonl") if "loss" in r]  # not the step-0 evaluation
    # One step = its wall time up to its weights landing on the engines (time_step_s): the wait for its batch, the
    # training, and the sync after it with any wait for the batch being generated (async: the sync lands between
    # two batches). The parts are reported beside it.
    parts = {k: [float(r.get(k, 0.0)) for r in rows] for k in ("time_generate_s", "time_train_s", "time_sync_s")}
    steps = [float(r["time_step_s"]) for r in rows]
    res = loop_figures(steps, [float(r["num_samples"]) for r in rows])
    res.update(wall_s=wall, steps=len(rows), accuracy=summary.get("accuracy_after_rl"),
               trainer_cpus=sorted(os.sched_getaffinity(0)), max_staleness=cfg.rl.max_staleness,
               staleness_mean=statistics.mean(float(r["staleness/mean"]) for r in rows) if rows else 0.0,
               in_process=any(engine_kind(spec).in_process for spec in cfg.engines.fleet),
               accuracy_initial=summary.get("accuracy_before_rl"),
               reward_mean_last=rows[-1].get("reward_mean") if rows else None,
               reward_per_step=[round(float(r["reward_mean"]), 4) for r in rows],
               generate_s_per_step=[round(x, 3) for x in parts["time_generate_s"]],
               train_s_per_step=[round(x, 3) for x in parts["time_train_s"]],
               sync_s_per_step=[round(x, 3) for x in parts["time_sync_s"]],
               response_length_mean=statistics.mean(float(r["response_length_mean"]) for r in rows) if rows else 0)
    return res


# ----------------------------------------------------------------------------------------------- TRL
def trl_args(bc: BenchConfig, cfg: Any, output_dir: str | Path) -> Any:
    """TRL's GRPOConfig for the same work, with every default that differs from ours set to ours (module doc)."""
    from trl import GRPOConfig

    from trainer.cli import phase_configs

    rl = phase_configs(cfg).rl
    loss, optim = rl.loss, rl.optim
    unmatched = {"loss.objective": (loss.objective, "ppo"), "loss.loss_agg": (loss.loss_agg, "seq-mean-token-mean"),
                 "loss.kl_type": (loss.kl_type, "k3"), "advantage_estimator": (rl.advantage_estimator, "grpo"),
                 "ppo_epochs": (rl.ppo_epochs, 1), "loss.entropy_coef": (loss.entropy_coef, 0.0),
                 "optim.warmup_steps": (optim.warmup_steps, 0), "optim.min_lr_ratio": (optim.min_lr_ratio, 1.0)}
    for key, (got, want) in unmatched.items():
        if got != want:
            raise ValueError(f"[rl] {key} = {got!r}: the TRL side mirrors only {want!r}; set it in {bc.config}")
    n = bc.prompts_per_step * bc.group_size
    return GRPOConfig(
        output_dir=str(output_dir), max_steps=bc.steps, seed=bc.seed, data_seed=bc.seed, use_cpu=True,
        per_device_train_batch_size=n, gradient_accumulation_steps=1, num_generations=bc.group_size,
        max_completion_length=bc.max_new_tokens, temperature=bc.temperature, top_p=1.0, top_k=0,
        repetition_penalty=1.0, loss_type="grpo", scale_rewards="group", importance_sampling_level="token",
        beta=loss.kl_coef, epsilon=loss.clip_low, epsilon_high=loss.clip_high, num_iterations=1,
        mask_truncated_completions=False, learning_rate=optim.lr, lr_scheduler_type="constant",
        adam_beta1=optim.betas[0], adam_beta2=optim.betas[1], adam_epsilon=optim.eps,
        weight_decay=optim.weight_decay, max_grad_norm=optim.max_grad_norm, bf16=False, fp16=False,
        disable_dropout=True, report_to="none", logging_steps=1, save_strategy="no", log_completions=False,
        dataloader_num_workers=0)


def _stop_ids(tokenizer: Any) -> list[int]:
    from trainer.rollout.samples import stop_token_ids

    return sorted(stop_token_ids(tokenizer, chat=True))


def hf_greedy_accuracy(model: Any, tokenizer: Any, prompts: list[Any], *, max_new_tokens: int, reward: str,
                       batch_size: int = 256) -> float:
    """Greedy accuracy with transformers' generate: the prompt ids, stop ids and reward of `trainer.cli.evaluate`."""
    import torch

    from trainer.rewards.rules import compute_rewards, load_reward_fn
    from trainer.rollout.samples import prompt_token_ids
    from trainer.types import Sample, Status

    stops, pad = _stop_ids(tokenizer), tokenizer.pad_token_id
    samples = []
    model.eval()
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        ids = [prompt_token_ids(tokenizer, p.prompt, chat=True, system=p.system) for p in chunk]
        width = max(map(len, ids))
        # Left padding [B, width]: every row's answer starts at the same column.
        input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
        with torch.no_grad():
            out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=stops, pad_token_id=pad)
        for p, prompt_ids, row in zip(chunk, ids, out[:, width:].tolist()):
            cut = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))  # keep the stop token
            resp = row[:cut]
            samples.append(Sample(prompt=p.prompt, tokens=tuple(prompt_ids) + tuple(resp),
                                  response=tokenizer.decode(resp), response_length=len(resp),
                                  metadata={**p.metadata, "answer": p.answer}, status=Status.COMPLETED))
    scored, _ = compute_rewards(samples, load_reward_fn(reward))
    return sum(s.reward or 0.0 for s in scored) / max(len(scored), 1)


def trl_reward_fn(reward: str):
    """Our reward function in TRL's calling convention: (prompts, completions, answer=[...]) -> [float]."""
    from trainer.rewards.rules import compute_rewards, load_reward_fn
    from trainer.types import Sample, Status

    fn = load_reward_fn(reward)

    def arithmetic(prompts, completions, answer, **_):
        samples = [Sample(prompt=str(p), tokens=(), response=c[0]["content"] if isinstance(c, list) else c,
                          metadata={"answer": a}, status=Status.COMPLETED)
                   for p, c, a in zip(prompts, completions, answer)]
        scored, _ = compute_rewards(samples, fn)
        return [s.reward or 0.0 for s in scored]

    arithmetic.__name__ = reward.rsplit(":", 1)[-1]
    return arithmetic


def run_trl(bc: BenchConfig, out: Path) -> dict[str, Any]:
    """TRL's GRPOTrainer on the same model folder, prompts, reward and hyper-parameters."""
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback

    from engines.tokenizer import load_tokenizer
    from trainer.cli import prepare_model_folder
    from trainer.data.buffer import config_prompts

    t0 = time.perf_counter()
    cfg = run_config(bc, out)
    data = cfg.data
    if data.format != "chat":
        raise ValueError(f"{bc.config}: [data].format = {data.format!r}; the TRL side runs chat prompts only")
    reward = data.reward
    folder = prepare_model_folder(cfg)
    tokenizer = load_tokenizer(folder)  # the tokenizer our CLI uses for this folder
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.generation_config.eos_token_id = _stop_ids(tokenizer)
    train = config_prompts(data.train, data.mapping(), where="[data].train", seed=cfg.seed)
    evals = config_prompts(data.eval, data.mapping(), where="[data].eval")[: bc.eval_limit or None]
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": p.prompt}], "answer": str(p.answer)}
                            for p in train])
    acc_initial = hf_greedy_accuracy(model, tokenizer, evals, max_new_tokens=bc.max_new_tokens, reward=reward)

    class StepTimes(TrainerCallback):
        """Seconds between consecutive optimizer steps (the first from the start of training)."""

        def __init__(self) -> None:
            self.seconds: list[float] = []
            self._last = 0.0

        def on_train_begin(self, *a, **k):
            self._last = time.perf_counter()

        def on_step_end(self, *a, **k):
            now = time.perf_counter()
            self.seconds.append(now - self._last)
            self._last = now

    times = StepTimes()
    trainer = trl.GRPOTrainer(model=model, reward_funcs=trl_reward_fn(reward), args=trl_args(bc, cfg, out / "trl"),
                              train_dataset=ds, processing_class=tokenizer, callbacks=[times])
    # TRL's generation phase per step: sampling, rewards, advantages and the reference model's log-probs.
    gen_seconds: list[float] = []
    generate_and_score = trainer._generate_and_score_completions

    def timed_generate_and_score(*a, **k):
        t = time.perf_counter()
        out = generate_and_score(*a, **k)
        gen_seconds.append(time.perf_counter() - t)
        return out

    trainer._generate_and_score_completions = timed_generate_and_score
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    acc = hf_greedy_accuracy(trainer.model, tokenizer, evals, max_new_tokens=bc.max_new_tokens, reward=reward)
    n = bc.prompts_per_step * bc.group_size
    res = loop_figures(times.seconds, [n] * len(times.seconds))
    res.update(wall_s=time.perf_counter() - t0, steps=len(times.seconds), accuracy=acc, accuracy_initial=acc_initial,
               reward_mean_last=logs[-1]["reward"] if logs else None,
               reward_per_step=[round(float(h["reward"]), 4) for h in logs],
               step_s=[round(x, 3) for x in times.seconds],
               generate_score_s_per_step=[round(x, 3) for x in gen_seconds],
               optim=str(trainer.args.optim), trl_version=trl.__version__)
    return res


# ----------------------------------------------------------------------------------------------- driver
def measure(side: str, bc: BenchConfig, workdir: Path, *, timeout_s: float = 3600.0) -> dict[str, Any]:
    """Run one side in a fresh subprocess; its result plus the peak RSS of its process tree (sampled at 5 Hz)."""
    if side not in SIDES:
        raise ValueError(f"side={side!r}: choose one of {SIDES}")
    out = workdir / side
    out.mkdir(parents=True, exist_ok=True)
    result = out / "result.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", side, "--worker-out", str(out),
           "--bench-config", json.dumps(dataclasses.asdict(bc))]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    rc, peak = run_with_peak_rss(cmd, log=out / "worker.log", timeout_s=timeout_s, cwd=ROOT, env=env)
    if rc != 0 or not result.is_file():
        tail = (out / "worker.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"bench side {side!r} exited with code {rc}; the end of {out / 'worker.log'}:\n{tail}")
    return {**json.loads(result.read_text()), "peak_rss_mb": peak / 2**20}


def machine_info() -> dict[str, Any]:
    import torch
    import transformers

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {"cpus": os.cpu_count(), "torch": torch.__version__, "transformers": transformers.__version__,
            "commit": commit, "load_1_5_15": [round(x, 2) for x in os.getloadavg()]}


def second_half_reward(run: dict[str, Any]) -> float | None:
    """The mean training reward over the second half of a run's steps (11-20 of 20): how well the policy samples
    on the training prompts, a steadier learning signal than one greedy evaluation of 200 held-out problems."""
    r = run.get("reward_per_step") or []
    return statistics.mean(r[len(r) // 2:]) if r else None


def _mean_of_known(values: Any) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.mean(known) if known else None


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One side over several seeds: samples/s over all their loops, mean accuracy, each seed's figures kept."""
    for r in runs:
        r["reward_mean_second_half"] = second_half_reward(r)
    if len(runs) == 1:
        return runs[0]
    loop = sum(r["loop_s"] for r in runs)
    samples = sum(r["samples"] for r in runs)
    return {"samples_per_s": samples / loop if loop > 0 else 0.0,
            "s_per_step": statistics.median(r["s_per_step"] for r in runs), "loop_s": loop, "samples": samples,
            "wall_s": sum(r["wall_s"] for r in runs), "peak_rss_mb": max(r["peak_rss_mb"] for r in runs),
            "accuracy": statistics.mean(r["accuracy"] for r in runs),
            "accuracy_initial": statistics.mean(r["accuracy_initial"] for r in runs),
            "accuracy_per_seed": [r["accuracy"] for r in runs],
            "reward_mean_second_half": _mean_of_known(r["reward_mean_second_half"] for r in runs),
            "reward_second_half_per_seed": [r["reward_mean_second_half"] for r in runs],
            "samples_per_s_per_seed": [r["samples_per_s"] for r in runs], "per_seed": runs}


def compare(bc: BenchConfig, sides: tuple[str, ...] = SIDES, workdir: Path | None = None,
            seeds: int = 1) -> dict[str, Any]:
    """Every side in turn (TRL first), for seeds bc.seed ... bc.seed + seeds - 1 (the sides interleaved within each
    seed, so a slow spell of the machine hits all of them); one JSON-able object with the headline keys and each
    side's figures (aggregate)."""
    with tempfile.TemporaryDirectory(prefix="rl_vs_trl_") as tmp:
        work = Path(workdir or tmp)
        before = machine_info()
        runs: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
        for k in range(seeds):
            seeded = dataclasses.replace(bc, seed=bc.seed + k)
            for side in sides:
                runs[side].append(measure(side, seeded, work / f"seed{seeded.seed}" if seeds > 1 else work))
        res = {side: aggregate(r) for side, r in runs.items()}
    out: dict[str, Any] = {"bench": {**dataclasses.asdict(bc), "seeds": seeds}, "machine": before,
                           "load_1_5_15_after": [round(x, 2) for x in os.getloadavg()]}
    if "trl" in res:
        out.update(trl_samples_per_s=res["trl"]["samples_per_s"], trl_accuracy=res["trl"]["accuracy"])
    for side in OURS:
        r = res.get(side)
        if r is None:
            continue
        mode = side.removeprefix("ours-").replace("-", "_")
        out[f"ours_{mode}_samples_per_s"], out[f"ours_{mode}_accuracy"] = r["samples_per_s"], r["accuracy"]
        if "trl" in res and res["trl"]["samples_per_s"] > 0:
            out[f"ratio_{mode}"] = r["samples_per_s"] / res["trl"]["samples_per_s"]
    return with_default_side(out, res)


def emit(result: dict[str, Any], out: str | None, as_json: bool, table_of) -> None:
    """A comparison's JSON to `out` (if given), and to stdout the JSON or `table_of(result)`."""
    text = json.dumps(result, indent=2)
    if out:
        Path(out).write_text(text + "\n")
    print(text if as_json else table_of(result), flush=True)


def with_default_side(out: dict[str, Any], res: dict[str, Any]) -> dict[str, Any]:
    """`out` with the headline side's figures (the demo config's default mode: synchronous, its one in-process
    engine; else the first of ours) and every side's under "sides"."""
    default = "ours-sync" if "ours-sync" in res else next((s for s in res if s.startswith("ours")), None)
    if default is not None:
        out.update(ours_mode=default.removeprefix("ours-"), ours_samples_per_s=res[default]["samples_per_s"],
                   ours_accuracy=res[default]["accuracy"])
    out["sides"] = res
    return out


def table(result: dict[str, Any]) -> str:
    rows = ["| side | samples/s | s/step (median) | loop s | wall s | peak RSS MB | accuracy (initial) |",
            "|---|---|---|---|---|---|---|"]
    for side, r in result["sides"].items():
        rows.append(f"| {side} | {r['samples_per_s']:.1f} | {r['s_per_step']:.2f} | {r['loop_s']:.1f} | "
                    f"{r['wall_s']:.1f} | {r['peak_rss_mb']:.0f} | {r['accuracy']:.3f} ({r['accuracy_initial']:.3f}) |")
    for side in OURS:
        mode = side.removeprefix("ours-").replace("-", "_")
        if f"ratio_{mode}" in result:
            rows.append(f"\n{side} / TRL samples/s: {result[f'ratio_{mode}']:.2f}x")
    for side, r in result["sides"].items():
        if "generate_score_s_per_step" in r:
            rows.append(f"{side}: generate + score + ref log-probs s/step {r['generate_score_s_per_step']}, "
                        f"whole step s {r['step_s']}")
        if "generate_s_per_step" in r:
            rows.append(f"{side}: generate s/step {r['generate_s_per_step']}, train s/step {r['train_s_per_step']}, "
                        f"sync s/step {r['sync_s_per_step']}")
    return "\n".join(rows)


def cpu_list(text: str) -> tuple[int, ...]:
    """"0,8" -> (0, 8)."""
    return tuple(int(c) for c in text.split(",") if c.strip())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=BenchConfig.steps)
    ap.add_argument("--prompts-per-step", type=int, default=BenchConfig.prompts_per_step)
    ap.add_argument("--group-size", type=int, default=BenchConfig.group_size)
    ap.add_argument("--eval-limit", type=int, default=0, help="held-out prompts to evaluate (0: all)")
    ap.add_argument("--seeds", type=int, default=1, help="run every side with seeds 0 .. N-1 (accuracy: the mean)")
    ap.add_argument("--model", default="", help="a Hugging Face folder both sides start from, e.g. the demo's SFT "
                    "model from `python -m trainer export` (default: the config's random initial model)")
    ap.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated subset of {SIDES}")
    ap.add_argument("--max-staleness", type=int, default=1, help="our async sides' [rl] max_staleness (steps ahead)")
    ap.add_argument("--update-in-flight", action="store_true", help="our async sides: [rl] update_in_flight")
    ap.add_argument("--rollout-worker", choices=("thread", "process"), default="thread",
                    help="our async sides with engines behind HTTP: [rl] rollout_worker")
    ap.add_argument("--engine-cpus", default="0", help="the disaggregated sides: the engine's cores, e.g. 0 or 0,8")
    ap.add_argument("--trainer-cpus", default="1", help="the disaggregated sides: the trainer's cores")
    ap.add_argument("--json", action="store_true", help="print one JSON object (default: a readable table)")
    ap.add_argument("--out", default=None, help="also write the JSON object to this file")
    ap.add_argument("--workdir", default=None, help="keep each side's outputs (logs, metrics.jsonl) here")
    ap.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    ap.add_argument("--bench-config", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        bc = BenchConfig(**json.loads(args.bench_config))
        out = Path(args.worker_out)
        if args.worker == "trl":
            res = run_trl(bc, out)
        else:
            async_rollout, in_process = OURS[args.worker]
            res = run_ours(bc, out, async_rollout=async_rollout, in_process=in_process,
                           disaggregated=args.worker.endswith("-disaggregated"))
        (out / "result.json").write_text(json.dumps(res))
        return
    bc = BenchConfig(steps=args.steps, prompts_per_step=args.prompts_per_step, group_size=args.group_size,
                     eval_limit=args.eval_limit, model=args.model, max_staleness=args.max_staleness,
                     update_in_flight=args.update_in_flight, rollout_worker=args.rollout_worker,
                     engine_cpus=cpu_list(args.engine_cpus), trainer_cpus=cpu_list(args.trainer_cpus))
    if not bc.engine_cpus or not bc.trainer_cpus or set(bc.engine_cpus) & set(bc.trainer_cpus):
        ap.error(f"--engine-cpus {args.engine_cpus} --trainer-cpus {args.trainer_cpus}: give each side at least one "
                 f"core, and no core to both")
    sides = tuple(s.strip() for s in args.sides.split(",") if s.strip())
    if args.seeds < 1:
        ap.error("--seeds must be >= 1")
    result = compare(bc, sides, Path(args.workdir) if args.workdir else None, seeds=args.seeds)
    emit(result, args.out, args.json, table)


if __name__ == "__main__":
    main()
