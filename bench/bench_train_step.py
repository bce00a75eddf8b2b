"""A full GRPO training step: ours (packed micro-batches, fused lm_head + policy loss, FSDP2, per-block compile)
versus a plain reference step (padded batch, eager full-vocabulary log_softmax, no compile; on a GPU in micro-batches
sized to fit its memory, or skipped with the reason when one row does not fit).

    make bench                                       (pytest-benchmark; extra_info holds tokens/s and peak MB)
    .venv/bin/python bench/bench_train_step.py       (side-by-side table and the ratios)
    .venv/bin/python bench/bench_train_step.py --long-answers   (bench_long_answers.py's train step by itself, CPU)

Workload: GRPO-like samples (prompt 16-64 tokens, log-normal responses, median 96, clipped) with random
advantages; a step is forward + backward over every sample, gradient clipping and an AdamW step. Tokens/s counts
real tokens. Peak memory: CUDA max_memory_allocated on a GPU; on the CPU the peak resident-set growth during the
step, sampled every millisecond (coarse, but it sees the [B, L, V] logits of the reference).
CPU: the tiny model (hidden 64, 2 layers). GPU: a Qwen2.5-0.5B-shaped random model in bf16, 16k tokens per step.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

import numpy as np
import pytest
import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _bench_utils import MEMORY_FRACTION, plan_entry, skip_unless_fits  # noqa: E402  (bench/ is on the path)

from kernels import use_backend  # noqa: E402
from trainer.batching.micro_batches import build_micro_batches  # noqa: E402
from trainer.types import Sample, TrainingState  # noqa: E402

# (samples, max response, token budget, bucket)
FULL_CPU = (48, 512, 1024, 128)
SMALL = (8, 64, 256, 64)
FULL_GPU = (96, 1024, 16384, 512)


def _model_config(device: torch.device):
    from engines.tiny import tiny_model_config

    if device.type != "cuda":
        return tiny_model_config("llama", max_position_embeddings=2048)
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
                       tie_word_embeddings=True, rms_norm_eps=1e-6)


def make_samples(n: int, max_resp: int, vocab: int, seed: int = 0) -> tuple[list[Sample], list[float]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        p = int(rng.integers(16, 65))
        r = int(np.clip(rng.lognormal(np.log(96), 0.8), 4, max_resp))
        out.append(Sample(prompt="", tokens=rng.integers(6, vocab, p + r).tolist(), response_length=r))
    return out, rng.standard_normal(n).tolist()


class _PeakRSS:
    """Peak resident-set growth (bytes) of this process while the block runs, sampled every millisecond."""

    def __enter__(self):
        self.base = self.peak = self._rss()
        self._stop = False
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _run(self):
        while not self._stop:
            self.peak = max(self.peak, self._rss())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._stop = True
        self._t.join()
        self.peak = max(self.peak, self._rss())

    @property
    def grown(self) -> int:
        return self.peak - self.base


# ---------------------------------------------------------------------------------------------------------
# The two steps
# ---------------------------------------------------------------------------------------------------------


def ours_step_fn(samples, adv, budget, bucket, device, compile_backend, *, shared_prompts: bool = False,
                 model_config=None):
    """shared_prompts: the RL loop's layout for groups (trainer.batching.shared_prompt: a group's prompt once).
    model_config: the model to build (default: this device's, _model_config)."""
    from trainer.backend.steps import build_components, forward_backward, optim_step, trainer_config_from
    from trainer.batching.shared_prompt import build_shared_micro_batches
    from trainer.config import OptimConfig, RLTrainingConfig

    rl = RLTrainingConfig(token_budget=budget, micro_batch_buckets=bucket, optim=OptimConfig(lr=1e-5))
    cfg = trainer_config_from(rl, compile=compile_backend is not None, compile_backend=compile_backend or "inductor")
    comp = build_components(model_config or _model_config(device), cfg)
    state = [TrainingState()]
    build = build_shared_micro_batches if shared_prompts else build_micro_batches
    mbs = build(samples, token_budget=budget, bucket_size=bucket, advantages=adv)

    def step():
        fut = forward_backward(comp, mbs)
        ofut, state[0] = optim_step(comp, state[0], num_tokens=fut.num_tokens)
        return fut.result()["loss"], ofut.result()

    return step


FP32_BYTES = 4
REFERENCE_MEMORY_FRACTION = MEMORY_FRACTION  # of the device's free memory: the allocator's fragmentation, CUDA context


class DoesNotFit(Exception):
    """The reference step cannot run one row on this device; the message says how much it needs."""


def reference_activation_bytes(rows: int, length: int, cfg, dtype_bytes: int) -> int:
    """Planned bytes of one reference micro-batch of `rows` padded rows of `length` tokens at the peak of its
    backward: the logits [rows, L, V] in the model dtype, four fp32 [rows, L, V] tensors (the .float() copy,
    log_softmax's output saved for its backward, and the gradients of both), and every decoder block's saved
    activations (generously 8 hidden-wide and 4 MLP-wide tensors per token in the model dtype)."""
    tokens = rows * length
    logits = tokens * cfg.vocab_size * (dtype_bytes + 4 * FP32_BYTES)
    blocks = tokens * cfg.num_hidden_layers * (8 * cfg.hidden_size + 4 * cfg.intermediate_size) * dtype_bytes
    return logits + blocks


def reference_state_bytes(n_params: int, dtype_bytes: int) -> int:
    """Weights, gradients and AdamW's two moments, all in the model dtype."""
    return 4 * n_params * dtype_bytes


def reference_rows(n_samples: int, length: int, cfg, n_params: int, dtype_bytes: int,
                   budget_bytes: float | None) -> int:
    """Rows per reference micro-batch: all `n_samples` without a budget (the CPU), else the most whose planned
    bytes (state + activations) fit `budget_bytes`. Raises DoesNotFit when not even one row does."""
    if budget_bytes is None:
        return n_samples
    state = reference_state_bytes(n_params, dtype_bytes)
    per_row = reference_activation_bytes(1, length, cfg, dtype_bytes)
    rows = min(n_samples, int((budget_bytes - state) // per_row))
    if rows < 1:
        raise DoesNotFit(f"the reference step needs {(state + per_row) / 2**30:.1f} GiB for one row of {length} "
                         f"tokens (vocab {cfg.vocab_size}); the device has {budget_bytes / 2**30:.1f} GiB to give: "
                         f"shorten the samples (max response) or use a larger device")
    return rows


def ours_bytes(n_params: int, cfg, token_budget: int, dtype_bytes: int) -> int:
    """Planned peak bytes of our step: fp32 weights, gradients and AdamW's two moments (16 B a parameter) and a
    compute-dtype copy of the weights; one packed micro-batch of `token_budget` tokens with every block's saved
    activations (the reference's generous 8 hidden-wide and 4 MLP-wide tensors per token); the fused lm_head's
    two chunk buffers (at most 2^28 bytes each) and its fp32 weight-gradient accumulator [V, H]."""
    state = (4 * FP32_BYTES + dtype_bytes) * n_params
    blocks = token_budget * cfg.num_hidden_layers * (8 * cfg.hidden_size + 4 * cfg.intermediate_size) * dtype_bytes
    head = 2 * (1 << 28) + FP32_BYTES * cfg.vocab_size * cfg.hidden_size
    return state + blocks + head


def planned_cases(memory_bytes: float) -> list[dict]:
    """The two cases at the GPU sizes with their planned bytes against `memory_bytes`: the reference in the
    micro-batches that fit MEMORY_FRACTION of it (reference_rows; skipped with the reason when one row does not),
    ours at its token budget (skipped with the reason when it does not fit)."""
    cfg = _model_config(torch.device("cuda"))  # the Qwen2.5-0.5B shape, built on the meta device only
    n, max_resp, budget, _ = FULL_GPU
    samples, _ = make_samples(n, max_resp, cfg.vocab_size)
    length, n_params, bf16 = max(len(s.tokens) for s in samples), _n_params(cfg), torch.bfloat16.itemsize
    state = reference_state_bytes(n_params, bf16)
    try:
        rows = reference_rows(n, length, cfg, n_params, bf16, MEMORY_FRACTION * memory_bytes)
        ref = plan_entry(f"test_train_step[reference] ({rows} of {n} rows a micro-batch)",
                         state + reference_activation_bytes(rows, length, cfg, bf16), memory_bytes)
    except DoesNotFit as e:
        ref = {**plan_entry("test_train_step[reference]", state + reference_activation_bytes(1, length, cfg, bf16),
                            memory_bytes), "skipped": str(e)}
    return [ref, plan_entry("test_train_step[ours]", ours_bytes(n_params, cfg, budget, bf16), memory_bytes)]


def _device_budget(device: torch.device) -> float | None:
    """Bytes the reference may plan for on `device` (None on the CPU: its peak is measured, not planned)."""
    if device.type != "cuda":
        return None
    return REFERENCE_MEMORY_FRACTION * torch.cuda.mem_get_info(device)[0]


def reference_step_fn(samples, adv, device, budget_bytes: float | None = None, model_config=None):
    """Padded [B, L] batch, full [B, L, V] logits, log_softmax + gather, clipped GRPO loss (seq-mean-token-mean).

    On a GPU the batch runs as micro-batches of the rows that fit the device (reference_rows; gradients
    accumulate, one optimizer step): the same loss and update as one batch, as a padded trainer would run it.
    """
    from trainer.backend.models import load_hf_model

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = model_config or _model_config(device)
    L = max(len(s.tokens) for s in samples)
    budget = _device_budget(device) if budget_bytes is None else budget_bytes
    rows = reference_rows(len(samples), L, cfg, _n_params(cfg), dtype.itemsize, budget)
    model = load_hf_model(cfg, dtype=dtype, device=device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.zeros(len(samples), L, dtype=torch.long)
    attn = torch.zeros(len(samples), L, dtype=torch.long)
    mask = torch.zeros(len(samples), L - 1)
    for b, s in enumerate(samples):
        ids[b, :len(s.tokens)] = torch.tensor(s.tokens)
        attn[b, :len(s.tokens)] = 1
        mask[b, s.prompt_length - 1:len(s.tokens) - 1] = 1
    ids, attn, mask = ids.to(device), attn.to(device), mask.to(device)
    advantages = torch.tensor(adv, device=device)[:, None]

    def micro_loss(sl: slice) -> torch.Tensor:  # this slice's share of the batch mean
        logits = model(input_ids=ids[sl], attention_mask=attn[sl]).logits[:, :-1].float()  # [b, L-1, V]
        logp = torch.log_softmax(logits, -1).gather(-1, ids[sl, 1:, None])[..., 0]
        ratio = torch.exp(logp - logp.detach())
        a = advantages[sl]
        pg = torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.2))
        m = mask[sl]
        return (pg * m).sum(1).div(m.sum(1).clamp(min=1)).sum() / len(samples)

    def step():
        total = torch.zeros((), device=device)
        for start in range(0, len(samples), rows):
            loss = micro_loss(slice(start, start + rows))
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total.item()

    return step


def measure(step, device, tokens: int, repeats: int) -> dict:
    step()  # warm-up (compiles)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    with _PeakRSS() as rss:
        for _ in range(repeats):
            t0 = time.perf_counter()
            step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else rss.grown
    t = float(np.median(times))
    return {"tokens_per_s": tokens / t, "step_s": t, "peak_mb": peak / 2**20}


def _sizes(device, small: bool):
    if small:
        return SMALL
    return FULL_GPU if device.type == "cuda" else FULL_CPU


# ---------------------------------------------------------------------------------------------------------
# pytest-benchmark
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("provider", ["reference", "ours"])
def test_train_step(benchmark, request, provider):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    small = request.config.getoption("benchmark_disable")
    n, max_resp, budget, bucket = _sizes(device, small)
    cfg = _model_config(device)
    samples, adv = make_samples(n, max_resp, cfg.vocab_size)
    tokens = sum(len(s.tokens) for s in samples)
    with use_backend("torch") if device.type == "cpu" else contextlib.nullcontext():
        if provider == "ours":
            if device.type == "cuda":
                skip_unless_fits(ours_bytes(_n_params(cfg), cfg, budget, torch.bfloat16.itemsize))
            step = ours_step_fn(samples, adv, budget, bucket, device, "aot_eager" if small else "inductor")
        else:
            try:
                step = reference_step_fn(samples, adv, device)
            except DoesNotFit as e:
                pytest.skip(str(e))
        step()
        benchmark.extra_info.update(tokens=tokens)
        benchmark.pedantic(step, rounds=1 if small else 5, iterations=1)


def group_samples(groups: int, group_size: int, prompt_len: int, response_len: int, vocab: int,
                  seed: int = 0) -> tuple[list[Sample], list[float]]:
    """GRPO groups: `group_size` responses of exactly `response_len` tokens to each of `groups` prompts."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        prompt = rng.integers(6, vocab, prompt_len).tolist()
        out += [Sample(prompt=str(g), tokens=prompt + rng.integers(6, vocab, response_len).tolist(),
                       response_length=response_len, group_index=g, index=i) for i in range(group_size)]
    return out, rng.standard_normal(len(out)).tolist()


def long_answers() -> None:
    """The train step of bench_long_answers.py's work on the CPU, by itself: the demo's model (hidden 128, 2 layers,
    vocabulary 288), 16 prompts of 13 tokens x 8 responses of 256, no reference forward; the padded reference
    against ours eager in the plain and in the shared-prompt layout, interleaved, one torch thread."""
    from engines.tiny import tiny_model_config

    cfg = tiny_model_config("qwen2", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                            max_position_embeddings=1024)  # configs/demo.toml's [model]
    torch.set_num_threads(1)
    samples, adv = group_samples(16, 8, 13, 256, cfg.vocab_size)
    tokens = sum(len(s.tokens) for s in samples)
    cpu = torch.device("cpu")
    with use_backend("torch"):
        steps = {"reference (padded, eager)": reference_step_fn(samples, adv, cpu, model_config=cfg),
                 "ours (packed, eager)": ours_step_fn(samples, adv, 4096, 64, cpu, None, model_config=cfg),
                 "ours (shared prompts, eager)": ours_step_fn(samples, adv, 4096, 64, cpu, None, shared_prompts=True,
                                                              model_config=cfg)}
        times: dict[str, list[float]] = {k: [] for k in steps}
        for step in steps.values():
            step()  # warm-up
        for _ in range(3):
            for name, step in steps.items():
                t = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - t)
    print(f"{len(samples)} samples, {tokens} tokens a step")
    for name, ts in times.items():
        med = float(np.median(ts))
        print(f"{name:32s} {tokens / med:8.0f} tok/s  {med:6.2f} s/step  {[round(t, 2) for t in ts]}")


def main() -> None:
    if "--long-answers" in sys.argv:
        return long_answers()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    n, max_resp, budget, bucket = _sizes(device, small="--small" in sys.argv)
    cfg = _model_config(device)
    samples, adv = make_samples(n, max_resp, cfg.vocab_size)
    tokens = sum(len(s.tokens) for s in samples)
    padded = len(samples) * max(len(s.tokens) for s in samples)
    print(f"device={device} samples={n} real tokens={tokens} padded tokens={padded} vocab={cfg.vocab_size}")
    repeats = 5
    with use_backend("torch") if device.type == "cpu" else contextlib.nullcontext():
        ref = measure(reference_step_fn(samples, adv, device), device, tokens, repeats)
        backend = "inductor" if "--eager-blocks" not in sys.argv else None
        ours = measure(ours_step_fn(samples, adv, budget, bucket, device, backend), device, tokens, repeats)
    for name, r in (("reference (padded, eager log_softmax)", ref), ("ours (packed, fused, compiled)", ours)):
        print(f"{name:40s} {r['tokens_per_s']:10.0f} tok/s  {r['step_s'] * 1e3:8.1f} ms/step  {r['peak_mb']:8.1f} MB")
    print(f"speed-up {ours['tokens_per_s'] / ref['tokens_per_s']:.2f}x   peak-memory ratio "
          f"{ours['peak_mb'] / max(ref['peak_mb'], 1e-9):.2f}x")
    if device.type == "cuda":
        n_params = _n_params(cfg)
        mfu = 6 * n_params * ours["tokens_per_s"] / 989e12
        print(f"MFU (6 N tokens/s over 989 TFLOP/s bf16 dense): {mfu:.3f}")


def _n_params(cfg) -> int:
    """Parameters of the model `cfg` describes (tied embeddings counted once), from a meta-device build."""
    return sum(p.numel() for p in _build_for_count(cfg).parameters())


def _build_for_count(cfg):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


if __name__ == "__main__":
    main()
