"""Shared-prompt micro-batches: a GRPO group's prompt is run through the model once, not once per sample.

With n samples per prompt, the plain layout (trainer.batching.micro_batches) packs `prompt + response` n times, and
on short-answer work the prompt is most of the tokens (the demo: ~25 prompt tokens, ~3 response tokens, n = 8, so
~85 % of every forward and backward recomputes the same prompt). Here the samples of one prompt form a tree in
the packed row:

    row:        [ p0 p1 ... pP-1 | a0 a1 a2 | b0 b1 | c0 ... ]       one prompt, then each response (a branch)
    positions:    0  1  ... P-1  | P  P+1 P+2 | P  P+1 | P  ...       the unshared sequence's positions

A branch token attends the prompt and its own branch causally (trainer.backend.attention), so every hidden state is
the one of the sample's own sequence and the loss is the plain layout's loss: the same per-token values, the same
per-sequence aggregation over the same samples. Only the loss rows change: the hidden state of the prompt's last
token predicts the first response token of every branch, so the loss gathers M rows (`PromptTrees.hidden_index`,
one per response token, sample by sample) from the N row tokens, and every per-token target (labels, mask,
advantages, log-probs, the per-sample `segments`) is laid out over those M rows. Gradients of the shared prompt are
the sum over its branches, as in the plain layout, where each copy of the prompt gets its own share.

Samples share a tree only when their prompt tokens are identical (not merely the same group id); a tree larger
than the token budget is split into several trees, each with its own copy of the prompt.

Beyond the prompt the tree is a prefix tree (a trie) of the samples: the samples of a group often write alike
tokens (a tool call's boilerplate, a format's opening) and part later, some of them sharing more than others (two
that call the tool alike get the same tool output and go on alike). Every run of tokens some samples have alike at
the same positions is one node, run once (`trie_nodes`); a response token inside a shared node is still trained
once per sample (its loss row reads the shared hidden state, with the sample's own label, mask and advantage), so
the loss is unchanged. The agent recipe's step: 18.3k row tokens plain, 9.5k sharing the group's common prefix,
6.4k as a trie.

    row:        [ p0 p1 p2 x0 x1 | y0 y1 | z0 | w0 w1 ]   prompt + common start, then two children: y (whose
    positions:     0  1  2  3  4 |  5  6 |  7 |  5  6     subtree holds z and a sample that ends at y1), and w
    end:          10 10 10 10 10 |  8  8 |  8 | 10 10     query i attends key j iff j <= i < end[j]
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
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


def trie_nodes(seqs: Sequence[Sequence[int]]) -> Iterator[tuple[list[int], int, int, int]]:
    """The prefix trie of `seqs` in depth-first preorder: (members, start, stop, level) per node, where members are
    the indices of the sequences through it, [start, stop) the positions of its tokens (the same in every member)
    and level its depth in the trie (the root 0). A node ends where its members' tokens differ (its children, in
    the order their first member comes) or where one of them ends (which then has no own tokens past it). Only
    the root may be empty (no sequence, or sequences that differ at their first token)."""
    if not seqs:
        return
    stack = [(list(range(len(seqs))), 0, 0)]
    while stack:
        members, depth, level = stack.pop()
        group = [seqs[m] for m in members]
        # The lexicographically least and greatest member share exactly the members' common prefix.
        lo, hi = min(group), max(group)
        n, limit = depth, min(len(lo), len(hi))
        while n < limit and lo[n] == hi[n]:
            n += 1
        yield members, depth, n, level
        children: dict[int, list[int]] = {}
        for m in members:
            if len(seqs[m]) > n:
                children.setdefault(seqs[m][n], []).append(m)
        stack.extend((sub, n, level + 1) for sub in reversed(list(children.values())))


def _trie_tokens(nodes: Sequence[tuple[list[int], int, int, int]]) -> int:
    """Row tokens of a trie (trie_nodes' nodes): each node's tokens once."""
    return sum(stop - start for _, start, stop, _ in nodes)


def tree_cost(samples: Sequence[Sample], tree: Sequence[int]) -> int:
    """Row tokens of one tree: each node of its samples' trie once."""
    return _trie_tokens(list(trie_nodes([samples[i].tokens for i in tree])))


class _TreeRow(NamedTuple):
    """One row's host lists before padding: N row tokens, M loss rows (one per trained response position)."""

    ids: list[int]  # [N] each trie node once, depth first
    pos: list[int]  # [N] positions of the sample's own sequence
    seq: list[int]  # [N] tree index
    end: list[int]  # [N] row end of each token's node's subtree
    cu_trees: list[int]  # [trees + 1] row offsets of the trees
    paths: list[tuple[tuple[int, int], ...]]  # per branch: its sequence's row ranges
    order: list[int]  # sample index of each branch, in row order (= the loss rows' sequence order)
    rows: list[int]  # [M] hidden_index: the row token whose hidden state predicts the label
    labels: list[int]  # [M]
    mask: list[float]  # [M]
    cu_rows: list[int]  # [branches + 1] loss-row offsets of the branches


def _walk_trees(samples: Sequence[Sample], trees: Sequence[Sequence[int]], tries: Sequence[list]) -> _TreeRow:
    """Lay out each tree's trie once, node by node, and the loss rows that read each sample's path through it.
    tries: each tree's trie_nodes."""
    r = _TreeRow([], [], [], [], [0], [], [], [], [], [], [0])
    for t, tree in enumerate(trees):
        p = samples[tree[0]].prompt_length
        seqs = [samples[i].tokens for i in tree]
        prompt = seqs[0][:p]
        assert all(s[:p] == prompt and samples[i].prompt_length == p for i, s in zip(tree, seqs)), \
            "a tree's samples must share their prompt tokens"
        nodes = tries[t]
        paths: list[list[tuple[int, int]]] = [[] for _ in tree]
        starts = []
        for members, start, stop, _ in nodes:
            row = len(r.ids)
            starts.append(row)
            r.ids.extend(seqs[members[0]][start:stop])
            r.pos.extend(range(start, stop))
            r.seq.extend([t] * (stop - start))
            if stop > start:
                for m in members:
                    paths[m].append((row, row + stop - start))
        # A node's subtree ends where the next node of its level or above starts (depth-first order): one pass
        # from the back with a stack of the later nodes that can still be that next one.
        after, later = [len(r.ids)] * len(nodes), []
        for k in reversed(range(len(nodes))):
            level = nodes[k][3]
            while later and later[-1][0] > level:
                later.pop()
            if later:
                after[k] = later[-1][1]
            later.append((level, starts[k]))
        for (_, start, stop, _), e in zip(nodes, after):
            r.end.extend([e] * (stop - start))
        for i, path in zip(tree, paths):
            s = samples[i]
            # Response token k (position p + k) is predicted by the token before it, wherever on the sample's path
            # that lies; with an empty prompt token 0 has no predictor and is never trained (as in the plain layout).
            lo, hi = max(p - 1, 0), len(s.tokens) - 1  # the predicting positions [lo, hi)
            o = 0  # the sequence position of each range's first token
            for a, b in path:
                first, last = max(lo, o), min(hi, o + b - a)
                if first < last:
                    r.rows.extend(range(a + first - o, a + last - o))
                o += b - a
            r.labels.extend(s.tokens[lo + 1:])
            r.mask.extend(map(float, s.effective_loss_mask[0 if p else 1:]))
            r.cu_rows.append(len(r.rows))
            r.order.append(i)
            r.paths.append(tuple(path))
        r.cu_trees.append(len(r.ids))
    return r


def pack_tree_micro_batch(samples: Sequence[Sample], trees: Sequence[Sequence[int]], *, advantages: Sequence[float],
                          tries: Sequence[list], bucket_size: int, pad_id: int, num_tokens: int,
                          num_seqs: int) -> MicroBatch:
    """Pack `trees` (lists of sample indices sharing one prompt; `tries`: each one's trie_nodes) into one row; host
    tensors.

    Row tokens (N, bucketed) and loss rows (M, bucketed) are padded separately: the row's tail is one more causal
    block (seq_index -1), the loss rows' tail reads hidden state 0 with label IGNORE_INDEX and mask 0, as one more
    segment.
    """
    walked = _walk_trees(samples, trees, tries)
    ids, pos, seq, end = walked.ids, walked.pos, walked.seq, walked.end
    cu_trees, order, rows = walked.cu_trees, walked.order, walked.rows
    labels, mask, cu_rows = walked.labels, walked.mask, walked.cu_rows
    total, m_real = len(ids), len(rows)
    n, m_len = bucketed_length(total, bucket_size), bucketed_length(m_real, bucket_size)
    tail = n - total
    ids += [pad_id] * tail
    pos += range(tail)
    seq += [-1] * tail
    end += [n] * tail  # the tail: one causal block
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
    layout = PromptTrees(end=torch.tensor(end, dtype=torch.int64),
                         hidden_index=torch.tensor(rows + [0] * pad_rows, dtype=torch.int64), paths=tuple(walked.paths))
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
    tries = [list(trie_nodes([samples[i].tokens for i in t])) for t in trees]  # built once: costed, then laid out
    plan = plan_micro_batches([_trie_tokens(nodes) for nodes in tries], token_budget=token_budget,
                              num_ranks=num_ranks)
    mine = rank_micro_batches(plan, rank)
    common = dict(advantages=adv, bucket_size=bucket_size, pad_id=pad_id, num_tokens=num_tokens,
                  num_seqs=len(samples))
    return [pack_tree_micro_batch(samples, [trees[t] for t in idx], tries=[tries[t] for t in idx], **common) if idx
            else pack_micro_batch(samples, [], **common) for idx in mine]
