"""FlexAttention's tile tables for the shared-prompt (tree) layout (trainer.backend.attention.flex_tree_block_tiles):
a key/value tile is listed for a query tile only where tree_causal_mask allows some pair in them, full only where it
allows every pair, against a brute force over the dense mask; and the BlockMask built on them attends as the dense
mask does.

What the CPU can run: flex_attention's eager path evaluates mask_mod on every pair and ignores the tile tables, and
flex_attention has no backward on CPU (torch 2.13 refuses inputs that require grad). So the tables the GPU kernels
read are checked directly (kv tables: the forward and dq; q tables: dk and dv), and the compiled CPU kernel, which
does skip the unlisted tiles, runs the forward against SDPA in float64 (it takes float32 at most).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_shared_prompt_flash import row_labels  # a row's [N] tree ids and subtree ends, as packed

from trainer.backend.attention import (
    flex_block_tiles,
    flex_tree_block_mask,
    flex_tree_block_tiles,
    tree_causal_mask,
)


def trie_row(g: torch.Generator, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random row of deeper tries at the scale of the tile: 1-4 trees, each node 1 token to 1.5 tiles with 0-3
    children (fewer deeper down), depth first, then a padding tail of 0 to 1 tile -> ([N] tree ids, [N] ends)."""
    rnd = lambda lo, hi: int(torch.randint(lo, hi, (), generator=g))  # noqa: E731
    seq: list[int] = []
    end: list[int] = []

    def node(t: int, depth: int) -> None:
        start = len(end)
        n = rnd(1, 3 * block_size // 2 + 1)
        seq.extend([t] * n)
        end.extend([0] * n)
        for _ in range(rnd(0, max(1, 4 - depth))):
            node(t, depth + 1)
        end[start:start + n] = [len(end)] * n  # this node's subtree ends here

    for t in range(rnd(1, 5)):
        node(t, 0)
    tail = rnd(0, block_size + 1)
    n = len(end) + tail
    return torch.tensor(seq + [-1] * tail), torch.tensor(end + [n] * tail)


def random_row(g: torch.Generator, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random shared-prompt row at the scale of the tile, ([N] tree ids, [N] subtree ends): half of them
    trie_row's, half two-level: 1-6 trees, prompts of 0 to 3 tiles (an empty prompt has one branch, as
    prompt_trees makes it), 1-6 branches of 0 to 2 tiles, so trees and branches start and end inside tiles,
    several share one tile, and some span whole tiles; a padding tail of 0 to 1.5 tiles."""
    rnd = lambda lo, hi: int(torch.randint(lo, hi, (), generator=g))  # noqa: E731
    if rnd(0, 2):
        return trie_row(g, block_size)
    trees = []
    for _ in range(rnd(1, 7)):
        p = rnd(0, 3 * block_size) if rnd(0, 4) else rnd(0, 3)
        lens = [rnd(1, 2 * block_size)] if p == 0 else [rnd(0, 2 * block_size) for _ in range(rnd(1, 7))]
        trees.append((p, lens))
    total = sum(p + sum(lens) for p, lens in trees)
    return row_labels(trees, total + rnd(0, 3 * block_size // 2))


def brute_force_tiles(end: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(any, all) [nb, nb]: whether a tile holds some / only allowed pairs of the dense tree mask; the slots past N
    (the last tile's padding) count as disallowed, so a tile that has them is never all-allowed."""
    n = end.shape[0]
    nb = -(-n // block_size)
    pad = torch.zeros(nb * block_size, nb * block_size, dtype=torch.bool)
    pad[:n, :n] = tree_causal_mask(end)[0, 0]
    tiles = pad.view(nb, block_size, nb, block_size).permute(0, 2, 1, 3).reshape(nb, nb, -1)
    return tiles.any(-1), tiles.all(-1)


def listed_tiles(counts: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """A BlockMask's (num_blocks [1, 1, nb], indices [1, 1, nb, nb']) -> [nb, nb'] bool table of the listed tiles."""
    nb = counts.shape[-1]
    table = torch.zeros(nb, cols.shape[-1], dtype=torch.bool)
    for i in range(nb):
        table[i, cols[0, 0, i, :counts[0, 0, i]].long()] = True
    return table


def applied_mask(partial: torch.Tensor, full: torch.Tensor, elementwise: torch.Tensor,
                 block_size: int) -> torch.Tensor:
    """[nb, nb] partial / full tile tables and mask_mod's [N, N] values -> the [N, N] mask a kernel reading those
    tables applies: mask_mod on partial tiles, every pair on full ones, none elsewhere."""
    n = elementwise.shape[0]

    def spread(t: torch.Tensor) -> torch.Tensor:  # [nb, nb] -> [N, N]
        return t.repeat_interleave(block_size, 0).repeat_interleave(block_size, 1)[:n, :n]

    return (spread(partial) & elementwise) | spread(full)


def issue_row(prompt: int = 200, branches: int = 8, length: int = 500) -> tuple[torch.Tensor, torch.Tensor]:
    """Issue 42's example: one tree, a 200-token prompt and 8 branches of 500 tokens (N = 4200, 33 tiles of 128)."""
    return row_labels([(prompt, [length] * branches)], prompt + branches * length)


def test_the_issue_example_lists_the_minimum_tiles():
    seq, end = issue_row()
    mask = flex_tree_block_mask(end, 128)
    listed = int(mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum())
    needed, all_allowed = brute_force_tiles(end, 128)
    assert int(needed.sum()) == 164 and listed == 164
    assert int(mask.full_kv_num_blocks.sum()) == int(all_allowed.sum()) == 58
    # Before: the tree's document tables, every causal tile of the tree (33 * 34 / 2), 3.4x the work.
    doc_partial, doc_full = flex_block_tiles(seq, 128)
    assert int((doc_partial | doc_full).sum()) == 561


@pytest.mark.parametrize("block_size", [4, 8, 16])
def test_tree_tiles_equal_the_brute_force(block_size):
    # Partial = some pair allowed but not all; full = all (off the diagonal, which masks its upper triangle, and
    # never with padding slots); the rest skipped. Exactly: no tile that holds only other branches is visited.
    g = torch.Generator().manual_seed(100 + block_size)
    fewer = 0
    for _ in range(60):
        seq, end = random_row(g, block_size)
        partial, full = flex_tree_block_tiles(end, block_size)
        any_allowed, all_allowed = brute_force_tiles(end, block_size)
        assert torch.equal(full, all_allowed), end.tolist()
        assert torch.equal(partial, any_allowed & ~all_allowed), end.tolist()
        doc_partial, doc_full = flex_block_tiles(seq, block_size)
        fewer += int((doc_partial | doc_full).sum() > any_allowed.sum())
    assert fewer >= 40  # most rows have tiles holding only other branches (they are the point)


@pytest.mark.parametrize("block_size", [4, 16, 128])
def test_block_mask_tables_attend_as_the_dense_mask(block_size):
    # What the GPU kernels apply: a listed partial tile evaluates mask_mod, a full tile allows every pair, an
    # unlisted tile none. From the kv tables (forward, dq) and the q tables (dk, dv, their transposes) that must be
    # the dense tree mask exactly, on random rows.
    g = torch.Generator().manual_seed(7 * block_size)
    for _ in range(10):
        _, end = random_row(g, block_size)
        n = end.shape[0]
        nb = -(-n // block_size)
        mask = flex_tree_block_mask(end, block_size)
        q_idx, kv_idx = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
        elementwise = mask.mask_mod(0, 0, q_idx, kv_idx)  # [N, N]
        dense = tree_causal_mask(end)[0, 0]
        assert torch.equal(elementwise, dense)
        kv = applied_mask(listed_tiles(mask.kv_num_blocks, mask.kv_indices),
                          listed_tiles(mask.full_kv_num_blocks, mask.full_kv_indices), elementwise, block_size)
        q = applied_mask(listed_tiles(mask.q_num_blocks, mask.q_indices).T,
                         listed_tiles(mask.full_q_num_blocks, mask.full_q_indices).T, elementwise, block_size)
        assert torch.equal(kv, dense) and torch.equal(q, dense)
        assert mask.kv_num_blocks.shape == (1, 1, nb) and mask.seq_lengths == (n, n)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_compiled_flex_attention_on_the_tree_tiles_equals_sdpa():
    # The compiled CPU kernel visits only the listed tiles (the eager path ignores them), float32 inputs (its
    # widest), against SDPA with the dense mask in float64: the design's 1e-5 abs. One compile: the issue's row
    # plus a 24-token padding tail, and a random multi-tree row of the same N.
    from torch.nn.attention.flex_attention import flex_attention

    compiled = torch.compile(flex_attention)
    g = torch.Generator().manual_seed(42)
    rows = [row_labels([(200, [500] * 8)], 4224)[1]]  # the issue's row plus a 24-token padding tail
    # 5 trees of a 150-token prompt and 4 branches of 160, then one of 244 + 10 + 20: 4224 tokens, no tail.
    rows.append(row_labels([(150, [160] * 4)] * 5 + [(244, [10, 20])], 4224)[1])
    for end in rows:
        q, k, v = (torch.randn(1, 2, 4224, 16, generator=g) for _ in range(3))
        out = compiled(q, k, v, block_mask=flex_tree_block_mask(end, 128))
        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=tree_causal_mask(end))
        torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-5)
