"""Nothing lost, round 2 (issue 44, items 2-3): user code that hangs.

- A sync environment method that blocks fails its own episode at [rl.rollout] env_timeout_s (FAILED, counted), and
  the rest of the batch goes on; a cancelled batch (what Ctrl-C does to the rollout) leaves a blocked method at once.
- A hung tool gives its thread slot back at its timeout: sync reward functions, which run on trio's default thread
  limiter, still get threads and score.

Blocking user code waits on a threading.Event that the test sets at its end (with a timeout of its own, so that
code which waits for it in the event loop ends the test with a failure rather than a hang).
"""

from __future__ import annotations

import threading
import time

import pytest
import trio
from episode_support import TOK, Scripted, arithmetic_buffer

from trainer.config import RolloutConfig
from trainer.rollout.blocking import abandoned_threads
from trainer.rollout.data import DataBuffer, Prompt
from trainer.rollout.manager import AsyncRolloutManager, generate_rollout_batches
from trainer.rollout.rewards import with_timeout
from trainer.rollout.source import RolloutSource
from trainer.types import Sample, Status

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
    source = RolloutSource(batches, num_steps=3, ahead=1, cancel=manager.cancel)
    first = source.next(1)  # batch 2 starts generating in the worker, and blocks
    assert [s.reward for s in first.samples] == [1.0, 1.0]
    time.sleep(0.3)
    t0 = time.monotonic()
    source.close()
    assert time.monotonic() - t0 < 2.0
    assert abandoned_threads() == 2


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
