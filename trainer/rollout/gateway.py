"""An OpenAI-compatible HTTP endpoint that records token-exact trajectories: agents people already wrote (the
`openai` SDK, any OpenAI client) are trained by pointing their `base_url` at it (`[rl.rollout] agent`).

    agent thread (its own asyncio loop)  --HTTP-->  Gateway (uvicorn, a thread on 127.0.0.1:<free port>)
        --trio.from_thread.run-->  the rollout's trio run: AgentRecorder (token ids) -> engine.generate

The server speaks `POST /v1/chat/completions`, `POST /v1/completions` and `GET /v1/models` (shapes and validation:
engines/openai_wire.py). It renders the chat template itself and calls the engine protocol with token ids, so it
sits in front of any `InferenceEngine` (the embedded engine in process or over HTTP, vLLM, SGLang) the same way.
Each episode gets its own key, in its base_url (`/episodes/<key>/v1`, so a client that sends a fixed API key of its
own still reaches its episode) and as its API key (for `/v1` itself): the key names the episode's `AgentRecorder`
(trainer/rollout/recording.py), which turns the requests into training sequences. A key is revoked when its
episode ends (401 after).

Sampling is the run's: the engine samples at [rl.rollout] temperature / top_p / top_k with the run's per-episode
seeds, whatever the request asks (the trainer computes its log-probs at the run's temperature, so another one would
train off-policy); `n`, `max_tokens` (capped by max_new_tokens), `stop` and `logprobs` are the request's. A stream
is sent once the completion is done (the engine protocol is not incremental): the same chunks, all at the end.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import inspect
import secrets
import socket
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from engines.openai_wire import (
    ChatRequest,
    CompletionRequest,
    WireError,
    chat_answer,
    chat_choice,
    completion_answer,
    completion_choice,
    json_body,
    models_response,
    parse_chat_request,
    parse_completion_request,
)
from engines.protocol import Completion, EngineError
from trainer.rollout.blocking import BlockedCallTimeout, enter_user_code
from trainer.rollout.loading import load_callable
from trainer.rollout.recording import AgentRecorder, Schema
from trainer.rollout.samples import data_row, sample_to_dict
from trainer.types import Sample, Status

# (prompt tokens, n, new-token budget, request number in the episode) -> n completions, or None: the batch filled.
GenerateN = Callable[[tuple[int, ...], int, int, int], Awaitable[list[Completion] | None]]


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """All an OpenAI client needs: `OpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key)` and
    `model=endpoint.model`."""

    base_url: str
    api_key: str
    model: str


@dataclasses.dataclass
class _Episode:
    recorder: AgentRecorder
    generate: GenerateN


def _cut(out: Completion, limit: str | None) -> str | None:
    """What cut this completion (Gateway._complete's `limit`) when it ended at its budget, else None."""
    return limit if out.finish_reason == "length" else None


async def _not_served(request: Any, exc: Exception) -> Any:
    """A path or method the gateway does not serve (e.g. /v1/responses): OpenAI's error shape, not Starlette's
    plain text (which the SDK cannot read)."""
    from starlette.responses import JSONResponse

    status = getattr(exc, "status_code", 404)
    error = WireError(f"{request.method} {request.url.path} is not served here: the gateway serves POST "
                      f"/v1/chat/completions, POST /v1/completions and GET /v1/models", status=status)
    return JSONResponse(error.body(), status_code=status)


class Gateway:
    """The HTTP server and the keys of the episodes in flight. `start()` from inside the trio run whose engines it
    calls (one rollout batch); `close()` stops the server. `parse`: the run's tool parser (text -> ParsedTurn)."""

    def __init__(self, *, tokenizer: Any, parse: Callable[[str], Any], model: str = "policy",
                 max_concurrency: int = 64) -> None:
        self.tokenizer, self.parse, self.model = tokenizer, parse, model
        self._episodes: dict[str, _Episode] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(max_concurrency + 4, thread_name_prefix="gateway")
        self.max_concurrency = max_concurrency
        self.agent_slots: trio.CapacityLimiter | None = None  # agents running at once (start(): in the trio run)
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._token: Any = None
        self.base_url = ""

    # ------------------------------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        import uvicorn

        self._token = trio.lowlevel.current_trio_token()
        self.agent_slots = trio.CapacityLimiter(self.max_concurrency)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.root = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.base_url = f"{self.root}/v1"
        config = uvicorn.Config(self._app(), log_level="warning", lifespan="off", access_log=False)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True,
                                        name="gateway-server")
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"the agent gateway did not start on {self.base_url}")
            time.sleep(0.005)

    def close(self) -> None:
        self._episodes.clear()
        if self._server is not None:
            # force_exit: no wait for connections still open. A request of an aborted episode may be in flight: its
            # pool thread waits on the trio run, which this very call blocks; it gets RunFinishedError at the run's end.
            self._server.should_exit = self._server.force_exit = True
            self._thread.join(timeout=5)
            self._server = None
        self._pool.shutdown(wait=False, cancel_futures=True)

    def open_episode(self, recorder: AgentRecorder, generate: GenerateN) -> Endpoint:
        key = "ep-" + secrets.token_hex(16)
        self._episodes[key] = _Episode(recorder, generate)
        # The key twice: in the path (a client that sends a fixed API key of its own still reaches its episode)
        # and as the API key.
        return Endpoint(base_url=f"{self.root}/episodes/{key}/v1", api_key=key, model=self.model)

    def close_episode(self, endpoint: Endpoint) -> None:
        self._episodes.pop(endpoint.api_key, None)

    # ------------------------------------------------------------------------------------------- HTTP side
    def _app(self) -> Any:
        from starlette.applications import Starlette
        from starlette.routing import Route

        chat = functools.partial(self._post, self.answer_chat, parse_chat_request)
        text = functools.partial(self._post, self.answer_completion, parse_completion_request)
        return Starlette(routes=[
            Route(f"{prefix}/v1/chat/completions", chat, methods=["POST"]) for prefix in ("", "/episodes/{key}")
        ] + [
            Route(f"{prefix}/v1/completions", text, methods=["POST"]) for prefix in ("", "/episodes/{key}")
        ] + [
            Route(f"{prefix}/v1/models", self._models, methods=["GET"]) for prefix in ("", "/episodes/{key}")
        ], exception_handlers={404: _not_served, 405: _not_served})

    async def _models(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        return JSONResponse(models_response([self.model]))

    async def _post(self, answer: Callable, parse: Callable, request: Any) -> Any:
        """Validate the body here, then answer in the rollout's trio run (a pool thread waits for it)."""
        from starlette.responses import JSONResponse, StreamingResponse

        try:
            body = json_body(await request.body())
            req = parse(body)
            if req.model != self.model:
                raise WireError(f"model {req.model!r} is not served here; use {self.model!r} (endpoint.model)",
                                param="model", status=404)
            key = request.path_params.get("key") or \
                request.headers.get("authorization", "").removeprefix("Bearer ").strip()
            call = functools.partial(trio.from_thread.run, answer, key, req, trio_token=self._token)
            try:
                response, chunks = await asyncio.get_running_loop().run_in_executor(self._pool, call)
            except trio.RunFinishedError as e:
                raise WireError("the rollout batch of this episode is over", status=503) from e
            except EngineError as e:  # the engine failed (after the manager's retries): the agent sees a 502
                raise WireError(f"the inference engine failed: {type(e).__name__}: {e}", status=502) from e
            except WireError:
                raise
            except Exception as e:  # noqa: BLE001 - e.g. a chat template that cannot render these messages
                raise WireError(f"the gateway could not answer: {type(e).__name__}: {e}", status=500) from e
        except WireError as e:
            return JSONResponse(e.body(), status_code=e.status)
        if req.sampling.stream:
            return StreamingResponse(iter(chunks), media_type="text/event-stream")
        return JSONResponse(response)

    def _episode(self, key: str) -> _Episode:
        episode = self._episodes.get(key)
        if episode is None:
            raise WireError("unknown or revoked API key: each episode's key (endpoint.api_key) is valid while its "
                            "agent runs", param="api_key", status=401)
        return episode

    # ------------------------------------------------------------------------------------------- trio side
    async def _complete(self, episode: _Episode, prompt: Sample, n: int,
                        asked: int | None) -> tuple[list[Completion], str | None]:
        """The engine's n completions of `prompt`, and what a completion that ends at its budget ("length") was cut
        by: "context" (max_context_tokens left less), "length" (the run's max_new_tokens), or None (the request's own
        max_tokens: the agent asked for that cut)."""
        rec = episode.recorder
        budget = rec.budget(prompt, asked)
        if budget <= 0:
            rec.truncated_by = "context"
            raise WireError("no room left under [rl.rollout] max_context_tokens for a completion; the episode is "
                            "over (marked truncated)", param="max_tokens")
        outs = await episode.generate(prompt.tokens, n, budget, rec.requests - 1)
        if outs is None or any(c.finish_reason == "abort" for c in outs):
            rec.aborted = True
            raise WireError("the rollout batch filled: this episode is aborted (it starts again in a later batch)",
                            status=503)
        limit = None if asked is not None and budget >= asked else \
            "context" if budget < rec.max_new_tokens else "length"
        return outs, limit

    async def answer_chat(self, key: str, req: ChatRequest) -> tuple[dict, list[str]]:
        """The chat.completion for `req` in episode `key` (and its SSE chunks), every choice recorded."""
        episode = self._episode(key)
        rec = episode.recorder
        parent, prompt = rec.chat_prompt(req.messages, req.tools)
        outs, limit = await self._complete(episode, prompt, req.sampling.n, req.sampling.max_tokens)
        shaped = []
        for i, out in enumerate(outs):
            c = chat_choice(i, out.output_ids, out.logprobs, out.finish_reason, req, tokenizer=self.tokenizer,
                            parse=self.parse)
            rec.tool_calls += c.tool_calls
            rec.record(parent, prompt, out, c.keep, messages=tuple(req.messages), cut=_cut(out, limit),
                       tools=tuple(Schema(t) for t in req.tools), reply=c.choice["message"])
            shaped.append(c)
        return chat_answer(self.model, shaped, len(prompt.tokens), req.sampling)

    async def answer_completion(self, key: str, req: CompletionRequest) -> tuple[dict, list[str]]:
        """The text_completion for `req` in episode `key` (and its SSE chunks), every choice recorded."""
        episode = self._episode(key)
        rec = episode.recorder
        parent, prompt = rec.completion_prompt(req.prompt)
        outs, limit = await self._complete(episode, prompt, req.sampling.n, req.sampling.max_tokens)
        prompt_text = req.prompt if isinstance(req.prompt, str) else None
        shaped = []
        for i, out in enumerate(outs):
            c = completion_choice(i, out.output_ids, out.logprobs, out.finish_reason, req, tokenizer=self.tokenizer)
            # The text the recorded tokens stand for: the choice's text stops before a stop string and drops
            # special tokens, but the tokens keep both. A later prompt continues this call only when it holds that
            # whole text (the agent sent the stop string and the end token back); any other prompt is a new root.
            kept = self.tokenizer.decode(list(out.output_ids[:c.keep]), skip_special_tokens=False)
            rec.record(parent, prompt, out, c.keep, text=None if prompt_text is None else prompt_text + kept,
                       cut=_cut(out, limit))
            shaped.append(c)
        return completion_answer(self.model, shaped, len(prompt.tokens), req.sampling)


# ----------------------------------------------------------------------------------------------- the agent
def load_agent(spec: Any) -> Callable[..., Any]:
    """`[rl.rollout] agent = "module:fn"`: `async def fn(row, endpoint)` or a plain `def` (run in a worker thread)
    returning the reward (a number, or {"reward", "correct"?, "metadata"?}) or None (the run's reward scores it)."""
    fn = load_callable(spec, "[rl.rollout] agent")
    params = [p for p in inspect.signature(fn).parameters.values()
              if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(params) != 2:
        raise ValueError(f"[rl.rollout] agent {spec!r}: takes {len(params)} required argument(s); write it as "
                         f"`async def fn(row, endpoint)` (endpoint.base_url, endpoint.api_key, endpoint.model)")
    return fn


def _call_agent(fn: Callable[..., Any], row: dict, endpoint: Endpoint, timeout_s: float) -> Any:
    """In a worker thread: an async agent in an event loop of its own (asyncio, as the openai SDK expects), within
    `timeout_s`; a plain one as it is (the caller abandons it at the deadline)."""
    if not inspect.iscoroutinefunction(fn):
        return fn(row, endpoint)

    async def bounded() -> Any:
        try:
            return await asyncio.wait_for(fn(row, endpoint), timeout_s)
        except TimeoutError as e:
            raise BlockedCallTimeout(f"agent {fn.__name__!r} took longer than {timeout_s:g} s ([rl.rollout] "
                                     f"agent_timeout_s): make it faster or raise agent_timeout_s") from e

    return asyncio.run(bounded())


async def _in_worker(gateway: Gateway, call: Callable[[], Any], timeout_s: float, name: str) -> Any:
    """`call()` in a worker thread of its own, at most `max_concurrency` at once (the gateway's agent slots: agents
    are many and mostly wait on the engine, so the 32 threads of the environments' pool would starve its batches);
    past `timeout_s` (+1 s for an async agent to raise its own timeout) the thread is abandoned and its slot freed."""
    await enter_user_code()
    async with gateway.agent_slots:
        with trio.move_on_after(timeout_s + 1.0):
            return await trio.to_thread.run_sync(call, abandon_on_cancel=True, limiter=trio.CapacityLimiter(1))
    raise BlockedCallTimeout(f"agent {name!r} took longer than {timeout_s:g} s ([rl.rollout] agent_timeout_s); its "
                             f"thread was abandoned: make it faster or raise agent_timeout_s")


_REPORTED: set[str] = set()


def _agent_reward(value: Any, name: str) -> tuple[Any, dict]:
    """(reward for score_finished, metadata to add) from what the agent returned."""
    if isinstance(value, dict):
        unknown = set(value) - {"reward", "correct", "metadata"}
        if unknown or "reward" not in value:
            raise TypeError(f"agent {name!r} returned keys {sorted(value)}; return a number or {{'reward': x, "
                            f"'correct': bool, 'metadata': {{...}}}}")
        extra = dict(value.get("metadata") or {})
        return {k: value[k] for k in ("reward", "correct") if k in value}, extra
    return value, {}


async def run_agent_episode(sample: Sample, agent: Callable[..., Any], gateway: Gateway, generate: GenerateN, *,
                            timeout_s: float, **recorder_kw: Any) -> tuple[list[Sample], Any]:
    """Run one agent episode from `sample`: ([its training sequences, the first carrying the episode's metadata],
    the reward it returned). Statuses: COMPLETED; TRUNCATED (a limit refused a request: `truncated_by`); FAILED
    (the agent raised or ran past `timeout_s`: `agent_error`; or it never called the endpoint); ABORTED (the batch
    filled while a request ran). ABORTED, or a cancellation: the episode starts again in a later batch."""
    rec = AgentRecorder(sample, **recorder_kw)
    endpoint = gateway.open_episode(rec, generate)
    row = {**data_row(sample), "prompt": sample.prompt}
    name = getattr(agent, "__name__", str(agent))
    value, error, extra = None, None, {}
    t0 = time.perf_counter()
    try:
        value = await _in_worker(gateway, functools.partial(_call_agent, agent, row, endpoint, timeout_s), timeout_s,
                                 name)
        value, extra = _agent_reward(value, name)
    except Exception as e:  # noqa: BLE001 - a failing agent fails its episode, not the run
        error = e
    finally:
        gateway.close_episode(endpoint)
    seconds = time.perf_counter() - t0
    leaves = rec.sequences()
    seqs, cuts = [s for s, _ in leaves], [c for _, c in leaves]
    meta = {"turns": rec.requests, "tool_calls": rec.tool_calls, "tool_errors": 0.0, "env_seconds": 0.0,
            "agent_seconds": seconds, "agent_splits": max(len(seqs) - 1, 0), **extra}
    # A refused request (rec.truncated_by) truncates the whole episode; a completion a limit cut, only the sequences
    # that hold it (with n > 1, a sibling the agent went on with was not cut)
    cuts = [rec.truncated_by or c for c in cuts]
    truncated = next((c for c in cuts if c), None)
    status = Status.TRUNCATED if truncated else Status.COMPLETED
    if rec.aborted:  # the batch filled mid-episode (the agent got a 503): cached, it starts again in a later batch
        status = Status.ABORTED
    elif error is not None and not truncated:
        status, message = Status.FAILED, f"{type(error).__name__}: {error}"
        meta.update(agent_error=message, env_error=message)
        if isinstance(error, BlockedCallTimeout):
            meta["env_timed_out"] = True
        if message not in _REPORTED and len(_REPORTED) < 20:
            _REPORTED.add(message)
            print(f"agent failed on prompt {sample.prompt[-200:]!r}:\n{''.join(traceback.format_exception(error))}",
                  file=sys.stderr, flush=True)
    elif not seqs:
        status = Status.FAILED
        meta.update(agent_error="the agent returned without calling its endpoint", env_error="no request")
    seqs, cuts = seqs or [sample], cuts or [truncated]
    reward = 0.0 if status == Status.FAILED else None

    def own(cut: str | None) -> Status:  # a sequence's status: the episode's, or COMPLETED where no limit cut it
        return (Status.TRUNCATED if cut else Status.COMPLETED) if status in (Status.TRUNCATED, Status.COMPLETED) \
            else status

    out = [dataclasses.replace(s, status=own(cut), reward=reward, response=_response(gateway, s),
                               metadata={**s.metadata, **meta, "truncated_by": cut} if k == 0 else
                               {**s.metadata, "agent_part": k, "agent_error": meta.get("agent_error"),
                                "truncated_by": cut})
           for k, (s, cut) in enumerate(zip(seqs, cuts))]
    out = [dataclasses.replace(s, metadata={k: v for k, v in s.metadata.items() if v is not None}) for s in out]
    return out, None if status == Status.FAILED else value


def _response(gateway: Gateway, s: Sample) -> str:
    """What a reward function reads: the text of the sequence's last completion (the model's final message)."""
    mask = list(s.loss_mask or ())
    end = len(mask)
    while end and not mask[end - 1]:
        end -= 1
    start = end
    while start and mask[start - 1]:
        start -= 1
    ids = list(s.tokens[s.prompt_length + start:s.prompt_length + end])
    return gateway.tokenizer.decode(ids, skip_special_tokens=True)


def pack_parts(samples: list[Sample]) -> list[Sample]:
    """An episode's sequences as one group entry: the first, holding the others (JSON, so a cached group stays
    checkpointable) in metadata["agent_parts"]; `unpack_parts` spreads them out again."""
    first, rest = samples[0], samples[1:]
    if not rest:
        return [first]
    return [dataclasses.replace(first, metadata={**first.metadata,
                                                 "agent_parts": [sample_to_dict(s) for s in rest]})]


def unpack_parts(group: list[Sample]) -> list[Sample]:
    """A group whose agent episodes split: every training sequence its own sample (sharing the group's uid)."""
    from trainer.rollout.samples import sample_from_dict

    out = []
    for s in group:
        parts = s.metadata.get("agent_parts")
        if not parts:
            out.append(s)
            continue
        out.append(dataclasses.replace(s, metadata={k: v for k, v in s.metadata.items() if k != "agent_parts"}))
        out.extend(sample_from_dict(d) for d in parts)
    return out


async def run_eval_agents(engine: Any, samples: list[Sample], config: Any, *, tokenizer: Any, max_new_tokens: int,
                          score: Callable[[Sample], Any], temperature: float = 0.0,
                          seeds: list[int] | None = None) -> list[Sample]:
    """Evaluation's agent episodes (trainer.rollout.episodes.run_eval_episodes' counterpart for `[rl.rollout]
    agent`): each sample's episode through a gateway of its own, every request at `temperature` (greedy by default;
    sampled requests of episode i seeded seeds[i] + 1009 * request), all in flight together; one sample each (its
    last sequence, with the episode's metadata), scored by the agent's reward or else by `score`."""
    from engines.protocol import SamplingParams
    from trainer.rollout.episodes import score_finished
    from trainer.rollout.samples import stop_token_ids
    from trainer.rollout.tools import load_tool_parser

    assert temperature == 0.0 or (seeds is not None and len(seeds) == len(samples)), "sampled episodes need seeds"
    agent = load_agent(config.agent)
    stops = tuple(stop_token_ids(tokenizer, chat=True, extra=config.stop_token_ids))
    gateway = Gateway(tokenizer=tokenizer, parse=load_tool_parser(config.tool_parser),
                      max_concurrency=config.max_concurrency)
    out: list[Any] = [None] * len(samples)

    def generator(i: int) -> GenerateN:
        async def generate(tokens: tuple[int, ...], n: int, budget: int, call: int) -> list[Completion]:
            seed = None if temperature == 0.0 else (seeds[i] + 1009 * call) % (2 ** 31)
            params = SamplingParams(temperature=temperature, max_new_tokens=budget, stop_token_ids=stops, n=n,
                                    seed=seed)
            return (await engine.generate([tokens], params))[0]
        return generate

    async def one(i: int) -> None:
        seqs, reward = await run_agent_episode(
            samples[i], agent, gateway, generator(i), timeout_s=config.agent_timeout_s, tokenizer=tokenizer,
            turn_end_ids=frozenset(stop_token_ids(tokenizer, chat=True)), max_turns=config.max_turns,
            max_new_tokens=max_new_tokens, max_context_tokens=config.max_context_tokens)
        last = dataclasses.replace(seqs[-1], metadata=seqs[0].metadata)
        out[i] = await score_finished(last, score, reward)

    gateway.start()
    try:
        async with trio.open_nursery() as nursery:
            for i in range(len(samples)):
                nursery.start_soon(one, i)
    finally:
        gateway.close()
    return out
