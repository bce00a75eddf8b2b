"""Adapter for a vLLM 0.32 server: OpenAI `/v1/completions` for generation, its RL routes for control and sync.

Built against vLLM 0.32's own code (vllm/entrypoints/rl/online/api_router.py, entrypoints/openai/completion/
protocol.py, distributed/weight_transfer/) and tested against a real CPU vLLM server (tests/test_engine_vllm_real.py).
Serve with `vllm_server_command(...)`, i.e. `python -m vllm.entrypoints.openai.api_server --model DIR
--logprobs-mode processed_logprobs --weight-transfer-config '{"backend": "rlkernels"}'` and `VLLM_SERVER_DEV_MODE=1`
(which adds the RL routes below):

    POST /v1/completions        {model, prompt: [[ids]], max_tokens, temperature, n, seed, stop_token_ids,
                                 ignore_eos, logprobs: 0, return_token_ids: true, request_id}
    POST /abort_requests        {request_ids: [external ids]} ({} = every request)
    POST /pause?mode=keep, POST /resume, POST /reset_prefix_cache
    GET  /weight_info -> {weight_version}; POST /update_weight_version {new_version}
    GET  /get_world_size?include_dp=true -> {world_size}   (this engine's ranks in the weight-update group)
    POST /init_weight_transfer_engine {init_info}; /start_weight_update; /update_weights {update_info};
         /finish_weight_update {weight_version}
    POST /collective_rpc {method: "reload_weights", kwargs: {weights_path}}   (disk fallback)
    POST /collective_rpc {method: "rlkernels_gpu_uuids"} -> {results: [[GPU UUID] per worker]}
         (our worker extension, engines/vllm_ext/worker.py)

Log-probs (the project contract: the sampled-from distribution at the request temperature, before top-k/top-p):
vLLM's default `raw_logprobs` are taken before temperature; `--logprobs-mode processed_logprobs` returns
`log_softmax(logits / T)` (greedy rows: `log_softmax(logits)`), which is the contract exactly when no top-k/top-p
filter is set, and the filtered, renormalised distribution otherwise. So this adapter refuses top_k > 0 or
top_p < 1 with a ValueError instead of returning log-probs of another distribution.

Weight sync: the `rlkernels` back end (engines/vllm_ext, a vLLM plugin) joins the trainer's own process group
(gloo on CPU, NCCL on GPU) and receives the project's wire format, so the same sender that feeds the embedded
engine feeds vLLM: `update_weights_from_distributed(meta)` wraps the metadata body in vLLM's start/update/finish
sequence and sets vLLM's weight version. vLLM's built-in `nccl` back end is not used: it rendezvouses through
vLLM's own StatelessProcessGroup + PyNccl, which our sender does not speak.

Completions report no weight version, so each is stamped with the version this adapter last set or read
(exact when generation is paused around a sync, as the sender does).

LoRA (a server started with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1): `load_adapter` serves a PEFT
folder by name (/v1/load_lora_adapter), `generate(adapter=name)` names it as the completions' `model`. A LoRA run's
adapter-only sync (an update with a `lora_adapter` field, engines.weight_sync.wire) needs no folder: the plugin
receives the A/B tensors by broadcast like any weights, our worker extension builds vLLM's LoRA model from them
(engines/vllm_ext/lora.py) and replaces the previous version in place, and a new name is registered once through
/v1/load_lora_adapter with the path `rlkernels-tensors://<name>`, which the worker builds from those tensors.
vLLM has no default adapter, so this adapter keeps one (`default_adapter`): requests that name no adapter use it
(`adapter=self.model`, the served model, names the base). The sync sets it to the adapter it marks as default
(wire.POLICY_ADAPTER, "policy"); a copy of this object that did not sync (the rollout process's, pickled before the
first sync) learns it at its first request naming no adapter: "policy" registered on the server (/v1/models).
A full-weight update clears it and unregisters "policy" from the server's names.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import Sequence

import anyio
import httpx

from engines.protocol import Completion, EngineError, SamplingParams, tls_context
from engines.sglang import parse_weight_version
from engines.vllm_ext import (
    APPLY_ADAPTER_METHOD,
    BACKEND_NAME,
    GPU_UUIDS_METHOD,
    LORA_SYNC_METHOD,
    TENSOR_PATH_SCHEME,
    WORKER_EXTENSION,
)
from engines.weight_sync.wire import POLICY_ADAPTER, lora_adapter_field

VLLM_VERSION = "0.32.0"
LOGPROBS_MODE = "processed_logprobs"
ABORT_WAIT_S = 10.0


def vllm_server_command(python: str, model_dir: str, *, port: int, host: str = "127.0.0.1", dtype: str = "float32",
                        max_model_len: int = 256, extra: Sequence[str] = ()) -> list[str]:
    """The command line this adapter expects (run it with VLLM_SERVER_DEV_MODE=1 in the environment)."""
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--host", host,
            "--port", str(port), "--dtype", dtype, "--max-model-len", str(max_model_len),
            "--logprobs-mode", LOGPROBS_MODE, "--weight-transfer-config", json.dumps({"backend": BACKEND_NAME}),
            "--worker-extension-cls", WORKER_EXTENSION, *extra]


def check_params(params: SamplingParams) -> None:
    if params.top_k > 0 or params.top_p < 1.0:
        raise ValueError(f"top_k={params.top_k}, top_p={params.top_p}: vLLM's processed log-probs are taken after "
                         f"the top-k/top-p filter, not before as the log-prob contract needs; use top_k=-1 and "
                         f"top_p=1.0 with a vLLM engine")


def completions_payload(model: str, prompts: Sequence[Sequence[int]], params: SamplingParams,
                        request_id: str) -> dict:
    """One /v1/completions body for all prompts; vLLM names prompt i's request `cmpl-{request_id}-{i}`."""
    check_params(params)
    body = {"model": model, "prompt": [list(p) for p in prompts], "max_tokens": params.max_new_tokens,
            "temperature": params.temperature, "n": params.n, "stop_token_ids": list(params.stop_token_ids),
            "ignore_eos": params.ignore_eos, "logprobs": 0, "return_token_ids": True, "request_id": request_id}
    if params.seed is not None:
        body["seed"] = params.seed  # vLLM gives sample j of a prompt seed + j, as our protocol says
    return body


def parse_finish_reason(reason: str | None) -> str:
    """vLLM's finish_reason: "stop" | "length" | "abort" (others, e.g. "error", are errors, not completions)."""
    if reason in ("stop", "length", "abort"):
        return reason
    raise EngineError(f"vLLM returned finish_reason={reason!r}; expected 'stop', 'length' or 'abort'")


def parse_completions(data: dict, prompts: Sequence[Sequence[int]], n: int, version: int) -> list[list[Completion]]:
    """Choices -> one list of n Completions per prompt (vLLM's choice index = prompt * n + sample)."""
    choices = sorted(data.get("choices") or [], key=lambda c: c["index"])
    if len(choices) != len(prompts) * n:
        raise EngineError(f"/v1/completions returned {len(choices)} choices for {len(prompts)} prompts x n={n}")
    out = []
    for i, prompt in enumerate(prompts):
        group = []
        for c in choices[i * n:(i + 1) * n]:
            ids = [int(t) for t in c.get("token_ids") or []]
            lps = (c.get("logprobs") or {}).get("token_logprobs") or []
            if len(lps) != len(ids) or any(x is None for x in lps):
                raise EngineError(f"choice {c['index']}: {len(ids)} tokens but log-probs {lps[:4]}...; the server "
                                  f"must return one log-prob per token (request logprobs=0)")
            group.append(Completion(ids, [float(x) for x in lps], parse_finish_reason(c.get("finish_reason")),
                                    version, list(prompt)))
        out.append(group)
    return out


class VLLMEngine:
    """One vLLM OpenAI-compatible server (InferenceEngine protocol). Mutable state: the weight version it last saw,
    the vLLM request ids of its in-flight generate calls (for abort by our rid), and the adapter its requests that
    name none use (`default_adapter`: set by an adapter-only sync, None = the base)."""

    def __init__(self, url: str, model: str, *, api_key: str | None = None, timeout_s: float = 300.0):
        self.url, self.model = url.rstrip("/"), model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout_s = timeout_s
        self.weight_version = 0
        self._inflight: dict[str, str] = {}  # our rid -> vLLM's external request id
        self._running: set[str] = set()  # request ids of this adapter's generate calls in flight
        self.default_adapter: str | None = None  # the LoRA adapter a request naming none uses (None: the base)
        self._default_known = False  # default_adapter set by a sync here, or read from the server once
        self._max_lora_rank: int | None = None  # the server's --max-lora-rank, read with weight_formats()

    async def _call(self, method: str, route: str, body: dict | None = None, params: dict | None = None):
        try:
            async with httpx.AsyncClient(timeout=self.timeout_s, headers=self.headers, verify=tls_context()) as client:
                r = await client.request(method, self.url + route, json=body, params=params)
        except httpx.HTTPError as e:
            raise EngineError(f"{self.url}{route}: no answer ({type(e).__name__}: {e})") from e
        if r.status_code >= 400:
            raise EngineError(f"{self.url}{route}: HTTP {r.status_code}: {r.text[:500]}", status=r.status_code)
        try:
            return r.json()
        except ValueError:
            return {}

    async def health(self) -> bool:
        try:
            await self._call("GET", "/health")
            return True
        except EngineError:
            return False

    async def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                       rids: Sequence[str] | None = None, adapter: str | None = None) -> list[list[Completion]]:
        """adapter: a LoRA adapter loaded with `load_adapter` or by an adapter sync (vLLM serves it as the model of
        that name); None: `default_adapter`, else the base (which `adapter=self.model` names explicitly)."""
        if rids is not None and len(rids) != len(prompts):
            raise ValueError(f"rids: {len(rids)} ids for {len(prompts)} prompts; give one per prompt")
        request_id = uuid.uuid4().hex
        # vLLM refuses n > 1 when greedy; greedy samples are identical, so ask for one and repeat it
        repeat = params.n if params.temperature == 0 and params.n > 1 else 1
        asked = dataclasses.replace(params, n=1) if repeat > 1 else params
        check_params(params)  # before any request, the default adapter's look-up included
        if adapter is None and not self._default_known:
            await self._learn_default_adapter()
        served = adapter if adapter is not None else self.default_adapter or self.model
        body = completions_payload(served, prompts, asked, request_id)
        names = {r: f"cmpl-{request_id}-{i}" for i, r in enumerate(rids or ())}
        self._inflight.update(names)
        self._running.add(request_id)
        try:
            version = self.weight_version
            data = await self._call("POST", "/v1/completions", body)
        finally:
            self._running.discard(request_id)
            for r in names:
                self._inflight.pop(r, None)
        out = parse_completions(data, prompts, asked.n, version)
        return [[dataclasses.replace(c, output_ids=list(c.output_ids), logprobs=list(c.logprobs))
                 for c in group for _ in range(repeat)] for group in out]

    async def _learn_default_adapter(self) -> None:
        """A copy that never synced: the synced default adapter is "policy" when the server lists it (/v1/models
        lists the base and each registered LoRA name)."""
        data = await self._call("GET", "/v1/models")
        names = {m.get("id") for m in (data.get("data") or []) if isinstance(m, dict)}
        if not self._default_known:  # a sync may have set it meanwhile
            self.default_adapter = POLICY_ADAPTER if POLICY_ADAPTER in names - {self.model} else None
            self._default_known = True

    async def abort(self, rids: Sequence[str] | None = None) -> None:
        """Abort our requests `rids` (None: every request on the server); they return with finish "abort".

        vLLM forgets an abort for a request it has not admitted yet (one still being tokenised or queued in its
        API server), so the abort is repeated until the adapter's own calls for those requests have returned
        (at most ABORT_WAIT_S)."""
        if rids is None:
            body, waiting = {}, set(self._running)
        else:
            ids = {self._inflight[r] for r in rids if r in self._inflight}
            if not ids:
                return
            body, waiting = {"request_ids": sorted(ids)}, ids
        deadline = time.monotonic() + ABORT_WAIT_S
        while True:
            await self._call("POST", "/abort_requests", body)
            live = set(self._running) if rids is None else set(self._inflight.values())
            if not waiting & live or time.monotonic() > deadline:
                return
            await anyio.sleep(0.2)

    async def get_weight_version(self) -> int:
        data = await self._call("GET", "/weight_info")
        # vLLM starts at "default" (never updated), as SGLang does
        self.weight_version = parse_weight_version(data.get("weight_version"), 0)
        return self.weight_version

    async def set_weight_version(self, version: int) -> None:
        await self._call("POST", "/update_weight_version", {"new_version": str(version)})
        self.weight_version = version

    async def world_size(self) -> int:
        """How many ranks this engine takes in the weight-update group (tp * pp * dp workers)."""
        return int((await self._call("GET", "/get_world_size", params={"include_dp": "true"}))["world_size"])

    async def weight_formats(self) -> tuple[str, ...]:
        """The plugin (engines/vllm_ext) reads this project's wire format in both forms, and "lora_adapter" (a
        LoRA run's adapter-only sync) when our worker extension says the server can serve synced adapters."""
        formats = ("direct", "flattened_bucket")
        return (*formats, "lora_adapter") if await self._takes_adapters() else formats

    async def _takes_adapters(self) -> bool:
        """Every worker started with --enable-lora, runtime LoRA updating and our back end (engines/vllm_ext/
        worker.py); False when the server does not say (no extension, no VLLM_SERVER_DEV_MODE)."""
        data = await self._worker_rpc(LORA_SYNC_METHOD)
        results = data.get("results") if isinstance(data, dict) else None
        if not (isinstance(results, list) and results and all(isinstance(r, dict) for r in results)):
            return False
        ranks = [r.get("max_lora_rank") for r in results if isinstance(r.get("max_lora_rank"), int)]
        self._max_lora_rank = min(ranks) if ranks else None
        return all(r.get("adapters") is True for r in results)

    async def _worker_rpc(self, method: str) -> object:
        """/collective_rpc's answer to our worker extension's `method` (its "results": one per worker); None when the
        server does not say (no extension: vLLM answers an error; no VLLM_SERVER_DEV_MODE: 404). A server that does
        not answer at all raises: no sync can work with it either."""
        try:
            return await self._call("POST", "/collective_rpc", {"method": method})
        except EngineError as e:
            if e.status is None:
                raise
            return None

    async def colocation_info(self) -> dict:
        """{}: vLLM has no same-device weight path here; the sender broadcasts to it through the plugin."""
        return {}

    async def gpu_uuids(self) -> tuple[str, ...] | None:
        """Every worker's GPU (tp * pp * dp workers), asked of our worker extension through /collective_rpc; () on
        CPU. None when the server does not say: started without the extension (vLLM answers with an error) or
        without VLLM_SERVER_DEV_MODE (404). A vLLM that lists the trainer's own GPU is synced from disk (it has no
        path for weights by handle here), never put in an NCCL group with the trainer."""
        data = await self._worker_rpc(GPU_UUIDS_METHOD)
        if data is None:
            return None
        results = data.get("results") if isinstance(data, dict) else None
        if not isinstance(results, list) or not all(isinstance(r, list) for r in results):
            raise EngineError(f"{self.url}/collective_rpc {GPU_UUIDS_METHOD}: expected one list of GPU UUIDs per "
                              f"worker, got {str(data)[:200]}")
        return tuple(dict.fromkeys(str(g) for r in results for g in r))

    async def colocated_weights(self, body: dict) -> dict:
        raise EngineError(f"{self.url}: vLLM has no colocated weight path (colocation_info() is {{}}); sync it by "
                          f"broadcast (transport='auto' or 'broadcast')")

    async def init_weights_update_group(self, *, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str = "", backend: str = "gloo",
                                        timeout_s: float | None = None) -> None:
        info = {"master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
                "world_size": world_size, "backend": backend, "timeout_s": float(timeout_s or self.timeout_s)}
        if group_name:
            info["group_name"] = group_name
        await self._call("POST", "/init_weight_transfer_engine", {"init_info": info})

    async def update_weights_from_distributed(self, meta: dict) -> None:
        """Receive the weights announced by `meta` (`WeightMeta.to_wire`: bucketed or per tensor) by broadcast.
        With a `lora_adapter` field ({name, scaling, default}) the A/B tensors become that adapter, in place of its
        previous version, the other tensors load into the base; without one (a full update) requests naming no
        adapter get the base again."""
        lora = lora_adapter_field(meta)  # ValueError names the bad field, before any call
        if lora is not None:
            self._check_adapter_rank(meta)
        version = meta.get("weight_version")
        await self._call("POST", "/start_weight_update", {})
        await self._call("POST", "/update_weights", {"update_info": meta})
        await self._call("POST", "/finish_weight_update",
                         {"weight_version": None if version is None else str(version)})
        if lora is None:  # a full update: requests naming no adapter get the base it sent
            if self.default_adapter is not None:
                await self._call("POST", "/v1/unload_lora_adapter", {"lora_name": self.default_adapter})
            self.default_adapter = None
        else:
            await self._serve_synced_adapter(lora["name"])
            if lora["default"]:
                self.default_adapter = lora["name"]
        self._default_known = True
        if version is not None:
            self.weight_version = int(version)

    def _check_adapter_rank(self, meta: dict) -> None:
        """Refuse an adapter wider than the server's --max-lora-rank before anything is sent or loaded (vLLM would
        refuse it only once the sync had loaded the rest)."""
        ranks = {int(shape[0]) for name, shape in zip(meta.get("names") or [], meta.get("shapes") or [])
                 if str(name).endswith(".lora_A.weight")}
        if self._max_lora_rank is not None and ranks and max(ranks) > self._max_lora_rank:
            raise EngineError(f"{self.url}: adapter rank {max(ranks)} is more than this vLLM's --max-lora-rank "
                              f"{self._max_lora_rank}; restart it with --max-lora-rank >= {max(ranks)} (or use a "
                              f"smaller [lora] rank)", status=400)

    async def _serve_synced_adapter(self, name: str) -> None:
        """The adapter the workers just received becomes vLLM's adapter `name`: rebuilt in place where vLLM serves
        the name, else registered through /v1/load_lora_adapter (the worker builds it from the tensors: the path
        names no folder). Then the prefix cache is dropped: blocks computed under the previous version are stale."""
        data = await self._call("POST", "/collective_rpc", {"method": APPLY_ADAPTER_METHOD, "kwargs": {"name": name}})
        results = data.get("results") if isinstance(data, dict) else None
        if not isinstance(results, list) or not results or not set(results) <= {"new", "replaced"}:
            raise EngineError(f"{self.url}/collective_rpc {APPLY_ADAPTER_METHOD}: expected 'new' or 'replaced' per "
                              f"worker, got {str(data)[:200]}")
        models = await self._call("GET", "/v1/models")
        if "new" in results or name not in {m.get("id") for m in models.get("data") or [] if isinstance(m, dict)}:
            # (a name the API server dropped, e.g. by a full update, is registered again: a new LoRA id)
            await self._call("POST", "/v1/load_lora_adapter",
                             {"lora_name": name, "lora_path": TENSOR_PATH_SCHEME + name})
        await self.flush_cache()

    async def update_weights_from_disk(self, model_path: str, *, weight_version: int | None = None) -> None:
        """Reload the weights from a safetensors folder this server can read (the disk fallback when no group can
        form): vLLM's worker `reload_weights(weights_path=...)` through /collective_rpc, in place, then the version."""
        await self._call("POST", "/collective_rpc", {"method": "reload_weights",
                                                     "kwargs": {"weights_path": str(model_path)}})
        if weight_version is not None:
            await self.set_weight_version(weight_version)

    async def pause_generation(self) -> None:
        """Freeze in-flight requests where they are (vLLM's mode "keep"); they go on after continue_generation."""
        await self._call("POST", "/pause", params={"mode": "keep"})

    async def continue_generation(self) -> None:
        await self._call("POST", "/resume")

    async def load_adapter(self, name: str, path: str) -> None:
        """vLLM's /v1/load_lora_adapter (the server needs --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1)."""
        await self._call("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})

    async def unload_adapter(self, name: str) -> None:
        await self._call("POST", "/v1/unload_lora_adapter", {"lora_name": name})

    async def flush_cache(self) -> None:
        await self._call("POST", "/reset_prefix_cache")

    async def aclose(self) -> None:  # each call opens and closes its own client: nothing pooled
        return None
