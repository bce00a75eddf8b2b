"""`python -m trainer serve --config <file>`: the Tinker API over this project's LoRA backend and embedded engine.

The official `tinker` SDK (0.38) points `tinker.ServiceClient(base_url="http://HOST:PORT", api_key="tml-...")` at
it. Routes: the SDK's own paths under /api/v1 (ROUTES below); anything else answers 404 naming the route.
Training requests queue work on the client's base model (trainer/backend/protocol.py) and answer a request id at
once; the SDK polls /api/v1/retrieve_future, which waits up to RETRIEVE_WAIT_S for the result, then answers
"try_again" (the SDK polls again at once). Errors: a failed future is {"error", "category"} (the SDK raises
RequestFailedError with the cause); a bad route-level request is an HTTP 4xx with {"error", "detail"}.

    [serve]
    host = "127.0.0.1"           # a non-loopback host needs an api_key
    port = 8000                  # 0: any free port (the line "serving on http://HOST:PORT" names it)
    api_key = "tml-..."          # or the environment variable RLKERNELS_API_KEY; the SDK sends it as X-API-Key
    output_dir = "tinker_out"    # checkpoints: tinker://<model_id>/<weights | sampler_weights>/<name>
    max_clients = 8              # training clients (LoRA adapters) at once
    device = "cpu"               # or "cuda"
    models = [{name = "tiny", path = "<HF folder>"}]

The same file may hold the run config's `seed`, `[trainer]` (param_dtype, logprob_chunk_tokens) and `[engines]` (one
in-process engine: fleet = [{kind = "local"}], threads, prefix_cache_tokens, speculative_tokens, dtype, cuda_graphs,
kv_cache_tokens); they are validated as in runs (trainer/config.py) and any other key is refused (READS).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import subprocess
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engines.registry import engine_kind, kinds_where
from trainer.config import ConfigError, RunConfig, config_from_dict
from trainer.serve import handlers
from trainer.serve.clients import Service, UserError

API_KEY_ENV = "RLKERNELS_API_KEY"
RETRIEVE_WAIT_S = 20.0  # a retrieve_future long-polls this long before "try_again"


# What the service reads of a run file beside [serve]; any other key would be silently ignored, so it is refused.
# The service trains LoRA adapters eagerly on one device (no torch.compile, FSDP, Liger, core pinning, remote
# backend) and samples through one in-process engine that takes adapters as tensors (no weight-sync group, no disk).
READS = {"": ("seed", "serve", "trainer", "engines"),
         "trainer": ("param_dtype", "logprob_chunk_tokens"),
         "engines": ("fleet", "in_process", "threads", "prefix_cache_tokens", "speculative_tokens", "dtype",
                     "cuda_graphs", "kv_cache_tokens")}


def load_serve_config(path: str | os.PathLike, environ: dict | None = None, overrides: Sequence[str] = ()
                      ) -> RunConfig:
    """The serve file as a RunConfig, validated by the runs' one path (trainer.config.config_from_dict: [serve] is
    ServeConfig, [trainer] BackendConfig, [engines] EnginesConfig), plus what only the service needs: a [serve]
    table with base models whose folders exist, the key from RLKERNELS_API_KEY, no non-loopback host without a
    key, one in-process engine, and no key the service would ignore. overrides: `--set key=value` pairs, applied
    over the file as for runs. Errors are ConfigErrors naming the key."""
    from trainer.config_reference import merge, override_value, parse_overrides

    environ = dict(os.environ) if environ is None else environ
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from e
    try:  # each --set key and value checked here, so that its errors name --set, not the file
        raw = merge(raw, parse_overrides(overrides, convert=override_value))
    except ValueError as e:
        raise ConfigError(str(e)) from e
    if not isinstance(raw.get("serve"), dict):
        raise ConfigError(f"{path}: no [serve] table (host, port, api_key, output_dir, max_clients, device, models)")
    engines = raw.get("engines", {})
    if isinstance(engines, dict) and not {"fleet", "in_process"} & set(engines):
        engines = {**engines, "in_process": True}  # the default here: one engine in the server's process
    try:
        cfg = config_from_dict(RunConfig, {**raw, "engines": engines, "name": path.stem}, "")
    except ValueError as e:
        raise ConfigError(f"{path}: {e}") from e
    for table, keys in READS.items():
        unread = sorted(set(raw if not table else raw.get(table, {})) - set(keys))
        if unread:
            where, reads = (f"[{table}] {unread[0]}", f"of [{table}] it reads {', '.join(keys)}") if table else (
                f"{unread[0]!r} at the top level", "it reads seed, [serve], [trainer] and [engines]")
            raise ConfigError(f"{path}: {where}: python -m trainer serve does not use it ({reads}); drop it")
    serve = cfg.serve
    if not serve.models:
        raise ConfigError(f"{path}: [serve] models: give a non-empty list of {{name = \"...\", path = \"<HF "
                          f"folder>\"}} tables (the base models it offers)")
    for m in serve.models:
        if not (Path(m.path) / "config.json").is_file():
            raise ConfigError(f"{path}: [serve] models: {m.name!r} path {m.path!r} is not a Hugging Face folder (no "
                              f"config.json)")
    fleet = cfg.engines.fleet
    if len(fleet) != 1 or not engine_kind(fleet[0]).in_process:
        raise ConfigError(f"{path}: [engines] fleet = {[s.kind for s in fleet]}: the service samples through one "
                          f"engine in its own process that takes adapters as tensors (kind "
                          f"{' or '.join(repr(k) for k in kinds_where(lambda k: k.in_process))}); give fleet = "
                          f"[{{kind = \"local\"}}] or leave fleet out")
    key = serve.api_key or environ.get(API_KEY_ENV) or None
    from engines.embedded.__main__ import is_loopback

    if key is None and not is_loopback(serve.host):
        raise ConfigError(f"{path}: [serve] host = {serve.host!r} is reachable from other machines and no API key is "
                          f"set: anyone could train on this server; set [serve] api_key or {API_KEY_ENV}")
    return dataclasses.replace(cfg, serve=dataclasses.replace(serve, api_key=key))


# ---------------------------------------------------------------------------------------------------------
# HTTP
# ---------------------------------------------------------------------------------------------------------


def error_response(message: str, status: int, category: str = "user") -> JSONResponse:
    return JSONResponse({"error": message, "detail": message, "category": category}, status_code=status)


async def retrieve_future(service: Service, body: dict) -> Response:
    """The SDK's polling: the result (JSON, or protobuf for ForwardBackwardOutput / SampleResponse), a failure
    {"error", "category"}, or {"type": "try_again"} after RETRIEVE_WAIT_S."""
    request_id = body.get("request_id")
    entry = service.futures.get(request_id)
    if entry is None:
        raise UserError(f"unknown request_id {request_id!r} (futures live as long as the server)", status=404)
    try:
        await asyncio.wait_for(asyncio.shield(entry.task), RETRIEVE_WAIT_S)
    except TimeoutError:
        return JSONResponse({"type": "try_again", "request_id": request_id, "queue_state": "active"})
    except BaseException:  # noqa: BLE001 - the task's own failure, read below
        pass
    if entry.task.cancelled():
        return JSONResponse({"error": "cancelled: the server is shutting down", "category": "server"})
    exc = entry.task.exception()
    if exc is not None:
        user = isinstance(exc, UserError | ValueError | FileNotFoundError | KeyError)
        return JSONResponse({"error": f"{type(exc).__name__}: {exc}", "category": "user" if user else "server"})
    kind, payload = entry.task.result()
    if kind == "proto":
        return Response(payload, media_type="application/x-protobuf")
    return JSONResponse(payload)


def _endpoint(service: Service, fn: Callable, raw: bool) -> Callable:
    async def endpoint(request: Request) -> Response:
        try:
            if raw:
                out = await fn(service, request)
            else:
                body = await request.json() if request.method == "POST" else dict(request.query_params)
                out = await fn(service, {**(body or {}), **request.path_params})
        except UserError as e:
            return error_response(str(e), e.status)
        except (ValueError, KeyError, TypeError) as e:  # a malformed body: the caller's to fix
            return error_response(f"{request.url.path}: bad request: {type(e).__name__}: {e}", 400)
        except Exception as e:  # noqa: BLE001 - a server fault, said in the SDK's error shape (it retries 5xx)
            return error_response(f"{request.url.path}: server error: {type(e).__name__}: {e}", 500, "server")
        return out if isinstance(out, Response) else JSONResponse(out)
    return endpoint


async def not_found(request: Request, exc: Exception) -> Response:
    return error_response(f"no route {request.method} {request.url.path} on this Tinker-API server (trainer serve)",
                          404)


def build_app(service: Service, api_key: str | None = None) -> Starlette:
    routes = [Route(path, _endpoint(service, fn, raw), methods=[method])
              for method, path, fn, raw in handlers.ROUTES]
    routes.append(Route("/api/v1/retrieve_future", _endpoint(service, retrieve_future, False), methods=["POST"]))
    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        service.close()  # queued work cancelled: its futures answer an error; checkpoints stay

    app = Starlette(routes=routes, exception_handlers={404: not_found, 405: not_found}, lifespan=lifespan)
    return ApiKey(app, api_key) if api_key else app


class ApiKey:
    """ASGI wrapper: with a key set, every request needs it as `X-API-Key` (the SDK's header) or a Bearer token."""

    def __init__(self, app, api_key: str):
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope, receive, send):
        import secrets

        if scope["type"] == "http":
            headers = dict(scope["headers"])
            got = headers.get(b"x-api-key") or headers.get(b"authorization", b"").removeprefix(b"Bearer ")
            if not secrets.compare_digest(got, self.key):
                resp = error_response("missing or wrong API key: pass api_key= to tinker.ServiceClient "
                                      "(or TINKER_API_KEY)", 401)
                return await resp(scope, receive, send)
        return await self.app(scope, receive, send)


# ---------------------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------------------


def build_service(cfg: RunConfig) -> Service:
    """The service of a checked serve config: base models in [trainer] param_dtype (None: bfloat16 on CUDA, float32
    on CPU, as in runs), log-probs in [trainer] logprob_chunk_tokens chunks, and per base model one engine of the
    [engines] fleet's kind in this process ([engines] threads, prefix_cache_tokens; dtype, None: the trainer's)."""
    import torch

    from engines.protocol import TensorAdapterEngine
    from engines.registry import build_engine

    serve, engines = cfg.serve, cfg.engines
    dtype = cfg.trainer.param_dtype or ("bfloat16" if serve.device.startswith("cuda") else "float32")

    def engine(path: str) -> TensorAdapterEngine:  # the trainer's dtype by default: the sampler's log-probs are its own
        built = build_engine(engines.fleet[0], model_folder=path, seed=cfg.seed, device=serve.device,
                             threads=engines.threads, prefix_cache_tokens=engines.prefix_cache_tokens,
                             speculative_tokens=engines.speculative_tokens, dtype=engines.dtype or dtype,
                             cuda_graphs=engines.cuda_graphs, kv_cache_tokens=engines.kv_cache_tokens)
        assert isinstance(built, TensorAdapterEngine), f"{built!r} takes no adapter tensors (load_serve_config checks)"
        return built

    return Service({m.name: m.path for m in serve.models}, serve.output_dir, max_clients=serve.max_clients,
                   device=serve.device, dtype=getattr(torch, dtype), chunk_tokens=cfg.trainer.logprob_chunk_tokens,
                   engine_factory=engine)


STOP_DRAIN_S = 3.0  # after SIGINT / SIGTERM: how long failed futures are still answered before the server exits


def serve(cfg: RunConfig) -> int:
    """Serve until SIGINT / SIGTERM: the futures not yet finished answer an error (a training request running on
    the worker finishes there first), in-flight HTTP requests get up to 2 s to finish, checkpoints stay on disk.
    Prints the address once it listens."""
    import socket

    import uvicorn

    sock = socket.socket(socket.AF_INET6 if ":" in cfg.serve.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((cfg.serve.host, cfg.serve.port))
    host, port = sock.getsockname()[:2]
    service = build_service(cfg)
    app = build_app(service, cfg.serve.api_key)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    # uvicorn's own handlers re-raise the signal once it has shut down (exit 130 / 143): a requested stop of a
    # server is its normal end, so the signals only ask it to exit (exit 0).
    server.capture_signals = contextlib.nullcontext

    async def run() -> None:
        loop = asyncio.get_running_loop()

        def stop() -> None:
            # First the work: every unfinished future fails now, and the server keeps answering for STOP_DRAIN_S so
            # that every SDK poll, the ones in flight and the ones between two polls, gets that error (a poll that
            # meets a closed port is retried by the SDK for ever); then it exits.
            service.stop_work()
            loop.call_later(STOP_DRAIN_S, setattr, server, "should_exit", True)

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop)

        async def announce() -> None:
            while not server.started:
                await asyncio.sleep(0.02)
            print(f"serving on http://{host if ':' not in host else f'[{host}]'}:{port}", flush=True)
        task = asyncio.ensure_future(announce())
        await server.serve(sockets=[sock])
        task.cancel()

    asyncio.run(run())
    return 0


def main(config_path: str, overrides: Sequence[str] = ()) -> int:
    import sys

    try:
        cfg = load_serve_config(config_path, overrides=overrides)
    except (ValueError, OSError) as e:  # ConfigError (names the key) or an unreadable file: nothing is written
        print(f"error: {e}", file=sys.stderr)
        return 2
    if cfg.serve.api_key is not None and not cfg.serve.api_key.startswith("tml-"):
        print("warning: the tinker SDK refuses API keys that do not start with 'tml-': its clients cannot send "
              "this one", file=sys.stderr)
    return serve(cfg)



def start_subprocess(config_path: str | os.PathLike, *, env: dict | None = None, timeout_s: float = 180.0,
                     argv: list[str] | None = None) -> tuple[subprocess.Popen, str]:
    """`python -m trainer serve --config <config_path>` as a child process (tests, benchmarks): (process, base
    URL) once it prints its address. Stop it with SIGINT or SIGTERM (exit 0). argv: another command that serves
    the same way (a benchmark's instrumented server)."""
    import sys
    import time

    root = Path(__file__).resolve().parents[2]
    # TRITON_INTERPRET=0: the embedded engine's kernels take their device's production path, never the Triton
    # interpreter a test process turns on for itself (as engines.embedded.launch.engine_env does for engines).
    env = {**(os.environ if env is None else env), "TRITON_INTERPRET": "0"}
    argv = argv or [sys.executable, "-m", "trainer", "serve", "--config", str(config_path)]
    proc = subprocess.Popen(argv, cwd=root,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline, lines = time.monotonic() + timeout_s, []
    while time.monotonic() < deadline:  # readline blocks: the deadline bounds a server that prints and hangs
        line = proc.stdout.readline()
        lines.append(line)
        if line.startswith("serving on "):
            _drain(proc)
            return proc, line.split()[-1]
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError(f"python -m trainer serve did not start (exit {proc.poll()}):\n{''.join(lines)[-3000:]}")


def _drain(proc: subprocess.Popen) -> None:
    """Read the child's output from now on (a full pipe would block it), its last 200 lines as `proc.tail`."""
    import collections
    import threading

    proc.tail = collections.deque(maxlen=200)
    threading.Thread(target=lambda: proc.tail.extend(iter(proc.stdout.readline, "")), daemon=True).start()
