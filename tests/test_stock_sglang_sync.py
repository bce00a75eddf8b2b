"""Stock SGLang protocol against the embedded engine: a client that speaks stock SGLang only (no colocated probe,
no bucketed extension, no `timeout_s`) syncs one broadcast per tensor with exactly SGLang's request fields, and the
engine's log-probs then equal the trainer's; the sender negotiates the format per engine from /get_server_info,
and a stock engine beside a colocated one gets per-tensor broadcasts while the other reads the shared slots.

The embedded engine is our code on both sides of the group, so it cannot prove that a stock SGLang joins it:
`test_the_trainer_joins_a_group_built_by_sglangs_own_helper` puts a stand-in on the other side that builds the
group the way SGLang 0.5's `init_custom_process_group` does (tests/sglang_standin.py)."""

import pytest
import torch
import trio
from sglang_standin import StockSGLangStandIn

from engines.embedded.launch import EngineProcess
from engines.embedded.presets import build_tiny_model
from engines.sglang import SGLangEngine
from engines.weight_sync.wire import WeightSyncError
from trainer.weight_sync import WeightSyncSender, verify_sync

SEED = 5
PROBES = [[1, 20, 21, 22], [1, 40], [1, 7, 8, 9, 10, 11]]
# SGLang's io_struct field names (UpdateWeightsFromDistributedReqInput, InitWeightsUpdateGroupReqInput)
STOCK_UPDATE_FIELDS = {"names", "dtypes", "shapes", "group_name", "flush_cache", "abort_all_requests",
                       "weight_version", "load_format", "torch_empty_cache"}
STOCK_INIT_FIELDS = {"master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"}


class RecordingEngine(SGLangEngine):
    """Records every body the sender posts to the weight routes."""

    def __init__(self, url, **kw):
        super().__init__(url, **kw)
        self.bodies: list[tuple[str, dict]] = []

    async def _call(self, method, route, body=None, timeout_s=None):
        if body is not None:
            self.bodies.append((route, dict(body)))
        return await super()._call(method, route, body, timeout_s)


@pytest.fixture(scope="module")
def engines():
    a, b = EngineProcess("tiny", seed=SEED, device="cpu"), EngineProcess("tiny", seed=SEED, device="cpu")
    try:
        a.launch(), b.launch()
        a.wait_healthy(), b.wait_healthy()
        yield a, b
    finally:
        a.kill()
        b.kill()


def perturb(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


def test_server_info_advertises_the_bucketed_extension(engines):
    a, _ = engines
    info = trio.run(SGLangEngine(a.url).get_server_info)
    assert info["weight_update_formats"] == ["direct", "flattened_bucket", "lora_adapter"] and info["tp_size"] == 1
    assert trio.run(SGLangEngine(a.url, extensions=False).weight_formats) == ("direct",)
    assert trio.run(SGLangEngine(a.url, tp_size=4).world_size) == 4


def test_stock_protocol_sync_matches_the_trainer(engines):
    a, _ = engines
    trainer = build_tiny_model(SEED)
    perturb(trainer, 1)
    eng = RecordingEngine(a.url, timeout_s=60, extensions=False)
    stale = verify_sync(trainer, [eng], PROBES, expected_version=1)
    assert stale.max_abs_diff[0] > 1e-3  # the check can fail
    sender = WeightSyncSender(trainer, [eng], timeout_s=60)  # mode="auto"
    sender.init_group()
    assert sender.per_tensor and sender.broadcast_to == [0] and sender.colocated == []
    assert sender.sync() == 1
    res = verify_sync(trainer, [eng], PROBES, expected_version=1)
    assert res.ok and res.max_abs_diff[0] <= 1e-5, res
    routes = [r for r, _ in eng.bodies]
    assert "/colocated_weights" not in routes
    init = [b for r, b in eng.bodies if r == "/init_weights_update_group"]
    upd = [b for r, b in eng.bodies if r == "/update_weights_from_distributed"]
    assert len(init) == 1 and set(init[0]) <= STOCK_INIT_FIELDS
    assert len(upd) == 1 and set(upd[0]) <= STOCK_UPDATE_FIELDS and upd[0]["load_format"] is None
    assert upd[0]["names"] == [n for n, _ in trainer.named_parameters()]
    assert upd[0]["shapes"] == [list(p.shape) for p in trainer.parameters()] and upd[0]["weight_version"] == "1"
    sender.close()


def test_negotiation_per_engine_with_a_stock_and_a_colocated_engine(engines):
    a, b = engines
    trainer = build_tiny_model(SEED)
    perturb(trainer, 2)
    stock, ours = SGLangEngine(a.url, timeout_s=60, extensions=False), SGLangEngine(b.url, timeout_s=60)
    with pytest.raises(WeightSyncError, match="flattened_bucket"):
        WeightSyncSender(trainer, [stock], timeout_s=60, mode="bucketed").init_group()
    sender = WeightSyncSender(trainer, [stock, ours], timeout_s=60, bucket_bytes=24 << 10, weight_version=6)
    sender.init_group()
    assert sender.per_tensor and sender.broadcast_to == [0] and sender.colocated == [1]
    assert len(sender.meta.bucket_nbytes) > 3  # the colocated engine reads several slots
    assert sender.sync() == 7
    res = verify_sync(trainer, [stock, ours], PROBES, expected_version=7)
    assert res.ok and max(res.max_abs_diff) <= 1e-5, res
    sender.close()
    # our engine alone over broadcast: the negotiated format is the bucketed extension
    perturb(trainer, 3)
    sender = WeightSyncSender(trainer, [ours], timeout_s=60, transport="broadcast", weight_version=7)
    sender.init_group()
    assert not sender.per_tensor
    assert sender.sync() == 8
    assert verify_sync(trainer, [ours], PROBES, expected_version=8).ok
    sender.close()


def test_the_trainer_joins_a_group_built_by_sglangs_own_helper():
    """Two processes over gloo: the trainer's WeightSyncSender (rank 0, hosting the store) and a stand-in that builds
    its side with SGLang 0.5's init_custom_process_group (PrefixStore(group_name) + torch's group helper). Every
    tensor's bytes must arrive; with the store keys of the two sides apart, the group never forms (the timeout)."""
    trainer = build_tiny_model(SEED)
    perturb(trainer, 4)
    stock = StockSGLangStandIn(timeout_s=10)
    try:
        sender = WeightSyncSender(trainer, [stock], timeout_s=10, weight_version=2)
        sender.init_group()
        assert sender.per_tensor and sender.broadcast_to == [0] and sender.backend == "gloo"
        assert sender.sync() == 3
        params = dict(trainer.named_parameters())
        assert list(stock.received) == list(params) and len(params) > 5
        for name, p in params.items():
            assert stock.received[name].dtype == p.dtype and torch.equal(stock.received[name], p.detach()), name
        init = [b for r, b in stock.bodies if r == "/init_weights_update_group"]
        assert init[0]["rank_offset"] == 1 and init[0]["world_size"] == 2 and init[0]["backend"] == "gloo"
        update = [b for r, b in stock.bodies if r == "/update_weights_from_distributed"]
        assert update[0]["group_name"] == init[0]["group_name"] and update[0]["weight_version"] == "3"
        sender.close()
    finally:
        stock.close()


def test_group_store_keys_are_those_of_torchs_group_helper():
    """The device prefix of group_store is the one torch's _new_process_group_helper picks for each backend (the
    first device of Backend.backend_capability): a torch that changes it fails here, not on a GPU box."""
    import torch.distributed as dist

    from engines.weight_sync.wire import GROUP_STORE_DEVICE, group_store

    assert {b: dist.Backend.backend_capability[b][0] for b in GROUP_STORE_DEVICE} == GROUP_STORE_DEVICE
    base = dist.HashStore()
    group_store(base, "G", "gloo").set("0/1", b"x")
    group_store(base, "G", "nccl").set("0", b"y")
    assert base.get("G/G//cpu//0/1") == b"x" and base.get("G/G//cuda//0") == b"y"
    with pytest.raises(ValueError, match="empty"):
        group_store(base, "", "gloo")
