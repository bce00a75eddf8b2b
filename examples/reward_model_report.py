"""What a reward model makes of a run's policy: its greedy held-out answers after SFT and after RL, each checked by
the rule and scored by the reward model, plus the run's own figures. The check behind configs/rm_demo.toml's numbers.

    python examples/reward_model_report.py runs/rm_demo_s0 runs/rm_demo_s1 --rm runs/rm_arithmetic \\
        --out bench/results/rm_demo_seeds-cpu-2core.json

For each run folder (written by `python -m trainer demo --config configs/rm_demo.toml`): summary.json's held-out
accuracies; from rl/metrics.jsonl the first and last 10 steps' mean of the reward model's score
(reward/model0_mean) and of the rule's reward on the same rollouts (reward/arithmetic_mean: rm_demo's weight-0
monitor); and for the newest SFT and RL checkpoints (exported to <run>/report/), the policy's greedy answer to every
prompt of [data].eval, with the rule's verdict and the reward model's score: how often the reward model agrees with
the rule on the policy's own answers, and how many wrong answers it scores as right (score > 0).
"""

import argparse
import json
import statistics
from pathlib import Path


def run_figures(run: Path) -> dict:
    summary = json.loads((run / "summary.json").read_text())
    rows = [json.loads(line) for line in (run / "rl/metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "reward/model0_mean" in r]  # the training steps (not the step-0 evaluation row)
    out = {k: summary.get(k) for k in ("accuracy_after_sft", "accuracy_after_rl", "wall_seconds", "rl_steps")}
    out["gain_points"] = round((summary["accuracy_after_rl"] - summary["accuracy_after_sft"]) * 100, 1)
    for key, name in (("reward/model0_mean", "rm_score"), ("reward/arithmetic_mean", "rule_reward")):
        if rows and key in rows[0]:
            out[f"train_{name}_first10"] = round(statistics.fmean(r[key] for r in rows[:10]), 4)
            out[f"train_{name}_last10"] = round(statistics.fmean(r[key] for r in rows[-10:]), 4)
    return out


def policy_answers(run: Path, phase: str, scorer) -> dict:
    """Greedy answers of the phase's newest checkpoint on [data].eval, checked by the rule and the reward model."""
    from engines.local import LocalEngine
    from trainer.backend.checkpoint import latest_checkpoint
    from trainer.backend.export import export_checkpoint
    from trainer.cli import load_run_config, model_tokenizer
    from trainer.data.buffer import config_prompts
    from trainer.evaluation import evaluate
    from trainer.rewards.rules import arithmetic_reward

    cfg = load_run_config(run / "config.toml")
    folder = export_checkpoint(str(latest_checkpoint(run / phase)), run / "init_model", run / "report" / phase)
    tokenizer = model_tokenizer(folder)
    prompts = config_prompts(cfg.data.eval, cfg.data.mapping(), where="[data].eval", seed=cfg.seed)
    seen = []

    def judge(sample):  # the rule's verdict (what evaluation reports), and the reward model's score beside it
        right = arithmetic_reward(sample)
        seen.append((right, scorer([sample])[0], sample.response))
        return right

    engine = LocalEngine(str(folder), seed=cfg.seed)
    try:
        got = evaluate([engine], prompts, tokenizer=tokenizer, reward_fn=judge,
                       max_new_tokens=cfg.eval.max_new_tokens or cfg.rl.rollout.max_new_tokens)
    finally:
        engine.close()
    wrong = [s for r, s, _ in seen if r < 1]
    right = [s for r, s, _ in seen if r >= 1]
    return {"accuracy": got["accuracy"], "n": len(seen),
            "rm_agrees_with_rule": sum((s > 0) == (r >= 1) for r, s, _ in seen) / len(seen),
            "rm_right_answers_scored_right": sum(s > 0 for s in right) / max(len(right), 1),
            "rm_wrong_answers_scored_right": sum(s > 0 for s in wrong) / max(len(wrong), 1),
            "rm_score_mean_right": round(statistics.fmean(right), 4) if right else None,
            "rm_score_mean_wrong": round(statistics.fmean(wrong), 4) if wrong else None,
            "distinct_wrong_answers": len({a for r, _, a in seen if r < 1})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="run folders (output_dir of rm_demo runs)")
    ap.add_argument("--rm", default="runs/rm_arithmetic", help="the reward model's folder")
    ap.add_argument("--out", default=None, help="write the figures to this JSON file")
    args = ap.parse_args()
    import torch

    from trainer.rewards.model import RewardModelScorer

    torch.set_num_threads(1)
    scorer = RewardModelScorer.from_pretrained(args.rm)
    report = []
    for run in map(Path, args.runs):
        entry = {"run": str(run), **run_figures(run)}
        for phase in ("sft", "rl"):
            entry[f"policy_after_{phase}"] = policy_answers(run, phase, scorer)
        print(json.dumps(entry, indent=1), flush=True)
        report.append(entry)
    if args.out:
        Path(args.out).write_text(json.dumps({"runs": report}, indent=1) + "\n")


if __name__ == "__main__":
    main()
