"""GRPO/PPO policy-loss benchmarks: from logits and from hidden states, same shapes and same options.

    make bench                                        (pytest-benchmark at the issue's sizes)
    .venv/bin/python bench/bench_policy_loss.py       (side by side on this machine: fwd+bwd time and peak memory
                                                       of each provider in a fresh subprocess, from hidden states)

Providers
    torch          the float reference (kernels/reference.py) in fp32, eager
    torch-compile  the same under torch.compile
    liger          from logits: liger_kernel `triton_grpo_loss` (Triton only: CUDA, or the interpreter in the CI
                   smoke run); from hidden: `LigerFusedLinearGRPOLoss` (chunked torch, any device)
    ours           kernels.policy_loss / kernels.linear_policy_loss
Options shared by every provider: token-mean (Liger "dapo") aggregation, clip 0.2/0.2, k3 KL with coefficient
0.04 against given reference log-probs, given old log-probs, temperature 1, one advantage per sequence.
Liger's logits op takes [B, L+1, V] (it drops the last position itself); the others take [B, L, V].
Derived figures: GB/s for the logits op (fwd reads T·V logits, fwd+bwd reads them twice and writes T·V
gradients), TFLOP/s for the hidden op (2·T·H·V per GEMM: 1 forward, 2 backward), peak memory on CUDA.
"""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys
import time

import pytest
import torch
from _bench_utils import TOKEN_VECTOR_BYTES, _backend_ctx, _device, _shape, _sync, planned_suite_cases, skip_unless_fits

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernels import LossInputs, PolicyLossConfig, linear_policy_loss, policy_loss, use_backend  # noqa: E402
from kernels.reference import policy_loss_ref  # noqa: E402

CONFIG = PolicyLossConfig(loss_agg="token-mean", clip_low=0.2, clip_high=0.2, kl_coef=0.04, kl_type="k3")
PROVIDERS = ("torch", "torch-compile", "liger", "ours")
# name -> (device, shape): (B, L, V, dtype) from logits; (B, L, H, V, dtype) from hidden.
LOGITS_SIZES = {"cpu-V32000": ("cpu", (8, 512, 32000, torch.float32)),
                "cuda-V151936": ("cuda", (8, 2048, 151936, torch.bfloat16))}
HIDDEN_SIZES = {"cpu-H256": ("cpu", (8, 512, 256, 32000, torch.float32)),
                "cuda-H896": ("cuda", (8, 2048, 896, 151936, torch.bfloat16)),
                "cuda-H4096": ("cuda", (8, 2048, 4096, 151936, torch.bfloat16))}
SMALL_LOGITS = (2, 16, 1271, torch.float32)
SMALL_HIDDEN = (2, 16, 32, 1271, torch.float32)


def case_bytes(op: str, provider: str, mode: str, shape: tuple) -> int:
    """Planned peak device bytes of one case; the run skips a case that does not fit (skip_unless_fits), the
    dry run (planned_cases) lists it. e = bytes per input element, N = B·L·V, [B, L] vectors
    TOKEN_VECTOR_BYTES per token.
    From logits (the leaf [B, L+1, V] e, ~N·e):
      torch(-compile) + the [B, L, V] copy x e; policy_loss_ref in fp32: z = .float()/t 4, log_softmax 4, the
                     entropy's exp 4 and product 4 -> 2e + 16; full: + x's gradient e, and the backward's
                     fp32 gradients of log_softmax, z and the division 4 each -> bounded by 3e + 20
      liger          triton_grpo_loss: the leaf e; full: + its gradient e (inplace=False)
      ours           + the copy x e; full: + x's gradient e
    From hidden (hidden [B, L, H] e, weight [V, H] e; full adds their gradients, 2e·(B·L + V)·H):
      torch(-compile) logits = hidden @ weight.t() [B, L, V] e, then as above without the copy: e + 16; full:
                     + the logits' gradient e -> 2e + 20
      liger          LigerFusedLinearGRPOLoss, one sequence (L tokens) at a time: [L, V] in e + five fp32
                     (upcast, log_softmax, their gradients, probs); grad_weight [V, H] e + the chunk's fp32
                     one; grad_inputs [B·L, H] e
      ours           one [n, V] e chunk buffer of at most 2^28 bytes (full: + the backward's own) and full: the
                     fp32 weight-gradient accumulator [V, H] 4
    """
    full = mode == "full"
    if op == "logits":
        B, L, V, dtype = shape
        e = dtype.itemsize
        per_elem = {"torch": (2 * e + 16, 3 * e + 20), "liger": (e, 2 * e), "ours": (2 * e, 3 * e)}
        fwd_b, full_b = per_elem[provider.removesuffix("-compile")]
        return (full_b if full else fwd_b) * B * (L + 1) * V + TOKEN_VECTOR_BYTES * B * L
    B, L, H, V, dtype = shape
    e, T = dtype.itemsize, B * L
    inputs = e * (T + V) * H * (2 if full else 1)
    base = provider.removesuffix("-compile")
    if base == "torch":
        work = (2 * e + 20 if full else e + 16) * T * V
    elif base == "liger":
        work = L * V * (e + 5 * 4) + (e + 4) * V * H + e * T * H
    else:
        work = min(1 << 28, T * V * e) * (2 if full else 1) + (4 * V * H if full else 0)
    return inputs + work + TOKEN_VECTOR_BYTES * T


def planned_cases(memory_bytes: float) -> list[dict]:
    """Every case this file runs at its CUDA sizes, with its planned bytes against `memory_bytes`."""
    return planned_suite_cases(memory_bytes, (
        ("logits", LOGITS_SIZES, PROVIDERS, "test_policy_loss_from_logits"),
        ("hidden", HIDDEN_SIZES, PROVIDERS, "test_policy_loss_from_hidden")), case_bytes)


def make_inputs(B, L, V, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, V, (B, L), generator=g)
    mask = (torch.rand(B, L, generator=g) < 0.9).float()
    adv = torch.randn(B, generator=g)
    # Logits ~ N(0, 0.5²) (weight scale below): log-probs ≈ −log V − 0.125 ± 0.5; old within ~0.3 of them so the
    # ratios fall on both sides of the clip range, and k3 stays below its clamp (Liger does not clamp k3).
    old = -math.log(V) - 0.125 + 0.3 * torch.randn(B, L, generator=g)
    ref = old + 0.1 * torch.randn(B, L, generator=g)
    return {k: v.to(device) for k, v in dict(labels=labels, mask=mask, adv=adv, old=old, ref=ref).items()}


def _loss_inputs(t):
    """The per-token inputs of our losses (and the reference) from make_inputs' tensors (advantages per token)."""
    return LossInputs(t["labels"], _token_adv(t), t["mask"], old_logprobs=t["old"], ref_logprobs=t["ref"])


def _token_adv(t):
    return t["adv"][:, None].expand_as(t["old"]).contiguous()


@functools.cache
def _compiled_ref():
    return torch.compile(policy_loss_ref, dynamic=False)


def logits_call(provider, t, logits):
    """A zero-argument closure computing the loss (and the tensor whose .grad the backward fills)."""
    if provider == "liger":
        from liger_kernel.transformers.grpo_loss import triton_grpo_loss

        def run():
            return triton_grpo_loss(logits, t["old"], t["ref"], t["labels"], t["adv"], t["mask"], temperature=1.0,
                                    beta=CONFIG.kl_coef, eps_low=CONFIG.clip_low, eps_high=CONFIG.clip_high,
                                    inplace=False, loss_type="dapo", reduce=True)[0]
        return run
    x = logits[:, :-1].contiguous().detach().requires_grad_(logits.requires_grad)  # [B, L, V] for the others
    inputs = _loss_inputs(t)
    if provider == "ours":
        return lambda: policy_loss(x, inputs, config=CONFIG)[0]
    ref = _compiled_ref() if provider == "torch-compile" else policy_loss_ref
    return lambda: ref(x, inputs, config=CONFIG, dtype=torch.float32)[0]


def hidden_call(provider, t, hidden, weight):
    B, L, H = hidden.shape
    if provider == "liger":
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        mod = LigerFusedLinearGRPOLoss(beta=CONFIG.kl_coef, epsilon_low=CONFIG.clip_low,
                                       epsilon_high=CONFIG.clip_high, loss_type="dapo", temperature=1.0,
                                       use_ref_model=True)  # compiled=True: Liger's default
        return lambda: mod(hidden, weight, t["labels"], t["mask"], t["adv"], ref_per_token_logps=t["ref"],
                           old_per_token_logps=t["old"])[0]
    if provider == "ours":
        # Packed [T] layout (token-mean needs no cu_seqlens): the same tokens as the [B, L] rows.
        tok = _loss_inputs(t)
        flat = LossInputs(tok.labels.reshape(-1), tok.advantages.reshape(-1), tok.mask.reshape(-1),
                          old_logprobs=tok.old_logprobs.reshape(-1), ref_logprobs=tok.ref_logprobs.reshape(-1))
        return lambda: linear_policy_loss(hidden.view(B * L, H), weight, flat, config=CONFIG)[0]
    ref = _compiled_ref() if provider == "torch-compile" else policy_loss_ref
    inputs = _loss_inputs(t)
    return lambda: ref(hidden @ weight.t(), inputs, config=CONFIG, dtype=torch.float32)[0]


def _skip_reason(provider, device, small):
    if provider == "liger":
        try:
            import liger_kernel  # noqa: F401
        except ImportError:
            return "liger_kernel is not installed on this machine"
    if provider == "torch-compile" and device == "cpu" and small:
        return "torch.compile on CPU spends ~40 s compiling C++ here; measured only at full size (make bench)"
    return None


def _pedantic(benchmark, fn, mode, rounds):
    """Time `fn` (forward, or forward + backward); a provider that runs out of GPU memory is a skip, not an error
    (the full-vocabulary references need several [T, V] fp32 buffers at the GPU sizes)."""
    try:
        benchmark.pedantic(_run_mode(fn, mode), rounds=rounds, iterations=1, warmup_rounds=1)
        _record_memory(benchmark, fn, mode)
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        pytest.skip("out of GPU memory at this size")


def _run_mode(fn, mode):
    def run():
        loss = fn()
        if mode == "full":
            loss.backward()
        _sync()
    return run


def _record_memory(benchmark, fn, mode):
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        _run_mode(fn, mode)()
        benchmark.extra_info["peak_mem_MB"] = (torch.cuda.max_memory_allocated() - base) / 2**20


@pytest.mark.parametrize("size", list(LOGITS_SIZES))
@pytest.mark.parametrize("mode", ["fwd", "full"])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_policy_loss_from_logits(benchmark, request, provider, mode, size):
    device = _device()
    small = request.config.getoption("benchmark_disable")
    if (reason := _skip_reason(provider, device, small)) is not None:
        pytest.skip(reason)
    if provider == "liger" and device == "cpu" and not small:
        pytest.skip("Liger's triton_grpo_loss has no CPU path (only the interpreter, a correctness tool)")
    B, L, V, dtype = _shape(LOGITS_SIZES, size, SMALL_LOGITS, device, small)
    skip_unless_fits(case_bytes("logits", provider, mode, (B, L, V, dtype)))
    t = make_inputs(B, L, V, device)
    logits = (0.5 * torch.randn(B, L + 1, V, device=device)).to(dtype).requires_grad_(mode == "full")
    with _backend_ctx(device, small):
        fn = logits_call(provider, t, logits)
        _pedantic(benchmark, fn, mode, 1 if small else 5)
    moved = B * L * V * logits.element_size() * (1 if mode == "fwd" else 3)
    benchmark.extra_info.update(shape=f"B={B} L={L} V={V} {dtype}")
    if benchmark.stats is not None:
        benchmark.extra_info["GB_per_s"] = moved / benchmark.stats.stats.median / 1e9


@pytest.mark.parametrize("size", list(HIDDEN_SIZES))
@pytest.mark.parametrize("mode", ["fwd", "full"])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_policy_loss_from_hidden(benchmark, request, provider, mode, size):
    device = _device()
    small = request.config.getoption("benchmark_disable")
    if (reason := _skip_reason(provider, device, small)) is not None:
        pytest.skip(reason)
    B, L, H, V, dtype = _shape(HIDDEN_SIZES, size, SMALL_HIDDEN, device, small)
    skip_unless_fits(case_bytes("hidden", provider, mode, (B, L, H, V, dtype)))
    t = make_inputs(B, L, V, device)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(B, L, H, generator=g).to(device, dtype).requires_grad_(mode == "full")
    weight = (torch.randn(V, H, generator=g) * 0.5 * H**-0.5).to(device, dtype).requires_grad_(mode == "full")
    with _backend_ctx(device, small):
        fn = hidden_call(provider, t, hidden, weight)
        _pedantic(benchmark, fn, mode, 1 if small else 3)
    flops = 2 * B * L * H * V * (1 if mode == "fwd" else 3)
    benchmark.extra_info.update(shape=f"B={B} L={L} H={H} V={V} {dtype}")
    if benchmark.stats is not None:
        benchmark.extra_info["TFLOP_per_s"] = flops / benchmark.stats.stats.median / 1e12


# ---------------------------------------------------------------------------------------------------------
# Side-by-side script: each provider in a fresh subprocess (peak RSS is per process), same shape and options
# ---------------------------------------------------------------------------------------------------------


def _child(provider: str, B: int, L: int, H: int, V: int, rounds: int) -> None:
    import resource

    torch.manual_seed(0)
    t = make_inputs(B, L, V, "cpu")
    hidden = torch.randn(B, L, H).requires_grad_(True)
    weight = (torch.randn(V, H) * 0.5 * H**-0.5).requires_grad_(True)
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with use_backend("torch"):
        fn = hidden_call(provider, t, hidden, weight)
        times = []
        for _ in range(rounds):
            hidden.grad = weight.grad = None
            t0 = time.perf_counter()
            loss = fn()
            loss.backward()
            times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"provider": provider, "times": times, "loss": float(loss),
                      "grad_w_norm": float(weight.grad.norm()), "peak_rss_MB": peak / 1024,
                      "added_rss_MB": (peak - base_rss) / 1024}))


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2], *map(int, sys.argv[3:8]))
        return
    B, L, H, V = 8, 512, 256, 32000
    rounds = 3
    print(f"linear policy loss fwd+bwd, B={B} L={L} H={H} V={V} fp32, CPU torch threads {torch.get_num_threads()}")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    results = {}
    # Interleave the providers so that background load hits both alike.
    for rep in range(2):
        for provider in ("liger", "ours"):
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", provider, str(B), str(L),
                                  str(H), str(V), str(rounds)], capture_output=True, text=True, env=env, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            results.setdefault(provider, []).append(r)
            print(f"  run {rep} {provider:6s} times {[round(x, 2) for x in r['times']]} s, loss {r['loss']:.6f}, "
                  f"|dW| {r['grad_w_norm']:.6f}, peak RSS {r['peak_rss_MB']:.0f} MB "
                  f"(+{r['added_rss_MB']:.0f} MB over inputs)")
    best = {p: min(min(r["times"]) for r in rs) for p, rs in results.items()}
    mem = {p: max(r["added_rss_MB"] for r in rs) for p, rs in results.items()}
    print(f"  best fwd+bwd: liger {best['liger']:.2f} s, ours {best['ours']:.2f} s -> "
          f"{best['liger'] / best['ours']:.2f}x; added peak RSS liger {mem['liger']:.0f} MB, ours {mem['ours']:.0f} MB")


if __name__ == "__main__":
    main()
