"""Continuous-batching sampling with a KV cache: rows join and leave the batch between decode steps.

`DecodeBatch` holds the rows being generated (B of them) and their KV cache (`KVCache`, preallocated, see below),
one cache row for each distinct run of tokens fed: rows fed the same tokens so far share a cache row (the n samples
of a prompt join as one, and stay one while they draw the same tokens). Per cache row [P]: the next position id
(counting real tokens only, so padding changes nothing but the mask), the token to feed next, the adapter slot; per
row [B]: its cache row (`phys_idx`) and its sampling parameters (`SamplingTensors`). All are device tensors that
change only when rows join, part or leave (and, for positions, by one increment per step). One `step(new_rows)`:
  1. decode: feed every cache row its next token (one forward of [P, 1]); each layer writes the new key/value in
     place at the cache's next column; each row reads its cache row's logits;
  2. prefill: the admitted rows, left-padded into one [u, L'] forward, one row per distinct prompt (built on the
     host, moved in one copy);
  3. join: each distinct prompt takes the next cache row, right-aligned at the batch's length;
  4. sample one token per row, keyed by the row's seed and the position the token takes (kernels.sampling), so a
     row's tokens depend on its seed, not on which other rows share the batch or its cache row;
  5. read the tokens and log-probs on the host (the step's one device-to-host read; in a step where rows join,
     transformers also reads the prefill's padding mask), retire finished rows (stop token, length, or abort);
  6. part: rows of one cache row that drew different tokens get a copy of it each (`_fork`); cache rows no row
     uses any more leave.
Sharing is exact: rows of one cache row have fed the same tokens, so their logits are the ones each would get from
its own row. It saves forwards when samples begin alike (the agent recipe's 8 samples of a prompt share ~60 of the
~84 tokens of their tool call): a cache row stands for 3.6 rows on average over that turn.

The cache: per layer, keys and values buffers [rows_capacity, H, capacity, D] (rows_capacity >= B: room for every
row to part). Cache rows are left-padded so each appends its next key/value at the same column `length`; attention
reads the views [P, H, length, D] of the filled prefix. Cache row p's real tokens are its last n_p columns (n_p =
its position id), so the attention mask is derived from the positions and no mask is stored. Rows join into the
next free cache rows, right-aligned at `length`; cache rows leave by moving the last ones into their places (a copy
of the moved rows only). New buffers are built only when a decode step needs a column past the capacity (twice
the attended length: geometric growth, at most what the rows can still generate), when joining rows do not fit
(more rows than the buffers hold, or a prompt longer than `length`), or when at least half the columns are ones no
running row attends to any more; they keep only the attended columns.

Speculative decoding (`drafts`, engines/embedded/drafts.py; `_verify`): a cache row is fed its next token and a
draft of the tokens after it, every row draws at each fed position as a decode step would, and keeps its draws up
to the first one that differs from the draft: the tokens of plain decoding, in fewer forwards.

Sampling: one call for the whole batch (kernels.sampling.sample_tokens: on CUDA one kernel) draws each row's token
from its probabilities by inverse CDF, with a uniform from Philox keyed by (the row's seed, the position of the
token): no per-row generator state, so a row draws the same tokens alone or in any batch, and a row resumed at a
position draws what it would have drawn there. Rows with top-k/top-p are filtered (a full-vocabulary sort) on
their own, gathered by device indices; rows without filters sample softmax(logits / T) itself. Greedy rows
(temperature 0) take the argmax of the logits. Nothing is read on the host.

Prefix reuse (a `PrefixCache`, engines/embedded/prefix_cache.py): a finished row leaves the KV of every token it
fed in the cache; a joining prompt that starts with a cached prefix (an episode's next turn, another request for a
group's prompt) prefills only the rest, on top of that KV (`_prefill_reusing`), for the same adapter slot and
weight version only. Each result says how many prompt tokens it took from the cache (RowResult.cached_tokens).

LoRA adapters: each row carries the slot of its adapter (`Row.adapter`, 0: the base) in the engine's AdapterSet
(engines/embedded/lora.py); before each forward the batch tells the set which slot each cache row uses, and the
adapted Linears add that row's adapter (a per-row gather). Rows of one prompt share a cache row only when they
also share the adapter.

Log-probs: for each sampled token, `log_softmax(logits / T)[token]` at the row's temperature T (temperature 0,
greedy: `log_softmax(logits)`), before top-k/top-p: the distribution the token was sampled from before the
filters, which is what the trainer recomputes at the same temperature.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from engines.embedded.drafts import NgramDrafts, index_tail
from engines.embedded.graphs import GraphDecode
from engines.embedded.kv_cache import KVCache
from engines.embedded.prefix_cache import PrefixCache
from engines.embedded.sampling import SamplingTensors, sample_with_logprobs
from kernels.packing import padding_chunks

# transformers 5.24 renames the forward's `past_key_values` to `cache` and warns on every decode step; the versions
# this project runs on (5.17 on the GPU image, < 5.20 beside vLLM) know only the old name, so the old name stays and
# that one warning is silenced (it would fill a run's log: one per engine step).
warnings.filterwarnings("ignore", message="`past_key_values` is deprecated", category=FutureWarning)


@dataclass(frozen=True)
class Row:
    """One sequence to generate. stop_ids ends the row (the stop token is kept in the output); rid names it for
    aborts."""

    prompt: tuple[int, ...]
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    stop_ids: frozenset[int]
    seed: int
    rid: str = ""
    adapter: int = 0  # the slot of its LoRA adapter in the engine's AdapterSet (engines/embedded/lora.py); 0: base


@dataclass(frozen=True)
class RowResult:
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "abort"
    # (first token index, weight version) of each run of tokens one weight version produced: one span unless the
    # weights changed while the row was paused in the batch (an update in flight).
    versions: tuple[tuple[int, int], ...] = ()
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache, not prefilled (SGLang's meta "cached_tokens")
    # Speculative decoding (DecodeBatch's `drafts`): forwards that fed the row a draft, and the draft tokens the row
    # drew itself (each saved a forward).
    verify_steps: int = 0
    accepted_tokens: int = 0


@dataclass
class _Active:
    row: Row
    handle: Any  # the caller's tag, returned with the result
    cached: int  # tokens of this row in the cache (its prompt, then one more per decode step)
    out_ids: list[int] = field(default_factory=list)
    out_lp: list[float] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)  # (first token index, version): RowResult.versions
    reused: int = 0  # prompt tokens taken from the prefix cache
    phys: int = 0  # its row of the KV cache, shared with every row of the batch fed the same tokens (DecodeBatch)
    # Speculative decoding only: the row's tokens (prompt, then output) and the index of their n-grams
    # (engines/embedded/drafts.py), and the counts RowResult reports.
    ctx: list[int] | None = None
    seen: dict[tuple[int, ...], int] | None = None
    verify_steps: int = 0
    accepted: int = 0

    @property
    def to_append(self) -> int:
        """Columns this row may still append to the cache: every token it may still sample but its last."""
        return self.row.max_new_tokens - max(len(self.out_ids), 1)

    def result(self, finish_reason: str) -> RowResult:
        return RowResult(self.out_ids, self.out_lp, finish_reason, tuple(self.spans), self.reused, self.verify_steps,
                         self.accepted)


def _capacity(length: int, limit: int) -> int:
    """Columns to allocate for `length` filled ones: twice that (geometric growth), at most `limit` (the most the
    rows can still need), and at least two free columns (the decode's view never spans the whole buffer, so a
    compiled decode does not specialise on the view being contiguous)."""
    return max(min(2 * length, limit), length + 2)


def _pack(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Tensors as one flat float64 tensor: exact for float32 values and for integers below 2^53 (token ids,
    indices, lengths)."""
    return torch.cat([p.reshape(-1).to(torch.float64) for p in parts])


def _unpack(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """`_pack`'s inverse: each part with the shape and dtype of its counterpart in `like`."""
    out, at = [], 0
    for p in like:
        out.append(flat[at:at + p.numel()].view(p.shape).to(p.dtype))
        at += p.numel()
    return out


def _to_device(parts: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """CPU tensors on `device` in one host-to-device copy (pinned memory and non_blocking on CUDA, so the host
    does not wait for the device); on the CPU, the tensors themselves."""
    if device.type == "cpu":
        return list(parts)
    flat = _pack(parts)
    if device.type == "cuda":
        flat = flat.pin_memory()
    return _unpack(flat.to(device, non_blocking=True), parts)


def _swap_remove(n: int, keep: list[int]) -> tuple[list[int], list[int], list[int]]:
    """Keep rows `keep` (ascending indices into n rows) as the first len(keep) rows, filling the places of the
    removed ones with the kept rows from the end: (order: old index of each new row, dst, src: rows copied)."""
    m, kept = len(keep), set(keep)
    holes = [i for i in range(m) if i not in kept]
    movers = [i for i in keep if i >= m]
    order = list(range(m))
    for d, s in zip(holes, movers):
        order[d] = s
    return order, holes, movers


# ------------------------------------------------------------------------------------------------- the batch
@dataclass(frozen=True)
class _Prefill:
    """The prefill of rows joining the batch, on the device."""

    logits: torch.Tensor  # [u, V] fp32, one per distinct (prompt, adapter)
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values) [u, H, L', D], one per distinct prompt
    where: torch.Tensor  # [b]: the distinct prompt of each row (device)
    owners: tuple[int, ...]  # the same on the host
    pos: torch.Tensor  # [u] next position id (the prompt's length)
    slots: torch.Tensor  # [u] the adapter slot
    params: SamplingTensors  # [b], one per row
    reused: tuple[int, ...] = ()  # per row: prompt tokens taken from the prefix cache (() : none)


class DecodeBatch:
    """The engine's running rows and their KV cache (the only mutable state of generation; see the module
    docstring). Not thread-safe: one thread (the engine's model thread) calls `step`."""

    def __init__(self, model, *, pad_id: int, decode_fn: Callable | None = None, adapters: Any = None,
                 prefix_cache: PrefixCache | None = None, drafts: NgramDrafts | None = None,
                 graphs: GraphDecode | None = None, min_decode_rows: int = 1):
        """adapters: the engine's AdapterSet (engines/embedded/lora.py), told each forward's row slots; None: the
        base model only. prefix_cache: where finished rows leave their KV and joining rows look for their prompt's
        prefix (engines/embedded/prefix_cache.py); None: every prompt is prefilled whole. drafts: speculative
        decoding's draft source (engines/embedded/drafts.py; `_verify`); None: one token a row and forward.
        graphs: the decode step as CUDA graphs (engines/embedded/graphs.py: the cache's buffers then come from its
        pool and stay with it across batches); None: `decode_fn`. min_decode_rows: `decode_fn` is fed at least this
        many cache rows, the last one repeated into spare rows of the buffers (which hold that many): a compiled
        decode_fn (the server's on CUDA, 2) then never traces a batch of one row, whose size of 1 would specialise a
        graph of its own (another inductor compile; a prompt's samples start as one cache row). The spare rows'
        outputs are dropped: a decoder's rows never mix."""
        assert min_decode_rows >= 1, min_decode_rows
        self.model, self.pad_id, self.adapters, self.graphs = model, pad_id, adapters, graphs
        self.min_decode_rows = min_decode_rows
        self.prefix_cache, self.drafts = prefix_cache, drafts
        self.decode_fn = decode_fn or model.forward
        self.device = next(model.parameters()).device
        self.version = 0  # the weight version of the model's weights now (the server sets it after a load)
        self._clear()

    def _clear(self) -> None:
        if self.graphs is not None:
            self.graphs.pool.give(getattr(self, "cache", None))
        self.rows: list[_Active] = []
        # The cache's P rows: one for each distinct run of tokens fed (rows whose tokens are all the same share one
        # until they draw different ones, `_fork`); per layer keys, values [P, H, length, D] (views of the buffers)
        self.cache: KVCache | None = None
        self.pos = torch.zeros((0,), dtype=torch.long, device=self.device)  # [P] next position id
        self.last = torch.zeros((0,), dtype=torch.long, device=self.device)  # [P] token not yet fed
        self.slots = torch.zeros((0,), dtype=torch.long, device=self.device)  # [P] adapter slot (0: base)
        self.phys_idx = torch.zeros((0,), dtype=torch.long, device=self.device)  # [B] each row's cache row
        self.params = SamplingTensors(*(t.to(self.device) for t in SamplingTensors.of([]).tensors()))  # [B]

    def __len__(self) -> int:
        return len(self.rows)

    def _limit(self, length: int, new: Sequence[Row] = ()) -> int:
        """The most columns the cache can need from filled `length` on: the longest the rows may still append."""
        return length + max([a.to_append for a in self.rows] + [r.max_new_tokens - 1 for r in new])

    def _compact(self, rows_capacity: int, length: int | None = None, new: Sequence[Row] = (),
                 reserve: int = 1) -> None:
        """Rebuild the cache without the leading columns no running row attends to, filled up to `length` (default:
        just the attended columns), with room for `rows_capacity` rows and at least `reserve` + 1 free columns."""
        first = self.cache.length - max(a.cached for a in self.rows)
        length = self.cache.length - first if length is None else length
        capacity = max(_capacity(length, self._limit(length, new)), length + reserve + 1)
        old = self.cache
        self.cache = old.rebuilt(rows_capacity, first, length, capacity, allocate=self._allocate)
        if self.graphs is not None:
            self.graphs.pool.give(old)

    @property
    def _allocate(self) -> Callable[..., KVCache]:
        """Where new cache buffers come from: the graphs' pool (kept across batches), or fresh ones."""
        return self.graphs.pool.allocate if self.graphs is not None else KVCache.allocate

    def _adapted(self, rows: Sequence[Row]) -> bool:
        """Whether any of `rows` has an adapter (an engine that never loaded one skips the scan)."""
        return self.adapters is not None and bool(self.adapters.stacks) and any(r.adapter for r in rows)

    @contextlib.contextmanager
    def _adapter_rows(self, slots: torch.Tensor, rows: Sequence[Row]):
        """The forward inside sees each row's adapter slot (`slots` [N], one per row of its input); a forward of
        base rows only leaves the adapters' hooks idle."""
        if not self._adapted(rows):
            yield
            return
        self.adapters.rows = slots
        try:
            yield
        finally:
            self.adapters.rows = None

    def _decode(self) -> torch.Tensor:
        """Feed each running row its last token; logits [B, V] fp32."""
        if self.cache.length + 2 > self.cache.capacity:  # room for this column and one spare (see _capacity)
            self._compact(self.cache.rows_capacity)
        length = self.cache.length
        rows = [a.row for a in self.rows]
        # Rows with an adapter decode eagerly: a compiled forward (or a graph) does not see hooks added after it was
        # compiled (torch._dynamo's skip_nnmodule_hook_guards), and the adapters' hooks come and go with loads.
        adapted = self._adapted(rows)
        logits = None
        if self.graphs is not None and not adapted and self.graphs.usable(self.cache):
            logits = self.graphs.decode(self.cache, self.last, self.pos)  # None: capturing failed, decode eagerly
        if logits is None:
            # Row i's real tokens are its last pos_i columns, and the one it is fed now: mask [B, length + 1].
            columns = torch.arange(length + 1, device=self.device)
            mask = columns[None, :] >= (length - self.pos)[:, None]
            decode = self.model.forward if adapted else self.decode_fn
            p = len(self.last)
            spare = 0 if adapted else max(0, self.min_decode_rows - p)
            last, pos = self.last, self.pos
            if spare:  # [P + spare]: the last cache row's inputs again, into the buffers' next rows (min_decode_rows)
                assert p + spare <= self.cache.rows_capacity, (p, spare, self.cache.rows_capacity)  # see _join
                last, pos, mask = (torch.cat([t, t[-1:].expand(spare, *t.shape[1:])]) for t in (last, pos, mask))
                self.cache.view(p + spare, length)
            with self._adapter_rows(self.slots, rows):
                logits = decode(input_ids=last[:, None], attention_mask=mask, position_ids=pos[:, None],
                                past_key_values=self.cache, use_cache=True).logits[:p, -1].float()
            if spare:
                self.cache.view(p, length + 1)
        self.pos = self.pos + 1
        for a in self.rows:
            a.cached += 1
        return logits

    def _prefills(self, rows: list[Row]) -> list[tuple[list[int], _Prefill]]:
        """The prefill of joining `rows`, as (indices into rows, their _Prefill) per chunk: distinct (prompt,
        adapter) pairs grouped by how many tokens each feeds (its suffix after the prefix cache's hit), so that one
        long suffix does not pad every other row to its length. An agent step's next turns feed ~25 tokens each
        after a ~110-token reused prefix, while a few rows feed 100-180 (their prefix not cached): one forward
        padded to 180 computed 4.5x the tokens of two. A chunk may pad to at most twice its real tokens (a group's
        rows, sharing a prompt, stay in one chunk)."""
        unique = list(dict.fromkeys((r.prompt, r.adapter) for r in rows))
        if self.prefix_cache is not None:
            hits = [self.prefix_cache.lookup(p, a, self.version) for p, a in unique]
        else:
            hits = [(None, 0)] * len(unique)
        position = {k: i for i, k in enumerate(unique)}
        owner = [position[r.prompt, r.adapter] for r in rows]  # each row's distinct prompt, hashed once
        out = []
        for chunk in padding_chunks([len(p) - n for (p, _), (_, n) in zip(unique, hits)]):
            chunk = sorted(chunk)  # first-appearance order: without shared prompts, row j is prompt j (_Prefill)
            members = set(chunk)
            idx = [j for j, u in enumerate(owner) if u in members]
            part, part_unique, part_hits = [rows[j] for j in idx], [unique[i] for i in chunk], [hits[i] for i in chunk]
            pre = (self._prefill_reusing(part, part_unique, part_hits) if any(n for _, n in part_hits)
                   else self._prefill(part, part_unique))
            out.append((idx, pre))
        return out

    def _prefill(self, rows: list[Row], unique: list[tuple[tuple[int, ...], int]]) -> _Prefill:
        """Left-padded prefill of new rows, one row per distinct (prompt, adapter) `unique` (the n samples of a
        group share one). Its inputs are built on the host and moved in one copy."""
        L = max(len(p) for p, _ in unique)
        ids = torch.tensor([[self.pad_id] * (L - len(p)) + list(p) for p, _ in unique], dtype=torch.long)
        mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p, _ in unique], dtype=torch.long)
        index = {k: i for i, k in enumerate(unique)}
        owners = tuple(index[r.prompt, r.adapter] for r in rows)
        where = torch.tensor(owners, dtype=torch.long)
        pos = torch.tensor([len(p) for p, _ in unique], dtype=torch.long)
        unique_slots = torch.tensor([a for _, a in unique], dtype=torch.long)
        ids, mask, where, pos, unique_slots, *params = _to_device(
            [ids, mask, where, pos, unique_slots, *SamplingTensors.of(rows).tensors()], self.device)
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        cache = DynamicCache()
        with self._adapter_rows(unique_slots, rows):
            logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                                use_cache=True, logits_to_keep=1).logits[:, -1].float()
        return _Prefill(logits, [(layer.keys, layer.values) for layer in cache.layers], where, owners, pos,
                        unique_slots, SamplingTensors(*params))

    def _prefill_reusing(self, rows: list[Row], unique: list[tuple[tuple[int, ...], int]],
                         hits: list[tuple[Any, int]]) -> _Prefill:
        """The prefill of `_prefill` where distinct prompt i reuses the first n_i tokens of cached entry e_i
        ((e_i, n_i) = hits[i]; n_i = 0: none) and feeds only its s_i = len(prompt_i) - n_i other tokens.

        Layout of the forward: past columns [0, P) hold each prefix right-aligned at P (P = max n_i), the input
        [u, S] each suffix right-aligned at S (S = max s_i); the mask [u, P + S] is 1 on the 2 * u real runs, so
        the gap between them is padding, and the positions continue from n_i. Its KV is then gathered into
        `_Prefill.kv`'s layout (each row's n_i + s_i real columns right-aligned at L = max len(prompt_i))."""
        u = len(unique)
        reuse = [n for _, n in hits]
        P, S = max(reuse), max(len(p) - n for (p, _), n in zip(unique, reuse))
        L = max(len(p) for p, _ in unique)
        ids, mask, positions, gather = [], [], [], []
        for (p, _), n in zip(unique, reuse):
            s = len(p) - n
            ids.append([self.pad_id] * (S - s) + list(p[n:]))
            mask.append([0] * (P - n) + [1] * n + [0] * (S - s) + [1] * s)
            positions.append([0] * (S - s) + list(range(n, n + s)))
            # Source column of each of the row's L output columns (padding: any real column, P + S - 1).
            gather.append([P + S - 1] * (L - n - s) + list(range(P - n, P)) + list(range(P + S - s, P + S)))
        index = {k: i for i, k in enumerate(unique)}
        owners = tuple(index[r.prompt, r.adapter] for r in rows)
        host = [torch.tensor(x, dtype=torch.long) for x in (ids, mask, positions, gather)]
        host += [torch.tensor(owners, dtype=torch.long), torch.tensor([len(p) for p, _ in unique], dtype=torch.long),
                 torch.tensor([a for _, a in unique], dtype=torch.long)]
        ids, mask, positions, gather, where, pos, unique_slots, *params = _to_device(
            host + list(SamplingTensors.of(rows).tensors()), self.device)
        like = next(e for e, _ in hits if e is not None).kv
        past = KVCache.allocate([(k[None], v[None]) for k, v in like], u, P + S)
        for i, (entry, n) in enumerate(hits):
            for (k, v), layer in zip(entry.kv if n else (), past.layers):
                layer.key_buffer[i, :, P - n:P] = k[:, :n]
                layer.value_buffer[i, :, P - n:P] = v[:, :n]
        past.view(u, P)
        with self._adapter_rows(unique_slots, rows):
            logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=past,
                                use_cache=True, logits_to_keep=1).logits[:, -1].float()
        idx = gather[:, None, :, None].expand(u, like[0][0].shape[0], L, like[0][0].shape[2])
        kv = [(layer.keys.gather(2, idx), layer.values.gather(2, idx)) for layer in past.layers]
        return _Prefill(logits, kv, where, owners, pos, unique_slots, SamplingTensors(*params),
                        tuple(reuse[j] for j in owners))

    def _remember(self, finished: list[int]) -> None:
        """Leave the KV of rows `finished` (indices into the batch) in the prefix cache: every token each fed the
        model, when all of it came from the weights now (a row paused across a weight update is not kept)."""
        kept, rows_seen = [], set()
        for i in finished:  # rows that share a cache row fed the same tokens: one entry for them
            a = self.rows[i]
            if a.spans == [(0, self.version)] and a.phys not in rows_seen:
                rows_seen.add(a.phys)
                kept.append(i)
        if not kept:
            return
        # One copy per layer for all of them: each row's last `cached` columns, packed [sum of cached, H, D] (an
        # index on rows and one on columns, separated by the head slice: the indexed dimension comes first).
        counts = torch.tensor([self.rows[i].cached for i in kept], dtype=torch.long)
        starts = counts.cumsum(0) - counts
        flat = torch.arange(int(counts.sum()))
        rows_idx = torch.tensor([self.rows[i].phys for i in kept], dtype=torch.long).repeat_interleave(counts)
        cols = self.cache.length - counts.repeat_interleave(counts) + flat - starts.repeat_interleave(counts)
        rows_idx, cols = _to_device([rows_idx, cols], self.device)
        packed = [(layer.keys[rows_idx, :, cols], layer.values[rows_idx, :, cols]) for layer in self.cache.layers]
        for i, start, n in zip(kept, starts.tolist(), counts.tolist()):
            a = self.rows[i]
            tokens = a.row.prompt + tuple(a.out_ids[:-1])
            assert len(tokens) == n, (len(tokens), n)
            kv = [(k[start:start + n].transpose(0, 1), v[start:start + n].transpose(0, 1)) for k, v in packed]
            self.prefix_cache.store(tokens, a.row.adapter, self.version, kv, owned=False)

    def _join(self, new: list[tuple[Row, Any]], pre: _Prefill) -> None:
        """Append the prefilled rows: one cache row per distinct prompt after the running ones, right-aligned at
        the batch's length (a new cache when they do not fit: more rows than the buffers hold, or a prompt longer
        than the filled length), their positions after the running rows', and each row's parameters. The buffers
        hold a row for every row of the batch, the most it can need once all of them diverge (`_fork`)."""
        rows, u, prompt_len = [r for r, _ in new], pre.kv[0][0].shape[0], pre.kv[0][0].shape[2]
        first = self.cache.rows if self.cache is not None else 0
        needed = max(first + u, len(self.rows) + len(rows), self.min_decode_rows)
        if self.cache is None:
            self.cache = self._allocate(pre.kv, needed, _capacity(prompt_len, self._limit(prompt_len, rows)))
            self.cache.view(0, prompt_len)
        elif needed > self.cache.rows_capacity or prompt_len > self.cache.length:
            live = max(a.cached for a in self.rows)
            self._compact(max(self.cache.rows_capacity, needed), max(live, prompt_len), rows)
        self.cache.append_rows(pre.kv, None, u)
        self.pos, self.params = torch.cat([self.pos, pre.pos]), self.params.cat(pre.params)
        self.slots = torch.cat([self.slots, pre.slots])
        self.phys_idx = torch.cat([self.phys_idx, pre.where + first])
        reused = pre.reused or (0,) * len(new)
        joined = [_Active(r, h, len(r.prompt), reused=n, phys=first + j)
                  for (r, h), n, j in zip(new, reused, pre.owners)]
        if self.drafts is not None:
            for a in joined:
                a.ctx, a.seen = list(a.row.prompt), {}
                index_tail(a.ctx, a.seen, self.drafts.n, 0)
        self.rows += joined

    def _keep(self, keep: list[int]) -> None:
        """Keep only rows `keep` (ascending indices) and the cache rows they use: the last kept cache rows move into
        the places of removed ones."""
        if not keep:
            self._clear()
            return
        changed = len(keep) < len(self.rows)
        if changed:
            self.rows = [self.rows[i] for i in keep]
            (keep_t,) = _to_device([torch.tensor(keep, dtype=torch.long)], self.device)
            self.params = self.params.select(keep_t)
        used = sorted({a.phys for a in self.rows})
        if len(used) < self.cache.rows:
            changed = True
            order, dst, src = _swap_remove(self.cache.rows, used)
            place = {old: new for new, old in enumerate(order)}
            for a in self.rows:
                a.phys = place[a.phys]
            order_t, dst_t, src_t = _to_device([torch.tensor(x, dtype=torch.long) for x in (order, dst, src)],
                                               self.device)
            self.pos, self.last = self.pos.index_select(0, order_t), self.last.index_select(0, order_t)
            self.slots = self.slots.index_select(0, order_t)
            if dst:
                self.cache.move_rows(dst_t, src_t, len(used))
            else:
                self.cache.view(len(used), self.cache.length)
        if changed:  # (forks rebuilt it already: `_part`)
            (self.phys_idx,) = _to_device([torch.tensor([a.phys for a in self.rows], dtype=torch.long)],
                                          self.device)
        # Leading columns no kept row attends to: dropped once they are half the cache (a rebuild).
        if 2 * max(a.cached for a in self.rows) <= self.cache.length:
            self._compact(self.cache.rows_capacity)

    def _fork(self, src: list[int]) -> None:
        """New cache rows, copies of rows `src` (their keys, values, positions, adapter slots), after the batch's:
        for rows that shared a cache row and drew different tokens (the buffers have room: see `_join`)."""
        assert self.cache.rows + len(src) <= self.cache.rows_capacity, (self.cache.rows, len(src))
        (src_t,) = _to_device([torch.tensor(src, dtype=torch.long)], self.device)
        self.cache.copy_rows(src_t)
        self.pos = torch.cat([self.pos, self.pos.index_select(0, src_t)])
        self.slots = torch.cat([self.slots, self.slots.index_select(0, src_t)])

    @torch.inference_mode()  # the cache's buffers are inference tensors, updated in place
    def abort(self, rids: Collection[str] | None) -> list[tuple[Any, RowResult]]:
        """Retire rows named in `rids` (None: all) with what they have, finish reason "abort"."""
        cut = [i for i, a in enumerate(self.rows) if rids is None or a.row.rid in rids]
        if not cut:
            return []
        out = [(self.rows[i].handle, self.rows[i].result("abort")) for i in cut]
        cut_set = set(cut)
        self._keep([i for i in range(len(self.rows)) if i not in cut_set])
        return out

    def _drafts(self) -> list[list[int]]:
        """Each cache row's draft (from the context of its rows, all the same; at most what each of them may still
        sample but one, so that the tokens fed never pass a row's limit, and within the drafts' step_tokens); []
        when no cache row has one (or the batch does not speculate, or has too many cache rows to): the step
        decodes one token a row."""
        if self.drafts is None or not self.rows:
            return []
        room = self.drafts.step_tokens // self.cache.rows - 1  # draft tokens a cache row within the step's budget
        if room < 1:
            return []
        limit, context = [room] * self.cache.rows, [None] * self.cache.rows
        for a in self.rows:
            limit[a.phys] = min(limit[a.phys], a.to_append - 1)
            context[a.phys] = a
        drafts = [self.drafts.propose(a.ctx, a.seen, n) for a, n in zip(context, limit)]
        return drafts if any(drafts) else []

    def _verify(self, drafts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
        """Speculative decode step: feed each cache row its last token and its draft d (one forward of [P, q],
        q = 1 + the longest draft; shorter drafts padded), draw a token at every fed position for each row as
        `step` would (keyed by the row's seed and the position it takes), and keep for a row its draws up to the
        first one that differs from its draft: the a drafts it drew itself plus the draw after them (a + 1 tokens,
        cut after a stop token). Those are the tokens the row draws decoding one at a time, since each draw sees
        the same prefix.

        The cache: the forward wrote q columns a cache row. Rows of one cache row that kept different tokens part
        (`_fork`, copies with those columns); then each cache row keeps the first a + 1 of them (the fed tokens its
        rows' kept draws follow) and is shifted right to end at the new length (length + max of a + 1), restoring
        the layout of the module docstring. Returns each row's (tokens, log-probs)."""
        q = 1 + max(len(d) for d in drafts)
        if self.cache.length + q + 1 > self.cache.capacity:  # room for the q columns and one spare (see _capacity)
            self._compact(self.cache.rows_capacity, reserve=q)
        length = self.cache.length
        padded = torch.tensor([d + [self.pad_id] * (q - 1 - len(d)) for d in drafts], dtype=torch.long)  # [P, q-1]
        (padded,) = _to_device([padded], self.device)
        ids = torch.cat([self.last[:, None], padded], dim=1)  # [P, q]
        positions = self.pos[:, None] + torch.arange(q, device=self.device)  # [P, q]: the fed tokens' position ids
        # Row i's real tokens are its last pos_i columns, then the q fed now (transformers adds the causal part).
        mask = torch.arange(length + q, device=self.device)[None, :] >= (length - self.pos)[:, None]
        rows = [a.row for a in self.rows]
        with self._adapter_rows(self.slots, rows):
            logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=self.cache,
                                use_cache=True).logits.float()  # [P, q, V]
        B = len(rows)
        each = torch.arange(B, device=self.device).repeat_interleave(q)
        tok, lp = sample_with_logprobs(logits.index_select(0, self.phys_idx).flatten(0, 1), self.params.select(each),
                                       [r for r in rows for _ in range(q)],
                                       (positions + 1).index_select(0, self.phys_idx).flatten())
        host_tok, host_lp = torch.stack([tok.to(torch.float64), lp.to(torch.float64)]).view(2, B, q).tolist()
        self._check_finite(host_lp, [])
        out = []
        parts: dict[int, dict[tuple[int, ...], list[_Active]]] = {}  # cache row -> the rows' kept tokens -> rows
        for a, toks, lps in zip(self.rows, host_tok, host_lp):
            d = drafts[a.phys]
            n = 0
            while n < len(d) and int(toks[n]) == d[n] and int(toks[n]) not in a.row.stop_ids:
                n += 1
            out.append(([int(t) for t in toks[:n + 1]], lps[:n + 1]))
            parts.setdefault(a.phys, {}).setdefault(tuple(out[-1][0]), []).append(a)
            a.verify_steps += bool(d)
            a.accepted += n
            a.cached += n + 1
        # kept: fed tokens whose keys and values stay, a cache row (the last one, and the drafts its rows drew)
        kept = [len(tokens) for tokens in self._part(parts)]
        width = max(kept)
        self.cache.align([width - k for k in kept], length + width, max(a.cached for a in self.rows))
        (shift,) = _to_device([torch.tensor(kept, dtype=torch.long)], self.device)
        self.pos = self.pos + shift
        return out

    def _check_finite(self, drawn_lp: list[list[float]], host_lp: list[float]) -> None:
        """drawn_lp: the log-probs each of the first len(drawn_lp) rows drew (a speculative step), host_lp: the one
        each later row drew (rows in batch order)."""
        # One sum first: NaN exactly when some log-prob is (they are <= 0, so no inf - inf); the per-row scan only then.
        total = sum(host_lp) + sum(p for lps in drawn_lp for p in lps)
        if total == total:
            return
        per_row = drawn_lp + [[p] for p in host_lp]
        bad = [a.row.rid or str(i) for i, (a, lps) in enumerate(zip(self.rows, per_row)) if any(p != p for p in lps)]
        if bad:  # NaN logits make NaN log-probs: the draw (argmax of NaN ratios) would be a silent wrong token
            raise RuntimeError(f"the model's logits are not finite (NaN log-probs) for rows {bad[:8]}: its weights or "
                               f"activations overflowed or were loaded wrong; check the last weight update")

    def _part(self, groups: dict[int, dict[Any, list[_Active]]]) -> list[Any]:
        """Part the rows of each cache row by what they drew (groups: cache row -> key -> its rows, e.g. the tokens
        drawn): the first key's rows stay, each other key's rows move to a copy of the cache row (`_fork`, after
        the batch's). Returns the key of every cache row after the part (None where no group names one)."""
        keys: list[Any] = [None] * self.cache.rows
        src = []
        for p, by_key in groups.items():
            (keys[p], _), *others = by_key.items()
            for key, moving in others:
                for a in moving:
                    a.phys = len(keys)
                keys.append(key)
                src.append(p)
        if src:
            self._fork(src)
            (self.phys_idx,) = _to_device([torch.tensor([a.phys for a in self.rows], dtype=torch.long)], self.device)
        return keys

    def _next_tokens(self, keep: list[int]) -> None:
        """Set each cache row's next token to feed (`last`): the last token its continuing rows (`keep`) drew (rows
        of one cache row that drew different tokens part, `_part`); a cache row no continuing row uses gets the pad
        id (it leaves in `_keep`)."""
        drew: dict[int, dict[int, list[_Active]]] = {}
        for i in keep:
            a = self.rows[i]
            drew.setdefault(a.phys, {}).setdefault(a.out_ids[-1], []).append(a)
        last = [self.pad_id if t is None else t for t in self._part(drew)]
        (self.last,) = _to_device([torch.tensor(last, dtype=torch.long)], self.device)

    @torch.inference_mode()
    def step(self, new: list[tuple[Row, Any]] = ()) -> list[tuple[Any, RowResult]]:
        """One decode step for the running rows (a speculative one when any has a draft: `_verify`) plus the
        prefill of `new` (row, handle) pairs; returns the (handle, result) of every row that finished in this
        step. Rows fed the same tokens so far (the samples of a prompt, until they draw different tokens) share a
        cache row and its forward; each draws its own token from the shared logits."""
        done = [(h, RowResult([], [], "length")) for r, h in new if r.max_new_tokens == 0]
        new = [(r, h) for r, h in new if r.max_new_tokens > 0]
        for r, _ in new:
            if not r.prompt:
                raise ValueError("a prompt is empty: give at least one input token (e.g. the bos id)")
        drafts = self._drafts()
        drawn = self._verify(drafts) if drafts else []  # per running row: (tokens, log-probs), in batch order
        logits = [self._decode().index_select(0, self.phys_idx)] if self.rows and not drafts else []
        if new:
            for idx, pre in self._prefills([r for r, _ in new]):
                self._join([new[j] for j in idx], pre)
                logits.append(pre.logits.index_select(0, pre.where))
        if not self.rows:
            return done
        if logits:  # one token for each row after the first len(drawn) (all of them unless the step verified)
            first = len(drawn)
            later = torch.arange(first, len(self.rows), device=self.device)
            params = self.params.select(later) if first else self.params
            # self.pos is each cache row's next position id: the position of the token drawn now (its prompt's
            # length for a joining row, one past the token just fed for a decoding one).
            pos = self.pos.index_select(0, self.phys_idx[first:])
            tok, lp = sample_with_logprobs(torch.cat(logits), params, [a.row for a in self.rows[first:]], pos)
            # The step's one host read: tokens (exact in float64, ids < 2^53) and log-probs in one transfer.
            host_tok, host_lp = torch.stack([tok.to(torch.float64), lp.to(torch.float64)]).tolist()
            self._check_finite([lps for _, lps in drawn], host_lp)
            drawn += [([int(t)], [p]) for t, p in zip(host_tok, host_lp)]
        keep, finished = [], []
        for i, (a, (toks, lps)) in enumerate(zip(self.rows, drawn)):
            if not a.spans or a.spans[-1][1] != self.version:  # this step's forward ran on these weights
                a.spans.append((len(a.out_ids), self.version))
            for t, p in zip(toks, lps):
                a.out_ids.append(t)
                a.out_lp.append(p)
                if a.ctx is not None:
                    a.ctx.append(t)
                    index_tail(a.ctx, a.seen, self.drafts.n, len(a.ctx) - 1)
                if t in a.row.stop_ids:
                    done.append((a.handle, a.result("stop")))
                    break
                if len(a.out_ids) >= a.row.max_new_tokens:
                    done.append((a.handle, a.result("length")))
                    break
            else:
                keep.append(i)
                continue
            finished.append(i)
            if self.drafts is not None:
                self.drafts.remember(a.ctx)
        self._next_tokens(keep)
        if self.prefix_cache is not None and finished:
            self._remember(finished)
        self._keep(keep)
        return done


def generate_rows(model, rows: list[Row], *, pad_id: int, decode_fn: Callable | None = None,
                  drafts: NgramDrafts | None = None, graphs: GraphDecode | None = None) -> list[RowResult]:
    """Generate every row to the end in one batch (benchmarks, tests); the server steps a DecodeBatch itself."""
    batch = DecodeBatch(model, pad_id=pad_id, decode_fn=decode_fn, drafts=drafts, graphs=graphs)
    results: dict[int, RowResult] = {}
    pending = [(r, i) for i, r in enumerate(rows)]
    while pending or len(batch):
        for i, res in batch.step(pending):
            results[i] = res
        pending = []
    return [results[i] for i in range(len(rows))]
