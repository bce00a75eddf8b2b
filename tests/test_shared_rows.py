"""Rows fed the same tokens share one KV-cache row and its forward (engines/embedded/generation.py: DecodeBatch's
cache rows, `_next_tokens`, `_fork`).

- A prompt's samples join as one cache row and stay one while they draw the same tokens: greedy samples of a prompt
  share a row to the end; sampled ones part (a copy of the row each) when their draws differ. Either way every
  row's tokens and log-probs are those of the same row generated alone (its own batch, its own cache row), and of
  a full forward of its sequence without a cache.
- The count of cache rows is asserted at every step (it is what saves the forwards), as are the parts.
"""

from __future__ import annotations

import engine_support
import pytest
import torch

from engines.embedded.generation import DecodeBatch, Row

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def repeating_model() -> torch.nn.Module:
    """lm_head = 6 x the embedding: sampled rows of one prompt draw the same tokens for a while, then part."""
    return engine_support.repeating_model(seed=11, scale=6.0)


def _alone(model, row: Row):
    """The row generated in a batch of its own."""
    batch, out = DecodeBatch(model, pad_id=0), []
    pending = [(row, 0)]
    while pending or len(batch):
        out += batch.step(pending)
        pending = []
    return out[0][1]


def test_greedy_samples_of_a_prompt_share_one_cache_row_to_the_end():
    model = repeating_model()
    prompt = (7, 8, 9, 10)
    rows = [Row(prompt, 0.0, 1.0, -1, 12, frozenset(), seed) for seed in range(5)]
    batch, results, cache_rows = DecodeBatch(model, pad_id=0), {}, []
    pending = [(r, i) for i, r in enumerate(rows)]
    while pending or len(batch):
        results.update(batch.step(pending))
        pending = []
        if len(batch):
            cache_rows.append(batch.cache.rows)
    assert cache_rows and set(cache_rows) == {1}  # five rows, one forward row every step
    want = _alone(model, rows[0])
    for i in range(5):
        assert results[i].output_ids == want.output_ids
        assert max(abs(a - b) for a, b in zip(results[i].logprobs, want.logprobs)) <= 1e-5


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sampled_samples_part_when_their_draws_differ_and_draw_what_they_draw_alone(seed):
    model = repeating_model()
    g = torch.Generator().manual_seed(seed)
    prompts = [tuple(torch.randint(4, 250, (int(torch.randint(2, 9, (), generator=g)),), generator=g).tolist())
               for _ in range(3)]
    stop = frozenset({int(torch.randint(4, 250, (), generator=g))})
    rows = [Row(p, (1.0, 0.7)[j % 2], 1.0 if j < 4 else 0.9, -1, int(torch.randint(8, 30, (), generator=g)), stop,
                100 * seed + 10 * k + j) for k, p in enumerate(prompts) for j in range(6)]
    batch, results, steps = DecodeBatch(model, pad_id=0), {}, []
    pending = [(r, i) for i, r in enumerate(rows[:12])]  # the third prompt's rows join later
    step = 0
    while pending or len(batch) or step < 3:
        if step == 3:
            pending = [(r, 12 + i) for i, r in enumerate(rows[12:])]
        results.update(batch.step(pending))
        pending = []
        if len(batch):
            # Rows of one cache row have fed the same tokens: their prompts and outputs so far are equal.
            by_row: dict[int, set] = {}
            for a in batch.rows:
                by_row.setdefault(a.phys, set()).add(a.row.prompt + tuple(a.out_ids[:-1]))
            assert all(len(v) == 1 for v in by_row.values()), by_row
            assert sorted(by_row) == list(range(batch.cache.rows))  # every cache row in use, none twice
            steps.append((len(batch), batch.cache.rows))
        step += 1
    assert any(p < b for b, p in steps) and any(p > 3 for _, p in steps), steps  # shared for a while, then parted
    for i, row in enumerate(rows):
        want = _alone(model, row)
        assert results[i].output_ids == want.output_ids, i
        assert results[i].finish_reason == want.finish_reason
        assert max(abs(a - b) for a, b in zip(results[i].logprobs, want.logprobs)) <= 1e-5, i
        seq = torch.tensor([list(row.prompt) + want.output_ids])
        with torch.no_grad():  # and the log-probs of a full forward without a cache, at the row's temperature
            logits = model(input_ids=seq).logits[0, len(row.prompt) - 1:-1].float() / row.temperature
        ref = logits.log_softmax(-1).gather(-1, torch.tensor(want.output_ids)[:, None])[:, 0]
        assert max(abs(a - b) for a, b in zip(results[i].logprobs, ref.tolist())) <= 1e-5, i
