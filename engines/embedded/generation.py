"""Continuous-batching sampling with a KV cache: rows join and leave the batch between decode steps.

`DecodeBatch` holds the rows being generated: one left-padded KV cache [B, heads, L, head_dim] per layer, the
attention mask [B, L] (1 = a real token), each row's next position id (counting real tokens only, so padding
changes nothing but the mask) and the token it sampled last. One `step(new_rows)`:
  1. decode: feed every running row its last token (one forward of [B, 1]);
  2. prefill: the admitted rows, left-padded into one [b, L'] forward;
  3. merge: both caches and masks, left-padded to a common length, concatenated along the batch;
  4. sample one token per row, each with its own `torch.Generator` (seeded from the row's seed), so a row's
     tokens depend on its seed, not on which other rows share the batch;
  5. retire finished rows (stop token, length, or abort) and drop mask columns no row still attends to.

Sampling draws exactly the token `torch.multinomial(probs[i], 1, generator=g_i)` draws: ATen samples one token as
argmax(p / q) with q = empty_like(p).exponential_(1, generator) (the exponential race, i.e. the Gumbel-max trick,
Distributions.cpp). Here each sampled row fills its row of one [B, V] buffer from its own generator, and one
division and one argmax serve all rows; greedy rows (temperature 0) take the argmax of the logits and leave their
generator untouched. Without multinomial's per-call validity checks, sampling issues no host sync.

Log-probs: for each sampled token, `log_softmax(logits / T)[token]` at the row's temperature T (temperature 0,
greedy: `log_softmax(logits)`), before top-k/top-p: the distribution the token was sampled from before the
filters, which is what the trainer recomputes at the same temperature.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

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


@dataclass(frozen=True)
class RowResult:
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "abort"
    # (first token index, weight version) of each run of tokens one weight version produced: one span unless the
    # weights changed while the row was paused in the batch (an update in flight).
    versions: tuple[tuple[int, int], ...] = ()


@dataclass
class _Active:
    row: Row
    handle: Any  # the caller's tag, returned with the result
    gen: torch.Generator
    out_ids: list[int] = field(default_factory=list)
    out_lp: list[float] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)  # (first token index, version): RowResult.versions

    def result(self, finish_reason: str) -> RowResult:
        return RowResult(self.out_ids, self.out_lp, finish_reason, tuple(self.spans))


# ---------------------------------------------------------------------------------------------------- sampling
@dataclass(frozen=True)
class SamplingTensors:
    """Each row's sampling parameters as tensors [B] (batch order)."""

    temperature: torch.Tensor  # fp32; 0: greedy
    top_k: torch.Tensor  # int64; <= 0: off
    top_p: torch.Tensor  # fp32; 1: off

    @staticmethod
    def of(rows: Sequence[Row]) -> SamplingTensors:
        """The rows' parameters as CPU tensors."""
        return SamplingTensors(torch.tensor([r.temperature for r in rows], dtype=torch.float32),
                               torch.tensor([r.top_k for r in rows], dtype=torch.long),
                               torch.tensor([r.top_p for r in rows], dtype=torch.float32))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.temperature, self.top_k, self.top_p

    def select(self, idx: torch.Tensor) -> SamplingTensors:
        return SamplingTensors(*(t.index_select(0, idx) for t in self.tensors()))

    def cat(self, other: SamplingTensors) -> SamplingTensors:
        return SamplingTensors(*(torch.cat([a, b]) for a, b in zip(self.tensors(), other.tensors())))


def filter_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor) -> torch.Tensor:
    """Temperature-scale and top-k/top-p-mask logits [B, V] (rows with temperature 0 are left for argmax).

    top_k [B] (<= 0: off), top_p [B] (1: off). The most likely token always survives both filters."""
    scaled = logits / temperature.clamp_min(1e-6)[:, None]
    sorted_logits, sorted_idx = scaled.sort(dim=-1, descending=True)
    V = logits.shape[-1]
    ranks = torch.arange(V, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, V).clamp(max=V)
    drop = ranks >= k[:, None]
    # top-p: drop a token when the mass of strictly more likely tokens already reaches top_p.
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    mass_before = probs.cumsum(-1) - probs
    drop |= mass_before >= top_p[:, None]
    drop[:, 0] = False
    masked_sorted = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(scaled).scatter_(-1, sorted_idx, masked_sorted)


def sample_with_logprobs(logits: torch.Tensor, params: SamplingTensors, rows: Sequence[Row],
                         gens: Sequence[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
    """(next token [B] int64, its log-prob [B] fp32 at the row's temperature) from fp32 logits [B, V].

    params: the rows' parameters on the device; rows: the same on the host (which rows sample, whether any
    filters); gens[i]: row i's generator, advanced only when the row samples (temperature > 0)."""
    temperature = params.temperature
    # temperature 0 (greedy) reports temperature-1 log-probs
    logprobs = (logits / torch.where(temperature > 0, temperature, 1.0)[:, None]).log_softmax(-1)
    tok = logits.argmax(-1)
    sampled = [i for i, r in enumerate(rows) if r.temperature > 0]
    if sampled:
        probs = logprobs.exp()  # rows without top-k/top-p sample the scaled distribution itself
        if any(rows[i].top_k > 0 or rows[i].top_p < 1 for i in sampled):
            # every row through the filters (row-wise ops: a row's values do not depend on its neighbours), kept
            # where the row asks for a filter
            filtered = (params.top_k > 0) | (params.top_p < 1)
            probs = torch.where(filtered[:, None],
                                filter_logits(logits, temperature, params.top_k, params.top_p).softmax(-1), probs)
        race = torch.empty_like(probs)  # [B, V]: q ~ Exp(1) in each sampled row, from the row's own generator
        for i in sampled:
            race[i].exponential_(1, generator=gens[i])
        drawn = torch.div(probs, race, out=race).argmax(-1)  # = torch.multinomial(probs[i], 1, generator=gens[i])
        tok = torch.where(temperature > 0, drawn, tok)
    return tok, logprobs.gather(-1, tok[:, None])[:, 0]


# ---------------------------------------------------------------------------------------------------- the batch
def _left_pad(x: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    """Left-pad x with zeros along dim up to `length`."""
    missing = length - x.shape[dim]
    if missing == 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x.new_zeros(shape), x], dim=dim)


def _cache_tensors(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


class DecodeBatch:
    """The engine's running rows and their KV cache (the only mutable state of generation; see the module
    docstring). Not thread-safe: one thread (the engine's model thread) calls `step`."""

    def __init__(self, model, *, pad_id: int, decode_fn: Callable | None = None):
        self.model, self.pad_id = model, pad_id
        self.decode_fn = decode_fn or model.forward
        self.device = next(model.parameters()).device
        self.rows: list[_Active] = []
        self.cache: DynamicCache | None = None  # per layer: keys, values [B, H, L, D]
        self.mask = torch.zeros((0, 0), dtype=torch.long, device=self.device)  # [B, L]
        self.pos = torch.zeros((0,), dtype=torch.long, device=self.device)  # [B] next position id
        self.last = torch.zeros((0,), dtype=torch.long, device=self.device)  # [B] token not yet fed
        self.version = 0  # the weight version of the model's weights now (the server sets it after a load)

    def __len__(self) -> int:
        return len(self.rows)

    def _decode(self) -> torch.Tensor:
        """Feed each running row its last token; logits [B, V] fp32."""
        self.mask = torch.cat([self.mask, self.mask.new_ones((len(self.rows), 1))], dim=1)
        logits = self.decode_fn(input_ids=self.last[:, None], attention_mask=self.mask,
                                position_ids=self.pos[:, None], past_key_values=self.cache,
                                use_cache=True).logits[:, -1].float()
        self.pos = self.pos + 1
        return logits

    def _prefill(self, rows: list[Row]) -> tuple[torch.Tensor, DynamicCache, torch.Tensor, torch.Tensor]:
        """Left-padded prefill of new rows: (logits [b, V], cache, mask [b, L'], next positions [b]). Rows with
        the same prompt (the n samples of a group) share one prefill: its cache rows are repeated."""
        unique = list(dict.fromkeys(r.prompt for r in rows))
        b, L = len(unique), max(len(p) for p in unique)
        ids = torch.full((b, L), self.pad_id, dtype=torch.long, device=self.device)
        mask = torch.zeros((b, L), dtype=torch.long, device=self.device)
        for i, p in enumerate(unique):
            ids[i, L - len(p):] = torch.tensor(p, device=self.device)
            mask[i, L - len(p):] = 1
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        cache = DynamicCache()
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                            use_cache=True, logits_to_keep=1).logits[:, -1].float()
        if b < len(rows):
            where = {p: i for i, p in enumerate(unique)}
            idx = torch.tensor([where[r.prompt] for r in rows], device=self.device)
            cache = DynamicCache(ddp_cache_data=[(k.index_select(0, idx), v.index_select(0, idx))
                                                 for k, v in _cache_tensors(cache)])
            logits, mask = logits.index_select(0, idx), mask.index_select(0, idx)
            positions = positions.index_select(0, idx)
        return logits, cache, mask, positions[:, -1] + 1

    def _merge(self, cache: DynamicCache, mask: torch.Tensor, pos: torch.Tensor) -> None:
        """Append prefilled rows: both caches left-padded to a common length, concatenated along the batch."""
        if not self.rows:
            self.cache, self.mask, self.pos = cache, mask, pos
            return
        L = max(self.mask.shape[1], mask.shape[1])
        self.cache = DynamicCache(ddp_cache_data=[
            (torch.cat([_left_pad(k0, L, 2), _left_pad(k1, L, 2)]),
             torch.cat([_left_pad(v0, L, 2), _left_pad(v1, L, 2)]))
            for (k0, v0), (k1, v1) in zip(_cache_tensors(self.cache), _cache_tensors(cache))])
        self.mask = torch.cat([_left_pad(self.mask, L, 1), _left_pad(mask, L, 1)])
        self.pos = torch.cat([self.pos, pos])

    def _keep(self, keep: list[int]) -> None:
        """Keep only rows `keep` (indices), and drop leading mask columns no kept row attends to."""
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.cache, self.mask = None, self.mask[:0, :0]
            self.pos, self.last = self.pos[:0], self.last[:0]
            return
        idx = torch.tensor(keep, device=self.device)
        mask = self.mask.index_select(0, idx)
        first = int(mask.any(0).nonzero()[0, 0])  # host sync: only when rows leave
        self.mask = mask[:, first:]
        self.cache = DynamicCache(ddp_cache_data=[
            (k.index_select(0, idx)[:, :, first:], v.index_select(0, idx)[:, :, first:])
            for k, v in _cache_tensors(self.cache)])
        self.pos, self.last = self.pos.index_select(0, idx), self.last.index_select(0, idx)

    def abort(self, rids: Collection[str] | None) -> list[tuple[Any, RowResult]]:
        """Retire rows named in `rids` (None: all) with what they have, finish reason "abort"."""
        cut = [i for i, a in enumerate(self.rows) if rids is None or a.row.rid in rids]
        if not cut:
            return []
        out = [(self.rows[i].handle, self.rows[i].result("abort")) for i in cut]
        cut_set = set(cut)
        self._keep([i for i in range(len(self.rows)) if i not in cut_set])
        return out

    @torch.inference_mode()
    def step(self, new: list[tuple[Row, Any]] = ()) -> list[tuple[Any, RowResult]]:
        """One decode step for the running rows plus the prefill of `new` (row, handle) pairs; returns the
        (handle, result) of every row that finished in this step."""
        done = [(h, RowResult([], [], "length")) for r, h in new if r.max_new_tokens == 0]
        new = [(r, h) for r, h in new if r.max_new_tokens > 0]
        for r, _ in new:
            if not r.prompt:
                raise ValueError("a prompt is empty: give at least one input token (e.g. the bos id)")
        logits = [self._decode()] if self.rows else []
        if new:
            rows = [r for r, _ in new]
            new_logits, cache, mask, pos = self._prefill(rows)
            self._merge(cache, mask, pos)
            self.rows += [_Active(r, h, _generator(r.seed, self.device)) for r, h in new]
            logits.append(new_logits)
        if not self.rows:
            return done
        rows = [a.row for a in self.rows]
        params = SamplingTensors(*(t.to(self.device) for t in SamplingTensors.of(rows).tensors()))
        tok, lp = sample_with_logprobs(torch.cat(logits), params, rows, [a.gen for a in self.rows])
        self.last = tok
        # One host sync per step: the finished-row bookkeeping needs the tokens on the host.
        keep = []
        for i, (a, t, p) in enumerate(zip(self.rows, tok.tolist(), lp.tolist())):
            if not a.spans or a.spans[-1][1] != self.version:  # this step's forward ran on these weights
                a.spans.append((len(a.out_ids), self.version))
            a.out_ids.append(t)
            a.out_lp.append(p)
            if t in a.row.stop_ids:
                done.append((a.handle, a.result("stop")))
            elif len(a.out_ids) >= a.row.max_new_tokens:
                done.append((a.handle, a.result("length")))
            else:
                keep.append(i)
        self._keep(keep)
        return done


def _generator(seed: int, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def generate_rows(model, rows: list[Row], *, pad_id: int, decode_fn: Callable | None = None) -> list[RowResult]:
    """Generate every row to the end in one batch (benchmarks, tests); the server steps a DecodeBatch itself."""
    batch = DecodeBatch(model, pad_id=pad_id, decode_fn=decode_fn)
    results: dict[int, RowResult] = {}
    pending = [(r, i) for i, r in enumerate(rows)]
    while pending or len(batch):
        for i, res in batch.step(pending):
            results[i] = res
        pending = []
    return [results[i] for i in range(len(rows))]
