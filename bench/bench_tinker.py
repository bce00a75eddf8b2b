"""The Tinker API's overhead (issue 39 item 6): the same batches through the tinker SDK against `python -m trainer
serve` on loopback vs the in-process TrainingBackend (trainer/backend/protocol.py), and sampling throughput
through the SDK vs the embedded engine called in process.

    make bench                               (pytest-benchmark smoke at small sizes; extra_info holds the figures)
    .venv/bin/python bench/bench_tinker.py   (the demo's RL batch: 64 prompts x 8 samples, the demo's model;
                                              a table and bench/results/tinker_<device>.json)

Figures (medians over `repeats` rounds after one warm-up, with their spread):
- step_s: forward_backward (importance_sampling) + optim_step, submitted back to back, both results read;
- overhead: the median over rounds of sdk / in-process - 1 for the round's two steps (goal <= 10 % at the demo's
  batch), and its range over rounds;
- round_trip_over_server_compute: per SDK step, its wall time / the server's own forward_backward + optim_step time
  on its worker - 1 (the server is started with those two timed, timed_server): what the API adds, measured on
  the same steps;
- sample_tok_s: completion tokens per second of `prompts` x n samples (SDK: one asample per prompt, all in flight;
  in process: one engine.generate of every prompt).
The two sides run in turn, the order flipped each round (A B, B A, ...), so that both see the same machine load;
the server is its own process. load_avg: the machine's 1-minute load before and after (a shared machine's noise).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEMO = {"samples": 512, "prompt": 20, "response": 6, "prompts": 64, "n": 8, "repeats": 8}
SMALL = {"samples": 16, "prompt": 8, "response": 4, "prompts": 4, "n": 2, "repeats": 2}
RANK = 32  # Tinker's default LoRA rank


def model_folder(root: Path) -> Path:
    """configs/demo.toml's model (qwen2, hidden 128, 2 layers, 4 heads, 2 KV heads), random, with a tokenizer."""
    from engines.embedded.presets import build_tiny_model
    from engines.tiny import build_tokenizer

    folder = root / "demo_model"
    build_tiny_model(0, arch="qwen2", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2).save_pretrained(
        folder)
    build_tokenizer().save_pretrained(folder)
    return folder


def rl_batch(size: dict, vocab: int, seed: int = 0) -> list[tuple[list[int], list[float], list[float]]]:
    """(tokens, sampling log-probs, advantages) per sample, the prompt's positions at advantage 0."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(size["samples"]):
        n = size["prompt"] + size["response"]
        toks = rng.integers(0, vocab, n).tolist()
        adv = [0.0] * (size["prompt"] - 1) + [float(rng.normal())] * size["response"]
        out.append((toks, (-rng.uniform(1, 6, n - 1)).tolist(), adv))
    return out


def _alternate(fns: dict, repeats: int) -> dict[str, list[float]]:
    """Seconds of each call of each function, called in turn after one warm-up call each, the order flipped every
    round (A B, B A, ...): on a shared machine both sides see the same load."""
    for fn in fns.values():
        fn()
    times = {k: [] for k in fns}
    for r in range(repeats):
        for k in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            t = time.perf_counter()
            fns[k]()
            times[k].append(time.perf_counter() - t)
    return times


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def local_side(folder: Path, batch, size: dict) -> tuple:
    """(train step, sample call, tokens a sample call asks for) of the in-process backend and engine."""
    import torch

    from engines.local import LocalEngine
    from engines.protocol import SamplingParams
    from trainer.backend.protocol import AdamParams, Datum, LocalLoraBackend, LoraBase, LoraSpec
    from trainer.serve.losses import LOSSES

    backend = LocalLoraBackend(LoraBase(folder), "bench", LoraSpec(rank=RANK), LOSSES, tempfile.mkdtemp())
    data = [Datum(torch.tensor(t[:-1]), {"target_tokens": torch.tensor(t[1:]), "logprobs": torch.tensor(lp),
                                         "advantages": torch.tensor(a)}) for t, lp, a in batch]

    def step():
        fb = backend.forward_backward(data, "importance_sampling")
        opt = backend.optim_step(AdamParams(learning_rate=1e-4))
        fb.result(), opt.result()

    engine = LocalEngine(str(folder), dtype=torch.float32, threads=1)
    prompts = [t[: size["prompt"]] for t, _, _ in batch[: size["prompts"]]]
    params = SamplingParams(max_new_tokens=size["response"], n=size["n"])
    counted = []

    def sample():
        out = asyncio.run(engine.generate(prompts, params))
        counted.append(sum(len(c.output_ids) for group in out for c in group))
    return step, sample, counted, engine


def sdk_side(url: str, batch, size: dict) -> tuple:
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=url, api_key="tml-bench")
    client = service.create_lora_training_client(base_model="demo", rank=RANK, seed=0).result()
    data = [types.Datum(model_input=types.ModelInput.from_ints(t[:-1]),
                        loss_fn_inputs={"target_tokens": t[1:], "logprobs": lp, "advantages": a})
            for t, lp, a in batch]

    def step():
        fb = client.forward_backward(data, "importance_sampling")
        opt = client.optim_step(types.AdamParams(learning_rate=1e-4))
        fb.result(), opt.result()

    sampler = service.create_sampling_client(base_model="demo").result()
    prompts = [types.ModelInput.from_ints(t[: size["prompt"]]) for t, _, _ in batch[: size["prompts"]]]
    params = types.SamplingParams(max_tokens=size["response"], temperature=1.0)
    counted = []

    def sample():  # one asample per prompt, all in flight (the engine batches them)
        futures = [sampler.sample(p, size["n"], params) for p in prompts]
        counted.append(sum(len(s.tokens) for f in futures for s in f.result().sequences))
    return step, sample, counted


def timed_server(config: str, log: str) -> int:
    """`python -m trainer serve` with each forward_backward and optim_step the worker runs timed into `log` (lines
    "run|opt START END"): the server's own compute of each SDK step. The round trip's cost is then measured on the
    same steps (SDK wall time - the server's compute), which a shared machine's load moves far less than the ratio
    of two processes' wall times."""
    from trainer.backend import protocol
    from trainer.serve import app

    out = open(log, "a", buffering=1)

    def timed(kind: str, fn):
        def run(*args, **kwargs):
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            out.write(f"{kind} {start} {time.perf_counter()}\n")
            return result
        return run

    cls = protocol.LocalLoraBackend
    cls._run, cls._optim_step = timed("run", cls._run), timed("opt", cls._optim_step)
    return app.main(config)


def _server_compute(log: Path) -> list[float]:
    """Seconds of forward_backward + optim_step on the server's worker, per SDK step, in order."""
    rows = [line.split() for line in log.read_text().splitlines()]
    runs = [float(b) - float(a) for kind, a, b in rows if kind == "run"]
    opts = [float(b) - float(a) for kind, a, b in rows if kind == "opt"]
    return [r + o for r, o in zip(runs, opts)]


def measure(size: dict) -> dict:
    from transformers import AutoConfig

    from trainer.serve.app import start_subprocess

    root = Path(tempfile.mkdtemp())
    folder = model_folder(root)
    batch = rl_batch(size, AutoConfig.from_pretrained(folder).vocab_size)
    config = root / "serve.toml"
    config.write_text(f'[serve]\nport = 0\noutput_dir = "{root / "out"}"\n'
                      f'models = [{{name = "demo", path = "{folder}"}}]\n')
    log = root / "server_compute.log"
    proc, url = start_subprocess(config, env={**os.environ, "RLKERNELS_API_KEY": "tml-bench"},
                                 argv=[sys.executable, os.path.abspath(__file__), "--timed-server", str(config),
                                       str(log)])
    load = [os.getloadavg()[0]]
    try:
        l_step, l_sample, l_count, engine = local_side(folder, batch, size)
        s_step, s_sample, s_count = sdk_side(url, batch, size)
        steps = _alternate({"in_process": l_step, "sdk": s_step}, size["repeats"])
        samples = _alternate({"in_process": l_sample, "sdk": s_sample}, size["repeats"])
        engine.close()
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    load.append(os.getloadavg()[0])
    ratios = [s / i - 1 for s, i in zip(steps["sdk"], steps["in_process"])]
    compute = _server_compute(log)[1:]  # the first is the warm-up's
    round_trip = [s / c - 1 for s, c in zip(steps["sdk"], compute)]
    tokens = {"in_process": statistics.median(l_count), "sdk": statistics.median(s_count)}
    return {"size": size, "step_s": {**{k: _spread(v) for k, v in steps.items()}, "server_compute": _spread(compute)},
            "overhead": _spread(ratios), "round_trip_over_server_compute": _spread(round_trip),
            "sample_tok_s": {k: _spread([tokens[k] / t for t in v]) for k, v in samples.items()},
            "load_avg": load}


def test_tinker_overhead(benchmark):
    figures = benchmark.pedantic(measure, args=(SMALL,), rounds=1, iterations=1)
    benchmark.extra_info.update(figures)
    assert figures["step_s"]["sdk"]["median"] > 0 and figures["sample_tok_s"]["in_process"]["median"] > 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--timed-server"]:
        sys.exit(timed_server(sys.argv[2], sys.argv[3]))
    import torch

    figures = measure(DEMO)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    figures.update(device=device, torch_threads=torch.get_num_threads(), cpus=os.cpu_count())
    print(json.dumps(figures, indent=1))
    out = Path(__file__).parent / "results" / f"tinker_{device}.json"
    out.write_text(json.dumps(figures, indent=1) + "\n")
    print(f"wrote {out}")
