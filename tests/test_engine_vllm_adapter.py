"""The vLLM adapter's requests and parsing checked against vLLM 0.32's own code, without starting a model.

Every request `VLLMEngine` makes is recorded on a loopback server, then replayed inside `.venv-vllm` against
vLLM's real FastAPI routers (RL routes, cache routes, health) mounted on an app whose engine client only records
the calls it gets: vLLM's own route signatures validate our bodies and query strings, and the engine-client calls
they turn into are compared with what we meant. /v1/completions bodies are validated by vLLM's `CompletionRequest`
and turned into its `SamplingParams`; responses built with vLLM's `CompletionResponse` model are parsed by ours.
(tests/test_engine_vllm_real.py drives a real server end to end.)
"""

import json
import subprocess
import threading
import time

import pytest
import torch
import trio
import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route
from vllm_support import require_vllm_venv

from engines.embedded.launch import free_port
from engines.protocol import InferenceEngine, SamplingParams
from engines.vllm import VLLMEngine, completions_payload, parse_completions
from engines.weight_sync.wire import plan_buckets

# Runs in .venv-vllm, once per module (importing vLLM takes tens of seconds here): stdin {replay, completions,
# plugin} -> stdout {replay, completions, response, plugin}.
IN_VLLM = r'''
import dataclasses, json, sys, types
from fastapi import FastAPI
from fastapi.testclient import TestClient
import vllm.v1.engine.async_llm
from vllm.entrypoints.rl.online.api_router import router as rl_router
from vllm.entrypoints.serve.dev.cache.api_router import router as cache_router
from vllm.entrypoints.serve.dev.rpc.api_router import router as rpc_router
from vllm.entrypoints.serve.instrumentator.health import router as health_router
from vllm.entrypoints.openai.completion.protocol import (CompletionLogProbs, CompletionRequest, CompletionResponse,
                                                         CompletionResponseChoice)
from vllm.entrypoints.serve.engine.protocol import UsageInfo
from engines.vllm_ext.receiver import ProcessGroupInitInfo, ProcessGroupWeightTransferEngine

todo = json.loads(sys.stdin.read())
result = {}
calls = []
RETURNS = {"get_weight_version": "7", "is_paused": True, "reset_prefix_cache": True}

def plain(x):
    if dataclasses.is_dataclass(x):
        return dataclasses.asdict(x)
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    return x

class Recorder:
    vllm_config = types.SimpleNamespace(parallel_config=types.SimpleNamespace(world_size_across_dp=3, world_size=3))
    output_processor = types.SimpleNamespace(request_states={"cmpl-x-0": None}, parent_requests={})
    def __getattr__(self, name):
        async def call(*args, **kwargs):
            kw = {k: plain(v) for k, v in kwargs.items()}
            calls.append({"method": name, "args": plain(list(args)), "kwargs": kw})
            return RETURNS.get(name)
        return call

# vLLM's real routers on an app whose engine client records what the routes ask of it
vllm.v1.engine.async_llm.AsyncLLM = Recorder  # "abort all" checks that the engine client is an AsyncLLM
app = FastAPI()
for r in (rl_router, cache_router, rpc_router, health_router):
    app.include_router(r)
app.state.engine_client = Recorder()
client = TestClient(app)
result["replay"] = []
for req in todo["replay"]:
    del calls[:]
    r = client.request(req["method"], req["path"], params=req["query"] or None,
                       json=req["body"] if req["method"] == "POST" else None)
    result["replay"].append({"status": r.status_code, "answer": r.text, "calls": list(calls)})

# our /v1/completions body through vLLM's request model into its SamplingParams
body = CompletionRequest.model_validate(todo["completions"])
sp = body.to_sampling_params(max_tokens=body.max_tokens)
result["completions"] = {"sampling": {k: getattr(sp, k) for k in ("n", "temperature", "top_k", "top_p", "seed",
                         "logprobs", "max_tokens", "stop_token_ids", "ignore_eos")},
                         "request_id": body.request_id, "return_token_ids": body.return_token_ids}

# a response made by vLLM's own model: 2 prompts x n=2, choices out of order
choices = []
for k in (3, 1, 0, 2):
    ids = [10 + k, 20 + k, 30 + k]
    choices.append(CompletionResponseChoice(index=k, text="abc", token_ids=ids,
        finish_reason="length" if k else "abort",
        logprobs=CompletionLogProbs(token_logprobs=[-0.5 - k, -1.5, -2.5], tokens=["a", "b", "c"],
                                    text_offset=[0, 1, 2], top_logprobs=[None, None, None])))
result["response"] = json.loads(CompletionResponse(model="m", choices=choices,
                                 usage=UsageInfo(prompt_tokens=4, completion_tokens=12)).model_dump_json())

# what reaches the worker, parsed by our back end's own types
init, update = todo["plugin"]
info = ProcessGroupInitInfo(**init)
meta = ProcessGroupWeightTransferEngine.parse_update_info(None, update)
bad = []
for broken in ({**init, "backend": "mpi"}, {**init, "rank_offset": 0}):
    try:
        ProcessGroupInitInfo(**broken)
    except ValueError as e:
        bad.append(str(e))
result["plugin"] = [dataclasses.asdict(info), list(meta.names), list(meta.bucket_nbytes), bad]
print(json.dumps(result))
'''
COMPLETIONS_PARAMS = SamplingParams(temperature=0.7, max_new_tokens=5, n=3, seed=4, stop_token_ids=(2, 5),
                                    ignore_eos=True)


def run_in_vllm(code: str, payload=None):
    python = require_vllm_venv()
    r = subprocess.run([str(python), "-c", code], input=json.dumps(payload), capture_output=True, text=True,
                       timeout=600, cwd="/")
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def recorded():
    """Every request the adapter makes, as (method, path, query, body), answered like vLLM does."""
    log = []

    async def handle(request):
        raw = await request.body()
        log.append({"method": request.method, "path": request.url.path, "query": dict(request.query_params),
                    "body": json.loads(raw) if raw else None})
        if request.url.path == "/weight_info":
            return JSONResponse({"weight_version": "7"})
        if request.url.path == "/get_world_size":
            return JSONResponse({"world_size": 3})
        return JSONResponse({"status": "ok"})

    paths = ["/health", "/weight_info", "/get_world_size", "/pause", "/resume", "/abort_requests",
             "/reset_prefix_cache", "/update_weight_version", "/init_weight_transfer_engine", "/start_weight_update",
             "/update_weights", "/finish_weight_update", "/collective_rpc"]
    port = free_port()
    app = Starlette(routes=[Route(p, handle, methods=["GET", "POST"]) for p in paths])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)

    eng = VLLMEngine(f"http://127.0.0.1:{port}", "m")
    assert isinstance(eng, InferenceEngine)
    meta = plan_buckets(["model.embed_tokens.weight", "lm_head.weight"], [(6, 4), (6, 4)], torch.float32, 128)
    steps = {
        "health": lambda: eng.health(),
        "get_weight_version": lambda: eng.get_weight_version(),
        "world_size": lambda: eng.world_size(),
        "pause": lambda: eng.pause_generation(),
        "continue": lambda: eng.continue_generation(),
        "abort_all": lambda: eng.abort(),
        "flush": lambda: eng.flush_cache(),
        "set_version": lambda: eng.set_weight_version(9),
        "init": lambda: eng.init_weights_update_group(master_address="10.1.2.3", master_port=29555, rank_offset=2,
                                                      world_size=5, group_name="g7", backend="gloo", timeout_s=30),
        "update": lambda: eng.update_weights_from_distributed(meta.to_wire(weight_version=12, group_name="g7")),
        "disk": lambda: eng.update_weights_from_disk("/ckpt/step_3", weight_version=13),
    }
    results, spans = {}, {}
    for name, step in steps.items():
        start = len(log)
        results[name] = trio.run(step)
        spans[name] = (start, len(log))
    yield log, spans, results, meta, eng
    server.should_exit = True
    t.join(10)


@pytest.fixture(scope="module")
def in_vllm(recorded):
    log, spans = recorded[0], recorded[1]
    todo = {"replay": log, "completions": completions_payload("m", [[1, 2, 3], [4]], COMPLETIONS_PARAMS, "abc"),
            "plugin": [log[spans["init"][0]]["body"]["init_info"], log[spans["update"][0] + 1]["body"]["update_info"]]}
    return run_in_vllm(IN_VLLM, todo)


def test_control_requests_accepted_by_vllm_routes(recorded, in_vllm):
    log, spans, results, meta, eng = recorded
    replayed = in_vllm["replay"]
    assert results["get_weight_version"] == 7 and results["world_size"] == 3 and results["health"] is True
    assert eng.weight_version == 13  # set by the sync's finish_weight_update, then by the disk reload
    for req, ans in zip(log, replayed):
        assert ans["status"] == 200, (req, ans)

    def calls(name):
        start, end = spans[name]
        return [c for ans in replayed[start:end] for c in ans["calls"]]

    assert calls("pause") == [{"method": "pause_generation", "args": [], "kwargs": {"mode": "keep",
                                                                                    "clear_cache": True}}]
    assert [c["method"] for c in calls("continue")] == ["resume_generation"]
    assert [c["method"] for c in calls("flush")] == ["reset_prefix_cache"]
    assert calls("set_version") == [{"method": "update_weight_version", "args": ["9"], "kwargs": {}}]
    abort = calls("abort_all")
    assert abort == [{"method": "abort", "args": [["cmpl-x-0"]], "kwargs": {"internal": True}}]
    (init,) = calls("init")
    assert init["method"] == "init_weight_transfer_engine"
    assert init["args"][0]["init_info"] == {"master_address": "10.1.2.3", "master_port": 29555, "rank_offset": 2,
                                            "world_size": 5, "backend": "gloo", "timeout_s": 30.0,
                                            "group_name": "g7"}
    update = calls("update")
    assert [c["method"] for c in update] == ["start_weight_update", "update_weights", "finish_weight_update"]
    sent = update[1]["kwargs"]["request"]["update_info"]
    assert sent == meta.to_wire(weight_version=12, group_name="g7")
    assert update[2]["args"] == ["12"]
    assert calls("disk") == [
        {"method": "collective_rpc", "args": [], "kwargs": {"method": "reload_weights", "timeout": None, "args": [],
                                                            "kwargs": {"weights_path": "/ckpt/step_3"}}},
        {"method": "update_weight_version", "args": ["13"], "kwargs": {}}]


def test_init_and_update_info_parse_in_the_plugin_back_end(in_vllm):
    """What reaches the worker (init_info, update_info) is parsed by our back end's own types inside vLLM's venv."""
    info, names, nbytes, bad = in_vllm["plugin"]
    assert info["world_size"] == 5 and info["rank_offset"] == 2 and info["group_name"] == "g7"
    assert names == ["model.embed_tokens.weight", "lm_head.weight"] and nbytes == [96, 96]
    assert "backend='mpi'" in bad[0] and "rank_offset=0" in bad[1]


def test_completions_body_becomes_the_intended_vllm_sampling_params(in_vllm):
    ans = in_vllm["completions"]
    sp = ans["sampling"]
    assert sp == {"n": 3, "temperature": 0.7, "top_k": 0, "top_p": 1.0, "seed": 4, "logprobs": 0, "max_tokens": 5,
                  "stop_token_ids": [2, 5], "ignore_eos": True}
    assert ans["request_id"] == "abc" and ans["return_token_ids"] is True


def test_parse_a_response_made_by_vllms_model(in_vllm):
    data = in_vllm["response"]
    out = parse_completions(data, [[1], [2, 3]], n=2, version=4)
    assert [[c.output_ids for c in g] for g in out] == [[[10, 20, 30], [11, 21, 31]], [[12, 22, 32], [13, 23, 33]]]
    assert [[c.finish_reason for c in g] for g in out] == [["abort", "length"], ["length", "length"]]
    assert out[1][1].logprobs == [-3.5, -1.5, -2.5] and out[1][0].prompt_ids == [2, 3]
    assert all(c.weight_version == 4 for g in out for c in g)


def test_refuses_filters_and_bad_answers():
    with pytest.raises(ValueError, match="top_k=-1 and top_p=1.0"):
        completions_payload("m", [[1]], SamplingParams(top_p=0.5), "r")
    bad = {"choices": [{"index": 0, "token_ids": [1, 2], "finish_reason": "length",
                        "logprobs": {"token_logprobs": [-1.0]}}]}
    with pytest.raises(Exception, match="one log-prob per token"):
        parse_completions(bad, [[1]], n=1, version=0)
    bad["choices"][0].update(finish_reason="error", logprobs={"token_logprobs": [-1.0, -2.0]})
    with pytest.raises(Exception, match="finish_reason='error'"):
        parse_completions(bad, [[1]], n=1, version=0)


class FakeTPEngine:
    """An engine of `tp` workers that report their count like vLLM's /get_world_size and join the weight-update
    group one rank per worker, receiving the buckets as the plugin's workers do (engines.weight_sync.wire only)."""

    def __init__(self, tp: int):
        self.tp, self.url = tp, f"fake-tp{tp}"
        self.groups, self.received = [None] * tp, [dict() for _ in range(tp)]

    async def world_size(self) -> int:
        return self.tp

    async def weight_formats(self) -> tuple[str, ...]:
        return ("direct", "flattened_bucket")

    async def colocation_info(self) -> dict:
        return {}

    async def init_weights_update_group(self, *, master_address, master_port, rank_offset, world_size, group_name,
                                        backend, timeout_s=None):
        import anyio

        from engines.weight_sync.wire import build_group, create_store

        self.rank_offset, self.world = rank_offset, world_size

        def join(i):
            store = create_store(master_address, master_port, is_master=False, timeout_s=60)
            self.groups[i] = build_group(store, rank=rank_offset + i, world_size=world_size, group_name=group_name,
                                         backend=backend, timeout_s=60)

        async with anyio.create_task_group() as tg:
            for i in range(self.tp):
                tg.start_soon(anyio.to_thread.run_sync, join, i)

    async def update_weights_from_distributed(self, body):
        import anyio

        from engines.weight_sync.wire import WeightMeta, broadcast_async, bucket_members, unpack_bucket, wait_work

        meta = WeightMeta.from_wire(body)

        def recv(i):
            for k, members in enumerate(bucket_members(meta)):
                bucket = torch.empty(meta.bucket_nbytes[k], dtype=torch.uint8)
                wait_work(broadcast_async(self.groups[i], bucket), timeout_s=60, what=f"bucket {k}")
                for j, t in zip(members, unpack_bucket(meta, members, bucket)):
                    self.received[i][meta.names[j]] = t.clone()

        async with anyio.create_task_group() as tg:
            for i in range(self.tp):
                tg.start_soon(anyio.to_thread.run_sync, recv, i)


def test_sender_gives_a_tp_engine_one_rank_per_worker():
    """Engines of 2 and 1 workers: ranks 1-2 and 3 of a world of 4, and every worker receives every weight."""
    from trainer.weight_sync import WeightSyncSender

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 3))
    engines = [FakeTPEngine(2), FakeTPEngine(1)]
    sender = WeightSyncSender(model, engines, bucket_bytes=256, timeout_s=60)
    try:
        sender.init_group()
        assert [(e.rank_offset, e.world) for e in engines] == [(1, 4), (3, 4)]
        sender.sync()
    finally:
        sender.close()
    for e in engines:
        for got in e.received:
            assert set(got) == {n for n, _ in model.named_parameters()}
            for n, p in model.named_parameters():
                assert torch.equal(got[n], p.detach())


def test_a_missing_vllm_venv_fails_naming_the_make_target(monkeypatch, tmp_path):
    import vllm_support

    monkeypatch.setattr(vllm_support, "VLLM_PYTHON", tmp_path / "none" / "bin" / "python")
    with pytest.raises(pytest.fail.Exception, match=r"make \.venv-vllm"):
        vllm_support.require_vllm_venv()
    monkeypatch.undo()
    assert vllm_support.require_vllm_venv() == vllm_support.VLLM_PYTHON  # the real one passes the check
