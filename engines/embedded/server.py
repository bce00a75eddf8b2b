"""The embedded engine's HTTP server: SGLang's native protocol over starlette/uvicorn.

Endpoints (SGLang's names and fields): GET /health, /get_model_info, /get_server_info, /get_weight_version,
/flush_cache; POST /generate, /abort_request ({rid} or {abort_all: true}), /init_weights_update_group,
/update_weights_from_distributed, /update_weights_from_tensor, /update_weights_from_disk ({model_path,
weight_version}), /destroy_weights_update_group, /pause_generation
({mode: abort | in_place | retract}), /continue_generation. /health and /get_server_info report the load:
num_running_rows, num_waiting_rows, decode_steps. LoRA adapters (engines/embedded/lora.py): /load_lora_adapter
{lora_name, lora_path: a PEFT folder}, /unload_lora_adapter {lora_name}, `lora_path` (a loaded name, or one per
prompt) in /generate, `lora_adapters` in /get_server_info.

/get_server_info lists `weight_update_formats` (["direct", "flattened_bucket"]): a trainer sends the bucketed
extension only to an engine that lists it. Our extensions, all optional: `timeout_s` in
/init_weights_update_group (the group's collective timeout);
`load_format: "flattened_bucket"` in /update_weights_from_distributed with `offsets`, `bucket_index` and
`bucket_nbytes` (see engines/weight_sync/wire.py); `ipc_buckets` in /update_weights_from_tensor (JSON CUDA-IPC handles
instead of SGLang's pickled tensors: nothing is unpickled from the network); POST /colocated_weights (same-device
weight sync through the trainer's shared slots: engines/weight_sync/receiver.py `colocated_request`).
OpenAI's API for the `openai` SDK (engines/embedded/openai_routes.py): POST /v1/chat/completions, /v1/completions,
GET /v1/models.

Concurrency: one "model thread" runs everything that touches the model (decode steps, weight loads), so a weight
update never overlaps a forward; group joins run on other threads; the event loop parses and schedules, and the
model thread steps on by itself while the running rows are all a step needs (`EngineServer._steps`).
Continuous batching: rows of every /generate request join the running batch between decode steps (up to
`max_batch_rows` rows) and leave it when they finish; an aborted row leaves at the next step with what it has.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import random
import secrets
import threading
import time
import warnings
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import torch
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from engines.embedded.drafts import NgramDrafts
from engines.embedded.fast_decode import plain_decode
from engines.embedded.generation import DecodeBatch, Row, RowResult
from engines.embedded.graphs import GraphDecode, pooled_shape
from engines.embedded.graphs import unsupported as unsupported_graphs
from engines.embedded.lora import AdapterSet, read_peft_folder
from engines.embedded.openai_routes import openai_routes
from engines.embedded.prefix_cache import PrefixCache
from engines.openai_wire import WireError
from engines.weight_sync.receiver import (
    WeightReceiver,
    colocated_request,
    disk_targets,
    load_into,
    load_synced_adapter,
    read_safetensors_folder,
)
from engines.weight_sync.wire import WEIGHT_UPDATE_FORMATS, WeightMeta, lora_adapter_field
from kernels.device import dynamic_compile, release_host_threads, shared_stream

T = TypeVar("T")

SAMPLING_KEYS = {"temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "n", "seed", "sampling_seed",
                 "ignore_eos"}
# Accepted and ignored: they change nothing for token-id generation.
IGNORED_SAMPLING_KEYS = {"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "min_new_tokens"}
# The prefix cache's default budget (tokens of KV kept for reuse; engines/embedded/prefix_cache.py gives the bytes a
# token costs): a step of the agent demo holds ~18k tokens (128 episodes of ~140).
DEFAULT_PREFIX_CACHE_TOKENS = 32768


# The most tokens a speculative forward feeds (NgramDrafts.step_tokens), on the CPU and on other devices. On the CPU
# (one thread, the agent recipe's model; bench/results/speculative_decoding-cpu-2core.json) a forward costs a fixed
# ~1 ms plus ~0.025 ms a token fed: with 256, 4 / 16 / 64 / 128 rows of the agent recipe's tool call generated 3.5 /
# 2.5 / 1.7 / 1.3x faster than plain decoding (both with shared cache rows); before the budget, every row drafting 4
# tokens at 128 rows was slower than plain. Other devices: unmeasured; decode there is bound by reading the weights,
# not by compute, until many more tokens a step.
SPECULATIVE_STEP_TOKENS_CPU, SPECULATIVE_STEP_TOKENS_OTHER = 256, 4096


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def _eos_ids(tokenizer, model) -> set[int]:
    """Tokens that end a row unless ignore_eos: the tokenizer's eos and the model's generation-config eos ids."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    gen = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(gen if isinstance(gen, (list, tuple)) else [gen] if gen is not None else [])
    return {int(i) for i in ids}


@dataclass
class _Request:
    """One /generate call: its rows, their results as they finish, and the future its handler awaits."""

    rows: list[Row]
    future: asyncio.Future
    results: list[RowResult | None] = field(default_factory=list)
    remaining: int = 0

    def __post_init__(self):
        self.results, self.remaining = [None] * len(self.rows), len(self.rows)

    def deliver(self, k: int, result: RowResult, version: int, step: int) -> None:
        """Row k's result, from the decode step `step` (the engine's count) in which it finished or was cut."""
        self.results[k] = result
        self.remaining -= 1
        if self.remaining == 0 and not self.future.done():
            self.future.set_result((self.results, version, step))


def _model_thread(threads: int | None) -> ThreadPoolExecutor:
    """The one thread that runs the model, started now, on `threads` torch threads (None: the process's count).

    torch.set_num_threads sets the calling thread's OpenMP count and also the process-wide count that every thread
    adopts on its first parallel op. So the thread first adopts it (get_num_threads), then sets its own, and the
    process-wide count is set back to the calling thread's: the trainer's threads, and any thread started later,
    keep theirs. (A thread making its first parallel op in the moment between the two would adopt `threads`; engines
    are built on the main thread before the training threads exist.)"""
    assert threads is None or threads >= 1, f"threads={threads}: give a count >= 1, or None (the process's)"
    if threads is None:
        return ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")

    def own_count() -> None:
        torch.get_num_threads()  # this thread's one-time adoption of the process-wide count, before setting its own
        torch.set_num_threads(threads)

    before = torch.get_num_threads()
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model", initializer=own_count)
    pool.submit(lambda: None).result()  # start it now: the initializer runs in the new thread
    torch.set_num_threads(before)
    return pool


KV_FREE_FRACTION = 0.4  # [engines] kv_cache_tokens unset on CUDA: this share of the memory free when a batch starts


def kv_cell_bytes(model: torch.nn.Module) -> int:
    """Bytes of one KV-cache cell of `model` (a row's column: keys and values of every layer, in its dtype)."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return cfg.num_hidden_layers * 2 * kv_heads * head_dim * next(model.parameters()).element_size()


def auto_kv_cache_tokens(model: torch.nn.Module, idle_bytes: int = 0) -> int | None:
    """The KV budget when none is given, measured when a batch starts: on CUDA, KV_FREE_FRACTION of the memory free
    now (the device's, this process's cached free blocks: what a trainer in this process freed, and `idle_bytes`
    of pooled cache buffers the batch would reuse), in cells; on other devices None (no limit: host memory is the
    operating system's to refuse). Measured then, not when the engine starts: a run starts its engines before its
    trainer builds the model, so the free memory at start would not leave the trainer its share."""
    device = next(model.parameters()).device
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return max(1, int(KV_FREE_FRACTION * (free + cached + idle_bytes)) // kv_cell_bytes(model))


def kv_cells_needed(rows: int, columns: int) -> int:
    """The most KV-cache cells a batch of `rows` rows, `columns` wide at most, holds at once: a row each (a
    group's samples share a cache row only until they part, DecodeBatch._fork), twice while a growing cache copies
    into new buffers (KVCache.rebuilt holds the old and the new)."""
    return 2 * rows * columns


class EngineServer:
    """The engine's mutable state: the model, its weight version, the running batch, the queue, the weight groups.

    Continuous batching: the scheduler (`_loop`, on the event loop) runs one `DecodeBatch.step` at a time on the
    model thread, admitting queued rows between steps (up to `max_batch_rows` running). Aborts are applied before
    the next step, to rows being admitted by the step in flight too, and while paused in place. A weight update
    holds admission, waits until no row is running, loads, then lets rows in, so every completion comes from one
    weight version.

    threads: the model thread's torch intra-op threads (None: the process's). OpenMP's thread count is per calling
    thread, so an engine inside the trainer's process can decode on fewer threads than the trainer steps with.

    prefix_cache_tokens: the budget of the prefix cache (engines/embedded/prefix_cache.py: finished rows' KV, reused
    by later prompts that start with them, e.g. an episode's next turn; LRU by tokens); 0: off.

    speculative_tokens: draft tokens a row and step for speculative decoding by n-gram lookup
    (engines/embedded/drafts.py; the tokens drawn are those of plain decoding); 0: off.

    cuda_graphs: decode steps as CUDA graphs, one per bucketed row count (engines/embedded/graphs.py), instead of a
    torch.compile'd forward; on the CPU the same static step runs uncaptured (what the tests prove; no faster).

    kv_cache_tokens: the KV-cache cells (a row's column: its keys and values in every layer; `kv_cell_bytes`) the
    running rows may hold; a queued row is admitted only while the batch's worst case fits (`_cells`), and a row
    that cannot fit even alone is refused (400) naming it. None: unlimited on the CPU; on CUDA `KV_FREE_FRACTION`
    of the memory free when a batch starts (`auto_kv_cache_tokens`; a first row is admitted whatever it needs).

    share_stream: on CUDA, the model thread queues its work on the process's shared compute stream
    (kernels.device.shared_stream, the trainer's), so the engine and a trainer that waits while it generates
    allocate from one pool of cached blocks; ignored elsewhere.
    """

    def __init__(self, model, tokenizer, *, model_path: str, seed: int = 0, max_batch_rows: int = 256,
                 compile_decode: bool | None = None, threads: int | None = None,
                 prefix_cache_tokens: int = DEFAULT_PREFIX_CACHE_TOKENS, speculative_tokens: int = 0,
                 cuda_graphs: bool = False, kv_cache_tokens: int | None = None, share_stream: bool = False):
        self.model, self.tokenizer, self.model_path = model, tokenizer, model_path
        self.device = next(model.parameters()).device
        self.pad_id = next((t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id) if t is not None), 0)
        self.eos_ids = _eos_ids(tokenizer, model)
        self.weight_version = 0
        self.weights_consistent = True  # False after a failed sync left a partial update
        self.max_batch_rows = max_batch_rows
        assert kv_cache_tokens is None or kv_cache_tokens > 0, kv_cache_tokens
        self.kv_cache_tokens = kv_cache_tokens  # the given budget (None: auto)
        self.kv_budget = kv_cache_tokens  # the budget the running batch is admitted under (`_start_budget`)
        self.rng = random.Random(seed)
        self.receiver = WeightReceiver(model, self.device)
        self.model_thread = _model_thread(threads)
        self.stream = shared_stream(self.device) if share_stream and self.device.type == "cuda" else None
        why_not = unsupported_graphs(model) if cuda_graphs else None
        if why_not is not None:
            warnings.warn(f"[engines] cuda_graphs: this model decodes without graphs: {why_not}", RuntimeWarning,
                          stacklevel=2)
            cuda_graphs = False
        if compile_decode is None:  # graphs replace the compiled step (no compile time; the eager forward is their
            # fallback if capturing fails)
            compile_decode = self.device.type == "cuda" and not cuda_graphs
        # Decode is the hot loop (one token per row per call): compiled on CUDA only, with dynamic shapes as rows join
        # and leave; dynamic_compile keeps duck sizing from tying the batch's rows to its cache's at the first call,
        # and its batches never feed it a single row (DecodeBatch's min_decode_rows), whose size of 1 would
        # specialise a graph of its own: one graph for every batch.
        # On the CPU eager, through engines/embedded/fast_decode.py where it is exact for the model.
        self.compile_decode = compile_decode  # its batches feed it >= 2 rows (DecodeBatch's min_decode_rows)
        self.decode_fn = dynamic_compile(model.forward) if compile_decode else plain_decode(model)
        # Idle pooled buffers between batches: half the KV budget (a batch's worst case counts its rebuild twice)
        idle = None if self.kv_budget is None else self.kv_budget // 2
        self.graphs = GraphDecode(model, pad_id=self.pad_id, max_idle_cells=idle) if cuda_graphs else None
        self.adapters = AdapterSet(model)  # named LoRA adapters, applied per row (engines/embedded/lora.py)
        self._adapter_lock = asyncio.Lock()
        self.prefix_cache = PrefixCache(prefix_cache_tokens) if prefix_cache_tokens else None
        # Speculative decoding's draft source; kept across batches (its index of finished rows is weight-free)
        step_tokens = SPECULATIVE_STEP_TOKENS_CPU if self.device.type == "cpu" else SPECULATIVE_STEP_TOKENS_OTHER
        self.drafts = NgramDrafts(speculative_tokens, step_tokens=step_tokens) if speculative_tokens else None
        self.batch = self._new_batch()
        self.admitting: list = []  # rows taken from the queue for the step on the model thread now
        self.waiting: collections.deque[tuple[Row, tuple[_Request, int]]] = collections.deque()
        self.abort_all, self.abort_rids = False, set()
        self.holds = 0  # weight updates waiting for the batch to drain
        self.steps = 0  # decode steps started
        self.step_seconds = 0.0  # time spent in steps (the engine's busy time)
        self.stepping = False  # a step is on the model thread
        self.model_work = 0  # other work queued for (or on) the model thread: on_model_thread
        self.handoff = threading.Lock()  # the model thread's look at `_wanted` and its step count vs an abort
        self.closing = False  # shutdown(): the model thread stops stepping by itself (`_wanted`)
        self.running, self.wakeup = asyncio.Event(), asyncio.Event()
        self._scheduler: asyncio.Task | None = None

    def _new_batch(self) -> DecodeBatch:
        return DecodeBatch(self.model, pad_id=self.pad_id, decode_fn=self.decode_fn, adapters=self.adapters,
                           prefix_cache=self.prefix_cache, drafts=self.drafts, graphs=self.graphs,
                           min_decode_rows=2 if self.compile_decode else 1)

    def _write_adapter(self, slot: int, modules) -> None:
        """On the model thread: write an adapter into `slot`; the prefix cache forgets that slot's KV."""
        self.adapters.write(slot, modules)
        if self.prefix_cache is not None:
            self.prefix_cache.drop_adapter(slot)

    def flush_prefix_cache(self) -> None:
        """On the model thread: forget every cached prefix (SGLang's /flush_cache)."""
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    def set_weight_version(self, version: int) -> int:
        """After a load: the version the model's weights now are. Rows paused in place (an update in flight) go
        on with these weights, so their next tokens start a new span of RowResult.versions."""
        self.weight_version = self.batch.version = int(version)
        return self.weight_version

    @property
    def num_running_rows(self) -> int:
        return len(self.batch)

    def load(self) -> dict:
        return {"num_running_rows": self.num_running_rows, "num_waiting_rows": len(self.waiting),
                "decode_steps": self.steps, "step_seconds": round(self.step_seconds, 4),
                "max_batch_rows": self.max_batch_rows}

    # ------------------------------------------------------------------ scheduling
    async def start(self):
        self.running, self.wakeup = asyncio.Event(), asyncio.Event()  # bound to the server's loop
        self.running.set()
        self._scheduler = asyncio.create_task(self._loop())

    async def _loop(self):
        while True:
            # Paused: rows stay in place until a continue, or until an abort cuts them (abort() sets `wakeup`; the
            # cut runs as a step that samples nothing, so its requests are answered while the engine stays paused).
            while not self.running.is_set() and not (self.abort_all or self.abort_rids):
                self.wakeup.clear()
                await self.wakeup.wait()
            self.wakeup.clear()
            if not self.weights_consistent and not self.holds and (self.waiting or len(self.batch)):
                self._refuse_inconsistent()
                continue
            cut = None if self.abort_all else set(self.abort_rids)
            has_cut = self.abort_all or bool(self.abort_rids)
            self.abort_all, self.abort_rids = False, set()
            admit = []
            if not self.holds and self.running.is_set():
                if self.waiting and not len(self.batch):
                    self._start_budget()
                fits = self._admission()
                while (self.waiting and len(self.batch) + len(admit) < self.max_batch_rows
                       and fits(self.waiting[0][0])):
                    admit.append(self.waiting.popleft())
            if not admit and (not len(self.batch) or (not has_cut and not self.running.is_set())):
                await self.wakeup.wait()
                continue
            self.stepping = True
            self.steps += 1  # counted when it starts: the step in flight when an abort arrives is counted
            t0 = time.perf_counter()
            self.admitting = admit
            try:
                loop = asyncio.get_running_loop()
                done = await loop.run_in_executor(self.model_thread, self._then_idle, self._steps,
                                                  cut if has_cut else False, admit, self.running.is_set(), loop)
            except Exception as e:  # noqa: BLE001 - delivered to every request that had a row in the batch
                self._drop_batch([h for _, h in admit], e)
                continue
            finally:
                self.stepping, self.admitting = False, []
                self.step_seconds += time.perf_counter() - t0
            self._deliver(done, self.steps)  # the model thread is idle: its last step is the one counted last

    def _refuse_inconsistent(self) -> None:
        """On the loop, no step running: a sync failed part-way, so the weights mix two versions. Rows that were
        queued behind it, or paused in place through it, fail with a 503 instead of decoding on them (new requests
        are refused at /generate until a sync succeeds)."""
        error = BadRequest("the last weight sync failed part-way; generation resumes after a successful sync",
                           status=503)
        self._drop_batch([h for _, h in self.waiting], error)
        self.waiting = collections.deque()

    def _drop_batch(self, handles: list, error: Exception) -> None:
        """On the loop, no step running: fail `handles` and every running row with `error`, and go on with an empty
        batch (the old one's buffers back to the pool: its graphs would hold them otherwise)."""
        self._fail(handles + [a.handle for a in self.batch.rows], error)
        if self.graphs is not None:
            self.graphs.pool.give(self.batch.cache)
        self.batch = self._new_batch()
        self.batch.version = self.weight_version

    def _deliver(self, done: list, step: int) -> None:
        """On the loop: hand the rows that finished in decode step `step` to their requests."""
        for (req, k), result in done:
            req.deliver(k, result, self.weight_version, step)

    def shutdown(self) -> None:
        """Stop the model thread: it leaves its own stepping after the step in flight (`_wanted`; the loop that would
        deliver the rows is going away) and runs no queued work. Idempotent."""
        self.closing = True
        self.model_thread.shutdown(wait=False, cancel_futures=True)

    async def on_model_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on the model thread (a load, an adapter write, a flush), between two decode steps: the steps
        the model thread runs by itself stop for it (`_wanted`). When it leaves the engine with no running row on a
        CPU, the thread then releases its OpenMP pool (kernels.device.release_host_threads): the cores go back to
        whoever computes next (the trainer, when this engine shares its process) without libgomp throttling two
        pools on them."""
        self.model_work += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.model_thread, self._then_idle, fn, *args)
        finally:
            self.model_work -= 1

    def _then_idle(self, fn: Callable[..., T], *args: Any) -> T:
        """On the model thread, every piece of its work: on the shared stream when the engine has one (share_stream),
        then, once it leaves the engine idle on a CPU, the OpenMP pool released (on_model_thread says why)."""
        try:
            with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
                return fn(*args)
        finally:
            if self.device.type == "cpu" and not len(self.batch) and torch.get_num_threads() > 1:
                release_host_threads()

    def _steps(self, cut, admit: list, advance: bool, loop: asyncio.AbstractEventLoop) -> list:
        """On the model thread: `_step`, then further steps for as long as the running rows are all a step needs
        (nothing queued to admit, no abort, hold, pause or other model-thread work: `_wanted`), the rows each one
        finishes delivered on the loop as they finish. Returns the last step's finished rows.

        Why: a step handed over from the loop costs two thread hand-offs (~70 us median, ~200 us at p90 beside a
        busy rollout client); an agent step's ~185 batch steps spent ~45 ms of its ~0.41 s generation on them."""
        done = self._step(cut, admit, advance)
        while advance and len(self.batch):
            with self.handoff:  # an abort lands before this look or after this step is counted: its rows leave at
                if self._wanted():  # the step after the last one counted when it was answered, as before
                    break
                self.steps += 1
            if done:  # from the step counted before this one
                loop.call_soon_threadsafe(self._deliver, done, self.steps - 1)
            done = self.batch.step([])
        return done

    def _wanted(self) -> bool:
        """Whether the loop has something for the next step (read on the model thread: the loop thread sets these
        between steps, and a step that misses one is followed by a look at it, as a step in flight is now). A
        queued row counts once the batch could admit it (room under max_batch_rows and the KV budget)."""
        waiting = self.waiting  # the loop thread may replace the deque (an abort): read one
        head = waiting[0][0] if waiting else None
        admissible = head is not None and len(self.batch) < self.max_batch_rows and self._admission()(head)
        return (admissible or self.abort_all or bool(self.abort_rids) or self.holds > 0
                or self.model_work > 0 or not self.running.is_set() or self.closing)

    def _start_budget(self) -> None:
        """On the loop, when a batch starts: the budget it is admitted under (the given one, or measured now) and the
        idle pooled buffers the graphs may keep (half of it)."""
        if self.kv_cache_tokens is None:
            idle = 0 if self.graphs is None else self.graphs.pool.idle_cells
            self.kv_budget = auto_kv_cache_tokens(self.model, idle * kv_cell_bytes(self.model))
        if self.graphs is not None and self.kv_budget is not None:
            self.graphs.pool.max_idle_cells = self.kv_budget // 2

    def _cells(self, rows: int, length: int, append: int, capacity: tuple[int, int] = (0, 0)) -> int:
        """The KV cells a batch of `rows` rows holds at most: rows left-padded to the filled `length`, each
        appending up to `append` columns (at least the two spare columns DecodeBatch keeps; with drafts, a
        speculative step's), in buffers of at least `capacity` (rows, columns) (they keep their rows while the batch
        runs), rounded up as the graphs' pool does; twice that while a growing cache copies (kv_cells_needed)."""
        spare = 2 if self.drafts is None else max(2, self.drafts.tokens + 2)
        rows, columns = max(rows, capacity[0]), max(length + max(append, spare), capacity[1])
        if self.graphs is not None:
            rows, columns = pooled_shape(rows, columns)
        return kv_cells_needed(rows, columns)

    def _admission(self) -> Callable[[Row], bool]:
        """`fits(row)`, asked of queued rows in turn: whether `row` may join the running rows and the rows it said
        yes to before under the KV budget (always, into an empty batch: a row that cannot fit alone under a given
        budget was refused by `submit`). It keeps running maxima, so admitting n rows costs O(n), not O(n^2)."""
        if self.kv_budget is None:
            return lambda row: True
        cache = self.batch.cache
        # Rows are left-padded to one filled length (the batch's, or a longer joining prompt), then each may append
        # what it may still sample; the buffers keep their rows and columns while the batch runs.
        held = (cache.rows_capacity, cache.capacity) if cache is not None else (0, 0)
        state = [len(self.batch), cache.length if cache is not None else 0,
                 max((a.to_append for a in self.batch.rows), default=0)]  # rows, length, append

        def fits(row: Row) -> bool:
            rows, length, append = state[0] + 1, max(state[1], len(row.prompt)), max(state[2], row.max_new_tokens)
            if state[0] and self._cells(rows, length, append, held) > self.kv_budget:
                return False
            state[:] = rows, length, append
            return True

        return fits

    def _step(self, cut, admit: list, advance: bool) -> list:
        """On the model thread: cut aborted rows (False: none, None: all, else a set of rids), then one step
        (none while paused: rows stay in place)."""
        out = self.batch.abort(cut) if cut is not False else []
        return out + (self.batch.step(admit) if advance else [])

    @staticmethod
    def _fail(handles: list, error: Exception) -> None:
        for req, _ in handles:
            if not req.future.done():
                req.future.set_exception(error)

    async def submit(self, rows: list[Row]) -> tuple[list[RowResult], int, int]:
        """The rows' results, the weight version they ended on, and the decode step in which the last one finished."""
        if self.kv_cache_tokens is not None:
            for r in rows:
                need = self._cells(1, len(r.prompt), r.max_new_tokens)
                if need > self.kv_cache_tokens:
                    raise ValueError(f"a row of {len(r.prompt)} prompt tokens and up to {r.max_new_tokens} new ones "
                                     f"needs {need} KV-cache cells and this engine holds {self.kv_cache_tokens} "
                                     f"([engines] kv_cache_tokens): shorten the prompt or max_new_tokens, or raise "
                                     f"the budget")
        req = _Request(rows, asyncio.get_running_loop().create_future())
        self.waiting.extend((r, (req, k)) for k, r in enumerate(rows))
        self.wakeup.set()
        return await req.future

    def abort(self, rid: str | None) -> int:
        """Abort rows named `rid` (None: all): queued ones return at once, running ones at the next step. Returns
        the number of rows cut."""
        kept, n = collections.deque(), 0
        for row, (req, k) in self.waiting:
            if rid is None or row.rid == rid:
                req.deliver(k, RowResult([], [], "abort"), self.weight_version, self.steps)
                n += 1
            else:
                kept.append((row, (req, k)))
        self.waiting = kept
        # Running rows, and rows the step in flight is admitting: those are in batch.rows only once their prefill
        # is done (DecodeBatch._join), and stay in `admitting` until the step returns; counted once each (by
        # identity), less any already answered. The flag stops the model thread at its next look (`_wanted`) and
        # the loop cuts them from the batch.
        running = {id(a.row) for a in list(self.batch.rows) if rid is None or a.row.rid == rid}
        running |= {id(r) for r, (req, k) in self.admitting
                    if (rid is None or r.rid == rid) and req.results[k] is None}
        if running:
            with self.handoff:  # the model thread's next step either sees it or was counted before it
                if rid is None:
                    self.abort_all = True
                else:
                    self.abort_rids.add(rid)
            self.wakeup.set()
        return n + len(running)

    # ------------------------------------------------------------------ LoRA adapters
    def adapter_names(self) -> list[str]:
        return sorted(self.adapters.names)

    async def load_adapter(self, name: str, tensors: dict[str, torch.Tensor], scaling: float, *,
                           default: bool = False) -> None:
        """Load (or replace in place) adapter `name` from PEFT's tensors, between two decode steps; the base
        weights are not touched. default=True: requests that name no adapter use it from now on (a LoRA run's
        synced policy). Bad tensors raise ValueError (400) before anything changes."""
        if not isinstance(name, str) or not name:
            raise BadRequest(f"adapter name {name!r}: give a non-empty string")
        modules = self.adapters.parse(tensors, scaling)
        async with self._adapter_lock:  # one load at a time: each picks a free slot
            slot = self.adapters.free_slot(name, self._slots_in_use())
            await self.on_model_thread(self._write_adapter, slot, modules)
            self.adapters.names[name] = slot
            if default:
                self.adapters.default = name

    async def unload_adapter(self, name: str) -> None:
        """Drop adapter `name`: requests naming it are refused from now on (404); rows already admitted or queued
        with it finish with it (its slot is reused once none holds it)."""
        if name not in self.adapters.names:
            raise BadRequest(f"adapter {name!r} is not loaded; loaded: {self.adapter_names()}", status=404)
        del self.adapters.names[name]
        if self.adapters.default == name:
            self.adapters.default = None

    def _slots_in_use(self) -> set[int]:
        """Adapter slots held by a running, admitted or queued row."""
        rows = [a.row for a in list(self.batch.rows)] + [r for r, _ in self.admitting] + [r for r, _ in self.waiting]
        return {r.adapter for r in rows}

    @contextlib.asynccontextmanager
    async def exclusive(self):
        """Hold admission and wait until no row runs (queued rows stay queued; rows paused in place keep their
        cache and continue with the new weights, as in SGLang): weight loads happen here."""
        self.holds += 1
        try:
            while self.stepping or (len(self.batch) and self.running.is_set()):
                await asyncio.sleep(0.001)
            yield
        finally:
            # Weights may have changed (even at the same version number): no cached prefix is valid any more. No
            # step runs here (held, drained), so the model thread is not using the cache.
            self.flush_prefix_cache()
            self.holds -= 1
            self.wakeup.set()


# ---------------------------------------------------------------------------------------------- request parsing
def _int_list(x, what: str) -> list[int]:
    if not isinstance(x, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in x):
        raise BadRequest(f"{what} must be a list of token ids (ints)")
    return x


def parse_prompts(body: dict, tokenizer) -> tuple[list[list[int]], bool]:
    """(prompts, is_batch) from SGLang's input_ids (list or list of lists) or text (str or list of str)."""
    has_ids, has_text = body.get("input_ids") is not None, body.get("text") is not None
    if has_ids == has_text:
        raise BadRequest("give exactly one of 'input_ids' (token ids) or 'text'")
    if has_ids:
        ids = body["input_ids"]
        if isinstance(ids, list) and ids and isinstance(ids[0], list):
            return [_int_list(p, "input_ids[i]") for p in ids], True
        return [_int_list(ids, "input_ids")], False
    text = body["text"]
    if isinstance(text, str):
        return [tokenizer(text)["input_ids"]], False
    if isinstance(text, list) and all(isinstance(t, str) for t in text):
        return [tokenizer(t)["input_ids"] for t in text], True
    raise BadRequest("'text' must be a string or a list of strings")


def parse_sampling(sp, vocab_size: int) -> dict:
    if sp is None:
        sp = {}
    if not isinstance(sp, dict):
        raise BadRequest("'sampling_params' must be an object")
    unknown = set(sp) - SAMPLING_KEYS - IGNORED_SAMPLING_KEYS
    if unknown:
        raise BadRequest(f"unsupported sampling_params {sorted(unknown)}; supported: {sorted(SAMPLING_KEYS)}")
    try:
        out = {
            "temperature": float(sp.get("temperature", 1.0)),
            "top_p": float(sp.get("top_p", 1.0)),
            "top_k": int(sp.get("top_k", -1)),
            "max_new_tokens": int(sp.get("max_new_tokens", 128)),
            "n": int(sp.get("n", 1)),
            "ignore_eos": bool(sp.get("ignore_eos", False)),
        }
    except (TypeError, ValueError) as e:
        raise BadRequest(f"sampling_params has a non-numeric value: {e}") from e
    seed = sp.get("seed", sp.get("sampling_seed"))
    if seed is not None and not isinstance(seed, int):
        raise BadRequest("sampling_params.seed must be an int")
    out["seed"] = seed
    out["stop_token_ids"] = _int_list(sp.get("stop_token_ids") or [], "sampling_params.stop_token_ids")
    if out["temperature"] < 0 or not 0 < out["top_p"] <= 1 or out["max_new_tokens"] < 0 or out["n"] < 1:
        raise BadRequest("sampling_params out of range: need temperature >= 0, 0 < top_p <= 1, "
                         "max_new_tokens >= 0, n >= 1")
    return out


def parse_adapters(body: dict, server: EngineServer, n_prompts: int) -> list[int]:
    """The adapter slot of each prompt from SGLang's `lora_path` (a name for every prompt, or a list with one per
    prompt; null: the engine's default adapter, else the base). An unknown name is a 404 naming the loaded ones."""
    names = body.get("lora_path")
    if not isinstance(names, list):
        names = [names] * n_prompts
    if len(names) != n_prompts or not all(n is None or isinstance(n, str) for n in names):
        raise BadRequest(f"'lora_path' must be an adapter name (string) or a list of {n_prompts} names or nulls "
                         f"(one per prompt)")
    try:
        return [server.adapters.slot(n) for n in names]
    except KeyError as e:
        raise BadRequest(e.args[0], status=404) from e


def build_rows(server: EngineServer, prompts: list[list[int]], sps: list[dict], rids: list[str],
               adapters: list[int] | None = None) -> list[Row]:
    """Rows in prompt-major order (prompt 0's n samples, then prompt 1's...). With a seed, the j-th of a prompt's
    n rows uses seed + j (SGLang gives one request's seed to each of its prompts); without, each row draws its
    seed from the server's seeded RNG. Rows of prompt i carry rids[i] (what /abort_request names) and adapter
    slot adapters[i] (None: the base)."""
    vocab = server.model.config.vocab_size
    rows = []
    for prompt, sp, rid, slot in zip(prompts, sps, rids, adapters or [0] * len(prompts)):
        if not prompt:
            raise BadRequest("a prompt is empty: give at least one token")
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise BadRequest(f"input_ids out of range [0, {vocab})")
        stops = set(sp["stop_token_ids"])
        if not sp["ignore_eos"]:
            stops |= server.eos_ids
        for j in range(sp["n"]):
            seed = sp["seed"] + j if sp["seed"] is not None else server.rng.getrandbits(63)
            rows.append(Row(tuple(prompt), sp["temperature"], sp["top_p"], sp["top_k"], sp["max_new_tokens"],
                            frozenset(stops), seed, rid, slot))
    return rows


def parse_rids(body: dict, n_prompts: int) -> list[str]:
    """One request id per prompt: SGLang's `rid` (a string, or a list with one per prompt), else random."""
    rid = body.get("rid")
    if rid is None:
        base = secrets.token_hex(8)
        return [base if n_prompts == 1 else f"{base}-{i}" for i in range(n_prompts)]
    if isinstance(rid, str):
        return [rid] * n_prompts
    if isinstance(rid, list) and len(rid) == n_prompts and all(isinstance(r, str) for r in rid):
        return list(rid)
    raise BadRequest(f"'rid' must be a string or a list of {n_prompts} strings (one per prompt)")


def _output(server: EngineServer, r: RowResult, prompt_len: int, version: int, step: int, rid: str) -> dict:
    reason = {"type": r.finish_reason}
    if r.finish_reason == "stop":
        reason["matched"] = r.output_ids[-1]
    else:
        reason["length"] = len(r.output_ids)
    return {
        "text": server.tokenizer.decode(r.output_ids),
        "output_ids": r.output_ids,
        "meta_info": {
            "id": rid,
            "finish_reason": reason,
            "prompt_tokens": prompt_len,
            "completion_tokens": len(r.output_ids),
            "cached_tokens": r.cached_tokens,  # prompt tokens taken from the prefix cache (as SGLang reports)
            # speculative decoding: forwards that fed the row a draft (SGLang's name) and draft tokens it drew
            "spec_verify_ct": r.verify_steps,
            "spec_accepted_tokens": r.accepted_tokens,
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(r.logprobs, r.output_ids)],
            "weight_version": str(version),
            # ours: (first token index, version) of each run of tokens one weight version produced
            "weight_versions": [[i, v] for i, v in r.versions],
            # ours: the decode step (get_server_info's decode_steps count) in which the request's last row finished
            "decode_step": step,
        },
    }


# ---------------------------------------------------------------------------------------------- the app
@dataclass(frozen=True)
class Endpoint:
    """One endpoint: its HTTP methods and its handler, a request body (dict) in, a JSON-able answer out."""

    methods: tuple[str, ...]
    handler: Callable[[dict], Awaitable[dict | list]]


def route_handlers(server: EngineServer) -> dict[str, Endpoint]:
    """Every endpoint of the engine as a plain async function of the request body, on the server's event loop.

    The HTTP app wraps them (build_app); engines.local.LocalEngine calls them in process, without a socket. A
    handler raises BadRequest (its status) or ValueError (400); any other exception is a 500.
    """

    async def health(body: dict):
        # pid: whoever started this process knows it is this server answering on the port, not another one
        return {"status": "ok", "weight_version": str(server.weight_version), "pid": os.getpid(), **server.load()}

    async def model_info(body: dict):
        return {"model_path": server.model_path, "tokenizer_path": server.model_path,
                "is_generation": True, "weight_version": str(server.weight_version),
                "vocab_size": server.model.config.vocab_size, "device": str(server.device),
                "dtype": str(next(server.model.parameters()).dtype).removeprefix("torch.")}

    async def weight_version(body: dict):
        return {"weight_version": str(server.weight_version)}

    async def flush_cache(body: dict):
        # The prefix cache's entries (the running rows' own cache stays with them).
        await server.on_model_thread(server.flush_prefix_cache)
        return {"success": True, "message": "Cache flushed."}

    async def generate(body: dict):
        if body.get("stream"):
            raise BadRequest("stream=true is not supported by the embedded engine")
        prompts, is_batch = parse_prompts(body, server.tokenizer)
        sp = body.get("sampling_params")
        sps = [parse_sampling(s, 0) for s in sp] if isinstance(sp, list) else [parse_sampling(sp, 0)] * len(prompts)
        if len(sps) != len(prompts):
            raise BadRequest(f"{len(sps)} sampling_params for {len(prompts)} prompts")
        rids = parse_rids(body, len(prompts))
        rows = build_rows(server, prompts, sps, rids, parse_adapters(body, server, len(prompts)))
        if not server.weights_consistent:
            raise BadRequest("the last weight sync failed part-way; generation resumes after a successful sync",
                             status=503)
        results, version, step = await server.submit(rows)
        outs, k = [], 0
        for prompt, s, rid in zip(prompts, sps, rids):
            for j in range(s["n"]):
                rid_j = rid if s["n"] == 1 else f"{rid}-{j}"
                outs.append(_output(server, results[k], len(prompt), version, step, rid_j))
                k += 1
        return outs if (is_batch or len(outs) > 1) else outs[0]

    async def abort_request(body: dict):
        if body.get("abort_all"):
            n = server.abort(None)
        elif isinstance(body.get("rid"), str) and body["rid"]:
            n = server.abort(body["rid"])
        else:
            raise BadRequest("give 'rid' (a request id) or 'abort_all': true")
        return {"success": True, "message": f"aborted {n} rows", "aborted_rows": n, **server.load()}

    async def server_info(body: dict):
        # weight_update_formats is how a trainer negotiates: a stock SGLang does not send it and gets SGLang's
        # one-broadcast-per-tensor protocol ("direct"); this engine also reads the bucketed extension.
        return {**server.load(), "model_path": server.model_path, "device": str(server.device),
                "weight_version": str(server.weight_version), "tp_size": 1, "dp_size": 1,
                "weight_update_formats": list(WEIGHT_UPDATE_FORMATS), "lora_adapters": server.adapter_names()}

    async def load_lora(body: dict):
        """SGLang's /load_lora_adapter {lora_name, lora_path}: a PEFT adapter folder this process can read."""
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise BadRequest("fields 'lora_name' (the adapter's name) and 'lora_path' (a PEFT adapter folder) are "
                             "required")
        tensors, scaling = await anyio.to_thread.run_sync(read_peft_folder, path)
        await server.load_adapter(name, tensors, scaling)
        return {"success": True, "message": f"loaded adapter {name!r}", "loaded_adapters": server.adapter_names()}

    async def unload_lora(body: dict):
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            raise BadRequest("field 'lora_name' (the adapter's name) is required")
        await server.unload_adapter(name)
        return {"success": True, "message": f"unloaded adapter {name!r}", "loaded_adapters": server.adapter_names()}

    async def init_group(body: dict):
        need = {"master_address": str, "master_port": int, "rank_offset": int, "world_size": int}
        for key, typ in need.items():
            if not isinstance(body.get(key), typ):
                raise BadRequest(f"field {key!r} is required ({typ.__name__})")
        kwargs = {k: body[k] for k in need}
        kwargs["group_name"] = str(body.get("group_name") or "weight_update_group")
        kwargs["backend"] = str(body.get("backend") or ("nccl" if server.device.type == "cuda" else "gloo"))
        kwargs["timeout_s"] = float(body.get("timeout_s", 600))
        await anyio.to_thread.run_sync(lambda: server.receiver.init_group(**kwargs))
        return {"success": True, "message": f"joined {kwargs['group_name']} as rank "
                                            f"{kwargs['rank_offset']}/{kwargs['world_size']}"}

    async def destroy_group(body: dict):
        name = str(body.get("group_name") or "weight_update_group")
        return {"success": server.receiver.destroy_group(name), "message": name}

    def _bump(body: dict) -> int:
        v = body.get("weight_version")
        return server.set_weight_version(int(v) if v is not None else server.weight_version + 1)

    async def update_distributed(body: dict):
        meta = WeightMeta.from_wire(body)
        group = str(body.get("group_name") or "weight_update_group")
        if body.get("weight_version") is not None and not str(body["weight_version"]).isdigit():
            raise BadRequest("weight_version must be a non-negative integer (as a string or int)")
        lora = lora_adapter_field(body)  # a LoRA run's adapter sync (engines/weight_sync/wire.py)
        targets = server.receiver.check(meta, group, lora is not None)  # 400 before joining any broadcast
        async with server.exclusive():
            try:
                await server.on_model_thread(server.receiver.receive, meta, group, targets)
                await load_synced_adapter(server, lora, meta, targets)
            except BaseException:
                server.weights_consistent = False
                raise
        server.weights_consistent = True
        v = _bump(body)
        return {"success": True, "message": f"updated {len(meta.names)} tensors",
                "weight_version": str(v)}

    async def update_disk(body: dict):
        """SGLang's /update_weights_from_disk {model_path, weight_version?, load_format?}: reload every weight
        from the safetensors files of a folder this process can read (the trainer's disk fallback)."""
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            raise BadRequest("field 'model_path' (a folder of *.safetensors files) is required")
        if body.get("load_format") not in (None, "auto", "safetensors"):
            raise BadRequest(f"load_format={body['load_format']!r}: this engine reads 'safetensors' folders only")
        if body.get("weight_version") is not None and not str(body["weight_version"]).isdigit():
            raise BadRequest("weight_version must be a non-negative integer (as a string or int)")
        tensors = await anyio.to_thread.run_sync(read_safetensors_folder, path)
        targets = disk_targets(server.model, tensors)  # 400 before any weight changes
        async with server.exclusive():
            await server.on_model_thread(load_into, list(targets.values()), [tensors[n] for n in targets])
            server.adapters.default = None  # a whole model: requests naming no adapter get it (load_synced_adapter)
        server.weights_consistent = True
        v = _bump(body)
        return {"success": True, "message": f"loaded {len(targets)} tensors from {path}",
                "num_paused_requests": 0, "weight_version": str(v)}

    async def update_tensor(body: dict):
        if body.get("serialized_named_tensors") is not None:
            raise BadRequest("pickled 'serialized_named_tensors' are refused; send 'ipc_buckets' (JSON CUDA-IPC "
                             "handles, engines/weight_sync/wire.py ipc_handle_to_wire)")
        buckets = body.get("ipc_buckets")
        if not isinstance(buckets, list):
            raise BadRequest("field 'ipc_buckets' (list) is required")
        if server.device.type != "cuda":
            raise BadRequest("update_weights_from_tensor (CUDA IPC) needs a CUDA engine; use the broadcast path")
        async with server.exclusive():
            try:
                await server.on_model_thread(server.receiver.receive_ipc, buckets)
            except BaseException:  # a bucket refused after others were loaded: a partial update
                server.weights_consistent = False
                raise
            server.adapters.default = None  # a whole model: requests naming no adapter get it (load_synced_adapter)
        server.weights_consistent = True
        v = _bump(body)
        return {"success": True, "message": "updated", "weight_version": str(v)}

    async def pause(body: dict):
        mode = body.get("mode") or "in_place"
        if mode not in ("abort", "in_place", "retract"):
            raise BadRequest(f"pause_generation mode {mode!r}: expected 'abort', 'in_place' or 'retract'")
        if mode == "abort":
            server.abort(None)
        server.running.clear()
        return {"success": True, "message": f"paused ({mode})"}

    async def resume(body: dict):
        server.running.set()
        server.wakeup.set()
        return {"success": True, "message": "continued"}

    async def _colocated(body: dict):  # same-device weight sync (engines/weight_sync/receiver.py)
        return await colocated_request(server, body)

    return {
        "/health": Endpoint(("GET", "POST"), health),
        "/health_generate": Endpoint(("GET", "POST"), health),
        "/get_model_info": Endpoint(("GET",), model_info),
        "/get_weight_version": Endpoint(("GET",), weight_version),
        "/flush_cache": Endpoint(("GET", "POST"), flush_cache),
        "/generate": Endpoint(("POST",), generate),
        "/init_weights_update_group": Endpoint(("POST",), init_group),
        "/destroy_weights_update_group": Endpoint(("POST",), destroy_group),
        "/update_weights_from_distributed": Endpoint(("POST",), update_distributed),
        "/update_weights_from_tensor": Endpoint(("POST",), update_tensor),
        "/update_weights_from_disk": Endpoint(("POST",), update_disk),
        "/pause_generation": Endpoint(("POST",), pause),
        "/abort_request": Endpoint(("POST",), abort_request),
        "/get_server_info": Endpoint(("GET",), server_info),
        "/continue_generation": Endpoint(("POST",), resume),
        "/colocated_weights": Endpoint(("POST",), _colocated),
        "/load_lora_adapter": Endpoint(("POST",), load_lora),
        "/unload_lora_adapter": Endpoint(("POST",), unload_lora),
    }


def build_app(server: EngineServer, api_key: str | None = None) -> Starlette:
    """The HTTP app: each route of `route_handlers` behind starlette (JSON bodies; errors as SGLang's
    {success: false, message} with the handler's status)."""

    def endpoint(fn):
        async def wrapped(request: Request):
            try:
                try:
                    body = json.loads(await request.body() or b"{}")
                except json.JSONDecodeError as e:
                    raise BadRequest(f"request body is not valid JSON: {e}") from e
                if not isinstance(body, dict):
                    raise BadRequest("request body must be a JSON object")
                return JSONResponse(await fn(body))
            except BadRequest as e:
                return JSONResponse({"success": False, "message": str(e), "error": str(e)}, status_code=e.status)
            except ValueError as e:
                return JSONResponse({"success": False, "message": str(e), "error": str(e)}, status_code=400)
            except Exception as e:  # noqa: BLE001 - reported to the client, server stays up
                msg = f"{type(e).__name__}: {e}"
                return JSONResponse({"success": False, "message": msg, "error": msg}, status_code=500)

        return wrapped

    handlers = route_handlers(server)
    routes = [Route(path, endpoint(r.handler), methods=list(r.methods)) for path, r in handlers.items()]

    async def sample(body: dict):  # /generate for the OpenAI routes, its refusals in their error shape
        try:
            return await handlers["/generate"].handler(body)
        except BadRequest as e:
            raise WireError(str(e), status=e.status) from e

    routes += openai_routes(server, sample)  # /v1/chat/completions, /v1/completions, /v1/models

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await server.start()
        yield
        server.shutdown()

    app = Starlette(routes=routes, lifespan=lifespan)
    return ApiKeyMiddleware(app, api_key) if api_key else app


class ApiKeyMiddleware:
    """ASGI wrapper: with an API key set, every HTTP request needs `Authorization: Bearer KEY` (401 otherwise)."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(got, self.expected):
                msg = "missing or wrong API key: send 'Authorization: Bearer <key>'"
                resp = JSONResponse({"success": False, "message": msg, "error": msg}, status_code=401)
                return await resp(scope, receive, send)
        return await self.app(scope, receive, send)
