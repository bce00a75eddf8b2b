"""Nothing lost, round 2 (issue 44, items 2-4): user code that hangs and runs that cannot finish.

- A sync environment method that blocks fails its own episode at [rl.rollout] env_timeout_s (FAILED, counted), and
  the rest of the batch goes on; a cancelled batch (what Ctrl-C does to the rollout) leaves a blocked method at once.
- A hung tool gives its thread slot back at its timeout: sync reward functions, which run on trio's default thread
  limiter, still get threads and score.
- A step where most samples were truncated or failed warns; [rl.rollout] max_truncated_steps steps in a row with
  nothing to learn from (every sample truncated or failed, equal rewards) stop the run with an error naming the
  length limits.

Blocking user code waits on a threading.Event that the test sets at its end (with a timeout of its own, so that
code which waits for it in the event loop ends the test with a failure rather than a hang).
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import trio
from device_support import cpu_child_env
from episode_support import CHAR_STOPS, TOK, Scripted, arithmetic_buffer

from trainer.backend.checkpoint import is_interrupt
from trainer.config import RolloutConfig
from trainer.data.buffer import DataBuffer, Prompt
from trainer.rewards.rules import with_timeout
from trainer.rl import TruncatedRunError, check_finishing
from trainer.rollout.blocking import abandoned_threads
from trainer.rollout.manager import AsyncRolloutManager, generate_rollout_batches
from trainer.rollout.service import RolloutService
from trainer.rollout.thread_worker import ThreadBackend
from trainer.types import Sample, Status

ROOT = Path(__file__).resolve().parents[1]

HOLD_S = 10.0  # how long blocked user code waits for the test to release it (never reached when the code is right)


def settled() -> int:
    """abandoned_threads() once the threads abandoned so far ended (up to 5 s: earlier tests' slow tools)."""
    deadline = time.monotonic() + 5
    while abandoned_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    return abandoned_threads()


@pytest.fixture
def release():
    """The event blocked user code waits on: set at the end of the test, and the abandoned threads seen to end."""
    assert settled() == 0
    event = threading.Event()
    yield event
    event.set()
    assert settled() == 0


def run_batch(cfg, *, engine, buffer, reward="arithmetic", within_s=None):
    """One batch of a fresh manager; with `within_s`, the batch is cancelled after that long (None back)."""
    manager = AsyncRolloutManager([engine], cfg, tokenizer=TOK, reward_fn=reward, check_health=False)

    async def run():
        async with manager:
            if within_s is None:
                return await manager.generate_batch(buffer)
            with trio.move_on_after(within_s):
                return await manager.generate_batch(buffer)
            return None

    return trio.run(run)


# ----------------------------------------------------------------------------------------------- environments
def blocking_env(release: threading.Event, method: str, blocked_index: int = 0):
    """An environment (a user's: plain methods, dict steps) whose `method` blocks for sample `blocked_index`."""

    class Stuck:
        def reset(self, prompt, metadata):
            self.index = metadata["sample_index"]
            if method == "reset" and self.index == blocked_index:
                release.wait(HOLD_S)
            return [{"role": "user", "content": prompt}]

        def step(self, message):
            if method == "step" and self.index == blocked_index:
                release.wait(HOLD_S)
            return {"messages": [], "reward": 1.0 + self.index, "done": True}

    return Stuck


@pytest.mark.parametrize("method", ["reset", "step"])
def test_a_blocking_env_method_fails_its_episode_and_the_batch_goes_on(release, method):
    cfg = RolloutConfig(rollout_batch_size=1, n_samples_per_prompt=3, max_new_tokens=8, seed=1,
                        env=blocking_env(release, method), env_timeout_s=0.5)
    t0 = time.monotonic()
    batch = run_batch(cfg, engine=Scripted(lambda text: "7"), buffer=arithmetic_buffer(1))
    assert time.monotonic() - t0 < 3.0  # the timeout, not the blocked call, ended the episode
    s0, s1, s2 = batch.samples
    assert s0.status == Status.FAILED and s0.reward == 0.0 and s0.metadata["env_timed_out"] is True
    assert s0.metadata["env_error"] == (
        f"BlockedCallTimeout: environment Stuck.{method} took longer than 0.5 s; its thread was abandoned (it runs "
        f"on, its result dropped): make it faster (or async) or raise [rl.rollout] env_timeout_s")
    # The other episodes of the group finished with their environment's rewards.
    assert [(s.status, s.reward) for s in (s1, s2)] == [(Status.COMPLETED, 2.0), (Status.COMPLETED, 3.0)]
    md = batch.metadata
    assert (md["env_errors"], md["env_timeouts"], md["failed_fraction"]) == (1, 1, pytest.approx(1 / 3))
    assert md["abandoned_threads"] == 1  # the blocked call still runs, in a thread nobody waits for
    assert s0.metadata["env_seconds"] == pytest.approx(0.5, abs=0.4)


def all_blocked(release: threading.Event, *, from_group: int = 0):
    """An environment whose every step blocks, in the episodes of groups `from_group` on (group i: batch i + 1 of
    one-group batches)."""

    class AllStuck:
        def reset(self, prompt, metadata):
            self.blocks = metadata["group_uid"] >= from_group
            return [{"role": "user", "content": prompt}]

        def step(self, message):
            if self.blocks:
                release.wait(HOLD_S)
            return {"messages": [], "reward": 1.0, "done": True}

    return AllStuck


def test_a_cancelled_batch_leaves_a_blocked_env_step_at_once(release):
    """What Ctrl-C does to a rollout (trio cancels it): every episode is blocked in a sync step with a long
    env_timeout_s, and the batch still ends within a fraction of a second of the cancellation."""
    cfg = RolloutConfig(rollout_batch_size=1, n_samples_per_prompt=2, max_new_tokens=8, seed=1,
                        env=all_blocked(release), env_timeout_s=60.0)
    t0 = time.monotonic()
    assert run_batch(cfg, engine=Scripted(lambda text: "7"), buffer=arithmetic_buffer(1), within_s=0.5) is None
    assert time.monotonic() - t0 < 1.5
    assert abandoned_threads() == 2


def test_closing_an_async_source_stops_the_batch_being_generated_ahead(release):
    """Async rollouts ([rl] async_rollout): the worker thread generates batch n+1 while step n trains. A run that
    closes then (Ctrl-C) while that batch is blocked in its environment's steps does not wait for it."""
    cfg = RolloutConfig(rollout_batch_size=1, n_samples_per_prompt=2, max_new_tokens=8, seed=1,
                        env=all_blocked(release, from_group=1), env_timeout_s=60.0)
    manager = AsyncRolloutManager([Scripted(lambda text: "7")], cfg, tokenizer=TOK, reward_fn="arithmetic",
                                  check_health=False)
    batches = generate_rollout_batches(arithmetic_buffer(2), cfg, manager=manager)
    source = RolloutService(ThreadBackend(batches, threaded=True, cancel=manager.cancel), num_steps=3, ahead=1)
    first = source.next(1)  # batch 2 starts generating in the worker, and blocks
    assert [s.reward for s in first.samples] == [1.0, 1.0]
    time.sleep(0.3)
    t0 = time.monotonic()
    source.close()
    assert time.monotonic() - t0 < 2.0
    assert abandoned_threads() == 2


def test_ctrl_c_ends_a_batch_whose_async_env_steps_block_the_event_loop():
    """A plain time.sleep in an `async def step` blocks the rollout's event loop: no timeout or cancellation reaches
    it, only Ctrl-C (trio raises KeyboardInterrupt in it). No other episode then starts its step: before, each episode
    whose engine reply had arrived went on into its own blocking step after the interrupt (and the run hung for good
    with steps that never return)."""
    import os
    import signal

    started = []

    class LoopBlocker:
        def reset(self, prompt, metadata):
            return [{"role": "user", "content": prompt}]

        async def step(self, message):
            started.append(time.monotonic())
            time.sleep(1.0)  # the event loop stops with it
            return {"messages": [], "reward": 1.0, "done": True}

    def ctrl_c():
        while not started:
            time.sleep(0.01)
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGINT)

    # Three groups: the cancellation reaches each group's nursery in turn.
    cfg = RolloutConfig(rollout_batch_size=3, n_samples_per_prompt=2, max_new_tokens=8, seed=1, env=LoopBlocker,
                        env_timeout_s=60.0)
    sender = threading.Thread(target=ctrl_c, daemon=True)
    sender.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(BaseException) as e:  # noqa: PT011 - KeyboardInterrupt, alone or in trio's exception group
            run_batch(cfg, engine=Scripted(lambda text: "7"), buffer=arithmetic_buffer(3))
    finally:
        sender.join(timeout=5)  # its signal never lands in a later test
    took = time.monotonic() - t0
    assert is_interrupt(e.value), repr(e.value)
    assert len(started) == 1 and took < 2.0, (len(started), took)


# ----------------------------------------------------------------------------------------------- tools
def hang(expression: str) -> str:
    """A tool that hangs.

    Args:
        expression: ignored
    """
    HUNG.wait(HOLD_S)
    return "late"


HUNG = threading.Event()
CALL = '<tool_call>{"name": "hang", "arguments": {"expression": "1"}}</tool_call>'


def scored(sample: Sample) -> float:
    """A sync reward function (so it runs in a worker thread of trio's default limiter)."""
    return 1.0 if "408" in sample.response else 0.0


def test_a_hanging_tool_does_not_starve_the_sync_rewards():
    """48 episodes each call a tool that hangs: more than trio's default 40 threads. Each call is cut at
    tool_timeout_s and answered with an error naming the tool; the model then answers 408, and every reward (a
    sync function with a timeout of its own, on trio's default threads) still scores it."""
    assert settled() == 0
    HUNG.clear()
    eng = Scripted(lambda text: "408" if "<|im_start|>tool" in text else CALL)
    cfg = RolloutConfig(rollout_batch_size=6, n_samples_per_prompt=8, max_new_tokens=128, tools=(hang,),
                        tool_timeout_s=0.5, max_concurrency=64)
    buffer = DataBuffer([Prompt(f"12*34? ({i})", "408") for i in range(6)], seed=0)
    try:
        t0 = time.monotonic()
        batch = run_batch(cfg, engine=eng, buffer=buffer, reward=with_timeout(scored, 1.0))
        took = time.monotonic() - t0
        assert [s.status for s in batch.samples] == [Status.COMPLETED] * 48
        assert [s.reward for s in batch.samples] == [1.0] * 48
        assert all("reward_error" not in s.metadata for s in batch.samples)
        for s in batch.samples:
            (msg,) = [m["content"] for m in s.metadata["messages"] if m["role"] == "tool"]
            assert msg == "error: hang timed out after 0.5s" and s.metadata["tool_errors"] == 1
        # 48 calls on the tools' 32 threads: two waves of 0.5 s, then the answers and the rewards.
        assert 1.0 <= took < 4.0
        assert batch.metadata["abandoned_threads"] == 48 and batch.metadata["tool_errors"] == 48
    finally:
        HUNG.set()
    assert settled() == 0


# --------------------------------------------------------------------------------------- runs that cannot finish
def samples(*statuses: Status, rewards=None, truncated_by=None) -> list[Sample]:
    rewards = rewards or [0.0] * len(statuses)
    meta = {} if truncated_by is None else {"truncated_by": truncated_by}
    return [Sample(prompt="p", tokens=(1, 2), status=st, reward=r, metadata=dict(meta))
            for st, r in zip(statuses, rewards)]


T, C, F = Status.TRUNCATED, Status.COMPLETED, Status.FAILED
DEMO_LIKE = RolloutConfig(max_new_tokens=6, env="a:b")  # a multi-turn config with the demo's per-turn limit


def test_a_step_with_most_samples_truncated_or_failed_warns():
    streak, warning = check_finishing(samples(T, T, F, C), 0, DEMO_LIKE, step=7)
    assert streak == 0  # one sample finished: the step can learn
    assert warning == ("warning: step 7: 3 of 4 samples (75%) were truncated (2 by max_new_tokens) or failed (1); "
                       "if the model needs more room, raise [rl.rollout] max_new_tokens = 6 (per turn in multi-turn "
                       "episodes), max_context_tokens = 0 (0: none), max_turns = 4")
    assert check_finishing(samples(T, T, C, C), 0, DEMO_LIKE, step=7) == (0, None)  # half: no warning


def test_steps_with_nothing_to_learn_from_stop_the_run_naming_the_limits():
    batch = samples(T, T, T, F, truncated_by="context")
    streak = 0
    for step in (1, 2):
        streak, warning = check_finishing(batch, streak, DEMO_LIKE, step=step)
        assert streak == step and warning.startswith(f"warning: step {step}: 4 of 4 samples (100%)")
    with pytest.raises(TruncatedRunError) as err:
        check_finishing(batch, streak, DEMO_LIKE, step=3)
    assert str(err.value).startswith(
        "step 3: 3 steps in a row had nothing to learn from: every sample was truncated (3 by max_context_tokens) "
        "or failed (1) and the rewards were all 0.0, so every advantage and the loss were 0. The model runs out of "
        "room before it finishes: raise [rl.rollout] max_new_tokens = 6")
    assert "max_context_tokens = 0" in str(err.value) and "max_truncated_steps = 0" in str(err.value)
    # A step whose cut samples score differently trains: the streak starts again.
    assert check_finishing(samples(T, T, rewards=[0.0, 0.5]), 2, DEMO_LIKE, step=3)[0] == 0
    # max_truncated_steps = 0: never a stop, still the warning.
    streak, warning = check_finishing(batch, 99, dataclasses.replace(DEMO_LIKE, max_truncated_steps=0), step=100)
    assert streak == 100 and warning.startswith("warning: step 100: 4 of 4 samples (100%)")


class CutShort:
    """An engine wrapper whose every row runs to max_new_tokens (no stop token ends it): every sample TRUNCATED."""

    def __init__(self, engine) -> None:
        self._engine = engine

    def __getattr__(self, name):
        return getattr(self._engine, name)

    async def generate(self, prompts, params, *, rids=None):
        params = dataclasses.replace(params, ignore_eos=True, stop_token_ids=())
        return await self._engine.generate(prompts, params, rids=rids)


def test_a_run_that_never_finishes_a_sample_warns_then_stops(tmp_path, capsys):
    """The loop: steps 1 and 2 (every sample cut at max_new_tokens, every reward 0) train and warn; the batch of
    step 3 stops the run before it trains, with the error naming the limits."""
    from engines.local import LocalEngine
    from engines.tiny import tiny_model_config
    from kernels import use_backend
    from trainer.backend.steps import build_components, trainer_config_from
    from trainer.config import OptimConfig, RLTrainingConfig
    from trainer.data.buffer import load_jsonl
    from trainer.metrics import read_jsonl
    from trainer.rl import run_rl_training
    from trainer.weight_sync import WeightSyncSender

    rollout = RolloutConfig(rollout_batch_size=2, n_samples_per_prompt=2, max_new_tokens=4, seed=5,
                            apply_chat_template=False)
    cfg = RLTrainingConfig(optim=OptimConfig(lr=1e-2), num_steps=5, token_budget=128, micro_batch_buckets=32,
                           output_dir=str(tmp_path), rollout=rollout, deterministic=True)
    engine = LocalEngine("tiny", seed=1)
    with use_backend("torch"):
        tcfg = trainer_config_from(cfg, compile=False)
        comp = build_components(tiny_model_config("llama"), tcfg)
        sender = WeightSyncSender(comp.model, [engine], timeout_s=60)
        sender.init_group()
        try:
            with pytest.raises(TruncatedRunError) as err:
                run_rl_training(None, DataBuffer(load_jsonl("data/arithmetic_train.jsonl"), seed=0), cfg,
                                engines=[CutShort(engine)], sender=sender, tokenizer=TOK, reward_fn=lambda s: 0.0,
                                trainer_config=tcfg, components=comp)
        finally:
            sender.close()
            engine.close()
    assert str(err.value).startswith("step 3: 3 steps in a row had nothing to learn from: every sample was truncated "
                                     "(4 by max_new_tokens) or failed (0) and the rewards were all 0.0")
    assert "raise [rl.rollout] max_new_tokens = 4" in str(err.value)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and all(r["rollout/truncated_fraction"] == 1.0 for r in rows)
    warned = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: step")]
    assert [w.split(":")[1] for w in warned] == [" step 1", " step 2"]
    assert warned[0].startswith("warning: step 1: 4 of 4 samples (100%) were truncated (4 by max_new_tokens)")


QUIET_ENV = """
class Quiet:
    \"\"\"A user's multi-turn environment: it answers every turn, gives no reward, ends after two.\"\"\"

    def reset(self, prompt, metadata):
        self.turns = 0
        return [{"role": "user", "content": prompt}]

    def step(self, message):
        self.turns += 1
        return {"messages": [{"role": "user", "content": "go on"}], "reward": None, "done": self.turns == 2}
"""


def env_run(tmp_path: Path, source: str, env_class: str, *sets: str) -> list[str]:
    """`python -m trainer rl` on the demo config with the environment `source` (written to tmp_path) at 2 x 2
    samples a step, its output under tmp_path/run, and more `--set` pairs."""
    (tmp_path / "user_env.py").write_text(source)
    base = [f"output_dir=\"{tmp_path / 'run'}\"", "rl.rollout.rollout_batch_size=2",
            "rl.rollout.n_samples_per_prompt=2", f"rl.rollout.env=\"{tmp_path}/user_env.py:{env_class}\"",
            "eval.limit=2", *sets]
    return [sys.executable, "-m", "trainer", "rl", "--config", "configs/demo.toml",
            *(a for s in base for a in ("--set", s))]


def test_the_demo_config_with_a_multi_turn_env_stops_with_an_error_naming_max_new_tokens(tmp_path):
    """The issue's run: configs/demo.toml copied for a multi-turn environment keeps max_new_tokens = 6 per turn, so
    every episode of the (random) model is cut, scored 0. It used to exit 0 with reward=0.000 loss=0 at every step;
    now each step warns and the third stops the run: exit 1, one line `error: ...` naming the limits."""
    cmd = env_run(tmp_path, QUIET_ENV, "Quiet", "rl.num_steps=5")
    proc = subprocess.run(cmd, cwd=ROOT, env=cpu_child_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    assert [line.split(":")[1] for line in lines if line.startswith("warning: step")] == [" step 1", " step 2"]
    assert lines[-1].startswith("error: step 3: 3 steps in a row had nothing to learn from: every sample was "
                                "truncated (4 by max_new_tokens) or failed (0) and the rewards were all 0.0")
    assert "raise [rl.rollout] max_new_tokens = 6 (per turn in multi-turn episodes), max_context_tokens = 0" \
        in lines[-1]
    assert "Traceback" not in proc.stderr


STUCK_ENV = """
import threading
from pathlib import Path

NEVER = threading.Event()


class Stuck:
    # A user's environment whose step blocks for ever in training (evaluation's episodes go through).

    def reset(self, prompt, metadata):
        self.training = "prompt_index" in metadata  # a training row (evaluation's have none)
        return [{"role": "user", "content": prompt}]

    def step(self, message):
        if self.training:
            Path(__file__).with_name("blocked").touch()
            NEVER.wait()
        return {"messages": [], "reward": 1.0, "done": True}
"""


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_ctrl_c_ends_a_run_blocked_in_an_env_step_with_a_checkpoint(tmp_path, mode):
    """A real Ctrl-C while every episode of the first batch is blocked in a plain step (env_timeout_s far away):
    the run exits 130 within seconds, with a checkpoint. It used to hang for good (the step ran on the rollout's
    event loop; in async mode the worker thread was joined)."""
    import signal

    out = tmp_path / "run"
    # Turns end after one token (a random model's would run to max_new_tokens and never reach step()).
    cmd = env_run(tmp_path, STUCK_ENV, "Stuck", "rl.num_steps=3", "rl.rollout.env_timeout_s=1000",
                  f"rl.rollout.stop_token_ids={list(CHAR_STOPS)}", f"rl.async_rollout={str(mode == 'async').lower()}")
    env = cpu_child_env()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 300
        while not (tmp_path / "blocked").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None and (tmp_path / "blocked").exists(), proc.stderr.read()[-3000:]
        time.sleep(0.5)  # every episode of the batch is in its step
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert took < 10, f"{took:.1f} s from Ctrl-C to the exit"
    assert "continue with --resume" in err
    assert (out / "rl" / "checkpoints" / "step_00000000" / "state.json").is_file()
    # Every sample cut but right (a common reward above 0: a converged run cut before its end of turn, as the real
    # vLLM test's) is not stuck: the streak does not grow, whatever it was.
    assert check_finishing(samples(T, T, T, rewards=[1.0] * 3), 2, DEMO_LIKE, step=3)[0] == 0
    with pytest.raises(TruncatedRunError, match="rewards were all -1.0"):  # a penalty for every cut sample: stuck
        check_finishing(samples(T, T, T, rewards=[-1.0] * 3), 2, DEMO_LIKE, step=3)


def test_close_abandons_a_worker_stuck_in_user_code_and_the_process_exits():
    """The probe's find: an async env that blocks its event loop (time.sleep in `async def step`) is out of reach of
    any cancellation, and the async rollout worker (a ThreadPoolExecutor thread, joined by close() and at
    interpreter exit) kept the process alive after Ctrl-C forever. Now close() waits its grace period, warns and
    leaves the daemon worker behind, and the process exits."""
    code = (
        "import sys, time\n"
        "import threading\n"
        "from trainer.rollout.thread_worker import ThreadBackend\n"
        "def batches():\n"
        "    while True:\n"
        "        time.sleep(120)  # user code no cancellation reaches\n"
        "        yield None\n"
        "src = ThreadBackend(batches(), threaded=True)\n"
        "threading.Thread(target=src.take, args=(1, 1), daemon=True).start()  # step 1 generates in the worker\n"
        "time.sleep(0.3)\n"
        "src.close_grace_s = 0.5\n"
        "t = time.monotonic()\n"
        "src.close()\n"
        "print(f'closed in {time.monotonic() - t:.1f} s', flush=True)\n")
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=cpu_child_env(), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    closed_s = float(done.stdout.split()[-2])  # "closed in X s": the grace period, not the 120 s sleep
    assert 0.45 <= closed_s < 5, done.stdout
    assert "warning: the rollout worker did not leave its batch within 0.5 s of the stop" in done.stderr
    assert time.monotonic() - t0 < 30  # the interpreter did not wait for the 120 s sleep
