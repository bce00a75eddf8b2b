"""Disk-free weight sync, trainer side: FSDP2 gather -> cast -> flat buckets -> broadcast to every engine.

Data path: every trainer rank walks the parameters in the same order and calls `DTensor.full_tensor()` (a
collective on the trainer's own group); rank 0 casts each full tensor into a flat byte bucket (default 512 MiB)
and, once a bucket is full, broadcasts it in a *dedicated* process group [trainer rank 0, engine 0, engine 1, ...]
built from a TCPStore that rank 0 hosts (gloo on CPU, NCCL on GPU; never the trainer's default group). Two bucket
buffers alternate: bucket k+1 is gathered and packed while bucket k's broadcast is in flight (async work; NCCL runs
it on its own stream). A rank never broadcasts a bucket before its gathers finished, and only rank 0 broadcasts.

Control path: the metadata (names, dtypes, shapes, per-tensor byte offsets and bucket sizes, weight_version) goes
to every engine at once over HTTP (httpx under trio, in a helper thread) as SGLang's
`/update_weights_from_distributed` request; the request returns when the engine has received and loaded
everything. Nothing touches disk, nothing is pickled.

Failure handling: every wait polls the broadcast and the HTTP calls together, so a dead engine (connection reset)
or one that rejects the metadata (4xx) fails the sync at once with an error naming the engine, and a wedged one
fails after `timeout_s`. The group is then marked broken; restart the engine and call `init_group()` again.

A colocated same-GPU engine takes the CUDA-IPC path instead (`sync_ipc`): the bucket is not copied at all, the
engine maps it from an IPC handle sent as JSON (`ipc_handle_to_wire`).
"""

from __future__ import annotations

import base64
import datetime
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

DEFAULT_BUCKET_BYTES = 512 << 20
DEFAULT_GROUP_NAME = "weight_update_group"
ALIGN = 64  # every tensor starts at a 64-byte offset in its bucket, so byte views can be re-viewed as any dtype


class WeightSyncError(RuntimeError):
    """A sync or group init failed; the message names the engine and what to do."""


# ----------------------------------------------------------------------------------------------- wire helpers
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
    expects); otherwise load_format is "flattened_bucket" and each bucket is one uint8 broadcast."""

    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...] = ()
    bucket_index: tuple[int, ...] = ()
    bucket_nbytes: tuple[int, ...] | None = None

    def to_wire(self, *, weight_version: int, group_name: str, flush_cache: bool = True) -> dict:
        body = {"names": list(self.names), "dtypes": list(self.dtypes), "shapes": [list(s) for s in self.shapes],
                "group_name": group_name, "flush_cache": flush_cache, "weight_version": str(weight_version),
                "load_format": None}
        if self.bucket_nbytes is not None:
            body.update(load_format="flattened_bucket", offsets=list(self.offsets),
                        bucket_index=list(self.bucket_index), bucket_nbytes=list(self.bucket_nbytes))
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
        meta = WeightMeta(tuple(body["names"]), dtypes, tuple(shapes), tuple(offsets), tuple(index), tuple(nbytes))
        for i in range(n):  # every tensor must lie inside its bucket
            b = meta.bucket_index[i]
            end = meta.offsets[i] + _nbytes(meta.shapes[i], dtype_from_wire(meta.dtypes[i]))
            if not (0 <= b < len(nbytes)) or meta.offsets[i] < 0 or end > nbytes[b]:
                raise ValueError(f"tensor {meta.names[i]!r} at bucket {b} offset {meta.offsets[i]} "
                                 f"does not fit the announced bucket sizes")
        return meta


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * dtype.itemsize


def plan_buckets(names: Sequence[str], shapes: Sequence[Sequence[int]], dtype: torch.dtype,
                 bucket_bytes: int) -> WeightMeta:
    """Greedy first-fit in order: a tensor starts a new bucket when it does not fit the current one; a tensor
    larger than bucket_bytes gets a bucket of its own size."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be positive")
    offsets, index, sizes = [], [], []
    cur = None  # bytes used in the current bucket
    for shape in shapes:
        n = _nbytes(shape, dtype)
        start = 0 if cur is None else -(-cur // ALIGN) * ALIGN
        if cur is None or start + n > bucket_bytes:
            sizes.append(0)
            start = 0
        offsets.append(start)
        index.append(len(sizes) - 1)
        cur = start + n
        sizes[-1] = cur
    return WeightMeta(tuple(names), (dtype_to_wire(dtype),) * len(names), tuple(tuple(s) for s in shapes),
                      tuple(offsets), tuple(index), tuple(sizes))


# ----------------------------------------------------------------------------------------------- process group
def create_store(master_address: str, master_port: int, *, is_master: bool, timeout_s: float) -> dist.TCPStore:
    """The rendezvous store: trainer rank 0 hosts it (port 0 = pick a free one; read `store.port`)."""
    return dist.TCPStore(master_address, master_port, is_master=is_master,
                         timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


def build_group(store: dist.Store, *, rank: int, world_size: int, group_name: str, backend: str,
                timeout_s: float) -> dist.ProcessGroup:
    """A standalone process group (no init_process_group, no default group touched), keyed `{group_name}/`
    in the store like torch's own named groups. Blocks until all `world_size` ranks joined."""
    timeout = datetime.timedelta(seconds=timeout_s)
    prefix = dist.PrefixStore(f"{group_name}/", store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefix, rank, world_size, timeout)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefix, rank, world_size, opts)
    raise ValueError(f"backend={backend!r}: use 'gloo' (CPU tensors) or 'nccl' (CUDA tensors)")


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


# ----------------------------------------------------------------------------------------------- CUDA IPC
def ipc_handle_to_wire(tensor: torch.Tensor) -> dict:
    """JSON-safe CUDA IPC handle of a CUDA tensor (the args of torch's rebuild_cuda_tensor; bytes as base64)."""
    from torch.multiprocessing.reductions import reduce_tensor

    if not tensor.is_cuda:
        raise ValueError("CUDA IPC needs a CUDA tensor; CPU engines use the broadcast path (sync)")
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
    return {"args": enc}


def ipc_handle_from_wire(wire: dict) -> torch.Tensor:
    """Inverse of ipc_handle_to_wire, in the engine process (same GPU). Only torch classes are resolved."""
    import importlib

    from torch.multiprocessing.reductions import rebuild_cuda_tensor

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


# ----------------------------------------------------------------------------------------------- trainer side
def named_weights(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, parameter) in a fixed order; FSDP2 keeps the HF names; torch.compile's `_orig_mod.` is stripped.
    Tied weights appear once (named_parameters de-duplicates), as HF's load_state_dict expects."""
    return [(n.replace("_orig_mod.", ""), p) for n, p in model.named_parameters()]


def full_tensor(p: torch.Tensor) -> torch.Tensor:
    """The unsharded value: a collective for FSDP2 DTensors (every rank must call it, in the same order)."""
    from torch.distributed.tensor import DTensor

    return p.full_tensor() if isinstance(p, DTensor) else p


def _trainer_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class _HttpCalls:
    """Runs one async call per engine concurrently (trio + httpx) in a helper thread; records the first error."""

    def __init__(self, engines: Sequence, make_call: Callable, what: str):
        self.error: BaseException | None = None
        self.results: list = [None] * len(engines)
        self._thread = threading.Thread(target=self._run, args=(engines, make_call, what), daemon=True)
        self._thread.start()

    def _run(self, engines, make_call, what):
        import trio

        async def one(i, eng):
            try:
                self.results[i] = await make_call(eng)
            except BaseException as e:  # noqa: BLE001 - reported to the waiting trainer thread
                if self.error is None:
                    self.error = WeightSyncError(f"engine {getattr(eng, 'url', eng)} failed {what}: "
                                                 f"{type(e).__name__}: {e}")

        async def main():
            async with trio.open_nursery() as nursery:
                for i, eng in enumerate(engines):
                    nursery.start_soon(one, i, eng)

        trio.run(main)

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def join(self, timeout_s: float, what: str) -> list:
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise WeightSyncError(f"{what}: no HTTP answer from every engine within {timeout_s:.0f}s")
        self.check()
        return self.results


class WeightSyncSender:
    """The trainer's side of weight sync (mutable: the group, the version, the bucket buffers).

    Call from every trainer rank (FSDP2 gathers are collectives); only rank 0 talks to engines and broadcasts.
    engines: SGLang-protocol clients (engines.sglang.SGLangEngine), each one process = one rank.
    mode: "bucketed" (flattened_bucket, the embedded engine) or "per_tensor" (a stock SGLang server).
    """

    def __init__(self, model: nn.Module, engines: Sequence, *, dtype: torch.dtype | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, backend: str | None = None, timeout_s: float = 300.0,
                 master_address: str = "127.0.0.1", master_port: int = 0, group_name: str = DEFAULT_GROUP_NAME,
                 mode: str = "bucketed", weight_version: int = 0):
        if mode not in ("bucketed", "per_tensor"):
            raise ValueError(f"mode={mode!r}: use 'bucketed' or 'per_tensor'")
        self.model, self.engines = model, list(engines)
        params = named_weights(model)
        if not params:
            raise ValueError("model has no parameters to sync")
        self.device = next(iter(params))[1].device
        self.dtype = dtype or next(iter(params))[1].dtype
        self.backend = backend or ("nccl" if self.device.type == "cuda" else "gloo")
        self.bucket_bytes, self.timeout_s, self.mode = bucket_bytes, timeout_s, mode
        self.master_address, self.master_port, self.group_name = master_address, master_port, group_name
        self.weight_version = weight_version
        self.rank = _trainer_rank()
        self.group: dist.ProcessGroup | None = None
        self._store = None
        self._generation = 0
        self.meta = plan_buckets([n for n, _ in params], [tuple(p.shape) for _, p in params], self.dtype,
                                 bucket_bytes)
        self._buffers: list[torch.Tensor] = []
        self.last_sync_s = float("nan")

    # ------------------------------------------------------------------ group
    def init_group(self) -> None:
        """(Re)build the dedicated group [trainer, engines...]; call again after an engine restarts."""
        if self.rank != 0:
            return
        self.close()
        self._generation += 1
        # A fresh store (and port) per generation: a restarted engine can never meet a stale half-built group.
        self._store = create_store(self.master_address, self.master_port if self._generation == 1 else 0,
                                   is_master=True, timeout_s=self.timeout_s)
        port = self._store.port
        world = 1 + len(self.engines)
        name = f"{self.group_name}_{self._generation}"

        def call(i_eng):
            i, eng = i_eng
            return eng.init_weights_update_group(master_address=self.master_address, master_port=port,
                                                 rank_offset=1 + i, world_size=world, group_name=name,
                                                 backend=self.backend, timeout_s=self.timeout_s)

        calls = _HttpCalls(list(enumerate(self.engines)), call, "init_weights_update_group")
        result: dict = {}

        def build():
            try:
                result["pg"] = build_group(self._store, rank=0, world_size=world, group_name=name,
                                           backend=self.backend, timeout_s=self.timeout_s)
            except BaseException as e:  # noqa: BLE001
                result["err"] = e

        t = threading.Thread(target=build, daemon=True)
        t.start()
        deadline = time.monotonic() + self.timeout_s
        while t.is_alive() and time.monotonic() < deadline:
            calls.check()
            t.join(0.005)
        if t.is_alive() or "err" in result:
            raise WeightSyncError(f"weight-update group {name!r} did not form with {len(self.engines)} engine(s) "
                                  f"within {self.timeout_s:.0f}s: {result.get('err', 'timeout')}")
        calls.join(self.timeout_s, "init_weights_update_group")
        self.group, self._group_name = result["pg"], name

    def close(self) -> None:
        if self.group is not None:
            try:
                self.group.shutdown()
            except Exception:  # noqa: BLE001 - best effort on a possibly broken group
                pass
        self.group = None
        self._buffers = []

    # ------------------------------------------------------------------ sync
    def _gathered(self) -> Iterator[tuple[int, torch.Tensor]]:
        """(index, full tensor cast to the engine dtype) for every parameter, all ranks in lockstep."""
        with torch.no_grad():
            for i, (_, p) in enumerate(named_weights(self.model)):
                yield i, full_tensor(p.detach()).to(self.dtype)

    def sync(self, weight_version: int | None = None,
             on_bucket: Callable[[int, int], None] | None = None) -> int:
        """Send the current weights to every engine; returns the new weight_version (all ranks).

        on_bucket(k, n_buckets) is called on rank 0 after bucket k's broadcast was issued (progress bars)."""
        version = self.weight_version + 1 if weight_version is None else weight_version
        if self.rank != 0:
            for _ in self._gathered():  # take part in the gathers only
                pass
            self.weight_version = version
            return version
        if self.group is None:
            raise WeightSyncError("no weight-update group: call init_group() first (again after an engine restart)")
        t0 = time.perf_counter()
        body = self.meta.to_wire(weight_version=version, group_name=self._group_name)
        if self.mode == "per_tensor":
            body.update(load_format=None)
            for key in ("offsets", "bucket_index", "bucket_nbytes"):
                body.pop(key, None)
        calls = _HttpCalls(self.engines, lambda eng: eng.update_weights_from_distributed(body),
                           "update_weights_from_distributed")
        try:
            if self.mode == "per_tensor":
                self._send_per_tensor(calls)
            else:
                self._send_buckets(calls, on_bucket)
            calls.join(self.timeout_s, "update_weights_from_distributed")
        except WeightSyncError as e:
            self.close()  # the group may hold a half-done collective: force a re-init
            raise self._explain(e, calls) from e
        except BaseException:
            self.close()
            raise
        self.weight_version = version
        self.last_sync_s = time.perf_counter() - t0
        return version

    def _explain(self, err: WeightSyncError, calls: _HttpCalls) -> WeightSyncError:
        """A transport error does not say which engine died; its HTTP call usually does, a moment later."""
        calls._thread.join(min(2.0, self.timeout_s))
        if calls.error is not None and calls.error is not err:
            return WeightSyncError(f"{calls.error} (transport: {err}); restart the engine and call init_group()")
        urls = ", ".join(getattr(e, "url", str(e)) for e in self.engines)
        return WeightSyncError(f"{err} (engines: {urls}); restart the failed engine and call init_group()")

    def _send_per_tensor(self, calls: _HttpCalls) -> None:
        for i, t in self._gathered():
            work = broadcast_async(self.group, t.contiguous())
            wait_work(work, timeout_s=self.timeout_s, what=f"broadcast of {self.meta.names[i]}", check=calls.check)

    def _send_buckets(self, calls: _HttpCalls, on_bucket) -> None:
        sizes = self.meta.bucket_nbytes
        cap = max(sizes)
        if len(self._buffers) != 2 or self._buffers[0].numel() < cap:
            self._buffers = [torch.empty(cap, dtype=torch.uint8, device=self.device) for _ in range(2)]
        inflight: list = [None, None]
        current = -1
        for i, t in self._gathered():
            b = self.meta.bucket_index[i]
            if b != current:
                if current >= 0:
                    inflight[current % 2] = self._issue(current, on_bucket, len(sizes))
                current = b
                if inflight[b % 2] is not None:  # double buffering: reuse a buffer only once its send finished
                    wait_work(inflight[b % 2], timeout_s=self.timeout_s, what=f"broadcast of bucket {b - 2}",
                              check=calls.check)
                    inflight[b % 2] = None
            off = self.meta.offsets[i]
            dst = self._buffers[b % 2][off:off + t.numel() * t.element_size()]
            dst.view(t.dtype).view(t.shape).copy_(t)
        inflight[current % 2] = self._issue(current, on_bucket, len(sizes))
        for k, work in enumerate(inflight):
            if work is not None:
                wait_work(work, timeout_s=self.timeout_s, what="broadcast of the last buckets", check=calls.check)
                inflight[k] = None

    def _issue(self, b: int, on_bucket, n: int):
        work = broadcast_async(self.group, self._buffers[b % 2][: self.meta.bucket_nbytes[b]])
        if on_bucket is not None:
            on_bucket(b, n)
        return work


# ----------------------------------------------------------------------------------------------- verification
@dataclass(frozen=True)
class VerifyResult:
    """max |engine log-prob - trainer log-prob| per engine over the probe tokens, and the versions engines report."""

    max_abs_diff: tuple[float, ...]
    versions: tuple[int, ...]
    expected_version: int
    tol: float

    @property
    def ok(self) -> bool:
        return all(d <= self.tol for d in self.max_abs_diff) and all(v == self.expected_version
                                                                        for v in self.versions)


# fp32 both sides: the only difference is batched/cached vs one-shot attention arithmetic. bf16: one bf16 rounding
# of logits-scale values (~2^-8 relative at |logit| ~ 10) dominates.
VERIFY_TOL = {torch.float32: 1e-5, torch.bfloat16: 5e-2, torch.float16: 1e-2}


def verify_sync(model: nn.Module, engines: Sequence, probe_prompts: Sequence[Sequence[int]], *,
                expected_version: int, max_new_tokens: int = 8, tol: float | None = None) -> VerifyResult:
    """Generate greedily from `probe_prompts` on every engine, recompute the log-prob of each generated token with
    the trainer's model, compare. Call on every trainer rank (an FSDP2 forward is collective); rank 0 asks the
    engines and shares their answers over the trainer's default group."""
    from engines.protocol import SamplingParams

    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True)
    answers = None
    if _trainer_rank() == 0:
        calls = _HttpCalls(engines, lambda eng: eng.generate([list(p) for p in probe_prompts], params), "generate")
        answers = calls.join(300.0, "verify_sync generate")
        answers = [[[(c.output_ids, c.logprobs, c.weight_version) for c in group] for group in per_engine]
                   for per_engine in answers]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [answers]
        dist.broadcast_object_list(box, src=0)
        answers = box[0]
    dtype = next(model.parameters()).dtype
    tol = VERIFY_TOL.get(dtype, 1e-2) if tol is None else tol
    diffs, versions = [], []
    device = next(model.parameters()).device
    with torch.no_grad():
        for per_engine in answers:
            worst = 0.0
            for prompt, group in zip(probe_prompts, per_engine):
                ids, lps, version = group[0]
                versions.append(version)
                seq = torch.tensor([list(prompt) + ids], device=device)
                logits = model(input_ids=seq).logits.float()[0, len(prompt) - 1:-1]
                ours = logits.log_softmax(-1).gather(-1, torch.tensor(ids, device=device)[:, None])[:, 0]
                worst = max(worst, (ours.cpu() - torch.tensor(lps)).abs().max().item())
            diffs.append(worst)
    per_engine_versions = tuple(versions[i * len(probe_prompts)] for i in range(len(answers)))
    return VerifyResult(tuple(diffs), per_engine_versions, expected_version, tol)
