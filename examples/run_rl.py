"""The task of custom_loop.py (GRPO on arithmetic prompts, tiny random model, in-process engine) in one call to
trainer.rl.run_rl_training, which also writes <out>/metrics.jsonl and a checkpoint at the end.

    python examples/run_rl.py --steps 3 --out runs/run_rl
    python examples/run_rl.py --steps 3 --out runs/run_rl_retry --episodes   # multi-turn: a second try on a miss

With --episodes each sample is a two-turn episode of `SecondTry`, an environment passed as a Python object (the
Python API's form of `[rl.rollout] env = "module:factory"`).
"""

import argparse
from pathlib import Path

from engines.embedded.presets import build_tiny_model
from engines.registry import EngineSpec, build_engine
from engines.tiny import build_tokenizer
from engines.tokenizer import load_tokenizer
from trainer.backend.steps import build_components, trainer_config_from
from trainer.config import OptimConfig, RLTrainingConfig, RolloutConfig
from trainer.data.buffer import DataBuffer
from trainer.rl import run_rl_training
from trainer.weight_sync import WeightSyncSender

DATA = Path(__file__).resolve().parents[1] / "data" / "arithmetic_train.jsonl"


class SecondTry:
    """An environment: a wrong first answer gets one more try; reward 1 for a right answer, 0.5 on the second try."""

    def reset(self, prompt, metadata):
        self.answer, self.tries = metadata["answer"], 0
        return [{"role": "user", "content": prompt}]

    def step(self, message):
        self.tries += 1
        right = message["content"].strip() == self.answer
        if right or self.tries == 2:
            return {"messages": [], "reward": (1.0 if self.tries == 1 else 0.5) if right else 0.0, "done": True}
        return {"messages": [{"role": "user", "content": "Wrong. Try again."}], "reward": None, "done": False}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("runs/run_rl"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--episodes", action="store_true", help="two-turn episodes of the SecondTry environment")
    args = p.parse_args()

    folder = args.out / "init_model"  # the tiny preset as a Hugging Face folder (any HF causal LM works)
    build_tiny_model(args.seed).save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    rollout = RolloutConfig(rollout_batch_size=4, n_samples_per_prompt=4, max_new_tokens=8, temperature=1.0,
                            apply_chat_template=True, seed=args.seed, env=SecondTry if args.episodes else None,
                            max_turns=2)
    cfg = RLTrainingConfig(optim=OptimConfig(lr=1e-3), num_steps=args.steps, token_budget=256,
                           micro_batch_buckets=64, rollout=rollout, seed=args.seed, output_dir=str(args.out / "rl"))
    tcfg = trainer_config_from(cfg, compile=False)
    # Built before the call: the weight-sync sender reads the trainer's (sharded) parameters.
    components = build_components(str(folder), tcfg)
    engine = build_engine(EngineSpec(kind="local"), model_folder=folder, seed=args.seed)
    sender = WeightSyncSender(components.model, [engine])
    sender.init_group()
    try:
        run_rl_training(None, DataBuffer.from_jsonl(DATA, seed=args.seed), cfg, engines=[engine], sender=sender,
                        tokenizer=load_tokenizer(folder), reward_fn="arithmetic", trainer_config=tcfg,
                        components=components,
                        on_step=lambda step, m: print(f"step {step} reward={m['reward_mean']:.4f} "
                                                      f"loss={m['loss']:.6f} weight_version={m['weight_version']} "
                                                      f"turns={m.get('rollout/turns_mean', 1.0):.2f}", flush=True))
    finally:
        sender.close()
        engine.close()
    print(f"metrics: {Path(cfg.output_dir) / 'metrics.jsonl'}")


if __name__ == "__main__":
    main()
