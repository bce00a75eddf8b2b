"""The embedded engine inside the trainer's own process: the same server, no socket, no JSON.

`LocalEngine` is `SGLangEngine` with its transport swapped. Each call goes straight to the embedded server's
route handler (engines/embedded/server.py `route_handlers`), run on the server's own asyncio loop in a background
thread, instead of over HTTP. Everything above the transport is the HTTP path's: the request bodies
(`generate_payload`: one request per group, seeds, rids), the parsing of the answers, aborts by rid, weight
versions, and the weight sync (the sender finds an embedded engine on its own host and hands it shared-memory
buckets, engines/weight_sync/wire.py). Everything below it is the same continuous-batching `EngineServer`.

Why: on small CPU work, the trainer's HTTP client and the engine's HTTP server cost as much CPU as the decode
steps themselves, and on a 2-core machine they compete with them (a 64-group step: ~0.3 s through HTTP, where the
decode steps alone take ~0.16 s). For one-machine runs this is verl's hybrid engine in spirit (rollouts in the
trainer's process); HTTP engines (the embedded engine process, SGLang, vLLM) remain the way to scale out, and the
CLI starts this one only when [engines] in_process = true.

Threads: the server's model thread runs the decode steps, on `threads` torch threads of its own (None: the process's
intra-op pool). OpenMP counts threads per calling thread, so the trainer keeps its own. In async RL the engine and
the trainer share the cores, and the engine gets [engines] threads (1). In synchronous RL the trainer waits while
the engine generates, so the run lends it the trainer's cores ([engines] lend_cores): `borrow_cores=True`, and each
call releases the calling thread's OpenMP pool while the model thread releases its own once its batch drains
(kernels.device.release_host_threads: two pools holding more threads than there are cores make libgomp sleep at
every barrier). Measured on the 2-core machine, the demo's GRPO step (512 samples): generation 0.13 -> 0.11 s with
the train step unchanged; without the releases, 2 engine threads generated no faster than 1 and the train step
slowed 0.20 -> 0.24 s (what an earlier round measured as "one thread is faster").
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import threading
from typing import Any

import sniffio

from engines.embedded.presets import load_engine_model
from engines.embedded.server import DEFAULT_PREFIX_CACHE_TOKENS, BadRequest, EngineServer, route_handlers
from engines.protocol import EngineError, EngineUnavailableError
from engines.sglang import SGLangEngine
from kernels.device import release_host_threads

_ids = itertools.count()


async def wait_future(fut: concurrent.futures.Future, *, cancel: bool = True) -> Any:
    """Await a future completed by another thread, from trio or asyncio. Cancelling the wait cancels `fut` (under
    asyncio always: wrap_future chains the cancellation; under trio when `cancel`)."""
    if sniffio.current_async_library() == "asyncio":
        return await asyncio.wrap_future(fut)
    import trio

    token, done = trio.lowlevel.current_trio_token(), trio.Event()

    def wake(_: concurrent.futures.Future) -> None:
        try:
            token.run_sync_soon(done.set)
        except trio.RunFinishedError:  # the waiting run is gone (cancelled): nobody to wake
            pass

    fut.add_done_callback(wake)
    try:
        await done.wait()
    except trio.Cancelled:
        if cancel:
            fut.cancel()
        raise
    return fut.result()


class LocalEngine(SGLangEngine):
    """An embedded engine served from this process (see the module docstring). `close()` stops it."""

    def __init__(self, model: str, *, seed: int = 0, device: str = "cpu", dtype: Any = None,
                 max_batch_rows: int = 1024, timeout_s: float = 300.0, threads: int | None = None,
                 prefix_cache_tokens: int = DEFAULT_PREFIX_CACHE_TOKENS, speculative_tokens: int = 0,
                 borrow_cores: bool = False, cuda_graphs: bool = False, kv_cache_tokens: int | None = None,
                 share_stream: bool = False):
        """model: a Hugging Face folder or "tiny" (engines/embedded/presets.py). max_batch_rows: rows decoded
        together (a step of 64 prompts x 8 samples fits in one batch at the default). threads: the model thread's
        torch threads (None: the process's intra-op pool). prefix_cache_tokens: the KV budget of the engine's prefix
        cache (engines/embedded/prefix_cache.py; 0: off). speculative_tokens: draft tokens a row and step
        (engines/embedded/drafts.py; 0: off). borrow_cores: the callers wait while it works (synchronous RL), so
        each call first releases the calling thread's OpenMP pool (the module docstring). cuda_graphs: decode steps
        as CUDA graphs (engines/embedded/graphs.py). kv_cache_tokens: the KV cells its running rows may hold
        (EngineServer; None: its default). share_stream: on CUDA, generate on the trainer's compute stream
        (kernels.device.shared_stream: the callers wait while it generates, so the two share cached memory)."""
        self.borrow_cores = borrow_cores and str(device) == "cpu"
        net, tokenizer = load_engine_model(model, seed=seed, dtype=dtype, device=device)
        super().__init__(f"local://localhost/{next(_ids)}", timeout_s=timeout_s)
        self.server = EngineServer(net, tokenizer, model_path=model, seed=seed, max_batch_rows=max_batch_rows,
                                   threads=threads, prefix_cache_tokens=prefix_cache_tokens,
                                   speculative_tokens=speculative_tokens, cuda_graphs=cuda_graphs,
                                   kv_cache_tokens=kv_cache_tokens, share_stream=share_stream)
        self._routes = route_handlers(self.server)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="local-engine", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self._loop).result(timeout=30)

    def __repr__(self) -> str:
        return f"LocalEngine({self.server.model_path!r})"

    def __getstate__(self) -> dict:
        raise TypeError(f"{self!r} lives in this process (its model, thread and event loop) and cannot be copied to "
                        f"another: start the engine as a server (kind \"embedded\") to reach it from elsewhere")

    async def _call(self, method: str, route: str, body: dict | None = None, timeout_s: float | None = None):
        """The route's handler on the server's loop; its errors become the same EngineError /
        EngineUnavailableError, with the same `status`, that the HTTP client raises for the answer the HTTP server
        would give (404 for a route the server lacks, the handler's BadRequest status, 400, 500)."""
        where = f"{self.url}{route}"
        endpoint = self._routes.get(route)
        if endpoint is None or method not in endpoint.methods:
            raise EngineError(f"{where}: HTTP 404: no {method} route {route!r} in the embedded engine", status=404)
        if self._loop.is_closed() or not self._thread.is_alive():
            raise EngineUnavailableError(f"{where}: no answer (the in-process engine was closed)")
        if self.borrow_cores:
            release_host_threads()  # this thread waits while the model thread computes on its cores
        fut = asyncio.run_coroutine_threadsafe(endpoint.handler(dict(body or {})), self._loop)
        try:
            data = await _wait_with_timeout(fut, timeout_s or self.timeout_s)
        except BadRequest as e:
            err = EngineUnavailableError if e.status >= 500 else EngineError
            raise err(f"{where}: HTTP {e.status}: {e}", status=e.status) from e
        except ValueError as e:
            raise EngineError(f"{where}: HTTP 400: {e}", status=400) from e
        except TimeoutError as e:
            raise EngineUnavailableError(f"{where}: no answer in {timeout_s or self.timeout_s} s") from e
        except (EngineError, concurrent.futures.CancelledError):
            raise
        except Exception as e:  # noqa: BLE001 - what the HTTP server answers with a 500
            raise EngineUnavailableError(f"{where}: HTTP 500: {type(e).__name__}: {e}", status=500) from e
        if isinstance(data, dict) and data.get("success") is False:
            raise EngineError(f"{where}: HTTP 200: {data.get('message')}", status=200)
        return data

    async def load_adapter_tensors(self, name: str, tensors: dict, scaling: float, *, default: bool = False) -> None:
        """Load (or replace) LoRA adapter `name` from tensors in this process (PEFT's keys, engines/embedded/lora.py),
        no disk and no JSON; default=True makes it the adapter of requests that name none. Errors as `_call`'s."""
        await self._on_loop(f"adapter {name!r}", self.server.load_adapter(name, tensors, scaling, default=default))

    async def _on_loop(self, what: str, coro) -> Any:
        """A coroutine of the server, run on its loop; BadRequest / ValueError become EngineError with the status
        the HTTP server would answer."""
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return await _wait_with_timeout(fut, self.timeout_s)
        except BadRequest as e:
            raise EngineError(f"{self.url}: {what}: HTTP {e.status}: {e}", status=e.status) from e
        except ValueError as e:
            raise EngineError(f"{self.url}: {what}: HTTP 400: {e}", status=400) from e

    async def aclose(self) -> None:  # no connections to close
        return None

    def close(self) -> None:
        """Stop the server's scheduler, its loop and its model thread (idempotent)."""
        if self._loop.is_closed():
            return

        async def cancel_tasks() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        self.server.closing = True  # first: a model thread stepping by itself stops after its step in flight
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(cancel_tasks(), self._loop).result(timeout=30)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self.server.shutdown()
        self._loop.close()


async def _wait_with_timeout(fut: concurrent.futures.Future, timeout_s: float) -> Any:
    if sniffio.current_async_library() == "asyncio":
        return await asyncio.wait_for(wait_future(fut), timeout_s)
    import trio

    with trio.move_on_after(timeout_s):
        return await wait_future(fut)
    raise TimeoutError  # only reached when move_on_after cancelled the wait
