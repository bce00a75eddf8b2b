"""Weight-sync bandwidth: a full sync of Qwen2.5-0.5B-shaped random fp32 weights (494M params, 1.98 GB) from this
process to a real embedded-engine server process (HTTP metadata + buckets + the engine's load into its
parameters), by each transport, against a copy of the same number of bytes on the same device, side by side in
one run:

    colocated  the engine maps the trainer's two bucket slots once (/dev/shm on CPU, CUDA IPC on GPU)
    broadcast  a gloo (CPU) / NCCL (GPU) process group; on one GPU it needs a second GPU for the engine

`python bench/bench_weight_sync.py --json` prints one JSON object (memcpy_gbps, colocated_gbps, broadcast_gbps,
ratios, bytes, buckets, machine load). Under pytest (`make bench`) the same measurement runs; with
--benchmark-disable (`make test`) a 2-layer, 8k-vocab model of the same widths runs once instead.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time

import torch
import trio
from torch import nn

if __package__ in (None, ""):  # `python bench/bench_weight_sync.py`: the repository root on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engines.embedded.launch import free_port  # noqa: E402
from engines.sglang import SGLangEngine  # noqa: E402
from trainer.weight_sync import WeightSyncSender  # noqa: E402


def qwen25_05b_shapes(num_layers: int = 24, vocab: int = 151936, *, h: int = 896, kv: int = 128,
                      inter: int = 4864) -> dict[str, tuple[int, ...]]:
    """Parameter names/shapes of Qwen2.5-0.5B (hidden 896, 14 q heads / 2 kv heads of 64, MLP 4864, tied lm_head);
    other widths keep its 290 tensors (the `narrow` run)."""
    shapes = {"model.embed_tokens.weight": (vocab, h)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (h, h), p + "self_attn.q_proj.bias": (h,),
            p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        })
    shapes["model.norm.weight"] = (h,)
    return shapes


class ShapeModel(nn.Module):
    """Parameters with HF names and given shapes, nothing else (uninitialised unless `fill`)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], fill: bool = False, device: str = "cpu"):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        for name, shape in shapes.items():
            mod = self
            *path, leaf = name.split(".")
            for part in path:
                if not hasattr(mod, part):
                    mod.add_module(part, nn.Module())
                mod = getattr(mod, part)
            t = torch.randn(shape, generator=g) if fill else torch.empty(shape)
            mod.register_parameter(leaf, nn.Parameter(t.to(device), requires_grad=False))
        self.config = type("Cfg", (), {"vocab_size": shapes["model.embed_tokens.weight"][0]})()


def _serve(shapes, port, device):
    import uvicorn

    from engines.embedded.server import EngineServer, build_app
    from engines.tiny import build_tokenizer

    torch.set_num_threads(1)
    server = EngineServer(ShapeModel(shapes, device=device), build_tokenizer(), model_path="qwen2.5-0.5b-shapes",
                          compile_decode=False)
    uvicorn.run(build_app(server), host="127.0.0.1", port=port, log_level="error")


def copy_timer(nbytes: int, device: str = "cpu"):
    """A function timing one copy of `nbytes` between two buffers on `device` (allocated and touched here once)."""
    src = torch.empty(nbytes // 4, device=device)
    src.fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)

    return lambda: timed(lambda: dst.copy_(src), device)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def timed(fn, device: str) -> float:
    """Seconds `fn()` takes on `device`, its queued device work included: the device is synchronised before the
    clock starts (earlier work is not counted) and before it stops (a CUDA call returns once its work is queued,
    so without the second wait the clock would stop before the copies ran). A no-op wait on CPU."""
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def _start_engine(shapes, device: str):
    port = free_port()
    proc = mp.get_context("spawn").Process(target=_serve, args=(shapes, port, device), daemon=True)
    proc.start()
    eng = SGLangEngine(f"http://127.0.0.1:{port}", timeout_s=300)
    deadline = time.monotonic() + 300
    while not trio.run(eng.health):
        if time.monotonic() > deadline or not proc.is_alive():
            proc.kill()
            raise RuntimeError("bench engine did not start")
        time.sleep(0.2)
    return proc, eng


# The narrow run: Qwen2.5-0.5B's 290 tensors at these widths (3.5 MB), in buckets of its bytes / 33 (its CUDA
# colocated sync has 33 of 64 MiB; the planner makes 41 of these, whole tensors not fitting exactly), so the time is
# the sync's fixed costs (the HTTP call, the bucket signals, the copies' launches on each side), not its bytes.
NARROW = {"vocab": 512, "h": 64, "kv": 16, "inter": 128}
NARROW_BUCKETS = 33


def measure(*, small: bool = False, narrow: bool = False, device: str = "cpu", engine_device: str | None = None,
            repeats: int = 3, bucket_bytes: int | None = None,
            transports: tuple[str, ...] = ("colocated", "broadcast")) -> dict:
    """Every transport against one engine process, and a copy of the same bytes, in one run: after one warm-up
    sync each (buffers allocated, pages touched), `repeats` interleaved rounds (copy, then each transport), so a
    change in the machine's load hits every contender alike; the best time of each is reported (and the median)."""
    shapes = (qwen25_05b_shapes(num_layers=2, vocab=8192) if small else qwen25_05b_shapes(**NARROW) if narrow
              else qwen25_05b_shapes())
    model = ShapeModel(shapes, fill=True, device=device)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if narrow and bucket_bytes is None:
        bucket_bytes = -(-nbytes // NARROW_BUCKETS)
    label = " (2 layers, 8k vocab)" if small else f" (narrow: {NARROW})" if narrow else ""
    out = {"model": "qwen2.5-0.5b-shapes" + label, "tensors": len(shapes), "bytes": nbytes,
           "dtype": "float32", "device": device, "engine_device": engine_device or device,
           "threads": torch.get_num_threads(), "load_1min": os.getloadavg()[0],
           "cpus": os.cpu_count(), "repeats": repeats}
    proc, eng = _start_engine(shapes, engine_device or device)
    senders = {}
    try:
        for transport in transports:
            sender = WeightSyncSender(model, [eng], timeout_s=300, transport=transport, bucket_bytes=bucket_bytes)
            senders[transport] = sender
            sender.init_group()
            sender.sync()
            out[f"{transport}_buckets"] = len(sender.meta.bucket_nbytes)
            out[f"{transport}_bucket_bytes"] = sender.bucket_bytes
        copy = copy_timer(nbytes, device)
        times: dict[str, list[float]] = {name: [] for name in ("memcpy", *transports)}
        for _ in range(repeats):
            times["memcpy"].append(copy())
            for transport, sender in senders.items():
                times[transport].append(timed(sender.sync, device))
        assert trio.run(eng.get_weight_version) == sender.weight_version
    finally:
        for sender in senders.values():
            sender.close()
        proc.kill()
        proc.join(10)
    for name, ts in times.items():
        out[f"{name}_gbps"] = nbytes / min(ts) / 1e9
        out[f"{name}_ms"] = 1e3 * min(ts)
        out[f"{name}_median_ms"] = 1e3 * sorted(ts)[len(ts) // 2]
    for transport in transports:
        out[f"{transport}_vs_memcpy"] = out[f"{transport}_gbps"] / out["memcpy_gbps"]
    out["load_1min_after"] = os.getloadavg()[0]
    return out


def run_all(*, small: bool = False, narrow: bool = False, device: str = "cpu", repeats: int = 3,
            bucket_bytes: int | None = None) -> dict:
    """Both transports where this machine can run them: on GPU the colocated engine shares the trainer's GPU and
    the broadcast one needs a second GPU (NCCL refuses two ranks on one device)."""
    kw = {"small": small, "narrow": narrow, "device": device, "repeats": repeats, "bucket_bytes": bucket_bytes}
    if not device.startswith("cuda"):
        return measure(**kw)
    res = measure(**kw, transports=("colocated",))
    if torch.cuda.device_count() > 1:
        bc = measure(**kw, engine_device="cuda:1", transports=("broadcast",))
        res.update({k: v for k, v in bc.items() if k.startswith("broadcast")})
    else:
        res["broadcast_skipped"] = "one GPU: NCCL cannot broadcast to an engine on the trainer's own device"
    return res


def test_weight_sync_bandwidth(benchmark, request):
    small = request.config.getoption("benchmark_disable")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    result = {}

    def run():
        result.update(run_all(small=small, device=device, repeats=1 if small else 3))

    benchmark.pedantic(run, rounds=1, iterations=1)
    if not result:  # benchmark disabled: pedantic did not run it
        run()
    benchmark.extra_info.update(result)
    print("\n" + json.dumps(result, indent=1))
    assert result["colocated_gbps"] > 0 and ("broadcast_gbps" in result or "broadcast_skipped" in result)


def test_weight_sync_fixed_costs(benchmark, request):
    """The narrow run (the sync's fixed costs: Qwen2.5-0.5B's 290 tensors, 33 buckets' worth, 3.5 MB), colocated
    only; once under --benchmark-disable."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    repeats = 3 if request.config.getoption("benchmark_disable") else 30
    result = {}

    def run():
        result.update(measure(narrow=True, device=device, repeats=repeats, transports=("colocated",)))

    benchmark.pedantic(run, rounds=1, iterations=1)
    if not result:
        run()
    benchmark.extra_info.update(result)
    print("\n" + json.dumps(result, indent=1))
    assert result["tensors"] == 290 and result["colocated_buckets"] >= NARROW_BUCKETS and result["colocated_ms"] > 0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object (default: a readable summary)")
    ap.add_argument("--small", action="store_true", help="2 layers, 8k vocab (a smoke run)")
    ap.add_argument("--narrow", action="store_true", help="the 0.5B's 290 tensors at widths of 64 in buckets of "
                                                          "1/33 of its bytes: the sync's fixed costs, not its bytes")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bucket-mb", type=int, default=None, help="bucket (slot) size in MiB (default: the sender's, "
                                                                "per transport)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the trainer process (the engine uses "
                                                           "1); the memcpy baseline uses the same")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    bucket_bytes = args.bucket_mb << 20 if args.bucket_mb else None
    res = run_all(small=args.small, narrow=args.narrow, device=args.device, repeats=args.repeats,
                  bucket_bytes=bucket_bytes)
    if args.json:
        print(json.dumps(res))
        return
    for k, v in res.items():
        print(f"{k:>22}: {v:.3f}" if isinstance(v, float) else f"{k:>22}: {v}")


if __name__ == "__main__":
    main()
