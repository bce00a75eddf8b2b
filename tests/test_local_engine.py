"""The in-process engine (engines/local.py): the HTTP path's answers without HTTP, the same errors, aborts and
weight sync, and an RL run through the CLI with [engines] in_process = true."""

import concurrent.futures
import json
import math

import pytest
import torch
import trio

from engines.embedded.presets import build_tiny_model
from engines.local import LocalEngine
from engines.protocol import EngineError, EngineUnavailableError, InferenceEngine, SamplingParams
from engines.registry import EngineSpec, build_engine
from engines.sglang import SGLangEngine
from trainer.weight_sync import WeightSyncSender, verify_sync

ENGINE_SEED = 3  # the shared `engine` fixture (tests/conftest.py): the same tiny model as the local one
PROMPTS = [[1, 20, 21, 22], [1, 40], [1, 7, 8, 9, 10, 11]]


@pytest.fixture(scope="module")
def local():
    """Built by the registry from a config entry, as the CLI builds it ([engines] in_process = true)."""
    eng = build_engine(EngineSpec(kind="local"), model_folder="tiny", seed=ENGINE_SEED)
    assert type(eng) is LocalEngine and isinstance(eng, InferenceEngine)
    yield eng
    eng.close()


def test_local_answers_equal_the_http_engine_process(local, engine):
    """Seeded sampling, n > 1, temperature 0.7 and greedy: token for token, log-prob for log-prob."""
    http = SGLangEngine(engine.url, timeout_s=60)

    async def both(params):
        return (await local.generate(PROMPTS, params, rids=["a", "b", "c"]),
                await http.generate(PROMPTS, params, rids=["a", "b", "c"]))

    for params in (SamplingParams(temperature=0.7, max_new_tokens=12, n=3, seed=11),
                   SamplingParams(temperature=0.0, max_new_tokens=8)):
        ours, theirs = trio.run(both, params)
        assert len(ours) == len(PROMPTS) and all(len(g) == params.n for g in ours)
        for g_local, g_http in zip(ours, theirs):
            for a, b in zip(g_local, g_http):
                assert a.output_ids == b.output_ids and a.finish_reason == b.finish_reason
                assert a.prompt_ids == b.prompt_ids and a.weight_version == b.weight_version
                assert len(a.logprobs) == len(a.output_ids) > 0
                assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-6
    # The samples of a seeded group differ from each other (seed + j per sample), as over HTTP.
    ours, _ = trio.run(both, SamplingParams(temperature=1.0, max_new_tokens=12, n=4, seed=5))
    assert len({tuple(c.output_ids) for c in ours[0]}) > 1


def test_the_model_thread_decodes_on_its_own_thread_count():
    """[engines] threads reaches the in-process engine's model thread (registry -> LocalEngine -> EngineServer):
    it decodes on that many torch threads while the caller keeps its own (OpenMP's count is per thread), and its
    answers are the engine's."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        eng = build_engine(EngineSpec(kind="local"), model_folder="tiny", seed=ENGINE_SEED, threads=1)
        ref = build_engine(EngineSpec(kind="local"), model_folder="tiny", seed=ENGINE_SEED)  # the process's pool
        try:
            params = SamplingParams(temperature=0.7, max_new_tokens=6, n=2, seed=4)
            got = trio.run(eng.generate, PROMPTS, params)
            want = trio.run(ref.generate, PROMPTS, params)
            assert eng.server.model_thread.submit(torch.get_num_threads).result(timeout=30) == 1
            assert ref.server.model_thread.submit(torch.get_num_threads).result(timeout=30) == 2
            assert torch.get_num_threads() == 2  # the caller's count is untouched, and so is a new thread's
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                assert pool.submit(torch.get_num_threads).result(timeout=30) == 2
            for g_got, g_want in zip(got, want):
                for a, b in zip(g_got, g_want):
                    assert a.output_ids == b.output_ids
                    assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-5
        finally:
            eng.close()
            ref.close()
    finally:
        torch.set_num_threads(before)


def test_local_engine_also_runs_under_asyncio(local):
    import asyncio

    out = asyncio.run(local.generate([[1, 5, 6]], SamplingParams(temperature=0.0, max_new_tokens=4)))
    ref = trio.run(local.generate, [[1, 5, 6]], SamplingParams(temperature=0.0, max_new_tokens=4))
    assert out[0][0].output_ids == ref[0][0].output_ids


def test_bad_requests_raise_the_http_errors(local):
    """The same messages and statuses as the HTTP path; a missing route is told by its status, not its text."""
    with pytest.raises(EngineError, match="HTTP 400: input_ids out of range") as bad:
        trio.run(local.generate, [[1, 10**6]], SamplingParams(max_new_tokens=2))
    assert bad.value.status == 400 and not bad.value.missing_route
    with pytest.raises(EngineError, match="HTTP 404") as missing:
        trio.run(local._call, "POST", "/no_such_route", {})
    assert missing.value.status == 404 and missing.value.missing_route
    with pytest.raises(EngineError, match="HTTP 400: give 'rid'") as no_rid:
        trio.run(local._call, "POST", "/abort_request", {})
    assert no_rid.value.status == 400


def test_local_engine_declares_its_weight_sync_capabilities(local):
    """One rank, both formats, and a same-device path that reports the tiny model's dtype."""
    assert trio.run(local.world_size) == 1
    assert trio.run(local.weight_formats) == ("direct", "flattened_bucket", "lora_adapter")
    info = trio.run(local.colocation_info)
    assert info["dtype"] == "float32" and info["device"] == "cpu"


def test_abort_by_rid_cuts_a_running_request_short(local):
    params = SamplingParams(temperature=1.0, max_new_tokens=5000, ignore_eos=True, seed=1)

    async def main():
        got = {}

        async def long():
            got["out"] = await local.generate([[1, 30, 31]], params, rids=["long-one"])

        async with trio.open_nursery() as n:
            n.start_soon(long)
            while local.server.num_running_rows == 0:
                await trio.sleep(0.01)
            await trio.sleep(0.05)
            await local.abort(["long-one"])
        return got["out"]

    out = trio.run(main)
    c = out[0][0]
    assert c.finish_reason == "abort" and 0 < len(c.output_ids) < 5000
    assert local.server.num_running_rows == 0


def test_weight_sync_reaches_the_local_engine_through_shared_memory(local, monkeypatch):
    ran = []  # what ran on the model thread through EngineServer._then_idle (its stream, its thread release)
    then_idle = local.server._then_idle
    monkeypatch.setattr(local.server, "_then_idle", lambda fn, *a: (ran.append(fn.__name__), then_idle(fn, *a))[1])
    trainer = build_tiny_model(ENGINE_SEED)
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    before = verify_sync(trainer, [local], PROMPTS, expected_version=local.weight_version)
    assert before.max_abs_diff[0] > 1e-3  # the check can fail: the engine still serves its own weights
    sender = WeightSyncSender(trainer, [local], timeout_s=60, weight_version=40)
    sender.init_group()
    assert sender.colocated == [0]  # same process, same host: shared slots, no process group
    assert sender.sync() == 41
    res = verify_sync(trainer, [local], PROMPTS, expected_version=41)
    assert res.ok and res.max_abs_diff[0] <= 1e-5, res
    assert trio.run(local.get_weight_version) == 41
    assert "receive_colocated" in ran, ran  # was: run on the model thread directly, outside the engine's stream
    sender.close()


def test_a_closed_engine_says_so():
    eng = LocalEngine("tiny", seed=1)
    eng.close()
    eng.close()  # idempotent
    with pytest.raises(EngineUnavailableError, match="closed"):
        trio.run(eng.generate, [[1, 2]], SamplingParams(max_new_tokens=2))


def test_rl_through_the_cli_with_the_in_process_engine(tmp_path):
    from trainer.cli import load_run_config, run

    cfg = load_run_config("configs/demo.toml", [
        f"output_dir={json.dumps(str(tmp_path))}", "engines.in_process=true", "rl.num_steps=3",
        "rl.rollout.rollout_batch_size=8", "rl.rollout.n_samples_per_prompt=4", "eval.limit=8"], mode="rl")
    summary = run("rl", cfg)
    rows = [json.loads(line) for line in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert "eval/eval/accuracy" in rows[0] and "loss" not in rows[0]  # step 0: the evaluation before RL
    rows = rows[1:]
    assert summary["rl_steps"] == 3 and len(rows) == 3
    assert all(r["num_samples"] == 32 and math.isfinite(r["loss"]) for r in rows)
    # On-policy: the engine's log-probs are the trainer's, so the weights reached the engine at every step.
    assert max(r["mismatch/logprob_abs_diff_max"] for r in rows) < 1e-4
    assert [r["weight_version"] for r in rows] == [1, 2, 3]


def test_in_process_config_errors_name_the_conflict(monkeypatch):
    from trainer.cli import load_run_config

    with pytest.raises(ValueError, match=r"in_process = true and \[engines\].fleet both given"):
        load_run_config("configs/demo.toml", ["engines.in_process=true", 'engines.fleet=[{url = "http://h:1"}]'],
                        mode="rl")
    with pytest.raises(ValueError, match="in_process = 1"):
        load_run_config("configs/demo.toml", ["engines.in_process=1"], mode="rl")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="single-process trainer"):
        load_run_config("configs/demo.toml", ["engines.in_process=true"], mode="rl")


def test_a_request_past_its_timeout_is_unavailable(local):
    from engines.sglang import generate_payload

    body = generate_payload([[1, 30, 31]], SamplingParams(max_new_tokens=100_000, ignore_eos=True, seed=2),
                            rids=["slow"])
    with pytest.raises(EngineUnavailableError, match="no answer in 0.2 s"):
        trio.run(local._call, "POST", "/generate", body, 0.2)
    trio.run(local.abort)  # the rows keep running after the caller gave up (as over HTTP): cut them
    for _ in range(500):
        if local.server.num_running_rows == 0:
            break
        trio.run(trio.sleep, 0.01)
    assert local.server.num_running_rows == 0
