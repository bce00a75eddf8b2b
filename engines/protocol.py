"""The one interface the rollout side, evaluation and the weight-sync sender use to talk to an inference engine.

Implementations: `engines.sglang.SGLangEngine` (SGLang's native HTTP protocol; it also drives the embedded server in
`engines/embedded/`), `engines.local.LocalEngine` (the embedded server in this process, no HTTP) and
`engines.vllm.VLLMEngine` (vLLM's OpenAI completions + weight-transfer routes); `engines.registry` builds each from a
config entry. All methods are async (httpx under trio or asyncio); `weight_version` is an int on our side and a
decimal string on the wire, as SGLang sends it.

`InferenceEngine` = generation and control + `WeightSyncEndpoint`, the capability the weight sync calls
(trainer/weight_sync/): every engine declares all of it, so nothing is probed with hasattr; what an engine
cannot do is an answer of the declared method (`colocation_info()` -> {}, `weight_formats()` -> ("direct",),
`gpu_uuids()` -> None).
Errors are `EngineError` with the answer's `status` (HTTP, or what the HTTP server would answer), never to be
recognised by their text.

The log-prob contract: `Completion.logprobs[t]` is the log-prob of `output_ids[t]` under the distribution it was
sampled from at the request's temperature T, before top-k/top-p: `log_softmax(logits / T)[token]` (T = 0, greedy:
`log_softmax(logits)`). The trainer computes its own log-probs at the same temperature, so on-policy they match.
"""

from __future__ import annotations

import functools
import ssl
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

# Statuses of "the engine has no such route" (Not Found, Method Not Allowed): it lacks that capability.
MISSING_ROUTE_STATUSES = (404, 405)


class EngineError(RuntimeError):
    """An engine answered with an error (a rejected request, a malformed answer).

    status: the HTTP status of the answer (an in-process engine reports the one its HTTP server would send; 200
    for a `{"success": false}` answer), None when there was no answer or the answer was malformed."""

    def __init__(self, message: str, *, status: int | None = None):
        super().__init__(message)
        self.status = status

    def __reduce__(self):  # keyword-only status: pickle (multiprocessing, torch object collectives) keeps it
        return _rebuild_error, (type(self), str(self), self.status)

    @property
    def missing_route(self) -> bool:
        """The engine has no such route (404 / 405): it lacks that capability, as opposed to refusing the request."""
        return self.status in MISSING_ROUTE_STATUSES


class EngineUnavailableError(EngineError):
    """An engine did not answer (connection refused, timed out) or answered 5xx: worth retrying."""


def _rebuild_error(cls: type[EngineError], message: str, status: int | None) -> EngineError:
    return cls(message, status=status)


FINISH_REASONS = ("stop", "length", "abort")


@functools.cache
def tls_context() -> ssl.SSLContext:
    """One TLS context for every HTTP client of the engine adapters (httpx's own trust store, certifi).

    httpx builds a new context for each client by default, and loading the CA bundle costs ~40 ms of CPU here:
    clients are per event loop (each rollout batch driven from sync code runs its own), and the engine start-up
    poll made one per /health request (~30 per run, ~1.3 s of CPU beside the starting engine), all for loopback
    HTTP that never uses TLS."""
    import certifi

    return ssl.create_default_context(cafile=certifi.where())


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings (SGLang's names; vLLM's are mapped by its adapter).

    temperature 0 means greedy; top_k <= 0 and top_p >= 1 disable those filters; seed None draws from the engine's
    own seeded generator (reproducible per server start, not per request). With a seed, the j-th of a prompt's n
    samples is drawn with seed + j, so a group of n is reproducible from its request's seed alone.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 0")
        if self.n < 1:
            raise ValueError(f"n={self.n} must be >= 1")


@dataclass(frozen=True)
class Completion:
    """One generated continuation: token ids, the log-prob of each under the distribution it was sampled from
    (the request's temperature, before top-k/top-p; see the module docstring), why it stopped
    ("stop" | "length" | "abort"), and the weights that produced it."""

    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_version: int
    prompt_ids: list[int] = field(default_factory=list)
    # (first token index, version) of each run of output tokens one weight version produced: more than one when
    # the engine took new weights while this request ran (an update in flight). () where the engine does not say.
    weight_versions: tuple[tuple[int, int], ...] = ()
    # Prompt tokens the engine did not prefill: their KV came from its prefix cache (SGLang's meta_info
    # "cached_tokens"; the embedded engine: engines/embedded/prefix_cache.py). 0 where the engine does not say.
    cached_tokens: int = 0
    # Output tokens drawn as speculative decoding's draft said, each a forward saved (the embedded engine's meta_info
    # "spec_accepted_tokens"; engines/embedded/drafts.py). 0 where the engine does not say or does not speculate.
    spec_accepted_tokens: int = 0

    @property
    def oldest_version(self) -> int:
        """The version of the oldest weights that produced a token of this completion (the staleness bound's)."""
        return min((v for _, v in self.weight_versions), default=self.weight_version)


@runtime_checkable
class WeightSyncEndpoint(Protocol):
    """What the weight sync (trainer/weight_sync/: WeightSyncSender, DiskWeightSync) calls on an engine. `url`
    names it in errors. The wire formats and the colocated protocol: engines/weight_sync/wire.py."""

    url: str

    async def world_size(self) -> int:
        """Ranks this engine takes in the weight-update group: one per worker that receives (tp * pp * dp)."""
        ...

    async def weight_formats(self) -> tuple[str, ...]:
        """The `update_weights_from_distributed` formats it reads: "direct" (SGLang's stock broadcast, one tensor at
        a time) and/or "flattened_bucket" (this project's buckets), and "lora_adapter" when it takes a LoRA run's
        adapter-only update (the `lora_adapter` field: the embedded engine; a vLLM started with LoRA enabled)."""
        ...

    async def colocation_info(self) -> dict:
        """Its device identity and served dtype ({"host", "device", "dtype", ...}, read by wire.is_colocated) when
        it can load weights from shared slots on its own device; {} when it has no such path (a stock SGLang,
        vLLM): the sender then broadcasts to it."""
        ...

    async def colocated_weights(self, body: dict) -> dict:
        """The same-device path (`op`: attach, load, detach); called only where colocation_info() was not {}."""
        ...

    async def gpu_uuids(self) -> tuple[str, ...] | None:
        """The GPUs its workers run on, as "GPU-<uuid>" (wire.gpu_uuid: a physical GPU, whatever CUDA_VISIBLE_DEVICES
        numbers it); () on CPU; None where the server does not say (a stock SGLang). NCCL refuses two ranks of one
        group on one GPU ("Duplicate GPU"), so the sender never broadcasts to an engine that lists the trainer's
        GPU: it colocates it by handle, or syncs it from disk."""
        ...

    async def init_weights_update_group(self, *, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str, backend: str,
                                        timeout_s: float | None = None) -> None:
        """Join the weight-update group at ranks rank_offset .. rank_offset + world_size() - 1."""
        ...

    async def update_weights_from_distributed(self, meta: dict) -> None:
        """Receive weights announced by `meta` (see engines/weight_sync/wire.py, `WeightMeta.to_wire`) by broadcast."""
        ...

    async def update_weights_from_disk(self, model_path: str, *, weight_version: int | None = None) -> None:
        """Reload every weight from the safetensors folder `model_path` (a path the engine can read)."""
        ...


@runtime_checkable
class InferenceEngine(WeightSyncEndpoint, Protocol):
    """What the trainer needs from an engine: generation and control here, weight sync from WeightSyncEndpoint."""

    url: str

    async def health(self) -> bool: ...

    async def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                       rids: Sequence[str] | None = None, adapter: str | None = None) -> list[list[Completion]]:
        """One list of `params.n` completions per prompt. `rids` (one per prompt) name the requests for `abort`.
        `adapter` names a LoRA adapter loaded with `load_adapter` (None: the engine's default, the base unless a
        LoRA run's adapter sync set one); an unknown name is an EngineError with status 404."""
        ...

    async def load_adapter(self, name: str, path: str) -> None:
        """Load the PEFT adapter folder `path` (adapter_config.json + adapter_model.safetensors, a path the engine
        can read) as adapter `name`, replacing one of that name; the base weights stay as they are."""
        ...

    async def unload_adapter(self, name: str) -> None:
        """Forget adapter `name` (EngineError 404 when it is not loaded); requests already running finish with it."""
        ...

    async def abort(self, rids: Sequence[str] | None = None) -> None:
        """Cut the named requests (None: every request) short: each returns what it has with finish "abort"."""
        ...

    async def get_weight_version(self) -> int: ...

    async def pause_generation(self) -> None: ...

    async def continue_generation(self) -> None: ...

    async def flush_cache(self) -> None: ...

    async def aclose(self) -> None:
        """Close the connections this engine object pooled for the current event loop (HTTP clients are per event
        loop, so whoever ran requests from a loop calls it before that loop ends); the engine itself keeps running.
        Nothing to close is a no-op."""
        ...


@runtime_checkable
class InProcessEngine(InferenceEngine, Protocol):
    """An engine that lives in the trainer's process (a kind with `in_process` in engines.registry): whoever built
    it owns it and stops it with `close()` (its model, threads and event loop)."""

    def close(self) -> None: ...


@runtime_checkable
class TensorAdapterEngine(InProcessEngine, Protocol):
    """An in-process engine that takes LoRA adapters as tensors of this process (the embedded engine in process,
    engines.local.LocalEngine): what the Tinker service's samplers need (adapter-only, no disk, no JSON)."""

    async def load_adapter_tensors(self, name: str, tensors: dict, scaling: float, *, default: bool = False) -> None:
        """Load (or replace) LoRA adapter `name` (PEFT's keys, engines/embedded/lora.py); default=True makes it the
        adapter of requests that name none."""
        ...
