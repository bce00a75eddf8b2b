"""The engine's side of weight sync: join the dedicated group, receive broadcasts, load into the live model.

Runs in worker threads (the server's event loop stays free). A sync is staged: every tensor is received into
fresh buffers first and copied into the parameters only when all arrived, so a failed sync (dead trainer,
timeout) leaves the previous weights intact and the weight_version unchanged.
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
        """Receive every tensor of `meta` by broadcast from rank 0, then load them (all or nothing)."""
        pg, _, timeout_s = self.groups[group_name]
        staged: list[torch.Tensor] = []
        if meta.bucket_nbytes is None:
            for name, dt, shape in zip(meta.names, meta.dtypes, meta.shapes):
                buf = torch.empty(shape, dtype=dtype_from_wire(dt), device=self.device)
                wait_work(broadcast_async(pg, buf), timeout_s=timeout_s, what=f"receiving {name}")
                staged.append(buf)
        else:
            buckets = []
            for k, n in enumerate(meta.bucket_nbytes):
                buf = torch.empty(n, dtype=torch.uint8, device=self.device)
                wait_work(broadcast_async(pg, buf), timeout_s=timeout_s, what=f"receiving bucket {k}")
                buckets.append(buf)
            staged = unpack_buckets(meta, buckets)
        load_into(targets, staged)

    def receive_ipc(self, buckets: list[dict]) -> None:
        """CUDA-IPC path: each bucket is {'handle': ipc wire dict, names, dtypes, shapes, offsets}; the bytes are
        read straight from the trainer's buffer on the same GPU."""
        for entry in buckets:
            flat = ipc_handle_from_wire(entry["handle"])
            meta = WeightMeta(tuple(entry["names"]), tuple(entry["dtypes"]), tuple(tuple(s) for s in entry["shapes"]),
                              tuple(entry["offsets"]), (0,) * len(entry["names"]), (flat.numel(),))
            load_into(self._targets(meta), unpack_buckets(meta, [flat]))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the trainer may reuse its buffer as soon as we answer


def unpack_buckets(meta: WeightMeta, buckets: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of each tensor inside its received uint8 bucket (no copy)."""
    out = []
    for dt, shape, off, b in zip(meta.dtypes, meta.shapes, meta.offsets, meta.bucket_index):
        dtype = dtype_from_wire(dt)
        n = 1
        for d in shape:
            n *= d
        out.append(buckets[b][off:off + n * dtype.itemsize].view(dtype).view(shape))
    return out


@torch.no_grad()
def load_into(targets: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    for p, v in zip(targets, values):
        p.copy_(v)  # casts when the engine serves another dtype than the trainer sent
