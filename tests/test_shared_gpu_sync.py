"""An engine on the trainer's own GPU that cannot take the weights by handle (a vLLM; any engine under
mode="per_tensor") must never join the NCCL broadcast group with the trainer: NCCL fails with "Duplicate GPU". The
engines report their GPUs (engines.protocol's gpu_uuids) and the sender, before any group exists, syncs such an
engine from disk under transport="auto" and refuses it under transport="broadcast", with the fix.

On CPU: the trainer's GPU is faked (the sender's device_identity reports FAKE_GPU) and backend="nccl" is asked for;
no NCCL group is ever built, which is the point (an attempt would fail here at once)."""

from __future__ import annotations

import os

import pytest
import torch
import trio
from safetensors.torch import load_file

from engines.embedded.presets import build_tiny_model
from engines.protocol import EngineError, WeightSyncEndpoint
from engines.sglang import SGLangEngine
from engines.vllm import VLLMEngine
from engines.weight_sync.wire import WeightSyncError
from trainer.weight_sync import WeightSyncSender

FAKE_GPU = "GPU-5f0c2a7e-0000-4c1d-9a7b-1234567890ab"
OTHER_GPU = "GPU-0b9e1d44-ffff-4e2a-8c3d-ba0987654321"


class GpuEngine:
    """An engine that answers like a vLLM on a GPU: no same-device path, both formats, its GPUs listed (None: it
    does not say, like a stock SGLang). Records the weight routes it is called on; the disk route loads for real."""

    def __init__(self, model, gpus: tuple[str, ...] | None, url: str = "http://vllm-on-gpu"):
        self.url, self.model, self.gpus = url, model, gpus
        self.calls: list[str] = []
        self.version = 0
        self.paths: list[str] = []

    async def world_size(self) -> int:
        return 1

    async def weight_formats(self) -> tuple[str, ...]:
        return ("direct", "flattened_bucket")

    async def colocation_info(self) -> dict:
        return {}

    async def gpu_uuids(self) -> tuple[str, ...] | None:
        return self.gpus

    async def colocated_weights(self, body: dict) -> dict:
        raise EngineError(f"{self.url}: no colocated path", status=404)

    async def init_weights_update_group(self, **kw) -> None:
        self.calls.append("init_weights_update_group")

    async def update_weights_from_distributed(self, meta: dict) -> None:
        self.calls.append("update_weights_from_distributed")

    async def update_weights_from_disk(self, model_path: str, *, weight_version: int | None = None) -> None:
        self.calls.append("update_weights_from_disk")
        self.paths.append(model_path)
        tensors = load_file(os.path.join(model_path, "model.safetensors"))
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(tensors[name])
        self.version = weight_version


@pytest.fixture
def trainer_on_fake_gpu(monkeypatch):
    """The sender sees its device as the GPU FAKE_GPU (the identity wire.device_identity gives a CUDA device)."""
    monkeypatch.setattr("trainer.weight_sync.sender.device_identity",
                        lambda device: {"host": "this-host", "device": FAKE_GPU, "gpus": [FAKE_GPU]})
    model = build_tiny_model(seed=1)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.01)
    return model


def test_an_engine_on_the_trainers_gpu_is_synced_from_disk(trainer_on_fake_gpu):
    trainer = trainer_on_fake_gpu
    engine = GpuEngine(build_tiny_model(seed=1), (FAKE_GPU,))
    assert isinstance(engine, WeightSyncEndpoint)
    sender = WeightSyncSender(trainer, [engine], backend="nccl", timeout_s=10, weight_version=4)
    with pytest.warns(UserWarning, match=f"engines \\['http://vllm-on-gpu'\\] run on this trainer's GPU {FAKE_GPU}"):
        sender.init_group()
    assert sender.to_disk == [0] and sender.broadcast_to == [] and sender.colocated == [] and sender.group is None
    assert engine.calls == []  # no group was asked for
    assert sender.sync() == 5
    assert engine.calls == ["update_weights_from_disk"] and engine.version == 5
    assert os.path.basename(engine.paths[0]) == "v5"
    for (name, p), (_, q) in zip(trainer.named_parameters(), engine.model.named_parameters()):
        assert torch.equal(p, q), name
    folder = os.path.dirname(engine.paths[0])
    sender.close()
    assert not os.path.exists(folder)  # the sync folder goes with the sender


def test_forced_broadcast_to_an_engine_on_the_trainers_gpu_is_refused(trainer_on_fake_gpu):
    engine = GpuEngine(build_tiny_model(seed=1), (OTHER_GPU, FAKE_GPU))  # tp=2, one worker on the trainer's GPU
    sender = WeightSyncSender(trainer_on_fake_gpu, [engine], backend="nccl", timeout_s=10, transport="broadcast")
    with pytest.raises(WeightSyncError, match=f"engines \\['http://vllm-on-gpu'\\] run on this trainer's GPU "
                                              f"{FAKE_GPU}: NCCL cannot .*'Duplicate GPU'.*transport='auto'"):
        sender.init_group()
    assert engine.calls == []  # refused before any group


def test_an_engine_that_does_not_say_its_gpu_is_named_when_the_group_fails(trainer_on_fake_gpu):
    """Unknown GPU (a stock SGLang): broadcast as before; when the NCCL group cannot form (here: no CUDA at all),
    the error names the engine and the fix."""
    unknown = GpuEngine(build_tiny_model(seed=1), None, url="http://stock-sglang")
    elsewhere = GpuEngine(build_tiny_model(seed=1), (OTHER_GPU,), url="http://vllm-elsewhere")
    sender = WeightSyncSender(trainer_on_fake_gpu, [unknown, elsewhere], backend="nccl", timeout_s=10)
    with pytest.raises(WeightSyncError, match="engines \\['http://stock-sglang'\\] do not say which GPU they use.*"
                                              "sync = \"disk\""):
        sender.init_group()
    assert sender.to_disk == [] and sender.broadcast_to == [0, 1]


def test_engines_report_their_gpus(monkeypatch):
    """The embedded engine lists its GPUs in the colocated probe ([] on CPU); a stock SGLang says nothing (None);
    vLLM's answer comes per worker from our worker extension through /collective_rpc."""
    from engines.local import LocalEngine

    local = LocalEngine("tiny", seed=1)
    try:
        assert trio.run(local.gpu_uuids) == ()
        assert trio.run(local.colocation_info)["gpus"] == []
    finally:
        local.close()
    assert trio.run(SGLangEngine("http://127.0.0.1:9", extensions=False).gpu_uuids) is None

    answers = []

    async def fake_call(self, method, route, body=None, params=None):
        assert (method, route, body) == ("POST", "/collective_rpc", {"method": "rlkernels_gpu_uuids"})
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(VLLMEngine, "_call", fake_call)
    vl = VLLMEngine("http://vllm", "m")
    answers.append({"results": [[FAKE_GPU], [OTHER_GPU], [FAKE_GPU]]})  # tp=3, two workers on one GPU
    assert trio.run(vl.gpu_uuids) == (FAKE_GPU, OTHER_GPU)
    answers.append({"results": [[], []]})  # CPU workers
    assert trio.run(vl.gpu_uuids) == ()
    answers.append(EngineError("started without the worker extension", status=500))
    assert trio.run(vl.gpu_uuids) is None
    answers.append(EngineError("no answer"))  # no status: the server is unreachable, which is an error
    with pytest.raises(EngineError, match="no answer"):
        trio.run(vl.gpu_uuids)
    answers.append({"results": "GPU-x"})
    with pytest.raises(EngineError, match="one list of GPU UUIDs per worker"):
        trio.run(vl.gpu_uuids)
