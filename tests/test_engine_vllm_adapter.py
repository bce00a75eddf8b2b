"""The vLLM adapter against a loopback server that records every request and checks it against the vLLM v0.25.0
schema documented in engines/vllm.py (vLLM itself cannot run here)."""

import json
import threading
import time

import pytest
import torch
import trio
import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from engines.embedded.launch import free_port
from engines.protocol import InferenceEngine, SamplingParams
from engines.vllm import VLLMEngine
from engines.weight_sync import plan_buckets

# route -> {field: allowed python types}; every listed field is required, no other field is allowed
SCHEMA = {
    "/v1/completions": {"model": (str,), "prompt": (list,), "max_tokens": (int,), "temperature": (float, int),
                        "top_p": (float, int), "top_k": (int,), "n": (int,), "stop_token_ids": (list,),
                        "ignore_eos": (bool,), "logprobs": (int,), "return_token_ids": (bool,),
                        "return_tokens_as_token_ids": (bool,), "seed?": (int,)},
    "/init_weight_transfer_engine": {"init_info": (dict,)},
    "/start_weight_update": {},
    "/update_weights": {"update_info": (dict,)},
    "/finish_weight_update": {"weight_version": (str, type(None))},
    "/pause": {}, "/resume": {},
}
INIT_INFO = {"master_address": str, "master_port": int, "rank_offset": int, "world_size": int}
UPDATE_INFO = {"names": list, "dtype_names": list, "shapes": list, "packed": bool}


def check_schema(route: str, body: dict) -> list[str]:
    spec = SCHEMA[route]
    problems = []
    required = {k for k in spec if not k.endswith("?")}
    allowed = {k.rstrip("?") for k in spec}
    problems += [f"missing {k}" for k in required - set(body)]
    problems += [f"unexpected {k}" for k in set(body) - allowed]
    for k, v in body.items():
        types = spec.get(k, spec.get(k + "?"))
        if types and not isinstance(v, types):
            problems.append(f"{k} has type {type(v).__name__}")
    if route == "/init_weight_transfer_engine":
        info = body.get("init_info", {})
        problems += [f"init_info.{k}" for k, t in INIT_INFO.items() if not isinstance(info.get(k), t)]
        problems += [f"init_info extra {k}" for k in set(info) - set(INIT_INFO)]
    if route == "/update_weights":
        info = body.get("update_info", {})
        problems += [f"update_info.{k}" for k, t in UPDATE_INFO.items() if not isinstance(info.get(k), t)]
        n = len(info.get("names", []))
        if len(info.get("dtype_names", [])) != n or len(info.get("shapes", [])) != n:
            problems.append("update_info lists differ in length")
        if not all(hasattr(torch, d) for d in info.get("dtype_names", [])):
            problems.append("dtype_names must be torch attribute names")
    if route == "/v1/completions" and not all(isinstance(p, list) and all(isinstance(t, int) for t in p)
                                              for p in body.get("prompt", [])):
        problems.append("prompt must be a list of token-id lists")
    return problems


@pytest.fixture(scope="module")
def recorder():
    log = []

    async def handle(request):
        raw = await request.body()
        body = json.loads(raw) if raw else {}
        route = request.url.path
        log.append((route, body, check_schema(route, body)))
        if route == "/v1/completions":
            choices, k = [], 0
            for p in body["prompt"]:
                for j in range(body["n"]):
                    ids = [(p[-1] + j + t) % 50 for t in range(body["max_tokens"])]
                    choices.append({"index": k, "text": "", "finish_reason": "length", "token_ids": ids,
                                    "logprobs": {"tokens": [f"token_id:{t}" for t in ids],
                                                 "token_logprobs": [-0.5 - t / 100 for t in ids]}})
                    k += 1
            return JSONResponse({"id": "cmpl", "object": "text_completion", "choices": choices[::-1]})
        return JSONResponse({"message": "ok"})

    routes = [Route(r, handle, methods=["POST"]) for r in SCHEMA] + [Route("/health", handle, methods=["GET"])]
    SCHEMA["/health"] = {}
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(Starlette(routes=routes), host="127.0.0.1", port=port, log_level="error"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", log
    server.should_exit = True
    t.join(10)


def test_generate_maps_to_completions_and_parses_choices(recorder):
    url, log = recorder
    eng = VLLMEngine(url, "m")
    assert isinstance(eng, InferenceEngine)
    prompts = [[1, 2, 3], [7]]
    out = trio.run(eng.generate, prompts, SamplingParams(temperature=0.8, max_new_tokens=4, n=2, seed=9,
                                                         stop_token_ids=(2,)))
    route, body, problems = log[-1]
    assert route == "/v1/completions" and not problems, problems
    assert body["prompt"] == prompts and body["seed"] == 9 and body["stop_token_ids"] == [2]
    for i, p in enumerate(prompts):  # choices came back reversed: the adapter orders them by index
        for j, c in enumerate(out[i]):
            expect = [(p[-1] + j + t) % 50 for t in range(4)]
            assert c.output_ids == expect and c.logprobs == [-0.5 - t / 100 for t in expect]
            assert c.weight_version == 0 and c.finish_reason == "length"


def test_weight_transfer_sequence_matches_schema(recorder):
    url, log = recorder
    eng = VLLMEngine(url, "m")
    start = len(log)
    trio.run(lambda: eng.init_weights_update_group(master_address="10.0.0.1", master_port=29500, rank_offset=1,
                                                   world_size=3, group_name="g", backend="nccl"))
    meta = plan_buckets(["a.weight", "b.bias"], [(4, 3), (5,)], torch.bfloat16, 1 << 20)
    wire = meta.to_wire(weight_version=7, group_name="g")
    with pytest.raises(ValueError, match="per_tensor"):
        trio.run(eng.update_weights_from_distributed, wire)
    wire.update(load_format=None)
    trio.run(eng.update_weights_from_distributed, wire)
    trio.run(eng.pause_generation)
    trio.run(eng.continue_generation)
    calls = log[start:]
    assert [c[0] for c in calls] == ["/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
                                     "/finish_weight_update", "/pause", "/resume"]
    assert all(not c[2] for c in calls), [c for c in calls if c[2]]
    assert calls[0][1]["init_info"] == {"master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 1,
                                        "world_size": 3}
    info = calls[2][1]["update_info"]
    assert info["names"] == ["a.weight", "b.bias"] and info["dtype_names"] == ["bfloat16", "bfloat16"]
    assert info["shapes"] == [[4, 3], [5]] and info["packed"] is False
    assert calls[3][1] == {"weight_version": "7"}
    assert trio.run(eng.get_weight_version) == 7


def test_schema_checker_catches_bad_requests():
    assert check_schema("/update_weights", {"update_info": {"names": ["a"], "dtype_names": [], "shapes": [[1]],
                                                            "packed": False}})
    assert check_schema("/init_weight_transfer_engine", {"init_info": {"master_address": "x"}})
    assert check_schema("/v1/completions", {"model": "m"})
