"""Length-chunked layouts for packed_sdpa (trainer.backend.attention): a packed row's sequences gathered into a few
padded batches of alike lengths instead of one padded to the longest sequence.

Why: the CPU's SDPA computes every score of a padded [S, H, Lmax, Lmax] batch (below 512 tokens its causal path
skips no key block), so one long sequence makes every short one pay Lmax^2. An agent step's episodes are 30-350
tokens long (one, two or three assistant turns): in one padded batch attention was 42 % of the RL train step
(0.54 of 1.28 s, torch.profiler on the recipe's step), most of it on padding.

The layout: sequences sorted by length and grouped by kernels.packing.padding_chunks on their squared lengths (each
group, padded to its longest, computes at most `waste` times its real score elements). Chunk c is a padded batch
[S_c, L_c]; the chunks are laid end to end in one flat index, so the row is gathered once per tensor and scattered
back once (one index op each way, as in the one-batch layout):

    gather   [sum_c S_c * L_c] int64   row position of each slot, chunk after chunk, each sequence's slots past its
                                       end repeating its last token (causal-masked for its real queries; their own
                                       outputs are never read)
    scatter  [N] int64                 slot each row token's output is read from; the padding tail reads the zero
                                       row sum_c S_c * L_c appended after the chunks (never computed: loss mask 0)
    chunks   ((S_c, L_c), ...)         host ints: the shape of each chunk

A shared-prompt row's branches (branch_segments: each sample's own sequence, gathered from the prefix trie it
shares) go one step further: a shared token's output is read from one branch only, so each branch runs queries for
the tokens it owns and keys for all of its sequence (branch_owned_chunks: chunks (S_c, Q_c, K_c) under a mask).

The host ints make the number of SDPA calls data-dependent, which a compiled block would specialise on (a recompile
per new chunk list): trainer.backend.attention uses these layouts in eager blocks only and keeps the one-batch layout
where the blocks are compiled.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from kernels.packing import host_to_device, padding_chunks

# A chunk computes at most 1.25x its real score elements. One layer's attention forward + backward over an agent
# step's three micro-batches (bench/results/agent_step_time-cpu-2core.json): one batch 216 ms; waste 3.0 201, 2.0 171,
# 1.5 132, 1.25 116, 1.1 119 ms. Where lengths are alike (the demo's ~30-token branches) the chunks cost ~6 % more
# than one batch (more SDPA calls), and tree_block_layout picks the tree layout there anyway.
WASTE = 1.25


def chunked_layout(segments: Sequence[np.ndarray], seg_of: np.ndarray, slot_of: np.ndarray, padded_len: int,
                   device: torch.device | str = "cpu", waste: float = WASTE
                   ) -> tuple[torch.Tensor, torch.Tensor, tuple[tuple[int, int], ...]]:
    """(gather, scatter, chunks) of the module docstring.

    segments: each sequence's row positions in order (non-empty int arrays); seg_of / slot_of [T]: for each of the
    row's first T real tokens the sequence and the slot in it that its output is read from (T <= padded_len; the
    rest of the row is the padding tail)."""
    lens = [len(g) for g in segments]
    assert lens and min(lens) > 0, "every sequence needs at least one token"
    assert len(seg_of) == len(slot_of) <= padded_len, "one (sequence, slot) per real row token, at most padded_len"
    parts: list[np.ndarray] = []
    base = np.empty(len(segments), dtype=np.int64)  # flat slot of each sequence's first token
    chunks: list[tuple[int, int]] = []
    offset = 0
    for group in padding_chunks([n * n for n in lens], waste):
        width = max(lens[i] for i in group)
        for j, i in enumerate(group):
            parts.append(np.asarray(segments[i], dtype=np.int64))
            if lens[i] < width:
                parts.append(np.full(width - lens[i], segments[i][-1], dtype=np.int64))
            base[i] = offset + j * width
        chunks.append((len(group), width))
        offset += len(group) * width
    scatter = np.full(padded_len, offset, dtype=np.int64)  # the tail reads the zero row
    scatter[:len(seg_of)] = base[seg_of] + slot_of
    gather = np.concatenate(parts)
    # Through pinned memory: a copy from pageable memory to CUDA would wait for the device's queued work
    return (host_to_device(torch.from_numpy(gather), device), host_to_device(torch.from_numpy(scatter), device),
            tuple(chunks))


def plain_chunked_indices(lengths: Sequence[int], padded_len: int, device: torch.device | str = "cpu",
                          waste: float = WASTE) -> tuple[torch.Tensor, torch.Tensor, tuple[tuple[int, int], ...]]:
    """The plain packed row (sequences of `lengths` end to end, then the padding tail) in the chunked layout.
    Empty sequences have no token and no slot."""
    lens = np.asarray([n for n in lengths if n > 0], dtype=np.int64)
    starts = np.cumsum(lens) - lens
    total = int(lens.sum())
    if not len(lens) or total > padded_len:
        raise ValueError(f"lengths={tuple(lengths)}: need at least one non-empty sequence and sum(lengths) <= "
                         f"padded_len={padded_len}")
    seg_of = np.repeat(np.arange(len(lens)), lens)
    slot_of = np.arange(total) - starts[seg_of]
    segments = [np.arange(s, s + n) for s, n in zip(starts.tolist(), lens.tolist())]
    return chunked_layout(segments, seg_of, slot_of, padded_len, device, waste)


def branch_segments(paths: Sequence[Sequence[tuple[int, int]]], padded_len: int
                    ) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """A shared-prompt row's branches as sequences: (segments, seg_of [T], slot_of [T]) for chunked_layout and the
    per-branch layouts of trainer.backend.attention. paths: each branch's row ranges [start, stop) in order
    (PromptTrees.paths); segment s is branch s's own sequence (its ancestors' tokens, then its own). Each of the
    row's T real tokens (the first T, every one on some path) reads its output from the first branch through it:
    every branch through a token computes the same output for it (the same keys before it)."""
    segments = [np.concatenate([np.arange(a, b) for a, b in path]) if path else np.zeros(0, dtype=np.int64)
                for path in paths]
    if not segments or any(not len(g) for g in segments):
        raise ValueError(f"paths={paths}: need at least one branch and non-empty sequences; pass the row's own "
                         f"PromptTrees.paths")
    total = max(int(g.max()) for g in segments) + 1
    if total > padded_len:
        raise ValueError(f"paths={paths}: tokens up to row position {total - 1}, past padded_len={padded_len}; pass "
                         f"the row's own PromptTrees.paths")
    seg_of = np.full(total, -1, dtype=np.int64)
    slot_of = np.zeros(total, dtype=np.int64)
    for s in reversed(range(len(segments))):  # the first branch through a token is written last
        seg_of[segments[s]] = s
        slot_of[segments[s]] = np.arange(len(segments[s]))
    if (seg_of < 0).any():
        raise ValueError(f"paths={paths}: row positions {np.flatnonzero(seg_of < 0).tolist()} lie on no branch; "
                         f"pass the row's own PromptTrees.paths")
    return segments, seg_of, slot_of


def owned_queries(paths: Sequence[Sequence[tuple[int, int]]]) -> list[int]:
    """Each branch's owned tokens (branch_owned_chunks' Q_s): those of the ranges on its path that no earlier branch
    holds. Host arithmetic over the ranges, cheap enough to decide a layout before building one."""
    seen: set[int] = set()
    out = []
    for path in paths:
        q = 0
        for a, b in path:
            if a not in seen:  # a range is a trie node's: the same (start, stop) on every path through it
                seen.add(a)
                q += b - a
        out.append(q)
    return out


class OwnedChunks(NamedTuple):
    """branch_owned_chunks' layout: each branch's queries only for the tokens whose output it gives (see there)."""

    query_index: torch.Tensor  # [sum_c S_c * Q_c] int64: row position of each query slot, chunk after chunk
    key_index: torch.Tensor  # [sum_c S_c * K_c] int64: row position of each key/value slot
    scatter: torch.Tensor  # [N] int64: the query slot each row token's output is read from; the tail: the zero row
    chunks: tuple[tuple[int, int, int], ...]  # host: (S_c, Q_c, K_c) of each chunk
    masks: tuple[torch.Tensor | None, ...]  # per chunk: bool [S_c, 1, Q_c, K_c] (True = attend), None: causal
    cost: int  # score elements computed: sum_c S_c * Q_c * K_c


def branch_owned_chunks(paths: Sequence[Sequence[tuple[int, int]]], padded_len: int,
                        device: torch.device | str = "cpu", waste: float = 1.5) -> OwnedChunks:
    """The shared-prompt row's per-branch layout with each branch's queries cut to the tokens it owns.

    A branch's sequence (branch_segments) holds every token on its path, but a shared token's output is read from
    the first branch through it, so the others need its key and value only: branch s computes queries for its
    owned tokens, the last Q_s of its K_s (owned tokens are a suffix: a branch that owns a node owns every node
    after it on its path), against all K_s keys, query i attending keys j <= K_s - Q_s + i. The agent recipe's
    step: 1.0M score elements where the whole sequences compute 2.7M. A branch that owns nothing (a sample equal
    to an earlier one, or a prefix of it) computes nothing.

    Chunks: the branches sorted by (K, Q), a new chunk when padding every member to the chunk's (Q_c, K_c) would
    compute more than `waste` times their real Q x K score elements. A chunk whose members all own their whole
    sequence runs causal (mask None); the others get a mask (True = attend), also letting each padding query slot
    attend its branch's real keys (no empty softmax row; its output is never read)."""
    segments, seg_of, slot_of = branch_segments(paths, padded_len)
    owned = np.bincount(seg_of, minlength=len(segments))  # [S] Q_s
    first = np.full(len(segments), np.iinfo(np.int64).max)
    np.minimum.at(first, seg_of, slot_of)  # each branch's first owned slot
    k_len = np.asarray([len(g) for g in segments])
    live = np.flatnonzero(owned)
    assert (first[live] == k_len[live] - owned[live]).all(), "a branch's owned tokens are a suffix of its sequence"
    order = sorted(live.tolist(), key=lambda b: (k_len[b], owned[b]))
    groups: list[list[int]] = []
    real = q_max = 0  # the open chunk's real score elements and its widest query run (its keys: the last K)
    for b in order:
        wider = max(q_max, owned[b])
        if groups and (len(groups[-1]) + 1) * wider * k_len[b] <= waste * (real + owned[b] * k_len[b]):
            groups[-1].append(b)
            real, q_max = real + owned[b] * k_len[b], wider
        else:
            groups.append([b])
            real, q_max = owned[b] * k_len[b], owned[b]
    q_parts, k_parts, chunks, masks = [], [], [], []
    q_base = np.zeros(len(segments), dtype=np.int64)  # flat query slot of each branch's first owned token
    q_off = cost = 0
    for group in groups:
        qc, kc = int(max(owned[b] for b in group)), int(max(k_len[b] for b in group))
        causal = all(owned[b] == k_len[b] for b in group)
        mask = None if causal else np.zeros((len(group), 1, qc, kc), dtype=bool)
        for j, b in enumerate(group):
            g, q, k = segments[b], int(owned[b]), int(k_len[b])
            q_parts.append(np.concatenate([g[k - q:], np.full(qc - q, g[-1])]))
            k_parts.append(np.concatenate([g, np.full(kc - k, g[-1])]))
            q_base[b] = q_off + j * qc
            if mask is not None:  # query slot i is sequence position k - q + i (pads: the last), keys up to it
                last = np.minimum(np.arange(qc) + k - q, k - 1)
                mask[j, 0] = np.arange(kc)[None, :] <= last[:, None]
        q_off += len(group) * qc
        cost += len(group) * qc * kc
        chunks.append((len(group), qc, kc))
        masks.append(None if mask is None else host_to_device(torch.from_numpy(mask), device))
    scatter = np.full(padded_len, q_off, dtype=np.int64)  # the tail reads the zero row after the chunks
    scatter[:len(seg_of)] = q_base[seg_of] + slot_of - first[seg_of]
    return OwnedChunks(host_to_device(torch.from_numpy(np.concatenate(q_parts)), device),
                       host_to_device(torch.from_numpy(np.concatenate(k_parts)), device),
                       host_to_device(torch.from_numpy(scatter), device), tuple(chunks), tuple(masks), int(cost))


def chunked_cost(lengths: Sequence[int], waste: float = WASTE) -> float:
    """Score elements SDPA computes for sequences of `lengths` in the chunked layout: sum_c S_c * L_c^2, halved for
    chunks of 512 tokens or more (from there the CPU flash kernel's causal path skips the blocks above the
    diagonal; attention.tree_block_layout's rule)."""
    cost = 0.0
    for group in padding_chunks([n * n for n in lengths], waste):
        width = max(lengths[i] for i in group)
        cost += len(group) * width * width / (2 if width >= 512 else 1)
    return cost
