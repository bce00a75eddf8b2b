"""A real vLLM 0.32 (CPU build, `.venv-vllm`) behind `engines.vllm.VLLMEngine`: generation and log-probs against a
float64 torch forward of the same weights, n samples, abort, pause/resume, weight versions, a weight sync
through this project's `rlkernels` weight-transfer back end (a vLLM plugin, gloo on CPU), and an `openai`-SDK agent
trained through the recording gateway (trainer/rollout/gateway.py) in front of this vLLM, token-exact, and
one RL step through the CLI of a fleet of an embedded engine and this vLLM.

One server per module (start-up is about a minute or two on two cores). A missing `.venv-vllm` FAILS with the
command that builds it: `make test` builds it first, so a skip would only hide a broken install.

Tolerance: the engine runs the model in float32 (`--dtype float32`) and returns float32 log-probs; the reference
is the same weights in float64. Over a two-layer model with |logits| of a few units the float32 forward and
log-softmax are good to ~1e-5 (measured ~7e-6), so 1e-4 (the contract's fp32 figure) has margin, yet a wrong
temperature (T = 0.7 vs 1 moves log-probs by ~0.5), a shifted position or stale weights differ by > 0.1.
"""

from __future__ import annotations

import json
import time

import pytest
import torch
import trio
from fleet_support import config_with_engines, run_one_rl_step
from vllm_support import ROOT, start_server, stop_server, tiny_qwen2, tiny_qwen2_config, write_model_folder

from engines.embedded.launch import free_port
from engines.protocol import InferenceEngine, SamplingParams
from engines.vllm import VLLMEngine
from trainer.types import Status

pytestmark = pytest.mark.slow
TOL = 1e-4


@pytest.fixture(scope="module")
def vllm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vllm_model")
    model, tok = write_model_folder(folder, seed=0)
    port = free_port()
    t0 = time.monotonic()
    proc = start_server(folder, port, folder / "server.log")
    print(f"vLLM start-up: {time.monotonic() - t0:.1f}s")
    engine = VLLMEngine(f"http://127.0.0.1:{port}", str(folder))
    state = {"engine": engine, "model": model, "tok": tok, "log": folder / "server.log", "sender": None}
    yield state
    if state["sender"] is not None:
        state["sender"].close()
    stop_server(proc)


def reference_logprobs(model, prompt: list[int], output: list[int], temperature: float) -> torch.Tensor:
    """float64 log_softmax(logits / T) of each generated token (T = 0: greedy, log-probs at T = 1)."""
    m = model.double()
    with torch.no_grad():
        logits = m(input_ids=torch.tensor([prompt + output])).logits[0, len(prompt) - 1:-1]
    model.float()
    scaled = logits / (temperature if temperature > 0 else 1.0)
    return scaled.log_softmax(-1).gather(-1, torch.tensor(output)[:, None])[:, 0]


def check_against(model, prompts, out, params: SamplingParams) -> float:
    """Every completion has max_new_tokens tokens and log-probs within TOL of the float64 reference."""
    worst = 0.0
    for prompt, group in zip(prompts, out):
        assert len(group) == params.n
        for c in group:
            assert len(c.output_ids) == params.max_new_tokens and c.finish_reason == "length"
            assert c.prompt_ids == list(prompt)
            ref = reference_logprobs(model, list(prompt), c.output_ids, params.temperature)
            diff = (ref - torch.tensor(c.logprobs, dtype=torch.float64)).abs().max().item()
            worst = max(worst, diff)
    assert worst <= TOL, f"engine vs float64 reference log-probs differ by {worst:.2e} > {TOL}"
    return worst


def encode(tok, texts):
    return [tok.encode(t) for t in texts]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_match_float64_reference(vllm, temperature):
    eng, model, tok = vllm["engine"], vllm["model"], vllm["tok"]
    assert isinstance(eng, InferenceEngine)
    prompts = encode(tok, ["12+34=", "hello world", "7*8"])
    params = SamplingParams(temperature=temperature, max_new_tokens=10, n=3, seed=11, ignore_eos=True)
    out = trio.run(eng.generate, prompts, params)
    check_against(model, prompts, out, params)
    # n samples are distinct draws (seed + j), and the same seed gives the same draws again
    assert len({tuple(c.output_ids) for c in out[0]}) > 1
    again = trio.run(eng.generate, prompts, params)
    assert [[c.output_ids for c in g] for g in again] == [[c.output_ids for c in g] for g in out]


def test_multi_turn_episodes_are_token_exact(vllm):
    """Episodes of several turns (trainer.rollout.episodes) through the rollout manager on vLLM: the sample's tokens
    are the opening prompt, what vLLM returned each turn and the environment's rendered messages; loss_mask 1
    exactly on vLLM's tokens; their log-probs agree with a float32 forward of the same weights (before any weight
    sync of this module changes them)."""
    from episode_support import CHAR_STOPS, Recording, Talk, arithmetic_buffer, check_token_exact

    from trainer.config import RolloutConfig
    from trainer.rollout.manager import AsyncRolloutManager

    eng, model, tok = vllm["engine"], vllm["model"], vllm["tok"]
    rec = Recording(eng)
    cfg = RolloutConfig(rollout_batch_size=2, n_samples_per_prompt=3, max_new_tokens=4, env=Talk,
                        stop_token_ids=CHAR_STOPS, max_turns=4, seed=1)
    manager = AsyncRolloutManager([rec], cfg, tokenizer=tok, reward_fn="arithmetic")

    async def run():
        async with manager:
            return await manager.generate_batch(arithmetic_buffer())

    batch = trio.run(run)
    assert sorted(s.metadata["turns"] for s in batch.samples) == [1, 1, 2, 2, 3, 3]
    check_token_exact(batch.samples, rec, tok, model, tol=TOL)


def _one_agent_batch(rec, cfg, tok):
    """One rollout batch of `cfg`'s agent on one arithmetic prompt, through the gateway in front of `rec`."""
    from episode_support import arithmetic_buffer

    from trainer.rollout.manager import AsyncRolloutManager

    manager = AsyncRolloutManager([rec], cfg, tokenizer=tok, reward_fn=None, check_health=False)

    async def run():
        async with manager:
            return await manager.generate_batch(arithmetic_buffer(1))

    return trio.run(run)


def test_an_openai_agent_through_the_gateway_is_token_exact(vllm):
    """The recording gateway (trainer/rollout/gateway.py) in front of the real vLLM: an agent that imports only
    `openai` (a function tool offered, its own message sent back, a tool result, a second turn) trains on exactly
    the tokens vLLM produced: the template's opening and the tool turn (loss mask 0) as the template writes them,
    vLLM's completions (mask 1) with vLLM's log-probs, within TOL of a float32 forward of the same weights. One
    prompt, two episodes: four requests, each one token or two (every character id above the digits stops a turn)."""
    from episode_support import CHAR_STOPS, Recording
    from gateway_support import check_two_turn_batch, two_turn_agent

    from trainer.config import RolloutConfig

    eng, model, tok = vllm["engine"], vllm["model"], vllm["tok"]
    rec = Recording(eng)
    cfg = RolloutConfig(rollout_batch_size=1, n_samples_per_prompt=2, max_new_tokens=6, agent=two_turn_agent,
                        max_turns=4, seed=1, agent_timeout_s=120.0, stop_token_ids=CHAR_STOPS[10:])
    batch = _one_agent_batch(rec, cfg, tok)
    assert len(batch) == 2 and len(rec.calls) == 4
    worst = check_two_turn_batch(batch, rec, model, tol=TOL)
    print(f"gateway over vLLM: engine vs float32 forward log-probs, max diff {worst:.2e}")


def test_greedy_is_argmax_with_temperature_one_logprobs(vllm):
    eng, model, tok = vllm["engine"], vllm["model"], vllm["tok"]
    prompts = encode(tok, ["abc", "99-1="])
    params = SamplingParams(temperature=0.0, max_new_tokens=8, n=2, ignore_eos=True)
    out = trio.run(eng.generate, prompts, params)
    check_against(model, prompts, out, params)
    for prompt, group in zip(prompts, out):
        assert group[0].output_ids == group[1].output_ids
        seq = list(prompt)
        with torch.no_grad():  # greedy continuation of the float64 model, token by token
            m = model.double()
            for _ in range(params.max_new_tokens):
                seq.append(int(m(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
            model.float()
        assert group[0].output_ids == seq[len(prompt):]


def test_top_k_top_p_refused_before_any_request():
    eng = VLLMEngine("http://127.0.0.1:9", "m")  # nothing listens: the check must come first
    for params in (SamplingParams(top_k=5), SamplingParams(top_p=0.9)):
        with pytest.raises(ValueError, match="top_k=-1 and top_p=1.0"):
            trio.run(eng.generate, [[1, 2]], params)


def test_abort_by_rid_and_all(vllm):
    eng, tok = vllm["engine"], vllm["tok"]
    params = SamplingParams(temperature=1.0, max_new_tokens=200, ignore_eos=True, seed=2)
    prompt = encode(tok, ["long story"])
    t0 = time.monotonic()
    trio.run(eng.generate, prompt, params)
    alone_s = time.monotonic() - t0  # a fixed delay raced a fast engine: abort a tenth of the way in instead
    for rids in (["story-1"], None):
        box = {}

        async def run(rids=rids, box=box):
            async def gen():
                box["out"] = await eng.generate(prompt, params, rids=["story-1"])

            async with trio.open_nursery() as nursery:
                nursery.start_soon(gen)
                await trio.sleep(alone_s / 10)
                await eng.abort(rids)

        t0 = time.monotonic()
        trio.run(run)
        c = box["out"][0][0]
        # cut short: what it had (none at all when the abort beat the prefill), never the full 200
        assert c.finish_reason == "abort" and len(c.output_ids) < 200, (c.finish_reason, len(c.output_ids))
        assert len(c.logprobs) == len(c.output_ids)
        assert time.monotonic() - t0 < 30


def test_pause_freezes_and_resume_continues(vllm):
    eng, model, tok = vllm["engine"], vllm["model"], vllm["tok"]
    prompt = encode(tok, ["pause me"])
    params = SamplingParams(temperature=1.0, max_new_tokens=200, ignore_eos=True, seed=5)
    t0 = time.monotonic()
    full = trio.run(eng.generate, prompt, params)
    alone_s = time.monotonic() - t0
    box = {}

    async def run():
        async def gen():
            box["out"] = await eng.generate(prompt, params)
            box["t"] = time.monotonic()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(gen)
            # pause a tenth of the way in: the request is surely in flight (a fixed delay raced a fast engine)
            await trio.sleep(alone_s / 10)
            assert "out" not in box, "the request finished before the pause: the test did not pause anything"
            await eng.pause_generation()
            try:
                assert (await eng._call("GET", "/is_paused"))["is_paused"] is True
                await trio.sleep(alone_s + 3.0)  # longer than the whole request takes unpaused
                assert "out" not in box, "a request finished while the engine was paused"
            finally:  # never leave the module's shared server paused for the tests after this one
                box["resumed"] = time.monotonic()
                await eng.continue_generation()

    trio.run(run)
    assert box["t"] >= box["resumed"]
    # mode "keep": the frozen request goes on where it stopped, same seed, same tokens as unpaused
    assert box["out"][0][0].output_ids == full[0][0].output_ids
    check_against(model, prompt, box["out"], params)


def test_weight_version_round_trip(vllm):
    eng, tok = vllm["engine"], vllm["tok"]
    trio.run(eng.set_weight_version, 41)
    fresh = VLLMEngine(eng.url, eng.model)  # reads it back from the server, not from the adapter's memory
    assert trio.run(fresh.get_weight_version) == 41
    out = trio.run(fresh.generate, encode(tok, ["v"]), SamplingParams(max_new_tokens=2, ignore_eos=True))
    assert out[0][0].weight_version == 41
    assert trio.run(fresh.world_size) == 1  # one CPU worker: one rank in the weight-update group
    # our worker extension answers through /collective_rpc: a CPU worker holds no GPU (None would mean no answer)
    assert trio.run(fresh.gpu_uuids) == ()


@pytest.mark.parametrize("mode", ["bucketed", "per_tensor"])
def test_weight_sync_through_the_gloo_plugin(vllm, mode):
    """The trainer's real sender (trainer.weight_sync) sends new random weights through our vLLM plugin; the
    engine's log-probs then match the new model, not the old, and its weight version is the sender's. The group's
    master address is another loopback address than the default, so the address really travels to the worker."""
    from trainer.weight_sync import WeightSyncSender, verify_sync

    eng, tok = vllm["engine"], vllm["tok"]
    new_model, _ = tiny_qwen2(seed=100 + len(mode))
    if vllm["sender"] is not None:
        vllm["sender"].close()
    sender = WeightSyncSender(new_model, [eng], mode=mode, bucket_bytes=256 << 10,  # several buckets
                              master_address="127.0.0.2", timeout_s=120.0, weight_version=60 + len(mode))
    vllm["sender"] = sender
    sender.init_group()
    if mode == "bucketed":
        assert len(sender.meta.bucket_nbytes) > 1
    version = sender.sync()
    old_model, vllm["model"] = vllm["model"], new_model
    assert trio.run(VLLMEngine(eng.url, eng.model).get_weight_version) == version
    prompts = encode(tok, ["12+34=", "sync"])
    params = SamplingParams(temperature=0.8, max_new_tokens=8, n=2, seed=7, ignore_eos=True)
    out = trio.run(eng.generate, prompts, params)
    assert all(c.weight_version == version for g in out for c in g)
    check_against(new_model, prompts, out, params)
    c = out[0][0]
    stale = reference_logprobs(old_model, prompts[0], c.output_ids, params.temperature)
    assert (stale - torch.tensor(c.logprobs, dtype=torch.float64)).abs().max().item() > 0.1
    check = verify_sync(new_model, [eng], prompts, expected_version=version)
    assert check.ok, check


def test_disk_fallback_reloads_a_saved_folder(vllm, tmp_path):
    """update_weights_from_disk: a folder written by save_pretrained is loaded in place (reload_weights)."""
    eng, tok = vllm["engine"], vllm["tok"]
    new_model, _ = tiny_qwen2(seed=300)
    new_model.save_pretrained(tmp_path / "step_7", safe_serialization=True)
    trio.run(lambda: eng.update_weights_from_disk(str(tmp_path / "step_7"), weight_version=70))
    old_model, vllm["model"] = vllm["model"], new_model
    prompts = encode(tok, ["disk"])
    params = SamplingParams(temperature=1.0, max_new_tokens=6, n=2, seed=1, ignore_eos=True)
    out = trio.run(eng.generate, prompts, params)
    assert all(c.weight_version == 70 for c in out[0])
    check_against(new_model, prompts, out, params)
    stale = reference_logprobs(old_model, prompts[0], out[0][0].output_ids, params.temperature)
    assert (stale - torch.tensor(out[0][0].logprobs, dtype=torch.float64)).abs().max().item() > 0.1


def test_a_tool_call_round_trip_through_the_gateway_is_token_exact(vllm, tmp_path):
    """The gateway in front of vLLM with a model that really calls the tool: a tiny model trained here to answer the
    prompt with a Hermes `<tool_call>` (per-token probability > 0.9998, so vLLM's T = 1 sampling writes it) is
    loaded into vLLM; a plain `openai` agent gets `tool_calls` parsed on the server, runs the calculator, sends the
    SDK's assistant message back with the `tool` result, and asks again. The trained sample: the template's opening
    (mask 0) + vLLM's call tokens (mask 1) + the tool turn as the template writes it (mask 0) + vLLM's answer to
    exactly that prefix (mask 1); log-probs within TOL of a float32 forward of the loaded weights."""
    from episode_support import Recording
    from gateway_support import CALC, CALL, IM_END_ID, after_turn, assert_exact, calculator_agent, train_to_write

    from trainer.config import RolloutConfig

    eng, tok = vllm["engine"], vllm["tok"]
    prompt = "0+1="  # arithmetic_buffer(1)'s one prompt
    start = tok.apply_chat_template([{"role": "user", "content": prompt}], tools=[CALC], add_generation_prompt=True,
                                    tokenize=True, return_dict=True)["input_ids"]
    call = tok.encode(CALL) + [IM_END_ID]
    model = train_to_write(tiny_qwen2(seed=400)[0], start, call, min_logprob=-2e-4)
    model.save_pretrained(tmp_path / "caller", safe_serialization=True)
    trio.run(lambda: eng.update_weights_from_disk(str(tmp_path / "caller"), weight_version=90))
    vllm["model"] = model
    rec = Recording(eng)
    cfg = RolloutConfig(rollout_batch_size=1, n_samples_per_prompt=2, max_new_tokens=100, agent=calculator_agent,
                        max_turns=2, seed=3, agent_timeout_s=300.0)
    batch = _one_agent_batch(rec, cfg, tok)
    assert len(batch) == 2 and len(rec.calls) == 4
    worst = 0.0
    for s in batch.samples:
        assert s.status == Status.COMPLETED and s.prompt == prompt
        assert s.metadata["calls"] == [["calculator", {"expression": "6*7"}]]
        assert s.metadata["finishes"][0] == "tool_calls" and s.metadata["tool_calls"] >= 1
        [c1] = [c for p, c in rec.calls if list(p) == start and list(s.tokens[len(start):len(start) + len(call)])
                == c.output_ids][:1]
        assert c1.output_ids == call, tok.decode(c1.output_ids)  # vLLM wrote the call
        prefix = start + call + after_turn("tool", "42")
        [c2] = [c for p, c in rec.calls if list(p) == prefix and list(s.tokens[len(prefix):]) == c.output_ids][:1]
        worst = max(worst, assert_exact(s, [(start, None), (call, c1), (prefix[len(start) + len(call):], None),
                                            (c2.output_ids, c2)], model, TOL))
        assert [v for v in s.metadata["weight_versions"] if v is not None] == [90, 90]  # both of vLLM's turns
    print(f"tool round trip through the gateway over vLLM: log-probs vs float32 forward, max diff {worst:.2e}")


def test_grpo_run_with_a_vllm_engine_raises_reward(vllm, tmp_path):
    """run_rl_training with the vLLM engine: rollouts through the rollout manager, a sync per step through the
    plugin (verified: engine log-probs equal the trainer's), and a reward that rises. The random tiny model cannot
    do arithmetic yet, so the reward is dense and verifiable (the fraction of digits in the answer), as in the
    embedded engine's end-to-end test, on the arithmetic prompts."""
    from kernels import use_backend
    from trainer.backend.steps import build_components, trainer_config_from
    from trainer.config import OptimConfig, RLTrainingConfig, RolloutConfig
    from trainer.data.buffer import DataBuffer, load_jsonl
    from trainer.rl import run_rl_training
    from trainer.weight_sync import WeightSyncSender

    eng, tok = vllm["engine"], vllm["tok"]
    if vllm["sender"] is not None:
        vllm["sender"].close()
        vllm["sender"] = None
    digits = {tok.convert_tokens_to_ids(c) for c in "0123456789"}

    def digit_fraction(sample):
        resp = sample.tokens[sample.prompt_length:]
        return sum(t in digits for t in resp) / max(len(resp), 1)

    rollout = RolloutConfig(apply_chat_template=False,
                            rollout_batch_size=8, n_samples_per_prompt=4, max_new_tokens=6, temperature=1.0, seed=5)
    cfg = RLTrainingConfig(optim=OptimConfig(lr=1e-2, warmup_steps=0, min_lr_ratio=1.0), num_steps=10,
                           token_budget=256, micro_batch_buckets=64, loss={"loss_agg": "token-mean"},
                           output_dir=str(tmp_path), rollout=rollout, verify_sync=True)
    tcfg = trainer_config_from(cfg, compile=False)
    comp = build_components(tiny_qwen2_config(), tcfg)
    data = DataBuffer(load_jsonl(str(ROOT / "data" / "arithmetic_train.jsonl")), seed=0)
    vllm["sender"] = sender = WeightSyncSender(comp.model, [eng])  # the fixture closes it
    sender.init_group()
    with use_backend("torch"):
        _, state, history = run_rl_training(None, data, cfg, engines=[eng], sender=sender, tokenizer=tok,
                                            reward_fn=digit_fraction, trainer_config=tcfg, components=comp)
    assert state.step == 10 and [m["weight_version"] for m in history] == list(range(1, 11))
    assert all(m["verify_sync_max_abs_diff"] <= TOL for m in history)
    assert all(m["mismatch/logprob_abs_diff_max"] < 1e-3 for m in history)  # engine vs trainer, every step
    rewards = [m["reward_mean"] for m in history]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1, f"reward did not rise: {rewards}"


def test_rl_step_with_an_embedded_and_a_vllm_engine(vllm, tmp_path):
    """A fleet of an embedded engine started by the run and this real vLLM by URL: one RL step through the CLI,
    the embedded engine colocated and vLLM over the group through its plugin, both verified after the sync. Last
    in the module: the run starts from the served folder and its sync replaces the server's weights."""
    eng = vllm["engine"]
    if vllm["sender"] is not None:  # the run forms its own group with this server
        vllm["sender"].close()
        vllm["sender"] = None
    cfg = config_with_engines(tmp_path, f'''
fleet = [{{kind = "embedded"}}, {{url = "{eng.url}", kind = "vllm"}}]
threads = 1
''', name="fleet_vllm")
    text = cfg.read_text()
    start = text.index("[model]")
    end = text.index("\n[", start + 1)
    cfg.write_text(text[:start] + f'[model]\npath = "{eng.model}"\n' + text[end:])
    run_one_rl_step(cfg)
    version = trio.run(VLLMEngine(eng.url, eng.model).get_weight_version)
    rows = [json.loads(line) for line in (tmp_path / "fleet_vllm" / "rl" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]  # the training step (step 0 holds the evaluation before RL)
    assert len(rows) == 1 and rows[0]["verify_sync_max_abs_diff"] <= 1e-5
    assert version == rows[0]["weight_version"] == 1  # vLLM got the sync
