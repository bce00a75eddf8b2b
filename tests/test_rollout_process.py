"""[rl] rollout_worker = "process" (trainer.rollout.process_worker): the rollout's client side in a process of its
own draws exactly the batches, and records exactly the resumable state, of the thread worker; its failures reach
the trainer as the same exceptions, and a child that dies is an error, not a hang. Against the real embedded
engine over HTTP (the shared `engine` fixture)."""

from __future__ import annotations

import os
import signal
import time

import pytest
from device_support import cpu_child_env
from engine_support import digit_fraction

import trainer.rl as rl
from engines.local import LocalEngine
from engines.protocol import EngineUnavailableError
from engines.sglang import SGLangEngine
from engines.tiny import build_tokenizer, tiny_model_config
from kernels import use_backend
from trainer.backend.steps import build_components, trainer_config_from
from trainer.config import (
    ConfigError,
    OptimConfig,
    RewardsConfig,
    RLTrainingConfig,
    RolloutConfig,
    RunConfig,
    config_from_dict,
)
from trainer.data.buffer import DataBuffer, load_jsonl
from trainer.rewards.sources import RewardsRecipe
from trainer.rollout.manager import AsyncRolloutManager, generate_rollout_batches
from trainer.rollout.process_worker import RolloutProcess, RolloutRecipe, check_picklable
from trainer.rollout.resume import ResumePoints, rollout_state
from trainer.rollout.service import RolloutService
from trainer.rollout.thread_worker import ThreadBackend
from trainer.weight_sync import WeightSyncSender

ENGINE_SEED = 2  # the shared `engine` fixture (tests/conftest.py)
TOK = build_tokenizer()


def _rollout(**kw) -> RolloutConfig:
    base = dict(rollout_batch_size=3, n_samples_per_prompt=2, max_new_tokens=4, temperature=1.0, seed=11,
                apply_chat_template=False, max_retries=0, retry_backoff_s=0.0)
    return RolloutConfig(**(base | kw))


def _parts(url: str, rollout: RolloutConfig, *, buffer_seed: int = 3) -> tuple[DataBuffer, AsyncRolloutManager]:
    buffer = DataBuffer(load_jsonl("data/arithmetic_train.jsonl"), seed=buffer_seed)
    # deterministic: one request at a time per engine, so the tokens do not depend on arrival order
    manager = AsyncRolloutManager([SGLangEngine(url)], rollout, tokenizer=TOK, reward_fn=digit_fraction,
                                  deterministic=True)
    return buffer, manager


def _recipe(buffer, manager, rollout, *, first_step: int = 1, **kw) -> RolloutRecipe:
    shorthand = RewardsRecipe(RewardsConfig(), digit_fraction, timeout_s=30.0)  # [data].reward alone
    return RolloutRecipe(**({"data_buffer": buffer, "rollout": rollout, "engines": tuple(manager.engines),
                             "tokenizer": TOK, "rewards": shorthand, "deterministic": True,
                             "manager_state": manager.state_dict(), "first_step": first_step} | kw))


def _view(batch) -> list[tuple]:
    """What a batch trains on: per sample its prompt, tokens, mask, engine log-probs, reward, group and status."""
    return [(s.prompt, s.tokens, s.loss_mask, s.rollout_logprobs, s.reward, s.group_index, s.status)
            for s in batch.samples]


def _assert_same_batches(got: list[list[tuple]], want: list[list[tuple]]) -> None:
    """_view's batches equal field for field, the engine log-probs within 1e-5: the engine's prefix cache
    ([engines] prefix_cache_tokens) serves a prompt's cached prefix to whichever run comes second, and a prefill
    from cached KV differs from a full one in the last bits (the same tokens; tests/test_prefix_cache.py)."""
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert [r[:3] + r[4:] for r in g] == [r[:3] + r[4:] for r in w]
        for a, b in zip(g, w, strict=True):
            assert a[3] == pytest.approx(b[3], abs=1e-5)


def _thread_run(url, rollout, steps, ahead, *, rewards=None, view=_view):
    """rewards: built RewardSources (trainer.rewards.sources), scored as the thread worker scores them."""
    from trainer.rewards.sources import scored_batches

    buffer, manager = _parts(url, rollout)
    if rewards is not None:
        manager.reward_fn = rewards.rollout_reward()
    points = ResumePoints({"data_buffer": buffer, "rollout_manager": manager}, step=0, keep=steps + 1)
    batches = generate_rollout_batches(buffer, rollout, manager=manager, weight_version=lambda: 0)
    if rewards is not None:
        batches = scored_batches(batches, rewards)
    backend = ThreadBackend(batches, threaded=ahead > 0, state=lambda: rollout_state(buffer, manager))
    with RolloutService(backend, num_steps=steps, ahead=ahead, on_drawn=points.record) as source:
        got = [view(source.next(s)) for s in range(1, steps + 1)]
    return got, [points.at(s) for s in range(1, steps + 1)]


def _process_run(url, rollout, steps, ahead, *, first_step: int = 1, state=None, rewards=None, view=_view):
    """rewards: a RewardsRecipe, rebuilt in the child in place of the recipe's [data].reward shorthand."""
    buffer, manager = _parts(url, rollout)
    if state is not None:  # a resumed run: the state a checkpoint of step first_step - 1 holds
        buffer.load_state_dict(state["data_buffer"])
        manager.load_state_dict(state["rollout_manager"])
    points = ResumePoints({"data_buffer": buffer, "rollout_manager": manager}, step=first_step - 1, keep=steps + 1)
    reward = {} if rewards is None else {"rewards": rewards}
    proc = RolloutProcess(_recipe(buffer, manager, rollout, first_step=first_step, **reward), version=lambda: 0)
    with RolloutService(proc, num_steps=steps, ahead=ahead, on_drawn=points.record) as source:
        got = [view(source.next(s)) for s in range(first_step, steps + 1)]
    return got, [points.at(s) for s in range(first_step, steps + 1)]


def test_the_process_draws_the_thread_workers_batches_and_resumable_state(engine):
    """Three steps, generation one step ahead: the same samples token for token (prompts, tokens, engine log-probs,
    rewards, groups) and, at every step, the same data position and rollout state for a checkpoint; then a run
    resumed from the step-1 state draws the uninterrupted run's steps 2 and 3."""
    rollout = _rollout()
    thread_batches, thread_states = _thread_run(engine.url, rollout, 3, 1)
    proc_batches, proc_states = _process_run(engine.url, rollout, 3, 1)
    assert len(thread_batches) == 3 and all(len(b) == 3 * 2 for b in thread_batches)
    assert len({b[0][0] for b in thread_batches}) == 3  # three different first prompts: the buffer moved
    _assert_same_batches(proc_batches, thread_batches)
    assert proc_states == thread_states
    resumed_batches, _ = _process_run(engine.url, rollout, 3, 1, first_step=2, state=thread_states[0])
    _assert_same_batches(resumed_batches, thread_batches[1:])


def test_requeued_groups_reach_the_process_and_come_back_from_their_prompts(engine):
    rollout = _rollout(rollout_batch_size=2)
    buffer, manager = _parts(engine.url, rollout)
    proc = RolloutProcess(_recipe(buffer, manager, rollout), version=lambda: 0)
    with RolloutService(proc, num_steps=3) as source:
        first = source.next(1)
        group = [s for s in first.samples if s.group_index == first.samples[0].group_index]
        source.requeue([group])
        second = source.next(2)
    again = [s for s in second.samples if s.prompt == group[0].prompt]
    assert len(again) == len(group) and all(s.metadata["weight_versions"] == [0] for s in again)
    # The requeued group took one of the second batch's two places: one new prompt was drawn, not two.
    assert len({s.group_index for s in second.samples}) == 2


def test_paused_waits_for_the_batch_in_flight_and_holds_the_next(engine):
    """Generation two steps ahead: inside paused() no batch is being generated (the engine is idle) and none is
    started until the block ends; the batches started after it carry the version given at resume (the manager's
    weight version, recorded with each batch's state)."""
    import httpx

    rollout = _rollout()
    buffer, manager = _parts(engine.url, rollout)
    points = ResumePoints({"data_buffer": buffer, "rollout_manager": manager}, step=0, keep=5)
    version = [0]
    proc = RolloutProcess(_recipe(buffer, manager, rollout), version=lambda: version[0])
    with RolloutService(proc, num_steps=4, ahead=2, on_drawn=points.record) as source:
        source.next(1)
        with source.paused():
            for _ in range(3):  # the engine runs nothing while paused
                info = httpx.get(engine.url + "/get_server_info", timeout=30).json()
                assert info["num_running_rows"] == 0 and info["num_waiting_rows"] == 0, info
                time.sleep(0.2)
            version[0] = 5
        for step in (2, 3, 4):
            source.next(step)
    drawn_with = [points.at(step)["rollout_manager"]["weight_version"] for step in (1, 2, 3, 4)]
    # Steps 2 (and maybe 3) were generating before the pause, with version 0; step 4 could only start after it.
    assert drawn_with[0] == 0 and drawn_with[-1] == 5, drawn_with


def test_a_failure_in_the_process_is_raised_as_itself(tmp_path):
    """An engine that does not answer: the rollout's own EngineUnavailableError reaches the trainer, at once."""
    rollout = _rollout(connect_timeout_s=2.0)
    dead = f"http://127.0.0.1:{_closed_port()}"
    buffer, manager = _parts(dead, rollout)
    proc = RolloutProcess(_recipe(buffer, manager, rollout), version=lambda: 0)
    t0 = time.perf_counter()
    with RolloutService(proc, num_steps=2, ahead=1) as source:
        with pytest.raises(EngineUnavailableError, match="127.0.0.1"):
            source.next(1)
    assert time.perf_counter() - t0 < 120


def test_a_process_that_dies_is_an_error_not_a_hang(engine):
    rollout = _rollout()
    buffer, manager = _parts(engine.url, rollout)
    proc = RolloutProcess(_recipe(buffer, manager, rollout), version=lambda: 0, poll_s=0.2)
    with RolloutService(proc, num_steps=5, ahead=1) as source:
        source.next(1)
        os.kill(proc._proc.pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="rollout process .* exited with code -9"):
            for step in range(2, 6):
                source.next(step)


def test_a_warmed_up_process_is_the_one_the_next_run_takes_and_a_spare_left_alone_exits(engine):
    from trainer.rollout import process_worker

    process_worker.warm_up()
    process_worker.warm_up()  # idempotent: one spare
    assert len(process_worker._spare) == 1
    spare_pid = process_worker._spare[0][0].pid
    rollout = _rollout()
    buffer, manager = _parts(engine.url, rollout)
    proc = RolloutProcess(_recipe(buffer, manager, rollout), version=lambda: 0)
    with RolloutService(proc, num_steps=1) as source:
        assert proc._proc.pid == spare_pid and not process_worker._spare
        assert len(source.next(1).samples) == 3 * 2
    process_worker.warm_up()
    child, conn = process_worker._take_spare()
    conn.close()  # the parent's end gone: the waiting child exits on its own
    child.join(timeout=60)
    assert child.exitcode == 0


def test_what_cannot_travel_to_the_process_is_named():
    rollout = _rollout()
    buffer = DataBuffer(load_jsonl("data/arithmetic_train.jsonl"), seed=0)
    local = LocalEngine("tiny", seed=0)
    try:
        manager = AsyncRolloutManager([local], rollout, tokenizer=TOK, reward_fn=digit_fraction, check_health=False)
        with pytest.raises(ValueError, match="engines .*in_process = false"):
            check_picklable(_recipe(buffer, manager, rollout))
    finally:
        local.close()
    manager = AsyncRolloutManager([SGLangEngine("http://127.0.0.1:1")], rollout, tokenizer=TOK,
                                  reward_fn=digit_fraction, check_health=False)
    with pytest.raises(ValueError, match="rewards .*not a lambda"):
        check_picklable(_recipe(buffer, manager, rollout,
                                rewards=RewardsRecipe(RewardsConfig(), default_rule=lambda s: 1.0)))


def test_reward_sources_score_in_the_process_as_in_the_thread_worker(engine, tmp_path):
    """[rewards] sources (a rule and a reward model, batch-normalised) with the rollout process: the child builds
    them from their recipe, loads the reward model itself and scores exactly what the thread worker scores (samples,
    each source's raw score, the combined rewards, the batch's reward metrics). The trainer's process, built as
    the CLI builds it for this worker, loads no reward model: scoring with its copy raises."""
    from test_reward_model import write_reward_model

    from trainer.config import RewardsConfig
    from trainer.rewards.sources import RewardSourceError, build_reward_sources

    rm = write_reward_model(tmp_path / "rm", seed=5)
    config = RewardsConfig(sources=[{"kind": "rule", "weight": 1.0}, {"kind": "model", "path": str(rm),
                                                                      "weight": 0.5}], normalize="batch")
    rollout, steps = _rollout(), 2

    def view(batch):
        return ([(*v, s.metadata["reward_sources"]) for v, s in zip(_view(batch), batch.samples)],
                batch.metadata["reward_metrics"], batch.metadata["reward_mean"])

    rewards = build_reward_sources(config, default_rule=digit_fraction, engines=[], tokenizer=TOK)
    thread, thread_states = _thread_run(engine.url, rollout, steps, 1, rewards=rewards, view=view)
    light = build_reward_sources(config, default_rule=digit_fraction, engines=[], tokenizer=TOK, load_models=False)
    with pytest.raises(RewardSourceError, match="not loaded in this process"):
        light.sources[1].score_batch([], [])
    process, process_states = _process_run(engine.url, rollout, steps, 1, rewards=light.recipe, view=view)
    assert process_states == thread_states
    assert all(len(samples) == 6 and set(samples[0][-1]) == {"digit_fraction", "model1"} for samples, _, _ in thread)
    # the engine log-probs within 1e-5 (the shared engine's prefix cache: _assert_same_batches), the rest exact
    _assert_same_batches([b for b, _, _ in process], [b for b, _, _ in thread])
    assert [(m, r) for _, m, r in process] == [(m, r) for _, m, r in thread]


def test_the_config_refuses_a_process_worker_it_cannot_run():
    with pytest.raises(ConfigError, match="rollout_worker"):
        config_from_dict(RunConfig, {"rl": {"rollout_worker": "fork"}}, "")
    from trainer.cli import load_run_config

    with pytest.raises(ConfigError, match="in_process = false"):
        load_run_config("configs/demo.toml", ["rl.rollout_worker=\"process\"", "engines.in_process=true"])
    rule = "{kind = \"rule\", name = \"trainer.rewards.rules:arithmetic_reward\"}"  # [rewards] sources: built there
    cfg = load_run_config("configs/demo.toml", ["rl.rollout_worker=\"process\"", "engines.in_process=false",
                                                f"rewards.sources=[{rule}]"])
    assert cfg.rl.rollout_worker == "process" and len(cfg.rewards.sources) == 1


def _closed_port() -> int:
    from engines.embedded.launch import free_port

    return free_port()  # nothing listens there


# ----------------------------------------------------------------------------------------------- a whole run
def _async_run(out, url: str, worker: str) -> list[tuple]:
    """Three async GRPO steps of the tiny model against the HTTP engine, its weights synced from the trainer (the
    same starting weights each run): what each step trained on and its loss."""
    rollout = _rollout(rollout_batch_size=2)
    cfg = RLTrainingConfig(optim=OptimConfig(lr=1e-2, warmup_steps=0, min_lr_ratio=1.0), num_steps=3,
                           token_budget=128, micro_batch_buckets=32, loss={"loss_agg": "token-mean"},
                           output_dir=str(out), rollout=rollout, async_rollout=True, deterministic=True,
                           rollout_worker=worker)
    tcfg = trainer_config_from(cfg, compile=False)
    seen: list[tuple] = []
    step = rl.train_on_batch

    def recording(components, state, batch, *args, **kw):
        metrics, new_state = step(components, state, batch, *args, **kw)
        seen.append((_view(batch), metrics["loss"]))
        return metrics, new_state

    eng = SGLangEngine(url)
    with use_backend("torch"), pytest.MonkeyPatch.context() as mp:
        mp.setattr(rl, "train_on_batch", recording)
        comp = build_components(tiny_model_config("llama"), tcfg)
        sender = WeightSyncSender(comp.model, [eng], timeout_s=60)
        sender.init_group()
        try:
            rl.run_rl_training(None, DataBuffer(load_jsonl("data/arithmetic_train.jsonl"), seed=0), cfg,
                               engines=[eng], sender=sender, tokenizer=TOK, reward_fn=digit_fraction,
                               trainer_config=tcfg, components=comp)
        finally:
            sender.close()
    return seen


def test_an_async_run_trains_the_same_steps_with_either_worker(engine, tmp_path):
    thread = _async_run(tmp_path / "thread", engine.url, "thread")
    process = _async_run(tmp_path / "process", engine.url, "process")
    assert len(thread) == len(process) == 3
    assert [v for v, _ in process] == [v for v, _ in thread]  # the same samples, token for token
    for (_, a), (_, b) in zip(process, thread):
        assert a == pytest.approx(b, rel=1e-6, abs=1e-9)


# ----------------------------------------------------------------------------------------------- the HTTP client
def test_the_engine_client_spreads_requests_over_small_pools():
    """SGLangEngine keeps ceil(max_connections / 8) pooled clients per event loop (httpcore's pool scans every
    connection per waiting request per event: quadratic in one large pool) and gives each request the least busy
    one; together they still allow max_connections connections."""
    import contextlib

    import trio

    from engines.sglang import SHARD_CONNECTIONS

    eng = SGLangEngine("http://127.0.0.1:1", max_connections=20)

    async def hold(n: int) -> list[int]:
        with contextlib.ExitStack() as stack:
            for _ in range(n):
                stack.enter_context(eng._client())
            loads = [load for _, load in eng._shards()]
        assert all(load == 0 for _, load in eng._shards())  # released
        limits = [c._transport._pool._max_connections for c, _ in eng._shards()]
        await eng.aclose()
        return loads, limits

    loads, limits = trio.run(hold, 20)
    assert len(loads) == 3 and sum(loads) == 20 and max(loads) - min(loads) <= 1
    assert all(lim <= SHARD_CONNECTIONS for lim in limits) and sum(limits) >= 20


def test_a_cli_run_scores_with_a_reward_model_in_the_rollout_process(tmp_path):
    """`python -m trainer rl` with async generation from a rollout process and [rewards] sources (a rule and a
    reward model): the run finishes, and every step logs both sources' means and a reward that combines them."""
    import json
    import math
    import subprocess
    import sys
    from pathlib import Path

    from test_reward_model import write_reward_model

    root = Path(__file__).resolve().parents[1]
    rm = write_reward_model(tmp_path / "rm", seed=4)
    out = tmp_path / "run"
    sources = ('[{kind = "rule", name = "trainer.rewards.rules:arithmetic_reward"}, '
               f'{{kind = "model", path = "{rm}", weight = 0.5}}]')
    cmd = [sys.executable, "-m", "trainer", "rl", "--config", "configs/demo.toml", "--set", f"output_dir=\"{out}\"",
           "--set", "rl.num_steps=2", "--set", "rl.rollout.rollout_batch_size=4", "--set", "eval.limit=4",
           "--set", "rl.async_rollout=true", "--set", "engines.in_process=false",
           "--set", "rl.rollout_worker=\"process\"", "--set", f"rewards.sources={sources}"]
    proc = subprocess.run(cmd, cwd=root, env=cpu_child_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        rule, model = r["reward/arithmetic_reward_mean"], r["reward/model1_mean"]
        assert math.isfinite(model) and 0.0 <= rule <= 1.0 and r["reward/model1_failed"] == 0.0
        assert r["reward_mean"] == pytest.approx(rule + 0.5 * model, abs=1e-5)  # weights 1 and 0.5, no normalising
