"""The Tinker service's state: sessions, training clients (LoRA adapters), sampling sessions and futures.

One `Service` per server process, used from its asyncio loop only (the starlette routes); the training work runs
on each base model's worker thread (trainer/backend/protocol.py), the sampling in the embedded engine.

Futures: every queued request gets a request id whose result the SDK polls (/api/v1/retrieve_future). A request
that fails (bad input, unknown loss, a server error) becomes a failed future with the cause, never one that
hangs. Retries: the SDK's training requests carry (model_id, seq_id) and its samples (sampling_session_id,
seq_id); a second request with the same key gets the first one's request id and does not run again.

Checkpoints: tinker://<model_id>/weights/<name> (adapter + AdamW state) and tinker://<model_id>/sampler_weights/
<name> (adapter only, a PEFT folder) live under <output_dir>/<model_id>/{weights,sampler_weights}/<name>.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import threading
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from trainer.backend.protocol import LocalLoraBackend, LoraBase, LoraSpec
from trainer.serve.losses import LOSSES

MAX_FUTURES = 20_000  # results kept for polling; the oldest finished quarter goes past it
KEEP_SNAPSHOTS = 4  # in-memory sampler snapshots (engine adapters) per training client
KEEP_CHECKPOINT_SAMPLERS = 16  # per base: samplers of saved checkpoints and of unloaded clients' snapshots
MAX_COMPLETIONS = 4096  # ended requests a sampling session's completion log keeps for /retrieve_futures


class UserError(ValueError):
    """A request the caller must change (named input, how to fix it): HTTP 4xx or a failed future, category user."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass
class TrainingModel:
    """One training client: its adapter on a base model. Mutable: its checkpoints."""

    model_id: str
    base_name: str
    session_id: str
    spec: LoraSpec
    backend: LocalLoraBackend
    created: datetime
    user_metadata: dict | None = None
    checkpoints: list[dict] = field(default_factory=list)


@dataclass
class Sampler:
    """A sampling session: the base model and, for a trained model's weights, the engine adapter holding them and
    the same tensors for prompt log-probs through the trainer's forward."""

    sampler_id: str
    base_name: str
    model_path: str | None
    adapter: str | None = None
    weights: dict[str, torch.Tensor] | None = None
    spec: LoraSpec | None = None
    owner: str | None = None  # the training client of an in-memory snapshot (save_weights_and_get_sampling_client)


@dataclass
class Entry:
    """A future: the task computing its payload ((media type, bytes | JSON dict)) on the server loop."""

    task: asyncio.Future
    created: datetime
    key: tuple | None = None


def tinker_path(model_id: str, kind: str, name: str) -> str:
    return f"tinker://{model_id}/{kind}/{name}"


def parse_tinker_path(path: str) -> tuple[str, str, str]:
    """tinker://<model_id>/<weights | sampler_weights>/<name> -> (model_id, kind, name)."""
    parts = path.removeprefix("tinker://").split("/") if path.startswith("tinker://") else []
    if len(parts) != 3 or parts[1] not in ("weights", "sampler_weights") or not parts[0] or not parts[2]:
        raise UserError(f"checkpoint path {path!r}: expected tinker://<model_id>/weights/<name> or "
                        f"tinker://<model_id>/sampler_weights/<name> (what save_state / save_weights_for_sampler "
                        f"return)")
    return parts[0], parts[1], parts[2]


class Service:
    """Mutable state of a server (see the module docstring)."""

    def __init__(self, models: dict[str, str], output_dir: str | Path, *, max_clients: int = 8,
                 device: str = "cpu", dtype: torch.dtype = torch.float32, chunk_tokens: int | None = None,
                 engine_factory: Callable[[str], Any] | None = None) -> None:
        self.model_paths = models  # {base name: HF folder}
        self.output_dir = Path(output_dir)
        self.max_clients = max_clients
        self.device, self.dtype, self.chunk_tokens = device, dtype, chunk_tokens  # the base models' ([trainer])
        self.engine_factory = engine_factory
        self.bases: dict[str, LoraBase] = {}
        self.engines: dict[str, Any] = {}
        self.tokenizers: dict[str, Any] = {}
        self.sessions: dict[str, dict] = {}
        self.models: dict[str, TrainingModel] = {}
        self.samplers: dict[str, Sampler] = {}
        self.evicted: set[str] = set()
        self.direct: dict[tuple, str] = {}  # (base, checkpoint path, its version) -> sampler of session-less samples
        self.futures: dict[str, Entry] = {}
        self.seen: dict[tuple, str] = {}  # (owner id, seq_id, route) -> request id: retries run once
        self.completions: dict[str, list[dict]] = {}  # sampling session -> its ended requests, by cursor
        self._cursor = itertools.count(1)
        self.changed = asyncio.Event()
        self._ids = itertools.count(1)
        self._loading = threading.Lock()  # base(), engine(), tokenizer() run in worker threads (asyncio.to_thread)
        self.stopping = False  # stop_work ran: new requests are answered as cancelled (the server is shutting down)
        self._slots = threading.Lock()  # max_clients: a slot is taken before a client's (slow) build
        self._building = 0  # clients being built (create_model runs in worker threads)

    # -- futures ---------------------------------------------------------------------------------------
    def submit(self, work: Awaitable[tuple[str, Any]], key: tuple | None = None, owner: str | None = None) -> str:
        """A request id for `work` (a coroutine giving (media type, payload)); with a key seen before, the id of
        the first request with it (the work is dropped unstarted). owner: a sampling session whose completion
        log (/api/v1/retrieve_futures) gets this request when it ends."""
        if key is not None and key in self.seen:
            if asyncio.iscoroutine(work):
                work.close()
            return self.seen[key]
        request_id = f"req-{next(self._ids)}"
        task = asyncio.ensure_future(work)
        if self.stopping:  # after SIGINT / SIGTERM: its poll answers "cancelled: the server is shutting down"
            task.cancel()
        self.futures[request_id] = Entry(task, datetime.now(UTC), key)
        if owner is not None:
            task.add_done_callback(lambda t: self._completed(owner, request_id, t))
        if key is not None:
            self.seen[key] = request_id
        if len(self.futures) > MAX_FUTURES:
            self._forget_oldest()
        return request_id

    def _forget_oldest(self) -> None:
        """Drop the oldest finished futures (a quarter of MAX_FUTURES): the SDK reads a result within seconds, and
        a long run must not keep every step's outputs. Their retry keys go with them."""
        done = [rid for rid, e in self.futures.items() if e.task.done()][: MAX_FUTURES // 4]
        for rid in done:
            entry = self.futures.pop(rid)
            if entry.key is not None:
                self.seen.pop(entry.key, None)

    def _completed(self, owner: str, request_id: str, task: asyncio.Future) -> None:
        state = "failed" if task.cancelled() or task.exception() is not None else "finished"
        log = self.completions.setdefault(owner, [])
        log.append({"cursor": next(self._cursor), "request_id": request_id, "state": state})
        del log[:-MAX_COMPLETIONS]  # a session nobody polls (the SDK's default here) keeps only the newest
        self.changed.set()
        self.changed = asyncio.Event()  # the next completion wakes the next waiters

    async def completions_after(self, owner: str, cursor: int, timeout_s: float) -> tuple[list[dict], int]:
        """(completions of `owner` after `cursor`, the newest cursor), waiting up to timeout_s for one; the ones
        at or before `cursor` are seen and dropped."""
        log = self.completions.setdefault(owner, [])
        log[:] = [e for e in log if e["cursor"] > cursor]
        if not log:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), timeout_s)
            log = self.completions.get(owner, [])
        return list(log), max((e["cursor"] for e in log), default=cursor)

    def fail(self, error: Exception, key: tuple | None = None) -> str:
        async def failed() -> tuple[str, Any]:
            raise error
        return self.submit(failed(), key)

    # -- sessions and bases ----------------------------------------------------------------------------
    def new_session(self, body: dict) -> str:
        session_id = f"session-{uuid.uuid4().hex[:12]}"
        self.sessions[session_id] = {"created": datetime.now(UTC), "user_metadata": body.get("user_metadata"),
                                     "heartbeats": 0, "sampler_count": 0, "finished": None}
        return session_id

    def session(self, session_id: str | None) -> dict:
        """A session still open: an unknown one is a 404; a finished one (ServiceClient.close) a 410, which the SDK
        reads as "stop this session's heartbeats" (its training clients and checkpoints stay)."""
        if session_id not in self.sessions:
            raise UserError(f"unknown session_id {session_id!r}: make a tinker.ServiceClient (it creates one)",
                            status=404)
        session = self.sessions[session_id]
        if session["finished"] is not None:
            raise UserError(f"session {session_id!r} finished ({session['finished']}): make a new "
                            f"tinker.ServiceClient for new clients", status=410)
        return session

    async def base_async(self, name: str) -> LoraBase:
        """base(name) without a thread hop once it is loaded (the first call loads it in a worker thread)."""
        return self.bases.get(name) or await asyncio.to_thread(self.base, name)

    async def engine_async(self, name: str) -> Any:
        return self.engines.get(name) or await asyncio.to_thread(self.engine, name)

    async def tokenizer_async(self, name: str) -> Any:
        return self.tokenizers.get(name) or await asyncio.to_thread(self.tokenizer, name)

    def base(self, name: str) -> LoraBase:
        """The loaded base model `name` (loaded at its first use)."""
        if name not in self.model_paths:
            raise UserError(f"unknown base_model {name!r}: this server offers {sorted(self.model_paths)} "
                            f"([serve] models)", status=404)
        with self._loading:
            if name not in self.bases:
                self.bases[name] = LoraBase(self.model_paths[name], device=self.device, dtype=self.dtype,
                                            chunk_tokens=self.chunk_tokens)
        return self.bases[name]

    def model(self, model_id: str) -> TrainingModel:
        if model_id not in self.models:
            raise UserError(f"unknown model_id {model_id!r}: create it with create_lora_training_client "
                            f"(the server has {len(self.models)} training clients)", status=404)
        return self.models[model_id]

    def create_model(self, body: dict) -> TrainingModel:
        """A training client: a fresh LoRA adapter (Tinker's LoraConfig) on base_model, trained with AdamW."""
        optimizer = body.get("optimizer_config") or {"type": "adamw"}
        if not isinstance(optimizer, dict) or optimizer.get("type") != "adamw":
            raise UserError(f"optimizer_config = {optimizer!r}: this server trains with AdamW only (the SDK's "
                            f"default, AdamOptimizerConfig)")
        with self._slots:  # counted with the clients still being built: concurrent creates cannot pass the limit
            if len(self.models) + self._building >= self.max_clients:
                raise UserError(f"{len(self.models) + self._building} training clients already: [serve] max_clients "
                                f"= {self.max_clients}; unload one (unload_model) or raise max_clients", status=429)
            self._building += 1
        try:
            return self._build_model(body)
        finally:
            with self._slots:
                self._building -= 1

    def _build_model(self, body: dict) -> TrainingModel:
        lora = body.get("lora_config") or {}
        if not isinstance(lora.get("rank"), int) or lora["rank"] <= 0:
            raise UserError(f"lora_config.rank = {lora.get('rank')!r}: a positive integer (full fine-tuning is not "
                            f"served: every training client is a LoRA adapter)")
        seed = lora.get("seed")
        spec = LoraSpec(rank=lora["rank"], seed=int(seed) if seed is not None else 0,
                        train_attn=bool(lora.get("train_attn", True)), train_mlp=bool(lora.get("train_mlp", True)),
                        train_unembed=bool(lora.get("train_unembed", True)))
        base = self.base(body.get("base_model", ""))
        model_id = body.get("model_id") or f"model-{uuid.uuid4().hex[:12]}"
        adapter = f"client{next(self._ids)}"  # PEFT's module key: no '.' or ':' as model ids have
        backend = LocalLoraBackend(base, adapter, spec, LOSSES, self.output_dir / model_id)
        record = TrainingModel(model_id, body["base_model"], body.get("session_id", ""), spec, backend,
                               datetime.now(UTC), body.get("user_metadata"))
        with self._slots:
            self.models[model_id] = record
        return record

    def unload(self, model_id: str) -> None:
        record = self.models.pop(model_id)
        record.backend.close()

    # -- checkpoints -----------------------------------------------------------------------------------
    def checkpoint_folder(self, path: str) -> tuple[Path, str]:
        """(folder, kind) of a tinker:// path; the folder must exist."""
        model_id, kind, name = parse_tinker_path(path)
        folder = self.output_dir / model_id / kind / name
        if not (folder / "adapter_model.safetensors").is_file():
            raise UserError(f"checkpoint {path!r} does not exist on this server (no {folder})", status=404)
        return folder, kind

    def record_checkpoint(self, record: TrainingModel, kind: str, name: str, folder: Path) -> str:
        path = tinker_path(record.model_id, kind, name)
        size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
        record.checkpoints = [c for c in record.checkpoints if c["tinker_path"] != path]
        record.checkpoints.append({"checkpoint_id": f"{kind}/{name}", "tinker_path": path, "size_bytes": size,
                                   "checkpoint_type": "training" if kind == "weights" else "sampler",
                                   "time": datetime.now(UTC).isoformat(), "public": False})
        return path

    # -- sampling --------------------------------------------------------------------------------------
    def tokenizer(self, base_name: str) -> Any:
        with self._loading:
            if base_name not in self.tokenizers:
                from transformers import AutoTokenizer

                self.tokenizers[base_name] = AutoTokenizer.from_pretrained(self.model_paths[base_name])
        return self.tokenizers[base_name]

    def engine(self, base_name: str) -> Any:
        """The embedded engine of base model `base_name` (started at its first sample)."""
        with self._loading:
            if base_name not in self.engines:
                assert self.engine_factory is not None, "this server was built without an engine factory"
                self.engines[base_name] = self.engine_factory(self.model_paths[base_name])
        return self.engines[base_name]

    async def sampler_from_weights(self, record: TrainingModel, name: str, weights: dict[str, torch.Tensor]) -> str:
        """A sampling session on the adapter weights `weights`, synced to the engine in memory (no disk)."""
        sampler_id = f"sampler-{uuid.uuid4().hex[:12]}"
        engine = await asyncio.to_thread(self.engine, record.base_name)
        await engine.load_adapter_tensors(sampler_id, weights, record.backend.scaling())
        self.samplers[sampler_id] = Sampler(sampler_id, record.base_name, None, adapter=sampler_id,
                                            weights=weights, spec=record.spec, owner=record.model_id)
        await self._evict([s for s in self.samplers.values() if s.owner == record.model_id], KEEP_SNAPSHOTS, engine)
        return sampler_id

    async def sampler_from_path(self, base_name: str | None, model_path: str | None) -> str:
        """A sampling session of a base model (no adapter) or of a saved checkpoint (read from its folder)."""
        from safetensors.torch import load_file

        sampler_id = f"sampler-{uuid.uuid4().hex[:12]}"
        if model_path is None:
            await asyncio.to_thread(self.base, base_name or "")  # checks the name
            self.samplers[sampler_id] = Sampler(sampler_id, base_name, None)
            return sampler_id
        folder, _ = self.checkpoint_folder(model_path)
        config = json.loads((folder / "adapter_config.json").read_text())
        base_name = next((n for n, p in self.model_paths.items() if str(p) == config["base_model_name_or_path"]),
                         None)
        if base_name is None:
            raise UserError(f"{model_path}: trained on {config['base_model_name_or_path']}, which this server does "
                            f"not offer", status=404)
        targets = set(config["target_modules"])
        spec = LoraSpec(rank=config["r"], alpha=config["lora_alpha"], train_attn=bool(targets & {"q_proj", "v_proj"}),
                        train_mlp=bool(targets & {"up_proj", "down_proj"}), train_unembed="lm_head" in targets)
        weights = {k.removeprefix("base_model.model."): v
                   for k, v in load_file(str(folder / "adapter_model.safetensors")).items()}
        engine = await asyncio.to_thread(self.engine, base_name)
        await engine.load_adapter_tensors(sampler_id, weights, spec.alpha / spec.rank)
        self.samplers[sampler_id] = Sampler(sampler_id, base_name, model_path, sampler_id, weights, spec)
        await self._evict_ownerless(base_name, engine)
        return sampler_id

    async def release_snapshots(self, model_id: str) -> None:
        """After unload_model: the client's in-memory snapshots stay sampleable, now counted with the checkpoints'
        samplers of their base (its newest KEEP_CHECKPOINT_SAMPLERS kept), not kept per client for as long as the
        server runs."""
        mine = [s for s in self.samplers.values() if s.owner == model_id]
        for sampler in mine:
            sampler.owner = None
        for base_name in {s.base_name for s in mine}:
            await self._evict_ownerless(base_name, await asyncio.to_thread(self.engine, base_name))

    async def _evict_ownerless(self, base_name: str, engine: Any) -> None:
        """Keep the newest KEEP_CHECKPOINT_SAMPLERS adapters of `base_name`'s engine that no training client owns."""
        await self._evict([s for s in self.samplers.values()
                           if s.owner is None and s.adapter is not None and s.base_name == base_name],
                          KEEP_CHECKPOINT_SAMPLERS, engine)

    async def _evict(self, samplers: list[Sampler], keep: int, engine: Any) -> None:
        """Unload all but the newest `keep` of `samplers` from the engine; sampling one later says it was dropped."""
        for old in samplers[: max(0, len(samplers) - keep)]:
            del self.samplers[old.sampler_id]
            self.evicted.add(old.sampler_id)
            self.direct = {k: v for k, v in self.direct.items() if v != old.sampler_id}
            await engine.unload_adapter(old.adapter)  # rows still decoding with it finish with it

    async def direct_sampler(self, base_name: str | None, model_path: str | None) -> Sampler:
        """The sampler of an asample that names base_model / model_path instead of a session: one per (base, path,
        checkpoint file version), reused by later such requests."""
        stamp = None
        if model_path is not None:
            folder, _ = self.checkpoint_folder(model_path)
            stamp = (folder / "adapter_model.safetensors").stat().st_mtime_ns
        key = (base_name, model_path, stamp)
        if key not in self.direct:
            self.direct[key] = await self.sampler_from_path(base_name, model_path)
        return self.sampler(self.direct[key])

    def sampler(self, sampler_id: str | None) -> Sampler:
        if sampler_id in self.evicted:
            raise UserError(f"sampling session {sampler_id!r} was dropped: the engine keeps a training client's "
                            f"newest {KEEP_SNAPSHOTS} in-memory snapshots and the newest {KEEP_CHECKPOINT_SAMPLERS} "
                            f"samplers of saved checkpoints; make a new sampling client (of a checkpoint saved with "
                            f"save_weights_for_sampler(name) to keep one)", status=410)
        if sampler_id not in self.samplers:
            raise UserError(f"unknown sampling_session_id {sampler_id!r}: create a sampling client first "
                            f"(create_sampling_client / save_weights_and_get_sampling_client)", status=404)
        return self.samplers[sampler_id]

    def stop_work(self) -> None:
        """Fail every unfinished future now (retrieve_future answers "cancelled: the server is shutting down") and
        drop the queued training work; the request running on a worker finishes there; a request that arrives
        later is answered the same way (the SDK sends a client's queued requests one by one). Does not block."""
        self.stopping = True
        for task in (e.task for e in self.futures.values()):
            if not task.done():
                task.cancel()
        for base in self.bases.values():
            base.close(cancel=True, wait=False)

    def close(self) -> None:
        """Stop the work (stop_work), wait for the workers, stop the engines."""
        self.stop_work()
        for base in self.bases.values():
            base.close(cancel=True)
        for engine in self.engines.values():
            engine.close()
