"""The engine's side of weight sync: join the dedicated group, receive broadcasts, load into the live model.

Runs in worker threads (the server's event loop stays free). Weights are loaded bucket by bucket as they arrive
(like SGLang), so a failed sync leaves a partial update: the server marks itself inconsistent and answers
/generate with 503 until the next sync succeeds; weight_version only moves on success.
"""

from __future__ import annotations

import torch
from torch import nn

from engines.weight_sync import (
    WeightMeta,
    broadcast_async,
    build_group,
    create_store,
    dtype_from_wire,
    ipc_handle_from_wire,
    wait_work,
)


class WeightReceiver:
    """Holds the weight-update groups of one engine process (mutable state: the groups)."""

    def __init__(self, model: nn.Module, device: torch.device):
        self.model, self.device = model, device
        self.groups: dict[str, tuple] = {}  # name -> (process group, store, timeout_s)
        self._buffers: list[torch.Tensor] = []  # two uint8 bucket buffers, reused across syncs

    def init_group(self, *, master_address: str, master_port: int, rank_offset: int, world_size: int,
                   group_name: str, backend: str, timeout_s: float) -> None:
        """Join as rank `rank_offset` (this engine is one process). Blocks until the group has formed."""
        if not 0 < rank_offset < world_size:
            raise ValueError(f"rank_offset={rank_offset} must be in [1, world_size={world_size}) (rank 0 = trainer)")
        if backend == "nccl" and self.device.type != "cuda":
            raise ValueError("backend='nccl' needs a CUDA engine; this engine runs on CPU, use 'gloo'")
        self.destroy_group(group_name)
        store = create_store(master_address, master_port, is_master=False, timeout_s=timeout_s)
        pg = build_group(store, rank=rank_offset, world_size=world_size, group_name=group_name, backend=backend,
                         timeout_s=timeout_s)
        self.groups[group_name] = (pg, store, timeout_s)

    def destroy_group(self, group_name: str) -> bool:
        entry = self.groups.pop(group_name, None)
        if entry is not None:
            try:
                entry[0].shutdown()
            except Exception:  # noqa: BLE001 - a broken group may refuse a clean shutdown
                pass
        return entry is not None

    def _targets(self, meta: WeightMeta) -> list[torch.Tensor]:
        """The live parameter for each name, checking names and shapes before any byte is received."""
        params = dict(self.model.named_parameters())
        out = []
        for name, shape in zip(meta.names, meta.shapes):
            p = params.get(name)
            if p is None:
                raise ValueError(f"unknown parameter name {name!r} (the engine's model has e.g. "
                                 f"{next(iter(params))!r}); send the HF names")
            if tuple(p.shape) != tuple(shape):
                raise ValueError(f"parameter {name!r} has shape {tuple(p.shape)}, the update sends {tuple(shape)}")
            out.append(p)
        return out

    def check(self, meta: WeightMeta, group_name: str) -> list[torch.Tensor]:
        if group_name not in self.groups:
            raise ValueError(f"group {group_name!r} not initialised here: call /init_weights_update_group first "
                             f"(known: {sorted(self.groups)})")
        return self._targets(meta)

    def receive(self, meta: WeightMeta, group_name: str, targets: list[torch.Tensor]) -> None:
        """Receive every tensor of `meta` by broadcast from rank 0 and load it.

        Buckets are double-buffered like the sender: bucket k+1's receive is posted before bucket k is copied
        into the parameters, so the network and the load copy overlap; the two buffers are kept across syncs.
        A failure mid-way leaves a partial update (the server then refuses /generate until a sync succeeds)."""
        pg, _, timeout_s = self.groups[group_name]
        if meta.bucket_nbytes is None:
            for name, dt, shape, p in zip(meta.names, meta.dtypes, meta.shapes, targets):
                buf = torch.empty(shape, dtype=dtype_from_wire(dt), device=self.device)
                wait_work(broadcast_async(pg, buf), timeout_s=timeout_s, what=f"receiving {name}")
                load_into([p], [buf])
            return
        cap = max(meta.bucket_nbytes)
        if len(self._buffers) != 2 or self._buffers[0].numel() < cap:
            self._buffers = [torch.empty(cap, dtype=torch.uint8, device=self.device) for _ in range(2)]
        n = len(meta.bucket_nbytes)
        by_bucket: list[list[int]] = [[] for _ in range(n)]
        for i, b in enumerate(meta.bucket_index):
            by_bucket[b].append(i)

        def post(k):
            return broadcast_async(pg, self._buffers[k % 2][: meta.bucket_nbytes[k]])

        work = post(0)
        for k in range(n):
            wait_work(work, timeout_s=timeout_s, what=f"receiving bucket {k}")
            if k + 1 < n:
                work = post(k + 1)  # lands in the other buffer while this one is loaded
            views = unpack_bucket(meta, by_bucket[k], self._buffers[k % 2])
            load_into([targets[i] for i in by_bucket[k]], views)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def receive_ipc(self, buckets: list[dict]) -> None:
        """CUDA-IPC path: each bucket is {'handle': ipc wire dict, names, dtypes, shapes, offsets}; the bytes are
        read straight from the trainer's buffer on the same GPU."""
        for entry in buckets:
            flat = ipc_handle_from_wire(entry["handle"])
            meta = WeightMeta(tuple(entry["names"]), tuple(entry["dtypes"]), tuple(tuple(s) for s in entry["shapes"]),
                              tuple(entry["offsets"]), (0,) * len(entry["names"]), (flat.numel(),))
            load_into(self._targets(meta), unpack_bucket(meta, range(len(meta.names)), flat))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the trainer may reuse its buffer as soon as we answer


def unpack_bucket(meta: WeightMeta, indices, bucket: torch.Tensor) -> list[torch.Tensor]:
    """Views of tensors `indices` of `meta` inside one received uint8 bucket (no copy)."""
    out = []
    for i in indices:
        dtype = dtype_from_wire(meta.dtypes[i])
        n = 1
        for d in meta.shapes[i]:
            n *= d
        off = meta.offsets[i]
        out.append(bucket[off:off + n * dtype.itemsize].view(dtype).view(meta.shapes[i]))
    return out


@torch.no_grad()
def load_into(targets: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    for p, v in zip(targets, values):
        p.copy_(v)  # casts when the engine serves another dtype than the trainer sent
