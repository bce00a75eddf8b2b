"""AsyncRolloutManager: fills one rollout batch from N inference engines over HTTP (trio + httpx).

Protocol: SGLang's native API. POST /generate {"input_ids", "sampling_params", "return_logprob", "rid"} answers
{"text", "output_ids", "meta_info": {"finish_reason": {"type": "stop"|"length"|"abort"},
"output_token_logprobs": [[logprob, token_id, text], ...], "weight_version"}}; POST /abort_request
{"abort_all": true} makes running requests return early with finish_reason "abort" and their partial output.

One batch, step by step:
  1. Groups cached from the previous batch go first (samples that were cut keep their partial response,
     log-probs and weight versions; samples older than `max_staleness` versions restart from the prompt).
  2. New prompts come from the DataBuffer. ceil(over_sampling_factor x groups still needed) groups are kept in
     flight; a group = n samples of one prompt, one request each, all sent to the same engine (prefix cache).
     A CapacityLimiter bounds the HTTP requests in flight over all engines.
  3. A finished group is scored (reward errors mark samples FAILED) and passed through the dynamic filters;
     a dropped group is replaced by a new one.
  4. Once rollout_batch_size groups passed: /abort_request on every engine, up to abort_grace_s for the cut
     requests to return their partial output, then the nursery is cancelled. Unfinished groups go to the cache.
Structured concurrency means nothing outlives `generate_batch`: no stray tasks, no stray requests.
"""

from __future__ import annotations

import builtins
import dataclasses
import inspect
import math
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any

import httpx
import trio

from trainer.rewards import RewardFn, acompute_reward, load_reward_fn
from trainer.rollout import (
    SampleTransform,
    apply_sample_transforms,
    convert_to_batch,
    first_failed_filter,
    prompt_token_ids,
    resolve_filters,
    sample_from_dict,
    sample_to_dict,
)
from trainer.types import RolloutBatch, RolloutConfig, Sample, Status


class EngineUnavailableError(RuntimeError):
    """An engine URL did not answer (connection refused / timed out / 5xx) after all retries."""


@dataclasses.dataclass(frozen=True)
class GenerateCall:
    """What a generate_fn gets for one sample: where to send it, how to sample, and helpers.

    Async generate_fns may `await call.post("/generate", payload)` (retries included); sync ones run in a
    worker thread and should use their own blocking client on `call.url`.
    """

    url: str
    sampling_params: dict[str, Any]
    config: RolloutConfig
    tokenizer: Any
    rid: str
    weight_version: int  # the trainer's current version (used when the engine reports none)
    post: Callable[[str, dict[str, Any]], Awaitable[Any]]


GenerateFn = Callable[[GenerateCall, Sample], Any]  # -> Sample or Awaitable[Sample]


def _parse_version(value: Any, default: int) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default  # SGLang's default weight_version is the string "default"


async def sglang_generate(call: GenerateCall, sample: Sample) -> Sample:
    """Default generate_fn: one SGLang /generate request that continues `sample` (prompt + partial response)."""
    remaining = call.config.max_new_tokens - sample.response_length
    if remaining <= 0:
        return dataclasses.replace(sample, status=Status.TRUNCATED)
    params = {**call.sampling_params, "max_new_tokens": remaining}
    payload = {"input_ids": list(sample.tokens), "sampling_params": params, "return_logprob": True,
               "rid": call.rid}
    data = await call.post("/generate", payload)
    if isinstance(data, list):  # a batched/n>1 answer; we always send one
        data = data[0]
    meta = data.get("meta_info", {})
    lp_entries = meta.get("output_token_logprobs") or []
    out_ids = data.get("output_ids")
    if out_ids is None:
        out_ids = [int(e[1]) for e in lp_entries]
    out_ids = [int(t) for t in out_ids]
    logprobs = [float(e[0]) for e in lp_entries]
    if len(logprobs) != len(out_ids):
        raise ValueError(f"{call.url}/generate returned {len(out_ids)} output ids but {len(logprobs)} log-probs; "
                         "the engine must honour return_logprob=true")
    finish = (meta.get("finish_reason") or {}).get("type", "stop")
    status = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}.get(finish,
                                                                                                 Status.COMPLETED)
    version = _parse_version(meta.get("weight_version"), call.weight_version)
    return extend_sample(sample, out_ids, logprobs, status=status, weight_version=version,
                         tokenizer=call.tokenizer, max_new_tokens=call.config.max_new_tokens)


def extend_sample(sample: Sample, new_ids: Sequence[int], new_logprobs: Sequence[float], *, status: Status,
                  weight_version: int, tokenizer: Any = None, max_new_tokens: int | None = None) -> Sample:
    """Append one generated segment to a (possibly partial) sample.

    `metadata["weight_versions"]` lists the version of each segment; `weight_version` is the oldest of them,
    the conservative value for the trainer's staleness bound.
    """
    old_lp = list(sample.rollout_logprobs or ())
    tokens = tuple(sample.tokens) + tuple(new_ids)
    resp_len = sample.response_length + len(new_ids)
    versions = list(sample.metadata.get("weight_versions", ())) + ([weight_version] if new_ids else [])
    if status == Status.ABORTED and max_new_tokens is not None and resp_len >= max_new_tokens:
        status = Status.TRUNCATED
    response = sample.response
    if tokenizer is not None:
        response = tokenizer.decode(list(tokens[len(tokens) - resp_len:]), skip_special_tokens=False)
    return dataclasses.replace(
        sample, tokens=tokens, response=response, response_length=resp_len,
        rollout_logprobs=tuple(old_lp) + tuple(float(x) for x in new_logprobs), status=status,
        weight_version=min(versions) if versions else weight_version,
        metadata={**sample.metadata, "weight_versions": versions})


def restart_sample(sample: Sample) -> Sample:
    """Drop a sample's partial response (it is too stale to finish) and make it pending again."""
    prompt = tuple(sample.tokens[: sample.prompt_length])
    meta = {k: v for k, v in sample.metadata.items() if k != "weight_versions"}
    return dataclasses.replace(sample, tokens=prompt, response="", response_length=0, rollout_logprobs=(),
                               loss_mask=None, reward=None, status=Status.PENDING, metadata=meta)


def _oldest_first(groups: list[list[Sample]]) -> list[list[Sample]]:
    """Cached groups in the order they were drawn from the data buffer (so none starves)."""
    return sorted(groups, key=lambda g: g[0].metadata["group_uid"])


_EXC_GROUP = getattr(builtins, "ExceptionGroup", ())  # Python >= 3.11; trio raises these from nurseries


def _first_leaf(eg: BaseException) -> BaseException:
    while isinstance(eg, _EXC_GROUP):
        eg = eg.exceptions[0]
    return eg


class AsyncRolloutManager:
    """Stateful rollout driver; use as `async with manager: batch = await manager.generate_batch(buffer)`.

    State kept between batches: the partial-group cache, the trainer's weight version, counters.
    """

    def __init__(self, engine_urls: Sequence[str], config: RolloutConfig, *, tokenizer: Any,
                 reward_fn: str | RewardFn | None = None, generate_fn: GenerateFn | None = None,
                 filters: Sequence[Any] | None = None, check_health: bool = True, api_key: str | None = None) -> None:
        self.engine_urls = [u.rstrip("/") for u in engine_urls]
        if not self.engine_urls and generate_fn is None:
            raise ValueError("engine_urls: give at least one engine URL (e.g. http://127.0.0.1:30000) "
                             "or a custom generate_fn")
        self.config = config
        self.tokenizer = tokenizer
        self.reward_fn = load_reward_fn(reward_fn) if reward_fn is not None else None
        self.generate_fn = generate_fn or sglang_generate
        self._gen_is_async = generate_fn is None or inspect.iscoroutinefunction(generate_fn)
        self.filters = resolve_filters(config.dynamic_filters if filters is None else filters)
        self.check_health = check_health
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.weight_version = 0
        self.partial_groups: list[list[Sample]] = []  # groups cut by the last batch, resumed first by the next
        self._group_uid = 0  # monotonically increasing id of each group drawn from the buffer (seeds, order)
        self._in_flight: dict[str, str] = {}  # rid -> engine url, for requests currently on the wire
        self._orphaned: set[str] = set()  # engines with requests we cancelled without an abort reaching them
        self._client: httpx.AsyncClient | None = None
        self._limiter: trio.CapacityLimiter | None = None
        self._stopping = False
        self._next_engine = 0
        self.stats: dict[str, int] = {"requests": 0, "retries": 0, "aborts_sent": 0}

    # ----------------------------------------------------------------------------------------- lifecycle
    async def __aenter__(self) -> AsyncRolloutManager:
        c = self.config
        timeout = httpx.Timeout(c.request_timeout_s, connect=min(c.connect_timeout_s, c.request_timeout_s))
        limits = httpx.Limits(max_connections=c.max_concurrency + 2 * len(self.engine_urls))
        self._client = httpx.AsyncClient(timeout=timeout, limits=limits, headers=self._headers)
        self._limiter = trio.CapacityLimiter(c.max_concurrency)
        try:
            if self.check_health:
                for url in self.engine_urls:
                    await self._request("GET", url, "/health", None)
        except BaseException:
            await self._client.aclose()
            self._client = None
            raise
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self._orphaned:  # requests cancelled client-side (error path, or past abort_grace_s): stop them
            with trio.move_on_after(2):
                await self._abort_all(self._orphaned)
            self._orphaned.clear()
        if self._client is not None:
            await self._client.aclose()
        self._client = None

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs to resume rollouts exactly: cached partial groups, group counter, version."""
        return {"weight_version": self.weight_version, "group_uid": self._group_uid,
                "partial_groups": [[sample_to_dict(s) for s in g] for g in self.partial_groups]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.weight_version = int(state["weight_version"])
        self._group_uid = int(state["group_uid"])
        self.partial_groups = [[sample_from_dict(d) for d in g] for g in state["partial_groups"]]

    def set_weight_version(self, version: int) -> None:
        """The trainer's current weight version (drives the staleness bound of cached partial samples)."""
        self.weight_version = int(version)

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    # ----------------------------------------------------------------------------------------- HTTP
    async def _request(self, method: str, url: str, path: str, payload: dict | None) -> Any:
        """One HTTP call with retries (connection errors, timeouts, 5xx); then EngineUnavailableError."""
        assert self._client is not None, "use the manager inside `async with`"
        c = self.config
        t0 = time.monotonic()
        last: BaseException | None = None
        for attempt in range(c.max_retries + 1):
            if attempt:
                self.stats["retries"] += 1
                await trio.sleep(c.retry_backoff_s * 2 ** (attempt - 1))
            try:
                resp = await self._client.request(method, url + path, json=payload)
            except (httpx.TransportError, httpx.TimeoutException) as e:
                last = e
                continue
            if resp.status_code >= 500:
                last = httpx.HTTPStatusError(f"HTTP {resp.status_code}: {resp.text[:200]}", request=resp.request,
                                             response=resp)
                continue
            if resp.status_code >= 400:
                raise ValueError(f"{method} {url}{path} was rejected with HTTP {resp.status_code}: {resp.text[:300]}")
            return resp.json() if resp.content else None
        raise EngineUnavailableError(
            f"engine {url} did not answer {method} {path} after {c.max_retries + 1} attempts in "
            f"{time.monotonic() - t0:.1f}s (last error: {type(last).__name__}: {last}); check that the server is "
            f"running at that URL, or raise max_retries / request_timeout_s")

    async def _abort_all(self, urls: Sequence[str] | set[str] = ()) -> bool:
        """Ask engines to cut their running requests short (best effort: errors are ignored).

        Returns True when every engine accepted /abort_request, i.e. cut requests will come back early with
        their partial output and are worth waiting for. Engines without it get SGLang's
        /pause_generation {"mode": "abort"} + /continue_generation instead, and are not waited for.
        """
        ok: list[bool] = []

        async def one(url: str) -> None:
            try:
                r = await self._client.post(url + "/abort_request", json={"abort_all": True, "rid": ""}, timeout=2)
                ok.append(r.status_code < 400)
                if r.status_code in (404, 405):
                    await self._client.post(url + "/pause_generation", json={"mode": "abort"}, timeout=2)
                    await self._client.post(url + "/continue_generation", json={}, timeout=2)
                self.stats["aborts_sent"] += 1
            except httpx.HTTPError:
                ok.append(False)

        async with trio.open_nursery() as n:
            for url in set(urls) or set(self._in_flight.values()) or self.engine_urls:
                n.start_soon(one, url)
        return all(ok)

    # ----------------------------------------------------------------------------------------- one sample
    def _sampling_params(self, seed: int) -> dict[str, Any]:
        c = self.config
        stop = set(c.stop_token_ids)
        if self.tokenizer is not None:
            if self.tokenizer.eos_token_id is not None:
                stop.add(int(self.tokenizer.eos_token_id))
            if c.apply_chat_template:
                stop.add(int(self.tokenizer.convert_tokens_to_ids("<|im_end|>")))
        return {"temperature": c.temperature, "top_p": c.top_p, "top_k": c.top_k, "max_new_tokens": c.max_new_tokens,
                "stop_token_ids": sorted(stop), "sampling_seed": seed}

    async def _generate_one(self, url: str, sample: Sample, seed: int, rid: str) -> Sample:
        async with self._limiter:
            if self._stopping:  # the batch filled while this request waited for a slot: never send it
                return sample

            async def post(path: str, payload: dict[str, Any]) -> Any:
                return await self._request("POST", url, path, payload)

            call = GenerateCall(url=url, sampling_params=self._sampling_params(seed), config=self.config,
                                tokenizer=self.tokenizer, rid=rid, weight_version=self.weight_version, post=post)
            self._in_flight[rid] = url
            self.stats["requests"] += 1
            try:
                if self._gen_is_async:
                    out = await self.generate_fn(call, sample)
                else:
                    out = await trio.to_thread.run_sync(self.generate_fn, call, sample, abandon_on_cancel=True)
            except (EngineUnavailableError, ValueError, httpx.HTTPError):
                if self._stopping:  # the engine dropped the request we aborted: keep the sample as it was
                    return sample
                raise
            except trio.Cancelled:  # we stop waiting, but the engine may still be generating: abort it later
                self._orphaned.add(url)
                raise
            finally:
                self._in_flight.pop(rid, None)
            if not isinstance(out, Sample):
                raise TypeError(f"generate_fn returned {type(out).__name__}; it must return a Sample")
            return out

    # ----------------------------------------------------------------------------------------- one group
    def _new_group(self, prompt: Any) -> list[Sample]:
        ids = prompt_token_ids(self.tokenizer, prompt.prompt, chat=self.config.apply_chat_template)
        uid = self._group_uid
        self._group_uid += 1
        meta = {**prompt.metadata, "answer": prompt.answer, "prompt_index": prompt.index, "group_uid": uid}
        return [Sample(prompt=prompt.prompt, tokens=tuple(ids), rollout_logprobs=(), index=j,
                       metadata={**meta, "sample_index": j}) for j in range(self.config.n_samples_per_prompt)]

    def _refresh_cached(self, group: list[Sample]) -> tuple[list[Sample], int]:
        """Restart the samples of a cached group that lag the trainer by more than max_staleness versions."""
        out, restarted = [], 0
        for s in group:
            has_progress = s.response_length > 0 or s.status in (Status.COMPLETED, Status.TRUNCATED)
            if has_progress and self.weight_version - s.weight_version > self.config.max_staleness:
                out.append(restart_sample(s))
                restarted += 1
            else:
                out.append(s)
        return out, restarted

    async def _run_group(self, slot: int, groups: dict[int, list[Sample]], url: str,
                         done: trio.MemorySendChannel) -> None:
        """Generate the unfinished samples of group `slot` (state kept in `groups[slot]` as it progresses),
        then score it and report it on `done`."""

        async def one(j: int) -> None:
            s = groups[slot][j]
            if s.status in (Status.COMPLETED, Status.TRUNCATED, Status.FAILED):
                return
            uid = s.metadata["group_uid"]
            seg = len(s.metadata.get("weight_versions", ()))
            seed = (self.config.seed * 1_000_003 + uid * 1009 + j * 31 + seg) % (2 ** 31)
            groups[slot][j] = await self._generate_one(url, s, seed, rid=f"g{uid}-s{j}-{seg}-{slot}")

        async with trio.open_nursery() as n:
            for j in range(len(groups[slot])):
                n.start_soon(one, j)
        if self._stopping or any(s.status in (Status.PENDING, Status.ABORTED) for s in groups[slot]):
            return  # cut by the abort: stays in `groups`, cached for the next batch
        scored = []
        for s in groups[slot]:
            if self.reward_fn is not None and s.status != Status.FAILED:
                s = await acompute_reward(s, self.reward_fn)
            scored.append(s)
        groups[slot] = scored
        await done.send(slot)

    # ----------------------------------------------------------------------------------------- one batch
    async def generate_batch(self, data_buffer: Any) -> RolloutBatch:
        """Fill one batch of rollout_batch_size groups that pass the filters (see the module docstring)."""
        if self._client is None:
            raise RuntimeError("generate_batch needs an open manager: `async with manager: ...`")
        try:
            return await self._generate_batch(data_buffer)
        except _EXC_GROUP as eg:  # surface the real error (e.g. EngineUnavailableError), not a group
            raise _first_leaf(eg) from eg

    async def _generate_batch(self, data_buffer: Any) -> RolloutBatch:
        t0 = time.monotonic()
        cached, self.partial_groups = self.partial_groups, []
        n_cached = len(cached)
        counters = {"groups_submitted": 0, "groups_filtered": 0, "groups_resumed": 0,
                    "samples_restarted_stale": 0, "reward_failed": 0, "groups_cached": 0, "samples_aborted": 0}
        filtered_by: dict[str, int] = {}
        groups: dict[int, list[Sample]] = {}  # slot -> current state of each group this batch touched
        accepted: list[int] = []
        filtered: set[int] = set()
        try:
            await self._fill(data_buffer, cached, groups, accepted, filtered, counters, filtered_by)
        except BaseException:
            # An engine failed (or we were cancelled): keep every group not dropped by a filter (accepted ones
            # too, the batch was never delivered), so a retry loses no prompt.
            self.partial_groups = _oldest_first(cached + [g for slot, g in groups.items() if slot not in filtered])
            raise
        # Every group neither accepted nor filtered out is cached for the next batch: groups cut mid-generation
        # (partial samples keep their tokens, log-probs and versions) and groups that finished after the batch
        # filled (re-scored next time), plus cached groups this batch did not need. Oldest first in line.
        taken = set(accepted) | filtered
        counters["groups_resumed"] = n_cached - len(cached)
        self.partial_groups = _oldest_first(cached + [g for slot, g in groups.items() if slot not in taken])
        counters["groups_cached"] = len(self.partial_groups)
        counters["samples_aborted"] = sum(1 for g in self.partial_groups for s in g if s.status == Status.ABORTED)
        counters.update({f"filtered_{k}": v for k, v in filtered_by.items()})
        counters["rollout_seconds"] = time.monotonic() - t0
        # Deterministic order: by the order groups were drawn, not by the order they finished.
        order = sorted(accepted, key=lambda sl: groups[sl][0].metadata["group_uid"])
        return convert_to_batch([groups[sl] for sl in order], current_weight_version=self.weight_version,
                                counters=counters)

    async def _fill(self, data_buffer: Any, cached: list[list[Sample]], groups: dict[int, list[Sample]],
                    accepted: list[int], filtered: set[int], counters: dict[str, Any],
                    filtered_by: dict[str, int]) -> None:
        """Launch, collect and filter groups until `accepted` holds rollout_batch_size of them; then cut the
        rest. Mutates its arguments (the caller owns the bookkeeping, also when this raises)."""
        c = self.config
        need = c.rollout_batch_size
        max_dropped = c.max_filtered_groups or 10 * need
        running: set[int] = set()  # group tasks still alive
        received = 0  # groups reported back to this loop; launched - received = groups still owed to it
        self._stopping = False
        send, recv = trio.open_memory_channel(math.inf)

        async with trio.open_nursery() as nursery:
            async def run(slot: int, url: str) -> None:
                try:
                    await self._run_group(slot, groups, url, send)
                finally:
                    running.discard(slot)

            def launch(group: list[Sample]) -> None:
                slot = len(groups)
                groups[slot] = group
                running.add(slot)
                url = self.engine_urls[self._next_engine % len(self.engine_urls)] if self.engine_urls else ""
                self._next_engine += 1
                counters["groups_submitted"] += 1
                nursery.start_soon(run, slot, url)

            while len(accepted) < need:
                want = math.ceil(c.over_sampling_factor * (need - len(accepted)))
                while len(groups) - received < want:
                    if cached:
                        group, restarted = self._refresh_cached(cached.pop(0))
                        counters["samples_restarted_stale"] += restarted
                    else:
                        group = self._new_group(data_buffer.get_prompts(1)[0])
                    launch(group)
                slot = await recv.receive()
                received += 1
                group = groups[slot]
                counters["reward_failed"] += sum(1 for s in group if "reward_error" in s.metadata)
                dropped_by = first_failed_filter(group, self.filters)
                if dropped_by is None:
                    accepted.append(slot)
                    continue
                counters["groups_filtered"] += 1
                filtered.add(slot)
                filtered_by[dropped_by] = filtered_by.get(dropped_by, 0) + 1
                if counters["groups_filtered"] > max_dropped:
                    raise RuntimeError(
                        f"dynamic filters dropped {counters['groups_filtered']} groups while filling a batch of "
                        f"{need} ({filtered_by}); the filters {[n for n, _ in self.filters]} reject almost "
                        f"everything: relax them, or raise max_filtered_groups")

            # Batch full: cut what is still running and collect partial output before cancelling the rest.
            self._stopping = True
            if running:
                with trio.move_on_after(c.abort_grace_s):
                    if self._in_flight and await self._abort_all():
                        while running:  # cut requests return their partial output
                            await trio.sleep(0.005)
            nursery.cancel_scope.cancel()


def generate_rollout_batches(data_buffer: Any, config: RolloutConfig, *, engine_urls: Sequence[str] = (),
                             num_batches: int | None = None, transforms: Sequence[SampleTransform] = (),
                             weight_version: Callable[[], int] | None = None, manager: Any = None,
                             **manager_kw: Any) -> Iterator[RolloutBatch]:
    """Yield one `RolloutBatch` per step (forever, or `num_batches` times).

    Builds an `AsyncRolloutManager(engine_urls, config, **manager_kw)` unless `manager` is given; its partial-
    sample cache lives across batches. `weight_version()` is read before each batch (the trainer's current
    version, for staleness). Each batch runs in its own `trio.run`, so the generator can be iterated from
    plain synchronous code (or from a worker thread in async-rollout mode).
    """
    if manager is None:
        manager = AsyncRolloutManager(engine_urls, config, **manager_kw)

    async def one_batch() -> RolloutBatch:
        async with manager:
            return await manager.generate_batch(data_buffer)

    produced = 0
    while num_batches is None or produced < num_batches:
        if weight_version is not None:
            manager.set_weight_version(weight_version())
        batch = trio.run(one_batch)
        if transforms:
            kept = apply_sample_transforms(batch.samples, transforms)
            batch = RolloutBatch(samples=tuple(kept), metadata=batch.metadata)
        produced += 1
        yield batch
