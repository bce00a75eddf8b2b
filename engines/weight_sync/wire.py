"""Weight sync wire format, shared by the trainer's sender (trainer/weight_sync/sender.py) and the engine's receiver
(engines/weight_sync/receiver.py). Nothing here knows about the trainer; nothing on the wire is pickled.

Both transports move the same thing: the model as a sequence of flat uint8 buckets (`plan_buckets`: every tensor at
a 64-byte aligned offset, in parameter order; for our own engines a parameter larger than a bucket is cut into row
chunks), announced by a JSON `WeightMeta` (names, dtypes, shapes, offsets, bucket sizes, row offsets,
weight_version) sent over HTTP, and staged through two alternating bucket buffers ("slots").

broadcast (engines on other devices or hosts): a dedicated process group [trainer rank 0, engine 0, engine 1, ...]
built from a TCPStore the trainer hosts (gloo on CPU, NCCL on GPU; never the trainer's default group), under the
store keys SGLang's own helper uses (`group_store`), so a stock SGLang server joins it; bucket k is one broadcast of
slot k % 2.

colocated (an engine on the trainer's own device: same GPU UUID, or on CPU the same host and /dev/shm): no copy on
the wire. The trainer's two slots are shared once per group (`create_slots` / `open_slots`: a /dev/shm file on
CPU, a CUDA IPC handle on GPU, both as JSON) and the engine keeps them mapped across syncs. A Unix socket (a file in
a mode-0700 folder: this user only) per engine carries one 8-byte sequence number per bucket each way:
    trainer: [wait done(k-2)] pack bucket k into slot k%2, [record written[k%2]]  -> send ready(seq_k)
    engine:  recv ready(seq_k), [wait written[k%2]], copy slot -> parameters, [record read[k%2]] -> send done(seq_k)
so a slot is never rewritten before every engine has copied it out. On CUDA the bracketed steps are IPC events:
the host messages only order the *recording* of events, the copies themselves are ordered on the GPU (no host
sync). A closed socket is a dead peer: the waiting side fails at once instead of at its deadline.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import importlib
import mmap
import os
import select
import socket
import stat
import struct
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

DEFAULT_BUCKET_BYTES = 512 << 20  # broadcast: few, large collectives
# colocated: on CPU small slots stay in the shared L3 cache, so the engine reads the bytes the trainer just packed
# from cache instead of memory (the sync then costs about one trip through memory, not two); on GPU larger ones
# keep the per-bucket host signals (a few tens of microseconds each) negligible.
COLOCATED_BUCKET_BYTES = {"cpu": 4 << 20, "cuda": 64 << 20}
DEFAULT_GROUP_NAME = "weight_update_group"
# The `load_format`s of /update_weights_from_distributed an engine may list in /get_server_info's
# `weight_update_formats`: "direct" is stock SGLang (one broadcast per tensor, load_format null), "flattened_bucket"
# this project's bucketed extension. An SGLang-protocol server that lists nothing gets "direct". "lora_adapter": the
# engine reads the `lora_adapter` field ({name, scaling, default}, `lora_adapter_field`) of a bucketed update, which
# loads the tensors named like PEFT's LoRA weights ("<module>.lora_A.weight" / ".lora_B.weight") as that adapter
# (engines/embedded/lora.py) instead of into the base weights: a LoRA run's adapter-only sync.
WEIGHT_UPDATE_FORMATS = ("direct", "flattened_bucket", "lora_adapter")
POLICY_ADAPTER = "policy"  # the adapter a LoRA run's sync loads, made the engine's default (requests naming none)
ALIGN = 64  # every tensor starts at a 64-byte offset in its bucket, so byte views can be re-viewed as any dtype
# NCCL's own collective timeout sits this far above the Python deadline: a wedged peer raises WeightSyncError in
# Python (and the group is aborted) before NCCL's watchdog would tear the whole trainer process down.
NCCL_TIMEOUT_MARGIN_S = 120.0
SHM_DIR = "/dev/shm"
# CUDA tensors and IPC events this process shared (ipc_handle_to_wire, create_slots), by a random key in their
# handles. An engine in the trainer's own process (engines.local) takes them from here: CUDA cannot open an IPC
# handle in the process that created it (cudaIpcOpenMemHandle fails with "invalid device context"), and there is
# nothing to open: the objects are at hand. Weak: an entry lives as long as the trainer holds the tensor or event.
# "This process" is a random token, not the pid: pids repeat across PID namespaces (an engine in another container
# on the same GPU can have the trainer's pid), and a forked child gets a token of its own.
_SHARED_HERE: weakref.WeakValueDictionary[str, object] = weakref.WeakValueDictionary()
_PROCESS = uuid.uuid4().hex


def _new_process_token() -> None:
    global _PROCESS
    _PROCESS = uuid.uuid4().hex
    _SHARED_HERE.clear()  # the parent's objects are not this child's


os.register_at_fork(after_in_child=_new_process_token)


def _share_here(obj: object) -> str:
    key = uuid.uuid4().hex
    _SHARED_HERE[key] = obj
    return key


def _shared_here(wire: dict, key: str | None, what: str) -> object | None:
    """The object behind a handle made by this very process, or None for another process's handle."""
    if wire.get("process") != _PROCESS or key is None:
        return None
    obj = _SHARED_HERE.get(key)
    if obj is None:
        raise ValueError(f"{what}: the handle names a {what} of this process that no longer exists (the trainer "
                         f"dropped its slots); re-run init_group()")
    return obj


class WeightSyncError(RuntimeError):
    """A sync or group init failed; the message names the engine and what to do."""


# ----------------------------------------------------------------------------------------------- dtypes, metadata
def dtype_from_wire(name: str) -> torch.dtype:
    """'bfloat16' or 'torch.bfloat16' -> torch.bfloat16 (SGLang sends the bare name)."""
    bare = name.removeprefix("torch.")
    dt = getattr(torch, bare, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"dtype {name!r} is not a torch dtype name (e.g. 'float32', 'bfloat16')")
    return dt


def dtype_to_wire(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


@dataclass(frozen=True)
class WeightMeta:
    """What one sync sends: tensor i is `names[i]`, stored at `offsets[i]` bytes into bucket `bucket_index[i]`.

    bucket_nbytes is None for the per-tensor protocol (one broadcast per tensor, what a real SGLang server
    expects); otherwise load_format is "flattened_bucket" and each bucket is one uint8 buffer.
    rows (wire: `row_offsets`, our extension): when not empty, entry i is rows [rows[i], rows[i] + shapes[i][0])
    of parameter names[i]; a parameter larger than a bucket is then split over several buckets."""

    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...] = ()
    bucket_index: tuple[int, ...] = ()
    bucket_nbytes: tuple[int, ...] | None = None
    rows: tuple[int, ...] = ()

    def to_wire(self, *, weight_version: int, group_name: str, flush_cache: bool = True) -> dict:
        body = {"names": list(self.names), "dtypes": list(self.dtypes), "shapes": [list(s) for s in self.shapes],
                "group_name": group_name, "flush_cache": flush_cache, "weight_version": str(weight_version),
                "load_format": None}
        if self.bucket_nbytes is not None:
            body.update(load_format="flattened_bucket", offsets=list(self.offsets),
                        bucket_index=list(self.bucket_index), bucket_nbytes=list(self.bucket_nbytes))
            if self.rows:
                body["row_offsets"] = list(self.rows)
        return body

    @staticmethod
    def from_wire(body: dict) -> WeightMeta:
        """Validate an /update_weights_from_distributed body (raises ValueError naming the bad field)."""
        for key in ("names", "dtypes", "shapes"):
            if not isinstance(body.get(key), list):
                raise ValueError(f"field {key!r} must be a list (SGLang's names/dtypes/shapes)")
        n = len(body["names"])
        if len(body["dtypes"]) != n or len(body["shapes"]) != n:
            raise ValueError(f"names, dtypes and shapes must have the same length, got {n}, "
                             f"{len(body['dtypes'])}, {len(body['shapes'])}")
        shapes = []
        for name, s in zip(body["names"], body["shapes"]):
            if not isinstance(s, list) or not all(isinstance(d, int) and d >= 0 for d in s):
                raise ValueError(f"shape of {name!r} must be a list of non-negative ints, got {s!r}")
            shapes.append(tuple(s))
        dtypes = tuple(dtype_to_wire(dtype_from_wire(d)) for d in body["dtypes"])
        fmt = body.get("load_format")
        if fmt in (None, "", "direct"):
            return WeightMeta(tuple(body["names"]), dtypes, tuple(shapes))
        if fmt != "flattened_bucket":
            raise ValueError(f"load_format={fmt!r} is not supported; use null (per tensor) or 'flattened_bucket'")
        offsets, index, nbytes = body.get("offsets"), body.get("bucket_index"), body.get("bucket_nbytes")
        if not (isinstance(offsets, list) and isinstance(index, list) and isinstance(nbytes, list)):
            raise ValueError("load_format='flattened_bucket' needs lists offsets, bucket_index and bucket_nbytes")
        if len(offsets) != n or len(index) != n:
            raise ValueError("offsets and bucket_index need one entry per name")
        rows = body.get("row_offsets") or []
        if rows and (len(rows) != n or not all(isinstance(r, int) and r >= 0 for r in rows)):
            raise ValueError("row_offsets needs one non-negative int per name")
        meta = WeightMeta(tuple(body["names"]), dtypes, tuple(shapes), tuple(offsets), tuple(index), tuple(nbytes),
                          tuple(rows))
        for i in range(n):  # every tensor must lie inside its bucket
            b = meta.bucket_index[i]
            end = meta.offsets[i] + nbytes_of(meta.shapes[i], dtype_from_wire(meta.dtypes[i]))
            if not (0 <= b < len(nbytes)) or meta.offsets[i] < 0 or end > nbytes[b]:
                raise ValueError(f"tensor {meta.names[i]!r} at bucket {b} offset {meta.offsets[i]} "
                                 f"does not fit the announced bucket sizes")
        return meta


def nbytes_of(shape: Sequence[int], dtype: torch.dtype) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * dtype.itemsize


def plan_buckets(names: Sequence[str], shapes: Sequence[Sequence[int]], dtype: torch.dtype,
                 bucket_bytes: int, *, split: bool = False) -> WeightMeta:
    """Greedy first-fit in order: a tensor starts a new bucket when it does not fit the current one. A tensor
    larger than bucket_bytes gets a bucket of its own size, or with `split` (receivers that read row_offsets) is
    cut along dim 0 into chunks that fit, so no bucket (and no slot) exceeds bucket_bytes by more than one row
    and the two slots keep alternating evenly."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be positive")
    entries = []  # (name, chunk shape, first row)
    for name, shape in zip(names, shapes):
        shape = tuple(shape)
        row = nbytes_of(shape[1:], dtype) if shape else 0
        if split and shape and shape[0] > 1 and nbytes_of(shape, dtype) > bucket_bytes:
            step = max(1, bucket_bytes // max(row, 1))
            entries += [(name, (min(step, shape[0] - r0), *shape[1:]), r0) for r0 in range(0, shape[0], step)]
        else:
            entries.append((name, shape, 0))
    offsets, index, sizes = [], [], []
    cur = None  # bytes used in the current bucket
    for _, shape, _ in entries:
        n = nbytes_of(shape, dtype)
        start = 0 if cur is None else -(-cur // ALIGN) * ALIGN
        if cur is None or start + n > bucket_bytes:
            sizes.append(0)
            start = 0
        offsets.append(start)
        index.append(len(sizes) - 1)
        cur = start + n
        sizes[-1] = cur
    rows = tuple(r for _, _, r in entries) if len(entries) > len(names) else ()
    return WeightMeta(tuple(e[0] for e in entries), (dtype_to_wire(dtype),) * len(entries),
                      tuple(e[1] for e in entries), tuple(offsets), tuple(index), tuple(sizes), rows)


def bucket_members(meta: WeightMeta) -> list[list[int]]:
    """Tensor indices of each bucket, in order."""
    out: list[list[int]] = [[] for _ in meta.bucket_nbytes]
    for i, b in enumerate(meta.bucket_index):
        out[b].append(i)
    return out


def unpack_bucket(meta: WeightMeta, indices, bucket: torch.Tensor) -> list[torch.Tensor]:
    """Views of tensors `indices` of `meta` inside one uint8 bucket buffer (no copy)."""
    out = []
    for i in indices:
        dtype = dtype_from_wire(meta.dtypes[i])
        off = meta.offsets[i]
        out.append(bucket[off:off + nbytes_of(meta.shapes[i], dtype)].view(dtype).view(meta.shapes[i]))
    return out


def slot_views(meta: WeightMeta, slots: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Per slot (a uint8 buffer any of `meta`'s buckets may occupy), every entry's view in it: what the colocated
    sender packs into and the engine loads from, made once per plan (a bucket's copy then makes no view)."""
    return [unpack_bucket(meta, range(len(meta.names)), slot) for slot in slots]


@torch.no_grad()
def copy_all(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """dsts[i].copy_(srcs[i]) for every i (casting where the dtypes differ), as one foreach copy where the dsts share
    a dtype and so do the srcs: on CUDA a few kernels for a bucket's tensors instead of one launch each. Mixed dtypes
    copy one by one (CUDA's foreach copy took its kernel from the first dst's dtype before pytorch#173531)."""
    assert len(dsts) == len(srcs), (len(dsts), len(srcs))
    if not dsts:
        return
    if len({t.dtype for t in dsts}) == 1 and len({t.dtype for t in srcs}) == 1:
        torch._foreach_copy_(dsts, srcs)
        return
    for d, s in zip(dsts, srcs):
        d.copy_(s)


# ----------------------------------------------------------------------------------------------- process group
def create_store(master_address: str, master_port: int, *, is_master: bool, timeout_s: float) -> dist.TCPStore:
    """The rendezvous store: trainer rank 0 hosts it (port 0 = pick a free one; read `store.port`).

    The host listens on `master_address` only, the address its engines were told: a bare TCPStore listens on every
    interface, which would open the group's rendezvous to the network when loopback suffices."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if not is_master:
        return dist.TCPStore(master_address, master_port, is_master=False, timeout=timeout, wait_for_workers=False)
    fd = listen_fd(master_address, master_port)
    port = master_port or _bound_port(fd)
    return dist.TCPStore(master_address, port, is_master=True, timeout=timeout, wait_for_workers=False,
                         master_listen_fd=fd)


def listen_fd(address: str, port: int) -> int:
    """A TCP socket listening on `address` alone (IPv4, IPv6 or a host name, resolved here); its descriptor is
    handed over (the TCPStore owns and closes it)."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise WeightSyncError(f"master_address {address!r} does not resolve ({e}); give an IP address of this host "
                              f"that the engines reach") from e
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise WeightSyncError(f"cannot listen on {address}:{port} for the weight-update group ({e}); give a free "
                              f"master_port (0: any) and an address of this host") from e
    return sock.detach()


def _bound_port(fd: int) -> int:
    sock = socket.socket(fileno=fd)
    try:
        return sock.getsockname()[1]
    finally:
        sock.detach()  # the descriptor stays open for the store


# The device prefix torch's `_new_process_group_helper` keys a one-backend group's store under: the first device
# that backend serves (`dist.Backend.backend_capability`; the helper builds one backend object for all of them).
GROUP_STORE_DEVICE = {"gloo": "cpu", "nccl": "cuda"}


def group_store(store: dist.Store, group_name: str, backend: str) -> dist.Store:
    """The store as the group's backend sees it, keyed exactly like a group SGLang builds, so a stock SGLang server
    (and anything else that uses its helper: slime, OpenRLHF) meets ours in the same keys.

    SGLang's `init_custom_process_group` (python/sglang/srt/utils/common.py, 0.5) wraps its rendezvous store in
    `PrefixStore(group_name)` and hands it to torch's `_new_process_group_helper`, which adds `{group_name}/` and then
    `{device}/` itself: a gloo group named G waits on keys `G/G//cpu//...`. The helper itself is not called here: it
    registers the group in torch's global state (a name can then be used once per process) and, in a trainer whose
    default group is bound to a GPU, splits the new communicator from that group, which the engines are not in."""
    if backend not in GROUP_STORE_DEVICE:
        raise ValueError(f"backend={backend!r}: use 'gloo' (CPU tensors) or 'nccl' (CUDA tensors)")
    if not group_name:
        raise ValueError("group_name is empty; SGLang refuses an empty name: give the weight-update group a name")
    helper_store = dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store))
    return dist.PrefixStore(f"{GROUP_STORE_DEVICE[backend]}/", helper_store)


def build_group(store: dist.Store, *, rank: int, world_size: int, group_name: str, backend: str,
                timeout_s: float, device: torch.device | None = None) -> dist.ProcessGroup:
    """A standalone process group (no init_process_group, no default group touched) over `group_store`'s keys,
    the ones SGLang's own helper uses. Blocks until all `world_size` ranks joined.

    NCCL: the communicator is created here, eagerly and non-blocking (a lazy one would be created inside the first
    broadcast, where a dead peer hangs ncclCommInitRank with no deadline); run this in a thread with a deadline.
    NCCL's timeout is NCCL_TIMEOUT_MARGIN_S above `timeout_s` so Python's deadline (wait_work) always fires first."""
    prefix = group_store(store, group_name, backend)
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(prefix, rank, world_size, datetime.timedelta(seconds=timeout_s))
        pg._set_sequence_number_for_group()  # as torch's helper does (older torch versions read it from the store)
        return pg
    if device is None or device.type != "cuda":
        raise ValueError(f"backend='nccl' needs the CUDA device of this rank, got device={device}")
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = datetime.timedelta(seconds=timeout_s + NCCL_TIMEOUT_MARGIN_S)
    if hasattr(opts, "config") and hasattr(opts.config, "blocking"):
        opts.config.blocking = 0  # init polls (and gives up at the timeout) instead of blocking in NCCL
    pg = dist.ProcessGroupNCCL(prefix, rank, world_size, opts)
    pg._set_sequence_number_for_group()
    pg.eager_connect_single_device(device)
    return pg


def shutdown_group(pg, *, broken: bool, pending_timeout_s: float = 0.0) -> None:
    """Release a group; a broken NCCL group (a collective may be stuck) is aborted, not shut down cleanly.

    pending_timeout_s > 0: a collective of ours may still be pending (a peer refused the update before joining its
    broadcast). Gloo's group destructor then blocks until that collective times out (the group's whole timeout:
    measured 120 s for a refused vLLM adapter sync), and abort() does not cut it short; so a daemon thread holds the
    last reference until then and the caller gets its error now. At exit the thread is dropped, not joined."""
    try:
        if broken and hasattr(pg, "abort"):
            pg.abort()
        else:
            pg.shutdown()
    except Exception:  # noqa: BLE001 - best effort on a possibly broken group
        pass
    if pending_timeout_s > 0:
        threading.Thread(target=_hold_until_timed_out, args=(pg, pending_timeout_s + 5.0), daemon=True,
                         name="weight-sync-broken-group").start()


def _hold_until_timed_out(pg, seconds: float) -> None:
    time.sleep(seconds)  # returning drops `pg` here, once its pending collective has timed out


def broadcast_async(group: dist.ProcessGroup, tensor: torch.Tensor, src: int = 0):
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    return group.broadcast([tensor], opts)


def wait_work(work, *, timeout_s: float, what: str, check: Callable[[], None] | None = None) -> None:
    """Wait for a collective with a deadline, calling `check()` (which raises on a peer's failure) meanwhile."""
    deadline = time.monotonic() + timeout_s
    while not work.is_completed():
        if check is not None:
            check()
        if time.monotonic() > deadline:
            raise WeightSyncError(f"{what} did not complete within {timeout_s:.0f}s (an engine is wedged or dead); "
                                  f"restart it and call init_group() again")
        time.sleep(0.0002)
    try:
        work.wait()
    except RuntimeError as e:
        raise WeightSyncError(f"{what} failed: {e}") from e


# ----------------------------------------------------------------------------------------------- colocation
def gpu_uuid(device: torch.device) -> str:
    """A CUDA device's physical GPU as nvidia-smi -L names it, "GPU-<uuid>": the same in every process, whatever
    CUDA_VISIBLE_DEVICES numbers it there."""
    return f"GPU-{torch.cuda.get_device_properties(device).uuid}"


def device_identity(device: torch.device) -> dict:
    """What decides colocation, as JSON: the host (hostname, boot id, the /dev/shm mount), the device (the GPU's
    UUID; "cpu" for CPU) and `gpus`, the GPUs in use (engines.protocol's gpu_uuids: [] on CPU)."""
    boot = ""
    if os.path.exists("/proc/sys/kernel/random/boot_id"):
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    shm = os.stat(SHM_DIR).st_dev if os.path.isdir(SHM_DIR) else -1
    host = f"{socket.gethostname()}/{boot}/{shm}"
    if device.type == "cuda":
        gpu = gpu_uuid(device)
        return {"host": host, "device": gpu, "gpus": [gpu]}
    return {"host": host, "device": device.type, "gpus": []}


def is_colocated(a: dict, b: dict) -> bool:
    return a.get("host") == b.get("host") and a.get("device") == b.get("device")


# ----------------------------------------------------------------------------------------------- shared slots
def create_slots(nbytes: int, device: torch.device, n: int = 2) -> tuple[list[torch.Tensor], list[str], dict]:
    """The trainer's `n` bucket slots of `nbytes`, shareable with a colocated engine, and their JSON handles.

    CPU: one /dev/shm file per slot, mapped MAP_SHARED; returns the paths too, to unlink once every engine has
    mapped them (the mapping outlives the name, so nothing leaks if a process dies later). CUDA: plain device
    tensors; the handle is their CUDA IPC handle, plus two IPC events per slot (written, read)."""
    if device.type == "cuda":
        slots = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(n)]
        events = [[torch.cuda.Event(interprocess=True) for _ in range(2)] for _ in range(n)]
        wire = {"kind": "cuda_ipc", "nbytes": nbytes, "slots": [ipc_handle_to_wire(s) for s in slots],
                "events": [[base64.b64encode(e.ipc_handle()).decode() for e in pair] for pair in events],
                "process": _PROCESS, "event_keys": [[_share_here(e) for e in pair] for pair in events]}
        return slots, [], {"wire": wire, "events": events}
    if not os.path.isdir(SHM_DIR):
        raise WeightSyncError(f"colocated CPU sync needs {SHM_DIR}; use transport='broadcast'")
    paths = [os.path.join(SHM_DIR, f"rlkernels-weights-{os.getpid()}-{uuid.uuid4().hex[:12]}-{i}") for i in range(n)]
    slots = []
    for p in paths:
        fd = os.open(p, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)
        slots.append(torch.from_file(p, shared=True, size=nbytes, dtype=torch.uint8))
    return slots, paths, {"wire": {"kind": "shm", "nbytes": nbytes, "paths": paths}, "events": None}


def open_slots(wire: dict, device: torch.device) -> tuple[list[torch.Tensor], list | None]:
    """Engine side: map the trainer's slots once (kept across syncs); returns (slots, [(written, read)] or None)."""
    kind = wire.get("kind")
    if kind == "shm":
        if device.type != "cpu":
            raise ValueError(f"shared-memory slots are CPU memory; this engine runs on {device}")
        nbytes = wire.get("nbytes")
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"slots nbytes={nbytes!r}: the size of the trainer's slot files, an int > 0")
        if not isinstance(wire.get("paths"), list) or not wire["paths"]:
            raise ValueError("slots 'paths' must be a non-empty list of the trainer's slot files")
        return [map_slot_file(p, nbytes) for p in wire["paths"]], None
    if kind == "cuda_ipc":
        if device.type != "cuda":
            raise ValueError("CUDA IPC slots need a CUDA engine; this engine runs on CPU")
        slots = [ipc_handle_from_wire(h) for h in wire["slots"]]
        if wire.get("process") == _PROCESS:  # an engine in the trainer's process: its own event objects
            events = [tuple(_shared_here(wire, k, "CUDA event") for k in pair) for pair in wire["event_keys"]]
        else:
            events = [tuple(torch.cuda.Event.from_ipc_handle(device, base64.b64decode(e)) for e in pair)
                      for pair in wire["events"]]
        return slots, events
    raise ValueError(f"slots kind={kind!r}: expected 'shm' (CPU) or 'cuda_ipc' (GPU)")


def map_slot_file(path: str, nbytes: int) -> torch.Tensor:
    """Map one existing slot file of the trainer's, shared, without creating or resizing anything: the request
    that names it comes over HTTP, so the file must already be a regular `SHM_DIR/rlkernels-weights-*` file of
    this user of exactly `nbytes` (torch.from_file would create a missing file and grow a short one to any size,
    leaving it behind in /dev/shm)."""
    if not isinstance(path, str) or os.path.dirname(path) != SHM_DIR or \
            not os.path.basename(path).startswith("rlkernels-weights-"):
        raise ValueError(f"slot path {path!r} is not a {SHM_DIR}/rlkernels-weights-* file")
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise ValueError(f"slot file {path!r} cannot be opened ({e.strerror}); the trainer creates it before "
                         f"attach and removes it once every engine mapped it: re-run init_group()") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size != nbytes:
            raise ValueError(f"slot file {path!r} is not a regular file of this user of {nbytes} bytes "
                             f"(size {st.st_size}, owner uid {st.st_uid}); re-run init_group()")
        mem = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)  # the mapping keeps the memory; nothing is left open or named on our side
    return torch.frombuffer(mem, dtype=torch.uint8)  # holds a reference to `mem`: unmapped with the tensor


# ----------------------------------------------------------------------------------------------- bucket signals
_SEQ = struct.Struct("<Q")
CHANNEL_PREFIX = "rlkernels-channel-"
CHANNEL_NAME = "signals.sock"


def listen_channel() -> tuple[socket.socket, str]:
    """Trainer side: a listening Unix socket, a file in a fresh mode-0700 folder (so only this user can connect;
    the abstract namespace would let any local user in). Its path goes to the engine as JSON; remove it with
    `remove_channel` once every engine connected (connections outlive the name)."""
    folder = tempfile.mkdtemp(prefix=CHANNEL_PREFIX)
    address = os.path.join(folder, CHANNEL_NAME)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(address)
        sock.listen(16)
    except BaseException:
        sock.close()
        remove_channel(address)
        raise
    return sock, address


def remove_channel(address: str) -> None:
    """Remove the socket file and its folder (idempotent)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(address)
    with contextlib.suppress(FileNotFoundError):
        os.rmdir(os.path.dirname(address))


def connect_channel(address: str, hello: int, timeout_s: float) -> socket.socket:
    """Engine side: connect and introduce itself with `hello` (its engine index)."""
    if not (isinstance(address, str) and os.path.basename(address) == CHANNEL_NAME
            and os.path.basename(os.path.dirname(address)).startswith(CHANNEL_PREFIX)):
        raise ValueError(f"channel address {address!r} is not one of ours (.../{CHANNEL_PREFIX}*/{CHANNEL_NAME})")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect(address)
        sock.sendall(_SEQ.pack(hello))
    except BaseException:
        sock.close()
        raise
    return sock


def send_seq(sock: socket.socket, seq: int) -> None:
    sock.sendall(_SEQ.pack(seq))


def recv_seq(sock: socket.socket, *, timeout_s: float, what: str, check: Callable[[], None] | None = None) -> int:
    """Read one sequence number; fails on a closed socket (dead peer) at once and after `timeout_s` otherwise,
    polling `check()` (which raises on a peer's reported failure) meanwhile."""
    deadline = time.monotonic() + timeout_s
    buf = b""
    while len(buf) < _SEQ.size:
        if check is not None:
            check()
        left = deadline - time.monotonic()
        if left <= 0:
            raise WeightSyncError(f"{what}: no signal within {timeout_s:.0f}s (the peer is wedged); "
                                  f"restart it and call init_group() again")
        ready, _, _ = select.select([sock], [], [], min(left, 0.05))
        if not ready:
            continue
        chunk = sock.recv(_SEQ.size - len(buf))
        if not chunk:
            raise WeightSyncError(f"{what}: the peer closed the channel (process died or gave up)")
        buf += chunk
    return _SEQ.unpack(buf)[0]


# ----------------------------------------------------------------------------------------------- CUDA IPC
def ipc_handle_to_wire(tensor: torch.Tensor) -> dict:
    """JSON-safe CUDA IPC handle of a CUDA tensor (the args of torch's rebuild_cuda_tensor; bytes as base64)."""
    if not tensor.is_cuda:
        raise ValueError("CUDA IPC needs a CUDA tensor; CPU slots are shared through /dev/shm (create_slots)")
    _, args = reduce_tensor(tensor)
    enc = []
    for a in args:
        if isinstance(a, bytes):
            enc.append({"b64": base64.b64encode(a).decode()})
        elif isinstance(a, torch.dtype):
            enc.append({"dtype": dtype_to_wire(a)})
        elif isinstance(a, type):
            enc.append({"type": f"{a.__module__}.{a.__qualname__}"})
        elif isinstance(a, torch.Size | tuple):
            enc.append({"tuple": list(a)})
        else:
            enc.append(a)
    return {"args": enc, "process": _PROCESS, "key": _share_here(tensor)}


def ipc_handle_from_wire(wire: dict) -> torch.Tensor:
    """Inverse of ipc_handle_to_wire, in the engine process (same GPU), or the tensor itself when that process is
    this one (an in-process engine). Only torch classes are resolved."""
    mine = _shared_here(wire, wire.get("key"), "CUDA tensor")
    if mine is not None:
        return mine
    args = []
    for a in wire["args"]:
        if isinstance(a, dict) and "b64" in a:
            args.append(base64.b64decode(a["b64"]))
        elif isinstance(a, dict) and "dtype" in a:
            args.append(dtype_from_wire(a["dtype"]))
        elif isinstance(a, dict) and "type" in a:
            mod, _, qual = a["type"].rpartition(".")
            if not mod.startswith("torch"):
                raise ValueError(f"IPC handle names a non-torch class {a['type']!r}")
            args.append(getattr(importlib.import_module(mod), qual))
        elif isinstance(a, dict) and "tuple" in a:
            args.append(tuple(a["tuple"]))
        else:
            args.append(a)
    args[1] = torch.Size(args[1])
    return rebuild_cuda_tensor(*args)


def is_lora_name(name: str) -> bool:
    """Whether a sent tensor is a LoRA adapter's (PEFT's "<module>.lora_A.weight" / "<module>.lora_B.weight")."""
    return name.endswith((".lora_A.weight", ".lora_B.weight"))


def lora_adapter_field(body: dict) -> dict | None:
    """The `lora_adapter` field of an update ({"name": str, "scaling": float, "default": bool}), checked; None when
    absent (a full-weight update)."""
    field = body.get("lora_adapter")
    if field is None:
        return None
    if not (isinstance(field, dict) and isinstance(field.get("name"), str) and field["name"]
            and isinstance(field.get("scaling"), (int, float)) and not isinstance(field["scaling"], bool)):
        raise ValueError(f"lora_adapter={field!r}: expected {{'name': str, 'scaling': lora_alpha / r, 'default': "
                         f"bool}}")
    return {"name": field["name"], "scaling": float(field["scaling"]), "default": bool(field.get("default", False))}
