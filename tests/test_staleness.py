"""Issue 27: bounded staleness. Async generation runs [rl] max_staleness steps ahead (less the engines' own lag),
no sample past the bound trains (dropped or regenerated, counted), and the data buffer is never read by two threads
at once."""

from __future__ import annotations

import threading
import time

import pytest
from engine_support import digit_fraction

import trainer.rl as rl
from engines.local import LocalEngine
from engines.tiny import build_tokenizer, tiny_model_config
from kernels import use_backend
from trainer.backend.steps import build_components, trainer_config_from
from trainer.config import ConfigError, OptimConfig, RLTrainingConfig, RolloutConfig, RunConfig, config_from_dict
from trainer.data.buffer import DataBuffer, load_jsonl
from trainer.rollout.service import RolloutService
from trainer.rollout.staleness import StalenessPolicy, past_bound, within_staleness
from trainer.rollout.thread_worker import ThreadBackend
from trainer.types import RolloutBatch, Sample
from trainer.weight_sync import WeightSyncSender

TOK = build_tokenizer()


# ----------------------------------------------------------------------------------------------- config
def _rl(**kw) -> RLTrainingConfig:
    return config_from_dict(RunConfig, {"rl": kw}, "").rl


def test_the_bound_sets_how_far_generation_runs_ahead():
    assert _rl().generation_ahead == 0 and _rl(max_staleness=3).generation_ahead == 0  # synchronous
    assert _rl(async_rollout=True).generation_ahead == 1
    assert _rl(async_rollout=True, max_staleness=3).generation_ahead == 3
    assert _rl(async_rollout=True, max_staleness=3, sync_every=2).generation_ahead == 2  # engines lag one more
    assert _rl(max_staleness=5).rollout.max_staleness == 5  # the manager's cached samples: the same bound
    with pytest.raises(ConfigError, match="max_staleness >= 2"):
        _rl(async_rollout=True, max_staleness=1, sync_every=2)
    with pytest.raises(ConfigError, match="max_staleness >= 2"):
        _rl(max_staleness=1, sync_every=3)
    with pytest.raises(ConfigError, match="async_rollout"):
        _rl(async_rollout=True, max_staleness=0)
    with pytest.raises(ConfigError, match="moved to \\[rl\\] max_staleness"):
        config_from_dict(RunConfig, {"rl": {"rollout": {"max_staleness": 2}}}, "")
    with pytest.raises(ConfigError, match="stale_policy"):
        _rl(stale_policy="keep")


# ----------------------------------------------------------------------------------------------- the source
def _batch(step: int) -> RolloutBatch:
    return RolloutBatch(samples=(Sample(prompt=str(step), tokens=(1, 2), response_length=1),))


def test_the_source_draws_at_most_k_ahead_and_snapshots_before_the_next_draw():
    events: list[tuple[str, int]] = []
    lock = threading.Lock()

    def batches():
        m = 0
        while True:
            m += 1
            with lock:
                events.append(("draw", m))
            yield _batch(m)

    def state() -> dict:  # read in the drawing thread, right after each batch
        with lock:
            m = max(m for kind, m in events if kind == "draw")
            events.append(("snapshot", m))
        return {"drawn": m}

    taken = []
    k, num_steps = 3, 8
    backend = ThreadBackend(batches(), threaded=True, state=state)
    with RolloutService(backend, num_steps=num_steps, ahead=k, on_drawn=lambda *a: taken.append(a)) as source:
        for step in range(1, num_steps + 1):
            batch = source.next(step)
            assert batch.samples[0].prompt == str(step)
            time.sleep(0.02)  # training: the worker runs ahead meanwhile
            with lock:
                drawn_so_far = max(m for kind, m in events if kind == "draw")
            assert drawn_so_far <= min(step + k, num_steps)  # never more than k steps ahead, never past the end
    draws = [m for kind, m in events if kind == "draw"]
    assert draws == list(range(1, num_steps + 1))
    for m in range(1, num_steps):  # the state after batch m is read before batch m+1 is drawn
        assert events.index(("snapshot", m)) < events.index(("draw", m + 1))
    assert taken == [(m, {"drawn": m}) for m in range(1, num_steps + 1)]  # each batch's own state, when taken


def test_paused_holds_the_worker_between_two_batches():
    started = []

    def batches():
        m = 0
        while True:
            m += 1
            started.append(m)
            time.sleep(0.05)
            yield _batch(m)

    with RolloutService(ThreadBackend(batches(), threaded=True), num_steps=6, ahead=2) as source:
        source.next(1)  # batches 2 and 3 queued; the worker starts on them
        with source.paused():
            begun = list(started)
            time.sleep(0.3)  # long enough for two more batches, were the worker free
            assert started == begun  # nothing started while paused (the ones queued when asked finished first)
        assert source.next(2).samples[0].prompt == "2"


def test_a_batch_queued_before_a_sync_is_generated_before_it_even_if_its_worker_starts_late():
    """Which weights a batch comes from must not depend on thread timing (`[rl] deterministic` runs repeat): a batch
    queued before `paused()` (the weight sync's block) is generated before the block, also when the worker has not
    started it yet (here: a worker that starts each batch 0.2 s late, as a loaded machine's may)."""
    version = [0]

    def batches():
        m = 0
        while True:
            m += 1
            yield RolloutBatch(samples=(Sample(prompt=str(m), tokens=(1, 2), response_length=1),),
                               metadata={"version": version[0]})

    backend = ThreadBackend(batches(), threaded=True)
    generate = backend._generate

    def late(step):
        time.sleep(0.2)
        return generate(step)

    backend._generate = late
    with RolloutService(backend, num_steps=4, ahead=1) as source:
        assert source.next(1).metadata["version"] == 0  # batch 2 is queued now, its worker not started yet
        with source.paused():
            version[0] = 1  # the sync after step 1
        assert source.next(2).metadata["version"] == 0  # queued before the sync: generated before it
        assert source.next(3).metadata["version"] == 1


class _Pausable:
    """An engine's pause_generation / continue_generation, logged."""

    def __init__(self, log: list) -> None:
        self.log = log

    async def pause_generation(self) -> None:
        self.log.append("pause")

    async def continue_generation(self) -> None:
        self.log.append("continue")


@pytest.mark.parametrize("in_place", [False, True])
def test_one_pause_for_a_weight_load_chosen_by_the_policy(in_place):
    """[rl] update_in_flight: the engines pause in place for the load only (the block after it, an evaluation, runs
    beside the rollouts); otherwise no batch runs for the whole block (the load, then the evaluation)."""
    log: list[str] = []
    backend = ThreadBackend((_batch(m) for m in range(1, 2)), threaded=False)
    with RolloutService(backend, num_steps=1, engines=[_Pausable(log)], in_place=in_place) as source:
        with source.paused(load=lambda: log.append("load") or 7.5) as loaded:
            log.append("block, rollouts held" if backend._engines.locked() else "block")
    assert loaded == 7.5
    assert log == (["pause", "load", "continue", "block"] if in_place else ["load", "block, rollouts held"])


def test_one_policy_derives_the_bound_for_every_part():
    """How far rollouts run ahead, the version they are measured against and which lag is past the bound: one
    StalenessPolicy, the config's (the rollout service, the manager's cache and within_staleness read it)."""
    p = _rl(async_rollout=True, max_staleness=3, sync_every=2).staleness
    assert (p.engine_lag, p.ahead, p.train_version(5)) == (1, 2, 8)  # started at 5: trains at 5 + 2 + 1, at the latest
    sync = _rl(max_staleness=2, sync_every=3).staleness
    assert (sync.ahead, sync.train_version(5)) == (0, 7)
    assert not past_bound(8, 5, 3) and past_bound(9, 5, 3)
    assert StalenessPolicy(1, sync_every=3).problem() is not None and StalenessPolicy(2, sync_every=3).problem() is None


# ----------------------------------------------------------------------------------------------- the bound
def _samples(versions: list[int], groups: list[int]) -> tuple[Sample, ...]:
    return tuple(Sample(prompt=f"p{g}", tokens=(1, 2, 3), response_length=2, weight_version=v, reward=float(i),
                        group_index=g, metadata={"weight_versions": [v]})
                 for i, (v, g) in enumerate(zip(versions, groups)))


@pytest.mark.parametrize("policy", ["drop", "regenerate"])
def test_no_sample_past_the_bound_trains(policy):
    cfg = _rl(max_staleness=2, stale_policy=policy)
    batch = RolloutBatch(samples=_samples([9, 8, 6, 9, 7, 5], [0, 0, 1, 1, 2, 2]))  # lags at version 9: 0 1 3 0 2 4
    sent_back = []
    kept, metrics = within_staleness(batch, 9, cfg.staleness, requeue=sent_back.extend)
    assert all(9 - s.weight_version <= 2 for s in kept.samples)
    assert metrics["staleness/past_bound"] == pytest.approx(2 / 6) and metrics["staleness/max"] == 4.0
    assert metrics["staleness/mean"] == pytest.approx((0 + 1 + 3 + 0 + 2 + 4) / 6)
    assert metrics["staleness/frac_0"] == pytest.approx(2 / 6) and metrics["staleness/frac_2"] == pytest.approx(1 / 6)
    if policy == "drop":  # only the stale samples go; their groups' baselines are the rest
        assert [s.reward for s in kept.samples] == [0.0, 1.0, 3.0, 4.0] and sent_back == []
        assert metrics["staleness/dropped"] == pytest.approx(2 / 6)
    else:  # whole groups go back to the manager, to be generated again from their prompts
        assert [s.reward for s in kept.samples] == [0.0, 1.0]
        assert sorted(len(g) for g in sent_back) == [2, 2]
        assert {s.group_index for g in sent_back for s in g} == {1, 2}
        assert metrics["staleness/regenerated"] == pytest.approx(4 / 6)
    fresh, m = within_staleness(RolloutBatch(samples=_samples([9, 9], [0, 0])), 9, cfg.staleness,
                                requeue=sent_back.extend)
    assert fresh.samples == _samples([9, 9], [0, 0]) and m["staleness/past_bound"] == 0.0
    with pytest.raises(RuntimeError, match="every sample of this batch is past"):
        within_staleness(RolloutBatch(samples=_samples([1, 1], [0, 0])), 9, cfg.staleness, requeue=sent_back.extend)


def test_requeued_groups_restart_from_their_prompts_first_in_the_next_batch():
    import trio

    from trainer.rollout.manager import AsyncRolloutManager

    eng = LocalEngine("tiny", seed=1)
    try:
        cfg = RolloutConfig(rollout_batch_size=2, n_samples_per_prompt=2, max_new_tokens=4, seed=5,
                            apply_chat_template=False)
        manager = AsyncRolloutManager([eng], cfg, tokenizer=TOK, reward_fn=digit_fraction, deterministic=True)
        buffer = DataBuffer(load_jsonl("data/arithmetic_train.jsonl"), seed=0)

        async def one():
            async with manager:
                return await manager.generate_batch(buffer)

        first = trio.run(one)
        group = [s for s in first.samples if s.group_index == first.samples[0].group_index]
        manager.requeue([group])
        second = trio.run(one)
    finally:
        eng.close()
    again = [s for s in second.samples if s.group_index == group[0].group_index]
    assert [s.prompt for s in again] == [s.prompt for s in group]  # the same prompt, generated again
    assert all(s.metadata["weight_versions"] == [0] for s in again)  # from the prompt: one fresh segment
    assert buffer.state_dict()["draws"] == 2 + 1  # the requeued group took one of the second batch's two places


def _run_async(out, rollout: RolloutConfig, *, num_steps: int, token_budget: int, **kw) -> tuple:
    """An async GRPO run of the tiny model against an in-process engine: (final state, per-step metrics)."""
    eng = LocalEngine("tiny", seed=1)
    cfg = RLTrainingConfig(optim=OptimConfig(lr=1e-2, warmup_steps=0, min_lr_ratio=1.0), num_steps=num_steps,
                           token_budget=token_budget, micro_batch_buckets=32, loss={"loss_agg": "token-mean"},
                           output_dir=str(out), rollout=rollout, async_rollout=True, **kw)
    tcfg = trainer_config_from(cfg, compile=False)
    try:
        with use_backend("torch"):
            comp = build_components(tiny_model_config("llama"), tcfg)
            sender = WeightSyncSender(comp.model, [eng], timeout_s=60)
            sender.init_group()
            try:
                _, state, history = rl.run_rl_training(
                    None, DataBuffer(load_jsonl("data/arithmetic_train.jsonl"), seed=0), cfg, engines=[eng],
                    sender=sender, tokenizer=TOK, reward_fn=digit_fraction, trainer_config=tcfg, components=comp)
            finally:
                sender.close()
    finally:
        eng.close()
    return state, history


def test_an_async_run_k_ahead_trains_nothing_past_the_bound(tmp_path, monkeypatch):
    """GRPO with async_rollout and max_staleness = 2: some batches really are two versions old (generation ran two
    steps ahead), none older; the staleness metrics are logged. Training is slowed down (a sleep in the step) so
    that generation always gets ahead, whatever the machine's load."""
    step = rl.train_on_batch

    def slow_step(*args, **kw):
        time.sleep(0.3)
        return step(*args, **kw)

    monkeypatch.setattr(rl, "train_on_batch", slow_step)
    rollout = RolloutConfig(rollout_batch_size=2, n_samples_per_prompt=2, max_new_tokens=4, temperature=1.0, seed=5,
                            apply_chat_template=False)
    _, history = _run_async(tmp_path, rollout, num_steps=6, token_budget=128, max_staleness=2)
    lags = [h["staleness/max"] for h in history]
    assert max(lags) == 2 and all(h["staleness/past_bound"] == 0.0 for h in history), lags
    assert all(abs(sum(h[f"staleness/frac_{j}"] for j in range(3)) - 1.0) < 1e-9 for h in history)


def test_the_data_buffer_refuses_a_second_reader():
    buffer = DataBuffer(load_jsonl("data/arithmetic_train.jsonl"), seed=0)
    with buffer._exclusive("a worker drawing"):  # another thread in the middle of a draw
        with pytest.raises(RuntimeError, match="another thread is reading or advancing"):
            buffer.state_dict()
        with pytest.raises(RuntimeError, match="another thread"):
            buffer.get_prompts(1)
    assert buffer.get_prompts(2) and buffer.state_dict()["draws"] == 2


@pytest.mark.skipif(0 not in __import__("os").sched_getaffinity(0), reason="needs core 0")
def test_an_engine_started_with_cpus_runs_on_those_cores_only():
    import os

    from engines.embedded.launch import EngineProcess

    with EngineProcess("tiny", cpus=(0,), threads=1, start_timeout_s=120, device="cpu") as proc:
        assert os.sched_getaffinity(proc.proc.pid) == {0}
    with pytest.raises(ValueError, match="only an \"embedded\" engine the run starts"):
        from engines.registry import EngineSpec

        EngineSpec(kind="embedded", url="http://127.0.0.1:1", cpus=(0,))


# ----------------------------------------------------------------------------------------------- in flight
def _greedy_logprobs(model, prompt: list[int], out: list[int]) -> list[float]:
    """log pi(token) of each output token under `model`, one full forward (temperature 1)."""
    import torch

    ids = torch.tensor([prompt + out])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt) - 1:-1], -1)
    return lp.gather(-1, torch.tensor(out)[:, None])[:, 0].tolist()


def test_an_update_in_flight_splits_a_request_between_two_versions(tmp_path):
    """A request runs; the engine pauses in place, loads other weights, goes on. Its tokens say which weights made
    them (version 0, then 1); the tokens before the load have the old model's log-probs, and a request after it is
    served by the new weights exactly (the engine's log-probs are a plain forward's of the new model)."""
    import torch
    import trio

    from engines.embedded.presets import build_tiny_model
    from engines.protocol import SamplingParams

    old = build_tiny_model(seed=1)  # what LocalEngine("tiny", seed=1) serves
    new = build_tiny_model(seed=7)
    new.save_pretrained(tmp_path / "new")
    eng = LocalEngine("tiny", seed=1)
    prompt, params = [5, 9, 13, 17], SamplingParams(temperature=1.0, max_new_tokens=64, ignore_eos=True, seed=3)
    got: dict = {}
    try:
        def generate():
            got["out"] = trio.run(eng.generate, [prompt], params)[0][0]

        worker = threading.Thread(target=generate)
        worker.start()
        deadline = time.monotonic() + 60
        while eng.server.steps < 8 and time.monotonic() < deadline:
            time.sleep(0.001)
        trio.run(eng.pause_generation)
        at_pause = eng.server.steps
        trio.run(lambda: eng.update_weights_from_disk(str(tmp_path / "new"), weight_version=1))
        assert eng.server.steps == at_pause  # nothing ran while paused
        trio.run(eng.continue_generation)
        worker.join(timeout=60)
        after = trio.run(eng.generate, [prompt], SamplingParams(temperature=1.0, max_new_tokens=12, seed=4))[0][0]
    finally:
        eng.close()
    out = got["out"]
    (start0, v0), (split, v1) = out.weight_versions
    assert (start0, v0, v1) == (0, 0, 1) and 0 < split < 64 and len(out.output_ids) == 64
    assert out.oldest_version == 0 and out.weight_version == 1
    before = _greedy_logprobs(old, prompt, out.output_ids)[:split]
    assert max(abs(a - b) for a, b in zip(before, out.logprobs[:split])) < 1e-4  # the old weights made these
    fresh = _greedy_logprobs(new, prompt, after.output_ids)
    assert after.weight_versions == ((0, 1),)
    assert max(abs(a - b) for a, b in zip(fresh, after.logprobs)) < 1e-4  # engine == new model after the load
    del torch


def test_an_async_run_updates_the_engines_in_flight(tmp_path, monkeypatch):
    """GRPO, async, [rl] update_in_flight: the syncs land while the next batch generates (the engine's decode steps
    are slowed so that they do), some samples hold tokens of two versions, none trains past the bound (its oldest
    token)."""
    from engines.embedded import generation

    step, decode = rl.train_on_batch, generation.DecodeBatch.step
    seen: list = []

    def recorded_step(comp, state, batch, *args, **kw):
        seen.extend(batch.samples)
        return step(comp, state, batch, *args, **kw)

    def slow_decode(self, *args, **kw):
        time.sleep(0.02)
        return decode(self, *args, **kw)

    monkeypatch.setattr(rl, "train_on_batch", recorded_step)
    monkeypatch.setattr(generation.DecodeBatch, "step", slow_decode)
    rollout = RolloutConfig(rollout_batch_size=4, n_samples_per_prompt=2, max_new_tokens=24, temperature=1.0,
                            seed=5, apply_chat_template=False, stop_token_ids=())
    state, history = _run_async(tmp_path, rollout, num_steps=5, token_budget=256, max_staleness=1,
                                update_in_flight=True)
    assert state.step == 5 and all(h["staleness/past_bound"] == 0.0 for h in history)
    split = [s for s in seen if len({v for _, v in s.metadata["token_versions"]}) > 1]
    assert split, "no sample saw an update in flight"
    for s in split:
        runs = s.metadata["token_versions"]
        assert [o for o, _ in runs] == sorted(o for o, _ in runs) and runs[0][0] == 0
        assert s.weight_version == min(v for _, v in runs)  # the bound reads the oldest token


def test_the_rollout_worker_runs_on_its_own_cores():
    """[trainer] rollout_cpus: the async worker thread (requests, responses, rewards) pins itself, not the trainer."""
    import os

    seen = []

    def batches():
        while True:
            seen.append(os.sched_getaffinity(0))
            yield _batch(len(seen))

    mine = os.sched_getaffinity(0)
    backend = ThreadBackend(batches(), threaded=True, worker_cpus=(min(mine),))
    with RolloutService(backend, num_steps=2, ahead=1) as source:
        source.next(1)
        source.next(2)
    assert seen == [{min(mine)}, {min(mine)}] and os.sched_getaffinity(0) == mine
