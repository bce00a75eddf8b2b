"""The disk fallback through the embedded engine: a consolidated safetensors folder written atomically, then
SGLang's /update_weights_from_disk; the engine's log-probs then equal the trainer's."""

import os

import pytest
import torch
import trio
from safetensors.torch import save_file

from engines.embedded.launch import EngineProcess
from engines.embedded.presets import build_tiny_model
from engines.protocol import EngineError
from engines.sglang import SGLangEngine
from trainer.weight_sync import DiskWeightSync, default_master_address, verify_sync

SEED = 9
PROBES = [[1, 20, 21, 22], [1, 40, 41], [1, 7, 8, 9, 10, 11]]


def perturb(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


def test_disk_sync_matches_the_trainer(tmp_path):
    trainer = build_tiny_model(SEED)
    with EngineProcess("tiny", seed=SEED, device="cpu") as proc:
        eng = SGLangEngine(proc.url, timeout_s=60)
        perturb(trainer, 1)
        assert verify_sync(trainer, [eng], PROBES, expected_version=0).max_abs_diff[0] > 1e-3
        sync = DiskWeightSync(trainer, [eng], folder=str(tmp_path / "w"))
        sync.init_group()
        assert sync.sync() == 1
        res = verify_sync(trainer, [eng], PROBES, expected_version=1)
        assert res.ok and res.max_abs_diff[0] <= 1e-5, res
        assert os.path.dirname(sync.folder) == str(tmp_path / "w")  # this run's own folder inside the given one
        assert sorted(os.listdir(sync.folder)) == ["v1"]  # no temporary folder left
        perturb(trainer, 2)
        assert sync.sync() == 2
        assert sorted(os.listdir(sync.folder)) == ["v2"]  # only the newest version is kept
        res = verify_sync(trainer, [eng], PROBES, expected_version=2)
        assert res.ok and res.max_abs_diff[0] <= 1e-5, res
        # a folder with a wrong shape is refused before any weight changes
        (tmp_path / "bad").mkdir()
        tensors = {n: p.detach().clone() for n, p in trainer.named_parameters()}
        name = next(iter(tensors))
        tensors[name] = tensors[name][:-1].contiguous()  # one row short
        save_file(tensors, str(tmp_path / "bad" / "model.safetensors"))
        with pytest.raises(EngineError, match="shape"):
            trio.run(lambda: eng.update_weights_from_disk(str(tmp_path / "bad"), weight_version=3))
        with pytest.raises(EngineError, match="not a folder"):
            trio.run(lambda: eng.update_weights_from_disk(str(tmp_path / "none")))
        assert verify_sync(trainer, [eng], PROBES, expected_version=2).ok
        sync.close()
    assert os.listdir(tmp_path / "w") == []  # the run's folder is gone, the given one stays


def test_default_master_address():
    assert default_master_address(["http://127.0.0.1:3000", "http://localhost:3001"]) == "127.0.0.1"
    addr = default_master_address(["http://10.255.255.1:30000"])  # a route lookup, no packet sent
    assert addr != "127.0.0.1" and addr.count(".") == 3
