"""Disk-free weight sync, trainer side: FSDP2 gather -> flat buckets -> every engine, by broadcast or, for an engine
on the trainer's own device, through shared slots. The wire format and both protocols: engines/weight_sync/wire.py.

Data path: every trainer rank walks the parameters in the same order, casts its shard to the engines' dtype and
calls `DTensor.full_tensor()` (a collective on the trainer's own group: a bf16 engine costs half the gather bytes
of fp32 master weights); rank 0 packs each full tensor into one of two bucket slots. While bucket k is out (a
broadcast in flight, or a colocated engine copying it), bucket k+1 is gathered and packed into the other slot; a
slot is reused only once every engine is done with it. Only rank 0 talks to engines.

Transport per engine (`transport="auto"`): an embedded engine that reports the trainer's own device identity (GPU
UUID; on CPU the host and /dev/shm) is colocated, any other engine (other GPU, other host, a stock SGLang or
vLLM) is broadcast to. `transport="broadcast"` forces the process group for all; "colocated" requires it for all.
On GPU the sender also asks each engine's GPUs (`gpu_uuids`): NCCL refuses two ranks of one group on one GPU
("Duplicate GPU"), so an engine on the trainer's own GPU that cannot take the weights by handle (a vLLM, or any
engine under mode="per_tensor") is synced from disk instead (a safetensors folder each sync, written from the same
gathered tensors; DiskWeightSync), with a warning; under transport="broadcast" it is an error, before any group.

Control path: the metadata goes to every engine at once over HTTP (httpx under trio, in a helper thread); the
request returns when the engine has loaded everything. Nothing touches disk (but for engines synced from disk,
above), nothing is pickled on the wire.

Failure handling: every wait polls the transport and the HTTP calls together, so a dead engine (connection reset,
closed signal socket) or one that rejects the metadata (4xx) fails the sync at once with an error naming the
engine, and a wedged one fails after `timeout_s`. The group is then dropped; restart the engine and call
`init_group()` again.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from engines.protocol import WeightSyncEndpoint
from engines.weight_sync.wire import (
    COLOCATED_BUCKET_BYTES,
    DEFAULT_BUCKET_BYTES,
    DEFAULT_GROUP_NAME,
    POLICY_ADAPTER,
    WeightSyncError,
    broadcast_async,
    build_group,
    copy_all,
    create_slots,
    create_store,
    device_identity,
    dtype_from_wire,
    is_colocated,
    listen_channel,
    nbytes_of,
    plan_buckets,
    recv_seq,
    remove_channel,
    send_seq,
    shutdown_group,
    slot_views,
    wait_work,
)
from trainer.weight_sync.common import (
    EngineCalls,
    adapter_sync_weights,
    any_rank,
    from_rank0,
    full_tensor,
    gathered_weights,
    lora_scaling,
    named_weights,
    trainer_rank,
)
from trainer.weight_sync.disk import DiskWeightSync

TRANSPORTS = ("auto", "broadcast", "colocated")
# The gathered tensors a sync holds before copying them into a slot (they are copied together: one foreach copy)
PACK_BYTES = 16 << 20
BUCKETING_MODES = ("auto", "bucketed", "per_tensor")  # WeightSyncSender(mode=...): the broadcast's wire format
LORA_SYNCS = ("auto", "adapters", "merged")  # WeightSyncSender(lora=...): what a LoRA model sends


class WeightSyncSender:
    """The trainer's side of weight sync (mutable: the group, the slots, the version).

    Call from every trainer rank (FSDP2 gathers are collectives); only rank 0 talks to engines.
    engines: what engines.protocol.WeightSyncEndpoint declares (every engine engines.registry builds); each one
    takes `await eng.world_size()` ranks of the group.
    dtype: the dtype sent (and gathered in); None = the engines' own dtype (asked at init_group), else
    `fallback_dtype` (engines that do not report theirs: a stock SGLang, vLLM), else the model's parameters'.
    bucket_bytes: None = 512 MiB for broadcast, COLOCATED_BUCKET_BYTES when an engine is colocated.
    mode: "auto" (negotiated at init_group: the bucketed `flattened_bucket` format when every broadcast engine
    lists it in /get_server_info, else SGLang's stock one broadcast per tensor), "bucketed" or "per_tensor"
    (forced; per_tensor is broadcast only). Colocated engines always read buckets through the shared slots.
    An engine with tensor parallelism takes `await eng.world_size()` ranks (SGLangEngine: its tp_size).
    transport: "auto" (colocated where the engine shares the trainer's device, else broadcast; from disk for an
    engine on the trainer's GPU that cannot be colocated), "broadcast" or "colocated" (an error for an engine that
    is not).
    disk_folder: where the folders for engines synced from disk go (DiskWeightSync's `folder`: default /dev/shm).

    lora: what a LoRA model (trainer.backend.lora) sends. "auto": "adapters" when every engine reads the
    `lora_adapter` field (its `weight_formats()` lists "lora_adapter": the embedded engine, in process or over
    HTTP; a vLLM started with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1) and none is synced from disk or
    per tensor, else "merged". "adapters": a sync sends only the adapters' A and B (plus the weights trained
    outside them), and the engines serve them as their default adapter "policy", the base weights untouched (the
    embedded engine per row, engines/embedded/lora.py; vLLM as a LoRA model built from the tensors,
    engines/vllm_ext/lora.py, used by the engine object's requests that name no adapter); the first sync after
    init_group also sends the base, unmerged. "merged": every sync sends the merged weights W + (alpha / r) B @ A,
    a stock model's (any engine). `last_sync_bytes`: the tensor bytes the last sync sent.
    """

    def __init__(self, model: nn.Module, engines: Sequence[WeightSyncEndpoint], *, dtype: torch.dtype | None = None,
                 fallback_dtype: torch.dtype | None = None, bucket_bytes: int | None = None,
                 backend: str | None = None, timeout_s: float = 300.0,
                 master_address: str = "127.0.0.1", master_port: int = 0, group_name: str = DEFAULT_GROUP_NAME,
                 mode: str = "auto", transport: str = "auto", weight_version: int = 0, disk_folder: str | None = None,
                 lora: str = "auto"):
        if mode not in BUCKETING_MODES:
            raise ValueError(f"mode={mode!r}: use one of {BUCKETING_MODES}")
        if lora not in LORA_SYNCS:
            raise ValueError(f"lora={lora!r}: use one of {LORA_SYNCS}")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport={transport!r}: use one of {TRANSPORTS}")
        if mode == "per_tensor" and transport == "colocated":
            raise ValueError("mode='per_tensor' is the stock-server broadcast protocol; use mode='bucketed' with "
                             "transport='colocated'")
        self.model, self.engines = model, list(engines)
        params = named_weights(model)
        if not params:
            raise ValueError("model has no parameters to sync")
        self.device = params[0][1].device
        self._dtype_arg = dtype
        # Under mixed precision the parameters are fp32 masters: an engine that serves bf16 would get twice the
        # bytes it keeps, so the caller says what engines that do not report their dtype serve.
        self.dtype = dtype or fallback_dtype or params[0][1].dtype
        self.backend = backend or ("nccl" if self.device.type == "cuda" else "gloo")
        self._bucket_arg = bucket_bytes
        self.bucket_bytes = bucket_bytes or DEFAULT_BUCKET_BYTES
        self.timeout_s, self.mode, self.transport = timeout_s, mode, transport
        self.master_address, self.master_port, self.group_name = master_address, master_port, group_name
        self.weight_version = weight_version
        self.per_tensor = mode == "per_tensor"  # the broadcast format, decided at init_group under "auto"
        self.rank = trainer_rank()
        from trainer.backend.lora import is_lora

        self.lora = lora if is_lora(model) else "merged"  # a full model has nothing else to send
        self.adapter_sync = False  # decided at init_group: the engines take the adapters alone
        self._base_sent = False  # adapter sync: the first sync after init_group sends the base too
        self._split = False
        self.meta = self._plan()
        self.group: dist.ProcessGroup | None = None
        self._group_name = ""
        self._store = None
        self._generation = 0
        self.broadcast_to: list[int] = []  # engine indices in the process group (rank 1 + position)
        self.colocated: list[int] = []  # engine indices reading the shared slots
        self.to_disk: list[int] = []  # engine indices on the trainer's GPU without a handle path: synced from disk
        self.disk_folder = disk_folder
        self._disk: DiskWeightSync | None = None  # rank 0, when to_disk
        self._unknown_gpus: list[int] = []  # broadcast engines (NCCL) that do not say which GPU they hold
        self._slots: list[torch.Tensor] = []
        self._views: tuple = ((), None, [])  # (slots, meta, per slot every entry's view in it): _slot_views
        self._events = None  # CUDA: [(written, read)] per slot
        self._channel = None  # listening socket
        self._socks: dict[int, object] = {}  # engine index -> connected signal socket
        self._seq = 0  # bucket signals sent so far on this channel
        self._ready = False
        self.last_sync_s = float("nan")
        self.last_sync_bytes = 0

    def _weights(self) -> list[tuple[str, torch.Tensor]]:
        """(name, parameter) of what the next sync sends, in its order."""
        if self.adapter_sync:
            return adapter_sync_weights(self.model, with_base=not self._base_sent)
        return named_weights(self.model)

    def _plan(self, split: bool = False):
        params = self._weights()
        meta = plan_buckets([n for n, _ in params], [tuple(p.shape) for _, p in params], self.dtype,
                            self.bucket_bytes, split=split and not self.per_tensor)
        entries: dict[str, list[int]] = {}
        for e, name in enumerate(meta.names):
            entries.setdefault(name, []).append(e)
        self._entries = [entries[n] for n, _ in params]  # parameter i -> its meta entries (chunks)
        return meta

    # ------------------------------------------------------------------ group
    def init_group(self) -> None:
        """(Re)connect every engine: decide each one's transport, build the process group for the broadcast
        ones, share the slots with the colocated ones. Call on every trainer rank; again after an engine restart."""
        decided = None
        if self.rank == 0:
            self.close()
            try:
                decided = self._decide()
            finally:
                shared = from_rank0(decided)
        else:
            shared = from_rank0(None)
        if shared is None:
            raise WeightSyncError("trainer rank 0 could not reach the engines (see its error)")
        (dtype_name, self.broadcast_to, self.colocated, self.to_disk, split, self.per_tensor, self._unknown_gpus,
         self.adapter_sync) = shared
        self.dtype = dtype_from_wire(dtype_name)
        self._base_sent, self._split = False, split
        if self._bucket_arg is None:
            self.bucket_bytes = (COLOCATED_BUCKET_BYTES.get(self.device.type, DEFAULT_BUCKET_BYTES) if self.colocated
                                 else DEFAULT_BUCKET_BYTES)
        self.meta = self._plan(split)
        if self.rank != 0:
            self._ready = True
            return
        self._generation += 1
        if self.broadcast_to:
            self._init_broadcast()
        if self.colocated:
            self._init_colocated()
        if self.to_disk:
            self._disk = DiskWeightSync(self.model, [self.engines[i] for i in self.to_disk], folder=self.disk_folder,
                                        dtype=self.dtype, timeout_s=self.timeout_s)
            self._disk.init_group()
        self._ready = True

    def _decide(self) -> tuple[str, list[int], list[int], list[int], bool, bool, list[int], bool]:
        """(dtype to send, broadcast engine indices, colocated engine indices, engine indices synced from disk,
        whether to split parameters larger than a bucket: only when every engine is one of ours, which reads
        row_offsets, whether the broadcast goes one tensor at a time, broadcast engines whose GPU is unknown,
        whether a LoRA model syncs its adapters alone) from the engines' probes, the formats they list and, for
        NCCL, the GPUs they hold."""
        probes = EngineCalls(self.engines, lambda i, eng: eng.colocation_info(), "the colocation probe").join(
            self.timeout_s, "colocation probe")
        formats = EngineCalls(self.engines, lambda i, eng: eng.weight_formats(), "the format probe").join(
            self.timeout_s, "format probe")
        # Only an NCCL group refuses two ranks on one GPU; a gloo (CPU) run need not ask.
        gpus = [None] * len(self.engines) if self.backend != "nccl" else EngineCalls(
            self.engines, lambda i, eng: eng.gpu_uuids(), "the GPU probe").join(self.timeout_s, "GPU probe")
        ours = device_identity(self.device)
        dtypes = {p["dtype"] for p in probes if p.get("dtype")}
        if self._dtype_arg is not None or not dtypes:
            dtype = self.dtype if self._dtype_arg is None else self._dtype_arg
        elif len(dtypes) == 1:
            dtype = dtype_from_wire(dtypes.pop())
        else:
            raise WeightSyncError(f"engines serve different dtypes {sorted(dtypes)}: pass dtype= explicitly")
        same = [self.mode != "per_tensor" and is_colocated(ours, p) for p in probes]
        if self.transport == "colocated" and not all(same):
            bad = [e.url for e, s in zip(self.engines, same) if not s]
            raise WeightSyncError(f"transport='colocated' but engines {bad} do not share this trainer's device "
                                  f"{ours}; use transport='auto' or 'broadcast'")
        if self.transport == "broadcast":
            same = [False] * len(self.engines)
        to_disk = [i for i, g in enumerate(gpus) if not same[i] and shares_gpu(ours, g)]
        if to_disk:
            self._no_broadcast_on_trainer_gpu(to_disk, ours)
        broadcast = [i for i, s in enumerate(same) if not s and i not in to_disk]
        stock = [i for i in broadcast if "flattened_bucket" not in formats[i]]
        if self.mode == "bucketed" and stock:
            raise WeightSyncError(f"mode='bucketed' but engines {[self.engines[i].url for i in stock]}"
                                  f" do not list 'flattened_bucket' in /get_server_info (a stock SGLang); use "
                                  f"mode='auto' or 'per_tensor'")
        per_tensor = self.mode == "per_tensor" or bool(stock)
        unknown = [i for i in broadcast if self.backend == "nccl" and gpus[i] is None]
        adapters = not per_tensor and not to_disk and all("lora_adapter" in f for f in formats)
        if self.lora == "adapters" and not adapters:
            raise WeightSyncError(f"lora='adapters' but engines {[e.url for e in self.engines]} cannot all take "
                                  f"adapters alone (those that can list 'lora_adapter' in their weight formats: "
                                  f"embedded engines, and vLLM started with --enable-lora and "
                                  f"VLLM_ALLOW_RUNTIME_LORA_UPDATING=1; none synced from disk or per tensor); use "
                                  f"lora='auto' or 'merged'")
        adapters = adapters and self.lora != "merged"
        return (str(dtype).removeprefix("torch."), broadcast, [i for i, s in enumerate(same) if s], to_disk,
                all(probes) and not per_tensor, per_tensor, unknown, adapters)

    def _no_broadcast_on_trainer_gpu(self, engines: list[int], ours: dict) -> None:
        """Engines on the trainer's GPU that cannot take weights by handle: refused under transport='broadcast',
        else synced from disk, said once here (before any NCCL group exists)."""
        urls = [self.engines[i].url for i in engines]
        gpu = ", ".join(ours.get("gpus") or [ours.get("device", "?")])
        if self.transport == "broadcast":
            raise WeightSyncError(f"engines {urls} run on this trainer's GPU {gpu}: NCCL cannot put two ranks of one "
                                  f"GPU in the broadcast group ('Duplicate GPU'); use transport='auto' (an embedded "
                                  f"engine then reads the weights by CUDA IPC handle, any other engine reloads them "
                                  f"from disk) or give each engine a GPU of its own")
        warnings.warn(f"weight sync: engines {urls} run on this trainer's GPU {gpu} and cannot take the weights by "
                      f"handle (only an embedded engine can, and not under mode='per_tensor'); NCCL cannot broadcast "
                      f"to them ('Duplicate GPU'), so every sync writes a safetensors folder they reload (slower: give "
                      f"them a GPU of their own to broadcast)", stacklevel=4)  # the caller of init_group

    def _init_broadcast(self) -> None:
        # A fresh store (and port) per generation: a restarted engine can never meet a stale half-built group.
        store = create_store(self.master_address, self.master_port if self._generation == 1 else 0,
                             is_master=True, timeout_s=self.timeout_s)
        name = f"{self.group_name}_{self._generation}"
        engines = [self.engines[i] for i in self.broadcast_to]
        # An engine with tensor/pipeline parallelism takes one rank per worker: offsets from each one's world size
        sizes = EngineCalls(engines, lambda k, eng: eng.world_size(), "world_size").join(self.timeout_s, "world_size")
        sizes = [int(n) for n in sizes]
        offsets = [1 + sum(sizes[:k]) for k in range(len(engines))]
        world = 1 + sum(sizes)

        def call(k, eng):
            return eng.init_weights_update_group(master_address=self.master_address, master_port=store.port,
                                                 rank_offset=offsets[k], world_size=world, group_name=name,
                                                 backend=self.backend, timeout_s=self.timeout_s)

        calls = EngineCalls(engines, call, "init_weights_update_group")
        result: dict = {}

        def build():  # in a thread: a peer that never joins must not hang the trainer (NCCL init included)
            try:
                result["pg"] = build_group(store, rank=0, world_size=world, group_name=name, backend=self.backend,
                                           timeout_s=self.timeout_s, device=self.device)
            except BaseException as e:  # noqa: BLE001
                result["err"] = e

        t = threading.Thread(target=build, daemon=True)
        t.start()
        deadline = time.monotonic() + self.timeout_s
        while t.is_alive() and time.monotonic() < deadline:
            calls.check()
            t.join(0.005)
        if t.is_alive() or "err" in result:
            unknown = [self.engines[i].url for i in self._unknown_gpus]
            hint = (f"; engines {unknown} do not say which GPU they use: NCCL cannot put one on this trainer's GPU "
                    f"in the group ('Duplicate GPU'), so give it a GPU of its own or use [engines] sync = \"disk\""
                    if unknown else "")
            raise WeightSyncError(f"weight-update group {name!r} did not form with {len(engines)} engine(s) "
                                  f"within {self.timeout_s:.0f}s: {result.get('err', 'timeout')}{hint}")
        calls.join(self.timeout_s, "init_weights_update_group")
        self.group, self._group_name, self._store = result["pg"], name, store

    def _init_colocated(self) -> None:
        """Create the two slots and the signal channel; every colocated engine maps them once."""
        self._channel, address = listen_channel()
        paths: list[str] = []
        try:
            self._slots, paths, extra = create_slots(max(self.meta.bucket_nbytes), self.device)
            self._events = extra["events"]
            self._seq = 0
            body = {"op": "attach", "slots": extra["wire"], "channel": address, "timeout_s": self.timeout_s}
            engines = [self.engines[i] for i in self.colocated]
            calls = EngineCalls(engines, lambda k, eng: eng.colocated_weights({**body, "index": k}), "attach")
            calls.join(self.timeout_s, "colocated attach")
            self._channel.settimeout(self.timeout_s)
            for _ in engines:
                sock, _ = self._channel.accept()
                k = recv_seq(sock, timeout_s=self.timeout_s, what="colocated hello")
                self._socks[self.colocated[k]] = sock
        finally:
            for p in paths:  # every engine mapped them (or failed): the mappings outlive the names
                _unlink(p)
            remove_channel(address)  # every engine connected (or failed): connections outlive the socket's name

    def close(self, *, pending: bool = False) -> None:
        """Drop the group, the slots and the channel (the engines drop theirs at the next attach). pending: a
        failed sync may have left a broadcast of ours unanswered (wire.shutdown_group)."""
        if self.group is not None:
            shutdown_group(self.group, broken=True, pending_timeout_s=self.timeout_s if pending else 0.0)
        for sock in [*self._socks.values(), self._channel]:
            if sock is not None:
                sock.close()
        if self._events is not None:
            torch.cuda.current_stream(self.device).synchronize()  # no engine copy may still read a freed slot
        self.group, self._channel, self._socks, self._slots, self._events = None, None, {}, [], None
        self._views = ((), None, [])  # the views hold the slots' memory
        if self._disk is not None:
            self._disk.close()  # removes its folder
            self._disk = None
        self._ready = False

    # ------------------------------------------------------------------ sync
    def _gathered(self) -> Iterator[tuple[int, torch.Tensor]]:
        """(index, full tensor in the sent dtype) for every parameter, all ranks in lockstep. The cast runs on
        the local shard, before the all-gather."""
        if self.adapter_sync:
            with torch.no_grad():
                for i, (_, p) in enumerate(self._weights()):
                    yield i, full_tensor(p.detach().to(self.dtype))
            return
        for i, (_, full) in enumerate(gathered_weights(self.model, self.dtype)):
            yield i, full

    def sync(self, weight_version: int | None = None,
             on_bucket: Callable[[int, int], None] | None = None) -> int:
        """Send the current weights to every engine; returns the new weight_version (all ranks).

        on_bucket(k, n_buckets) is called on rank 0 once bucket k is handed out (progress bars). A failure on rank
        0 reaches every rank: rank 0 still finishes the gathers, then all ranks agree and raise."""
        version = self.weight_version + 1 if weight_version is None else weight_version
        gathered = self._gathered()
        error = None
        if self.rank == 0:
            try:
                self._send(version, gathered, on_bucket)
            except BaseException as e:  # noqa: BLE001 - re-raised below, after the other ranks heard of it
                error = e
        for _ in gathered:  # ranks > 0 take part in the gathers only; rank 0 finishes them after a failure
            pass
        if any_rank(error is not None, self.device):
            if error is not None:
                raise error
            raise WeightSyncError("the weight sync failed on trainer rank 0 (its error says why); fix it and call "
                                  "init_group() on every rank again")
        self.weight_version = version
        self.last_sync_bytes = sum(nbytes_of(s, dtype_from_wire(d)) for s, d in zip(self.meta.shapes, self.meta.dtypes))
        if self.adapter_sync and not self._base_sent:  # the engines hold the base now: adapters alone from here on
            self._base_sent = True
            self.meta = self._plan(self._split)
        return version

    def _send(self, version: int, gathered: Iterator, on_bucket) -> None:
        if not self._ready:
            raise WeightSyncError("no weight-update group: call init_group() first (again after an engine restart)")
        t0 = time.perf_counter()
        bucketed = self.meta.to_wire(weight_version=version, group_name=self._group_name)
        if self.adapter_sync:  # the engines load the LoRA tensors as their default adapter (wire.lora_adapter_field)
            bucketed["lora_adapter"] = {"name": POLICY_ADAPTER, "scaling": lora_scaling(self.model), "default": True}
        colocated_body = {**bucketed, "op": "load", "seq": self._seq}
        body = bucketed
        if self.per_tensor:  # SGLang's stock fields only: names, dtypes, shapes, group_name, flush_cache, ...
            body = {k: v for k, v in bucketed.items() if k not in ("offsets", "bucket_index", "bucket_nbytes",
                                                                      "row_offsets")}
            body["load_format"] = None

        def call(i, eng):
            if i in self._socks:
                return eng.colocated_weights(colocated_body)
            return eng.update_weights_from_distributed(body)

        kept: dict[str, torch.Tensor] = {}  # for the engines synced from disk: every full tensor, on the CPU
        if self._disk is not None:
            gathered = _keep_on_cpu(gathered, [n for n, _ in named_weights(self.model)], kept)
        live = [i for i in range(len(self.engines)) if i not in self.to_disk]
        calls = EngineCalls([self.engines[i] for i in live], lambda k, eng: call(live[k], eng), "the weight update")
        try:
            if self.group is None and not self._socks:  # every engine reloads from disk
                for _ in gathered:
                    pass
            elif self.per_tensor and not self._socks:
                self._send_per_tensor(gathered, calls)
            else:
                self._send_buckets(gathered, calls, on_bucket)
            with torch.profiler.record_function("sync.engines_done"):  # the engines' answers to the update call
                calls.join(self.timeout_s, "the weight update")
            if self._disk is not None:
                self._disk.reload(self._disk.write_tensors(version, kept), version)
        except (WeightSyncError, OSError) as e:  # OSError: a socket to an engine that died (BrokenPipeError, ...)
            self.close(pending=True)  # a half-done collective, a slot a half-read bucket: force a re-init
            raise self._explain(e, calls) from e
        except BaseException:
            self.close(pending=True)
            raise
        self.last_sync_s = time.perf_counter() - t0

    def _explain(self, err: WeightSyncError | OSError, calls: EngineCalls) -> WeightSyncError:
        """A transport error does not say which engine died; its HTTP call usually does, a moment later."""
        calls._thread.join(min(2.0, self.timeout_s))
        what = str(err) if isinstance(err, WeightSyncError) else f"{type(err).__name__}: {err}"
        if calls.error is not None and calls.error is not err:
            return WeightSyncError(f"{calls.error} (transport: {what}); restart the engine and call init_group()")
        urls = ", ".join(e.url for e in self.engines)
        return WeightSyncError(f"{what} (engines: {urls}); restart the failed engine and call init_group()")

    def _send_per_tensor(self, gathered: Iterator, calls: EngineCalls) -> None:
        for i, t in gathered:
            work = broadcast_async(self.group, t.contiguous())
            wait_work(work, timeout_s=self.timeout_s, what=f"broadcast of {self.meta.names[i]}", check=calls.check)

    def _slot_views(self) -> list[list[torch.Tensor]]:
        """Per slot, every entry's view in it ([shape] in its dtype at its offset; entry e of bucket b is packed
        into slot b % 2): built once per slots and plan, so packing a bucket makes no view."""
        slots, meta, views = self._views
        if slots is not self._slots or meta is not self.meta:
            views = slot_views(self.meta, self._slots)
            self._views = (self._slots, self.meta, views)
        return views

    def _send_buckets(self, gathered: Iterator, calls: EngineCalls, on_bucket) -> None:
        sizes = self.meta.bucket_nbytes
        if not self._slots or self._slots[0].numel() < max(sizes):  # broadcast-only: plain buffers, kept
            self._slots = [torch.empty(max(sizes), dtype=torch.uint8, device=self.device) for _ in range(2)]
        views = self._slot_views()
        inflight: list = [None, None]  # per slot: the broadcast work of the bucket it holds
        current = -1
        # A bucket's copies go together (wire.copy_all: on CUDA a few kernels for its tensors instead of one launch
        # each), issued once PACK_BYTES of them are held (a gathered or cast tensor is an allocation of its own, so
        # holding a whole bucket's would raise the sync's peak memory by a bucket) and when the bucket is complete.
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        held = 0
        for i, t in gathered:
            for e in self._entries[i]:  # one entry, or the row chunks of a parameter larger than a bucket
                b = self.meta.bucket_index[e]
                if b != current:
                    if current >= 0:
                        _pack(dsts, srcs)
                        held = 0
                        inflight[current % 2] = self._hand_out(current, calls, on_bucket)
                    current = b
                    self._free_slot(b, inflight, calls)
                shape = self.meta.shapes[e]
                dsts.append(views[b % 2][e])
                srcs.append(t if tuple(t.shape) == shape else t.narrow(0, self.meta.rows[e], shape[0]))
                held += srcs[-1].numel() * srcs[-1].element_size()
                if held >= PACK_BYTES:
                    _pack(dsts, srcs)
                    held = 0
            if self.per_tensor and self.group is not None:  # stock engines beside colocated ones: one per tensor
                wait_work(broadcast_async(self.group, t.contiguous()), timeout_s=self.timeout_s,
                          what=f"broadcast of {self.meta.names[self._entries[i][0]]}", check=calls.check)
        _pack(dsts, srcs)
        inflight[current % 2] = self._hand_out(current, calls, on_bucket)
        for b in (current - 1, current):
            if b >= 0:
                self._free_slot(b + 2, inflight, calls)
        self._seq += len(sizes)

    @torch.profiler.record_function("sync.free_slot")  # a range in [logging] profile_steps' traces
    def _free_slot(self, b: int, inflight: list, calls: EngineCalls) -> None:
        """Before packing bucket b into slot b % 2: bucket b-2's broadcast finished and every colocated engine
        signalled that it copied bucket b-2 out (on CUDA, the pack then waits for their copy on the GPU)."""
        s = b % 2
        if inflight[s] is not None:
            wait_work(inflight[s], timeout_s=self.timeout_s, what=f"broadcast of bucket {b - 2}", check=calls.check)
            inflight[s] = None
        if b < 2:
            return
        for i, sock in self._socks.items():
            what = f"engine {self.engines[i].url} copying bucket {b - 2}"
            got = recv_seq(sock, timeout_s=self.timeout_s, what=what, check=calls.check)
            if got != self._seq + b - 1:
                raise WeightSyncError(f"{what}: signal {got} out of order (expected {self._seq + b - 1})")
        if self._events is not None:
            torch.cuda.current_stream(self.device).wait_event(self._events[s][1])

    @torch.profiler.record_function("sync.hand_out")
    def _hand_out(self, b: int, calls: EngineCalls, on_bucket):
        """Bucket b is packed in slot b % 2: broadcast it (async) and signal the colocated engines."""
        work = None
        if self.group is not None and not self.per_tensor:
            work = broadcast_async(self.group, self._slots[b % 2][: self.meta.bucket_nbytes[b]])
        if self._socks:
            if self._events is not None:
                self._events[b % 2][0].record(torch.cuda.current_stream(self.device))
            for i, sock in self._socks.items():
                try:
                    send_seq(sock, self._seq + b + 1)
                except OSError as e:  # BrokenPipeError, ConnectionResetError: the engine's end is gone
                    raise WeightSyncError(f"engine {self.engines[i].url}: its signal channel broke while bucket {b} "
                                          f"was handed out ({type(e).__name__}: {e}); the engine process died or "
                                          f"closed the channel") from e
        if on_bucket is not None:
            on_bucket(b, len(self.meta.bucket_nbytes))
        return work


def _pack(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """Copy srcs into their slot views dsts (same shapes), then empty both lists."""
    copy_all(dsts, srcs)
    dsts.clear()
    srcs.clear()


def shares_gpu(ours: dict, gpus: Sequence[str] | None) -> bool:
    """Whether an engine that holds `gpus` (its gpu_uuids(); None: it does not say) is on the trainer's GPU
    (`ours`: wire.device_identity of the trainer's device)."""
    return gpus is not None and bool(set(ours.get("gpus") or ()) & set(gpus))


def _keep_on_cpu(gathered: Iterator, names: Sequence[str], kept: dict) -> Iterator:
    """Pass the gathered (index, full tensor) pairs on, keeping each tensor on the CPU under its name."""
    for i, t in gathered:
        kept[names[i]] = t.detach().cpu()
        yield i, t


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def default_master_address(urls: Sequence[str]) -> str:
    """The weight-update group's address: 127.0.0.1 when every engine is on this host (loopback URLs), else the
    address of this host on the route to the first remote engine (a UDP connect sends no packet)."""
    import socket
    from urllib.parse import urlsplit

    hosts = [urlsplit(u).hostname or "127.0.0.1" for u in urls]
    remote = [h for h in hosts if h not in ("127.0.0.1", "localhost", "::1", "0.0.0.0")]
    if not remote:
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((remote[0], 9))
            return sock.getsockname()[0]
        except OSError as e:
            raise WeightSyncError(f"no route from this host to engine host {remote[0]!r} ({e}); set [engines] "
                                  f"master_address to this host's address the engines can reach") from e
