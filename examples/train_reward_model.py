"""Train the demo's reward model: a tiny classifier of right vs wrong answers to the arithmetic prompts.

    python examples/train_reward_model.py --out runs/rm_arithmetic
    python -m trainer demo --config configs/rm_demo.toml          # the demo, rewarded by this model

The model is the demo's tiny preset (configs/demo.toml [model]: qwen2, hidden 128, 2 layers, 4 heads, 2 key/value
heads, the project tokenizer) with a one-output score head instead of the LM head (Qwen2ForSequenceClassification,
num_labels=1). Its body starts, as an RLHF reward model starts from the SFT model, from a language model of the same
preset trained here for --lm-steps on the training prompts' right answers (the demo's SFT: next-token loss on the
assistant's answer; --lm-steps 0 starts from random weights, seeded by --seed).

Examples: every prompt of data/arithmetic_train.jsonl with its right answer (label 1) and with a wrong one made by
perturbing it (label 0): off by 1-3, off by 10, two digits swapped, a digit dropped or repeated, or any other number
up to 99; a fresh wrong answer each time the prompt is drawn. Each example is the conversation the RL loop's reward
model reads (trainer.rewards.model encode_for_scoring): the prompt as the user's turn and the answer as the
assistant's, in the tokenizer's chat template. Loss: binary cross-entropy on the logit, so the score is the log-odds
that the answer is right.

Held out: data/arithmetic_test.jsonl (prompts the RL run never trains on), each prompt with its right answer and one
wrong answer of each kind (drawn from a fixed seed): the accuracy of the sign of the score (> 0: "right") over all
of them, and the pairwise accuracy (the right answer scored above the wrong one). The same figures on the training
prompts are printed too: the RL run's prompts are those, so they are what its reward is computed on.

The folder is written with save_pretrained (weights, config with pad_token_id) and the tokenizer (its chat template):
it loads in stock transformers (AutoModelForSequenceClassification) and in [rewards] sources = [{kind = "model",
path = "..."}]. Figures go to <out>/rm_metrics.json.
"""

import argparse
import json
import random
import time
from pathlib import Path

import torch

from engines.tiny import build_tokenizer, tiny_model_config
from trainer.data.buffer import load_jsonl
from trainer.rewards.model import encode_for_scoring

ROOT = Path(__file__).resolve().parents[1]
WRONG_KINDS = ("near", "tens", "swap", "drop", "repeat", "other")


def wrong_answer(answer: int, kind: str, rng: random.Random) -> int:
    """A wrong answer to a problem whose answer is `answer` (never equal to it), of the given kind of mistake."""
    text = str(answer)
    for _ in range(20):
        if kind == "near":
            got = answer + rng.choice((-3, -2, -1, 1, 2, 3))
        elif kind == "tens":
            got = answer + rng.choice((-10, 10))
        elif kind == "swap" and len(text) > 1:
            got = int(text[::-1])
        elif kind == "drop" and len(text) > 1:
            i = rng.randrange(len(text))
            got = int(text[:i] + text[i + 1:])
        elif kind == "repeat":
            i = rng.randrange(len(text))
            got = int(text[:i] + text[i] + text[i:])
        else:  # "other", and the kinds a one-digit answer has no room for
            got = rng.randrange(0, 100)
        if got != answer and got >= 0:
            return got
    return answer + 1


def build_model(seed: int) -> torch.nn.Module:
    from transformers import AutoModelForSequenceClassification

    config = tiny_model_config("qwen2", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2)
    config.num_labels = 1
    config.pad_token_id = build_tokenizer().pad_token_id  # where a padded row's score is read (its last real token)
    torch.manual_seed(seed)
    return AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)


def warm_start(model, tokenizer, train: list[tuple[str, int]], *, steps: int, batch: int, lr: float,
               rng: random.Random) -> None:
    """Train `model`'s body as a causal LM (its own copy of the preset with an LM head) on the right answers for
    `steps` steps: the loss on the answer's tokens and the end of turn, as the demo's SFT does."""
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
    lm.model.load_state_dict(model.model.state_dict())  # the same random start as the classifier's body
    lm.train()
    optim = torch.optim.AdamW(lm.parameters(), lr=lr, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda k: min(1.0, (k + 1) / 10))
    for step in range(1, steps + 1):
        rows = [(p, str(a)) for p, a in rng.sample(train, batch)]
        input_ids, mask = encode(tokenizer, rows)
        labels = torch.full_like(input_ids, -100)
        for i, (p, _) in enumerate(rows):  # the answer and its end of turn, after the assistant header
            start = len(tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                      tokenize=True, return_dict=True)["input_ids"])
            end = int(mask[i].sum())
            labels[i, start:end] = input_ids[i, start:end]
        loss = lm(input_ids=input_ids, attention_mask=mask, labels=labels).loss
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(lm.parameters(), 1.0)
        optim.step()
        sched.step()
        if step % 100 == 0 or step == steps:
            print(f"lm warm start step {step} loss {loss.item():.4f}", flush=True)
    model.model.load_state_dict(lm.model.state_dict())


def encode(tokenizer, rows: list[tuple[str, str]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded [B, T] input ids and attention mask of (prompt, answer) conversations."""
    ids = [encode_for_scoring(tokenizer, p, a) for p, a in rows]
    width = max(map(len, ids))
    input_ids = torch.full((len(ids), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, x in enumerate(ids):
        input_ids[i, :len(x)] = torch.tensor(x)
        mask[i, :len(x)] = 1
    return input_ids, mask


@torch.no_grad()
def scores(model, tokenizer, rows: list[tuple[str, str]], batch: int = 256) -> list[float]:
    out = []
    for start in range(0, len(rows), batch):
        input_ids, mask = encode(tokenizer, rows[start:start + batch])
        out += model(input_ids=input_ids, attention_mask=mask).logits[:, 0].tolist()
    return out


def held_out_figures(model, tokenizer, problems, seed: int) -> dict[str, float]:
    """Sign accuracy over right + wrong answers (one wrong of each kind per prompt) and pairwise accuracy."""
    rng = random.Random(seed)
    rows, labels, pairs, kinds = [], [], [], []
    for prompt, answer in problems:
        right = len(rows)
        rows.append((prompt, str(answer)))
        labels.append(1)
        kinds.append("right")
        for kind in WRONG_KINDS:
            pairs.append((right, len(rows)))
            rows.append((prompt, str(wrong_answer(answer, kind, rng))))
            labels.append(0)
            kinds.append(kind)
    model.eval()
    s = scores(model, tokenizer, rows)
    model.train()
    right_ones = [s[i] for i, y in enumerate(labels) if y == 1]
    return {"accuracy": sum((x > 0) == bool(y) for x, y in zip(s, labels)) / len(rows),
            "accuracy_right_answers": sum(x > 0 for x in right_ones) / len(right_ones),
            "accuracy_wrong_answers": sum(x <= 0 for x, y in zip(s, labels) if y == 0) / (len(rows) - len(right_ones)),
            "pairwise_accuracy": sum(s[r] > s[w] for r, w in pairs) / len(pairs), "n": len(rows),
            # the share of each kind of wrong answer scored as wrong (score <= 0)
            "wrong_answers_by_kind": {k: sum(x <= 0 for x, kk in zip(s, kinds) if kk == k) / kinds.count(k)
                                      for k in WRONG_KINDS}}


def problems_of(path: Path) -> list[tuple[str, int]]:
    return [(p.prompt, int(p.answer)) for p in load_jsonl(str(path))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs/rm_arithmetic", help="the reward model's folder")
    ap.add_argument("--steps", type=int, default=1500, help="optimiser steps")
    ap.add_argument("--batch", type=int, default=64, help="prompts per step (each with a right and a wrong answer)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lm-steps", type=int, default=300, help="language-model warm start steps (0: none)")
    ap.add_argument("--lm-lr", type=float, default=3e-3, help="the warm start's learning rate (the demo's SFT's)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (a tiny model's ops are too short "
                                                          "to share across cores)")
    ap.add_argument("--eval-every", type=int, default=500, help="print the held-out figures every N steps")
    ap.add_argument("--train", default=str(ROOT / "data/arithmetic_train.jsonl"))
    ap.add_argument("--test", default=str(ROOT / "data/arithmetic_test.jsonl"))
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    tokenizer = build_tokenizer()
    train, test = problems_of(Path(args.train)), problems_of(Path(args.test))
    model = build_model(args.seed).train()
    rng = random.Random(args.seed)
    t0 = time.time()
    if args.lm_steps:
        warm_start(model, tokenizer, train, steps=args.lm_steps, batch=args.batch, lr=args.lm_lr, rng=rng)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda k: min(1.0, (k + 1) / 100))  # 100 warm-up steps
    for step in range(1, args.steps + 1):
        batch = rng.sample(train, args.batch)
        rows = [(p, str(a)) for p, a in batch] + [(p, str(wrong_answer(a, rng.choice(WRONG_KINDS), rng)))
                                                  for p, a in batch]
        labels = torch.tensor([1.0] * len(batch) + [0.0] * len(batch))
        input_ids, mask = encode(tokenizer, rows)
        logits = model(input_ids=input_ids, attention_mask=mask).logits[:, 0]  # [2B]
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        sched.step()
        if step % args.eval_every == 0 or step == args.steps:
            held = held_out_figures(model, tokenizer, test, seed=1)
            print(f"step {step} loss {loss.item():.4f} held-out accuracy {held['accuracy'] * 100:.1f} % pairwise "
                  f"{held['pairwise_accuracy'] * 100:.1f} % ({time.time() - t0:.0f} s)", flush=True)
    figures = {"held_out": held_out_figures(model, tokenizer, test, seed=1),
               "train_prompts": held_out_figures(model, tokenizer, train, seed=1),
               "steps": args.steps, "batch": args.batch, "lr": args.lr, "seed": args.seed,
               "lm_steps": args.lm_steps, "lm_lr": args.lm_lr,
               "train_seconds": round(time.time() - t0, 1)}
    out = Path(args.out)
    model.eval().save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "rm_metrics.json").write_text(json.dumps(figures, indent=2) + "\n")
    for name in ("held_out", "train_prompts"):
        f = figures[name]
        print(f"{name}: accuracy {f['accuracy'] * 100:.1f} % (right answers {f['accuracy_right_answers'] * 100:.1f} "
              f"%, wrong answers {f['accuracy_wrong_answers'] * 100:.1f} %), pairwise "
              f"{f['pairwise_accuracy'] * 100:.1f} % over {f['n']} answers")
    print(f"saved {out}")


if __name__ == "__main__":
    main()
