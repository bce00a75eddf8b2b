"""The engine's side of weight sync: join the dedicated group or map the trainer's colocated slots, receive, load
into the live model. The wire format and both protocols are described in engines/weight_sync/wire.py.

Runs in worker threads (the server's event loop stays free); loads run on the server's model thread, so a load
never overlaps a forward. Weights are loaded bucket by bucket as they arrive (like SGLang), so a failed sync
leaves a partial update: the server marks itself inconsistent and answers /generate with 503 until the next sync
succeeds; weight_version only moves on success.
"""

from __future__ import annotations

import contextlib
import socket
from dataclasses import dataclass, field

import anyio
import torch
from torch import nn

from engines.weight_sync.wire import (
    WeightMeta,
    broadcast_async,
    bucket_members,
    build_group,
    connect_channel,
    copy_all,
    create_store,
    device_identity,
    dtype_from_wire,
    dtype_to_wire,
    ipc_handle_from_wire,
    is_lora_name,
    lora_adapter_field,
    open_slots,
    recv_seq,
    send_seq,
    shutdown_group,
    slot_views,
    unpack_bucket,
    wait_work,
)


@dataclass
class _Colocated:
    """The trainer's slots as mapped here (kept across syncs), the signal socket, and on CUDA the IPC events."""

    slots: list[torch.Tensor]
    events: list | None  # [(written, read)] per slot on CUDA
    sock: socket.socket
    timeout_s: float
    # Per slot, every entry's view in it for `views_meta` (the trainer sends the same plan every sync): a bucket's
    # load then makes no view
    views_meta: WeightMeta | None = None
    views: list[list[torch.Tensor]] = field(default_factory=list)


class WeightReceiver:
    """Holds the weight-update groups and the colocated slots of one engine process (mutable state)."""

    def __init__(self, model: nn.Module, device: torch.device):
        self.model, self.device = model, device
        self.groups: dict[str, tuple] = {}  # name -> (process group, store, timeout_s)
        self._buffers: list[torch.Tensor] = []  # two uint8 bucket buffers, reused across syncs
        self.colocated: _Colocated | None = None

    # ------------------------------------------------------------------ broadcast
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
                         timeout_s=timeout_s, device=self.device)
        self.groups[group_name] = (pg, store, timeout_s)

    def destroy_group(self, group_name: str) -> bool:
        entry = self.groups.pop(group_name, None)
        if entry is not None:
            shutdown_group(entry[0], broken=False)
        return entry is not None

    def _targets(self, meta: WeightMeta, lora: bool = False) -> list[torch.Tensor]:
        """The live parameter for each name, checking names and shapes before any byte is received. lora: the
        LoRA adapter tensors (`is_lora_name`) land in new buffers instead (`adapter_tensors` collects them)."""
        params = dict(self.model.named_parameters())
        out = []
        for i, (name, shape) in enumerate(zip(meta.names, meta.shapes)):
            if lora and is_lora_name(name):
                if meta.names.count(name) > 1:
                    raise ValueError(f"adapter tensor {name!r} is split over buckets: send larger buckets")
                out.append(torch.empty(shape, dtype=dtype_from_wire(meta.dtypes[i]), device=self.device))
                continue
            p = params.get(name)
            if p is None:
                raise ValueError(f"unknown parameter name {name!r} (the engine's model has e.g. "
                                 f"{next(iter(params))!r}); send the HF names")
            r0 = meta.rows[i] if meta.rows else 0
            if not meta.rows or tuple(p.shape) == tuple(shape):
                if tuple(p.shape) != tuple(shape) or r0 != 0:
                    raise ValueError(f"parameter {name!r} has shape {tuple(p.shape)}, the update sends "
                                     f"{tuple(shape)} from row {r0}")
                out.append(p)
            elif tuple(p.shape[1:]) != tuple(shape[1:]) or r0 + shape[0] > p.shape[0]:
                raise ValueError(f"parameter {name!r} has shape {tuple(p.shape)}, the update sends rows "
                                 f"[{r0}, {r0 + shape[0]}) of shape {tuple(shape)}")
            else:
                out.append(p.narrow(0, r0, shape[0]))  # a view: loading it writes those rows of the parameter
        return out

    def check(self, meta: WeightMeta, group_name: str, lora: bool = False) -> list[torch.Tensor]:
        if group_name not in self.groups:
            raise ValueError(f"group {group_name!r} not initialised here: call /init_weights_update_group first "
                             f"(known: {sorted(self.groups)})")
        return self._targets(meta, lora)

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
        members = bucket_members(meta)

        def post(k):
            return broadcast_async(pg, self._buffers[k % 2][: meta.bucket_nbytes[k]])

        work = post(0)
        for k in range(len(members)):
            wait_work(work, timeout_s=timeout_s, what=f"receiving bucket {k}")
            if k + 1 < len(members):
                work = post(k + 1)  # lands in the other buffer while this one is loaded
            load_into([targets[i] for i in members[k]], unpack_bucket(meta, members[k], self._buffers[k % 2]))
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def receive_ipc(self, buckets: list[dict]) -> None:
        """One-shot CUDA-IPC path (/update_weights_from_tensor): each bucket is {'handle': ipc wire dict, names,
        dtypes, shapes, offsets}; the bytes are read straight from the trainer's buffer on the same GPU."""
        for entry in buckets:
            flat = ipc_handle_from_wire(entry["handle"])
            meta = WeightMeta(tuple(entry["names"]), tuple(entry["dtypes"]), tuple(tuple(s) for s in entry["shapes"]),
                              tuple(entry["offsets"]), (0,) * len(entry["names"]), (flat.numel(),))
            load_into(self._targets(meta), unpack_bucket(meta, range(len(meta.names)), flat))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the trainer may reuse its buffer as soon as we answer

    # ------------------------------------------------------------------ colocated
    def attach(self, *, slots: dict, channel: str, index: int, timeout_s: float) -> None:
        """Map the trainer's slots (once per trainer group; they stay mapped across syncs) and connect the signal
        channel. A new attach replaces the previous one (the trainer re-initialised after a failure)."""
        self.detach()
        mapped, events = open_slots(slots, self.device)
        sock = connect_channel(channel, index, timeout_s)
        self.colocated = _Colocated(mapped, events, sock, timeout_s)

    def detach(self) -> bool:
        c, self.colocated = self.colocated, None
        if c is not None:
            with contextlib.suppress(OSError):
                c.sock.close()
        return c is not None

    def receive_colocated(self, meta: WeightMeta, seq: int, targets: list[torch.Tensor]) -> None:
        """Copy bucket k (signal seq+k+1) out of slot k % 2 into the parameters, then hand the slot back."""
        c = self.colocated
        if c is None:
            raise ValueError("no colocated slots attached: the trainer must call init_group() first")
        cap = c.slots[0].numel()
        if max(meta.bucket_nbytes) > cap:
            raise ValueError(f"bucket of {max(meta.bucket_nbytes)} bytes exceeds the attached slots ({cap} bytes)")
        stream = torch.cuda.current_stream(self.device) if c.events is not None else None
        if c.views_meta != meta:
            c.views = slot_views(meta, c.slots)
            c.views_meta = meta
        for k, members in enumerate(bucket_members(meta)):
            got = recv_seq(c.sock, timeout_s=c.timeout_s, what=f"waiting for bucket {k}")
            if got != seq + k + 1:
                raise ValueError(f"bucket signal {got} out of order (expected {seq + k + 1}); re-run init_group()")
            s = k % 2
            if stream is not None:
                stream.wait_event(c.events[s][0])  # the trainer's pack of this slot is done (on the GPU)
            with torch.profiler.record_function("sync.load_bucket"):  # a range in a trainer's profiler trace
                load_into([targets[i] for i in members], [c.views[s][i] for i in members])
            if stream is not None:
                c.events[s][1].record(stream)  # the trainer's next pack of this slot waits for our copy
            send_seq(c.sock, got)


async def colocated_request(server, body: dict) -> dict:
    """POST /colocated_weights, one JSON body per operation (`op`):
      probe  -> this engine's device identity and dtype (the trainer decides colocation from it);
      attach {slots, channel, index, timeout_s} -> map the trainer's slots and connect the signal channel;
      load   {WeightMeta wire fields, seq, weight_version} -> receive one sync through the slots;
      detach -> drop the slots."""
    op = body.get("op")
    rec: WeightReceiver = server.receiver
    if op == "probe":
        return {"success": True, **device_identity(server.device),
                "dtype": dtype_to_wire(next(server.model.parameters()).dtype)}
    if op == "attach":
        for key, typ in (("slots", dict), ("channel", str), ("index", int)):
            if not isinstance(body.get(key), typ):
                raise ValueError(f"attach: field {key!r} is required ({typ.__name__})")
        await anyio.to_thread.run_sync(lambda: rec.attach(slots=body["slots"], channel=body["channel"],
                                                          index=body["index"],
                                                          timeout_s=float(body.get("timeout_s", 600))))
        return {"success": True, "message": "attached the trainer's slots"}
    if op == "detach":
        return {"success": rec.detach(), "message": "detached"}
    if op != "load":
        raise ValueError(f"op={op!r}: use 'probe', 'attach', 'load' or 'detach'")
    meta = WeightMeta.from_wire(body)
    if meta.bucket_nbytes is None or not isinstance(body.get("seq"), int):
        raise ValueError("load needs load_format='flattened_bucket' and an int 'seq'")
    if body.get("weight_version") is not None and not str(body["weight_version"]).isdigit():
        raise ValueError("weight_version must be a non-negative integer (as a string or int)")
    lora = lora_adapter_field(body)
    targets = rec._targets(meta, lora is not None)  # 400 before touching any slot
    async with server.exclusive():  # no row decodes while the weights change
        try:
            # on the model thread as its other work is (EngineServer.on_model_thread): on the engine's stream
            # where it shares the trainer's, and the CPU's OpenMP pool released after it when no row runs
            await server.on_model_thread(rec.receive_colocated, meta, body["seq"], targets)
            await load_synced_adapter(server, lora, meta, targets)
        except BaseException:
            server.weights_consistent = False
            raise
    server.weights_consistent = True
    v = body.get("weight_version")
    server.set_weight_version(int(v) if v is not None else server.weight_version + 1)
    return {"success": True, "message": f"updated {len(meta.names)} tensors",
            "weight_version": str(server.weight_version)}


async def load_synced_adapter(server, lora: dict | None, meta: WeightMeta, targets: list[torch.Tensor]) -> None:
    """After an update with a `lora_adapter` field: its adapter tensors (received into `targets`) become that
    adapter of the engine (in place when loaded), its default when asked. A full-weight update (lora None) clears
    the default: the trainer now sends whole models (a full RL phase after a LoRA SFT), so requests that name no
    adapter get the base it sent."""
    if lora is None:
        server.adapters.default = None
        return
    tensors = {n: t for n, t in zip(meta.names, targets) if is_lora_name(n)}
    await server.load_adapter(lora["name"], tensors, lora["scaling"], default=lora["default"])


def read_safetensors_folder(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of the *.safetensors files in folder `path` (a consolidated HF checkpoint), on CPU."""
    import os

    from safetensors.torch import load_file

    if not os.path.isdir(path):
        raise ValueError(f"model_path {path!r} is not a folder this engine can read (a disk sync needs a folder "
                         f"on a file system the engine shares with the trainer)")
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"model_path {path!r} holds no *.safetensors file")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(os.path.join(path, f)))
    return out


def disk_targets(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """name -> live parameter for a full reload: every parameter must be present with its shape (a tied lm_head
    may be absent, as HF saves it), and no unknown name may appear."""
    params = dict(model.named_parameters())
    unknown = sorted(set(tensors) - set(params) - {n for n, _ in model.named_buffers()})
    if unknown:
        raise ValueError(f"the folder has tensors this model lacks: {unknown[:5]}; save the HF names")
    missing = sorted(set(params) - set(tensors))
    if missing:
        raise ValueError(f"the folder lacks parameters {missing[:5]}; save a consolidated (unsharded) checkpoint")
    for name, t in tensors.items():
        if name in params and tuple(t.shape) != tuple(params[name].shape):
            raise ValueError(f"parameter {name!r} has shape {tuple(params[name].shape)}, the folder has "
                             f"{tuple(t.shape)}")
    return {n: params[n] for n in tensors if n in params}


def load_into(targets: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    """Copy each value into its target, casting where the engine serves another dtype than the trainer sent
    (wire.copy_all: one foreach copy where it can)."""
    copy_all(targets, values)
