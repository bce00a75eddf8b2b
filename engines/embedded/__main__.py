"""`python -m engines.embedded --model PATH|tiny --port N [--host 127.0.0.1] [--api-key-file F] [--seed S]`.

The API key (required on every route when set) comes from the environment variable RLKERNELS_ENGINE_API_KEY,
from `--api-key-file` (a file only you can read) or from `--api-key` (visible to every local user in `ps`: avoid).
An engine on an address other than loopback without a key is refused unless `--allow-no-key` says so.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import os
import signal
import stat
import sys

from engines.embedded.launch import API_KEY_ENV, PARENT_ENV, die_with_parent


def resolve_api_key(flag: str | None, file: str | None, environ: dict[str, str]) -> str | None:
    """The key from at most one source: `--api-key`, `--api-key-file` (its first line) or API_KEY_ENV."""
    sources = (("--api-key", flag), ("--api-key-file", file), (API_KEY_ENV, environ.get(API_KEY_ENV)))
    given = [name for name, v in sources if v]
    if len(given) > 1:
        raise SystemExit(f"error: the API key is given by {' and '.join(given)}; give it once (prefer "
                         f"{API_KEY_ENV} or --api-key-file: --api-key shows in `ps`)")
    if file:
        mode = os.stat(file).st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise SystemExit(f"error: --api-key-file {file} is readable by others (mode {stat.S_IMODE(mode):o}); "
                             f"chmod 600 it")
        with open(file) as f:
            key = f.readline().strip()
        if not key:
            raise SystemExit(f"error: --api-key-file {file} is empty; write the key on its first line")
        return key
    return flag or environ.get(API_KEY_ENV) or None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def check_exposure(host: str, api_key: str | None, allow_no_key: bool) -> None:
    """Refuse to serve a non-loopback address without a key: anyone who reaches it could swap the weights
    (/update_weights_from_disk) or stall the run (/pause_generation)."""
    if api_key is None and not allow_no_key and not is_loopback(host):
        raise SystemExit(f"error: --host {host} without an API key would let anyone who reaches this address "
                         f"replace the model's weights; set {API_KEY_ENV} (or --api-key-file), or pass "
                         f"--allow-no-key to serve it open on purpose")


def parse_cpus(text: str) -> list[int]:
    """"0,2" -> [0, 2]; an error naming the flag otherwise."""
    try:
        cpus = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        cpus = []
    if not cpus or min(cpus) < 0:
        raise SystemExit(f"--cpus {text!r}: give core numbers separated by commas, e.g. --cpus 0 or --cpus 0,2")
    return cpus


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m engines.embedded", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="'tiny' (random preset, project tokenizer) or a HF model folder")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    ap.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every endpoint (shows "
                                                    f"in `ps`: prefer {API_KEY_ENV} or --api-key-file)")
    ap.add_argument("--api-key-file", default=None, help="read the key from the first line of this file (mode 600)")
    ap.add_argument("--allow-no-key", action="store_true", help="serve a non-loopback --host without a key")
    ap.add_argument("--seed", type=int, default=0, help="seed of the tiny preset's weights and of unseeded sampling")
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                    help="default: float32 on CPU, bfloat16 on CUDA")
    ap.add_argument("--max-batch-rows", type=int, default=256, help="rows merged into one generation batch")
    ap.add_argument("--no-compile", action="store_true", help="do not torch.compile the decode step on CUDA")
    ap.add_argument("--kv-cache-tokens", type=int, default=None,
                    help="KV-cache cells the running rows may hold (default: unlimited on CPU, 40%% of the memory "
                         "free when a batch starts on CUDA)")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="decode steps as CUDA graphs, one per bucketed row count, instead of a compiled step")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    ap.add_argument("--prefix-cache-tokens", type=int, default=None,
                    help="KV budget in tokens of the prefix cache (finished rows' KV reused by prompts that start "
                         "with them, e.g. an episode's next turn; LRU); 0: off; default: the engine's")
    ap.add_argument("--speculative-tokens", type=int, default=0,
                    help="speculative decoding by n-gram lookup: up to this many draft tokens a row and step "
                         "(the tokens drawn are plain decoding's); 0: off")
    ap.add_argument("--cpus", default=None, help="pin the engine to these CPU cores, e.g. 0 or 0,2 (one thread each "
                                                 "unless --threads says otherwise)")
    parent = os.environ.pop(PARENT_ENV, None)
    die_with_parent(parent)  # started by a trainer: end with it, even on kill -9
    if parent is not None:  # and leave Ctrl-C and SIGTERM to it (serve's docstring), from the model's load on
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
    args = ap.parse_args(argv)
    if args.cpus:  # before torch starts its thread pools: they size themselves from the affinity
        cpus = parse_cpus(args.cpus)
        os.sched_setaffinity(0, cpus)
        args.threads = args.threads or len(cpus)
    api_key = resolve_api_key(args.api_key, args.api_key_file, dict(os.environ))
    os.environ.pop(API_KEY_ENV, None)  # not inherited by anything this process starts (compile workers)
    check_exposure(args.host, api_key, args.allow_no_key)  # before the slow imports and the model load
    if args.api_key:
        print(f"warning: --api-key shows in `ps` to every local user; use {API_KEY_ENV} or --api-key-file",
              file=sys.stderr)
    serve(args, api_key, owned=parent is not None)


def serve(args: argparse.Namespace, api_key: str | None, *, owned: bool = False) -> None:
    """Load the model and serve it until stopped. `owned` (a trainer started this engine): uvicorn does not install
    its SIGINT / SIGTERM handlers, which shut the server down (main ignores both signals then). A terminal's Ctrl-C
    and a scheduler's SIGTERM (Slurm, Kubernetes) reach the whole process group, and the engine must not shut down
    under the trainer, which checkpoints on them and then kills it (die_with_parent ends it should the trainer die
    instead)."""
    import gc

    import torch
    import uvicorn

    from engines.embedded.presets import load_engine_model
    from engines.embedded.server import EngineServer, build_app
    from kernels.device import tune_host_malloc

    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if torch.device(device).type == "cpu":  # its decode steps reuse the memory the last one freed (the docstring)
        tune_host_malloc()
    dtype = getattr(torch, args.dtype) if args.dtype else None
    model, tok = load_engine_model(args.model, seed=args.seed, dtype=dtype, device=device)
    server = EngineServer(model, tok, model_path=args.model, seed=args.seed, max_batch_rows=args.max_batch_rows,
                          compile_decode=False if args.no_compile else None,
                          speculative_tokens=args.speculative_tokens, cuda_graphs=args.cuda_graphs,
                          kv_cache_tokens=args.kv_cache_tokens,
                          **({} if args.prefix_cache_tokens is None else
                             {"prefix_cache_tokens": args.prefix_cache_tokens}))
    app = build_app(server, api_key=api_key)
    # The heap is what serving keeps for its whole life: out of the collector's full passes (~0.2 s each over the
    # ~400k objects of torch, transformers and the model; trainer/backend/heap.py has the measurement).
    gc.freeze()
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=1)
    server = uvicorn.Server(config)
    if owned:
        server.capture_signals = contextlib.nullcontext  # where uvicorn (>= 0.29) installs its shutdown handlers
    server.run()


if __name__ == "__main__":
    main()
