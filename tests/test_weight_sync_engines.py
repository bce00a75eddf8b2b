"""Weight sync against real embedded-engine processes on loopback: one trainer process and 2 FSDP2 ranks, one and
two engines, verify_sync before/after, an engine killed mid-sync (clear error, no hang), a wedged engine (timeout),
restart and sync again."""

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch
import trio

from engines.embedded.launch import EngineProcess, free_port
from engines.embedded.presets import build_tiny_model
from engines.sglang import SGLangEngine
from engines.weight_sync.wire import WeightSyncError
from trainer.weight_sync import WeightSyncSender, verify_sync

SEED = 3
PROBES = [[1, 20, 21, 22], [1, 40], [1, 7, 8, 9, 10, 11]]


@pytest.fixture(scope="module")
def engines():
    # On the CPU on every machine, as the trainers here are: on a CUDA machine an engine would default to the GPU in
    # bf16, which the colocated transport cannot reach from a CPU trainer and float32's tolerance does not cover.
    a, b = EngineProcess("tiny", seed=SEED, device="cpu"), EngineProcess("tiny", seed=SEED, device="cpu")
    try:
        a.launch(), b.launch()  # both load in parallel
        a.wait_healthy(), b.wait_healthy()
        yield a, b
    finally:
        a.kill()
        b.kill()


def served_dtype(url: str) -> torch.dtype:
    """The dtype the engine at `url` computes in (its /get_model_info): verify_sync's tolerance takes both sides'."""
    return getattr(torch, trio.run(SGLangEngine(url).get_model_info)["dtype"])


def train_step(model, seed=0, lr=0.5):
    """One real optimiser step on next-token loss over random tokens (same data on every rank)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(6, 100, (4, 16), generator=g)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()


def test_sync_one_then_two_engines_after_a_training_step(engines):
    a, b = engines
    trainer = build_tiny_model(SEED)
    ea = SGLangEngine(a.url, timeout_s=60)
    dtype = served_dtype(a.url)
    first = verify_sync(trainer, [ea], PROBES, expected_version=0, engine_dtype=dtype)
    assert first.ok and first.tol == 1e-5  # same seeded initial weights; float32 on both sides
    train_step(trainer)
    stale = verify_sync(trainer, [ea], PROBES, expected_version=0, engine_dtype=dtype)
    assert not stale.ok and stale.max_abs_diff[0] > 1e-3  # the check can fail

    sender = WeightSyncSender(trainer, [ea], timeout_s=60, bucket_bytes=64 << 10, transport="broadcast")
    sender.init_group()
    assert sender.sync() == 1
    res = verify_sync(trainer, [ea], PROBES, expected_version=1, engine_dtype=dtype)
    assert res.ok, res
    assert trio.run(ea.get_weight_version) == 1
    sender.close()

    # two engines, one group of world size 3; B still has the initial weights, A gets them again
    train_step(trainer, seed=1)
    eb = SGLangEngine(b.url, timeout_s=60)
    sender2 = WeightSyncSender(trainer, [ea, eb], timeout_s=60, weight_version=1, transport="broadcast")
    sender2.init_group()
    assert sender2.sync() == 2
    res = verify_sync(trainer, [ea, eb], PROBES, expected_version=2, engine_dtype=served_dtype(b.url))
    assert res.ok and len(res.max_abs_diff) == 2, res
    sender2.close()


@pytest.mark.parametrize("transport", ["broadcast", "colocated"])
def test_engine_killed_mid_sync_then_restarted(engines, transport):
    a, _ = engines
    trainer = build_tiny_model(SEED)
    train_step(trainer, seed=2)
    ea = SGLangEngine(a.url, timeout_s=60)
    timeout_s = 30.0
    sender = WeightSyncSender(trainer, [ea], timeout_s=timeout_s, bucket_bytes=16 << 10, weight_version=10,
                              transport=transport)
    sender.init_group()
    assert len(sender.meta.bucket_nbytes) > 3

    def kill_at(k, n):
        if k == 1:
            a.kill()

    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match=a.url.split("//")[1]) as err:
        sender.sync(on_bucket=kill_at)
    elapsed = time.monotonic() - t0
    assert elapsed < timeout_s / 2, f"the failure took {elapsed:.1f}s to surface: {err.value}"
    assert sender.group is None  # the broken group was dropped
    with pytest.raises(WeightSyncError, match="init_group"):
        sender.sync()

    a.start()  # same port: the trainer's client needs no change
    sender.init_group()
    assert sender.sync() == 11
    assert verify_sync(trainer, [ea], PROBES, expected_version=11, engine_dtype=served_dtype(a.url)).ok


@pytest.mark.parametrize("transport", ["broadcast", "colocated"])
def test_wedged_engine_times_out(engines, transport):
    _, b = engines
    trainer = build_tiny_model(SEED)
    eb = SGLangEngine(b.url, timeout_s=60)
    sender = WeightSyncSender(trainer, [eb], timeout_s=3.0, transport=transport)
    sender.init_group()
    os.kill(b.proc.pid, signal.SIGSTOP)  # alive but answering nothing
    try:
        t0 = time.monotonic()
        with pytest.raises(WeightSyncError):
            sender.sync()
        assert time.monotonic() - t0 < 10
    finally:
        os.kill(b.proc.pid, signal.SIGCONT)
    assert trio.run(eb.health)
    # the engine's half-done receive fails once it runs again; it then refuses to generate from mixed weights
    import httpx

    deadline, status = time.monotonic() + 20, None
    while time.monotonic() < deadline and status != 503:
        status = httpx.post(b.url + "/generate", json={"input_ids": [1, 2]}, timeout=30).status_code
        time.sleep(0.2)
    assert status == 503


def _fsdp_rank(rank: int, port: int, url: str, out):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)  # the trainer's own default group exists too
    try:
        model = build_tiny_model(SEED)
        mesh = init_device_mesh("cpu", (2,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        train_step(model, seed=4)
        sender = WeightSyncSender(model, [SGLangEngine(url, timeout_s=60)], timeout_s=60, bucket_bytes=32 << 10)
        sender.init_group()
        version = sender.sync()
        res = verify_sync(model, [SGLangEngine(url, timeout_s=60)], PROBES, expected_version=version,
                          engine_dtype=served_dtype(url))

        def boom(k, n):  # called on rank 0 only
            raise RuntimeError("boom on rank 0")

        try:  # a failure on rank 0 mid-sync must reach rank 1 (which is gathering), not hang it
            sender.sync(on_bucket=boom)
            failure = "no error"
        except WeightSyncError as e:
            failure = f"WeightSyncError: {e}"
        except RuntimeError as e:
            failure = str(e)
        out.put((rank, version, res.ok, res.max_abs_diff, res.versions, failure, res.tol))
    except BaseException as e:  # noqa: BLE001
        out.put((rank, repr(e)))
        raise
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_sync_from_two_fsdp2_ranks(engines):
    _, b = engines
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_fsdp_rank, args=(r, port, b.url, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = sorted(out.get(timeout=180) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert all(len(r) == 7 for r in results), results
    for rank, version, ok, diffs, versions, _, tol in results:
        assert ok, (rank, diffs, versions)
        assert version == 1 and versions == (1,) and tol == 1e-5  # float32 ranks and engine
    assert results[0][5] == "boom on rank 0"
    assert results[1][5].startswith("WeightSyncError: the weight sync failed on trainer rank 0"), results[1][5]
    assert trio.run(SGLangEngine(b.url).get_weight_version) == 1
