"""Weight sync: bucket layout and wire format (pure), then the full sender -> receiver path in one process
(receivers run on trio worker threads with their own gloo ranks), per-tensor and bucketed, 1 and 2 receivers."""

import os
import time

import pytest
import torch
import trio

from engines.embedded.presets import build_tiny_model
from engines.protocol import EngineError
from engines.weight_sync.receiver import WeightReceiver
from engines.weight_sync.wire import ALIGN, WeightMeta, WeightSyncError, copy_all, dtype_from_wire, plan_buckets
from trainer.weight_sync import WeightSyncSender
from trainer.weight_sync import sender as sender_mod


def test_plan_buckets_layout_is_aligned_disjoint_and_in_bounds():
    g = torch.Generator().manual_seed(0)
    shapes = [tuple(int(d) for d in torch.randint(1, 40, (int(torch.randint(1, 3, (1,), generator=g)),),
                                                    generator=g)) for _ in range(50)]
    shapes.append((3000,))  # 12000 bytes in fp32: larger than a bucket, gets its own
    names = [f"p{i}" for i in range(len(shapes))]
    meta = plan_buckets(names, shapes, torch.float32, bucket_bytes=4096)
    spans = {}
    for s, off, b in zip(shapes, meta.offsets, meta.bucket_index):
        n = torch.Size(s).numel() * 4
        assert off % ALIGN == 0 and off + n <= meta.bucket_nbytes[b]
        spans.setdefault(b, []).append((off, off + n))
    for b, ss in spans.items():
        ss.sort()
        assert all(a[1] <= c[0] for a, c in zip(ss, ss[1:])), f"overlap in bucket {b}"
        if max(e for _, e in ss) > 4096:
            assert len(ss) == 1, "only a lone oversized tensor may exceed the bucket size"
    assert list(meta.bucket_index) == sorted(meta.bucket_index)  # order preserved
    assert WeightMeta.from_wire(meta.to_wire(weight_version=3, group_name="g")) == meta


@pytest.mark.parametrize("body,match", [
    ({"names": ["a"], "dtypes": ["float32"]}, "shapes"),
    ({"names": ["a"], "dtypes": ["float32", "float32"], "shapes": [[1]]}, "same length"),
    ({"names": ["a"], "dtypes": ["floaty"], "shapes": [[1]]}, "not a torch dtype"),
    ({"names": ["a"], "dtypes": ["float32"], "shapes": [[-1]]}, "non-negative"),
    ({"names": ["a"], "dtypes": ["float32"], "shapes": [[4]], "load_format": "flattened_bucket", "offsets": [0],
      "bucket_index": [0], "bucket_nbytes": [8]}, "does not fit"),
    ({"names": ["a"], "dtypes": ["float32"], "shapes": [[4]], "load_format": "pickle"}, "not supported"),
])
def test_wire_validation_names_the_bad_field(body, match):
    with pytest.raises(ValueError, match=match):
        WeightMeta.from_wire(body)


def test_dtype_names():
    assert dtype_from_wire("torch.bfloat16") is torch.bfloat16 and dtype_from_wire("float32") is torch.float32


class InProcessEngine:
    """The receive side without HTTP: what the embedded server does, on a trio worker thread. It declares the
    weight-sync capability (engines.protocol.WeightSyncEndpoint) the sender calls: one rank, both formats, no
    same-device path."""

    def __init__(self, model):
        self.url, self.model = "inproc", model
        self.receiver = WeightReceiver(model, torch.device("cpu"))
        self.version = 0

    async def world_size(self):
        return 1

    async def weight_formats(self):
        return ("direct", "flattened_bucket")

    async def colocation_info(self):
        return {}

    async def init_weights_update_group(self, **kw):
        await trio.to_thread.run_sync(lambda: self.receiver.init_group(**kw))

    async def update_weights_from_distributed(self, body):
        meta = WeightMeta.from_wire(body)
        targets = self.receiver.check(meta, body["group_name"])
        await trio.to_thread.run_sync(self.receiver.receive, meta, body["group_name"], targets)
        self.version = int(body["weight_version"])


def _perturb(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.01)


@pytest.mark.parametrize("mode,bucket_bytes,n_engines,pack_bytes",
                         [("bucketed", 16 << 10, 1, None), ("bucketed", 16 << 10, 1, 2 << 10),
                          ("bucketed", 512 << 20, 2, None), ("per_tensor", 512 << 20, 1, None)])
def test_sync_in_process_makes_weights_bitwise_equal(mode, bucket_bytes, n_engines, pack_bytes, monkeypatch):
    """pack_bytes: the sender copies what it holds into the slot every 2 KiB, mid-bucket (PACK_BYTES)."""
    if pack_bytes is not None:
        monkeypatch.setattr(sender_mod, "PACK_BYTES", pack_bytes)
    trainer = build_tiny_model(seed=1)
    _perturb(trainer, 123)
    engines = [InProcessEngine(build_tiny_model(seed=1)) for _ in range(n_engines)]
    sender = WeightSyncSender(trainer, engines, bucket_bytes=bucket_bytes, timeout_s=30, mode=mode)
    if mode == "bucketed" and bucket_bytes < (1 << 20):
        assert len(sender.meta.bucket_nbytes) > 4  # exercises the double-buffer reuse
    sender.init_group()
    seen = []
    assert sender.sync(on_bucket=lambda k, n: seen.append(k)) == 1
    for eng in engines:
        assert eng.version == 1
        for (n, p), (_, q) in zip(trainer.named_parameters(), eng.model.named_parameters()):
            assert torch.equal(p, q), n
    # a second sync after another change, and the version keeps counting
    _perturb(trainer, 7)
    assert sender.sync() == 2
    for (n, p), (_, q) in zip(trainer.named_parameters(), engines[0].model.named_parameters()):
        assert torch.equal(p, q), n
    sender.close()


def test_sync_without_group_is_a_clear_error():
    trainer = build_tiny_model(seed=1)
    sender = WeightSyncSender(trainer, [InProcessEngine(build_tiny_model(seed=1))], timeout_s=5)
    with pytest.raises(WeightSyncError, match="init_group"):
        sender.sync()


class RefusingEngine(InProcessEngine):
    """Joins the group, then refuses the first update before its broadcast (as vLLM's adapter-rank check does)."""

    refuse = True

    async def update_weights_from_distributed(self, body):
        if self.refuse:
            self.refuse = False
            raise EngineError("inproc: adapter rank 16 is more than this engine's limit", status=400)
        await super().update_weights_from_distributed(body)


def test_a_refused_update_fails_at_once_and_a_new_group_syncs():
    """The sender's broadcast is left unanswered: gloo's group destructor would wait out the whole group timeout
    (60 s here) before the error reached the caller (wire.shutdown_group)."""
    trainer = build_tiny_model(seed=1)
    _perturb(trainer, 5)
    engine = RefusingEngine(build_tiny_model(seed=1))
    sender = WeightSyncSender(trainer, [engine], timeout_s=60)
    sender.init_group()
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match="adapter rank 16 is more than"):
        sender.sync()
    assert time.monotonic() - t0 < 30  # not the group's 60 s timeout
    assert engine.version == 0
    sender.init_group()  # a new group: the next sync goes through
    assert sender.sync() == 1 and engine.version == 1
    for (n, p), (_, q) in zip(trainer.named_parameters(), engine.model.named_parameters()):
        assert torch.equal(p, q), n
    sender.close()


class ProbedEngine(InProcessEngine):
    """An engine elsewhere (another host) that reports its dtype: the sender broadcasts in that dtype."""

    async def colocation_info(self):
        return {"success": True, "host": "another-host", "device": "cpu",
                "dtype": str(next(self.model.parameters()).dtype).removeprefix("torch.")}


def test_sender_sends_in_the_engines_dtype():
    trainer = build_tiny_model(seed=1)
    _perturb(trainer, 11)
    engine = ProbedEngine(build_tiny_model(seed=1, dtype=torch.bfloat16))
    sender = WeightSyncSender(trainer, [engine], bucket_bytes=16 << 10, timeout_s=30)
    assert sender.dtype == torch.float32  # until the engines are asked
    sender.init_group()
    assert sender.dtype == torch.bfloat16 and set(sender.meta.dtypes) == {"bfloat16"}
    assert sender.broadcast_to == [0] and sender.colocated == []
    fp32_bytes = sum(p.numel() * 4 for p in trainer.parameters())
    assert sum(sender.meta.bucket_nbytes) < 0.51 * fp32_bytes + 64 * len(sender.meta.names)  # half the bytes
    assert sender.sync() == 1
    for (n, p), (_, q) in zip(trainer.named_parameters(), engine.model.named_parameters()):
        assert q.dtype == torch.bfloat16 and torch.equal(p.to(torch.bfloat16), q), n
    sender.close()


def test_engines_that_do_not_report_a_dtype_get_the_fallback_not_the_fp32_masters():
    """A stock engine (colocation_info {}: no dtype) serving bf16: the sender sends the caller's fallback_dtype (the
    CLI's: [engines] dtype, else the trainer's compute dtype), half the bytes of the fp32 masters; an engine that
    reports its dtype still decides."""
    from trainer.config import RunConfig, config_from_dict
    from trainer.run import served_dtype

    trainer = build_tiny_model(seed=1)
    _perturb(trainer, 12)
    engine = InProcessEngine(build_tiny_model(seed=1, dtype=torch.bfloat16))
    sender = WeightSyncSender(trainer, [engine], fallback_dtype=torch.bfloat16, bucket_bytes=16 << 10, timeout_s=30)
    sender.init_group()
    assert sender.dtype == torch.bfloat16 and set(sender.meta.dtypes) == {"bfloat16"}
    assert sender.sync() == 1
    for (n, p), (_, q) in zip(trainer.named_parameters(), engine.model.named_parameters()):
        assert torch.equal(p.to(torch.bfloat16), q), n
    sender.close()
    reported = WeightSyncSender(trainer, [ProbedEngine(build_tiny_model(seed=1))], fallback_dtype=torch.bfloat16,
                                timeout_s=30)
    reported.init_group()
    assert reported.dtype == torch.float32  # the engine said float32
    reported.close()
    # The CLI's choice: [engines] dtype, else the compute dtype ([trainer] param_dtype; float32 on CPU by default).
    assert served_dtype(RunConfig(), trainer) == torch.float32
    assert served_dtype(config_from_dict(RunConfig, {"trainer": {"param_dtype": "bfloat16"}}, ""), trainer) \
        == torch.bfloat16
    assert served_dtype(config_from_dict(RunConfig, {"engines": {"dtype": "float16"}}, ""), trainer) == torch.float16


def test_sender_argument_errors_name_the_fix():
    model = build_tiny_model(seed=1)
    with pytest.raises(ValueError, match="transport='pipes'"):
        WeightSyncSender(model, [], transport="pipes")
    with pytest.raises(ValueError, match="mode='bucketed' with transport='colocated'"):
        WeightSyncSender(model, [], transport="colocated", mode="per_tensor")
    from engines.weight_sync.wire import build_group, create_store

    store = create_store("127.0.0.1", 0, is_master=True, timeout_s=5)
    with pytest.raises(ValueError, match="needs the CUDA device"):
        build_group(store, rank=0, world_size=1, group_name="g", backend="nccl", timeout_s=5)


def test_verify_tolerance_follows_the_compute_dtypes():
    from trainer.weight_sync import verify_tolerance

    assert verify_tolerance(torch.float32) == 1e-5
    assert verify_tolerance(torch.float32, torch.bfloat16) == verify_tolerance(torch.bfloat16) > 1e-3


def test_plan_buckets_splits_a_large_parameter_by_rows_and_the_receiver_loads_each_chunk():
    names, shapes = ["a", "big", "s", "c"], [(10, 7), (1000, 5), (), (3,)]
    meta = plan_buckets(names, shapes, torch.float32, bucket_bytes=4096, split=True)
    assert max(meta.bucket_nbytes) <= 4096 and len(meta.bucket_nbytes) >= 5
    chunks = [(r, s[0]) for n, s, r in zip(meta.names, meta.shapes, meta.rows) if n == "big"]
    assert chunks[0][0] == 0 and sum(k for _, k in chunks) == 1000
    assert all(r0 + k == r1 for (r0, k), (r1, _) in zip(chunks, chunks[1:]))  # contiguous, in order
    assert WeightMeta.from_wire(meta.to_wire(weight_version=1, group_name="g")) == meta
    assert plan_buckets(names, shapes, torch.float32, bucket_bytes=4096).rows == ()  # no split: SGLang's format

    model = build_tiny_model(seed=1)
    rec = WeightReceiver(model, torch.device("cpu"))
    pname, p = next((n, q) for n, q in model.named_parameters() if q.dim() == 2)
    meta = plan_buckets([pname], [tuple(p.shape)], torch.float32, bucket_bytes=p[0].numel() * 4 * 3, split=True)
    views = rec._targets(meta)
    assert len(views) > 1 and all(v.data_ptr() == p[r].data_ptr() for v, r in zip(views, meta.rows))
    bad = WeightMeta(meta.names[:1], meta.dtypes[:1], ((p.shape[0], p.shape[1]),), (0,), (0,), (10**6,),
                     (1,))
    with pytest.raises(ValueError, match="from row 1"):
        rec._targets(bad)  # the whole parameter, announced from row 1
    bad = WeightMeta(meta.names[:1], meta.dtypes[:1], ((2, p.shape[1]),), (0,), (0,), (10**6,), (p.shape[0] - 1,))
    with pytest.raises(ValueError, match="rows"):
        rec._targets(bad)  # past the last row


def test_both_senders_share_the_weight_sync_protocol(tmp_path):
    """The group sender and the disk fallback are interchangeable behind trainer.weight_sync.WeightSync."""
    import math

    from trainer.weight_sync import DiskWeightSync, WeightSync

    model = build_tiny_model(seed=1)
    group = WeightSyncSender(model, [InProcessEngine(build_tiny_model(seed=1))], weight_version=4)
    disk = DiskWeightSync(model, [], folder=str(tmp_path), weight_version=4)
    for sender in (group, disk):
        assert isinstance(sender, WeightSync) and sender.weight_version == 4 and math.isnan(sender.last_sync_s)
    disk.init_group()
    assert disk.sync() == 5 and disk.weight_version == 5 and disk.last_sync_s >= 0
    assert sorted(os.listdir(disk.folder)) == ["v5"] and os.path.dirname(disk.folder) == str(tmp_path)
    disk.close()


def test_copy_all_equals_copying_one_by_one():
    """wire.copy_all (the sender's pack, the engine's load): each dst equal to dst.copy_(src) on fresh random values,
    with casts, a strided dst, a broadcast src, and dsts of mixed dtypes (copied one by one)."""
    g = torch.Generator().manual_seed(9)

    def case(mixed: bool):
        base = torch.zeros(6, 10)
        dsts = [torch.zeros(3, 4), base[:, ::2], torch.zeros(5, 7, dtype=torch.bfloat16 if mixed else torch.float32),
                torch.zeros(4, 3)]
        srcs = [torch.randn(3, 4, generator=g), torch.randn(6, 5, generator=g), torch.randn(5, 7, generator=g),
                torch.randn(3, generator=g)]
        return dsts, srcs

    for mixed in (False, True):
        dsts, srcs = case(mixed)
        want = [d.clone().copy_(s) for d, s in zip(dsts, srcs)]
        copy_all(dsts, srcs)
        for d, w in zip(dsts, want):
            assert d.dtype == w.dtype and torch.equal(d, w)
    copy_all([], [])  # nothing to copy is no error
    with pytest.raises(AssertionError):
        copy_all([torch.zeros(2)], [])
