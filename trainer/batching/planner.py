"""Packing planner: sequences -> per-rank, per-micro-batch lists of sequence indices under a token budget.

    plan = plan_micro_batches(lengths, token_budget=8192, num_ranks=2)
    plan[r][m] -> sorted indices of the sequences packed into rank r's micro-batch m

Guarantees (tests/test_planner.py checks each):
  * every sequence appears exactly once; every micro-batch holds <= token_budget tokens;
  * every rank gets the same number M of micro-batches (FSDP ranks step together);
  * balance: max - min token total over all micro-batches <= max(lengths), and the same bound over ranks;
  * deterministic: the same lengths give the same plan (ties broken by index, no hashing, no randomness).

Algorithm (LPT, longest processing time first, with a capacity check):
  1. M starts at the lower bound max(ceil(T / (B * R)), ceil(#{l > B/2} / R)): T tokens need T/B rows, and two
     sequences longer than half the budget can never share a row.
  2. Sort sequences by length, longest first, and put each into the currently lightest of the K = M * R rows
     (a heap). If it does not fit the lightest row it fits no row: try M + 1, then bisect up to a proven bound
     (M * R >= max(2T / B, #long) always succeeds, see plan_micro_batches), so at most O(log n) LPT passes.
     LPT bound: when a row receives its last sequence it is the lightest, so at the end every row exceeds the
     lightest by at most that sequence's length: max - min <= max(lengths).
  3. Deal rows to ranks in rounds of R, heaviest rows first; in each round the heaviest row goes to the lightest
     rank. With ranks sorted up r_1 <= ... <= r_R and rows sorted down b_1 >= ... >= b_R, the new spread
     max(r_i + b_i) - min(r_j + b_j) is <= max(old rank spread, b_1 - b_R), so the rank spread stays within the row
     spread, hence within max(lengths).

Compile-stable shapes: `bucket_length(n, token_budget)` rounds a row up to a multiple of `pad_multiple` (256 by
default, never past the budget), so torch.compile sees at most ceil(budget / 256) row shapes; `padding_efficiency`
is real tokens over processed (bucketed) tokens.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

Plan = list[list[list[int]]]  # [rank][micro_batch] -> sequence indices


def _check(lengths: Sequence[int], token_budget: int, num_ranks: int) -> list[int]:
    if not isinstance(token_budget, int) or token_budget <= 0:
        raise ValueError(f"token_budget={token_budget!r}: must be a positive int (tokens per packed micro-batch)")
    if not isinstance(num_ranks, int) or num_ranks <= 0:
        raise ValueError(f"num_ranks={num_ranks!r}: must be a positive int (data-parallel world size)")
    lens = [int(n) for n in lengths]
    for i, (n, raw) in enumerate(zip(lens, lengths)):
        if n != raw:
            raise ValueError(f"lengths[{i}] = {raw!r}: sequence lengths must be integers (token counts)")
        if n <= 0:
            raise ValueError(f"lengths[{i}] = {n}: every sequence length must be > 0 (drop empty samples first)")
        if n > token_budget:
            raise ValueError(f"lengths[{i}] = {n} exceeds token_budget={token_budget}; raise the budget to at least "
                             f"{n} or truncate that sequence")
    return lens


def _lpt(order: list[int], lens: list[int], num_rows: int, token_budget: int) -> list[list[int]] | None:
    """Longest-first into the lightest row; None if some sequence fits no row."""
    heap = [(0, r) for r in range(num_rows)]  # (tokens, row id): ties go to the lowest row id (determinism)
    rows: list[list[int]] = [[] for _ in range(num_rows)]
    for i in order:
        load, r = heap[0]
        if load + lens[i] > token_budget:
            return None  # the lightest row is full for this length, so every row is
        rows[r].append(i)
        heapq.heapreplace(heap, (load + lens[i], r))
    return rows


def plan_micro_batches(lengths: Sequence[int], *, token_budget: int, num_ranks: int = 1) -> Plan:
    """Balanced packing plan: plan[rank][micro_batch] = sorted sequence indices (see the module docstring).

    Empty input gives one empty micro-batch per rank. A micro-batch is empty only when there are fewer sequences
    than rows (fewer sequences than ranks); the trainer must still step it (a zero-token forward) to stay in lockstep.
    """
    lens = _check(lengths, token_budget, num_ranks)
    if not lens:
        return [[[]] for _ in range(num_ranks)]
    total = sum(lens)
    long_ones = sum(1 for n in lens if 2 * n > token_budget)
    order = sorted(range(len(lens)), key=lambda i: (-lens[i], i))
    m_lo = max(1, math.ceil(total / (token_budget * num_ranks)), math.ceil(long_ones / num_ranks))
    # LPT cannot fail once K = M * R >= max(2T / B, #long): failing on x <= B/2 needs every row above B - x >= B/2
    # (so T > K * B / 2), and failing on x > B/2 needs K rows already holding a sequence >= x > B/2 (so
    # #long > K). That M is the search's upper end.
    m_hi = max(m_lo, math.ceil(2 * total / (token_budget * num_ranks)), math.ceil(long_ones / num_ranks))
    rows = _lpt(order, lens, m_lo * num_ranks, token_budget)
    m = m_lo
    if rows is None:
        # Usually one more micro-batch is enough; otherwise bisect (m_lo, m_hi] for the smallest M that LPT fills.
        rows_hi = _lpt(order, lens, (m_lo + 1) * num_ranks, token_budget)
        m_fail, m = m_lo, m_lo + 1
        if rows_hi is None:
            m_fail, m = m_lo + 1, max(m_hi, m_lo + 2)
            rows_hi = _lpt(order, lens, m * num_ranks, token_budget)
            while m - m_fail > 1:
                mid = (m_fail + m) // 2
                trial = _lpt(order, lens, mid * num_ranks, token_budget)
                if trial is None:
                    m_fail = mid
                else:
                    m, rows_hi = mid, trial
        rows = rows_hi
    assert rows is not None, "LPT failed above its proven bound; please report the lengths"

    # Deal rows to ranks: heaviest rows first, in rounds of num_ranks, heaviest of the round to the lightest rank.
    loads = [sum(lens[i] for i in row) for row in rows]
    by_load = sorted(range(len(rows)), key=lambda r: (-loads[r], r))
    rank_tokens = [0] * num_ranks
    plan: Plan = [[] for _ in range(num_ranks)]
    for k in range(0, len(by_load), num_ranks):
        round_rows = by_load[k : k + num_ranks]
        ranks = sorted(range(num_ranks), key=lambda q: (rank_tokens[q], q))
        for q, r in zip(ranks, round_rows):
            plan[q].append(sorted(rows[r]))
            rank_tokens[q] += loads[r]
    return plan


def bucket_length(num_tokens: int, *, token_budget: int, pad_multiple: int = 256) -> int:
    """Row length to pad a packed micro-batch of `num_tokens` to: the next multiple of `pad_multiple`, capped at
    the budget (which is itself a bucket). At most ceil(token_budget / pad_multiple) distinct shapes."""
    if pad_multiple <= 0:
        raise ValueError(f"pad_multiple={pad_multiple}: must be > 0")
    if num_tokens > token_budget:
        raise ValueError(f"num_tokens={num_tokens} > token_budget={token_budget}; the plan broke the budget")
    if num_tokens <= 0:
        return pad_multiple if pad_multiple <= token_budget else token_budget  # an empty step still has a shape
    return min(-(-num_tokens // pad_multiple) * pad_multiple, token_budget)


@dataclass(frozen=True)
class PlanStats:
    real_tokens: int
    processed_tokens: int  # sum over micro-batches of the bucketed row length
    padding_efficiency: float  # real / processed
    micro_batches_per_rank: int
    rank_tokens: tuple[int, ...]  # real tokens per rank
    max_micro_batch_tokens: int
    min_micro_batch_tokens: int


def plan_stats(lengths: Sequence[int], plan: Plan, *, token_budget: int, pad_multiple: int = 256) -> PlanStats:
    """Token accounting of a plan, with rows padded to their buckets."""
    lens = [int(n) for n in lengths]
    mb_tokens = [sum(lens[i] for i in mb) for rank in plan for mb in rank]
    processed = sum(bucket_length(t, token_budget=token_budget, pad_multiple=pad_multiple) for t in mb_tokens)
    real = sum(mb_tokens)
    return PlanStats(
        real_tokens=real,
        processed_tokens=processed,
        padding_efficiency=real / processed if processed else 1.0,
        micro_batches_per_rank=len(plan[0]) if plan else 0,
        rank_tokens=tuple(sum(lens[i] for mb in rank for i in mb) for rank in plan),
        max_micro_batch_tokens=max(mb_tokens, default=0),
        min_micro_batch_tokens=min(mb_tokens, default=0),
    )


def padding_efficiency(lengths: Sequence[int], plan: Plan, *, token_budget: int, pad_multiple: int = 256) -> float:
    """Real tokens / processed tokens when every micro-batch row is padded to its bucket (1.0 = no padding)."""
    return plan_stats(lengths, plan, token_budget=token_budget, pad_multiple=pad_multiple).padding_efficiency
