"""Debugging without the other half: train on rollouts written out earlier (no engine), or generate rollouts
without training (no trainer).

    python -m trainer generate --config configs/demo.toml --set rl.num_steps=3   # -> <output_dir>/rollouts/
    python -m trainer replay --config configs/demo.toml --rollouts runs/demo/rl/rollouts \
        --checkpoint runs/demo/rl/checkpoints/step_00000024

Replay trains each step file (trainer.rollout.dumps) in step order with the RL step function the run uses
(`trainer.rl.train_on_batch`: the same advantages, packing, loss and optimizer step), from `--checkpoint` (its
weights, optimizer, schedule and step) or from the weights the RL phase started from: the SFT phase's last
checkpoint when the run has one, else the start model. Those are also the KL term's reference and, with [rl.lora],
the frozen base the checkpoint's adapters are loaded onto. The step of the
file after the checkpoint's reproduces the logged step's loss and gradient norm (tests/test_evaluation.py).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainer.config import RunConfig


def replay(cfg: RunConfig, model_folder: Path, rollouts: str | Path, *, checkpoint: str | None = None,
           tokenizer: Any) -> list[dict[str, float]]:
    """Train on every step file under `rollouts` whose step is past the checkpoint's, in order; returns each
    step's metrics (also written to <output_dir>/replay/metrics.jsonl, the original's beside them when the run's
    rl/metrics.jsonl has that step)."""
    from trainer.backend.checkpoint import load_checkpoint, step_folders
    from trainer.backend.memory import release_phase_memory
    from trainer.backend.steps import TrainerConfig, build_components
    from trainer.metrics import JSONLLogger, read_jsonl
    from trainer.rl import _reference_components, local_backend, train_on_batch
    from trainer.rollout.dumps import read_rollouts, rollout_files
    from trainer.rollout.samples import pad_token_id
    from trainer.types import TrainingState

    rl_cfg, tcfg = cfg.rl, TrainerConfig(phase=cfg.rl, backend=cfg.trainer)  # what trainer.run.phase_configs gives
    sft_dir = Path(cfg.output_dir) / "sft"
    # The RL phase's starting weights, built as trainer.run does: SFT's last checkpoint when the run has one (its
    # newest intact one; a damaged newer one: a warning, or the error), else the start model. A LoRA RL checkpoint
    # holds the adapters alone, so with [rl.lora] this is also the frozen base they are loaded onto.
    start: Any = str(model_folder)
    if step_folders(sft_dir):
        sft = build_components(str(model_folder), TrainerConfig(phase=cfg.sft, backend=cfg.trainer))
        load_checkpoint(sft, sft_dir)
        release_phase_memory(sft)  # SFT's AdamW state is not RL's
        start = sft.root
    comp = build_components(start, tcfg)
    # The KL reference, taken before a checkpoint loads: a frozen copy of the starting weights (LoRA: the policy
    # itself with its adapters off), as trainer.rl makes it.
    ref = _reference_components(comp, tcfg) if rl_cfg.loss.kl_coef > 0 else None
    state = TrainingState()
    if checkpoint is not None:
        if not Path(checkpoint).exists():
            raise FileNotFoundError(f"--checkpoint {checkpoint}: does not exist (give a step_NNNNNNNN folder or a "
                                    f"phase's output_dir such as runs/<name>/rl)")
        state, _ = load_checkpoint(comp, checkpoint)  # verified; a crafted pickle in it runs nothing
    logged = Path(rl_cfg.output_dir) / "metrics.jsonl"
    original = {r["step"]: r for r in read_jsonl(logged) if "loss" in r} if logged.is_file() else {}
    out_dir = Path(cfg.output_dir) / "replay"
    history = []
    logger = JSONLLogger(out_dir / "metrics.jsonl", enabled=comp.rank == 0, keep_through=0)
    backend = local_backend(comp, rl_cfg, tcfg, pad_id=pad_token_id(tokenizer), ref=ref)
    try:
        for path in rollout_files(rollouts):
            step, batch = read_rollouts(path)
            if step <= state.step:
                continue
            metrics, state = train_on_batch(backend, state, batch, rl_cfg)
            was = original.get(step, {})
            metrics.update({f"original/{k}": was[k] for k in ("loss", "grad_norm") if k in was})
            logger.log(step, metrics)
            history.append({"step": step, **metrics})
            if comp.rank == 0:
                then = "".join(f", logged {k} {was[k]:.6g}" for k in ("loss", "grad_norm") if k in was)
                print(f"replay step {step} ({path.name}): loss {metrics['loss']:.6g}, grad_norm "
                      f"{metrics['grad_norm']:.6g}{then}", flush=True)
    finally:
        logger.close()
    return history


def generate(cfg: RunConfig, engines: Sequence[Any], *, tokenizer: Any, folder: Path) -> list[Path]:
    """[rl] num_steps rollout batches from the engines as they are (no trainer, no weight sync), each scored,
    given its advantages and written to folder/step_N.jsonl like a training run's dumps."""
    from trainer.data.buffer import config_buffer
    from trainer.rewards.sources import build_reward_sources, scored_batches
    from trainer.rl import compute_advantages, trained_samples
    from trainer.rollout.dumps import rollout_rows, write_rollouts
    from trainer.rollout.manager import AsyncRolloutManager, generate_rollout_batches

    data, rl_cfg = cfg.data, cfg.rl
    # The run's reward as training builds it: [rewards] sources, or [data].reward alone (neither: the episodes'
    # environment or rollout_fn gives each reward; the CLI checked there is one). No trainer: reward models on CPU.
    rewards = build_reward_sources(cfg.rewards, default_rule=data.reward, engines=engines, tokenizer=tokenizer,
                                   timeout_s=data.reward_timeout_s)
    manager = AsyncRolloutManager(engines, rl_cfg.rollout, tokenizer=tokenizer, reward_fn=rewards.rollout_reward(),
                                  deterministic=rl_cfg.deterministic)
    buffer = config_buffer(data.train, data.mapping(), where="[data].train", seed=cfg.seed)
    written = []
    batches = scored_batches(generate_rollout_batches(buffer, rl_cfg.rollout, manager=manager,
                                                      num_batches=rl_cfg.num_steps), rewards)
    for step, batch in enumerate(batches, start=1):
        keep, _ = trained_samples(batch.samples, rl_cfg.advantage_estimator,
                                  mask_truncated=rl_cfg.rollout.mask_truncated)
        rows = rollout_rows(batch, step=step, advantages=compute_advantages(batch.samples, rl_cfg.advantage_estimator),
                            trained=[i in set(keep) for i in range(len(batch))], trainer_logprobs=None,
                            tokenizer=tokenizer)
        written.append(write_rollouts(folder / f"step_{step:06d}.jsonl", rows))
        rewards = [r["reward"] for r in rows if r["reward"] is not None]
        print(f"generate step {step}: {len(rows)} samples, mean reward "
              f"{sum(rewards) / max(len(rewards), 1):.3f} -> {written[-1]}", flush=True)
    (folder / "config.json").write_text(json.dumps({"name": cfg.name, "num_steps": rl_cfg.num_steps}) + "\n")
    return written
