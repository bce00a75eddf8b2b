"""A GRPO loop written by hand on the step functions: generate -> reward -> advantages -> micro-batches ->
forward_backward -> optim_step -> sync, with a tiny random model and an engine inside this process (CPU is enough).

    python examples/custom_loop.py --steps 3 --out runs/custom_loop

Each step prints its mean reward, its loss and the weight version the engine serves after the sync (= the step).
The model is random, so arithmetic answers are right only by chance: the reward (and with it the GRPO loss) is
mostly 0 here; start from a fine-tuned model (`--model FOLDER`) to see it move. trainer.rl.run_rl_training is this
loop plus what a real run needs (async rollouts, PPO epochs, metrics, checkpoints); examples/run_rl.py calls it.
"""

import argparse
from pathlib import Path

import trio

from engines.embedded.presets import build_tiny_model
from engines.registry import EngineSpec, build_engine
from engines.tiny import build_tokenizer
from engines.tokenizer import load_tokenizer
from trainer.backend.steps import build_components, forward_backward, optim_step, trainer_config_from
from trainer.batching.micro_batches import build_micro_batches
from trainer.config import OptimConfig, RLTrainingConfig, RolloutConfig
from trainer.data.buffer import DataBuffer
from trainer.rewards.rules import arithmetic_reward, compute_rewards
from trainer.rl import compute_advantages, trained_samples
from trainer.rollout.manager import AsyncRolloutManager, generate_rollout_batches
from trainer.rollout.samples import pad_token_id
from trainer.types import TrainingState
from trainer.weight_sync import WeightSyncSender

DATA = Path(__file__).resolve().parents[1] / "data" / "arithmetic_train.jsonl"


def tiny_model_folder(out: Path, seed: int) -> Path:
    """The tiny preset (random weights from `seed`) and its tokenizer as a Hugging Face folder: the trainer and the
    engine both load it, so they start from the same weights. Any HF causal-LM folder works in its place."""
    folder = out / "init_model"
    build_tiny_model(seed).save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    return folder


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("runs/custom_loop"))
    p.add_argument("--model", type=Path, default=None, help="a Hugging Face folder (default: the tiny preset)")
    p.add_argument("--data", type=Path, default=DATA, help="JSONL prompts with an 'answer' field")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    folder = args.model or tiny_model_folder(args.out, args.seed)
    tokenizer = load_tokenizer(folder)  # the folder's own: prompts, stop tokens and the pad id come from it
    # 4 prompts x 4 samples of at most 8 new tokens per step; the chat template wraps each prompt as a user turn.
    rollout = RolloutConfig(rollout_batch_size=4, n_samples_per_prompt=4, max_new_tokens=8, temperature=1.0,
                            apply_chat_template=True, seed=args.seed)
    cfg = RLTrainingConfig(optim=OptimConfig(lr=1e-3), num_steps=args.steps, token_budget=256,
                           micro_batch_buckets=64, rollout=rollout, seed=args.seed, output_dir=str(args.out))
    tcfg = trainer_config_from(cfg, compile=False)  # torch.compile pays off on long GPU runs, not in a few CPU steps

    components = build_components(str(folder), tcfg)  # the FSDP2-wrapped model, AdamW and its LR schedule
    engine = build_engine(EngineSpec(kind="local"), model_folder=folder, seed=args.seed)
    # Same process: the sender hands the weights over through shared memory (a process group for remote engines).
    sender = WeightSyncSender(components.model, [engine])
    sender.init_group()
    buffer = DataBuffer.from_jsonl(args.data, seed=args.seed)  # seeded, resumable prompt order
    # No reward_fn here, so the rewards are computed in the loop below; with reward_fn=... the manager scores each
    # group as it finishes (what dynamic filters need).
    manager = AsyncRolloutManager([engine], rollout, tokenizer=tokenizer)
    batches = generate_rollout_batches(buffer, rollout, manager=manager, weight_version=lambda: sender.weight_version)
    pad_id = pad_token_id(tokenizer)
    state = TrainingState()  # step, weight version, tokens seen: threaded through optim_step
    try:
        while state.step < args.steps:
            batch = next(batches)  # rollout_batch_size groups of n samples, with the engine's log-probs
            samples, _ = compute_rewards(batch.samples, arithmetic_reward)  # a reward that raises marks it FAILED
            # GRPO: each sample's reward minus its group's mean, over the group's std. Failed samples and groups
            # with fewer than two scored samples have no baseline and are left out of the loss.
            keep, _ = trained_samples(samples, cfg.advantage_estimator)
            advantages = compute_advantages(samples, cfg.advantage_estimator)
            trained = [samples[i] for i in keep]
            # Packed rows of at most token_budget tokens, the loss already normalised by the batch's token count.
            micro_batches = build_micro_batches(trained, token_budget=cfg.token_budget,
                                                bucket_size=cfg.micro_batch_buckets,
                                                advantages=[advantages[i] for i in keep], pad_id=pad_id,
                                                num_ranks=components.world_size, rank=components.rank)
            fut = forward_backward(components, micro_batches, tcfg)  # gradients accumulate; metrics in a future
            opt_fut, state = optim_step(components, state, tcfg, num_tokens=fut.num_tokens)
            metrics = fut.result() | opt_fut.result()  # the step's one host sync
            sender.sync(weight_version=state.weight_version)  # the next batch samples from the new weights
            served = trio.run(engine.get_weight_version)
            reward = sum(s.reward for s in samples) / len(samples)
            print(f"step {state.step} reward={reward:.4f} loss={metrics['loss']:.6f} "
                  f"grad_norm={metrics['grad_norm']:.4f} engine_weight_version={served}", flush=True)
    finally:
        sender.close()
        engine.close()


if __name__ == "__main__":
    main()
