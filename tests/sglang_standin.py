"""A stand-in for the weight-update side of a stock SGLang 0.5 server, for tests on machines where SGLang cannot run
(its CPU kernels need AVX-512): a child process that joins the trainer's weight-update group exactly the way
SGLang's own code builds it, and receives the stock "direct" format (one broadcast per tensor).

What it re-implements (read from the sglang 0.5.23 wheel, not imported; the module lines cite where):
- python/sglang/srt/model_executor/model_runner_components/weight_updater.py, `init_weights_update_group`:
  rank = rank_offset + tp_rank, then `init_custom_process_group(backend=backend, init_method="tcp://addr:port",
  world_size=world_size, rank=rank, group_name=group_name)`.
- python/sglang/srt/utils/common.py, `init_custom_process_group`: torch's `rendezvous(init_method, rank,
  world_size, timeout)` (a TCPStore client for rank > 0), `store.set_timeout(timeout)`, `PrefixStore(group_name,
  store)` (no trailing slash), then torch's own `_new_process_group_helper(world_size, rank, [], backend, store,
  group_name=group_name, backend_options=None, timeout=timeout, device_id=None)` (which adds `{group_name}/` and
  `{device}/` prefixes of its own), and `_world.pg_group_ranks[pg] = {i: i}`.
- weight_updater.py, `receive_weights_from_distributed` (load_format None): one async `broadcast(src=0)` per tensor
  into `torch.empty(shape, dtype)`, then wait for all.
- python/sglang/srt/managers/io_struct.py: the request fields of InitWeightsUpdateGroupReqInput and
  UpdateWeightsFromDistributedReqInput (anything else is refused, as SGLang's request structs refuse it).

One deviation: SGLang gives the group torch's default timeout (30 min); the stand-in takes `timeout_s` so that a test
whose group never forms ends in seconds.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp

import torch

INIT_FIELDS = {"master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"}
UPDATE_FIELDS = {"names", "dtypes", "shapes", "group_name", "flush_cache", "abort_all_requests", "weight_version",
                 "load_format", "selector", "torch_empty_cache"}


def init_custom_process_group(*, backend: str, init_method: str, world_size: int, rank: int, group_name: str,
                              timeout: datetime.timedelta):
    """SGLang's init_custom_process_group (python/sglang/srt/utils/common.py), the init_method branch it uses."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                      backend_options=None, timeout=timeout, device_id=None)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def _serve(conn, timeout_s: float) -> None:
    """The child: answers ("init", body) and ("update", body) like SGLang's scheduler (tp_rank 0, CPU device)."""
    import torch.distributed as dist

    groups = {}
    timeout = datetime.timedelta(seconds=timeout_s)
    while True:
        op, body = conn.recv()
        if op == "stop":
            return
        try:
            if op == "init":
                groups[body["group_name"]] = init_custom_process_group(
                    backend=body["backend"], init_method=f"tcp://{body['master_address']}:{body['master_port']}",
                    world_size=body["world_size"], rank=body["rank_offset"], group_name=body["group_name"],
                    timeout=timeout)
                conn.send(("ok", None))
            else:
                if body.get("load_format") is not None:
                    raise ValueError(f"the stand-in reads load_format None only, got {body['load_format']!r}")
                group = groups[body["group_name"]]
                weights = [torch.empty(shape, dtype=getattr(torch, dtype))
                           for dtype, shape in zip(body["dtypes"], body["shapes"])]
                handles = [dist.broadcast(w, src=0, group=group, async_op=True) for w in weights]
                for h in handles:
                    h.wait()
                conn.send(("ok", dict(zip(body["names"], weights))))
        except Exception as e:  # noqa: BLE001 - SGLang answers {"success": false, "message": ...}
            conn.send(("error", f"{type(e).__name__}: {e}"))


class StockSGLangStandIn:
    """The trainer-facing side: the engine protocol's weight-sync methods answered as a stock SGLang server answers
    them (no colocated path, no GPU identity, the "direct" format only), each request forwarded to the child.

    received: name -> tensor, what the last update's broadcasts delivered. bodies: (route, body) of every request."""

    def __init__(self, *, timeout_s: float):
        self.url = "http://stock-sglang-standin"
        self.timeout_s = timeout_s
        self.received: dict[str, torch.Tensor] = {}
        self.bodies: list[tuple[str, dict]] = []
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, timeout_s), daemon=True)
        self._proc.start()

    def close(self) -> None:
        if self._proc.is_alive():
            self._conn.send(("stop", None))
            self._proc.join(5)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)

    def _ask(self, op: str, body: dict):
        self._conn.send((op, body))
        if not self._conn.poll(self.timeout_s + 10):
            raise TimeoutError(f"the stand-in did not answer {op} within {self.timeout_s + 10:.0f}s")
        status, value = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"stand-in {op} failed: {value}")
        return value

    async def _request(self, op: str, route: str, body: dict, fields: set[str]):
        import trio

        self.bodies.append((route, dict(body)))
        unknown = set(body) - fields
        if unknown:
            raise ValueError(f"{route}: SGLang's request struct has no fields {sorted(unknown)}")
        return await trio.to_thread.run_sync(self._ask, op, body)

    async def world_size(self) -> int:
        return 1

    async def weight_formats(self) -> tuple[str, ...]:
        return ("direct",)

    async def colocation_info(self) -> dict:
        return {}

    async def gpu_uuids(self) -> tuple[str, ...] | None:
        return None  # a stock SGLang's /server_info names no GPU

    async def colocated_weights(self, body: dict) -> dict:
        raise RuntimeError("a stock SGLang has no /colocated_weights route")

    async def init_weights_update_group(self, *, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str, backend: str,
                                        timeout_s: float | None = None) -> None:
        body = {"master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
                "world_size": world_size, "group_name": group_name, "backend": backend}
        await self._request("init", "/init_weights_update_group", body, INIT_FIELDS)

    async def update_weights_from_distributed(self, meta: dict) -> None:
        self.received = await self._request("update", "/update_weights_from_distributed", meta, UPDATE_FIELDS)

    async def update_weights_from_disk(self, model_path: str, *, weight_version: int | None = None) -> None:
        raise RuntimeError("the stand-in takes weights by broadcast only")
