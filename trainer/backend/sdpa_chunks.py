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

The host ints make the number of SDPA calls data-dependent, which a compiled block would specialise on (a recompile
per new chunk list): trainer.backend.attention uses this layout in eager blocks only and keeps the one-batch layout
where the blocks are compiled.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kernels.packing import padding_chunks

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
    return torch.from_numpy(gather).to(device), torch.from_numpy(scatter).to(device), tuple(chunks)


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


def branch_chunked_indices(paths: Sequence[Sequence[tuple[int, int]]], padded_len: int,
                           device: torch.device | str = "cpu", waste: float = WASTE
                           ) -> tuple[torch.Tensor, torch.Tensor, tuple[tuple[int, int], ...]]:
    """The shared-prompt row's per-branch layout (branch_segments: each branch its own sequence, a shared token's
    output read from the first branch through it) in the chunked layout. paths: PromptTrees.paths."""
    return chunked_layout(*branch_segments(paths, padded_len), padded_len, device, waste)


def chunked_cost(lengths: Sequence[int], waste: float = WASTE) -> float:
    """Score elements SDPA computes for sequences of `lengths` in the chunked layout: sum_c S_c * L_c^2, halved for
    chunks of 512 tokens or more (from there the CPU flash kernel's causal path skips the blocks above the
    diagonal; attention.tree_block_layout's rule)."""
    cost = 0.0
    for group in padding_chunks([n * n for n in lengths], waste):
        width = max(lengths[i] for i in group)
        cost += len(group) * width * width / (2 if width >= 512 else 1)
    return cost
