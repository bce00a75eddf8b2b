"""AsyncRolloutManager against the real embedded engine (`python -m engines.embedded --model tiny`).

The tiny model is random, so arithmetic rewards would all be 0; the reward here is the parity of the first
response token, which gives groups with and without reward variance. Once the batch is full the manager aborts
the over-sampled requests still running: the engine cuts them at its next decode step, they come back with
their partial output (cached groups), and the next batch resumes them.
"""

import statistics

import httpx
import torch
import trio
from engine_support import Counted

from engines.embedded.presets import build_tiny_model
from engines.sglang import SGLangEngine
from engines.tiny import build_tokenizer
from trainer.config import RolloutConfig
from trainer.data.buffer import DataBuffer, load_jsonl
from trainer.rollout.manager import AsyncRolloutManager
from trainer.types import Status

SEED = 3
TOK = build_tokenizer()


ENGINE_SEED, ENGINE_API_KEY = SEED, "k"  # for the shared `engine` fixture (tests/conftest.py)


def first_token_parity(sample):
    return float(sample.tokens[sample.prompt_length] % 2 == 0)


def _run(manager, buffer):
    async def go():
        async with manager:
            batch = await manager.generate_batch(buffer)
            assert all(e.running == 0 for e in manager.engines)
            return batch
    return trio.run(go)  # returns only once every task of the batch has ended


def _hf_logprobs(model, s):
    seq = torch.tensor([list(s.tokens)])
    with torch.no_grad():
        lp = model(input_ids=seq).logits.float().log_softmax(-1)[0, s.prompt_length - 1:-1]
    return lp.gather(-1, seq[0, s.prompt_length:, None])[:, 0]


def test_manager_with_embedded_engine_oversamples_filters_and_carries_groups_over(engine):
    # 48 new tokens: a group launched when an earlier one finishes is still decoding when the batch fills, also when
    # the test process is descheduled for a while (the full suite on two cores); with 12 the engine, stepping on by
    # itself between requests, once finished it before the client had accepted the second group, and no abort was due.
    cfg = RolloutConfig(rollout_batch_size=2, n_samples_per_prompt=2, over_sampling_factor=2.0, max_new_tokens=48,
                        max_concurrency=3, temperature=1.0, dynamic_filters=("check_reward_nonzero_std",), seed=7,
                        apply_chat_template=True, abort_grace_s=2.0)
    m = AsyncRolloutManager([Counted(SGLangEngine(engine.url, api_key="k"))], cfg, tokenizer=TOK,
                            reward_fn=first_token_parity)
    buf = DataBuffer(load_jsonl("data/arithmetic_train.jsonl"), seed=0)
    batch = _run(m, buf)
    md = batch.metadata
    assert len(batch) == 4 and md["groups_submitted"] >= 4
    # The cut requests stopped: nothing runs or waits on the engine once the batch is delivered, so the next
    # batch starts at once instead of queueing behind them.
    load = httpx.get(engine.url + "/get_server_info", headers={"Authorization": "Bearer k"}, timeout=30).json()
    assert load["num_running_rows"] == 0 and load["num_waiting_rows"] == 0 and m.stats["aborts_sent"] >= 1
    assert len(dict.fromkeys(s.group_index for s in batch.samples)) == 2
    for g in dict.fromkeys(s.group_index for s in batch.samples):
        group = [s for s in batch.samples if s.group_index == g]
        assert statistics.pstdev([s.reward for s in group]) > 0  # zero-variance groups were dropped
    assert md.get("filtered_check_reward_nonzero_std", 0) == md["groups_filtered"]
    cached = m.partial_groups
    # Over-sampled groups that were neither accepted nor dropped are cut and cached (>= 1 by construction).
    assert len(cached) == md["groups_cached"] == md["groups_submitted"] - 2 - md["groups_filtered"] >= 1
    done_before = {(g[0].group_index, s.index): s for g in cached for s in g
                   if s.status in (Status.COMPLETED, Status.TRUNCATED)}

    model = build_tiny_model(SEED)
    # The engine is not wedged by the cut requests: the next batch resumes every cached group first.
    m.set_weight_version(1)
    cfg2 = RolloutConfig(**{**cfg.__dict__, "rollout_batch_size": max(1, len(cached)), "over_sampling_factor": 1.0,
                            "dynamic_filters": ()})
    m2 = AsyncRolloutManager([Counted(SGLangEngine(engine.url, api_key="k"))], cfg2, tokenizer=TOK,
                             reward_fn=first_token_parity)
    m2.load_state_dict(m.state_dict())
    batch2 = _run(m2, buf)
    assert batch2.metadata["groups_resumed"] == len(cached)
    resumed = [s for s in batch2.samples if len(s.metadata["weight_versions"]) == 2]
    partial = [s for g in cached for s in g if s.status == Status.ABORTED and s.response_length > 0]
    assert len(resumed) == len(partial)  # samples cut mid-way continued from their partial output
    for s in list(batch.samples) + list(batch2.samples):
        # a sample cut mid-way carries its partial segment over: one version per segment
        assert s.status in (Status.COMPLETED, Status.TRUNCATED) and set(s.metadata["weight_versions"]) == {0}
        assert s.weight_version == 0 and len(s.rollout_logprobs) == s.response_length >= 1
        assert s.tokens[-1] == TOK.eos_token_id or s.status == Status.TRUNCATED or \
            s.tokens[-1] == TOK.convert_tokens_to_ids("<|im_end|>")
        # Samples keep the engine's own log-probs (equal to a plain HF forward of the same weights).
        assert torch.allclose(torch.tensor(s.rollout_logprobs), _hf_logprobs(model, s), atol=1e-4, rtol=0)
        key = (s.group_index, s.index)
        if key in done_before:  # a sample finished before the cut is carried over unchanged
            assert s.tokens == done_before[key].tokens and s.rollout_logprobs == done_before[key].rollout_logprobs
