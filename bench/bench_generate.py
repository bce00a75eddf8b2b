"""Generation throughput: the embedded engine's batched KV-cache sampler vs plain `transformers` `generate`.

Same model (the engine's providers on a copy switched to the engine's attention, as the server serves it), same
prompts, same number of new tokens (no early stop: both produce exactly B x new tokens), greedy
and sampled. The engine runs three ways: its eager decode ("engine"), its decode as CUDA graphs ("engine-graphs",
[engines] cuda_graphs: on the CPU the same static step uncaptured) and, on CUDA, the torch.compile'd decode the
server uses there by default ("engine-compiled"; its compile is the warm-up round's). The figure is generated
tokens/s (extra_info["tokens_per_s"]); the ratio of providers in one run is what to compare. The engine's HTTP
layer is not timed here (tests/test_engine_server.py covers it). On a CUDA machine all run on the GPU (model,
prompts and the engine's cache; the clock stops after a device sync), otherwise on the CPU; extra_info["device"]
says which.

    .venv/bin/python -m pytest bench/bench_generate.py --benchmark-only      # full size
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from _bench_utils import plan_entry, skip_unless_fits

from engines.embedded.attention import use_engine_attention
from engines.embedded.generation import Row, generate_rows
from engines.embedded.graphs import GraphDecode
from engines.embedded.presets import build_tiny_model
from kernels import use_backend

SMOKE = dict(hidden_size=64, num_layers=2, batch=8, prompt=8, new=8)
FULL = dict(hidden_size=256, num_layers=4, batch=64, prompt=16, new=64)


def bench_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def case_bytes(size: dict) -> int:
    """Planned peak device bytes of either provider at `size` (fp32): the weights 4·P (P from a meta-device build
    of the config), the KV cache of B rows of prompt + new tokens (K and V, every layer: 2·B·S·layers·kv_width·4;
    doubled for a concatenating cache's copy), and fp32 logits of every position at the prefill, 4·B·S·vocab."""
    from transformers import AutoModelForCausalLM

    from engines.tiny import tiny_model_config

    cfg = tiny_model_config("qwen2", hidden_size=size["hidden_size"], num_layers=size["num_layers"],
                            max_position_embeddings=512)
    with torch.device("meta"):
        n_params = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
    rows, seq = size["batch"], size["prompt"] + size["new"]
    kv_width = cfg.num_key_value_heads * cfg.hidden_size // cfg.num_attention_heads
    return 4 * n_params + 2 * (2 * rows * seq * cfg.num_hidden_layers * kv_width * 4) + 4 * rows * seq * cfg.vocab_size


def planned_cases(memory_bytes: float) -> list[dict]:
    """Every case this file runs on a GPU (FULL), with its planned bytes against `memory_bytes`."""
    nbytes = case_bytes(FULL)
    return [plan_entry(f"test_generate_throughput[{p}-{t}]", nbytes, memory_bytes)
            for t in ("greedy", "sampled") for p in PROVIDERS]


def build_setup(size: dict, device: str):
    """(model, prompts [B, P], size) on `device`: the model in eval mode, prompts from a fixed seed."""
    model = build_tiny_model(0, arch="qwen2", hidden_size=size["hidden_size"], num_layers=size["num_layers"],
                             max_position_embeddings=512).to(device)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(6, 100, (size["batch"], size["prompt"]), generator=g).to(device)
    return model, prompts, size


@pytest.fixture(scope="module")
def setup(request):
    if bench_device() == "cuda":
        skip_unless_fits(case_bytes(SMOKE if request.config.getoption("benchmark_disable") else FULL))
    return build_setup(SMOKE if request.config.getoption("benchmark_disable") else FULL, bench_device())


def _synced(fn):
    """fn, then a device sync before it returns (so the benchmark's clock stops after the GPU's work)."""
    def run(*args):
        n = fn(*args)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return n

    return run


def _engine(model, prompts, new, temperature, **decode):
    """decode: generate_rows' decode_fn or graphs (the other engine providers)."""
    rows = [Row(prompt=tuple(p.tolist()), temperature=temperature, top_p=1.0, top_k=-1, max_new_tokens=new,
                stop_ids=frozenset(), seed=i) for i, p in enumerate(prompts)]
    with torch.inference_mode():
        out = generate_rows(model, rows, pad_id=0, **decode)
    return sum(len(r.output_ids) for r in out)


def _hf(model, prompts, new, temperature):
    kw = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else dict(
        do_sample=False)
    with torch.no_grad():
        out = model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new,
                             min_new_tokens=new, pad_token_id=0, eos_token_id=None, **kw)
    return (out.shape[1] - prompts.shape[1]) * out.shape[0]


PROVIDERS = ("engine", "engine-graphs", "engine-compiled", "transformers")
_DECODERS: dict = {}  # per model: the graphs (captured once, replayed by every round) and the compiled forward


def _engine_model(model):
    """The model as the engine serves it (engines/embedded/presets.py): a copy switched to the engine's attention
    (engines/embedded/attention.py), so that the transformers provider keeps transformers' sdpa."""
    twin = _DECODERS.get((id(model), "engine-model"))
    if twin is None:
        twin = _DECODERS[id(model), "engine-model"] = copy.deepcopy(model)
        use_engine_attention(twin)
    return twin


def _provider(provider: str, model):
    """The provider's function of (model, prompts, new, temperature): the engine's on its engine-served copy."""
    if provider == "transformers":
        return _hf
    served = _engine_model(model)
    if provider == "engine-graphs":
        graphs = _DECODERS.setdefault((id(model), provider), GraphDecode(served, pad_id=0))
        return lambda m, *a: _engine(served, *a, graphs=graphs)
    if provider == "engine-compiled":
        compiled = _DECODERS.setdefault((id(model), provider), torch.compile(served.forward, dynamic=True))
        return lambda m, *a: _engine(served, *a, decode_fn=compiled)
    return lambda m, *a: _engine(served, *a)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_generate_throughput(benchmark, setup, provider, temperature):
    model, prompts, size = setup
    if provider == "engine-compiled" and prompts.device.type != "cuda":
        pytest.skip("the compiled decode is the server's CUDA default; on the CPU the engine decodes eagerly")
    fn = _synced(_provider(provider, model))
    device = prompts.device.type
    # On CPU the torch kernels (conftest sets the Triton interpreter there); on CUDA the device's own choice.
    with use_backend("torch") if device == "cpu" else contextlib.nullcontext():
        n = benchmark.pedantic(fn, args=(model, prompts, size["new"], temperature), rounds=3, iterations=1,
                               warmup_rounds=1)
    assert n == size["batch"] * size["new"]  # both providers produce exactly the same amount of work
    if benchmark.stats is not None:
        benchmark.extra_info["tokens_per_s"] = n / benchmark.stats.stats.median
    benchmark.extra_info.update(batch=size["batch"], new_tokens=size["new"], hidden=size["hidden_size"],
                                device=device)
