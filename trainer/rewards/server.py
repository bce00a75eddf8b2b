"""A reward model behind HTTP, and its client: `python -m trainer.rewards.server --model PATH --port N`.

    POST /score  {"prompts": [str], "completions": [str], "systems": [str | null]}  ->  {"scores": [float]}
    GET  /health                                                                     ->  {"status": "ok", "model": PATH}

The server holds one reward model (trainer.rewards.model.load_reward_model: a sequence classifier with one
output and its tokenizer) and scores each request with score_samples: the (system, prompt, completion) rendered by
the model's own chat template (`--no-chat`: the plain text prompt + completion), one score per sample in the
request's order. "systems" is optional (one entry per sample; null: no system turn). Why a server: the reward model
then lives on its own device or machine (a large one beside the trainer's GPUs, or one shared by several runs),
the way verl and slime place theirs; a [rewards] model source with `url` scores through it.

Requests are scored one at a time on a worker thread (the event loop keeps answering /health). A bad body is a 400
with {"error": why}; a failing forward a 500 with the exception. A body over --max-body-mb (16 MiB by default) is a
413 naming the limit, refused by its Content-Length before anything is read, or as soon as a streamed body passes
it: a body is read whole and parsed before scoring (its bytes, then what they parse into), so its size is what
bounds the server's memory. A sample that renders to more tokens than the reward model's context
(max_position_embeddings) is scored past the positions the model was trained on: the first such request gets a
warning on stderr naming --max-length (which keeps the last N tokens of a longer rendering); later ones are not
checked again. With an API key (RLKERNELS_ENGINE_API_KEY in the environment, or --api-key-file: a file only its
owner can read), every route needs `Authorization: Bearer KEY`; a non-loopback --host without a key is refused
unless --allow-no-key (as for the embedded engine).

The client, `score_remote`, posts the samples in requests of at most MAX_REQUEST_BYTES of JSON each (well under the
server's default limit), each with a timeout, and raises RewardServerError naming the server (and its message) on
any failure: no answer, an HTTP error, or an answer of the wrong shape.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import httpx

ScoreFn = Callable[[list[str], list[str], list[str | None]], list[float]]

MAX_BODY_BYTES = 16 * 2**20  # the server's default limit on a /score body (--max-body-mb)
MAX_REQUEST_BYTES = 4 * 2**20  # the client's requests: several of these per batch rather than one over the limit


class RewardServerError(RuntimeError):
    """The scoring server did not give scores for a request (the message names the server)."""


# ----------------------------------------------------------------------------------------------- client
def score_remote(url: str, prompts: Sequence[str], completions: Sequence[str],
                 systems: Sequence[str | None] | None = None, *, api_key: str | None = None,
                 timeout_s: float = 120.0) -> list[float]:
    """The server's score of each (prompt, completion), in the input order; RewardServerError otherwise. The samples
    go in requests of at most MAX_REQUEST_BYTES each (request_bodies), one after the other."""
    systems = list(systems) if systems is not None else [None] * len(prompts)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    where = f"reward server {url.rstrip('/')}/score"
    with httpx.Client(timeout=timeout_s, headers=headers) as client:
        return [x for body in request_bodies(prompts, completions, systems, MAX_REQUEST_BYTES)
                for x in _post_scores(client, url, body, where=where, timeout_s=timeout_s)]


def request_bodies(prompts: Sequence[str], completions: Sequence[str], systems: Sequence[str | None],
                   limit: int) -> list[dict[str, list]]:
    """The samples, in order, cut into /score bodies of at most about `limit` bytes of JSON each (a sample larger
    than that goes alone, and a server whose limit it passes refuses it, naming the limit). Lists of unequal
    lengths go as one body, for the server to say what is wrong with them."""
    if not len(prompts) == len(completions) == len(systems):
        return [{"prompts": list(prompts), "completions": list(completions), "systems": list(systems)}]
    bodies: list[dict[str, list]] = []
    body: dict[str, list] = {"prompts": [], "completions": [], "systems": []}
    size = 0
    for sample in zip(prompts, completions, systems):
        n = len(json.dumps(sample).encode())  # its share of the body, give or take the keys' few bytes
        if body["prompts"] and size + n > limit:
            bodies.append(body)
            body, size = {"prompts": [], "completions": [], "systems": []}, 0
        for key, value in zip(("prompts", "completions", "systems"), sample):
            body[key].append(value)
        size += n
    return [*bodies, body]


def _post_scores(client: httpx.Client, url: str, body: dict[str, list], *, where: str,
                 timeout_s: float) -> list[float]:
    """One /score request: its scores, checked."""
    try:
        resp = client.post(url.rstrip("/") + "/score", json=body)
    except httpx.TimeoutException as e:
        raise RewardServerError(f"{where}: no answer within {timeout_s:g} s ({type(e).__name__}); is it overloaded? "
                                f"raise the source's timeout_s") from e
    except httpx.HTTPError as e:
        raise RewardServerError(f"{where}: {type(e).__name__}: {e}; is the server running at that address "
                                f"(python -m trainer.rewards.server)?") from e
    if resp.status_code != 200:
        raise RewardServerError(f"{where}: HTTP {resp.status_code}: {_message(resp)}")
    try:
        scores = resp.json()["scores"]
    except (ValueError, KeyError, TypeError) as e:
        raise RewardServerError(f"{where}: the answer is not {{\"scores\": [...]}}: {resp.text[:200]!r}") from e
    if not isinstance(scores, list) or len(scores) != len(body["prompts"]) or not all(
            isinstance(x, int | float) and not isinstance(x, bool) for x in scores):
        raise RewardServerError(f"{where}: expected {len(body['prompts'])} numbers, got {str(scores)[:200]}")
    return [float(x) for x in scores]


def read_api_key(path: str | os.PathLike | None) -> str | None:
    """The key on the first line of `path` (None: no key); an error naming the file when it is missing or empty."""
    if path is None:
        return None
    with open(path) as f:
        key = f.readline().strip()
    if not key:
        raise ValueError(f"api_key_file {str(path)!r} is empty; write the server's key on its first line")
    return key


def _message(resp: httpx.Response) -> str:
    try:
        return str(resp.json().get("error", resp.text))[:500]
    except ValueError:
        return resp.text[:500]


# ----------------------------------------------------------------------------------------------- server
def parse_request(body: Any) -> tuple[list[str], list[str], list[str | None]]:
    """(prompts, completions, systems) of a /score body; a ValueError saying what is wrong with it."""
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object {\"prompts\": [...], \"completions\": [...]}")
    prompts, completions = body.get("prompts"), body.get("completions")
    systems = body.get("systems")
    for key, value in (("prompts", prompts), ("completions", completions)):
        if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
            raise ValueError(f"{key!r} must be a list of strings")
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions; give one completion per prompt")
    if systems is None:
        systems = [None] * len(prompts)
    if not isinstance(systems, list) or len(systems) != len(prompts) or not all(
            s is None or isinstance(s, str) for s in systems):
        raise ValueError(f"'systems' must be a list of {len(prompts)} strings or nulls (one per sample), or absent")
    return prompts, completions, systems


class BodyTooLarge(ValueError):
    """A request body over the server's limit."""


async def read_capped(request: Any, limit: int) -> bytes:
    """The body of a starlette `request`, read in chunks; BodyTooLarge as soon as it passes `limit` bytes, by its
    Content-Length before anything is read (a client may still lie about it: the count of what arrives decides)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"a body of {int(declared)} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"a body of more than {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def warn_past_context(score: ScoreFn, tokenizer: Any, *, context: int | None, chat: bool) -> ScoreFn:
    """`score`, which also warns, once, when a request holds a sample that renders (encode_for_scoring) to more
    than `context` tokens (the reward model's max_position_embeddings; None: no check). Only requests up to that
    warning are tokenized a second time for the check (the forward costs far more)."""
    from trainer.rewards.model import encode_for_scoring

    warned = threading.Event()

    def checked(prompts: list[str], completions: list[str], systems: list[str | None]) -> list[float]:
        if context is not None and not warned.is_set():
            lengths = [len(encode_for_scoring(tokenizer, p, c, system=s, chat=chat))
                       for p, c, s in zip(prompts, completions, systems)]
            longer = [n for n in lengths if n > context]
            if longer:
                warned.set()
                warnings.warn(f"reward server: {len(longer)} of {len(lengths)} samples of a request render to more "
                              f"tokens than the reward model's context ({max(longer)} > {context}, its "
                              f"max_position_embeddings): they are scored past the positions it was trained on, "
                              f"so their scores mean little (or its forward fails); start the server with "
                              f"--max-length {context} to keep the last {context} tokens of such samples. Warned "
                              f"once: later requests are not checked", stacklevel=2)
        return score(prompts, completions, systems)

    return checked


def build_app(score: ScoreFn, *, model: str = "", api_key: str | None = None,
              max_body_bytes: int = MAX_BODY_BYTES) -> Any:
    """The starlette app serving `score(prompts, completions, systems) -> scores` at /score, and /health; a /score
    body over `max_body_bytes` is refused (413)."""
    import anyio
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from engines.embedded.server import ApiKeyMiddleware

    lock = threading.Lock()  # one forward at a time: concurrent ones would only fight over the same cores

    def run(prompts: list[str], completions: list[str], systems: list[str | None]) -> list[float]:
        with lock:
            return score(prompts, completions, systems)

    async def health(_: Request) -> JSONResponse:
        return JSONResponse({"status": "ok", "model": model})

    async def score_route(request: Request) -> JSONResponse:
        try:
            body = await read_capped(request, max_body_bytes)
        except BodyTooLarge as e:
            return JSONResponse({"error": f"{e} is over this server's limit of {max_body_bytes} bytes "
                                          f"({max_body_bytes / 2**20:g} MiB, --max-body-mb); send fewer samples per "
                                          f"request"}, status_code=413)
        try:
            parsed = parse_request(json.loads(body or b"null"))
        except ValueError as e:  # json.JSONDecodeError is a ValueError
            return JSONResponse({"error": f"bad /score request: {e}"}, status_code=400)
        try:
            scores = await anyio.to_thread.run_sync(run, *parsed)
        except Exception as e:  # noqa: BLE001 - reported to the client, the server stays up
            return JSONResponse({"error": f"{type(e).__name__}: {e}"}, status_code=500)
        if not all(math.isfinite(x) for x in scores):
            return JSONResponse({"error": f"the reward model gave non-finite scores {scores[:8]}"}, status_code=500)
        return JSONResponse({"scores": scores})

    app = Starlette(routes=[Route("/health", health, methods=["GET"]),
                            Route("/score", score_route, methods=["POST"])])
    return ApiKeyMiddleware(app, api_key) if api_key else app


def main(argv: Sequence[str] | None = None) -> None:
    from engines.embedded.__main__ import check_exposure, resolve_api_key
    from engines.embedded.launch import API_KEY_ENV, PARENT_ENV, die_with_parent

    ap = argparse.ArgumentParser(prog="python -m trainer.rewards.server", description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="the reward model's folder (a sequence classifier, num_labels=1)")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    ap.add_argument("--api-key-file", default=None, help="require the key on the first line of this file (mode 600)")
    ap.add_argument("--allow-no-key", action="store_true", help="serve a non-loopback --host without a key")
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                    help="default: float32 on CPU, bfloat16 on CUDA")
    ap.add_argument("--batch-size", type=int, default=16, help="samples per forward (sorted by length)")
    ap.add_argument("--max-length", type=int, default=None, help="keep the last N tokens of a longer rendering")
    ap.add_argument("--no-chat", action="store_true", help="score the plain text prompt + completion")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    ap.add_argument("--max-body-mb", type=float, default=MAX_BODY_BYTES / 2**20,
                    help="refuse a /score body larger than this (413); the body is held in memory while it is scored")
    die_with_parent(os.environ.pop(PARENT_ENV, None))  # started by a test or a run: end with it
    args = ap.parse_args(argv)
    api_key = resolve_api_key(None, args.api_key_file, dict(os.environ))
    os.environ.pop(API_KEY_ENV, None)
    check_exposure(args.host, api_key, args.allow_no_key)  # before the model load

    import torch
    import uvicorn

    from trainer.rewards.model import load_reward_model, score_samples

    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = load_reward_model(args.model, device=device,
                                         dtype=getattr(torch, args.dtype) if args.dtype else None)

    def score(prompts: list[str], completions: list[str], systems: list[str | None]) -> list[float]:
        return score_samples(model, tokenizer, prompts, completions, system=systems, batch_size=args.batch_size,
                             max_length=args.max_length, chat=not args.no_chat)

    context = model.config.get_text_config().max_position_embeddings
    if args.max_length is not None and context is not None and args.max_length <= context:
        context = None  # --max-length already keeps every rendering within it
    app = build_app(warn_past_context(score, tokenizer, context=context, chat=not args.no_chat), model=args.model,
                    api_key=api_key, max_body_bytes=int(args.max_body_mb * 2**20))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=1)


if __name__ == "__main__":
    main()
