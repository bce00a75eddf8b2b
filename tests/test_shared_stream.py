"""One CUDA stream for the trainer and an in-process engine that generates while it waits (kernels.device.
shared_stream; issue 42 item 1: the caching allocator keeps a freed block for the stream that allocated it, so on
two streams a colocated run holds the engine's KV cache and the trainer's activations side by side).

No GPU here: CUDA's stream objects are replaced by stand-ins that record which stream each piece of work was queued
under. Proven: the trainer's compute stream is the process's shared one (one per device, whatever component asks);
an engine given it runs every piece of its model-thread work (decode steps, weight loads) under it, and an engine
without it under none; the run shares it in synchronous RL on CUDA only (tests/test_engine_kinds.py: the run's
choice reaches the in-process engine).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest
import torch
import trio

import kernels.device as device_mod
from engines.embedded.generation import DecodeBatch
from engines.protocol import SamplingParams
from engines.registry import EngineSpec, build_engine
from trainer.backend.futures import DeviceStreams


class FakeStream:
    def __init__(self, device=None):
        self.device = device


@pytest.fixture
def fake_cuda_streams(monkeypatch):
    """torch.cuda.Stream / current_device / stream(...) as stand-ins; returns the per-thread stack of streams."""
    local = threading.local()

    @contextlib.contextmanager
    def stream(s):
        local.stack = [*getattr(local, "stack", []), s]
        try:
            yield
        finally:
            local.stack = local.stack[:-1]

    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(device_mod, "_SHARED_STREAMS", {})
    return local


def test_every_trainer_component_computes_on_the_shared_stream(fake_cuda_streams):
    policy, reference = DeviceStreams(torch.device("cuda", 0)), DeviceStreams(torch.device("cuda"))
    assert policy.compute is reference.compute is device_mod.shared_stream("cuda:0")
    assert policy.copy is not policy.compute  # the copy stream stays its own (it overlaps the next micro-batch)
    assert device_mod.shared_stream("cuda:1") is not policy.compute


@pytest.mark.parametrize("shared", [True, False])
def test_an_engine_given_the_stream_runs_all_its_model_work_under_it(fake_cuda_streams, monkeypatch, shared):
    under = []
    step = DecodeBatch.step

    def recording(self, new=()):
        under.append(tuple(getattr(fake_cuda_streams, "stack", [])))
        return step(self, new)

    monkeypatch.setattr(DecodeBatch, "step", recording)
    engine = build_engine(EngineSpec("local"), model_folder="tiny", seed=0)
    try:
        # The engine is on the CPU (no stream to share there): give it the process's stream as CUDA would.
        assert engine.server.stream is None
        sentinel = device_mod.shared_stream("cuda:0")
        engine.server.stream = sentinel if shared else None
        out = trio.run(engine.generate, [[5, 6, 7], [8, 9]], SamplingParams(max_new_tokens=6, n=2, seed=3))
        assert len(out) == 2
        # Other model-thread work (a weight load, an adapter write) goes the same way, on the server's loop.
        load = asyncio.run_coroutine_threadsafe(
            engine.server.on_model_thread(lambda: tuple(getattr(fake_cuda_streams, "stack", []))),
            engine._loop).result(timeout=30)
    finally:
        engine.close()
    assert len(under) >= 6
    want = (sentinel,) if shared else ()
    assert all(u == want for u in under) and load == want
