"""The one client for SGLang's native HTTP protocol; drives the embedded engine and a real SGLang server alike.

Rollouts, evaluation and weight sync all use `SGLangEngine`. Request fields follow SGLang's io_struct:
/generate {input_ids, sampling_params{temperature, top_p, top_k, max_new_tokens, stop_token_ids, n, sampling_seed,
ignore_eos}, return_logprob, rid}; /abort_request {rid} or {abort_all: true}; /init_weights_update_group
{master_address, master_port, rank_offset, world_size, group_name, backend}; /update_weights_from_distributed
{names, dtypes, shapes, group_name, flush_cache, weight_version, load_format}; /update_weights_from_disk
{model_path, weight_version}; /get_server_info -> tp_size, weight_update_formats (ours only). Responses: generate ->
{output_ids, meta_info{finish_reason, output_token_logprobs [[logprob, id, text]], weight_version}}; weight routes
-> {success, message}.

Log-probs: we send `return_logprob: true` and rely on SGLang's default `SGLANG_RETURN_ORIGINAL_LOGPROB=false`
(a server environment variable, not a request field): SGLang then returns the log-prob of each sampled token
under the temperature-scaled distribution, before top-k/top-p, which is this project's contract
(engines/protocol.py). A server started with `SGLANG_RETURN_ORIGINAL_LOGPROB=1` returns temperature-1 log-probs
instead, which the trainer's mismatch metrics show at once for temperature != 1.

Seeds: SGLang applies one request's `sampling_seed` to each of its `n` samples, which would make them identical;
so a seeded request with n > 1 is sent as a batch of n copies of the prompt, the j-th with seed + j (still one
HTTP request). Finish reasons: "stop" (with or without `matched`: a token id, a stop string or None), "length"
and "abort" (with optional message/status); anything else is an error, never taken as "completed". SGLang's
default weight version, the string "default", means "never updated": we report the last version we set.

Connections: one pooled keep-alive `httpx.AsyncClient` per event loop (trio or asyncio), reused by every call
made from that loop; `aclose()` closes the current loop's client. Extensions only the embedded engine reads
(a stock SGLang ignores or rejects them): `timeout_s` in the group init, the flattened_bucket
`offsets/bucket_index/bucket_nbytes` fields. Every call has a timeout; errors raise `EngineError` (the request
was rejected) or `EngineUnavailableError` (no answer, or 5xx: worth retrying) with the URL, route, status and
the server's message.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import httpx
import sniffio

from engines.protocol import (
    FINISH_REASONS,
    Completion,
    EngineError,
    EngineUnavailableError,
    SamplingParams,
    tls_context,
)

SHARD_CONNECTIONS = 8  # connections per pooled client (SGLangEngine._shards says why)


def _sampling_dict(params: SamplingParams, *, n: int, seed: int | None) -> dict:
    sp = {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
          "max_new_tokens": params.max_new_tokens, "stop_token_ids": list(params.stop_token_ids), "n": n,
          "ignore_eos": params.ignore_eos}
    if seed is not None:
        sp["sampling_seed"] = seed
    return sp


def generate_payload(prompts: Sequence[Sequence[int]], params: SamplingParams,
                     rids: Sequence[str] | None = None, adapter: str | None = None) -> dict:
    """The /generate body for `prompts` x `params.n` (prompt-major order of the answers); `adapter` names a
    loaded LoRA adapter (SGLang's `lora_path`), None: the server's default."""
    body = _payload(prompts, params, rids)
    if adapter is not None:
        body["lora_path"] = adapter
    return body


def _payload(prompts: Sequence[Sequence[int]], params: SamplingParams, rids: Sequence[str] | None) -> dict:
    if rids is not None and len(rids) != len(prompts):
        raise ValueError(f"rids: {len(rids)} ids for {len(prompts)} prompts; give one per prompt")
    if params.seed is not None and params.n > 1:  # one row per sample, each with its own seed
        ids = [list(p) for p in prompts for _ in range(params.n)]
        sps = [_sampling_dict(params, n=1, seed=params.seed + j) for _ in prompts for j in range(params.n)]
        body = {"input_ids": ids, "sampling_params": sps, "return_logprob": True}
        if rids is not None:
            body["rid"] = [f"{r}-{j}" for r in rids for j in range(params.n)]
        return body
    body = {"input_ids": [list(p) for p in prompts], "sampling_params": _sampling_dict(params, n=params.n,
                                                                                       seed=params.seed),
            "return_logprob": True}
    if rids is not None:
        body["rid"] = list(rids)
    return body


def parse_finish_reason(reason: Any) -> str:
    """"stop" | "length" | "abort" from SGLang's finish_reason ({"type": ..., "matched"/"length"/"message"...}
    or a bare string); anything else raises EngineError."""
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if isinstance(kind, str) and kind in FINISH_REASONS:
        return kind
    raise EngineError(f"unknown finish_reason {reason!r}: expected type 'stop', 'length' or 'abort' (SGLang's); "
                      f"the engine speaks a protocol this client does not know")


def parse_weight_version(value: Any, fallback: int) -> int:
    """SGLang's weight_version: a decimal string or int; "default" (or absent) means never updated -> fallback."""
    if value is None or value == "default":
        return fallback
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.isdigit():
        return int(value)
    raise EngineError(f"weight_version {value!r} is not an integer version; this client sets decimal versions "
                      f"('0', '1', ...) and reads SGLang's 'default' as unset")


def parse_generate(resp: Any, prompts: Sequence[Sequence[int]], n: int,
                   fallback_version: int = 0) -> list[list[Completion]]:
    """Group a batch response (prompt-major, n per prompt) into one list of Completions per prompt."""
    outs = resp if isinstance(resp, list) else [resp]
    if len(outs) != len(prompts) * n:
        raise EngineError(f"/generate returned {len(outs)} outputs for {len(prompts)} prompts x n={n}")
    groups = []
    for i, prompt in enumerate(prompts):
        group = []
        for o in outs[i * n:(i + 1) * n]:
            meta = o.get("meta_info") or {}
            lps = meta.get("output_token_logprobs") or []
            ids = o.get("output_ids")
            ids = [int(e[1]) for e in lps] if ids is None else [int(t) for t in ids]
            if len(lps) != len(ids):
                raise EngineError(f"/generate returned {len(ids)} output ids but {len(lps)} log-probs; the engine "
                                  f"must honour return_logprob=true")
            version = parse_weight_version(meta.get("weight_version"), fallback_version)
            # The embedded engine says which version produced which tokens (an update in flight splits a row);
            # a stock SGLang reports one version a request: every token gets it.
            spans = tuple((int(i), int(v)) for i, v in meta.get("weight_versions") or ()) or ((0, version),)
            group.append(Completion(output_ids=ids, logprobs=[float(x[0]) for x in lps],
                                    finish_reason=parse_finish_reason(meta.get("finish_reason")),
                                    weight_version=version, prompt_ids=list(prompt),
                                    weight_versions=spans if ids else (),
                                    cached_tokens=int(meta.get("cached_tokens") or 0),
                                    spec_accepted_tokens=int(meta.get("spec_accepted_tokens") or 0)))
        groups.append(group)
    return groups


def _loop_key() -> object:
    """An object identifying the running event loop (trio's token or the asyncio loop)."""
    if sniffio.current_async_library() == "trio":
        import trio

        return trio.lowlevel.current_trio_token()
    import asyncio

    return asyncio.get_running_loop()


class SGLangEngine:
    """One SGLang-protocol server (see the module docstring). Usable from any event loop or thread: each loop
    gets its own pooled client (the weight sync runs its calls on its own trio thread, rollouts on theirs)."""

    def __init__(self, url: str, *, api_key: str | None = None, timeout_s: float = 300.0,
                 connect_timeout_s: float = 10.0, max_connections: int = 64, tp_size: int | None = None,
                 extensions: bool = True):
        """tp_size: the server's tensor-parallel workers (each takes one rank of the weight-update group); None =
        ask /get_server_info. extensions=False: speak stock SGLang only (no colocated probe, no `timeout_s`, no
        bucketed format even where the server lists it)."""
        if tp_size is not None and (isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1):
            raise ValueError(f"tp_size={tp_size!r}: give the server's tensor-parallel size (an int >= 1)")
        self.url = url.rstrip("/")
        self.tp_size, self.extensions = tp_size, extensions
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout_s, self.connect_timeout_s, self.max_connections = timeout_s, connect_timeout_s, max_connections
        self.weight_version = 0  # the last version we set: what SGLang's "default" stands for
        # Keyed weakly by the loop: a client whose loop ended (it cannot be closed from another loop) is dropped.
        self._clients: weakref.WeakKeyDictionary[object, httpx.AsyncClient] = weakref.WeakKeyDictionary()
        self._expanded: dict[str, int] = {}  # rid -> n of seeded requests in flight sent as one row per sample
        self._lock = threading.Lock()

    def __repr__(self):
        return f"SGLangEngine({self.url!r})"

    def __getstate__(self) -> dict:
        """A copy for another process (a rollout process): the address and settings, without this process's
        pooled connections, lock or in-flight bookkeeping."""
        drop = ("_clients", "_expanded", "_lock")
        return {k: v for k, v in self.__dict__.items() if k not in drop}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._clients = weakref.WeakKeyDictionary()
        self._expanded = {}
        self._lock = threading.Lock()

    def _shards(self) -> list[list]:
        """This event loop's pooled clients, as [client, requests in flight] pairs: ceil(max_connections /
        SHARD_CONNECTIONS) small pools rather than one large one. httpcore's pool scans all its connections for
        every waiting request on every request event, so one pool of 64 busy keep-alive connections cost the rollout
        ~0.45 s of CPU a step of 64 requests (the demo's, measured in one long-lived loop); pools of 8 cost 1/64 of
        that scan."""
        key = _loop_key()
        with self._lock:
            shards = self._clients.get(key)
            if shards is None:
                n = -(-self.max_connections // SHARD_CONNECTIONS)
                per = -(-self.max_connections // n)
                limits = httpx.Limits(max_connections=per, max_keepalive_connections=per)
                shards = [[httpx.AsyncClient(headers=self.headers, limits=limits, verify=tls_context(),
                                             timeout=httpx.Timeout(self.timeout_s, connect=self.connect_timeout_s)), 0]
                          for _ in range(n)]
                self._clients[key] = shards
            return shards

    @contextlib.contextmanager
    def _client(self) -> Iterator[httpx.AsyncClient]:
        """The least busy pooled client of this loop, for one request."""
        shard = min(self._shards(), key=lambda sh: sh[1])
        shard[1] += 1
        try:
            yield shard[0]
        finally:
            shard[1] -= 1

    async def aclose(self) -> None:
        """Close the pooled connections of the current event loop (a later call opens new ones)."""
        with self._lock:
            shards = self._clients.pop(_loop_key(), None)
        for client, _ in shards or ():
            await client.aclose()

    async def _call(self, method: str, route: str, body: dict | None = None, timeout_s: float | None = None):
        timeout = httpx.Timeout(timeout_s or self.timeout_s, connect=min(self.connect_timeout_s,
                                                                         timeout_s or self.timeout_s))
        try:
            with self._client() as client:
                r = await client.request(method, self.url + route, json=body, timeout=timeout)
        except httpx.HTTPError as e:
            raise EngineUnavailableError(f"{self.url}{route}: no answer ({type(e).__name__}: {e})") from e
        try:
            data = r.json()
        except ValueError:
            data = {"message": r.text}
        if r.status_code >= 400 or (isinstance(data, dict) and data.get("success") is False):
            msg = (data.get("message") or data.get("error")) if isinstance(data, dict) else data
            err = EngineUnavailableError if r.status_code >= 500 else EngineError
            raise err(f"{self.url}{route}: HTTP {r.status_code}: {msg}", status=r.status_code)
        return data

    async def health(self) -> bool:
        try:
            await self._call("GET", "/health", timeout_s=min(self.timeout_s, 10.0))
            return True
        except EngineError:
            return False

    async def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                       rids: Sequence[str] | None = None, adapter: str | None = None) -> list[list[Completion]]:
        if not prompts:
            return []
        body = generate_payload(prompts, params, rids, adapter)
        expanded = len(body["input_ids"]) != len(prompts)  # seeded n > 1: one row per sample
        if expanded and rids is not None:
            self._expanded.update({r: params.n for r in rids})
        try:
            data = await self._call("POST", "/generate", body)
        finally:
            for r in rids if expanded and rids is not None else ():
                self._expanded.pop(r, None)
        if not expanded:
            return parse_generate(data, prompts, params.n, self.weight_version)
        rows = parse_generate(data, [p for p in prompts for _ in range(params.n)], 1, self.weight_version)
        return [[g[0] for g in rows[i * params.n:(i + 1) * params.n]] for i in range(len(prompts))]

    async def abort(self, rids: Sequence[str] | None = None) -> None:
        """SGLang's /abort_request, by rid or all. A seeded n > 1 request in flight went out as rows
        `rid-0..rid-(n-1)`: naming `rid` aborts each of them. Servers without the route get
        /pause_generation {"mode": "abort"} + /continue_generation (which cuts every request)."""
        if rids is None:
            bodies = [{"abort_all": True, "rid": ""}]
        else:
            bodies = [{"rid": f"{r}-{j}" if j >= 0 else r} for r in rids for j in range(-1, self._expanded.get(r, 0))]
        for body in bodies:
            try:
                await self._call("POST", "/abort_request", body, timeout_s=min(self.timeout_s, 10.0))
            except EngineError as e:
                if not e.missing_route:
                    raise
                await self._call("POST", "/pause_generation", {"mode": "abort"})
                await self._call("POST", "/continue_generation", {})
                return

    async def get_model_info(self) -> dict:
        return await self._call("GET", "/get_model_info")

    async def get_server_info(self) -> dict:
        return await self._call("GET", "/get_server_info")

    async def get_weight_version(self) -> int:
        info = await self._call("GET", "/get_model_info")
        return parse_weight_version(info.get("weight_version"), self.weight_version)

    async def weight_formats(self) -> tuple[str, ...]:
        """The /update_weights_from_distributed formats this server reads: its `weight_update_formats` in
        /get_server_info (our engine lists "flattened_bucket" too); a stock SGLang lists none -> ("direct",)."""
        if not self.extensions:
            return ("direct",)
        try:
            info = await self.get_server_info()
        except EngineError as e:
            if e.missing_route:
                return ("direct",)
            raise
        formats = info.get("weight_update_formats") if isinstance(info, dict) else None
        return tuple(str(f) for f in formats) if isinstance(formats, list) and formats else ("direct",)

    async def world_size(self) -> int:
        """Ranks this server takes in the weight-update group: one per tensor-parallel worker (SGLang's workers
        join at rank_offset + tp_rank). The configured tp_size, else the server's own `tp_size`, else 1."""
        if self.tp_size is not None:
            return self.tp_size
        try:
            info = await self.get_server_info()
        except EngineError as e:
            if e.missing_route:
                return 1
            raise
        tp = info.get("tp_size", 1) if isinstance(info, dict) else 1
        return int(tp) if isinstance(tp, int) and tp >= 1 else 1

    async def init_weights_update_group(self, *, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str, backend: str,
                                        timeout_s: float | None = None) -> None:
        body = {"master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
                "world_size": world_size, "group_name": group_name, "backend": backend}
        if timeout_s is not None and self.extensions:
            body["timeout_s"] = timeout_s
        await self._call("POST", "/init_weights_update_group", body, timeout_s=(timeout_s or self.timeout_s) + 5)

    def _note_version(self, body: dict) -> None:
        if body.get("weight_version") is not None:
            self.weight_version = parse_weight_version(body["weight_version"], self.weight_version)

    async def update_weights_from_distributed(self, meta: dict) -> None:
        await self._call("POST", "/update_weights_from_distributed", meta)
        self._note_version(meta)

    async def update_weights_from_disk(self, model_path: str, *, weight_version: int | None = None) -> None:
        """SGLang's /update_weights_from_disk: the server reloads every weight from the safetensors folder
        `model_path` (a path the server can read), then reports `weight_version`."""
        body: dict = {"model_path": str(model_path), "flush_cache": True}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        await self._call("POST", "/update_weights_from_disk", body)
        self._note_version(body)

    async def update_weights_from_tensor(self, body: dict) -> None:
        await self._call("POST", "/update_weights_from_tensor", body)
        self._note_version(body)

    async def colocation_info(self) -> dict:
        """The embedded engine's answer to the colocated probe (its device identity and dtype); {} for a server
        without the route (a stock SGLang answers 404) or with extensions=False (not asked)."""
        if not self.extensions:
            return {}
        try:
            return await self.colocated_weights({"op": "probe"})
        except EngineError as e:
            if e.missing_route:
                return {}
            raise

    async def gpu_uuids(self) -> tuple[str, ...] | None:
        """The embedded engine's GPUs, from its colocated probe (`gpus`: [] on CPU); None for a stock SGLang (or
        extensions=False): its /server_info names GPUs by index (base_gpu_id) under its own CUDA_VISIBLE_DEVICES,
        never by UUID, so nothing there can be compared with the trainer's GPU."""
        gpus = (await self.colocation_info()).get("gpus")
        return tuple(str(g) for g in gpus) if isinstance(gpus, list) else None

    async def colocated_weights(self, body: dict) -> dict:
        """The embedded engine's same-device weight path (`op`: probe, attach, load, detach; see
        engines/weight_sync/wire.py)."""
        data = await self._call("POST", "/colocated_weights", body)
        self._note_version(body)
        return data

    async def destroy_weights_update_group(self, group_name: str) -> None:
        await self._call("POST", "/destroy_weights_update_group", {"group_name": group_name})

    async def pause_generation(self) -> None:
        await self._call("POST", "/pause_generation", {})

    async def continue_generation(self) -> None:
        await self._call("POST", "/continue_generation", {})

    async def flush_cache(self) -> None:
        await self._call("GET", "/flush_cache")

    async def load_adapter(self, name: str, path: str) -> None:
        """SGLang's /load_lora_adapter: the server loads the PEFT adapter folder `path` (one it can read) as
        `name`, replacing an adapter of that name (a real SGLang needs --enable-lora)."""
        await self._call("POST", "/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})

    async def unload_adapter(self, name: str) -> None:
        await self._call("POST", "/unload_lora_adapter", {"lora_name": name})
