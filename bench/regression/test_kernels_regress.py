"""Kernel regression set: every case times our op and an eager torch yardstick of the same math, side by side.

    make bench-save / make bench-check      (bench/gate.py: median(ours) / median(torch), against a saved
                                             per-device baseline; see docs/components.md "Kernel regression gate")

Cases (fwd = forward only, full = forward + backward with a random upstream gradient):
    logprobs-logits-{fwd,full}    kernels.token_logprobs            vs log_softmax + gather
    logprobs-hidden-{fwd,full}    kernels.linear_token_logprobs     vs hidden @ weight.T, log_softmax + gather
    policy-loss-logits-full       kernels.policy_loss               vs the same clipped PPO loss + k3 KL, eager
    policy-loss-hidden-full       kernels.linear_policy_loss        vs hidden @ weight.T, then the same eager loss
    pack-full, unpack-fwd         kernels.pack / kernels.unpack     vs boolean-mask indexing of the padded batch
The yardsticks live here, not in kernels/reference.py: a baseline's ratios stay comparable only while the
denominator does not change, and the float64 references are free to change for clarity.

Sizes: CPU sizes that keep the whole set under two minutes on 2 busy cores; CUDA sizes of a 0.5B-parameter
policy (H=896, V=151936, 8192 tokens, bf16). Under --benchmark-disable (`make test`) each case runs once at a tiny
size so that the set cannot rot. On CPU both sides run the torch path single-threaded (the root conftest turns the
Triton interpreter on, a correctness tool, not something to time) and bench/gate.py times them by process CPU
time; on CUDA by wall clock, with a device synchronisation ending each round.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from gate import parse_slow_case, settled  # bench/gate.py (bench/ is on sys.path: see conftest.py)

from kernels import (
    LossInputs,
    PolicyLossConfig,
    linear_policy_loss,
    linear_token_logprobs,
    pack,
    policy_loss,
    token_logprobs,
    unpack,
    use_backend,
)
from kernels.device import triton_interpret


@dataclass(frozen=True)
class Sizes:
    T: int  # tokens (policy loss: B rows of T // B)
    V: int
    H: int
    dtype: torch.dtype
    pack: tuple[int, int, int]  # padded batch [B, L, D] for the packing cases
    blocks: int  # interleaved blocks per case (see pytest_generate_tests)
    rounds: int  # per block, times the case's multiplier
    warmup: int  # warm-up rounds (torch then ours) at least, before the first block; at most WARMUP_MAX_ROUNDS
    threads: int | None  # torch CPU threads while timing, the same for both sides (None: leave as is)


SIZES = {
    "cpu": Sizes(T=512, V=32000, H=256, dtype=torch.float32, pack=(32, 1024, 256), blocks=15, rounds=1, warmup=3,
                 threads=1),
    "cuda": Sizes(T=8192, V=151936, H=896, dtype=torch.bfloat16, pack=(64, 4096, 896), blocks=10, rounds=5,
                  warmup=3, threads=None),
    "smoke": Sizes(T=64, V=1271, H=32, dtype=torch.float32, pack=(4, 32, 8), blocks=1, rounds=1, warmup=0,
                   threads=1),
}
# Warm-up: rounds of torch then ours until the median ratio of the last WARMUP_WINDOW rounds is within
# WARMUP_TOLERANCE of the WARMUP_WINDOW before (gate.settled), at most WARMUP_MAX_ROUNDS (a case that never
# settles is timed anyway; extra_info's warmup_settled says so).
WARMUP_WINDOW = 3
WARMUP_TOLERANCE = 0.05
WARMUP_MAX_ROUNDS = 12
B = 4  # rows of the policy-loss cases
CONFIG = PolicyLossConfig(loss_agg="token-mean", clip_low=0.2, clip_high=0.2, kl_coef=0.04, kl_type="k3")


# ---------------------------------------------------------------------------------------------------------
# Eager torch yardsticks (fp32 math, the plainest formulation)
# ---------------------------------------------------------------------------------------------------------


def eager_logprobs(logits, labels, mask):
    """logits [..., V] -> log p(labels) [...] in fp32, 0 where masked."""
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return logp * mask


def eager_policy_loss(logits, labels, adv, mask, old, ref):
    """Token-mean clipped PPO surrogate + 0.04 · k3 KL to ref over [B, L] (CONFIG's objective)."""
    logp = eager_logprobs(logits, labels, mask)
    ratio = torch.exp(torch.clamp(logp - old, -20.0, 20.0))
    a = adv[:, None]
    pg = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1 - CONFIG.clip_low, 1 + CONFIG.clip_high))
    diff = logp - ref
    kl = torch.clamp(torch.exp(-diff) + diff - 1.0, -10.0, 10.0)
    return ((pg + CONFIG.kl_coef * kl) * mask).sum() / mask.sum().clamp(min=1)


def eager_pack(padded, keep):
    """[B, L, D] -> [sum(lengths), D]: the kept slots (keep [B, L] bool) in row order."""
    return padded[keep]


def eager_unpack(flat, keep):
    out = flat.new_zeros(*keep.shape, flat.shape[-1])
    out[keep] = flat
    return out


# ---------------------------------------------------------------------------------------------------------
# Cases: each builds its inputs and returns {"ours": fn, "torch": fn}; fn() -> the tensor to backpropagate
# (with its upstream gradient) or None for forward-only cases
# ---------------------------------------------------------------------------------------------------------


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _token_inputs(shape, V, device, g):
    labels = torch.randint(0, V, shape, generator=g)
    mask = (torch.rand(shape, generator=g) < 0.9).float()
    return labels.to(device), mask.to(device)


def _logits(T, V, s: Sizes, device, g, grad):
    return (2 * torch.randn(T, V, generator=g)).to(device, s.dtype).requires_grad_(grad)


def _hidden(T, s: Sizes, device, g, grad):
    hidden = torch.randn(T, s.H, generator=g).to(device, s.dtype).requires_grad_(grad)
    weight = (torch.randn(s.V, s.H, generator=g) * s.H**-0.5).to(device, s.dtype).requires_grad_(grad)
    return hidden, weight


def _with_grad(out, g):
    """Scalar to backpropagate: a random upstream gradient, never ones."""
    return out if out.ndim == 0 else (out * g).sum()


def logprobs_logits(s: Sizes, device: str, full: bool):
    g = _gen()
    labels, mask = _token_inputs((s.T,), s.V, device, g)
    up = torch.randn(s.T, generator=g).to(device)
    x = _logits(s.T, s.V, s, device, g, full)
    return {
        "ours": lambda: _with_grad(token_logprobs(x, labels, mask=mask), up),
        "torch": lambda: _with_grad(eager_logprobs(x, labels, mask), up),
    }, [x]


def logprobs_hidden(s: Sizes, device: str, full: bool):
    g = _gen()
    labels, mask = _token_inputs((s.T,), s.V, device, g)
    up = torch.randn(s.T, generator=g).to(device)
    hidden, weight = _hidden(s.T, s, device, g, full)
    return {
        "ours": lambda: _with_grad(linear_token_logprobs(hidden, weight, labels, mask=mask), up),
        "torch": lambda: _with_grad(eager_logprobs(hidden @ weight.t(), labels, mask), up),
    }, [hidden, weight]


def _loss_inputs(s: Sizes, device, g):
    L = s.T // B
    labels, mask = _token_inputs((B, L), s.V, device, g)
    adv = torch.randn(B, generator=g)
    # Old log-probs near the current ones (logits ~ N(0, 1) below) so ratios fall on both sides of the clip range.
    old = -math.log(s.V) - 0.5 + 0.3 * torch.randn(B, L, generator=g)
    ref = old + 0.1 * torch.randn(B, L, generator=g)
    return labels, mask, adv.to(device), old.to(device), ref.to(device)


def policy_loss_logits(s: Sizes, device: str, full: bool):
    g = _gen()
    labels, mask, adv, old, ref = _loss_inputs(s, device, g)
    x = (torch.randn(*labels.shape, s.V, generator=g)).to(device, s.dtype).requires_grad_(full)
    inputs = LossInputs(labels, adv[:, None].expand_as(old).contiguous(), mask, old_logprobs=old, ref_logprobs=ref)
    return {
        "ours": lambda: policy_loss(x, inputs, config=CONFIG)[0],
        "torch": lambda: eager_policy_loss(x, labels, adv, mask, old, ref),
    }, [x]


def policy_loss_hidden(s: Sizes, device: str, full: bool):
    g = _gen()
    labels, mask, adv, old, ref = _loss_inputs(s, device, g)
    hidden, weight = _hidden(s.T, s, device, g, full)
    h3 = hidden.view(*labels.shape, s.H)
    inputs = LossInputs(labels, adv[:, None].expand_as(old).contiguous(), mask, old_logprobs=old, ref_logprobs=ref)

    def ours():
        return linear_policy_loss(h3, weight, inputs, config=CONFIG)[0]

    return {
        "ours": ours,
        "torch": lambda: eager_policy_loss(h3 @ weight.t(), labels, adv, mask, old, ref),
    }, [hidden, weight]


def _padded(s: Sizes, device, g, grad):
    Bp, L, D = s.pack
    # RL-like response lengths: log-normal around L/4, clipped to [1, L].
    lengths = torch.clamp(torch.exp(math.log(L / 4) + torch.randn(Bp, generator=g)), 1, L).long()
    keep = torch.arange(L)[None, :] < lengths[:, None]  # [B, L]
    padded = torch.randn(Bp, L, D, generator=g).to(device).requires_grad_(grad)
    return padded, lengths.tolist(), keep.to(device)


def pack_case(s: Sizes, device: str, full: bool):
    g = _gen()
    padded, lengths, keep = _padded(s, device, g, full)
    up = torch.randn(sum(lengths), s.pack[2], generator=g).to(device)
    return {
        "ours": lambda: _with_grad(pack(padded, lengths), up),
        "torch": lambda: _with_grad(eager_pack(padded, keep), up),
    }, [padded]


def unpack_case(s: Sizes, device: str, full: bool):
    g = _gen()
    padded, lengths, keep = _padded(s, device, g, full)
    flat = eager_pack(padded, keep).contiguous()
    L = s.pack[1]
    return {
        "ours": lambda: unpack(flat, lengths, max_len=L),
        "torch": lambda: eager_unpack(flat, keep),
    }, []


# name -> (builder, forward + backward?, rounds multiplier: short cases take more rounds for a stable median)
CASES: dict[str, tuple[Callable, bool, int]] = {
    "logprobs-logits-fwd": (logprobs_logits, False, 6),
    "logprobs-logits-full": (logprobs_logits, True, 1),
    "logprobs-hidden-fwd": (logprobs_hidden, False, 1),
    "logprobs-hidden-full": (logprobs_hidden, True, 1),
    "policy-loss-logits-full": (policy_loss_logits, True, 1),
    "policy-loss-hidden-full": (policy_loss_hidden, True, 1),
    "pack-full": (pack_case, True, 4),
    "unpack-fwd": (unpack_case, False, 8),
}


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


@functools.lru_cache(maxsize=1)  # the inputs of one case at a time, shared by its blocks and both sides
def _built(case: str, device: str, smoke: bool):
    s = SIZES["smoke" if smoke else device]
    build, full, scale = CASES[case]
    return s, full, scale, *build(s, device, full)


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


# Each case alternates torch and ours in many short blocks (torch-b0, ours-b0, torch-b1, ...): the gate takes the
# median over blocks of median(ours) / median(torch), each ratio from two windows a fraction of a second apart, so
# a shift of the machine's load between blocks cancels, and a burst that hits one side of one block is one outlier
# among many. More, shorter blocks for the same rounds in all: 15 blocks of 1 round (times the case's multiplier)
# on CPU, 10 of 5 on CUDA, where 5 blocks of 3 and of 10 were.
def pytest_generate_tests(metafunc):
    # The smoke run (--benchmark-disable) only proves that each case runs: one block.
    blocks = 1 if metafunc.config.getoption("benchmark_disable") else SIZES[_device()].blocks
    params = [(c, b, i) for c in CASES for b in range(blocks) for i in ("torch", "ours")]
    metafunc.parametrize(("case", "block", "impl"), params, ids=[f"{c}-b{b}-{i}" for c, b, i in params])


def _slow_factor(case: str) -> float:
    """GATE_SLOW_CASE=<case>[:<factor>] makes our side of that case `factor` times slower (2 without one), to
    prove the gate catches it; unset in every normal run. A name that is no case is an error, not a silent pass."""
    slow = parse_slow_case(os.environ.get("GATE_SLOW_CASE"))
    if slow is None:
        return 1.0
    if slow[0] not in CASES:
        raise ValueError(f"GATE_SLOW_CASE names {slow[0]!r}, which is not a case of this set: one of {list(CASES)}")
    return slow[1] if slow[0] == case else 1.0


def _spin(clock: Callable[[], float], seconds: float):
    """Busy-wait `seconds` on `clock` (process CPU time on CPU: a sleep would not count)."""
    end = clock() + seconds
    while clock() < end:
        pass


@contextlib.contextmanager
def _timing(s: Sizes, device: str):
    """What both sides run under, warm-up included: the same torch thread count (one on CPU: on a shared machine a
    competing process stalls every multi-threaded parallel region, and single-threaded the CPU time that
    bench/gate.py times by is the work the op does) and, on CPU, the torch path of our ops."""
    threads = torch.get_num_threads()
    torch.set_num_threads(s.threads or threads)
    try:
        with use_backend("torch") if device == "cpu" else contextlib.nullcontext():
            yield
    finally:
        torch.set_num_threads(threads)


def _warm_up(runs: dict[str, Callable[[], None]], clear: Callable[[], None], s: Sizes, device: str):
    """Rounds of torch then ours, each timed by the gate's clock, until their ratio settles (gate.settled);
    returns (rounds, settled)."""
    clock = time.perf_counter if device == "cuda" else time.process_time
    ratios: list[float] = []
    for n in range(1, WARMUP_MAX_ROUNDS + 1):
        took = {}
        for impl in ("torch", "ours"):
            clear()
            t0 = clock()
            runs[impl]()
            took[impl] = clock() - t0
        ratios.append(took["ours"] / max(took["torch"], 1e-12))
        if n >= s.warmup and settled(ratios, WARMUP_WINDOW, WARMUP_TOLERANCE):
            return n, True
    return WARMUP_MAX_ROUNDS, False


def test_regress(benchmark, request, case, block, impl):
    device = _device()
    smoke = request.config.getoption("benchmark_disable")
    if device == "cuda" and triton_interpret() and not smoke:
        pytest.skip("TRITON_INTERPRET=1 would time the Triton interpreter on CUDA; run `make bench-check`, "
                    "which sets TRITON_INTERPRET=0")
    s, full, scale, fns, leaves = _built(case, device, smoke)
    clock = time.perf_counter if device == "cuda" else time.process_time

    def runner(side: str, slow: float = 1.0):
        def run():
            t0 = clock()
            out = fns[side]()
            if full:
                out.backward()
            _sync(device)
            if slow > 1.0:  # the injected slowdown: this round's own time, stretched by the factor
                _spin(clock, (clock() - t0) * (slow - 1.0))
        return run

    def clear_grads():
        for t in leaves:
            t.grad = None

    run = runner(impl, _slow_factor(case) if impl == "ours" else 1.0)

    benchmark.group = case
    benchmark.extra_info.update(case=case, impl=impl, block=block, device=device, threads=s.threads,
                                dtype=str(s.dtype).removeprefix("torch."),
                                shape=f"T={s.T} V={s.V} H={s.H} pack={s.pack}")
    with _timing(s, device):
        if block == 0 and impl == "torch" and not smoke:  # the case's first benchmark warms both sides
            rounds, ok = _warm_up({"torch": runner("torch"), "ours": runner("ours")}, clear_grads, s, device)
            benchmark.extra_info.update(warmup_rounds=rounds, warmup_settled=ok)
        benchmark.pedantic(run, setup=clear_grads, rounds=s.rounds * scale, iterations=1)
