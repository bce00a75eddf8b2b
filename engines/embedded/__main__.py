"""`python -m engines.embedded --model PATH|tiny --port N [--host 127.0.0.1] [--api-key KEY] [--seed S]`."""

from __future__ import annotations

import argparse

import torch
import uvicorn

from engines.embedded.presets import load_engine_model
from engines.embedded.server import EngineServer, build_app

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m engines.embedded", description=__doc__)
    ap.add_argument("--model", required=True, help="'tiny' (random preset, project tokenizer) or a HF model folder")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    ap.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every endpoint")
    ap.add_argument("--seed", type=int, default=0, help="seed of the tiny preset's weights and of unseeded sampling")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    ap.add_argument("--max-batch-rows", type=int, default=256, help="rows merged into one generation batch")
    ap.add_argument("--no-compile", action="store_true", help="do not torch.compile the decode step on CUDA")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_engine_model(args.model, seed=args.seed, dtype=DTYPES.get(args.dtype), device=args.device)
    server = EngineServer(model, tok, model_path=args.model, seed=args.seed, max_batch_rows=args.max_batch_rows,
                          compile_decode=False if args.no_compile else None)
    app = build_app(server, api_key=args.api_key)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=1)


if __name__ == "__main__":
    main()
