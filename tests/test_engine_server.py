"""The embedded engine as a real server process on loopback: batched seeded generation whose log-probs equal a
plain HF forward, SGLang's response shape, 4xx on malformed requests, 401 without the API key."""

import httpx
import pytest
import torch
import trio

from engines.embedded.presets import build_tiny_model
from engines.embedded.sampling import filter_logits
from engines.protocol import SamplingParams
from engines.sglang import EngineError, SGLangEngine

KEY = "test-key"
SEED = 5


ENGINE_SEED, ENGINE_API_KEY = SEED, KEY  # for the shared `engine` fixture (tests/conftest.py)


def _post(engine, route, body=None, key=KEY, content=None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(engine.url + route, json=body, content=content, headers=headers, timeout=60)


def _hf_logprobs(model, prompt, out_ids):
    seq = torch.tensor([list(prompt) + list(out_ids)])
    with torch.no_grad():
        lp = model(input_ids=seq).logits.float().log_softmax(-1)[0, len(prompt) - 1:-1]
    return lp.gather(-1, torch.tensor(out_ids)[:, None])[:, 0]


def test_batched_generate_is_seeded_and_logprobs_match_hf_forward(engine):
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(6, 100, (int(n),), generator=g).tolist() for n in (3, 9, 1, 6)]
    client = SGLangEngine(engine.url, api_key=KEY)
    params = SamplingParams(temperature=1.0, top_p=0.95, top_k=40, max_new_tokens=12, n=2, seed=1234,
                            ignore_eos=True)
    first = trio.run(client.generate, prompts, params)
    again = trio.run(client.generate, prompts, params)
    other = trio.run(client.generate, prompts, SamplingParams(max_new_tokens=12, n=2, seed=99, ignore_eos=True))
    assert [[c.output_ids for c in grp] for grp in first] == [[c.output_ids for c in grp] for grp in again]
    assert [[c.output_ids for c in grp] for grp in first] != [[c.output_ids for c in grp] for grp in other]
    assert first[0][0].output_ids != first[0][1].output_ids  # the n samples of a prompt use distinct seeds
    model = build_tiny_model(SEED)  # the same weights the server built from --seed
    for prompt, grp in zip(prompts, first):
        for c in grp:
            assert len(c.output_ids) == 12 and c.finish_reason == "length" and c.weight_version == 0
            ref = _hf_logprobs(model, prompt, c.output_ids)
            assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-5, rtol=0), (c.logprobs, ref)


def test_stop_token_and_greedy_and_sglang_shape(engine):
    prompt = [1, 17, 18, 19]
    r = _post(engine, "/generate", {"input_ids": prompt, "sampling_params": {"temperature": 0,
                                                                              "max_new_tokens": 6}})
    assert r.status_code == 200
    out = r.json()
    assert set(out) >= {"text", "output_ids", "meta_info"} and out["meta_info"]["weight_version"] == "0"
    model = build_tiny_model(SEED)
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(len(out["output_ids"])):  # greedy = argmax of the plain forward at every step
            seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    assert out["output_ids"] == seq[len(prompt):]
    stop = out["output_ids"][2]
    r = _post(engine, "/generate", {"input_ids": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 6,
                                                                              "stop_token_ids": [stop]}})
    out2 = r.json()
    first_stop = out["output_ids"].index(stop)
    assert out2["output_ids"] == out["output_ids"][:first_stop + 1]
    assert out2["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_concurrent_requests_are_batched_and_match_solo_results(engine):
    client = SGLangEngine(engine.url, api_key=KEY)
    prompts = [[5 + i, 9, 30 + i] for i in range(6)]
    params = [SamplingParams(max_new_tokens=8, seed=50 + i, ignore_eos=True) for i in range(6)]
    solo = [trio.run(client.generate, [p], sp)[0][0] for p, sp in zip(prompts, params)]
    together = [None] * 6

    async def main():
        async def one(i):
            together[i] = (await client.generate([prompts[i]], params[i]))[0][0]

        async with trio.open_nursery() as n:
            for i in range(6):
                n.start_soon(one, i)

    trio.run(main)
    for a, b in zip(solo, together):
        assert a.output_ids == b.output_ids
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)


@pytest.mark.parametrize("route,body,content,match", [
    ("/generate", None, b"{not json", "not valid JSON"),
    ("/generate", {"sampling_params": {}}, None, "exactly one"),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"temprature": 1.0}}, None, "unsupported"),
    ("/generate", {"input_ids": [1, 100000]}, None, "out of range"),
    ("/generate", {"input_ids": [1], "sampling_params": {"top_p": 0}}, None, "out of range"),
    ("/generate", {"input_ids": ["a"]}, None, "token ids"),
    ("/init_weights_update_group", {"master_address": "127.0.0.1"}, None, "master_port"),
    ("/update_weights_from_distributed", {"names": ["model.embed_tokens.weight"], "dtypes": ["float32"],
                                          "shapes": [[128, 64]]}, None, "not initialised"),
    ("/update_weights_from_tensor", {"serialized_named_tensors": ["x"]}, None, "pickled"),
])
def test_malformed_requests_get_4xx_with_a_message(engine, route, body, content, match):
    r = _post(engine, route, body, content=content)
    assert 400 <= r.status_code < 500, r.text
    assert match in r.json()["message"]


def test_unknown_parameter_name_rejected_before_any_broadcast(engine):
    # a group must exist for the name check to be reached: use the in-process trainer side
    from engines.weight_sync.wire import create_store

    store = create_store("127.0.0.1", 0, is_master=True, timeout_s=30)
    import threading

    from engines.weight_sync.wire import build_group

    groups = []  # keep the trainer side's group alive: a collected group closes its pairs mid-handshake
    t = threading.Thread(target=lambda: groups.append(build_group(store=store, rank=0, world_size=2, group_name="g",
                                                                  backend="gloo", timeout_s=30)))
    t.start()
    r = _post(engine, "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": store.port,
                                                     "rank_offset": 1, "world_size": 2, "group_name": "g"})
    t.join()
    assert r.status_code == 200, r.text
    r = _post(engine, "/update_weights_from_distributed", {"names": ["nope.weight"], "dtypes": ["float32"],
                                                           "shapes": [[2]], "group_name": "g"})
    assert r.status_code == 400 and "unknown parameter name" in r.json()["message"]
    r = _post(engine, "/update_weights_from_distributed", {"names": ["model.norm.weight"], "dtypes": ["float32"],
                                                           "shapes": [[3]], "group_name": "g"})
    assert r.status_code == 400 and "has shape" in r.json()["message"]
    assert _post(engine, "/destroy_weights_update_group", {"group_name": "g"}).json()["success"]
    assert len(groups) == 1


@pytest.mark.parametrize("key", [None, "wrong"])
def test_missing_or_wrong_api_key_is_401(engine, key):
    for route in ("/health", "/get_model_info"):
        r = httpx.get(engine.url + route, headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=30)
        assert r.status_code == 401 and "API key" in r.json()["message"]
    assert _post(engine, "/generate", {"input_ids": [1]}, key=key).status_code == 401
    with pytest.raises(EngineError, match="401"):
        trio.run(SGLangEngine(engine.url, api_key=key).generate, [[1]], SamplingParams(max_new_tokens=1))


def test_pause_holds_generation_until_continue(engine):
    client = SGLangEngine(engine.url, api_key=KEY)
    got = []

    async def main():
        await client.pause_generation()

        async def gen():
            got.append(await client.generate([[1, 2]], SamplingParams(max_new_tokens=2)))

        async with trio.open_nursery() as n:
            n.start_soon(gen)
            await trio.sleep(0.5)
            assert not got and await client.health()  # held, and the server still answers
            await client.continue_generation()

    trio.run(main)
    assert len(got) == 1


def test_filter_logits_matches_a_direct_top_k_top_p():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 37, generator=g) * 3
    temp = torch.tensor([1.0, 0.7, 1.3, 1.0, 2.0])
    top_k = torch.tensor([-1, 5, 0, 1, 12])
    top_p = torch.tensor([0.9, 1.0, 0.5, 1.0, 0.8])
    got = filter_logits(logits, temp, top_k, top_p)
    for i in range(5):
        scaled = logits[i] / temp[i]
        order = scaled.argsort(descending=True).tolist()
        keep = order[: top_k[i] if top_k[i] > 0 else 37]
        probs = torch.softmax(scaled[keep], -1)
        kept, mass = [], 0.0
        for tok, p in zip(keep, probs.tolist()):
            if mass >= top_p[i] and kept:
                break
            kept.append(tok)
            mass += p
        finite = torch.isfinite(got[i]).nonzero()[:, 0].tolist()
        assert sorted(finite) == sorted(kept)
        assert torch.allclose(got[i, kept], scaled[kept])


def _load(engine) -> dict:
    return httpx.get(engine.url + "/get_server_info", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()


def test_logprobs_at_the_request_temperature_equal_the_trainer_kernel(engine):
    """Contract: log_softmax(logits / T) of each sampled token, before top-k/top-p, as the trainer computes it."""
    from kernels import linear_token_logprobs

    g = torch.Generator().manual_seed(21)
    prompts = [torch.randint(6, 100, (int(n),), generator=g).tolist() for n in (4, 7)]
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=10, n=3, seed=77, ignore_eos=True)
    groups = trio.run(SGLangEngine(engine.url, api_key=KEY).generate, prompts, params)
    model = build_tiny_model(SEED)
    for prompt, grp in zip(prompts, groups):
        for c in grp:
            seq = torch.tensor([prompt + c.output_ids])
            with torch.no_grad():
                hidden = model.model(input_ids=seq).last_hidden_state[0, len(prompt) - 1:-1].contiguous()
                ref = linear_token_logprobs(hidden, model.lm_head.weight.contiguous(), torch.tensor(c.output_ids),
                                            temperature=0.7)
            got = torch.tensor(c.logprobs)
            assert torch.allclose(got, ref, atol=1e-5, rtol=0), (got - ref).abs().max()
            # and not the temperature-1 log-probs (what an engine breaking the contract returns)
            assert (got - _hf_logprobs(model, prompt, c.output_ids)).abs().max() > 1e-2


def _run_and_cut(engine, params, rids, cut):
    """Start one long request, wait until its rows run, call cut(); returns (completions, load after)."""
    client = SGLangEngine(engine.url, api_key=KEY)
    got, info = [], {}

    async def main():
        async def gen():
            got.append(await client.generate([[1, 2, 3]], params, rids=rids))

        async with trio.open_nursery() as n:
            n.start_soon(gen)
            while _load(engine)["num_running_rows"] < params.n:
                await trio.sleep(0.01)
            await trio.sleep(0.05)  # a few steps in
            info.update(await cut(client) or {})

    trio.run(main)
    return got[0][0], _load(engine), info


def test_abort_all_stops_running_rows_within_one_decode_step(engine):
    async def cut(client):
        r = _post(engine, "/abort_request", {"rid": "nobody"})
        assert r.status_code == 200 and r.json()["aborted_rows"] == 0
        r = _post(engine, "/abort_request", {"abort_all": True})
        return r.json()

    comps, after, info = _run_and_cut(engine, SamplingParams(max_new_tokens=400, n=4, seed=3, ignore_eos=True),
                                      None, cut)
    assert info["aborted_rows"] == 4
    assert after["num_running_rows"] == 0 and after["num_waiting_rows"] == 0
    assert after["decode_steps"] <= info["decode_steps"] + 1  # the cut rows left at the next step
    assert len(comps) == 4 and all(c.finish_reason == "abort" for c in comps)
    assert all(0 < len(c.output_ids) < 400 and len(c.logprobs) == len(c.output_ids) for c in comps)
    r = _post(engine, "/abort_request", {})
    assert r.status_code == 400 and "abort_all" in r.json()["message"]


def test_abort_by_request_id_cuts_only_that_request(engine):
    client = SGLangEngine(engine.url, api_key=KEY)
    other = []

    async def cut(c):
        async def bystander():
            other.append(await client.generate([[9, 9]], SamplingParams(max_new_tokens=30, seed=1, ignore_eos=True)))

        async with trio.open_nursery() as n:
            n.start_soon(bystander)
            await trio.sleep(0.02)
            await c.abort(["long-one"])  # a seeded n=2 request went out as rows long-one-0, long-one-1

    comps, after, _ = _run_and_cut(engine, SamplingParams(max_new_tokens=400, n=2, seed=3, ignore_eos=True),
                                   ["long-one"], cut)
    assert [c.finish_reason for c in comps] == ["abort", "abort"] and after["num_running_rows"] == 0
    assert other[0][0][0].finish_reason == "length" and len(other[0][0][0].output_ids) == 30


def test_new_rows_join_a_running_batch_and_keep_their_seeded_results(engine):
    """Continuous batching: a short request sent while a long one runs finishes first, and both give what they
    give alone (per-row seeded generators)."""
    client = SGLangEngine(engine.url, api_key=KEY)
    long = SamplingParams(temperature=0.8, max_new_tokens=150, seed=8, ignore_eos=True)
    short = SamplingParams(temperature=1.2, top_k=30, max_new_tokens=3, n=2, seed=9, ignore_eos=True)
    solo_long = trio.run(client.generate, [[7, 8, 9, 10]], long)[0][0]
    solo_short = trio.run(client.generate, [[40, 41]], short)[0]
    seen = {}

    async def main():
        async def gen_long():
            seen["long"] = (await client.generate([[7, 8, 9, 10]], long))[0][0]

        async with trio.open_nursery() as n:
            n.start_soon(gen_long)
            while _load(engine)["num_running_rows"] < 1:
                await trio.sleep(0.005)
            seen["short"] = (await client.generate([[40, 41]], short))[0]
            seen["running_when_short_done"] = _load(engine)["num_running_rows"]

    trio.run(main)
    assert seen["running_when_short_done"] == 1  # the long row was still running
    for a, b in [(solo_long, seen["long"])] + list(zip(solo_short, seen["short"])):
        assert a.output_ids == b.output_ids
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_rows_admitted_together_are_answered_as_each_finishes(engine):
    """The model thread steps on without the loop while only the running rows need a step (EngineServer._steps); a
    request whose rows finish in such a step is answered then, not when the batch drains. Both requests are queued
    while the engine is paused, so they join in one step and nothing else arrives: the short one finishes
    mid-run. The step each request finished in is the server's own count (meta_info.decode_step), so it does not
    depend on how soon the client gets a core; the long row (500 tokens) leaves the client ample steps to see it
    still running when the short answer arrives."""
    client = SGLangEngine(engine.url, api_key=KEY)
    long = SamplingParams(temperature=0.8, max_new_tokens=500, seed=8, ignore_eos=True)
    short = SamplingParams(temperature=1.0, max_new_tokens=3, n=2, seed=9, ignore_eos=True)
    solo_short = trio.run(client.generate, [[40, 41]], short)[0]
    seen = {}

    def raw(prompt: list[int], sp: SamplingParams) -> list[dict]:
        body = {"input_ids": [prompt], "sampling_params": {"temperature": sp.temperature, "n": sp.n, "seed": sp.seed,
                                                            "max_new_tokens": sp.max_new_tokens, "ignore_eos": True}}
        return httpx.post(engine.url + "/generate", json=body, headers={"Authorization": f"Bearer {KEY}"},
                          timeout=60).json()

    async def main():
        await client.pause_generation()

        async def gen_long():
            seen["long"] = await trio.to_thread.run_sync(raw, [7, 8, 9, 10], long)

        async def gen_short():
            seen["short"] = await trio.to_thread.run_sync(raw, [40, 41], short)
            seen["when_short_done"] = await trio.to_thread.run_sync(_load, engine)

        async with trio.open_nursery() as n:
            n.start_soon(gen_long)
            n.start_soon(gen_short)
            while _load(engine)["num_waiting_rows"] < 3:
                await trio.sleep(0.005)
            steps_before = _load(engine)["decode_steps"]
            await client.continue_generation()
        seen["steps_before"] = steps_before

    trio.run(main)
    done, start = seen["when_short_done"], seen["steps_before"]
    assert done["num_running_rows"] == 1, done  # the long row still ran when the short request was answered
    # Paused, the engine took no step after `start`: the three rows joined in step start + 1, which sampled each
    # one's first token, so 3 tokens end in step start + 3 and 500 in step start + 500.
    assert [o["meta_info"]["decode_step"] for o in seen["short"]] == [start + 3] * 2, (seen["short"], start)
    (long_out,) = seen["long"]
    assert long_out["meta_info"]["decode_step"] == start + 500, start
    assert len(long_out["output_ids"]) == 500 and long_out["meta_info"]["finish_reason"]["type"] == "length"
    for a, b in zip(solo_short, seen["short"]):
        assert a.output_ids == b["output_ids"] and len(b["output_ids"]) == 3
        got = [lp for lp, _, _ in b["meta_info"]["output_token_logprobs"]]
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(got), atol=1e-5, rtol=0)


def test_decode_batch_admitting_rows_between_steps_gives_the_solo_results():
    """In process: rows admitted one per step (ragged caches merged, finished rows retired, a shared prefill for
    identical prompts) give the tokens and log-probs each row gives alone."""
    from engines.embedded.generation import DecodeBatch, Row, generate_rows

    model = build_tiny_model(SEED)
    g = torch.Generator().manual_seed(4)
    prompts = [tuple(torch.randint(6, 100, (int(n),), generator=g).tolist()) for n in (3, 9, 1, 6)]
    prompts += [prompts[1]] * 2  # a group: one prefill, cache rows repeated
    rows = [Row(p, t, tp, tk, m, frozenset({7, 11}), 100 + i, f"r{i}") for i, (p, t, tp, tk, m) in enumerate(
        zip(prompts, (0.7, 1.0, 0.0, 1.3, 0.9, 0.9), (1.0, 0.9, 1.0, 1.0, 1.0, 0.8), (-1, -1, -1, 20, -1, 5),
            (12, 5, 9, 14, 8, 8)))]
    solo = [generate_rows(model, [r], pad_id=0)[0] for r in rows]
    batch, got = DecodeBatch(model, pad_id=0), {}
    for i in range(len(rows) + 20):
        admit = [(rows[i], i)] if i < 4 else [(rows[4], 4), (rows[5], 5)] if i == 4 else []
        got.update(batch.step(admit))
    assert len(batch) == 0 and sorted(got) == list(range(len(rows)))
    for i, ref in enumerate(solo):
        assert got[i].output_ids == ref.output_ids and got[i].finish_reason == ref.finish_reason
        assert torch.allclose(torch.tensor(got[i].logprobs), torch.tensor(ref.logprobs), atol=1e-5, rtol=0)
    assert solo[4].output_ids != solo[5].output_ids  # same prompt, own seeds


def test_pause_with_mode_abort_cuts_running_rows(engine):
    async def cut(client):
        r = _post(engine, "/pause_generation", {"mode": "abort"})
        assert r.status_code == 200
        await trio.sleep(0.1)
        load = _load(engine)
        await client.continue_generation()
        return load

    comps, after, paused = _run_and_cut(engine, SamplingParams(max_new_tokens=400, n=2, ignore_eos=True), None, cut)
    assert paused["num_running_rows"] == 0 and after["num_running_rows"] == 0
    assert [c.finish_reason for c in comps] == ["abort", "abort"] and all(len(c.output_ids) < 400 for c in comps)
    assert _post(engine, "/pause_generation", {"mode": "later"}).status_code == 400
