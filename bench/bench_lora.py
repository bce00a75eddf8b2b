"""Full fine-tuning vs LoRA (r = 16, every decoder Linear) on one GRPO train step of the same model: step time,
peak memory, optimizer-state bytes, gradient bytes and the bytes a weight sync moves (issue 38).

    make bench                                  (pytest-benchmark, the tiny model; extra_info holds the figures)
    .venv/bin/python bench/bench_lora.py        (the Qwen2.5-0.5B shape of configs/qwen05b_shape.toml, a table
                                                 and bench/results/lora_<device>.json)

The step is this project's (trainer.backend.steps: packed micro-batches, fused lm_head + policy loss, AdamW) on
GRPO-like samples with random advantages; the two sides differ only in `RLTrainingConfig.lora`. Figures:
- step_s: median wall time of forward + backward + clip + AdamW over `repeats` steps after a warm-up step;
- peak_mb: CUDA max_memory_allocated on a GPU, the step's resident-set growth on the CPU (bench_train_step._PeakRSS);
- optimizer_bytes: every tensor of the optimizer's state (AdamW's two moments and its step counts);
- gradient_bytes: the gradients the step leaves before zero_grad, i.e. one fp32 tensor per trainable parameter;
- sync_bytes: what one weight sync sends at the engine's dtype: the whole model for a full run; for a LoRA run the
  adapter tensors only (its A [r, in] and B [out, r] of every adapted Linear), the adapter-only path of issue 38.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_train_step import make_samples, measure  # noqa: E402  (bench/ is on the path)

from trainer.batching.micro_batches import build_micro_batches  # noqa: E402
from trainer.types import TrainingState  # noqa: E402

RANK = 16
# (samples, max response, token budget, bucket): CPU sizes keep a 0.5B step under a minute on 2 cores
QWEN_CPU = (4, 64, 512, 128)
QWEN_GPU = (96, 1024, 16384, 512)
TINY = (4, 32, 256, 64)  # the pytest cases: `make test` runs them once, to keep them from rotting


def qwen05b_config():
    """configs/qwen05b_shape.toml's model: Qwen2.5-0.5B's shape (494M parameters, tied embeddings)."""
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
                       tie_word_embeddings=True, rms_norm_eps=1e-6)


def tiny_config():
    from engines.tiny import tiny_model_config

    return tiny_model_config("qwen2", max_position_embeddings=2048)


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    return _bytes(v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))


def sync_bytes(model: torch.nn.Module, lora: bool, dtype: torch.dtype) -> int:
    """Bytes one weight sync sends at `dtype`: the adapter tensors of a LoRA model, else every engine weight."""
    from trainer.backend.lora import is_adapter
    from trainer.weight_sync.common import named_weights

    if lora:
        return sum(p.numel() * dtype.itemsize for n, p in model.named_parameters() if is_adapter(n))
    return sum(p.numel() * dtype.itemsize for _, p in named_weights(model))


def build_side(model_config, lora: bool, sizes, compile_backend: str | None = None):
    """(components, step function, token count) of one side: the same model, samples and optimizer settings."""
    from trainer.backend.steps import build_components, forward_backward, optim_step, trainer_config_from
    from trainer.config import LoRAConfig, OptimConfig, RLTrainingConfig

    n, max_resp, budget, bucket = sizes
    rl = RLTrainingConfig(token_budget=budget, micro_batch_buckets=bucket, optim=OptimConfig(lr=1e-5),
                          lora=LoRAConfig(rank=RANK, alpha=2.0 * RANK) if lora else None)
    cfg = trainer_config_from(rl, compile=compile_backend is not None, compile_backend=compile_backend or "inductor")
    comp = build_components(model_config, cfg)
    samples, adv = make_samples(n, max_resp, model_config.vocab_size, seed=0)
    mbs = build_micro_batches(samples, token_budget=budget, bucket_size=bucket, advantages=adv)
    state = [TrainingState()]
    grads = [0]

    def step():
        fut = forward_backward(comp, mbs)
        loss = fut.result()["loss"]
        # the gradients as the optimizer sees them (optim_step zeroes them after its update)
        grads[0] = _bytes(p.grad for p in comp.model.parameters() if p.grad is not None)
        ofut, state[0] = optim_step(comp, state[0], num_tokens=fut.num_tokens)
        ofut.result()
        return loss

    return comp, step, grads, sum(len(s.tokens) for s in samples)


def measure_side(model_config, lora: bool, sizes, repeats: int, device: torch.device) -> dict:
    comp, step, grads, tokens = build_side(model_config, lora, sizes)
    timed = measure(step, device, tokens, repeats)  # a warm-up step (the optimizer's state exists after it), then
    engine_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the median of `repeats`
    params = sum(p.numel() for p in comp.model.parameters())
    trainable = sum(p.numel() for p in comp.model.parameters() if p.requires_grad)
    return {**timed, "optimizer_bytes": optimizer_bytes(comp.optimizer), "gradient_bytes": grads[0],
            "sync_bytes": sync_bytes(comp.model, lora, engine_dtype), "parameters": params,
            "trainable_parameters": trainable}


def compare(model_config, sizes, repeats: int, device: torch.device) -> dict:
    """Both sides, one after the other in this process (full first), and the LoRA/full ratios."""
    full = measure_side(model_config, False, sizes, repeats, device)
    lora = measure_side(model_config, True, sizes, repeats, device)
    ratios = {k: lora[k] / full[k] for k in ("step_s", "optimizer_bytes", "gradient_bytes", "sync_bytes")}
    ratios["optimizer_plus_gradient"] = ((lora["optimizer_bytes"] + lora["gradient_bytes"])
                                         / (full["optimizer_bytes"] + full["gradient_bytes"]))
    return {"full": full, "lora": lora, "lora_over_full": ratios, "rank": RANK, "sizes": list(sizes),
            "repeats": repeats}


# ------------------------------------------------------------------------------------------- pytest-benchmark
@pytest.mark.parametrize("side", ["full", "lora"])
def test_lora_train_step(benchmark, side):
    comp, step, grads, tokens = build_side(tiny_config(), side == "lora", TINY)
    step()
    benchmark.pedantic(step, rounds=3, iterations=1)
    benchmark.extra_info.update(optimizer_bytes=optimizer_bytes(comp.optimizer), gradient_bytes=grads[0],
                                sync_bytes=sync_bytes(comp.model, side == "lora", torch.float32), tokens=tokens)


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="the tiny model (seconds) instead of the 0.5B shape")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/lora_<device>.json)")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    if args.tiny:
        cfg, sizes = tiny_config(), TINY
    else:
        cfg, sizes = qwen05b_config(), (QWEN_GPU if device.type == "cuda" else QWEN_CPU)
    result = compare(cfg, sizes, args.repeats, device)
    result.update(model="tiny" if args.tiny else "qwen2.5-0.5b shape (configs/qwen05b_shape.toml)",
                  device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                  torch=torch.__version__, threads=torch.get_num_threads())
    for side in ("full", "lora"):
        r = result[side]
        mb = {k: r[k] / 2**20 for k in ("optimizer_bytes", "gradient_bytes", "sync_bytes")}
        print(f"{side:>5}: step {r['step_s']:.2f} s  peak +{r['peak_mb']:.0f} MB  optimizer {mb['optimizer_bytes']:.1f}"
              f" MB  gradients {mb['gradient_bytes']:.1f} MB  sync {mb['sync_bytes']:.1f} MB  "
              f"trainable {r['trainable_parameters']:,} of {r['parameters']:,}")
    print("lora / full:", {k: round(v, 4) for k, v in result["lora_over_full"].items()})
    name = "cpu" if device.type != "cuda" else torch.cuda.get_device_name().lower().replace(" ", "-")
    out = Path(args.out or Path(__file__).parent / "results" / f"lora_{name}{'_tiny' if args.tiny else ''}.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print("wrote", out)


if __name__ == "__main__":
    main()
