"""AsyncRolloutManager at the edges a review found (trainer/rollout/manager.py), with a scripted engine stand-in
that answers each call as the test says: an abort nobody asked for, a retry across the batch's end, partial samples
resumed, an agent group requeued. Each test failed before its fix."""

from __future__ import annotations

import trio
from episode_support import IM_END_ID, TOK

from engines.protocol import Completion, EngineUnavailableError
from trainer.config import RolloutConfig
from trainer.data.buffer import DataBuffer, Prompt
from trainer.rollout.manager import AsyncRolloutManager
from trainer.types import Status


def _buffer(n: int = 20) -> DataBuffer:
    return DataBuffer([Prompt(prompt=f"{i}+1=", answer=str(i + 1), index=i) for i in range(n)], seed=0)


class Scripted:
    """`behave(engine, call_number, prompts, params, rids)` answers a call, or returns None for the default reply
    ("7" and the end token)."""

    url = "scripted://"

    def __init__(self, behave=None):
        self.behave, self.calls, self.aborts, self.running = behave, [], 0, set()

    async def health(self):
        return True

    async def generate(self, prompts, params, *, rids=None):
        self.calls.append((list(prompts), params, rids))
        if self.behave is not None:
            out = await self.behave(self, len(self.calls) - 1, prompts, params, rids)
            if out is not None:
                return out
        ids = (TOK.encode("7") + [IM_END_ID])[:params.max_new_tokens]
        return [[Completion(ids, [-0.5] * len(ids), "stop", 0, list(p))] * params.n for p in prompts]

    async def abort(self, rids=None):
        self.aborts += 1
        self.running.clear()

    async def aclose(self):
        pass


def _config(**kw) -> RolloutConfig:
    return RolloutConfig(**{"apply_chat_template": False, "rollout_batch_size": 2, "n_samples_per_prompt": 2,
                            "max_new_tokens": 8, **kw})


def test_an_abort_the_manager_did_not_ask_for_runs_the_rows_again():
    """Was: a request the engine answered "abort" on its own (an operator's /abort_request, a server rejecting it)
    left its group neither reported nor replaced: the batch waited for it for ever. Now the rows go on, and an
    engine that keeps doing it is an error naming it."""
    async def once(engine, k, prompts, params, rids):
        if k == 0:
            return [[Completion([], [], "abort", 0, list(p))] * params.n for p in prompts]

    async def always(engine, k, prompts, params, rids):
        return [[Completion([], [], "abort", 0, list(p))] * params.n for p in prompts]

    async def main(behave, retries=3):
        engine = Scripted(behave)
        manager = AsyncRolloutManager([engine], _config(max_retries=retries), tokenizer=TOK, check_health=False)
        async with manager:
            with trio.fail_after(20):
                return await manager.generate_batch(_buffer()), manager, engine

    batch, manager, engine = trio.run(main, once)
    assert len(batch.samples) == 4 and all(s.status == Status.COMPLETED for s in batch.samples)
    assert manager.stats["unrequested_aborts"] == 1 and len(engine.calls) == 3  # the cut group's rows ran again
    try:
        trio.run(main, always, 2)
        raise AssertionError("an engine that aborts every request did not fail the batch")
    except EngineUnavailableError as e:
        assert "aborted the samples of group" in str(e) and "3 times without being asked" in str(e)


def test_a_retry_due_after_the_batch_filled_is_not_sent():
    """Was: a request waiting in its retry backoff when the batch filled was sent after the batch-end abort and
    kept running on the engine into the next batch. Now it is not sent, and the batch returns without waiting."""
    async def behave(engine, k, prompts, params, rids):
        if k == 0:  # the first group's first attempt: the engine is unavailable, a retry follows after the backoff
            raise EngineUnavailableError("503")
        engine.running.add(rids[0])

    async def main():
        engine = Scripted(behave)
        cfg = _config(rollout_batch_size=1, over_sampling_factor=2.0, retry_backoff_s=0.3, abort_grace_s=30.0)
        manager = AsyncRolloutManager([engine], cfg, tokenizer=TOK, check_health=False)
        async with manager:
            t0 = trio.current_time()
            batch = await manager.generate_batch(_buffer())
            took = trio.current_time() - t0
            await trio.sleep(0.5)  # past the first group's backoff
        return batch, engine, took

    batch, engine, took = trio.run(main)
    assert len(batch.samples) == 2
    assert len(engine.calls) == 2, [c[2] for c in engine.calls]  # the failed attempt and the other group: no retry
    assert took < 30.0  # nothing kept the batch waiting for abort_grace_s


def test_resumed_partial_samples_are_each_drawn_with_their_own_seed():
    """Was: a group's samples cut by the batch's abort (same length, different tokens) were resumed as one request
    of n prompts with one seed: every row drew the same randomness. Now each is a request with its own seed."""
    async def behave(engine, k, prompts, params, rids):
        if k == 0:  # cut after 3 tokens by the batch's abort, each sample a different prefix
            while not engine.aborts:
                await trio.sleep(0.01)
            return [[Completion(TOK.encode(f"{j}{j}{j}"), [-0.5] * 3, "abort", 0, list(p)) for j in range(params.n)]
                    for p in prompts]

    async def main():
        engine = Scripted(behave)
        manager = AsyncRolloutManager([engine], _config(rollout_batch_size=1, n_samples_per_prompt=4,
                                                        over_sampling_factor=2.0, seed=11),
                                      tokenizer=TOK, check_health=False)
        async with manager:
            await manager.generate_batch(_buffer())
            (cut,) = manager.partial_groups
            first = len(engine.calls)
            await manager.generate_batch(_buffer())
        return cut[0].group_index, engine.calls[first:]

    uid, calls = trio.run(main)
    resumed = [(prompts, params) for prompts, params, rids in calls if rids[0].startswith(f"g{uid}-")]
    assert len(resumed) == 4 and all(len(p) == 1 and params.n == 1 for p, params in resumed)
    assert len({params.seed for _, params in resumed}) == 4  # four rows, four seeds
    assert len({tuple(p[0]) for p, _ in resumed}) == 4  # each sample's own partial tokens


def test_a_requeued_group_restarts_one_sample_per_episode():
    """Was: restarting a group whose agent episodes had split (one sample per training sequence) restarted every
    sequence as an episode of its own: the prompt came back with more than n_samples_per_prompt episodes."""
    from trainer.rollout.samples import restart_group

    a = [_sample(0, {}), _sample(0, {"agent_part": 1}), _sample(1, {}), _sample(1, {"agent_part": 1}),
         _sample(1, {"agent_part": 2})]
    restarted = restart_group(a)
    assert [s.index for s in restarted] == [0, 1] and all(s.status == Status.PENDING for s in restarted)
    assert all(s.response_length == 0 and "agent_part" not in s.metadata for s in restarted)


def _sample(index: int, meta: dict):
    from trainer.types import Sample

    tokens = tuple(TOK.encode("1+1=")) + tuple(TOK.encode("2"))
    return Sample(prompt="1+1=", tokens=tokens, response="2", response_length=1, rollout_logprobs=(-0.5,),
                  loss_mask=(1,), group_index=0, index=index, status=Status.COMPLETED,
                  metadata={"weight_versions": [[0, 0]], **meta})


def test_groups_requeued_while_a_step_trains_survive_its_checkpoint():
    """Was: groups handed back while step n trained (past the staleness bound) were in neither the manager's state
    nor the resume point of step n (read when batch n was drawn): a run resumed from step n's checkpoint never
    generated those prompts. Now both hold them, and the resumed manager generates them first."""
    from trainer.rollout.resume import ResumePoints
    from trainer.rollout.samples import restart_group, sample_to_dict

    buffer = _buffer()

    async def draw(manager):
        async with manager:
            return await manager.generate_batch(buffer)

    manager = AsyncRolloutManager([Scripted()], _config(), tokenizer=TOK, check_health=False)
    points = ResumePoints({"data_buffer": buffer, "rollout_manager": manager}, step=0)
    batch = trio.run(draw, manager)
    points.record(1)  # batch 1 drawn; step 1 trains and hands its first group back
    stale = [[s for s in batch.samples if s.group_index == batch.samples[0].group_index]]
    manager.requeue(stale)
    points.requeued(1, [[sample_to_dict(s) for s in restart_group(g)] for g in stale])
    saved = points.at(1)["rollout_manager"]
    assert len(saved["requeued"]) == 1 and saved == {**manager.state_dict(), "requeued": saved["requeued"]}

    resumed = AsyncRolloutManager([Scripted()], _config(), tokenizer=TOK, check_health=False)
    resumed.load_state_dict(saved)
    again = trio.run(draw, resumed)
    assert again.samples[0].prompt == stale[0][0].prompt and again.samples[0].group_index == stale[0][0].group_index
