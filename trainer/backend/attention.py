"""Packing-correct attention for Hugging Face causal LMs: a packed row's forward equals each sequence's own.

Why position_ids are not enough: with SDPA or eager attention, transformers only infers sequence boundaries from
position_ids when no attention_mask is passed and no cache is used (masking_utils.find_packed_sequence_indices);
pass a 2D mask, a cache, or compile the call and the row gets one plain causal mask, so tokens attend across
sequences (the issue measured a max logit error of 0.15 on transformers 5.23). So every path here states the
document structure explicitly:

    attn implementation   what we pass                                            where
    packed_sdpa           gather / scatter indices (per-sequence causal SDPA)     CPU default
    sdpa                  4D bool mask [1, 1, N, N], True = attend                CPU reference
    eager                 4D additive float mask [1, 1, N, N] (0 / dtype min)    debugging
    flash_attention_2/3   cu_seq_lens_q/k + max_length_q/k (varlen kernel)        CUDA, flash-attn, bf16/fp16 compute
    flex_attention        BlockMask with a document-causal mask_mod               CUDA otherwise (fp32 included);
                          through trainer.backend.flex (compiled once for every row length)

transformers returns a 4D tensor or BlockMask mask as-is (masking_utils._preprocess_mask_arguments), so the same
mask reaches every layer; the flash kwargs travel through **kwargs down to the attention function. packed_sdpa
passes an empty 4D placeholder [1, 1, 0, 0] (packed_placeholder_mask) for the same reason: a 2D all-ones mask makes
sdpa_mask ask `mask.all()` (_ignore_causal_mask_sdpa) and no mask makes find_packed_sequence_indices read the
position_ids, both host syncs on CUDA; the placeholder skips both and holds no data.

packed_sdpa is registered here with transformers' AttentionInterface: the row's segments are gathered into a padded
batch [S, H, Lmax, D] and run through SDPA with is_causal, so a row costs O(S * Lmax^2) instead of the dense path's
O(N^2) (bench_train_step measured the dense mask at ~0.95x the padded reference). In eager blocks the sequences go
in a few padded batches of alike lengths instead of one padded to the longest (trainer.backend.sdpa_chunks: an
agent step's 113-token episodes no longer pay a 300-token one's square); compiled blocks keep the one batch. Without
the packing kwargs it is plain sdpa (same mask function), so per-sequence calls, generation and references still work
on such a model.

The shared-prompt (tree) layout (trainer.batching.shared_prompt: each group a prefix trie, PromptTrees.end says
what a token attends) has a path on each: a dense tree mask for sdpa / eager, a tree mask_mod for flex_attention,
for flash-attn the gathered per-branch layout (each branch attends its own copy of what it shares, so the kernel
stays a plain causal one; see tree_flash_attention), and for packed_sdpa either one padded sequence per tree under
the tree mask (each trie token once) or the per-branch layout (in eager blocks each branch's owned queries only:
sdpa_chunks.branch_owned_chunks), whichever computes fewer score elements (tree_block_layout).

Mask semantics (plain rows): query i attends key j iff j <= i and seq_index[i] == seq_index[j]. The padding tail
(seq_index -1) is one more causal block, so no softmax row is empty (an all-masked SDPA row is NaN, and NaN
times a zero loss mask is still NaN in the backward); packed_sdpa skips it instead (its attention output is 0).
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.flash_attention import flash_attention_forward
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kernels.packing import PackedBatch, host_to_device
from trainer.backend import flex  # also registers packed_flex_attention over "flex_attention"
from trainer.backend.parallel import blocks_compiled
from trainer.backend.sdpa_chunks import (
    branch_owned_chunks,
    branch_segments,
    chunked_cost,
    owned_queries,
    plain_chunked_indices,
)
from trainer.batching.micro_batches import PromptTrees

_FLASH = ("flash_attention_2", "flash_attention_3")
PACKED_SDPA = "packed_sdpa"


def flash_attn_available() -> bool:
    """flash-attn importable (checked lazily, never imported here)."""
    return importlib.util.find_spec("flash_attn") is not None


def flash_attn_3_available() -> bool:
    """FlashAttention 3 (the `flash_attn_interface` package of flash-attn's hopper build) importable."""
    return importlib.util.find_spec("flash_attn_interface") is not None


FLASH_DTYPES = (torch.float16, torch.bfloat16)  # flash-attn's kernels take half-precision q/k/v only


def choose_attn_implementation(device: torch.device | str, dtype: torch.dtype = torch.bfloat16,
                               requested: str = "auto") -> tuple[str, str]:
    """(attn_implementation, why) for packed training on `device` with attention inputs (the compute dtype) of
    `dtype`: flash-attn only where it is installed and the inputs are half precision (it rejects fp32 ones, e.g.
    [trainer] param_dtype = "float32"), FlexAttention on other CUDA runs, packed_sdpa on the CPU. `requested`
    ([trainer] attention): "auto" for that choice, or an implementation by name, checked against what it needs
    (flash-attn: installed, CUDA, half-precision inputs); an error names the fix."""
    if requested != "auto":
        if requested in _FLASH:
            installed = flash_attn_available() if requested == "flash_attention_2" else flash_attn_3_available()
            why = ("flash-attn is not installed (pip install -e '.[flash]')" if not installed else
                   "flash-attn runs on CUDA only" if torch.device(device).type != "cuda" else
                   f"flash-attn takes float16/bfloat16 inputs and this model computes in {dtype}"
                   if dtype not in FLASH_DTYPES else None)
            if why is not None:
                raise ValueError(f"[trainer] attention = {requested!r}: {why}; set attention = \"auto\" (or "
                                 f"\"packed_sdpa\" / \"flex_attention\")")
        if requested == "flex_attention" and torch.device(device).type != "cuda":
            raise ValueError("[trainer] attention = 'flex_attention': torch has no FlexAttention backward on the "
                             "CPU; set attention = \"auto\" (packed_sdpa there) or train on CUDA")
        return requested, "[trainer] attention"
    if torch.device(device).type != "cuda":
        return PACKED_SDPA, "not CUDA: per-sequence SDPA over the packed row"
    if not flash_attn_available():
        return "flex_attention", "flash-attn is not installed: FlexAttention with a document-causal BlockMask"
    if dtype not in FLASH_DTYPES:
        return "flex_attention", (f"flash-attn takes float16/bfloat16 inputs only and this model computes in "
                                  f"{dtype}: FlexAttention instead (compute in bfloat16 to use flash-attn)")
    # Both layouts pass the placeholder mask (no packed-sequence detection on the position_ids); that the call is
    # free of host syncs only a GPU with flash-attn can check.
    return "flash_attention_2", f"flash-attn's varlen kernel on {dtype} inputs"


def default_attn_implementation(device: torch.device | str, dtype: torch.dtype = torch.bfloat16,
                                requested: str = "auto") -> str:
    """The attn_implementation to load a model with for packed training on `device`, computing in `dtype`
    (choose_attn_implementation says why; `requested`: [trainer] attention)."""
    return choose_attn_implementation(device, dtype, requested)[0]


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool (True = attend) -> additive float of the same shape: 0 where allowed, dtype's min elsewhere."""
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)


def _as_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[N, N] bool (True = attend) -> [1, 1, N, N] bool, or additive float (0 / dtype min) for eager attention."""
    if dtype == torch.bool:
        return allowed[None, None]
    return _additive(allowed, dtype)[None, None]


def block_causal_mask(seq_index: torch.Tensor, dtype: torch.dtype = torch.bool) -> torch.Tensor:
    """[N] sequence ids -> [1, 1, N, N] document-causal mask: bool (True = attend) or additive float (0 / min).

    Dense: N^2 elements (64 MiB as bool at N = 8192); fine for the CPU path, which is what uses it.
    """
    n = seq_index.shape[0]
    i = torch.arange(n, device=seq_index.device)
    allowed = (seq_index[:, None] == seq_index[None, :]) & (i[None, :] <= i[:, None])
    return _as_mask(allowed, dtype)


def flex_block_tiles(seq_index: torch.Tensor, block_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """[N] sequence ids -> (partial, full) [nb, nb] bool tile tables of the document-causal mask, nb = ceil(N / bs).

    Built from each tile's documents, [nb, nb] work: create_block_mask's eager path evaluates mask_mod on all N^2
    pairs (a dense [N, N] mask) before reducing it to tiles. A row's sequences are contiguous, so the run ids r
    (0, 1, ... in row order, one per run of equal seq_index, the padding tail included) are non-decreasing and a
    tile's runs are the integer interval [r of its first row, r of its last]. Tile (q i, kv j) has an allowed pair
    iff j <= i and the intervals meet (same run = same sequence); it is full iff j < i and both tiles are complete
    and lie in one and the same run (a diagonal tile always masks its upper triangle). The same tables as
    create_block_mask (tested); every op runs on seq_index's device with sizes the host knows (no sync).
    """
    n, dev = seq_index.shape[0], seq_index.device
    nb = -(-n // block_size)
    run = torch.zeros(n, dtype=torch.int64, device=dev)
    run[1:] = torch.cumsum(seq_index[1:] != seq_index[:-1], 0)
    run = torch.cat([run, run[-1:].expand(nb * block_size - n)]).view(nb, block_size)  # pad: repeat the last run
    lo, hi = run[:, 0], run[:, -1]  # [nb] first and last run of each tile
    t = torch.arange(nb, device=dev)
    below = t[None, :] < t[:, None]  # [nb q, nb kv]: kv tile strictly before the q tile
    meet = (lo[None, :] <= hi[:, None]) & (hi[None, :] >= lo[:, None])
    single = (lo == hi) & (t < n // block_size)  # one run and no padding slots past N
    full = below & single[:, None] & single[None, :] & (lo[:, None] == lo[None, :])
    partial = (below | (t[None, :] == t[:, None])) & meet & ~full
    return partial, full


def _block_mask(partial: torch.Tensor, full: torch.Tensor, mask_mod: Callable, n: int, block_size: int):
    """A FlexAttention BlockMask over [N] rows from [nb, nb] tile tables: fully masked tiles are skipped, full tiles
    skip mask_mod, partial tiles evaluate it."""
    from torch.nn.attention.flex_attention import BlockMask

    def ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # [nb, nb] -> (counts [1, 1, nb], column indices [1, 1, nb, nb]) int32, listed tiles first in column order
        # (create_block_mask's layout).
        t = tiles.to(torch.int32)[None, None]
        cols = torch.argsort(t, dim=-1, descending=True, stable=True)
        return t.sum(-1, dtype=torch.int32), cols.to(torch.int32)

    mask = BlockMask.from_kv_blocks(*ordered(partial), *ordered(full), BLOCK_SIZE=block_size, mask_mod=mask_mod,
                                    seq_lengths=(n, n))
    setattr(mask, flex.PACKED_ROW, True)  # its lengths are the row's (flex.packed_flex_attention)
    return mask


def flex_block_mask(seq_index: torch.Tensor, block_size: int = 128):
    """BlockMask for FlexAttention: document-causal over `seq_index` [N] (mask_mod reads seq_index [N]). Tile tables
    from flex_block_tiles."""

    def document_causal(b, h, q_idx, kv_idx):
        return (seq_index[q_idx] == seq_index[kv_idx]) & (kv_idx <= q_idx)

    partial, full = flex_block_tiles(seq_index, block_size)
    return _block_mask(partial, full, document_causal, seq_index.shape[0], block_size)


def _tile_min(x: torch.Tensor, fill: int, nb: int, block_size: int) -> torch.Tensor:
    """[N] int64 per-token values -> [nb] their minimum over each tile's tokens (slots past N hold `fill`)."""
    pad = x.new_full((nb * block_size - x.shape[0],), fill)
    return torch.cat([x, pad]).view(nb, block_size).amin(dim=1)


def flex_tree_block_tiles(end: torch.Tensor, block_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """[N] subtree ends of a shared-prompt row (PromptTrees.end) -> (partial, full) [nb, nb] bool tile tables of
    tree_causal_mask's rule (query i attends key j iff j <= i < end[j]), nb = ceil(N / bs): a tile is listed iff it
    holds an allowed pair, full iff all its pairs are allowed.

    The document tables of the trees (flex_block_tiles) list every causal tile of a tree, so a branch's queries also
    visit the key tiles of all earlier branches of its tree, where mask_mod is false everywhere: with a prompt of P
    and B branches of R tokens, ~(P + B R)^2 / 2 scores where ~P^2 / 2 + B R (P + R / 2) are needed (P = 200,
    8 x R = 500, bs = 128: 561 causal tiles, 164 of them hold an allowed pair). Key j allows the queries [j, end[j]),
    so for a key tile before the query tile [qs, qe] some pair is allowed iff the key tile's greatest end exceeds qs,
    and all are iff its least end exceeds qe (both tiles complete: slots past N are never allowed); a diagonal tile
    always holds its diagonal and masks its upper triangle. Every op runs on the device with sizes the host knows
    (no sync): minima over [nb, bs], [nb, nb] comparisons.
    """
    n, dev = end.shape[0], end.device
    nb = -(-n // block_size)
    big = torch.iinfo(torch.int64).max
    e = end.to(torch.int64)
    max_end = -_tile_min(-e, 0, nb, block_size)  # [nb] greatest end among each tile's keys (slots past N: 0)
    min_end = _tile_min(e, big, nb, block_size)  # [nb] least end
    t = torch.arange(nb, device=dev)
    first = t * block_size  # [nb] first query of each tile
    last = torch.clamp((t + 1) * block_size, max=n) - 1  # [nb] its last real query
    below = t[None, :] < t[:, None]  # [nb q, nb kv]: kv tile strictly before the q tile
    complete = t < n // block_size  # [nb] no slot past N
    listed = (below & (max_end[None, :] > first[:, None])) | (t[None, :] == t[:, None])
    full = below & complete[:, None] & complete[None, :] & (min_end[None, :] > last[:, None])
    return listed & ~full, full


def flex_tree_block_mask(end: torch.Tensor, block_size: int = 128):
    """BlockMask for FlexAttention in the shared-prompt layout: tree_causal_mask's rule over the row's [N] subtree
    ends (PromptTrees.end), as a mask_mod, over flex_tree_block_tiles' tables (only the tiles holding an allowed
    pair; mask_mod skipped on the full ones). Everything runs on the device with sizes the host knows."""

    def tree_causal(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx < end[kv_idx])

    partial, full = flex_tree_block_tiles(end, block_size)
    return _block_mask(partial, full, tree_causal, end.shape[0], block_size)


def packed_segment_indices(seq_index: torch.Tensor, lengths: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """[N] sequence ids of a packed row (-1 on the padding tail) and its host lengths -> (gather [S, Lmax],
    scatter [N]) int64 indices over its S non-empty sequences, on seq_index's device.

    gather[s, j] is the row position of token j of sequence s, clamped to its last token for j >= its length
    (those slots are causal-masked for every real query, and their own query rows are dropped); scatter[n] =
    s * Lmax + j is where row token n sits in the flattened [S * Lmax] padded batch, and S * Lmax (one zero row
    past the end) for the N - T padding-tail tokens: their attention output is 0, never computed (it is never
    used: loss mask 0, and no real token attends them). Built once per row, shared by every layer.

    Device ops on seq_index only, sizes from the host's lengths: no tensor is made from a Python list (a blocking
    host-to-device copy on CUDA) and nothing is read back.
    """
    segs = [n for n in lengths if n > 0]
    n = seq_index.shape[0]
    if not segs or sum(segs) > n:
        raise ValueError(f"lengths={tuple(lengths)}: need at least one non-empty sequence and sum(lengths) <= "
                         f"N={n}; pass the row's own seq_index and lengths")
    s, lmax, total, dev = len(segs), max(segs), sum(segs), seq_index.device
    # run[i]: 0 .. S-1 over the real tokens in row order (an empty sequence has no token, so no run), S on the tail
    run = torch.zeros(n, dtype=torch.int64, device=dev)
    run[1:] = torch.cumsum(seq_index[1:] != seq_index[:-1], 0)
    lens = torch.zeros(s + 1, dtype=torch.int64, device=dev).index_add_(0, run, torch.ones_like(run))[:s]  # [S]
    starts = torch.cumsum(lens, 0) - lens  # [S]
    j = torch.arange(lmax, device=dev)
    gather = starts[:, None] + torch.minimum(j[None, :], lens[:, None] - 1)  # [S, Lmax]
    i = torch.arange(n, device=dev)
    real = run * lmax + i - starts[run.clamp(max=s - 1)]  # [N]: slot of token i in its sequence's padded row
    return gather, torch.where(i < total, real, s * lmax)


def tree_causal_mask(end: torch.Tensor, dtype: torch.dtype = torch.bool) -> torch.Tensor:
    """[N] subtree ends of a shared-prompt row (PromptTrees.end) -> [1, 1, N, N] mask (bool / additive).

    Query i attends key j iff j <= i < end[j]: a token sees the tokens before it on its own path through its
    tree's trie (its node's earlier tokens, its ancestors'), never a sibling subtree or another tree
    (trainer.batching.shared_prompt). The padding tail (end N) is one causal block, as in block_causal_mask.
    """
    n = end.shape[0]
    i = torch.arange(n, device=end.device)
    allowed = (i[None, :] <= i[:, None]) & (i[:, None] < end[None, :])
    return _as_mask(allowed, dtype)


# The fewest query tokens a branch runs on average for the per-branch layout to be worth its score count: the CPU's
# SDPA pays a share per sequence and head that the count misses, most with a few queries against many keys. One layer's
# forward + backward on 64 groups of 8 (bench_packing-shaped rows, 25-token prompts): answers of 1-6 tokens, tree
# 19.4 ms against owned queries 48.6 ms (2.5x fewer score elements); 5-19: 23.1 against 36.2 ms; 10-29: 24.7 against
# 24.2 ms; 30-59: 36.6 against 20.8 ms (bench/results/agent_step_time-cpu-2core.json, training_trie).
MIN_BRANCH_QUERIES = 16


def tree_block_layout(tree_lengths: Sequence[int], branch_cost: float, branch_queries: float = math.inf) -> str:
    """Which packed_sdpa layout runs a shared-prompt row: "tree" (one padded sequence per tree, each of its trie's
    tokens once, a tree mask) or "branch" (a sequence per branch: branch_cost, the score elements it computes, from
    chunked_cost over the branches' lengths, or sdpa_chunks.branch_owned_chunks' cost where each branch runs only
    the queries it owns; branch_queries, the query tokens a branch runs on average). tree_lengths: the row tokens of
    each tree.

    "branch" when it computes fewer score elements, T * Lt^2 (Lt the longest tree, every tree padded to it) against
    branch_cost, and its branches run at least MIN_BRANCH_QUERIES queries on average. GRPO groups with short
    answers favour trees (the demo's rows, 64 prompts of 23-25 tokens and 8 answers of 1-6 each: 64 * 62^2 = 246k
    against 512 * 31^2 = 492k elements for whole branches, and SDPA's per-(sequence, head) cost on the CPU makes the
    gap 3x: 3.7 vs 11.4 ms a layer); long answers favour branches (P = 100, 8 x R = 1000: 66M against 4.8M). Memory
    is not modelled: the tree layout also holds its [T, 1, Lt, Lt] mask, once per row (packed_attention_kwargs)."""
    lengths = [n for n in tree_lengths if n > 0]
    lt = max(lengths)
    fewer = branch_cost < len(lengths) * lt * lt
    return "branch" if fewer and branch_queries >= MIN_BRANCH_QUERIES else "tree"


def tree_block_indices(seq_index: torch.Tensor, end: torch.Tensor, lengths: tuple[int, ...]
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Shared-prompt row -> (gather [T, Lt], scatter [N], mask [T, 1, Lt, Lt] bool) for packed_sdpa, T = trees.

    Each tree is one padded sequence of the batch (packed_segment_indices over the tree ids seq_index [N] and the
    host tree lengths), so each of its trie's tokens runs once in attention too; mask is tree_causal_mask's rule
    inside each tree: slot q attends slot k iff k <= q and q's row position < end[k's]. A tree's pad slots repeat
    its last token, after every real token (no real query sees them) and each sees itself (no empty softmax row);
    their outputs are never scattered back. Device ops on seq_index and end [N], sizes from the host: no sync.
    """
    gather, scatter = packed_segment_indices(seq_index, lengths)
    lt = gather.shape[1]
    causal = torch.ones(lt, lt, dtype=torch.bool, device=gather.device).tril()
    mask = causal & (gather[:, :, None] < end[gather][:, None, :])  # [T, Lt q, Lt kv]
    return gather, scatter, mask[:, None]


def tree_block_kwargs(seq_index: torch.Tensor, end: torch.Tensor, lengths: tuple[int, ...],
                      dtype: torch.dtype) -> dict:
    """packed_sdpa's keyword arguments for a shared-prompt row in the tree layout: tree_block_indices' gather and
    scatter, and its mask additive in `dtype` (the model's), made once for every layer: SDPA turns a bool mask into a
    new float tensor in each call, and the CPU flash backward keeps each copy (L x T x Lt^2 x 4 bytes in fp32)."""
    gather, scatter, allowed = tree_block_indices(seq_index, end, lengths)
    return {"packed_gather_index": gather, "packed_scatter_index": scatter,
            "packed_block_mask": _additive(allowed, dtype)}


def tree_branch_indices(paths: Sequence[Sequence[tuple[int, int]]], padded_len: int,
                        device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Shared-prompt row -> (gather [S, Lmax], scatter [N]) for packed_sdpa, S = number of branches.

    paths: each branch's row ranges (PromptTrees.paths). Segment s is branch s's own sequence (sdpa_chunks.
    branch_segments), so the per-segment causal SDPA is the sample's unshared attention; every branch reads the
    keys and values of the tokens it shares (their gradients sum over the branches through the gather). Each row
    token's output is taken from the first branch through it; the padding tail from the zero row S * Lmax.
    """
    segs, seg_of, slot_of = branch_segments(paths, padded_len)
    lmax = max(len(g) for g in segs)
    gather = np.stack([np.concatenate([g, np.full(lmax - len(g), g[-1])]) for g in segs])
    scatter = np.full(padded_len, len(segs) * lmax, dtype=np.int64)
    scatter[:len(seg_of)] = seg_of * lmax + slot_of
    return host_to_device(torch.from_numpy(gather), device), host_to_device(torch.from_numpy(scatter), device)


def packed_placeholder_mask(device: torch.device | str) -> torch.Tensor:
    """[1, 1, 0, 0] bool, no data: packed_sdpa's attention_mask. transformers returns any 4D mask untouched, so
    no mask function runs (no host read of a mask or of position_ids); packed_sdpa_attention knows it by its
    shape and attends per segment (packing indices) or causally over the whole row (one segment). Empty on
    purpose: code that took it for a real [B, 1, N, N] mask fails on its shape instead of attending everything."""
    return torch.empty((1, 1, 0, 0), dtype=torch.bool, device=device)


def is_packed_placeholder(mask) -> bool:
    """Whether `mask` is packed_placeholder_mask's (a real 4D mask has N >= 1 query rows)."""
    return isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[-2:] == (0, 0)


def packed_sdpa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                          packed_gather_index: torch.Tensor | None = None,
                          packed_scatter_index: torch.Tensor | None = None,
                          packed_block_mask: torch.Tensor | None = None,
                          packed_chunks: tuple[tuple[int, ...], ...] | None = None,
                          packed_query_index: torch.Tensor | None = None,
                          packed_chunk_masks: tuple[torch.Tensor | None, ...] | None = None,
                          **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function "packed_sdpa": causal SDPA per segment of a packed row.

    query [1, H, N, D], key/value [1, Hkv, N, D] -> ([1, N, H, D], None). With packed_gather_index [S, Lmax] and
    packed_scatter_index [N] (packed_attention_kwargs builds them), the row is gathered into a padded batch
    [S, H, Lmax, D], attended with is_causal (a sequence's pad slots sit after its real tokens, so the causal mask
    already hides them from real queries) and scattered back, the padding tail as zeros: O(S * Lmax^2) work, and
    both index ops are differentiable. packed_block_mask [S, 1, Lmax, Lmax] (bool, True = attend, or additive
    float) replaces is_causal where a segment is a shared-prompt tree (tree_block_indices). With packed_chunks
    ((S_c, L_c), ...), packed_gather_index is flat [sum_c S_c * L_c]: the sequences in padded batches of alike
    lengths (trainer.backend.sdpa_chunks), one causal SDPA each, O(sum_c S_c * L_c^2). With packed_query_index too
    (sdpa_chunks.branch_owned_chunks: chunks (S_c, Q_c, K_c), packed_gather_index the key slots), each chunk's
    queries are its own gathered slots, under packed_chunk_masks (or causal where None): O(sum_c S_c Q_c K_c).
    Without them this is
    transformers' sdpa (mask from the sdpa mask function), or, given the placeholder mask, one causal sequence
    (sdpa's is_causal, no mask tensor).
    """
    placeholder = is_packed_placeholder(attention_mask)
    if packed_gather_index is None:
        mask = None if placeholder else attention_mask
        return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)
    if query.shape[0] != 1 or not (attention_mask is None or placeholder) or packed_scatter_index is None:
        raise ValueError(
            f"packed_sdpa with packing indices expects one row (batch 1, got {query.shape[0]}), no attention mask "
            f"or packed_placeholder_mask's (got {None if attention_mask is None else tuple(attention_mask.shape)}) "
            "and packed_scatter_index; build the call with trainer.backend.attention.packed_attention_kwargs"
        )
    if not getattr(module, "is_causal", True):
        raise ValueError("packed_sdpa: the packed path is causal only; this attention module is not causal")
    if packed_query_index is not None:  # branch_owned_chunks: (S_c, Q_c, K_c) chunks, their masks
        return _chunked_sdpa(query, key, value, packed_query_index, packed_gather_index, packed_scatter_index,
                             packed_chunks, packed_chunk_masks, dropout, scaling), None
    if packed_chunks is not None:  # the plain chunks (S_c, L_c): queries at the key slots, all causal
        chunks = tuple((n, width, width) for n, width in packed_chunks)
        return _chunked_sdpa(query, key, value, packed_gather_index, packed_gather_index, packed_scatter_index,
                             chunks, (None,) * len(chunks), dropout, scaling), None
    s, lmax = packed_gather_index.shape

    def gather(x: torch.Tensor) -> torch.Tensor:  # [1, h, N, D] -> [S, h, Lmax, D], one index op
        return _rows(x, packed_gather_index.flatten()).unflatten(0, (s, lmax)).transpose(1, 2)

    q, k, v = gather(query), gather(key), gather(value)
    mask = packed_block_mask
    if mask is not None and mask.dtype not in (torch.bool, q.dtype):  # computing in another dtype (mixed precision)
        mask = mask.to(q.dtype)
    k, v, gqa = sdpa_gqa(q, k, v, mask)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=mask is None,
                                         scale=scaling, enable_gqa=gqa)  # [S, H, Lmax, D]
    flat = out.transpose(1, 2).reshape(s * lmax, q.shape[1], q.shape[3])  # [S * Lmax, H, D]
    flat = torch.cat([flat, flat.new_zeros(1, q.shape[1], q.shape[3])])  # + the padding tail's zero row
    return flat.index_select(0, packed_scatter_index)[None], None  # [1, N, H, D]


def native_gqa(device_type: str, dtype: torch.dtype, masked: bool, head_dim: int) -> bool:
    """Whether SDPA on `device_type` runs grouped-query attention (enable_gqa) in a fused kernel. The CPU's kernels
    do, with a mask or without. CUDA's (torch 2.5 to 2.12 at least; the GPU machine has 2.11) take it in the flash
    kernel only: half precision, no mask, head dim <= 256; a mask or float32 sends enable_gqa to the math kernel,
    which materialises every score in float32 ([S, H, L, L] and its gradient: O(L^2) memory)."""
    return device_type == "cpu" or (not masked and dtype in (torch.float16, torch.bfloat16) and head_dim <= 256)


def sdpa_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(key, value, enable_gqa) for SDPA of q [.., H, Lq, D] over k, v [.., Hkv, Lk, D]: as they are with
    enable_gqa where the device's fused kernels take it (native_gqa), else each KV head repeated for its H / Hkv
    query heads (query head h reads KV head h // (H / Hkv), transformers' repeat_kv order): O(L) more memory for
    the memory-efficient kernel instead of the math kernel's O(L^2)."""
    h, hkv = q.shape[1], k.shape[1]
    if h == hkv:
        return k, v, False
    if native_gqa(q.device.type, q.dtype, mask is not None, q.shape[-1]):
        return k, v, True
    return k.repeat_interleave(h // hkv, dim=1), v.repeat_interleave(h // hkv, dim=1), False


def _rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """[1, h, N, D] (the projections' token-major memory seen head-major) -> [len(index), h, D]: the tokens at
    `index`, gathered along the token dimension. index_select over whole token rows, not advanced indexing over dim
    1: its backward is index_add_ over contiguous [h * D] rows, where advanced indexing's is an accumulating
    index_put_ (on the CPU ~8x slower at the agent step's 7k tokens -> 16k key slots)."""
    return x[0].transpose(0, 1).index_select(0, index)


def _chunked_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, q_index: torch.Tensor,
                  kv_index: torch.Tensor, scatter: torch.Tensor, chunks: tuple[tuple[int, int, int], ...],
                  masks: tuple[torch.Tensor | None, ...], dropout: float, scaling: float | None) -> torch.Tensor:
    """packed_sdpa over a chunked layout: query [1, H, N, D], key/value [1, Hkv, N, D], q_index [sum S_c * Q_c],
    kv_index [sum S_c * K_c], scatter [N] -> [1, N, H, D], chunks (S_c, Q_c, K_c). One gather per tensor, one SDPA
    per chunk on views of the gathered tensors, under its mask (additive or bool; causal where None), one scatter
    back. The plain layout's chunks are (S_c, L_c, L_c), its queries the key slots, every one causal."""
    q = _rows(query, q_index)  # [sum S_c * Q_c, h, D]
    k, v = (_rows(x, kv_index) for x in (key, value))  # [sum S_c * K_c, hkv, D]
    heads, dim = q.shape[1], q.shape[2]
    outs, q_off, k_off = [], 0, 0
    for (s, qc, kc), mask in zip(chunks, masks):
        qs = q[q_off:q_off + s * qc].unflatten(0, (s, qc)).transpose(1, 2)  # [s, h, Q_c, D]
        ks, vs = (x[k_off:k_off + s * kc].unflatten(0, (s, kc)).transpose(1, 2) for x in (k, v))  # [s, hkv, K_c, D]
        q_off += s * qc
        k_off += s * kc
        if mask is not None and mask.dtype not in (torch.bool, qs.dtype):  # computing in another dtype
            mask = mask.to(qs.dtype)
        ks, vs, gqa = sdpa_gqa(qs, ks, vs, mask)
        out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, dropout_p=dropout, is_causal=mask is None,
                                             scale=scaling, enable_gqa=gqa)  # [s, H, Q_c, D]
        outs.append(out.transpose(1, 2).reshape(s * qc, heads, dim))
    outs.append(q.new_zeros(1, heads, dim))  # the padding tail's zero row
    return torch.cat(outs).index_select(0, scatter)[None]


AttentionInterface.register(PACKED_SDPA, packed_sdpa_attention)
AttentionMaskInterface.register(PACKED_SDPA, sdpa_mask)  # plain calls (no packing kwargs) build sdpa's masks


def tree_varlen_indices(paths: Sequence[Sequence[tuple[int, int]]], padded_len: int,
                        device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Shared-prompt row -> (cu_seqlens [S+1], gather [T], scatter [N], max_len) for flash-attn's varlen kernel.

    paths: each branch's row ranges (PromptTrees.paths); S = number of branches. Segment s is branch s's own
    sequence (sdpa_chunks.branch_segments: what it shares, then its own tokens), laid end to end: gather[t] is the
    row position of token t of that layout (T = sum of the branches' lengths), cu_seqlens the segments' offsets in
    it and max_len the longest (a host int, as flash-attn takes it). scatter[n] is where row token n's output is
    read: from the first branch through it (every branch's copy of a shared token sees the same keys, so the
    copies are equal), the padding tail from the zero row T (never computed: loss mask 0, and no real token
    attends it).

    Built on the host from the host paths and moved in one copy (one int32 buffer; the three tensors are views of
    it), non-blocking from page-locked memory on CUDA: no device value is read and the copy does not wait for the
    queued work.
    """
    segs, seg_of, slot_of = branch_segments(paths, padded_len)
    lengths = np.asarray([len(g) for g in segs], dtype=np.int64)
    cu = np.concatenate([[0], np.cumsum(lengths)])
    scatter = np.full(padded_len, cu[-1], dtype=np.int64)
    scatter[:len(seg_of)] = cu[seg_of] + slot_of
    host = torch.from_numpy(np.concatenate([cu, *segs, scatter]).astype(np.int32))  # [S+1 + T + N]: cu first
    device = torch.device(device)
    if device.type == "cuda":
        host = host.pin_memory()
    buf = host.to(device, non_blocking=True)
    s, t = len(cu), int(cu[-1])
    return buf[:s], buf[s:s + t], buf[s + t:], int(lengths.max())


def tree_flash_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, *, tree_gather_index: torch.Tensor | None = None,
                         tree_scatter_index: torch.Tensor | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function for "flash_attention_2" / "flash_attention_3", registered over transformers'
    own: the shared-prompt layout on flash-attn's varlen kernel, as the gathered per-branch layout.

    query [1, H, N, D], key/value [1, Hkv, N, D] -> ([1, N, H, D], None). With tree_gather_index [T] and
    tree_scatter_index [N] (tree_varlen_indices; cu_seq_lens_q/k and max_length_q/k over the gathered layout in
    kwargs), q/k/v are gathered into the T tokens of the per-branch segments (one index op each), attended by
    transformers' flash_attention_forward on its varlen path (flash-attn's causal varlen kernel, GQA native) and
    scattered back to the row, the padding tail as zeros. The gather's backward (an index_add) sums each prompt
    token's K/V gradient over its branches: the gradient of the plain layout, where every sample has its own copy.
    Work: T tokens of causal varlen attention (the plain layout's attention), while everything else in the model
    runs on the N row tokens.

    Without the tree kwargs this is transformers' flash_attention_forward, call for call (the placeholder mask, if
    given, is no mask), so a model loaded with flash-attn anywhere in the process behaves as before.

    Proven on CPU with the kernel replaced by a float64 reference (tests/test_shared_prompt_flash.py): the indices,
    the routing of cu_seq_lens / max_length through transformers to the kernel call, forward and gradients against
    the dense tree mask and the model against the plain layout. Only a GPU with flash-attn can check the real
    kernel on these inputs (bf16 numerics, the int32 cu_seqlens view, no host sync in the call).
    """
    placeholder = is_packed_placeholder(attention_mask)
    if tree_gather_index is None:
        mask = None if placeholder else attention_mask
        return flash_attention_forward(module, query, key, value, mask, **kwargs)
    if (query.shape[0] != 1 or not (attention_mask is None or placeholder) or tree_scatter_index is None
            or kwargs.get("cu_seq_lens_q") is None or kwargs.get("max_length_q") is None):
        raise ValueError(
            f"the shared-prompt flash path expects one row (batch 1, got {query.shape[0]}), no attention mask or "
            f"packed_placeholder_mask's (got {None if attention_mask is None else tuple(attention_mask.shape)}), "
            "tree_scatter_index and the varlen kwargs; build the call with "
            "trainer.backend.attention.packed_attention_kwargs"
        )
    if not getattr(module, "is_causal", True):
        raise ValueError("the shared-prompt flash path is causal only; this attention module is not causal")
    # position_ids describe the row, not the gathered layout: the varlen kwargs say where segments start.
    kwargs.pop("position_ids", None)

    def gather(x: torch.Tensor) -> torch.Tensor:
        # [1, h, N, D] -> [1, h, T, D], read through its [1, N, h, D] view: the result is [1, T, h, D] in memory,
        # the layout flash_attention_forward transposes to, so its reshape to [T, h, D] copies nothing.
        return x.transpose(1, 2).index_select(1, tree_gather_index).transpose(1, 2)

    out, _ = flash_attention_forward(module, gather(query), gather(key), gather(value), None, **kwargs)  # [1, T, H, D]
    out = F.pad(out[0], (0, 0, 0, 0, 0, 1))  # [T + 1, H, D]: + the padding tail's zero row
    return out.index_select(0, tree_scatter_index)[None], None  # [1, N, H, D]


for _name in _FLASH:  # the same function as transformers' until the tree kwargs are passed
    AttentionInterface.register(_name, tree_flash_attention)


def _attn_implementation(model) -> str:
    config = getattr(model, "config", model)
    impl = getattr(config, "_attn_implementation", None) or "eager"
    return impl


def _model_dtype(model) -> torch.dtype:
    dtype = getattr(model, "dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype
    return next(model.parameters()).dtype


SHARED_PROMPT_IMPLS = (PACKED_SDPA, "sdpa", "eager", "flex_attention", *_FLASH)  # paths with a tree layout


def supports_shared_prompts(model) -> bool:
    """Whether the model's attn_implementation can run the shared-prompt layout (trainer.batching.shared_prompt).

    packed_sdpa runs one padded sequence per tree with the tree mask, or one per branch where that costs less
    (tree_block_layout), flash-attn the gathered per-branch layout (tree_varlen_indices), sdpa / eager the dense
    tree mask, flex_attention a tree mask_mod and tile tables (flex_tree_block_mask).
    """
    return _attn_implementation(model) in SHARED_PROMPT_IMPLS


def _tree_attention_kwargs(impl: str, model, batch: PackedBatch, trees: PromptTrees) -> dict:
    if impl == PACKED_SDPA:
        dev = batch.input_ids.device
        kw = {"attention_mask": packed_placeholder_mask(dev)}
        dtype = _model_dtype(model)
        if not blocks_compiled(model):  # eager: each branch's owned queries, in chunks of alike shapes
            live = sum(1 for q in owned_queries(trees.paths) if q)
            queries = batch.num_tokens / max(1, live)  # each real token: one query
            # Short answers take the tree without building the owned layout (a few ms of host work a forward).
            owned = branch_owned_chunks(trees.paths, batch.padded_len, dev) if queries >= MIN_BRANCH_QUERIES else None
            if owned is None or tree_block_layout(batch.lengths, owned.cost, queries) == "tree":
                return {**kw, **tree_block_kwargs(batch.seq_index, trees.end, batch.lengths, dtype)}
            # Additive in the model's dtype, made once for every layer (as tree_block_kwargs' mask).
            masks = tuple(None if m is None else _additive(m, dtype) for m in owned.masks)
            return {**kw, "packed_query_index": owned.query_index, "packed_gather_index": owned.key_index,
                    "packed_scatter_index": owned.scatter, "packed_chunks": owned.chunks,
                    "packed_chunk_masks": masks}
        branch_lengths = [sum(b - a for a, b in path) for path in trees.paths]
        cost = chunked_cost(branch_lengths, waste=math.inf)
        if tree_block_layout(batch.lengths, cost, sum(branch_lengths) / len(branch_lengths)) == "tree":
            return {**kw, **tree_block_kwargs(batch.seq_index, trees.end, batch.lengths, dtype)}
        gather, scatter = tree_branch_indices(trees.paths, batch.padded_len, dev)
        return {**kw, "packed_gather_index": gather, "packed_scatter_index": scatter}
    if impl in ("sdpa", "eager"):
        dtype = torch.bool if impl == "sdpa" else _model_dtype(model)
        return {"attention_mask": tree_causal_mask(trees.end, dtype)}
    if impl == "flex_attention":
        return {"attention_mask": flex_tree_block_mask(trees.end)}
    if impl in _FLASH:
        if ALL_ATTENTION_FUNCTIONS.get(impl) is not tree_flash_attention:
            # Another function under this name would ignore the tree kwargs and attend the row as one sequence.
            raise ValueError(f"attn_implementation={impl!r} is registered to another function than "
                             "trainer.backend.attention.tree_flash_attention (re-registered after this module was "
                             "imported?); register it back or set [trainer] share_prompts = false")
        # The placeholder mask, as for packed_sdpa: transformers returns it untouched, so its mask code reads
        # neither a mask nor the position_ids (attention_mask=None would make it scan position_ids on the host).
        dev = batch.input_ids.device
        cu, gather, scatter, max_len = tree_varlen_indices(trees.paths, batch.padded_len, dev)
        return {"attention_mask": packed_placeholder_mask(dev), "cu_seq_lens_q": cu, "cu_seq_lens_k": cu,
                "max_length_q": max_len, "max_length_k": max_len,
                "tree_gather_index": gather, "tree_scatter_index": scatter}
    raise ValueError(f"attn_implementation={impl!r} has no shared-prompt (tree) mask; load the model with one of "
                     f"{SHARED_PROMPT_IMPLS} or set [trainer] share_prompts = false")


def packed_attention_kwargs(model, batch: PackedBatch, trees: PromptTrees | None = None) -> dict:
    """Keyword arguments for `model(**kw)` or its backbone on one packed row (batch dimension 1).

    Returns input_ids [1, N], position_ids [1, N], use_cache False, and the attention inputs the model's
    attn_implementation needs (see the module docstring); with `trees`, the shared-prompt layout's attention.
    """
    impl = _attn_implementation(model)
    ids = batch.input_ids[None]
    kw: dict = {"input_ids": ids, "position_ids": batch.position_ids[None], "use_cache": False}
    if trees is not None:
        return {**kw, **_tree_attention_kwargs(impl, model, batch, trees)}
    if impl == PACKED_SDPA:
        # The empty 4D placeholder: transformers passes it through (no position_ids packing detection, no
        # mask.all() check: no host sync), so no N x N tensor exists; the segments travel as the two index tensors.
        kw["attention_mask"] = packed_placeholder_mask(ids.device)
        real = sum(1 for n in batch.lengths if n > 0)
        if blocks_compiled(model):
            # One padded batch (no data-dependent number of SDPA calls to specialise), for a row of one sequence
            # too: every row then calls the blocks with the same arguments, so one graph serves them all (a row of
            # one sequence still compiles once more: its batch of 1 specialises, see compile_blocks).
            if real:
                gather, scatter = packed_segment_indices(batch.seq_index, batch.lengths)
            else:  # an all-padding row (ranks kept in step): one sequence of padding, its outputs 0 as a tail's
                n = batch.padded_len
                gather = torch.arange(n, device=ids.device)[None]  # [1, N]
                scatter = torch.full((n,), n, dtype=torch.long, device=ids.device)  # [N]: the zero row
            kw.update(packed_gather_index=gather, packed_scatter_index=scatter)
        elif real + (batch.padded_len > batch.num_tokens) > 1:  # sequences in batches of alike lengths (sdpa_chunks)
            gather, scatter, chunks = plain_chunked_indices(batch.lengths, batch.padded_len, ids.device)
            kw.update(packed_gather_index=gather, packed_scatter_index=scatter, packed_chunks=chunks)
        # else one plain causal sequence (or an all-padding row): sdpa with is_causal
    elif impl == "sdpa":
        kw["attention_mask"] = block_causal_mask(batch.seq_index, torch.bool)
    elif impl == "eager":
        kw["attention_mask"] = block_causal_mask(batch.seq_index, _model_dtype(model))
    elif impl in _FLASH:
        # The placeholder mask, as for packed_sdpa: with attention_mask=None transformers' _preprocess_mask_arguments
        # would call find_packed_sequence_indices on the position_ids (a host read on CUDA) although the
        # cu_seq_lens below already say where sequences start; tree_flash_attention (registered over the flash
        # names) takes the placeholder as no mask. Another function registered under the name gets None, as
        # transformers' own expects (correct, with that host read). Varlen segments: the real sequences, then the
        # padding tail as one more segment (so every row of the packed tensor belongs to some segment and the output
        # shape stays [1, N, H]).
        # The tail's end is appended by a fill (F.pad's value), not a tensor from a Python list (a blocking copy).
        cu = batch.cu_seqlens
        seg = list(batch.lengths)
        tail = batch.padded_len - batch.num_tokens
        if tail:
            cu = F.pad(cu, (0, 1), value=batch.padded_len)  # [S+2]
            seg.append(tail)
        max_len = max(seg) if seg else 0
        ours = ALL_ATTENTION_FUNCTIONS.get(impl) is tree_flash_attention
        kw.update(attention_mask=packed_placeholder_mask(ids.device) if ours else None, cu_seq_lens_q=cu,
                  cu_seq_lens_k=cu, max_length_q=max_len, max_length_k=max_len)
    elif impl == "flex_attention":
        kw["attention_mask"] = flex_block_mask(batch.seq_index)
    else:
        raise ValueError(
            f"attn_implementation={impl!r} has no packed path; load the model with one of "
            f"{PACKED_SDPA!r}, 'sdpa', 'eager', 'flex_attention', {', '.join(repr(x) for x in _FLASH)} "
            "(trainer.backend.attention.default_attn_implementation picks one per device)"
        )
    return kw


def backbone(model):
    """The decoder without its LM head (model.model for Llama/Qwen2); the model itself if it has no head."""
    prefix = getattr(model, "base_model_prefix", "model")
    inner = getattr(model, prefix, None)
    return inner if isinstance(inner, torch.nn.Module) else model


def packed_hidden_states(model, batch: PackedBatch, trees: PromptTrees | None = None) -> torch.Tensor:
    """[N, H] final hidden states (after the last norm) of one packed row; no logits are built.

    Feed them with the LM head weight to the fused log-prob / policy-loss kernels; hidden state i predicts token
    i + 1 of the same sequence (kernels.packing.shift_left builds those targets). With `trees` (the shared-prompt
    layout) hidden state i is the one of token i in its sample's own sequence.
    """
    if batch.input_ids.dim() != 1:
        raise ValueError(f"batch.input_ids must be [N] (one packed row), got {tuple(batch.input_ids.shape)}")
    out = backbone(model)(**packed_attention_kwargs(model, batch, trees))
    return out.last_hidden_state[0]


def packed_logits(model, batch: PackedBatch) -> torch.Tensor:
    """[N, V] logits of a packed row (tests and debugging; training uses packed_hidden_states + a fused head)."""
    return model.get_output_embeddings()(packed_hidden_states(model, batch))
