"""Draft tokens for speculative decoding by n-gram lookup (no draft model): the engine's `[engines]
speculative_tokens`.

A row's draft is what followed the last time its current n-gram (its last `n` tokens) occurred: first in its own
context (its prompt and what it has generated: the digits of a question copied into a tool call, an earlier turn's
call repeated), else in the sequences of rows that finished before (`NgramDrafts.remember`: the boilerplate of a
tool call, a format every episode of the task shares). DecodeBatch feeds the draft after the row's last token and
keeps the longest prefix of it the model samples itself (engines/embedded/generation.py, `_verify`): the tokens are
the ones the row would have drawn without drafts, so a draft only changes how many forwards they take.

The own-context index (`index_tail`) maps each n-gram of the row's context to the index of the token that followed
its most recent occurrence; the row's current n-gram is never in it (its next token is not drawn yet). The shared
index maps an n-gram to (sequence, index) of its most recent occurrence in a finished row, bounded by `capacity`
n-grams (the oldest forgotten first).
"""

from __future__ import annotations

from collections.abc import Sequence

# The most draft tokens a row and step: a speculative step feeds 1 + this many tokens a row, which the engine's CPU
# attention takes as a decode (engines/embedded/attention.py, MAX_QUERY_TOKENS).
MAX_SPECULATIVE_TOKENS = 15


def index_tail(ctx: Sequence[int], seen: dict[tuple[int, ...], int], n: int, start: int) -> None:
    """Add to `seen` the n-grams of ctx that end before tokens [start, len(ctx)): seen[ctx[t-n:t]] = t."""
    for t in range(max(start, n), len(ctx)):
        seen[tuple(ctx[t - n:t])] = t


class NgramDrafts:
    """The engine's draft source (module docstring): `tokens` drafts a row and step at most, n-grams of `n` tokens;
    the index of finished rows' n-grams is its state, kept across batches and weight versions (a draft never
    changes a token, only the number of forwards).

    `step_tokens`: the most tokens a speculative forward feeds (rows x (1 + draft)); a batch of B rows drafts at
    most step_tokens // B - 1 tokens a row, none once B reaches step_tokens. A forward costs a fixed part plus a part
    per token fed; drafts pay where the fixed part dominates (few rows, or a device whose decode is bound by reading
    the weights), not where the per-token part does (many rows on a CPU, whose linears are then compute-bound)."""

    def __init__(self, tokens: int, n: int = 3, capacity: int = 1 << 16, step_tokens: int = 128):
        assert 1 <= tokens <= MAX_SPECULATIVE_TOKENS and n >= 1 and capacity >= 1 and step_tokens >= 2, (
            tokens, n, capacity, step_tokens)
        self.tokens, self.n, self.capacity, self.step_tokens = tokens, n, capacity, step_tokens
        self.shared: dict[tuple[int, ...], tuple[Sequence[int], int]] = {}

    def propose(self, ctx: Sequence[int], seen: dict[tuple[int, ...], int], limit: int) -> list[int]:
        """At most min(tokens, limit) draft tokens to follow ctx (own context first, then finished rows)."""
        k = min(self.tokens, limit)
        if k <= 0 or len(ctx) < self.n:
            return []
        key = tuple(ctx[-self.n:])
        t = seen.get(key)
        if t is not None:
            return list(ctx[t:t + k])
        hit = self.shared.get(key)
        if hit is None:
            return []
        seq, t = hit
        return list(seq[t:t + k])

    def remember(self, seq: Sequence[int]) -> None:
        """Index a finished row's tokens (prompt and output): its n-grams become the most recent occurrences."""
        seq, n, shared = tuple(seq), self.n, self.shared
        for t in range(n, len(seq)):
            key = seq[t - n:t]
            shared.pop(key, None)  # re-inserted last: the dict's order is the recency order
            shared[key] = (seq, t)
        for _ in range(len(shared) - self.capacity):
            del shared[next(iter(shared))]
