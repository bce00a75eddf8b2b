"""Colocated weight sync on CPU, end to end through a real embedded-engine process: the trainer's two shared
/dev/shm slots are mapped once by the engine and reused across syncs; forcing broadcast still works; two engines
share the slots. A killed or wedged colocated engine: tests/test_weight_sync_engines.py."""

import glob
import os

import pytest
import torch

from engines.embedded.launch import EngineProcess
from engines.embedded.presets import build_tiny_model
from engines.local import LocalEngine
from engines.sglang import SGLangEngine
from engines.weight_sync import wire as wire_mod
from engines.weight_sync.wire import WeightSyncError, create_slots, device_identity, is_colocated, open_slots
from trainer.weight_sync import WeightSyncSender, verify_sync

SEED = 5
PROBES = [[1, 20, 21, 22], [1, 40], [1, 7, 8, 9, 10, 11]]


ENGINE_SEED = SEED  # the shared `engine` fixture (tests/conftest.py) serves the tiny model of this seed


def train_step(model, seed):
    """One real optimiser step on next-token loss over random tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(6, 100, (4, 16), generator=g).to(next(model.parameters()).device)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


def test_slots_map_the_same_bytes_and_identity_decides_colocation():
    slots, paths, extra = create_slots(4096, torch.device("cpu"))
    try:
        theirs, events = open_slots(extra["wire"], torch.device("cpu"))
        assert events is None and len(theirs) == 2
        data = torch.randint(0, 256, (4096,), dtype=torch.uint8)
        slots[1].copy_(data)
        assert torch.equal(theirs[1], data) and not torch.equal(theirs[0], data)
    finally:
        for p in paths:
            os.unlink(p)
    me = device_identity(torch.device("cpu"))
    assert is_colocated(me, dict(me)) and not is_colocated(me, {**me, "host": "elsewhere"})
    with pytest.raises(ValueError, match="rlkernels-weights"):
        open_slots({"kind": "shm", "nbytes": 8, "paths": ["/etc/passwd"]}, torch.device("cpu"))


def test_colocated_sync_matches_trainer_logprobs_over_two_syncs(engine):
    trainer = build_tiny_model(SEED)
    eng = SGLangEngine(engine.url, timeout_s=60)
    sender = WeightSyncSender(trainer, [eng], timeout_s=60, bucket_bytes=20 << 10)
    sender.init_group()
    assert sender.colocated == [0] and sender.broadcast_to == [] and sender.group is None
    assert max(sender.meta.rows) > 0 and max(sender.meta.bucket_nbytes) <= 20 << 10  # large ones go in row chunks
    n_buckets = len(sender.meta.bucket_nbytes)
    assert n_buckets > 4  # both slots are reused within one sync
    # names unlinked once mapped: nothing can leak (this process's slots: another test worker's sender may be
    # between creating and unlinking its own)
    assert not glob.glob(f"/dev/shm/rlkernels-weights-{os.getpid()}-*")
    slots = [s.data_ptr() for s in sender._slots]
    for step in range(2):  # the second sync reuses the slots the engine mapped at init_group
        train_step(trainer, seed=step)
        stale = verify_sync(trainer, [eng], PROBES, expected_version=step)
        assert stale.max_abs_diff[0] > 1e-3  # the check can fail: the engine still has the old weights
        seen = []
        assert sender.sync(on_bucket=lambda k, n, seen=seen: seen.append(k)) == step + 1
        assert seen == list(range(n_buckets))
        res = verify_sync(trainer, [eng], PROBES, expected_version=step + 1)
        assert res.ok and res.tol == 1e-5 and res.max_abs_diff[0] <= 1e-5, res
    assert [s.data_ptr() for s in sender._slots] == slots
    assert sender._seq == 2 * n_buckets
    sender.close()


def test_forced_broadcast_still_works_and_colocated_resumes(engine):
    trainer = build_tiny_model(SEED)
    train_step(trainer, seed=7)
    eng = SGLangEngine(engine.url, timeout_s=60)
    sender = WeightSyncSender(trainer, [eng], timeout_s=60, transport="broadcast", weight_version=20)
    sender.init_group()
    assert sender.broadcast_to == [0] and sender.colocated == [] and sender.group is not None
    assert sender.sync() == 21
    assert verify_sync(trainer, [eng], PROBES, expected_version=21).ok
    sender.close()
    # the same engine, colocated again (a new attach replaces the old slots)
    train_step(trainer, seed=8)
    sender = WeightSyncSender(trainer, [eng], timeout_s=60, transport="colocated", weight_version=21)
    sender.init_group()
    assert sender.sync() == 22
    assert verify_sync(trainer, [eng], PROBES, expected_version=22).ok
    sender.close()


def test_forced_colocated_refuses_an_engine_elsewhere():
    class Remote:  # an engine that reports another host
        url = "http://remote"

        async def colocation_info(self):
            return {"success": True, "host": "other-host", "device": "cpu", "dtype": "float32"}

        async def weight_formats(self):
            return ("direct", "flattened_bucket")

    sender = WeightSyncSender(build_tiny_model(SEED), [Remote()], timeout_s=5, transport="colocated")
    with pytest.raises(WeightSyncError, match="do not share this trainer's device"):
        sender.init_group()


def test_two_colocated_engines_share_the_slots():
    trainer = build_tiny_model(SEED)
    with EngineProcess("tiny", seed=SEED, device="cpu") as a, EngineProcess("tiny", seed=SEED, device="cpu") as b:
        engines = [SGLangEngine(a.url, timeout_s=60), SGLangEngine(b.url, timeout_s=60)]
        sender = WeightSyncSender(trainer, engines, timeout_s=60, bucket_bytes=24 << 10)
        sender.init_group()
        assert sender.colocated == [0, 1] and sorted(sender._socks) == [0, 1]
        for step in range(2):  # a slot is reused only when both engines copied it out
            train_step(trainer, seed=10 + step)
            assert sender.sync() == step + 1
            res = verify_sync(trainer, engines, PROBES, expected_version=step + 1)
            assert res.ok and len(res.max_abs_diff) == 2, res
        sender.close()


def _two_colocated_cuda_syncs(trainer, eng) -> None:
    """Two train steps, each synced through the colocated CUDA slots and verified on the engine."""
    sender = WeightSyncSender(trainer, [eng], timeout_s=120, bucket_bytes=20 << 10)
    sender.init_group()
    assert sender.colocated == [0] and sender._events is not None  # same GPU UUID: CUDA slots and events
    for step in range(2):
        train_step(trainer, seed=step)
        assert sender.sync() == step + 1
        res = verify_sync(trainer, [eng], PROBES, expected_version=step + 1)
        assert res.ok, res
    sender.close()


@pytest.mark.gpu
def test_colocated_sync_on_one_gpu_uses_cuda_ipc_slots():
    trainer = build_tiny_model(SEED).cuda()
    with EngineProcess("tiny", seed=SEED, extra_args=("--device", "cuda", "--dtype", "float32")) as proc:
        eng = SGLangEngine(proc.url, timeout_s=120)
        _two_colocated_cuda_syncs(trainer, eng)


@pytest.mark.gpu
def test_colocated_sync_on_one_gpu_with_an_in_process_engine():
    """The demo's one-GPU layout: the engine in the trainer's process on the same GPU. CUDA cannot open an IPC handle
    in the process that made it, so the engine takes the trainer's own slot tensors and events (the first GPU demo
    failed at this attach with "invalid device context")."""
    trainer = build_tiny_model(SEED).cuda()
    eng = LocalEngine("tiny", seed=SEED, device="cuda", dtype=torch.float32)
    try:
        _two_colocated_cuda_syncs(trainer, eng)
    finally:
        eng.close()


def test_handles_made_here_give_back_the_object_and_a_dropped_one_is_an_error():
    """What the in-process engine relies on, on the CPU: a handle from this process yields the very object; one from
    another process yields None (the IPC path opens it); a handle whose object the trainer dropped names the fix."""
    t = torch.randn(7)
    key, here = wire_mod._share_here(t), {"process": wire_mod._PROCESS, "pid": os.getpid()}
    assert wire_mod._shared_here(here, key, "CUDA tensor") is t
    # another process, even one with our pid (another PID namespace): None, the IPC path opens it
    assert wire_mod._shared_here({"process": "another", "pid": os.getpid()}, key, "CUDA tensor") is None
    assert wire_mod._shared_here({}, key, "CUDA tensor") is None  # an older trainer's handle
    gone = wire_mod._share_here(torch.randn(3))  # no reference kept: the weak entry is gone
    with pytest.raises(ValueError, match="re-run init_group"):
        wire_mod._shared_here(here, gone, "CUDA tensor")
