"""Speculative decoding in the embedded engine ([engines] speculative_tokens; engines/embedded/drafts.py and
DecodeBatch._verify).

- A DecodeBatch with n-gram drafts draws, row for row, the tokens plain decoding draws (same seeds) with the same
  finish reasons and log-probs (<= 1e-5 in float32, <= 1e-9 in float64): greedy and sampled rows, top-k/top-p
  rows, stop tokens, short and long limits, rows joining at different steps, with and without the prefix cache over
  multi-turn episodes. The model is one that tends to repeat its last token (lm_head = 4 x the embedding), so drafts
  are taken whole, in part and not at all in the same run (asserted), and it takes fewer forwards than plain decoding.
- The draft source: a row's own context first, then finished rows, at most `tokens` and the row's limit; the index
  of finished rows keeps the most recent occurrence and forgets the oldest beyond its capacity.
- KVCache.align shifts the rows it is told to, by their shifts, and leaves the others untouched.
- Through the engine (LocalEngine, speculative_tokens = 4): the same completions as without; the config key reaches it.
"""

from __future__ import annotations

import pytest
import torch
from engine_support import repeating_model

from engines.embedded.drafts import MAX_SPECULATIVE_TOKENS, NgramDrafts, index_tail
from engines.embedded.generation import DecodeBatch, KVCache, Row
from engines.embedded.prefix_cache import PrefixCache

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _run(batch: DecodeBatch, rows: list[Row], per_step: int | None) -> tuple[list, int]:
    """Every row to its end, `per_step` joining per step (None: all at once): (results, batch steps)."""
    results, pending, steps = {}, [(r, i) for i, r in enumerate(rows)], 0
    while pending or len(batch):
        take = pending if per_step is None else pending[:per_step]
        pending = pending[len(take):]
        for i, res in batch.step(take):
            results[i] = res
        steps += 1
    return [results[i] for i in range(len(rows))], steps


def _rows(seed: int, vocab: int, count: int = 14) -> list[Row]:
    g = torch.Generator().manual_seed(seed)
    stop = frozenset({int(torch.randint(4, vocab, (), generator=g))})
    rows = []
    for i in range(count):
        prompt = tuple(torch.randint(4, vocab, (int(torch.randint(3, 20, (), generator=g)),), generator=g).tolist())
        rows.append(Row(prompt, (0.0, 0.6, 1.0)[i % 3], 0.9 if i % 4 == 1 else 1.0, 20 if i % 5 == 2 else -1,
                        int(torch.randint(1, 48, (), generator=g)), stop, 100 * seed + i))
    return rows


def _same(got, want, tol):
    for k, (a, b) in enumerate(zip(got, want)):
        assert a.output_ids == b.output_ids, k
        assert a.finish_reason == b.finish_reason, k
        assert len(a.logprobs) == len(b.logprobs)
        assert max([abs(x - y) for x, y in zip(a.logprobs, b.logprobs)] or [0.0]) <= tol, k


@pytest.mark.parametrize("dtype,tol,per_step,tokens", [  # each value of each axis, in four runs
    (torch.float32, 1e-5, None, 4), (torch.float32, 1e-5, 4, MAX_SPECULATIVE_TOKENS),
    (torch.float64, 1e-9, 4, 1), (torch.float64, 1e-9, None, MAX_SPECULATIVE_TOKENS)])
def test_speculative_decoding_draws_the_tokens_of_plain_decoding(dtype, tol, per_step, tokens):
    model = repeating_model(dtype=dtype)
    drafts = NgramDrafts(tokens, n=2)
    accepted = verified = short = spec_total = plain_total = 0
    for seed in (1, 2, 3):  # later seeds also draft from the rows the earlier ones finished
        rows = _rows(seed, model.config.vocab_size)
        got, spec_steps = _run(DecodeBatch(model, pad_id=0, drafts=drafts), rows, per_step)
        want, plain_steps = _run(DecodeBatch(model, pad_id=0), rows, per_step)
        _same(got, want, tol)
        assert all(b.verify_steps == b.accepted_tokens == 0 for b in want)
        assert spec_steps <= plain_steps
        spec_total, plain_total = spec_total + spec_steps, plain_total + plain_steps
        accepted += sum(a.accepted_tokens for a in got)
        verified += sum(a.verify_steps for a in got)
        short += sum(a.accepted_tokens < tokens * a.verify_steps for a in got)
    # Drafts drawn whole and in part: more accepted tokens than verify steps would need all-or-nothing luck.
    assert accepted > 0 and verified > 0 and short > 0, (accepted, verified, short)
    assert spec_total < plain_total


def test_the_step_budget_limits_the_drafts_by_the_rows():
    """step_tokens: a batch of B rows drafts at most step_tokens // B - 1 tokens a row; none when that is 0 (a
    plain decode step), so a speculative forward never feeds more than step_tokens tokens."""
    model = repeating_model()
    rows = _rows(4, model.config.vocab_size, count=12)
    want, _ = _run(DecodeBatch(model, pad_id=0), rows, None)
    fed = []  # (rows, tokens fed) of each speculative forward
    original = DecodeBatch._verify

    def verify(self, drafts):
        fed.append((len(self.rows), len(self.rows) * (1 + max(len(d) for d in drafts))))
        return original(self, drafts)

    for budget in (12, 23, 24, 40):  # 12 rows: 24 tokens a step let each draft one
        fed.clear()
        DecodeBatch._verify = verify
        try:
            got, _ = _run(DecodeBatch(model, pad_id=0, drafts=NgramDrafts(8, n=2, step_tokens=budget)), rows, None)
        finally:
            DecodeBatch._verify = original
        _same(got, want, 1e-5)
        assert fed, budget  # fewer rows as they finish: each budget speculates once few enough are left
        assert all(n <= budget and b <= budget // 2 for b, n in fed), (budget, fed)
        assert any(b == 12 for b, _ in fed) == (budget >= 24), (budget, fed)  # all 12 rows speculate from 24 on


def test_speculation_with_the_prefix_cache_over_multi_turn_episodes():
    """Turn t+1's prompt = turn t's prompt + output + new tokens: its own context drafts the repeats, the prefix
    cache gives the earlier turns' KV; both on against both off, turn by turn."""
    model = repeating_model()
    g = torch.Generator().manual_seed(5)
    vocab = model.config.vocab_size
    spec = DecodeBatch(model, pad_id=0, prefix_cache=PrefixCache(1 << 20), drafts=NgramDrafts(4, n=2))
    plain = DecodeBatch(model, pad_id=0)
    rows = _rows(5, vocab, count=9)
    reused = accepted = 0
    for _turn in range(3):
        got, _ = _run(spec, rows, per_step=3)
        want, _ = _run(plain, rows, per_step=3)
        _same(got, want, 1e-5)
        reused += sum(a.cached_tokens for a in got)
        accepted += sum(a.accepted_tokens for a in got)
        rows = [Row(r.prompt + tuple(a.output_ids) + tuple(torch.randint(4, vocab, (3,), generator=g).tolist()),
                    r.temperature, r.top_p, r.top_k, r.max_new_tokens, r.stop_ids, r.seed + 7, r.rid)
                for r, a in zip(rows, got)]
    assert reused > 0 and accepted > 0


def test_drafts_come_from_the_row_first_then_from_finished_rows():
    d = NgramDrafts(3, n=2)
    ctx, seen = [5, 6, 7, 8, 9, 5, 6], {}
    index_tail(ctx, seen, 2, 0)
    assert seen == {(5, 6): 2, (6, 7): 3, (7, 8): 4, (8, 9): 5, (9, 5): 6}  # (5, 6) at the end: not yet followed
    assert d.propose(ctx, seen, limit=10) == [7, 8, 9]  # what followed (5, 6) in the row
    assert d.propose(ctx, seen, limit=2) == [7, 8]
    assert d.propose(ctx, seen, limit=0) == []
    other = [1, 2, 3, 4]
    assert d.propose(other, {}, limit=10) == []  # nothing known
    d.remember([3, 4, 40, 41, 42, 43])
    d.remember([0, 3, 4, 50])  # the most recent occurrence of (3, 4) wins
    assert d.propose(other, {}, limit=10) == [50]
    own = {}
    index_tail([3, 4, 60, 61, 3, 4], own, 2, 0)
    assert d.propose([3, 4, 60, 61, 3, 4], own, limit=10) == [60, 61, 3]  # the row's own before the shared
    # Appending one token indexes the n-gram it completes, and only that one.
    ctx.append(7)
    index_tail(ctx, seen, 2, len(ctx) - 1)
    assert seen[(5, 6)] == 7 and len(seen) == 5
    small = NgramDrafts(2, n=1, capacity=3)
    small.remember([1, 2, 3, 4, 5])  # n-grams (1), (2), (3), (4): the oldest, (1), forgotten
    assert list(small.shared) == [(2,), (3,), (4,)]
    assert small.propose([1], {}, 5) == [] and small.propose([3], {}, 5) == [4, 5]
    with pytest.raises(AssertionError):
        NgramDrafts(MAX_SPECULATIVE_TOKENS + 1)


def test_align_shifts_only_the_rows_it_is_told_to():
    g = torch.Generator().manual_seed(0)
    like = [(torch.zeros(1, 2, 1, 3), torch.zeros(1, 2, 1, 3))] * 2
    cache = KVCache.allocate(like, 5, 20)
    for layer in cache.layers:
        layer.key_buffer.copy_(torch.randn(layer.key_buffer.shape, generator=g))
        layer.value_buffer.copy_(torch.randn(layer.value_buffer.shape, generator=g))
    before = [(layer.key_buffer.clone(), layer.value_buffer.clone()) for layer in cache.layers]
    cache.view(4, 12)
    shifts, length, span = [0, 2, 1, 2], 12, 9
    cache.align(shifts, length, span)
    assert cache.length == length and cache.rows == 4
    for (k0, v0), layer in zip(before, cache.layers):
        for old, new in ((k0, layer.key_buffer), (v0, layer.value_buffer)):
            for i, s in enumerate(shifts):
                want = old[i].clone()
                want[:, length - span:length] = old[i, :, length - span - s:length - s]
                assert torch.equal(new[i], want), i
            assert torch.equal(new[4], old[4])  # a row outside the batch


def test_the_engine_with_speculative_tokens_completes_as_without(tmp_path):
    """LocalEngine over a saved folder of the repeating model: with speculative_tokens = 4 the completions of
    plain decoding (a group of n = 4 sampled rows and a greedy one), and the draft tokens drawn reported per
    completion (meta_info "spec_accepted_tokens" -> Completion.spec_accepted_tokens)."""
    import trio

    from engines.local import LocalEngine
    from engines.protocol import SamplingParams
    from engines.tiny import build_tokenizer
    from trainer.config import EnginesConfig

    assert EnginesConfig().speculative_tokens == 0
    with pytest.raises(ValueError, match="speculative_tokens"):
        EnginesConfig(speculative_tokens=MAX_SPECULATIVE_TOKENS + 1)
    repeating_model().save_pretrained(tmp_path)
    build_tokenizer().save_pretrained(tmp_path)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 12]]
    requests = [SamplingParams(temperature=1.0, max_new_tokens=24, n=4, seed=11),
                SamplingParams(temperature=0.0, max_new_tokens=30)]

    async def complete(engine):
        return [c for sp in requests for group in await engine.generate(prompts, sp) for c in group]

    out = []
    for tokens in (4, 0):
        engine = LocalEngine(str(tmp_path), speculative_tokens=tokens, prefix_cache_tokens=0)
        try:
            assert (engine.server.drafts is not None) == bool(tokens)
            out.append(trio.run(complete, engine))
        finally:
            engine.close()
    spec, plain = out
    assert len(spec) == 10
    _same(spec, plain, 1e-5)
    assert sum(c.spec_accepted_tokens for c in spec) > 0
    assert all(c.spec_accepted_tokens == 0 for c in plain)


def test_the_accepted_count_reaches_the_rollout_batch_metrics():
    """meta_info "spec_accepted_tokens" -> Completion -> the sample's metadata, summed over its turns ->
    build_batch_metadata's spec_accepted_tokens (logged as rollout/spec_accepted_tokens by trainer/rl.py)."""
    from engines.sglang import parse_generate
    from trainer.rollout.samples import build_batch_metadata, extend_sample
    from trainer.types import Sample, Status

    def answer(ids, accepted):
        return {"output_ids": ids, "meta_info": {"finish_reason": {"type": "stop"}, "weight_version": "2",
                                                 "output_token_logprobs": [[-0.5, t, None] for t in ids],
                                                 **({"spec_accepted_tokens": accepted} if accepted is not None
                                                    else {})}}

    (a,), (b,) = parse_generate([answer([5, 6, 7], 2), answer([7], None)], [[1, 2], [3, 4]], 1)
    assert (a.spec_accepted_tokens, b.spec_accepted_tokens) == (2, 0)  # a stock server that does not say: 0
    s = Sample(prompt="p", tokens=(1, 2))
    for accepted in (0, 2, 5):  # three turns
        s = extend_sample(s, [5, 6, 7], [-0.1] * 3, status=Status.COMPLETED, weight_version=2, loss_mask_value=1,
                          spec_accepted_tokens=accepted)
        s = extend_sample(s, [9], [0.0], status=Status.COMPLETED, weight_version=None, loss_mask_value=0)
    assert s.metadata["spec_accepted_tokens"] == 7
    other = extend_sample(Sample(prompt="q", tokens=(3,)), [5], [-0.1], status=Status.COMPLETED, weight_version=2)
    assert "spec_accepted_tokens" not in other.metadata
    assert build_batch_metadata([s, other])["spec_accepted_tokens"] == 7
    assert build_batch_metadata([other])["spec_accepted_tokens"] == 0
    assert build_batch_metadata([s, other])["generated_tokens"] == 3 * 3 + 1  # loss mask 1: not the tool tokens
