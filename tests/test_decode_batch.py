"""The embedded engine's decode loop (engines/embedded/generation.py, its sampling engines/embedded/sampling.py;
issue 26 item 7).

- Batched sampling (one kernels.sampling call for the batch, keyed by each row's seed and token position) draws the
  token the float64 reference draws from the row's own probabilities (softmax(logits / T), top-k/top-p-filtered
  where the row asks), with its log-prob, over many fresh seeds and positions; a row draws the same token alone or
  in any batch; only the rows that filter go through the filters' sort; and the draws follow softmax(logits / T)
  (chi-square over 100k draws with a concrete bound).
- A DecodeBatch (preallocated KV cache, rows left-padded to a common column) gives, for every row, the logits and
  log-probs of a plain forward of prompt + generated tokens without a cache, and the tokens the reference draws
  from those logits at each token's position, while rows join and leave at different steps, rows are aborted,
  stop tokens end rows, a group shares one prefill and the cache grows past its first capacity. The cache's
  in-place joins, moved rows, rebuilds and growth all happen in the run (asserted, so the comparison covers them).
- A decode step reads the host once (tokens and log-probs in one transfer); an abort reads it never.
- The compiled decode (kernels.device.dynamic_compile, fed >= 2 rows: min_decode_rows) traces the cache without
  graph breaks, in one graph for every row count (a plain dynamic compile needs three).
"""

from __future__ import annotations

import collections
import os
import re
import traceback
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from engines.embedded import generation, sampling
from engines.embedded.generation import DecodeBatch, KVCache, Row, generate_rows
from engines.embedded.presets import build_tiny_model
from engines.embedded.sampling import SamplingTensors, filter_logits, sample_with_logprobs
from kernels import use_backend
from kernels.reference import sample_tokens_reference

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------ references
def _reference_sample(logits: torch.Tensor, row: Row, position: int) -> tuple[int, float]:
    """One row, written plainly: log-probs at the row's temperature (1 when greedy), the token by argmax (greedy)
    or, keyed by (row.seed, position), by the float64 reference of kernels.sampling on the top-k/top-p-filtered (or
    plain) probabilities. logits [V] fp32."""
    device = logits.device
    temperature = torch.tensor([row.temperature], dtype=torch.float32, device=device)
    logprobs = (logits[None] / (temperature if row.temperature > 0 else 1.0)).log_softmax(-1)[0]
    if row.temperature == 0:
        tok = int(logits.argmax())
    else:
        if row.top_k > 0 or row.top_p < 1:
            probs = filter_logits(logits[None], temperature, torch.tensor([row.top_k], device=device),
                                  torch.tensor([row.top_p], dtype=torch.float32, device=device)).softmax(-1)[0]
        else:
            probs = logprobs.exp()
        tok = sample_tokens_reference(probs[None], [row.seed], [position])[0]
    return tok, float(logprobs[tok])


def _random_row(g: torch.Generator, vocab: int, **fields) -> Row:
    """A row with random sampling parameters: greedy or T in [0.2, 2); top-k off, 0 or 1..V+4; top-p off or
    in [0.05, 0.99)."""
    u = torch.rand(5, generator=g).tolist()
    temperature = 0.0 if u[0] < 0.25 else 0.2 + 1.8 * u[1]
    top_k = [-1, 0, int(torch.randint(1, vocab + 5, (), generator=g))][int(u[2] * 3)]
    top_p = 1.0 if u[3] < 0.4 else 0.05 + 0.94 * u[4]
    defaults = dict(prompt=(1,), temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=1,
                    stop_ids=frozenset(), seed=int(torch.randint(0, 2**62, (), generator=g)))
    return Row(**{**defaults, **fields})


def _params(rows: list[Row]) -> SamplingTensors:
    return SamplingTensors.of(rows)


# ------------------------------------------------------------------------------------------------ sampling
def _sample(logits: torch.Tensor, rows: list[Row], positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """sample_with_logprobs on CPU inputs: the rows' parameters and the positions their tokens take."""
    return sample_with_logprobs(logits, _params(rows), rows, torch.tensor(positions, dtype=torch.long))


def test_batched_sampling_draws_the_seeded_reference():
    # Random batches of greedy, plain and filtered rows at random positions (up to 2^40), several consecutive
    # positions each: every token and log-prob equals the reference's for that row alone, and the batch permuted
    # (with a row repeated) gives each row the same token: nothing depends on the batch's composition.
    g = torch.Generator().manual_seed(2026)
    seen = collections.Counter()
    for _ in range(30):
        B = int(torch.randint(1, 10, (), generator=g))
        V = [2, 7, 1271, 5003][int(torch.randint(0, 4, (), generator=g))]
        rows = [_random_row(g, V) for _ in range(B)]
        start = torch.randint(0, 2**40, (B,), generator=g).tolist()
        for step in range(3):  # consecutive positions: a new draw each
            scale = 0.5 + 7.5 * float(torch.rand((), generator=g))
            logits = torch.randn(B, V, generator=g) * scale
            positions = [p + step for p in start]
            tok, lp = _sample(logits, rows, positions)
            for i, row in enumerate(rows):
                ref_tok, ref_lp = _reference_sample(logits[i], row, positions[i])
                assert int(tok[i]) == ref_tok, (i, row)
                assert float(lp[i]) == ref_lp, (i, row)
                kind = "greedy" if row.temperature == 0 else (
                    "filtered" if row.top_k > 0 or row.top_p < 1 else "plain")
                seen[kind] += 1
                seen["not argmax"] += ref_tok != int(logits[i].argmax())
            if step == 0:
                order = torch.randperm(B, generator=g).tolist() + [0]
                shuffled = [rows[i] for i in order]
                tok2, _ = _sample(logits[order], shuffled, [positions[i] for i in order])
                assert tok2.tolist() == [int(tok[i]) for i in order]
    assert min(seen.values()) > 30, seen  # every kind of row, and draws that are not the argmax


def test_only_the_rows_that_filter_are_sorted(monkeypatch):
    # filter_logits (the full-vocabulary sort) sees exactly the sampled rows with top-k/top-p, in batch order, and
    # a batch without such rows never calls it; the plain rows' tokens equal the ones they draw in a batch of
    # plain rows only (the unfiltered path).
    calls = []
    real = sampling.filter_logits

    def spy(logits, temperature, top_k, top_p):
        calls.append((logits.clone(), top_k.tolist()))
        return real(logits, temperature, top_k, top_p)

    monkeypatch.setattr(sampling, "filter_logits", spy)
    g = torch.Generator().manual_seed(77)
    V = 1271
    plain = dict(top_k=-1, top_p=1.0)
    rows = [_random_row(g, V, temperature=0.9, **plain), _random_row(g, V, temperature=0.8, top_k=40, top_p=1.0),
            _random_row(g, V, temperature=0.0, top_k=5, top_p=1.0),  # greedy: no sort although it names a filter
            _random_row(g, V, temperature=1.3, **plain), _random_row(g, V, temperature=0.7, top_k=-1, top_p=0.6),
            _random_row(g, V, temperature=1.1, **plain)]
    logits = torch.randn(len(rows), V, generator=g) * 3
    positions = torch.randint(0, 1000, (len(rows),), generator=g).tolist()
    tok, _ = _sample(logits, rows, positions)
    assert len(calls) == 1 and calls[0][1] == [40, -1]
    assert torch.equal(calls[0][0], logits[[1, 4]])
    for i in (1, 4):
        assert int(tok[i]) == _reference_sample(logits[i], rows[i], positions[i])[0]
    calls.clear()
    only_plain = [0, 3, 5]
    tok_plain, _ = _sample(logits[only_plain], [rows[i] for i in only_plain], [positions[i] for i in only_plain])
    assert not calls and tok_plain.tolist() == [int(tok[i]) for i in only_plain]


def test_draws_follow_softmax_at_the_temperature():
    # 100k draws at positions 0..N-1 of one seed, one row of 40 logits at T = 0.7: Pearson's chi-square against
    # softmax(logits / 0.7) is below the 0.999 quantile of chi-square with 39 degrees of freedom (72.05), and the
    # same counts against softmax(logits) (T ignored) are far above it. A top-k = 5 row draws only its 5 most
    # likely tokens, in proportion to their renormalised probabilities (4 degrees of freedom: 18.47).
    g = torch.Generator().manual_seed(3)
    V, n = 40, 100_000
    z = torch.randn(V, generator=g) * 1.5

    def chi_square(counts: torch.Tensor, p: torch.Tensor) -> float:
        expected = p.double() / p.double().sum() * n
        return float(((counts.double() - expected) ** 2 / expected).sum())

    def draw(row: Row) -> torch.Tensor:
        rows = [row] * n
        with use_backend("torch"):  # the batch of 100k rows on the CPU's path (both paths equal the reference)
            tok, _ = _sample(z.expand(n, V).contiguous(), rows, list(range(n)))
        return torch.bincount(tok, minlength=V)

    counts = draw(Row((1,), 0.7, 1.0, -1, 1, frozenset(), 424242))
    p = torch.softmax(z / 0.7, -1)
    assert chi_square(counts, p) < 72.05
    assert chi_square(counts, torch.softmax(z, -1)) > 10 * 72.05
    counts = draw(Row((1,), 0.7, 1.0, 5, 1, frozenset(), 424243))
    top = torch.topk(p, 5).indices
    assert counts[top].sum() == n
    assert chi_square(counts[top], p[top]) < 18.47


def test_host_inputs_cross_in_one_copy_exactly():
    """The packing `_to_device` uses on an accelerator: float64 holds int64 ids < 2^53 and float32 values exactly,
    and each part keeps its shape and dtype."""
    g = torch.Generator().manual_seed(7)
    parts = [torch.randint(0, 2**53 - 1, (3, 5), generator=g), torch.randint(0, 2, (4,), generator=g),
             torch.randn(6, generator=g), torch.randint(-(2**40), 2**40, (2, 2, 2), generator=g),
             torch.zeros(0, dtype=torch.long)]
    flat = generation._pack(parts)
    assert flat.dtype == torch.float64 and flat.numel() == sum(p.numel() for p in parts)
    for got, want in zip(generation._unpack(flat, parts), parts):
        assert got.dtype == want.dtype and torch.equal(got, want)


# ------------------------------------------------------------------------------------------------ the batch
class _Spy:
    """Records the cache operations of each step (and the cache's capacity after it)."""

    def __init__(self, monkeypatch):
        self.steps: list[list[str]] = [[]]
        for name in ("allocate", "rebuilt", "append_rows", "move_rows"):
            self._wrap(monkeypatch, name)

    def _wrap(self, monkeypatch, name):
        original = KVCache.__dict__[name]
        fn = original.__func__ if isinstance(original, staticmethod) else original

        def spied(*args, **kwargs):
            self.steps[-1].append(name)
            return fn(*args, **kwargs)

        monkeypatch.setattr(KVCache, name, staticmethod(spied) if isinstance(original, staticmethod) else spied)

    def next_step(self):
        self.steps.append([])


def _rows_and_schedule(g: torch.Generator) -> tuple[list[Row], dict[int, list[int]], dict[int, set[str]]]:
    """Rows, which join at which step, and which rids are aborted before which step.

    Prompts of 1-12 tokens (one of 30: longer than the batch's filled length when it joins, so the cache is
    rebuilt), a group of three sharing one prompt (one prefill row), stop sets that end some rows early, and
    rows of up to 60 new tokens (past the cache's first capacity)."""
    def prompt(n):
        return tuple(torch.randint(6, 200, (n,), generator=g).tolist())

    def row(i, p, max_new, stops=()):
        return _random_row(g, 1000, prompt=p, max_new_tokens=max_new, rid=f"r{i}",
                           stop_ids=frozenset(stops))

    common = frozenset(range(6, 60))  # ~ a quarter of the likely ids: rows with it stop early
    group = prompt(5)
    rows = [row(0, prompt(3), 60), row(1, prompt(9), 25), row(2, prompt(1), 8, common),
            row(3, prompt(12), 40), row(4, group, 30), row(5, group, 30, common), row(6, group, 30),
            row(7, prompt(30), 20), row(8, prompt(2), 6, common), row(9, prompt(7), 45), row(10, prompt(4), 3),
            row(11, prompt(6), 50, common)]
    joins = {0: [0, 1, 2], 1: [3], 3: [4, 5, 6], 5: [7], 12: [8, 9], 14: [10], 30: [11]}
    aborts = {7: {"r1"}, 13: {"r9"}, 16: {"r6"}}
    return rows, joins, aborts


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_decode_batch_matches_a_full_forward_without_a_cache(arch, monkeypatch):
    g = torch.Generator().manual_seed(31 if arch == "llama" else 32)
    model = build_tiny_model(int(torch.randint(0, 1000, (), generator=g)), arch=arch)
    rows, joins, aborts = _rows_and_schedule(g)
    spy = _Spy(monkeypatch)
    batch = DecodeBatch(model, pad_id=0)
    seen_logits: dict[tuple[int, int], torch.Tensor] = {}  # (row, token index) -> decode logits [V]

    def decode(**kw):  # the batch's decode forward, recording each row's logits (its cache row's)
        out = model(**kw)
        for a in batch.rows:
            seen_logits[(a.handle, len(a.out_ids))] = out.logits[a.phys, -1].float().clone()
        return out

    batch.decode_fn = decode
    results, capacities, step = {}, [], 0
    while step <= max(joins) or len(batch):
        if step in aborts:
            results.update(batch.abort(aborts[step]))
        results.update(batch.step([(rows[i], i) for i in joins.get(step, [])]))
        capacities.append(batch.cache.capacity if batch.cache is not None else 0)
        spy.next_step()
        step += 1

    # The run covered what the cache does: joins in place and by a rebuild, rows moved into the places of
    # finished ones, growth past the first capacity.
    in_place = [ops for ops in spy.steps if "append_rows" in ops and "rebuilt" not in ops and "allocate" not in ops]
    rebuilt_for_join = [ops for ops in spy.steps if "rebuilt" in ops and "append_rows" in ops]
    assert in_place and rebuilt_for_join and any("move_rows" in ops for ops in spy.steps), spy.steps
    assert max(capacities) > capacities[0] and sum(1 for ops in spy.steps if "rebuilt" in ops) >= 3
    reasons = collections.Counter(r.finish_reason for r in results.values())
    assert set(results) == set(range(len(rows))) and reasons["stop"] and reasons["abort"] == 3, reasons

    checked = 0
    for i, row in enumerate(rows):
        res = results[i]
        P = len(row.prompt)
        seq = torch.tensor([list(row.prompt) + res.output_ids])
        with torch.no_grad():
            ref_logits = model(input_ids=seq).logits[0].float()  # [P + n, V], no cache, no padding
        for j, tok in enumerate(res.output_ids):  # token j takes position P + j
            ref_tok, ref_lp = _reference_sample(ref_logits[P - 1 + j], row, P + j)
            assert tok == ref_tok, (i, j)
            assert abs(res.logprobs[j] - ref_lp) < 1e-5, (i, j, res.logprobs[j], ref_lp)
            if j > 0:
                torch.testing.assert_close(seen_logits[(i, j)], ref_logits[P - 1 + j], atol=1e-5, rtol=0)
                checked += 1
        stopped = [j for j, t in enumerate(res.output_ids) if t in row.stop_ids]
        if res.finish_reason == "stop":
            assert stopped == [len(res.output_ids) - 1]
        else:
            assert not stopped
            assert (len(res.output_ids) == row.max_new_tokens) == (res.finish_reason == "length")
        assert res.versions == ((0, 0),)
    assert checked > 150
    # the group shared one prefill row yet drew its own tokens
    assert len({tuple(results[i].output_ids) for i in (4, 5, 6)}) == 3


# ------------------------------------------------------------------------------------------------ host reads
SYNC_OPS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::is_nonzero", "aten::equal", "aten::item"}
HOST_READS = {"tolist", "item", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__"}


def _origin(stack: list[traceback.FrameSummary]) -> str:
    """The innermost frame outside torch: project file:function, or 'transformers:<file>'."""
    for f in reversed(stack):
        path = os.path.relpath(f.filename, ROOT)
        if "/transformers/" in f.filename:
            return f"transformers:{Path(f.filename).name}"
        if not path.startswith(("..", ".venv", "tests/")):
            return f"{path}:{f.name}"
    return "?"


class _HostReads(TorchDispatchMode):
    """Every op that would synchronise with a CUDA device (scalar reads, data-dependent sizes) and every
    Python-level device-to-host read, with where it comes from (CPU tensors dispatch no aten op for `.tolist()`,
    so a function mode catches those)."""

    def __init__(self):
        super().__init__()
        self.events: list[tuple[str, str]] = []
        recorder = self

        class _Reads(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if getattr(func, "__name__", "") in HOST_READS:
                    recorder.events.append((f"Tensor.{func.__name__}", _origin(traceback.extract_stack()[:-1])))
                return func(*args, **(kwargs or {}))

        self.reads = _Reads()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in SYNC_OPS:
            self.events.append((func._schema.name, _origin(traceback.extract_stack()[:-1])))
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        super().__enter__()
        self.reads.__enter__()
        return self

    def __exit__(self, *exc):
        self.reads.__exit__(*exc)
        return super().__exit__(*exc)


def test_a_decode_step_reads_the_host_once():
    g = torch.Generator().manual_seed(9)
    model = build_tiny_model(4, arch="qwen2")
    rows = [_random_row(g, 1000, prompt=tuple(torch.randint(6, 200, (n,), generator=g).tolist()),
                        max_new_tokens=m, rid=f"r{k}")
            for k, (n, m) in enumerate([(3, 12), (7, 4), (1, 12), (5, 7), (2, 12), (4, 12)])]
    rows[0] = Row(rows[0].prompt, 0.0, 1.0, -1, 12, frozenset(), 1, "r0")  # greedy, filtered and plain rows
    rows[1] = Row(rows[1].prompt, 0.9, 0.8, 20, 4, frozenset(), 2, "r1")
    rows[2] = Row(rows[2].prompt, 1.2, 1.0, -1, 12, frozenset(), 3, "r2")
    batch = DecodeBatch(model, pad_id=0)
    batch.step([(r, k) for k, r in enumerate(rows[:5])])
    ours = ("Tensor.tolist", "engines/embedded/generation.py:step")
    left_in_a_decode_step = False
    for step in range(1, 9):
        admit = [(rows[5], 5)] if step == 3 else []
        before = len(batch)
        with _HostReads() as rec:
            batch.step(admit)
        if admit:  # the prefill's padding mask is read by transformers (sdpa's causal-skip check); rows join only
            assert rec.events.count(ours) == 1
            assert {e for e in rec.events if e != ours} <= {("aten::is_nonzero", "transformers:masking_utils.py"),
                                                            ("Tensor.__bool__", "transformers:masking_utils.py")}
        else:
            assert rec.events == [ours], (step, rec.events)
            left_in_a_decode_step |= len(batch) < before  # rows left (moved into the freed places): still once
        if step == 5:
            with _HostReads() as rec:
                batch.abort({"r2"})
            assert rec.events == [] and "r2" not in {a.row.rid for a in batch.rows}
    assert left_in_a_decode_step


def test_non_finite_logits_are_an_error_not_a_silent_token():
    """torch.multinomial raised on NaN probabilities; the batched draw would pick some token, so the step checks the
    log-probs it reads anyway and names the rows, before any row takes the token."""
    g = torch.Generator().manual_seed(4)
    model = build_tiny_model(4, arch="qwen2")
    rows = [_random_row(g, 1000, prompt=(5, 6, 7), max_new_tokens=5, rid=f"r{k}", temperature=t)
            for k, t in enumerate([0.0, 1.0, 0.7])]
    batch = DecodeBatch(model, pad_id=0)
    batch.step([(r, k) for k, r in enumerate(rows)])
    with torch.no_grad():
        model.lm_head.weight[3].fill_(float("nan"))  # one vocabulary row: every row's softmax turns NaN
    out_before = [list(a.out_ids) for a in batch.rows]
    with pytest.raises(RuntimeError, match=r"not finite \(NaN log-probs\) for rows \['r0', 'r1', 'r2'\]"):
        batch.step()
    assert [list(a.out_ids) for a in batch.rows] == out_before


def test_non_finite_logits_of_some_rows_name_only_those_rows():
    """The check sums the step's log-probs first and scans rows only when the sum is NaN: with NaN logits in some
    rows only (the embedding of the token those rows feed next), the error names exactly them, and no row takes a
    token."""
    g = torch.Generator().manual_seed(7)
    model = build_tiny_model(7, arch="qwen2")
    rows = [_random_row(g, 1000, prompt=(5 + k, 6, 7 + k), max_new_tokens=5, rid=f"r{k}", temperature=1.0, top_k=0,
                        top_p=1.0) for k in range(6)]
    batch = DecodeBatch(model, pad_id=0)
    batch.step([(r, k) for k, r in enumerate(rows)])
    last = {a.row.rid: a.out_ids[-1] for a in batch.rows}
    poisoned = last["r0"]
    want = [rid for rid, t in last.items() if t == poisoned]
    assert len(want) < len(rows), last  # some rows stay finite (else the seeds drew one token for all)
    with torch.no_grad():
        model.model.embed_tokens.weight[poisoned].fill_(float("nan"))
    out_before = [list(a.out_ids) for a in batch.rows]
    with pytest.raises(RuntimeError, match=re.escape(f"for rows {want}")):
        batch.step()
    assert [list(a.out_ids) for a in batch.rows] == out_before


def test_the_reference_recorder_sees_host_reads():
    """The recorder above is not blind: a multinomial draw, an item() and a tolist() are all seen."""
    with _HostReads() as rec:
        p = torch.rand(5)
        float(p.sum())
        p.tolist()
        p.nonzero()
    kinds = {name for name, _ in rec.events}
    assert {"Tensor.__float__", "Tensor.tolist", "aten::nonzero"} <= kinds, rec.events


# ------------------------------------------------------------------------------------------------ compiled decode
def _compiled_decode_rows(g: torch.Generator, **fields) -> list[Row]:
    """Six rows of 1-8 prompt tokens and 4-29 new ones: joined two a step, they finish one by one, so a run decodes
    2 rows first (as many as the cache's rows and the tiny model's KV heads: the sizes duck sizing would tie), then
    more, fewer, and its last row alone. fields: the rows' sampling (temperature=0.0: greedy)."""
    return [_random_row(g, 1000, prompt=tuple(torch.randint(6, 200, (int(n),), generator=g).tolist()),
                        max_new_tokens=int(m), **fields)
            for n, m in zip(torch.randint(1, 9, (6,), generator=g), torch.randint(4, 30, (6,), generator=g))]


def _decode_all(model, rows: list[Row], decode_fn, min_rows: int = 1) -> tuple[dict, collections.Counter]:
    """Every row decoded by one DecodeBatch joining two a step: (results by row, how many decode forwards ran at
    each row count fed; empty for the eager forward, decode_fn None). min_rows: the batch's min_decode_rows."""
    sizes: collections.Counter = collections.Counter()

    def counted(**kwargs):
        sizes[kwargs["input_ids"].shape[0]] += 1
        return decode_fn(**kwargs)

    batch, out, pending = DecodeBatch(model, pad_id=0, decode_fn=counted if decode_fn else None,
                                      min_decode_rows=min_rows), {}, list(enumerate(rows))
    while pending or len(batch):
        admit = [(r, i) for i, r in pending[:2]]
        pending = pending[2:]
        out.update(batch.step(admit))
    return out, sizes


@pytest.mark.parametrize("served", [False, True], ids=["sdpa-fp32", "engine-bf16"])
def test_a_compiled_decode_is_one_graph_for_every_row_count(served):
    """The server's CUDA decode, kernels.device.dynamic_compile over the model's forward, fed >= 2 rows
    (min_decode_rows; aot_eager here: dynamo and AOT autograd, which is where in-place cache writes can break): the
    same tokens as eager while rows join and leave, and one graph for ~30 steps at 1 to 5 rows, the cache rebuilt
    and grown. A plain torch.compile(dynamic=True) of the same forward traces three (duck sizing ties the first
    call's rows to the cache's and the KV heads; then the last row alone), with duck sizing off two (the last row
    alone), each an inductor compile on CUDA. Also as the CUDA engine serves a model: bf16 through the engine's
    attention (its folded decode traced by dynamo)."""
    from torch._dynamo.utils import counters

    from engines.embedded.attention import ENGINE_SDPA, use_engine_attention
    from kernels.device import dynamic_compile

    model = build_tiny_model(6, arch="llama", dtype=torch.bfloat16 if served else torch.float32)
    assert model.config.num_key_value_heads == 2  # the first step's row count: the coincidence duck sizing ties
    if served:
        use_engine_attention(model)
        assert model.config._attn_implementation == ENGINE_SDPA
    rows = _compiled_decode_rows(torch.Generator().manual_seed(12))

    eager, schedule = _decode_all(model, rows, model.forward)
    assert sum(schedule.values()) > 25 and schedule[1] > 0 and max(schedule) >= 4, schedule  # 1 to >= 4 rows
    graphs = {}
    for name, fn, min_rows in (("plain", torch.compile(model.forward, dynamic=True, backend="aot_eager"), 1),
                               ("duck sizing off", dynamic_compile(model.forward, backend="aot_eager"), 1),
                               ("ours", dynamic_compile(model.forward, backend="aot_eager"), 2)):
        torch._dynamo.reset()
        counters.clear()
        out, sizes = _decode_all(model, rows, fn, min_rows)
        graphs[name] = counters["stats"]["unique_graphs"]
        assert not counters["graph_break"], dict(counters)
        assert sum(sizes.values()) == sum(schedule.values()) and (1 in sizes) == (min_rows == 1), sizes
        for i in range(len(rows)):
            assert out[i].output_ids == eager[i].output_ids
            torch.testing.assert_close(torch.tensor(out[i].logprobs), torch.tensor(eager[i].logprobs),
                                       atol=1e-5, rtol=0)
    assert graphs == {"plain": 3, "duck sizing off": 2, "ours": 1}, graphs


# ------------------------------------------------------------------------------------------------ on a GPU
@pytest.mark.gpu
def test_decode_steps_on_cuda_issue_no_host_sync_but_the_read():
    """On CUDA: a decode forward, the batched sampling and rows leaving (moved rows, host index in one pinned
    copy) run under sync debug mode "error"; then the device's draws (the Triton kernel) equal the reference's."""
    model = build_tiny_model(3, arch="qwen2").cuda()
    g = torch.Generator().manual_seed(1)
    rows = [_random_row(g, 1000, prompt=tuple(torch.randint(6, 200, (int(n),), generator=g).tolist()),
                        max_new_tokens=20) for n in torch.randint(1, 12, (8,), generator=g)]
    batch = DecodeBatch(model, pad_id=0)
    batch.step([(r, i) for i, r in enumerate(rows)])
    with torch.inference_mode():
        torch.cuda.set_sync_debug_mode("error")
        try:
            logits = batch._decode()
            tok, lp = sample_with_logprobs(logits, batch.params, [a.row for a in batch.rows], batch.pos)
            batch.last = tok
            batch._keep([0, 2, 3, 5])
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert len(batch) == 4 and batch.cache.rows == 4
    # the kernel on the device draws what the float64 reference draws from the same probabilities
    V = 151936
    logits = torch.randn(16, V, device="cuda") * 4
    rows = [_random_row(g, V) for _ in range(16)]
    positions = torch.randint(0, 2**40, (16,), generator=g).tolist()
    params = SamplingTensors(*(t.cuda() for t in _params(rows).tensors()))
    tok, _ = sample_with_logprobs(logits, params, rows, torch.tensor(positions, device="cuda"))
    for i, row in enumerate(rows):
        assert int(tok[i]) == _reference_sample(logits[i], row, positions[i])[0]


@pytest.mark.gpu
def test_the_compiled_decode_on_cuda_is_one_graph():
    """On CUDA, inductor (the server's decode there): kernels.device.dynamic_compile fed >= 2 rows gives eager's
    greedy tokens and log-probs over ~30 steps at 1 to 5 rows, in one graph (a plain dynamic compile of the same
    forward traces three on the CPU). fp32, so the tokens are comparable; the engine's attention as served."""
    from torch._dynamo.utils import counters

    from engines.embedded.attention import use_engine_attention
    from kernels.device import dynamic_compile

    model = build_tiny_model(6, arch="llama").cuda()
    use_engine_attention(model)
    rows = _compiled_decode_rows(torch.Generator().manual_seed(12), temperature=0.0, top_k=-1, top_p=1.0)
    eager, _ = _decode_all(model, rows, None)
    torch._dynamo.reset()
    counters.clear()
    compiled, sizes = _decode_all(model, rows, dynamic_compile(model.forward), min_rows=2)
    assert 1 not in sizes and max(sizes) >= 4, sizes
    for i in range(len(rows)):
        assert compiled[i].output_ids == eager[i].output_ids
        torch.testing.assert_close(torch.tensor(compiled[i].logprobs), torch.tensor(eager[i].logprobs), atol=1e-4,
                                   rtol=0)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters)


def test_padding_chunks_bound_the_padding_and_cover_every_row():
    """Each chunk padded to its longest computes at most twice its real tokens; the chunks partition the rows.
    An agent step's next turns (69 rows feeding ~25 tokens, 8 feeding 102-180) make two forwards, not one padded
    to 180 (3,165 tokens computed instead of 13,860)."""
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        lengths = torch.randint(1, 300, (int(torch.randint(1, 60, (1,), generator=g)),), generator=g).tolist()
        chunks = generation.padding_chunks(lengths)
        assert sorted(i for c in chunks for i in c) == list(range(len(lengths)))
        for c in chunks:
            assert len(c) * max(lengths[i] for i in c) <= 2.0 * sum(lengths[i] for i in c)
    agent = [25] * 69 + [102] + [124] * 5 + [180] * 2
    chunks = generation.padding_chunks(agent)
    assert [sorted(agent[i] for i in c) for c in chunks] == [[25] * 69, [102] + [124] * 5 + [180] * 2]
    assert sum(len(c) * max(agent[i] for i in c) for c in chunks) == 69 * 25 + 8 * 180
    assert generation.padding_chunks([7] * 10) == [list(range(10))]  # alike lengths: one forward


def test_rows_of_very_different_lengths_join_in_separate_forwards_with_their_solo_results():
    """Prompts of 3-7 and 40-50 tokens joining in one step are prefilled in two forwards (no short row padded to
    50), and every row's tokens and log-probs are what it gives alone."""
    model = build_tiny_model(3)
    g = torch.Generator().manual_seed(0)
    rows = []
    for i, n in enumerate([3, 40, 5, 44, 6, 7, 50]):
        prompt = tuple(torch.randint(4, 200, (n,), generator=g).tolist())
        rows.append(Row(prompt, 0.9, 1.0, -1, 6, frozenset(), 100 + i, f"r{i}"))
    solo = [generate_rows(model, [r], pad_id=0)[0] for r in rows]
    widths = []
    hook = model.register_forward_pre_hook(lambda m, a, k: widths.append(tuple(k["input_ids"].shape)), with_kwargs=True)
    try:
        batch, got = DecodeBatch(model, pad_id=0), {}
        got.update(batch.step([(r, i) for i, r in enumerate(rows)]))
        joined = list(widths)
        while len(batch):
            got.update(batch.step())
    finally:
        hook.remove()
    assert joined == [(4, 7), (3, 50)]  # two prefills: the short prompts padded to 7, the long ones to 50
    for i, ref in enumerate(solo):
        assert got[i].output_ids == ref.output_ids
        assert torch.allclose(torch.tensor(got[i].logprobs), torch.tensor(ref.logprobs), atol=1e-5, rtol=0)
