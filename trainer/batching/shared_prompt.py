"""Shared-prompt micro-batches: a GRPO group's prompt is run through the model once, not once per sample.

With n samples per prompt, the plain layout (trainer.batching.micro_batches) packs `prompt + response` n times, and
on short-answer work the prompt is most of the tokens (the demo: ~25 prompt tokens, ~3 response tokens, n = 8, so
~85 % of every forward and backward recomputes the same prompt). Here the samples of one prompt form a tree in
the packed row:

    row:        [ p0 p1 ... pP-1 | a0 a1 a2 | b0 b1 | c0 ... ]       one prompt, then each response (a branch)
    positions:    0  1  ... P-1  | P  P+1 P+2 | P  P+1 | P  ...       the unshared sequence's positions
    branch:      -1 -1  ...  -1  | 0  0  0  | 1  1  | 2  ...         (row order; -1 on prompts and the padding tail)

A branch token attends the prompt and its own branch causally (trainer.backend.attention), so every hidden state is
the one of the sample's own sequence and the loss is the plain layout's loss: the same per-token values, the same
per-sequence aggregation over the same samples. Only the loss rows change: the hidden state of the prompt's last
token predicts the first response token of every branch, so the loss gathers M rows (`PromptTrees.hidden_index`,
one per response token, sample by sample) from the N row tokens, and every per-token target (labels, mask,
advantages, log-probs, the per-sample `segments`) is laid out over those M rows. Gradients of the shared prompt are
the sum over its branches, as in the plain layout, where each copy of the prompt gets its own share.

Samples share a tree only when their prompt tokens are identical (not merely the same group id); a tree larger
than the token budget is split into several trees, each with its own copy of the prompt.

The shared part is the tree's longest common prefix, not only the prompt: the samples of a group often begin
their responses alike (a tool call's boilerplate, a format's opening), and those tokens, the same in every sample
of the tree, are run once too (`shared_length`). A response token inside the shared part is still trained once per
sample (its loss row reads the shared hidden state, with the sample's own label, mask and advantage), so the loss
is unchanged; each branch keeps at least its last token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from kernels.packing import PackedBatch
from trainer.batching.micro_batches import (
    IGNORE_INDEX,
    MicroBatch,
    PromptTrees,
    bucketed_length,
    check_batch_inputs,
    pack_micro_batch,
    rank_micro_batches,
)
from trainer.batching.planner import plan_micro_batches
from trainer.types import Sample


def prompt_trees(samples: Sequence[Sample], token_budget: int) -> list[list[int]]:
    """Sample indices grouped by identical prompt tokens (first-appearance order), each tree <= token_budget tokens.

    A tree costs P + sum of its response lengths. Samples with an empty prompt share nothing: one tree each.
    """
    by_prompt: dict[tuple, list[int]] = {}
    for i, s in enumerate(samples):
        key = s.tokens[:s.prompt_length] if s.prompt_length else ("no prompt", i)
        by_prompt.setdefault(key, []).append(i)
    trees: list[list[int]] = []
    for members in by_prompt.values():
        p = samples[members[0]].prompt_length
        cur, size = [], p
        for i in members:
            r = samples[i].response_length
            if cur and size + r > token_budget:  # a single sample always fits (check_batch_inputs)
                trees.append(cur)
                cur, size = [], p
            cur.append(i)
            size += r
        trees.append(cur)
    return trees


def shared_length(samples: Sequence[Sample], tree: Sequence[int]) -> int:
    """Tokens the tree's samples run once: their longest common prefix (the prompt, and the start of the responses
    where every sample has the same tokens), leaving each sample at least one token of its own (none past the
    prompt where a response is empty)."""
    seqs = [samples[i].tokens for i in tree]
    limit = min(len(t) for t in seqs) - 1
    n = samples[tree[0]].prompt_length  # never less: the loop only moves it forward
    first = seqs[0]
    while n < limit and all(t[n] == first[n] for t in seqs):
        n += 1
    return n


def tree_cost(samples: Sequence[Sample], tree: Sequence[int]) -> int:
    """Row tokens of one tree: its shared prefix once plus the rest of every sample."""
    shared = shared_length(samples, tree)
    return shared + sum(len(samples[i].tokens) - shared for i in tree)


class _TreeRow(NamedTuple):
    """One row's host lists before padding: N row tokens, M loss rows (one per trained response position)."""

    ids: list[int]  # [N] shared prefix once, then each branch
    pos: list[int]  # [N] positions of the sample's own sequence
    seq: list[int]  # [N] tree index
    branch: list[int]  # [N] branch index in row order, -1 on shared prefixes
    cu_trees: list[int]  # [trees + 1] row offsets of the trees
    shapes: list[tuple[int, tuple[int, ...]]]  # (shared length, branch lengths) per tree
    order: list[int]  # sample index of each branch, in row order (= the loss rows' sequence order)
    rows: list[int]  # [M] hidden_index: the row token whose hidden state predicts the label
    labels: list[int]  # [M]
    mask: list[float]  # [M]
    cu_rows: list[int]  # [branches + 1] loss-row offsets of the branches


def _walk_trees(samples: Sequence[Sample], trees: Sequence[Sequence[int]]) -> _TreeRow:
    """Lay out each tree's shared prefix once, then the rest of each sample, and the loss rows that read them."""
    r = _TreeRow([], [], [], [], [0], [], [], [], [], [], [0])
    for t, tree in enumerate(trees):
        p = samples[tree[0]].prompt_length
        shared = shared_length(samples, tree)
        prefix = samples[tree[0]].tokens[:shared]
        assert all(samples[i].tokens[:shared] == prefix and samples[i].prompt_length == p for i in tree), \
            "a tree's samples must share their prompt tokens"
        start = len(r.ids)
        r.ids.extend(prefix)
        r.pos.extend(range(shared))
        r.seq.extend([t] * shared)
        r.branch.extend([-1] * shared)
        lens = []
        for i in tree:
            s = samples[i]
            own = s.tokens[shared:]
            b0 = len(r.ids)
            r.ids.extend(own)
            r.pos.extend(range(shared, shared + len(own)))
            r.seq.extend([t] * len(own))
            r.branch.extend([len(r.order)] * len(own))
            lens.append(len(own))
            m = s.effective_loss_mask
            # Response token k (position p + k) is predicted by the token before it: in the shared prefix or in
            # the sample's own part; with an empty prompt token 0 has no predictor and is never trained (as in the
            # plain layout).
            for k in range(0 if p else 1, s.response_length):
                before = p + k - 1
                r.rows.append(start + before if before < shared else b0 + before - shared)
                r.labels.append(s.tokens[p + k])
                r.mask.append(float(m[k]))
            r.cu_rows.append(len(r.rows))
            r.order.append(i)
        r.shapes.append((shared, tuple(lens)))
        r.cu_trees.append(len(r.ids))
    return r


def pack_tree_micro_batch(samples: Sequence[Sample], trees: Sequence[Sequence[int]], *, advantages: Sequence[float],
                          bucket_size: int, pad_id: int, num_tokens: int, num_seqs: int) -> MicroBatch:
    """Pack `trees` (lists of sample indices sharing one prompt) into one row; host tensors.

    Row tokens (N, bucketed) and loss rows (M, bucketed) are padded separately: the row's tail is one more causal
    block (seq_index -1), the loss rows' tail reads hidden state 0 with label IGNORE_INDEX and mask 0, as one more
    segment.
    """
    walked = _walk_trees(samples, trees)
    ids, pos, seq, branch = walked.ids, walked.pos, walked.seq, walked.branch
    cu_trees, shapes, order, rows = walked.cu_trees, walked.shapes, walked.order, walked.rows
    labels, mask, cu_rows = walked.labels, walked.mask, walked.cu_rows
    total, m_real = len(ids), len(rows)
    n, m_len = bucketed_length(total, bucket_size), bucketed_length(m_real, bucket_size)
    tail = n - total
    ids += [pad_id] * tail
    pos += range(tail)
    seq += [-1] * tail
    branch += [-1] * tail
    pad_rows = m_len - m_real

    def per_row(values) -> torch.Tensor:
        """values[i]: sample i's per-response-token values (a dict over this row's samples) -> [M] on the loss
        rows (0 on the tail)."""
        flat = []
        for i in order:
            v = values[i]
            flat += v[0 if samples[i].prompt_length else 1:]
        return torch.tensor(flat + [0.0] * pad_rows, dtype=torch.float32)

    is_real = torch.zeros(n, dtype=torch.float32)
    is_real[:total] = 1.0
    row = PackedBatch(input_ids=torch.tensor(ids, dtype=torch.int64), position_ids=torch.tensor(pos, dtype=torch.int64),
                      seq_index=torch.tensor(seq, dtype=torch.int64),
                      cu_seqlens=torch.tensor(cu_trees, dtype=torch.int32), loss_mask=is_real,
                      lengths=tuple(b - a for a, b in zip(cu_trees, cu_trees[1:])))
    layout = PromptTrees(branch=torch.tensor(branch, dtype=torch.int64),
                         hidden_index=torch.tensor(rows + [0] * pad_rows, dtype=torch.int64), trees=tuple(shapes))
    adv = torch.tensor([float(advantages[i]) for i in order], dtype=torch.float32)
    counts = torch.tensor([b - a for a, b in zip(cu_rows, cu_rows[1:])], dtype=torch.int64)
    has_rollout = any(samples[i].rollout_logprobs is not None for i in order)
    return MicroBatch(
        row=row, labels=torch.tensor(labels + [IGNORE_INDEX] * pad_rows, dtype=torch.int64),
        loss_mask=torch.tensor(mask + [0.0] * pad_rows, dtype=torch.float32),
        advantages=torch.cat([torch.repeat_interleave(adv, counts), torch.zeros(pad_rows)]),
        num_tokens=num_tokens, num_seqs=num_seqs,
        segments=torch.tensor(cu_rows + ([m_len] if pad_rows else []), dtype=torch.int32),
        local_tokens=int(sum(mask)), sample_index=tuple(order),
        rollout_logprobs=per_row({i: samples[i].rollout_logprobs or (0.0,) * samples[i].response_length
                                  for i in order}) if has_rollout else None,
        trees=layout)


def build_shared_micro_batches(samples: Sequence[Sample], *, token_budget: int, bucket_size: int,
                               advantages: Sequence[float] | None = None, pad_id: int = 0, num_ranks: int = 1,
                               rank: int = 0) -> list[MicroBatch]:
    """trainer.batching.micro_batches.build_micro_batches with the shared-prompt layout: same arguments, same loss.

    The planner balances trees (their row tokens) instead of samples; a rank with fewer micro-batches gets
    all-padding rows (the plain layout's), so every rank runs the same number of forwards.
    """
    adv, num_tokens = check_batch_inputs(samples, token_budget=token_budget, bucket_size=bucket_size,
                                         advantages=advantages, num_ranks=num_ranks, rank=rank)
    trees = prompt_trees(samples, token_budget)
    plan = plan_micro_batches([tree_cost(samples, t) for t in trees], token_budget=token_budget, num_ranks=num_ranks)
    mine = rank_micro_batches(plan, rank)
    common = dict(advantages=adv, bucket_size=bucket_size, pad_id=pad_id, num_tokens=num_tokens,
                  num_seqs=len(samples))
    return [pack_tree_micro_batch(samples, [trees[t] for t in idx], **common) if idx
            else pack_micro_batch(samples, [], **common) for idx in mine]
