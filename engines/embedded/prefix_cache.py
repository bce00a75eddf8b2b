"""The embedded engine's prefix cache: the KV of sequences it already computed, reused by later prompts that start
with them (engines/embedded/generation.py DecodeBatch uses it).

What is kept: when a row finishes, the keys and values of every token it fed the model (its prompt and its sampled
tokens but the last), per layer [H, n, D], copied out of the batch's cache. A later prompt that starts with those
tokens (the next turn of a multi-turn episode: prompt + answer + tool result; another request for a group's prompt)
prefills only the tokens after the longest cached prefix, at least its last one (its logits give the first
sample). The reused prefix was computed by the same weights and adapter, so the results equal a fresh prefill up to
float rounding (tests/test_prefix_cache.py: <= 1e-5 in float32).

Lookup: a prefix is found by its blocks of `BLOCK` tokens: each entry is indexed under (adapter, version, k,
the chain hash of its first k blocks) for every whole block k (the newest entry with that prefix); a prompt
computes its own chain (O(L)), looks up its block prefixes, longest first, checks the tokens of the entry found (a
hash collision is skipped, never reused), then extends the match token by token inside it (at most one block
more than the shared blocks, so at most BLOCK - 1 tokens of a longer match in another entry are missed).

Bound and eviction: at most `budget_tokens` tokens in all entries (each entry counts its n tokens, so memory is
n * layers * 2 * H_kv * D * dtype bytes per entry: the tiny demo model 1 KiB a token, Qwen2.5-0.5B in bfloat16
12 KiB); least recently used entries (stored or reused) go first; an entry larger than the budget is not kept.
Invalidation: every entry carries the weight version it was computed with; a lookup or store at another version
drops them all (weights changed), `drop_adapter(slot)` drops one adapter's (its slot was rewritten), `clear()`
everything (/flush_cache). Not thread-safe: only the engine's model thread calls it.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, replace

import torch

BLOCK = 4  # tokens per indexed block: prefixes are found at this granularity, then extended token by token


def _chain(tokens: tuple[int, ...], blocks: int) -> list[int]:
    """The hash of the first k blocks of `tokens`, for k = 1 .. blocks (each hashes the previous and its block)."""
    out, h = [], 0
    for k in range(blocks):
        h = hash((h, tokens[k * BLOCK:(k + 1) * BLOCK]))
        out.append(h)
    return out


@dataclass(frozen=True)
class _Entry:
    tokens: tuple[int, ...]
    adapter: int
    kv: tuple[tuple[torch.Tensor, torch.Tensor], ...]  # per layer (keys, values) [H, n, D]
    chain: tuple[int, ...]  # _chain of its whole blocks: its index keys
    owned: bool = True  # False: kv are views of a tensor shared with the other entries stored in the same step


class PrefixCache:
    """The engine's reusable prefixes (see the module docstring), bounded by `budget_tokens` (LRU)."""

    def __init__(self, budget_tokens: int):
        assert isinstance(budget_tokens, int) and budget_tokens >= 0, (
            f"prefix cache budget {budget_tokens!r}: give a whole number of tokens >= 0 (0: off)")
        self.budget = budget_tokens
        self.version = 0
        self.entries: collections.OrderedDict[tuple, _Entry] = collections.OrderedDict()  # LRU order, oldest first
        self.index: dict[tuple, tuple] = {}  # (adapter, version, k, chain hash of k blocks) -> the entry's key
        self.tokens = 0  # tokens held (the budget's unit)
        self.evicted = 0  # entries dropped for the budget (a statistic)

    def __len__(self) -> int:
        return len(self.entries)

    def clear(self) -> None:
        self.entries.clear()
        self.index.clear()
        self.tokens = 0

    def _at(self, version: int) -> None:
        if version != self.version:  # the weights changed: no entry is valid any more
            self.clear()
            self.version = version

    def drop_adapter(self, adapter: int) -> None:
        """Forget every entry of adapter slot `adapter` (its weights were rewritten or unloaded)."""
        for key in [k for k, e in self.entries.items() if e.adapter == adapter]:
            self._remove(key)

    def _remove(self, key: tuple) -> None:
        entry = self.entries.pop(key)
        self.tokens -= len(entry.tokens)
        for k, h in enumerate(entry.chain, 1):
            block_key = (entry.adapter, self.version, k, h)
            if self.index.get(block_key) == key:
                del self.index[block_key]

    def lookup(self, prompt: tuple[int, ...], adapter: int, version: int) -> tuple[_Entry | None, int]:
        """(entry, n): the cached entry sharing the longest prefix with `prompt` and n, the tokens of it to reuse
        (at most len(prompt) - 1: the last prompt token is always fed); (None, 0) when none shares a block."""
        self._at(version)
        if not self.entries:
            return None, 0
        chain = _chain(prompt, len(prompt) // BLOCK)
        for k in range(len(chain), 0, -1):
            key = self.index.get((adapter, version, k, chain[k - 1]))
            if key is None:
                continue
            entry = self.entries[key]
            if entry.tokens[:k * BLOCK] != prompt[:k * BLOCK]:
                continue  # a hash collision
            if not entry.owned:  # reused: it may outlive its step's other entries, so it stops holding their memory
                entry = self.entries[key] = replace(entry, kv=tuple((k_.clone(), v.clone()) for k_, v in entry.kv),
                                                    owned=True)
            self.entries.move_to_end(key)  # used: the most recent
            n, end = k * BLOCK, min(len(entry.tokens), len(prompt) - 1)
            while n < end and entry.tokens[n] == prompt[n]:
                n += 1
            n = min(n, len(prompt) - 1)
            return (entry, n) if n > 0 else (None, 0)
        return None, 0

    def store(self, tokens: tuple[int, ...], adapter: int, version: int,
              kv: list[tuple[torch.Tensor, torch.Tensor]], *, owned: bool = True) -> None:
        """Keep the KV `kv` (per layer (keys, values) [H, len(tokens), D], owned by the cache from now on) of
        `tokens` under `adapter` at weight `version`, evicting the least recently used entries to stay within the
        budget. Sequences shorter than a block, or longer than the budget, are not kept.

        owned=False: `kv` are views of one tensor holding the KV of every entry stored in the same step (one copy
        a step, not one per entry). Unused entries leave in the order they came (LRU), so that tensor is freed
        once the step's last entry is evicted; an entry that is reused first copies its own KV (`lookup`), so it
        never holds the others' memory past them."""
        self._at(version)
        n = len(tokens)
        assert all(k.shape[1] == n and v.shape[1] == n for k, v in kv), "kv must hold one column per token"
        key = (adapter, tokens)
        if key in self.entries:
            self.entries.move_to_end(key)
            return
        if n < BLOCK or n > self.budget:
            return
        while self.tokens + n > self.budget:
            self._remove(next(iter(self.entries)))
            self.evicted += 1
        chain = tuple(_chain(tokens, n // BLOCK))
        self.entries[key] = _Entry(tokens, adapter, tuple(kv), chain, owned)
        self.tokens += n
        for k, h in enumerate(chain, 1):
            self.index[(adapter, version, k, h)] = key  # the newest entry with this prefix
