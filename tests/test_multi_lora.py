"""Several LoRA adapters in one embedded engine (issue 38 item 4): one decode batch mixes rows of three adapters and
the base (a per-row gather at each adapted Linear, engines/embedded/lora.py), and every request's tokens and
log-probs equal a plain forward of the base with its adapter merged (PEFT's own merge_and_unload) within 1e-5 in
float32. Adapters are loaded, replaced and removed by name while requests run; an unknown name is a 404."""

from __future__ import annotations

import copy

import pytest
import torch
import trio
from engine_support import random_peft_adapter

from engines.embedded.lora import read_peft_folder
from engines.embedded.presets import build_tiny_model
from engines.local import LocalEngine
from engines.protocol import EngineError, SamplingParams
from engines.sglang import SGLangEngine, parse_generate

ENGINE_SEED = 5  # the `engine` fixture's tiny model (tests/conftest.py): the same weights as build_tiny_model(5)
PROMPTS = [[1, 20, 21, 22], [1, 40], [1, 7, 8, 9, 10, 11]]
TOL = 1e-5


def make_adapter(folder, seed: int, r: int, alpha: float, targets: list[str]):
    """A PEFT adapter of the tiny base with random A and B (B = 0 would be the base), saved to `folder`; returns
    the merged reference model (PEFT's merge_and_unload)."""
    pm = random_peft_adapter(build_tiny_model(ENGINE_SEED), folder, r=r, alpha=alpha, targets=targets, seed=seed)
    return copy.deepcopy(pm).merge_and_unload().eval()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """name -> (PEFT folder, merged reference model): three adapters of different ranks and targets."""
    root = tmp_path_factory.mktemp("adapters")
    specs = {"a": (11, 4, 8.0, ["q_proj", "v_proj"]),
             "b": (12, 8, 4.0, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
             "c": (13, 2, 2.0, ["down_proj", "up_proj"])}
    return {n: (root / n, make_adapter(root / n, *spec)) for n, spec in specs.items()}


@pytest.fixture(scope="module")
def local():
    eng = LocalEngine("tiny", seed=ENGINE_SEED)
    yield eng
    eng.close()


def reference_check(model, completion, temperature: float) -> None:
    """The completion's log-probs (and, greedy, its tokens) under `model` by one plain forward of prompt + output."""
    ids = completion.prompt_ids + completion.output_ids
    assert completion.output_ids, "nothing generated"
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, len(completion.prompt_ids) - 1:-1].double()
    lp = (logits / (temperature or 1.0)).log_softmax(-1)
    out = torch.tensor(completion.output_ids)
    want = lp.gather(-1, out[:, None])[:, 0]
    got = torch.tensor(completion.logprobs, dtype=torch.float64)
    assert (got - want).abs().max().item() <= TOL, f"log-probs differ by {(got - want).abs().max().item():.2e}"
    if temperature == 0:
        assert logits.argmax(-1).tolist() == completion.output_ids


def load_all(eng: LocalEngine, adapters) -> None:
    async def go():
        for name, (folder, _) in adapters.items():
            tensors, scaling = read_peft_folder(str(folder))
            await eng.load_adapter_tensors(name, tensors, scaling)

    trio.run(go)


def test_three_adapters_and_the_base_in_one_batch(local, adapters):
    """One /generate request whose rows name a, b, c and none, the same prompts under every adapter (so the
    prefill must not share a row across adapters), greedy and sampled: all decode in the same batch."""
    load_all(local, adapters)
    base = build_tiny_model(ENGINE_SEED)
    refs = {None: base, **{n: m for n, (_, m) in adapters.items()}}
    names = [None, "a", "b", "c"]
    prompts = [p for p in PROMPTS for _ in names]
    lora = [n for _ in PROMPTS for n in names]
    temps = [0.0 if i % 2 == 0 else 0.8 for i in range(len(prompts))]
    sps = [{"temperature": t, "max_new_tokens": 12, "n": 1, "sampling_seed": 100 + i, "ignore_eos": True}
           for i, t in enumerate(temps)]
    steps = local.server.steps
    body = {"input_ids": prompts, "sampling_params": sps, "return_logprob": True, "lora_path": lora}
    groups = parse_generate(trio.run(local._call, "POST", "/generate", body), prompts, 1)
    assert local.server.steps - steps == 12  # every row joined the first step and decoded in every one after
    for (c,), name, t in zip(groups, lora, temps):
        reference_check(refs[name], c, t)
    # The adapters matter: each one's greedy log-probs differ from the base's on the same prompt.
    for k, name in enumerate(names[1:], 1):
        assert groups[k][0].logprobs != groups[0][0].logprobs, f"adapter {name} changed nothing"


def test_generate_by_adapter_name_concurrently(local, adapters):
    """generate(adapter=...) from four concurrent callers (continuous batching mixes them), seeded n = 2."""
    load_all(local, adapters)
    refs = {None: build_tiny_model(ENGINE_SEED), **{n: m for n, (_, m) in adapters.items()}}
    params = SamplingParams(temperature=0.7, max_new_tokens=10, n=2, seed=3)
    out = {}

    async def go():
        async def one(name):
            out[name] = await local.generate(PROMPTS, params, adapter=name)

        async with trio.open_nursery() as nursery:
            for name in refs:
                nursery.start_soon(one, name)

    trio.run(go)
    for name, groups in out.items():
        for group in groups:
            for c in group:
                reference_check(refs[name], c, 0.7)


def test_load_replace_unload_while_requests_run(local, adapters):
    """Long requests of a and c run while a new adapter d is loaded, b is replaced by c's weights, and c is
    unloaded: a's and c's rows finish exactly as their references (d never takes c's slot while c's rows run),
    b answers with its new weights, and a request naming c after it is gone is a 404 naming the loaded ones."""
    load_all(local, adapters)
    refs = {n: m for n, (_, m) in adapters.items()}
    long = SamplingParams(temperature=0.0, max_new_tokens=60, ignore_eos=True)
    got: dict = {}
    server = local.server

    async def go():
        async def run(name):
            got[name] = await local.generate(PROMPTS, long, adapter=name)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "a")
            nursery.start_soon(run, "c")
            while server.num_running_rows < 2 * len(PROMPTS):
                await trio.sleep(0.001)
            steps = server.steps
            d_tensors, d_scale = read_peft_folder(str(adapters["a"][0]))
            await local.load_adapter_tensors("d", d_tensors, d_scale)
            c_tensors, c_scale = read_peft_folder(str(adapters["c"][0]))
            await local.load_adapter_tensors("b", c_tensors, c_scale)  # replace b in place
            await local.unload_adapter("c")
            assert server.num_running_rows and server.steps - steps < 50, "the rows finished before the changes"
            with pytest.raises(EngineError) as err:
                await local.generate(PROMPTS, long, adapter="c")
            assert err.value.status == 404 and "'c'" in str(err.value) and "['a', 'b', 'd']" in str(err.value)
            got["b"] = await local.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=8), adapter="b")
            got["d"] = await local.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=8), adapter="d")

    trio.run(go)
    for name, ref in (("a", refs["a"]), ("c", refs["c"]), ("b", refs["c"]), ("d", refs["a"])):
        for (c,) in got[name]:
            reference_check(ref, c, 0.0)
    assert sorted(server.adapters.names) == ["a", "b", "d"]
    trio.run(local.unload_adapter, "d")
    with pytest.raises(EngineError) as err:
        trio.run(local.unload_adapter, "d")
    assert err.value.status == 404


def test_bad_adapters_are_refused_before_any_change(local, adapters, tmp_path):
    tensors, scaling = read_peft_folder(str(adapters["a"][0]))
    key = next(k for k in tensors if k.endswith("lora_A.weight"))
    cases = [({**tensors, key.replace("q_proj", "nope_proj"): tensors[key]}, "not an nn.Linear"),
             ({k: v for k, v in tensors.items() if k != key}, "lora_B only"),
             ({**tensors, key: tensors[key][:, :5]}, "do not fit the Linear"),
             ({"model.layers.0.mlp.weight": tensors[key]}, "is not a LoRA weight")]
    for bad, words in cases:
        with pytest.raises(EngineError) as err:
            trio.run(local.load_adapter_tensors, "bad", bad, scaling)
        assert err.value.status == 400 and words in str(err.value)
    assert "bad" not in local.server.adapters.names
    with pytest.raises(EngineError) as err:  # over the SGLang route: not a PEFT folder
        trio.run(local.load_adapter, "bad", str(tmp_path))
    assert err.value.status == 400 and "adapter_config.json" in str(err.value)


def test_http_engine_loads_a_peft_folder(engine, adapters):
    """The embedded engine process over HTTP: SGLang's /load_lora_adapter from PEFT's folder, lora_path in
    /generate, the loaded names in /get_server_info, /unload_lora_adapter."""
    http = SGLangEngine(engine.url, timeout_s=60)
    folder, ref = adapters["b"]
    params = SamplingParams(temperature=0.0, max_new_tokens=10)

    async def go():
        await http.load_adapter("b", str(folder))
        info = await http.get_server_info()
        out = await http.generate(PROMPTS, params, adapter="b")
        await http.unload_adapter("b")
        with pytest.raises(EngineError) as err:
            await http.generate(PROMPTS, params, adapter="b")
        return info, out, err.value

    info, out, err = trio.run(go)
    assert info["lora_adapters"] == ["b"]
    for (c,) in out:
        reference_check(ref, c, 0.0)
    assert err.status == 404 and "'b'" in str(err)
