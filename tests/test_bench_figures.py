"""Benchmarks report what they claim (issue 26 item 5): the logits op's GB/s is read against a copy of the same
bytes, measured the same way; its "full" mode times only the op's own traffic (the leaf that requires grad is the
op's input, its gradient fresh each round); the weight-sync clock stops after the device finished. CPU stand-ins:
the benchmark functions run at their smoke size with a minimal `benchmark` fixture, and a device whose work ends
50 ms after the call returns (what `torch.cuda.synchronize` waits for) stands in for CUDA."""

import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))  # the benchmark modules import their helpers as top-level modules

import bench_logprobs as bl  # noqa: E402
import bench_weight_sync as bw  # noqa: E402


class _Benchmark:
    """pytest-benchmark's `benchmark` fixture, as much of it as the suites use (pedantic, extra_info, stats)."""

    def __init__(self):
        self.extra_info, self.stats = {}, None

    def pedantic(self, fn, rounds, iterations=1, warmup_rounds=0):
        for _ in range(warmup_rounds):
            fn()
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        self.stats = SimpleNamespace(stats=SimpleNamespace(median=sorted(times)[len(times) // 2]))


SMOKE = SimpleNamespace(config=SimpleNamespace(getoption=lambda name: True))  # --benchmark-disable: smoke size
SIZE = next(iter(bl.LOGITS_SIZES))  # the one size the smoke run measures


def test_logprobs_analytic_bytes():
    # fwd reads the [T, V] logits; fwd+bwd reads them twice and writes their gradient.
    assert bl.logits_bytes(16384, 151936, 2, "fwd") == 16384 * 151936 * 2
    assert bl.logits_bytes(16384, 151936, 2, "full") == 3 * 16384 * 151936 * 2


@pytest.mark.parametrize("mode", ["fwd", "full"])
def test_copy_provider_moves_the_ops_bytes_and_the_others_read_against_it(mode):
    assert bl.LOGITS_PROVIDERS[0] == "copy"  # the outer parametrize loop: it runs before the providers it rates
    T, V, dtype = bl.SMALL_LOGITS
    expected = bl.logits_bytes(T, V, dtype.itemsize, mode)
    copy, copied = bl.copy_call(expected, "cpu")
    assert copied == expected
    dst = copy()
    assert dst.nbytes * 2 == expected and bool((dst == 1).all())  # a real copy of src (ones), read + write

    bl._COPY_GB_PER_S.clear()
    rows = {}
    for provider in ("copy", "ours"):
        rows[provider] = b = _Benchmark()
        bl.test_logprobs_from_logits(b, SMOKE, provider, mode, SIZE)
    assert rows["copy"].extra_info["bytes"] == rows["ours"].extra_info["bytes"] == expected
    assert rows["copy"].extra_info["GB_per_s"] > 0
    ratio = rows["ours"].extra_info["GB_per_s"] / rows["copy"].extra_info["GB_per_s"]
    assert rows["ours"].extra_info["GB_per_s_vs_copy"] == pytest.approx(ratio)


def _leaf_feeders(*outs: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """(node, leaf) for every leaf the outputs' autograd graph accumulates into: the node whose gradient lands
    in the leaf's .grad (a SliceBackward0 there scatters into a zero gradient of the bigger leaf first)."""
    seen, found, todo = set(), [], [o.grad_fn for o in outs if o is not None]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for nxt, _ in node.next_functions:
            if nxt is not None and type(nxt).__name__ == "AccumulateGrad":
                found.append((type(node).__name__, nxt.variable))
            todo.append(nxt)
    return found


@pytest.mark.parametrize("provider", ["torch", "ours", "ours-entropy"])
def test_full_mode_times_only_the_ops_traffic(provider):
    T, V, dtype = bl.SMALL_LOGITS
    labels, mask, grads = bl._inputs(T, V, "cpu")
    logits = bl.logits_input(provider, T, V, dtype, "cpu", requires_grad=True)
    assert logits.is_leaf and logits.shape == (T, V)  # the op's input itself, not a slice of a bigger leaf
    call = bl.logits_call(provider, logits, labels, mask)
    feeders = _leaf_feeders(*call())
    assert feeders and all(leaf is logits for _, leaf in feeders)
    assert not [n for n, _ in feeders if n.startswith(("Slice", "Select", "AsStrided", "Index"))], feeders

    run = bl._run_mode(call, "full", grads, leaves=(logits,))
    run()
    first = logits.grad.clone()
    run()  # a second round writes a fresh gradient: no accumulation pass over the first one
    torch.testing.assert_close(logits.grad, first, rtol=0, atol=0)


@pytest.fixture
def slow_device(monkeypatch):
    """The device's work ends 50 ms after a call returns: _sync (torch.cuda.synchronize on CUDA) waits for it."""
    monkeypatch.setattr(bw, "_sync", lambda device: time.sleep(0.05))


def test_timed_waits_for_the_device_before_stopping_the_clock(slow_device):
    assert bw.timed(lambda: None, "cuda") >= 0.05


def test_weight_sync_transports_are_timed_to_the_devices_end(slow_device, monkeypatch):
    class Engine:
        async def get_weight_version(self):
            return 1

    class Sender:  # returns at once, as a CUDA sender does once its copies are queued
        def __init__(self, model, engines, **kw):
            self.meta, self.bucket_bytes, self.weight_version = SimpleNamespace(bucket_nbytes=[64]), 64, 1

        def init_group(self):
            pass

        def sync(self):
            pass

        def close(self):
            pass

    monkeypatch.setattr(bw, "qwen25_05b_shapes", lambda **kw: {"model.embed_tokens.weight": (8, 4)})
    monkeypatch.setattr(bw, "_start_engine", lambda shapes, device: (SimpleNamespace(kill=lambda: None,
                                                                                      join=lambda t: None), Engine()))
    monkeypatch.setattr(bw, "WeightSyncSender", Sender)
    out = bw.measure(small=True, repeats=2)
    assert out["memcpy_ms"] >= 50 and out["colocated_ms"] >= 50 and out["broadcast_ms"] >= 50
