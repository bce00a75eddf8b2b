"""AsyncRolloutManager: fills one rollout batch from N inference engines (any `engines.protocol.InferenceEngine`).

The manager speaks only the engine protocol: `engine.generate(prompts, SamplingParams, rids=...)` and
`engine.abort()`; HTTP, pooled connections and the wire format are the engine client's business
(`engines.sglang.SGLangEngine` for the embedded engine and SGLang, `engines.vllm.VLLMEngine` for vLLM).

One batch, step by step:
  1. Groups cached from the previous batch go first (samples that were cut keep their partial response,
     log-probs and weight versions; samples older than `max_staleness` versions restart from the prompt).
  2. New prompts come from the DataBuffer. ceil(over_sampling_factor x groups still needed) groups are kept in
     flight; a group = n samples of one prompt sent as ONE request (n samples of one prompt, or the group's
     partial samples as one batch), so the engine batches them and shares the prompt. A CapacityLimiter bounds
     the requests in flight over all engines. Engines that do not answer are retried (`max_retries`).
  3. A finished group is scored (reward errors mark samples FAILED) and passed through the dynamic filters;
     a dropped group is replaced by a new one.
  With `deterministic=True` each engine runs one request at a time, so a request's rows form the engine's whole
  batch: the logits (and so the tokens and log-probs) do not depend on which other requests arrived meanwhile.
  4. Once rollout_batch_size groups passed: `abort()` on every engine with requests in flight, up to
     abort_grace_s for the cut requests to return their partial output, then the nursery is cancelled.
     Unfinished groups go to the cache.
Structured concurrency means nothing outlives `generate_batch`: no stray tasks, no stray requests.
"""

from __future__ import annotations

import builtins
import collections
import contextlib
import dataclasses
import functools
import math
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import trio

from engines.protocol import Completion, EngineError, EngineUnavailableError, InferenceEngine, SamplingParams
from trainer.config import RolloutConfig
from trainer.rewards.rules import RewardFn, load_reward_fn
from trainer.rollout.blocking import abandoned_threads
from trainer.rollout.episodes import build_driver, run_episode, score_finished
from trainer.rollout.gateway import Gateway, load_agent, pack_parts, run_agent_episode, unpack_parts
from trainer.rollout.samples import (
    SampleTransform,
    apply_sample_transforms,
    convert_to_batch,
    extend_sample,
    first_failed_filter,
    prompt_token_ids,
    resolve_filters,
    restart_group,
    restart_sample,
    sample_from_dict,
    sample_to_dict,
    stop_token_ids,
)
from trainer.rollout.staleness import past_bound
from trainer.rollout.tools import load_tool_parser
from trainer.types import RolloutBatch, Sample, Status


def _oldest_first(groups: list[list[Sample]]) -> list[list[Sample]]:
    """Cached groups in the order they were drawn from the data buffer (so none starves)."""
    return sorted(groups, key=lambda g: g[0].group_index)


_EXC_GROUP = builtins.ExceptionGroup  # trio raises these from nurseries
_FINISHED = (Status.COMPLETED, Status.TRUNCATED, Status.FAILED)
_STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}


def _first_leaf(eg: BaseException) -> BaseException:
    while isinstance(eg, _EXC_GROUP):
        eg = eg.exceptions[0]
    return eg


def request_seed(run_seed: int, group_uid: int, sample: int, k: int) -> int:
    """The engine seed of one request: fixed by (run seed, group, first sample, k = the segment, turn or agent
    call), so a batch is reproducible whatever the arrival order."""
    return (run_seed * 1_000_003 + group_uid * 65_537 + sample * 257 + k) % (2 ** 31)


class AsyncRolloutManager:
    """Stateful rollout driver; use as `async with manager: batch = await manager.generate_batch(buffer)`.

    engines: `InferenceEngine` objects (groups go round-robin over them). State kept between batches: the
    partial-group cache, the trainer's weight version, counters.
    """

    def __init__(self, engines: Sequence[InferenceEngine], config: RolloutConfig, *, tokenizer: Any,
                 reward_fn: str | RewardFn | None = None, filters: Sequence[Any] | None = None,
                 check_health: bool = True, generation_config: Any = None, deterministic: bool = False) -> None:
        self.engines = list(engines)
        if not self.engines:
            raise ValueError("engines: give at least one inference engine (e.g. "
                             "engines.sglang.SGLangEngine('http://127.0.0.1:30000'))")
        bad = [e for e in self.engines if isinstance(e, str | bytes | dict)]
        if bad:
            raise TypeError(f"engines: {bad[0]!r} is not an engine object (engines.protocol.InferenceEngine): pass "
                            f"engine objects, e.g. engines.registry.build_engine(EngineSpec(kind, url)), not URLs")
        self.config = config
        self.tokenizer = tokenizer
        # A data set's prompts come back every epoch; rendering the chat template costs ~0.7 ms per prompt.
        self._prompt_ids = functools.lru_cache(maxsize=1 << 16)(
            lambda text, system: tuple(prompt_token_ids(tokenizer, text, chat=config.apply_chat_template,
                                                        system=system)))
        self.reward_fn = load_reward_fn(reward_fn) if reward_fn is not None else None
        # Multi-turn episodes (trainer.rollout.episodes) when the config names an env, tools or a rollout_fn.
        self.driver, self.tools = build_driver(config)
        self.parse_turn = load_tool_parser(config.tool_parser)
        # An OpenAI-client agent ([rl.rollout] agent), served by a recording gateway while a batch runs.
        self.agent = load_agent(config.agent) if config.agent else None
        self.gateway: Gateway | None = None
        self.filters = resolve_filters(config.dynamic_filters if filters is None else filters)
        self.check_health = check_health
        self.deterministic = deterministic
        self._engine_locks: dict[int, trio.Lock] = {}  # deterministic: id(engine) -> its one request at a time
        self.stop_ids = tuple(stop_token_ids(tokenizer, chat=config.apply_chat_template, extra=config.stop_token_ids,
                                             generation_config=generation_config))
        # Where an assistant turn ends in the chat template (episodes render the environment's answer after it).
        self.turn_end_ids = frozenset(stop_token_ids(tokenizer, chat=True, generation_config=generation_config))
        self.weight_version = 0
        self.partial_groups: list[list[Sample]] = []  # groups cut by the last batch, resumed first by the next
        # Groups the trainer sent back (past the staleness bound, [rl] stale_policy = "regenerate"): from the
        # trainer's thread while this one generates in the worker; a deque's append / popleft are atomic.
        self._requeued: collections.deque[list[Sample]] = collections.deque()
        self._group_uid = 0  # monotonically increasing id of each group drawn from the buffer (seeds, order)
        self._in_flight: dict[str, InferenceEngine] = {}  # rid -> engine, for requests currently running
        self._orphaned: dict[int, InferenceEngine] = {}  # engines with requests we stopped waiting for
        self._limiter: trio.CapacityLimiter | None = None
        self._open = False
        self._stopping = False
        self._cancelled = False  # cancel() was called: no batch any more
        self._running: tuple[Any, trio.CancelScope] | None = None  # (trio token, scope) of the batch in flight
        self._next_engine = 0
        self.stats: dict[str, int] = {"requests": 0, "retries": 0, "aborts_sent": 0, "unrequested_aborts": 0}

    # ----------------------------------------------------------------------------------------- lifecycle
    async def __aenter__(self) -> AsyncRolloutManager:
        self._limiter = trio.CapacityLimiter(self.config.max_concurrency)
        self._engine_locks = {id(e): trio.Lock() for e in self.engines} if self.deterministic else {}
        self._open = True
        if self.agent is not None:
            self.gateway = Gateway(tokenizer=self.tokenizer, parse=self.parse_turn,
                                   max_concurrency=self.config.max_concurrency)
            self.gateway.start()
        try:
            if self.check_health:
                for engine in self.engines:
                    await self._with_retries(engine, "health check", self._health, engine)
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self._orphaned:  # requests cancelled client-side (error path, or past abort_grace_s): stop them
            with trio.move_on_after(2):
                await self._abort(self._orphaned.values())
            self._orphaned.clear()
        for engine in self.engines:  # pooled connections belong to this event loop
            with trio.move_on_after(2):
                await engine.aclose()
        if self.gateway is not None:
            self.gateway.close()
            self.gateway = None
        self._open = False

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs to resume rollouts exactly: cached partial groups, groups requeued and not drawn
        again yet, group counter, version."""
        return {"weight_version": self.weight_version, "group_uid": self._group_uid,
                "partial_groups": [[sample_to_dict(s) for s in g] for g in self.partial_groups],
                "requeued": [[sample_to_dict(s) for s in g] for g in list(self._requeued)]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.weight_version = int(state["weight_version"])
        self._group_uid = int(state["group_uid"])
        self.partial_groups = [[sample_from_dict(d) for d in g] for g in state["partial_groups"]]
        self._requeued = collections.deque([sample_from_dict(d) for d in g] for g in state.get("requeued", ()))

    def requeue(self, groups: Sequence[Sequence[Sample]]) -> None:
        """Generate these groups again, from their prompts, first in line in a later batch (thread-safe)."""
        for g in groups:
            self._requeued.append(restart_group(g))

    def set_weight_version(self, version: int) -> None:
        """The version the next batch is measured against (trainer.rollout.staleness.StalenessPolicy.train_version:
        the trainer's version it trains at, at the latest); cached partial samples past the bound restart."""
        self.weight_version = int(version)

    # ----------------------------------------------------------------------------------------- engine calls
    @staticmethod
    async def _health(engine: InferenceEngine) -> None:
        if not await engine.health():
            raise EngineUnavailableError(f"{engine.url}/health: not healthy")

    async def _with_retries(self, engine: InferenceEngine, what: str, fn: Callable, *args: Any) -> Any:
        """`await fn(*args)` under request_timeout_s, retried on EngineUnavailableError (no answer, 5xx, timeout)
        with exponential backoff; after max_retries a clear EngineUnavailableError naming the engine."""
        c = self.config
        t0 = time.monotonic()
        last: BaseException | None = None
        for attempt in range(c.max_retries + 1):
            if attempt:
                self.stats["retries"] += 1
                await trio.sleep(c.retry_backoff_s * 2 ** (attempt - 1))
                if self._stopping:  # the batch filled during the backoff: a retry sent now would run past its abort
                    raise EngineUnavailableError(f"engine {engine.url}: the {what} was not retried: the batch filled")
            try:
                with trio.fail_after(c.request_timeout_s):
                    return await fn(*args)
            except trio.TooSlowError as e:
                self._orphaned[id(engine)] = engine
                last = e
            except EngineUnavailableError as e:
                last = e
        raise EngineUnavailableError(
            f"engine {engine.url} did not answer the {what} after {c.max_retries + 1} attempts in "
            f"{time.monotonic() - t0:.1f}s (last error: {type(last).__name__}: {last}); check that the server is "
            f"running at that URL, or raise max_retries / request_timeout_s")

    async def _abort(self, engines: Any) -> None:
        """Ask engines to cut their running requests short (best effort: errors are ignored)."""
        async def one(engine: InferenceEngine) -> None:
            try:
                await engine.abort()
                self.stats["aborts_sent"] += 1
            except EngineError:
                pass

        async with trio.open_nursery() as n:
            for engine in {id(e): e for e in engines}.values():
                n.start_soon(one, engine)

    async def _generate(self, engine: InferenceEngine, prompts: list[tuple[int, ...]], params: SamplingParams,
                        rid: str) -> list[Completion] | None:
        """One request (prompt-major rows, n per prompt); None when the batch filled before it was sent or the
        engine dropped it while being aborted."""
        alone = self._engine_locks.get(id(engine)) or contextlib.nullcontext()
        async with self._limiter, alone:
            if self._stopping:  # the batch filled while this request waited for a slot: never send it
                return None
            self._in_flight[rid] = engine
            self.stats["requests"] += 1
            try:
                groups = await self._with_retries(engine, "generate request", self._call_generate, engine, prompts,
                                                  params, rid)
            except EngineError:
                if self._stopping:  # the engine dropped the request we aborted: keep the samples as they were
                    return None
                raise
            except trio.Cancelled:  # we stop waiting, but the engine may still be generating: abort it later
                self._orphaned[id(engine)] = engine
                raise
            finally:
                self._in_flight.pop(rid, None)
            return [c for g in groups for c in g]

    @staticmethod
    async def _call_generate(engine: InferenceEngine, prompts: list[tuple[int, ...]], params: SamplingParams,
                             rid: str) -> list[list[Completion]]:
        return await engine.generate(prompts, params, rids=[f"{rid}-p{i}" for i in range(len(prompts))])

    # ----------------------------------------------------------------------------------------- one group
    def _new_group(self, prompt: Any) -> list[Sample]:
        ids = self._prompt_ids(prompt.prompt, getattr(prompt, "system", None))
        uid = self._group_uid
        self._group_uid += 1
        meta = {**prompt.metadata, "answer": prompt.answer, "prompt_index": prompt.index}
        if self.driver is not None and getattr(prompt, "system", None):
            meta["system_prompt"] = prompt.system  # the tool environment opens with it
        return [Sample(prompt=prompt.prompt, tokens=tuple(ids), rollout_logprobs=(), group_index=uid, index=j,
                       metadata=meta) for j in range(self.config.n_samples_per_prompt)]

    def _refresh_cached(self, group: list[Sample]) -> tuple[list[Sample], int]:
        """Restart the samples of a cached group that lag the trainer by more than max_staleness versions (an agent
        episode that split restarts as one sample: its further sequences are dropped, restart_group)."""
        stale = {s.index for s in group
                 if (s.response_length > 0 or s.status in (Status.COMPLETED, Status.TRUNCATED))
                 and past_bound(self.weight_version, s.weight_version, self.config.max_staleness)}
        out = [s for s in group if s.index not in stale] + restart_group([s for s in group if s.index in stale])
        return sorted(out, key=lambda s: s.index), len(stale)

    async def _run_part(self, slot: int, groups: dict[int, list[Sample]], engine: InferenceEngine,
                        js: list[int], budget: int) -> None:
        """Continue samples `js` of group `slot` (all with `budget` new tokens left): n samples of one prompt in one
        request when they share their tokens (a fresh group), else one request per sample. The k-th row of a request
        is drawn with seed + k, a seed fixed by (run seed, group, first sample, segment): reproducible whatever the
        arrival order."""
        samples = [groups[slot][j] for j in js]
        if len(js) > 1 and any(s.tokens != samples[0].tokens for s in samples):
            # Samples that parted (resumed partial ones): one request each, so each gets its own seed; one request
            # of n prompts would draw every row with the same seed (SamplingParams: seed + k over a prompt's n).
            async with trio.open_nursery() as n:
                for j in js:
                    n.start_soon(self._run_part, slot, groups, engine, [j], budget)
            return
        if budget <= 0:
            for j, s in zip(js, samples):
                groups[slot][j] = dataclasses.replace(s, status=Status.TRUNCATED)
            return
        c = self.config
        uid = samples[0].group_index
        seg = len(samples[0].metadata.get("weight_versions", ()))
        seed = request_seed(c.seed, uid, js[0], seg)
        params = SamplingParams(temperature=c.temperature, top_p=c.top_p, top_k=c.top_k, max_new_tokens=budget,
                                stop_token_ids=self.stop_ids, n=len(js), seed=seed)
        outs = await self._generate(engine, [samples[0].tokens], params, rid=f"g{uid}-s{js[0]}-{seg}-{slot}")
        if outs is None:
            return
        for j, s, out in zip(js, samples, outs):
            groups[slot][j] = extend_sample(s, out.output_ids, out.logprobs, status=_STATUS[out.finish_reason],
                                            weight_version=out.oldest_version, spans=out.weight_versions,
                                            tokenizer=self.tokenizer, max_new_tokens=c.max_new_tokens,
                                            cached_tokens=out.cached_tokens,
                                            spec_accepted_tokens=out.spec_accepted_tokens)

    async def _run_group(self, slot: int, groups: dict[int, list[Sample]], engine: InferenceEngine,
                         done: trio.MemorySendChannel) -> None:
        """Generate the unfinished samples of group `slot` (state kept in `groups[slot]` as it progresses),
        then score it and report it on `done`. One request per distinct remaining budget (one for a fresh
        group)."""
        for _ in range(self.config.max_retries + 1):
            parts: dict[int, list[int]] = {}
            for j, s in enumerate(groups[slot]):
                if s.status not in _FINISHED:
                    parts.setdefault(self.config.max_new_tokens - s.response_length, []).append(j)
            async with trio.open_nursery() as n:
                if self.driver is not None or self.agent is not None:  # episodes: one each, scored as they finish
                    run = self._run_episode if self.agent is None else self._run_agent
                    for j in (j for js in parts.values() for j in js):
                        n.start_soon(run, slot, groups, engine, j)
                else:
                    for budget, js in parts.items():
                        n.start_soon(self._run_part, slot, groups, engine, js, budget)
            if self._stopping:
                return  # cut by the batch-end abort: stays in `groups`, cached for the next batch
            if not any(s.status in (Status.PENDING, Status.ABORTED) for s in groups[slot]):
                break
            # The engine cut rows nobody here asked it to (an operator's /abort_request, a scheduler's rejection):
            # they go on from where they were; unreported, the group would be owed to the batch for ever (a hang)
            self.stats["unrequested_aborts"] += 1
        else:
            raise EngineUnavailableError(
                f"engine {engine.url} aborted the samples of group {groups[slot][0].group_index} "
                f"{self.config.max_retries + 1} times without being asked (an operator's abort_request, or a server "
                f"rejecting the requests); check its log, or raise max_retries")
        if self.driver is None and self.agent is None:
            groups[slot] = [await score_finished(s, self.reward_fn) for s in groups[slot]]
        if self.agent is not None:  # an agent episode that split: each training sequence its own sample
            groups[slot] = unpack_parts(groups[slot])
        await done.send(slot)

    async def _run_episode(self, slot: int, groups: dict[int, list[Sample]], engine: InferenceEngine, j: int) -> None:
        """Run sample j of group `slot` as a multi-turn episode (trainer.rollout.episodes), one engine request per
        turn, each turn's seed fixed by (run seed, group, sample, segment) like single-turn requests. An episode
        that was cut by an earlier batch's abort starts again: its environment did not outlive that batch."""
        s = groups[slot][j]
        if s.status != Status.PENDING or s.response_length:
            s = restart_sample(s)
        c = self.config
        uid = s.group_index

        async def generate(tokens: tuple[int, ...], budget: int, segment: int) -> Completion | None:
            seed = request_seed(c.seed, uid, j, segment)
            params = SamplingParams(temperature=c.temperature, top_p=c.top_p, top_k=c.top_k, max_new_tokens=budget,
                                    stop_token_ids=self.stop_ids, n=1, seed=seed)
            outs = await self._generate(engine, [tokens], params, rid=f"g{uid}-s{j}-{segment}-{slot}")
            return None if outs is None else outs[0]

        done, reward = await run_episode(
            s, self.driver, tokenizer=self.tokenizer, generate=generate, turn_end_ids=self.turn_end_ids,
            parse=self.parse_turn, max_turns=c.max_turns, max_new_tokens=c.max_new_tokens,
            max_context_tokens=c.max_context_tokens, tools=self.tools)
        groups[slot][j] = await score_finished(done, self.reward_fn, reward)

    async def _run_agent(self, slot: int, groups: dict[int, list[Sample]], engine: InferenceEngine, j: int) -> None:
        """Run sample j of group `slot` as an agent episode through the gateway (trainer.rollout.gateway): the
        run's sampling settings, each request's seed fixed by (run seed, group, sample, request number)."""
        s = groups[slot][j]
        if s.status != Status.PENDING or s.response_length:
            s = restart_sample(s)
        c = self.config
        uid = s.group_index

        async def generate(tokens: tuple[int, ...], n: int, budget: int, call: int) -> list[Completion] | None:
            seed = request_seed(c.seed, uid, j, call)
            params = SamplingParams(temperature=c.temperature, top_p=c.top_p, top_k=c.top_k, max_new_tokens=budget,
                                    stop_token_ids=self.stop_ids, n=n, seed=seed)
            return await self._generate(engine, [tokens], params, rid=f"g{uid}-s{j}-{call}-{slot}")

        seqs, reward = await run_agent_episode(
            s, self.agent, self.gateway, generate, timeout_s=c.agent_timeout_s, tokenizer=self.tokenizer,
            turn_end_ids=self.turn_end_ids, max_turns=c.max_turns, max_new_tokens=c.max_new_tokens,
            max_context_tokens=c.max_context_tokens)
        groups[slot][j] = pack_parts([await score_finished(x, self.reward_fn, reward) for x in seqs])[0]

    # ----------------------------------------------------------------------------------------- one batch
    async def generate_batch(self, data_buffer: Any) -> RolloutBatch:
        """Fill one batch of rollout_batch_size groups that pass the filters (see the module docstring)."""
        if not self._open:
            raise RuntimeError("generate_batch needs an open manager: `async with manager: ...`")
        with trio.CancelScope() as scope:
            self._running = (trio.lowlevel.current_trio_token(), scope)
            if self._cancelled:  # read after _running is set: a cancel() in between sees one or the other
                scope.cancel()
            try:
                return await self._generate_batch(data_buffer)
            except _EXC_GROUP as eg:  # surface the real error (e.g. EngineUnavailableError), not a group
                raise _first_leaf(eg) from eg
            finally:
                self._running = None
        raise RuntimeError("the rollout manager was cancelled (the run is closing); it generates no more batches")

    def cancel(self) -> None:
        """Stop generating, from any thread: the batch in flight ends now (its groups are cached, as on any error),
        and generate_batch refuses every later one. For a run that is closing (Ctrl-C, an error) while a worker
        thread generates: the worker must not keep the run waiting for a batch nobody will train on."""
        self._cancelled = True
        running = self._running
        if running is not None:
            token, scope = running
            with contextlib.suppress(trio.RunFinishedError):  # the batch ended meanwhile
                token.run_sync_soon(scope.cancel)

    async def _generate_batch(self, data_buffer: Any) -> RolloutBatch:
        t0 = time.monotonic()
        requeued = []
        while self._requeued:
            requeued.append(self._requeued.popleft())
        cached, self.partial_groups = requeued + self.partial_groups, []
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
        # Threads of hung tools and environment calls that still run (trainer.rollout.blocking): a number that grows
        # from batch to batch is a leak of threads (and of what they hold) a user should see.
        counters["abandoned_threads"] = abandoned_threads()
        # Deterministic order: by the order groups were drawn, not by the order they finished.
        order = sorted(accepted, key=lambda sl: groups[sl][0].group_index)
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
            async def run(slot: int, engine: InferenceEngine) -> None:
                try:
                    await self._run_group(slot, groups, engine, send)
                finally:
                    running.discard(slot)

            def launch(group: list[Sample]) -> None:
                slot = len(groups)
                groups[slot] = group
                running.add(slot)
                engine = self.engines[self._next_engine % len(self.engines)]
                self._next_engine += 1
                counters["groups_submitted"] += 1
                nursery.start_soon(run, slot, engine)

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
                    if self._in_flight:
                        await self._abort(list(self._in_flight.values()))
                    while running:  # cut requests return their partial output
                        await trio.sleep(0.005)
            nursery.cancel_scope.cancel()
        # Requests given up client-side (past abort_grace_s) may still run on their engines: stop them now, before
        # the next batch starts (a process backend keeps one manager open for the whole run, so __aexit__ is late)
        if self._orphaned:
            with trio.move_on_after(2):
                await self._abort(self._orphaned.values())
            self._orphaned.clear()


def generate_rollout_batches(data_buffer: Any, config: RolloutConfig, *, engines: Sequence[InferenceEngine] = (),
                             num_batches: int | None = None, transforms: Sequence[SampleTransform] = (),
                             weight_version: Callable[[], int] | None = None, manager: Any = None,
                             **manager_kw: Any) -> Iterator[RolloutBatch]:
    """Yield one `RolloutBatch` per step (forever, or `num_batches` times).

    Builds an `AsyncRolloutManager(engines, config, **manager_kw)` unless `manager` is given; its partial-
    sample cache lives across batches. `weight_version()` is read before each batch (the trainer's current
    version, for staleness). Each batch runs in its own `trio.run`, so the generator can be iterated from
    plain synchronous code (or from a worker thread in async-rollout mode).
    """
    if manager is None:
        manager = AsyncRolloutManager(engines, config, **manager_kw)

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
