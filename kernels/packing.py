"""Sequence packing: padded [B, L, ...] <-> flat [N, ...] plus the layout tensors a packed row needs.

A packed row concatenates S sequences of lengths l_0..l_{S-1} (all > 0) into one row of T = sum(l) real
tokens, optionally followed by a padding tail up to a bucketed length N >= T (compile-stable shapes):

    cu_seqlens   [S+1] int32   0, l_0, l_0+l_1, ..., T              (flash-attn varlen layout)
    position_ids [N]   int64   t - cu[s] for token t of sequence s   (restarts at 0 per sequence);
                               the padding tail counts 0, 1, ... as if it were one more sequence
    seq_index    [N]   int64   s for token t of sequence s, -1 on the padding tail
    broadcast    [N]           values[s] per token of sequence s (the advantage), `fill` on the padding tail

Ops (each with a Triton kernel and a torch path, chosen by kernels.device.backend_for):
    pack(padded, lengths)     [B, L, ...] -> [N, ...]   differentiable (backward is unpack with fill 0)
    unpack(flat, lengths)     [N, ...] -> [B, L, ...]   differentiable (backward is pack)
    packed_layout(...)        cu_seqlens -> (position_ids, seq_index)
    broadcast_to_tokens(...)  values [S] -> [N]         differentiable (backward is a per-sequence sum)

Lengths are host integers (a list, or a tensor read once with a marked sync): sizes of the outputs depend on
them, so they must be on the host anyway, and the planner has them there already.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.device import backend_for

Lengths = Sequence[int] | torch.Tensor


# ---------------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------------


@triton.jit
def _pack_kernel(pad_ptr, flat_ptr, len_ptr, cu_ptr, L, D, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    # Copy, no math: flat[cu[b] + t, :] = padded[b, t, :] for t < len[b]. Grid (B, cdiv(L, BLOCK_T)); padded is
    # viewed as [B, L, D] and flat as [N, D] (D = product of the trailing dims). int64 offsets: B*L*D and N*D can
    # pass 2**31 for [T, V]-sized per-token tensors.
    b = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    n = tl.load(len_ptr + b).to(tl.int64)
    start = tl.load(cu_ptr + b).to(tl.int64)
    rows = t < n
    src_row = (b * L + t) * D
    dst_row = (start + t) * D
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        m = rows[:, None] & (d < D)[None, :]
        x = tl.load(pad_ptr + src_row[:, None] + d[None, :], mask=m)
        tl.store(flat_ptr + dst_row[:, None] + d[None, :], x, mask=m)


@triton.jit
def _unpack_kernel(flat_ptr, pad_ptr, len_ptr, cu_ptr, L, D, FILL: tl.constexpr, BLOCK_T: tl.constexpr,
                   BLOCK_D: tl.constexpr):
    # Inverse of _pack_kernel: padded[b, t, :] = flat[cu[b] + t, :] for t < len[b], FILL for len[b] <= t < L.
    # Every padded element is written, so the output can be allocated uninitialised.
    b = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    n = tl.load(len_ptr + b).to(tl.int64)
    start = tl.load(cu_ptr + b).to(tl.int64)
    in_row = t < L
    real = t < n
    src_row = (start + t) * D
    dst_row = (b * L + t) * D
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        dm = (d < D)[None, :]
        x = tl.load(flat_ptr + src_row[:, None] + d[None, :], mask=real[:, None] & dm, other=FILL)
        tl.store(pad_ptr + dst_row[:, None] + d[None, :], x, mask=in_row[:, None] & dm)


@triton.jit
def _layout_kernel(cu_ptr, pos_ptr, seq_ptr, N, S, N_ITERS: tl.constexpr, BLOCK: tl.constexpr):
    # For token i of the row, its sequence is s = max{b in [0, S] : cu[b] <= i}, found by a vectorised binary
    # search over cu_seqlens (cu is strictly increasing because every length is > 0; cu[0] = 0 <= i always).
    # Invariant lo <= s <= hi; each step halves hi - lo, so N_ITERS = bit_length(S) steps reach lo == hi.
    # s == S means i >= T: the padding tail, numbered -1 with positions restarting at 0 at T.
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = i < N
    lo = tl.zeros([BLOCK], dtype=tl.int64)
    hi = tl.zeros([BLOCK], dtype=tl.int64) + S
    for _ in tl.static_range(N_ITERS):
        mid = (lo + hi + 1) // 2
        c = tl.load(cu_ptr + mid, mask=inb, other=0).to(tl.int64)
        go = c <= i
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid - 1)
    start = tl.load(cu_ptr + lo, mask=inb, other=0).to(tl.int64)
    tl.store(pos_ptr + i, i - start, mask=inb)
    tl.store(seq_ptr + i, tl.where(lo == S, -1, lo), mask=inb)


@triton.jit
def _broadcast_kernel(val_ptr, seq_ptr, out_ptr, N, FILL: tl.constexpr, BLOCK: tl.constexpr):
    # out[i] = values[seq_index[i]], FILL where seq_index[i] < 0 (padding tail). A gather, no math.
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = i < N
    s = tl.load(seq_ptr + i, mask=inb, other=-1)
    v = tl.load(val_ptr + s, mask=inb & (s >= 0), other=FILL)
    tl.store(out_ptr + i, v, mask=inb)


# ---------------------------------------------------------------------------------------------------------
# Host helpers: argument checks, allocation, launches
# ---------------------------------------------------------------------------------------------------------


def host_lengths(lengths: Lengths, name: str = "lengths") -> list[int]:
    """Lengths as a host list of positive ints; a ValueError naming `name` otherwise."""
    if isinstance(lengths, torch.Tensor):
        if lengths.dim() != 1 or lengths.dtype.is_floating_point or lengths.dtype == torch.bool:
            raise ValueError(f"{name} must be a 1-D integer tensor, got shape {tuple(lengths.shape)} {lengths.dtype}")
        out = lengths.tolist()  # host sync (marked): output sizes depend on the lengths
    else:
        out = [int(x) for x in lengths]
        if any(int(x) != x for x in lengths):
            raise ValueError(f"{name} must be integers, got {list(lengths)[:8]}...")
    bad = [(i, n) for i, n in enumerate(out) if n <= 0]
    if bad:
        i, n = bad[0]
        raise ValueError(f"{name}[{i}] = {n}: every sequence length must be > 0 (drop empty sequences first)")
    return out


def padding_chunks(costs: Sequence[float], waste: float = 2.0) -> list[list[int]]:
    """Indices of `costs` grouped so that each group, every member costed as its most costly, costs at most `waste`
    times its real total: cheapest first, a new group when the next item would break the bound.

    costs: what each item computes alone. The engine's prefill passes the tokens each joining row feeds (a forward
    pads its rows to the longest); packed_sdpa passes each sequence's squared length (its attention is quadratic, so
    a group pads to its longest sequence's score elements). Fewer, larger calls where costs are alike: one call's
    fixed cost is a few ms for a forward on a CPU, tens of us for an SDPA."""
    order = sorted(range(len(costs)), key=lambda i: costs[i])
    chunks: list[list[int]] = []
    real = 0.0
    for i in order:
        if chunks and (len(chunks[-1]) + 1) * costs[i] <= waste * (real + costs[i]):
            chunks[-1].append(i)
            real += costs[i]
        else:
            chunks.append([i])
            real = costs[i]
    return chunks


def cu_seqlens_from_lengths(lengths: Lengths, device: torch.device | str | None = None) -> torch.Tensor:
    """[S+1] int32 cumulative lengths starting at 0 (the flash-attn varlen layout). A cumsum: no kernel needed."""
    lens = host_lengths(lengths)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    if cu[-1] >= 2**31:
        raise ValueError(f"sum(lengths) = {cu[-1]} does not fit int32 cu_seqlens; pack fewer tokens per row")
    return host_ints_to(cu, device)


def host_ints_to(values: Sequence[int], device: torch.device | str | None,
                 dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """A host list of ints as a tensor on `device`, without a host sync: `torch.tensor(values, device="cuda")` is a
    blocking copy from pageable memory (it trips `set_sync_debug_mode("error")`); from pinned memory the copy is
    queued on the current stream and the caching host allocator keeps the pinned block until it has run."""
    return host_to_device(torch.tensor(values, dtype=dtype), device)


def host_to_device(host: torch.Tensor, device: torch.device | str | None) -> torch.Tensor:
    """A host tensor on `device` without a host sync: to CUDA through pinned memory (a `non_blocking` copy from
    pageable memory is still synchronous), elsewhere a plain `.to` (None: left where it is)."""
    if device is None or torch.device(device).type != "cuda":
        return host if device is None else host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _kernel_view(t: torch.Tensor) -> torch.Tensor:
    # Triton has no bool pointer loads we rely on; bytes are bytes for a copy.
    return t.view(torch.uint8) if t.dtype == torch.bool else t


def _fill_for(dtype: torch.dtype, fill: float) -> float | int | bool:
    if dtype == torch.bool:
        return bool(fill)
    if dtype.is_floating_point:
        return float(fill)
    if int(fill) != fill:
        raise ValueError(f"fill={fill} is not representable in the integer dtype {dtype}; pass an integer fill")
    return int(fill)


# One program of _pack_kernel / _unpack_kernel copies [BLOCK_T, BLOCK_D] tiles. Its registers hold the tile's
# int64 addresses (8 B per element whatever the dtype) besides the data, so the tile size, not the dtype, decides
# spills: at 4 warps, 64 x 64 and larger tiles spill when D is not a multiple of 16 (no 16-byte loads), and
# 64 x 256 tiles for 4- and 8-byte elements even when it is; tiles of 2048 elements (16 per thread) spill in
# none (ptxas for sm_90: tests/test_kernel_spills.py). Wide rows take fewer tokens per program; narrow ones
# (D = 1: ids, masks) keep 64. A copy needs no more bytes in flight per program: other programs fill the SM.
_COPY_TILE_ELEMS = 2048
_COPY_BLOCK_T = 64
_COPY_WARPS = 4
# Tokens per program of _layout_kernel and _broadcast_kernel (one int64 element each, 2 per thread at 4 warps).
_TOKEN_BLOCK = 256


def _copy_tiles(D: int) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_D, num_warps) of a pack/unpack launch over rows of D elements (the copy is the same at any
    tiling: only speed and registers depend on it)."""
    block_d = min(triton.next_power_of_2(max(D, 1)), 256)
    return min(_COPY_BLOCK_T, _COPY_TILE_ELEMS // block_d), block_d, _COPY_WARPS


def _check_padded(padded: torch.Tensor, lens: list[int]) -> None:
    if padded.dim() < 2:
        raise ValueError(f"padded must be [B, L, ...], got shape {tuple(padded.shape)}; add a batch dimension")
    B, L = padded.shape[:2]
    if len(lens) != B:
        raise ValueError(f"len(lengths) = {len(lens)} != padded.shape[0] = {B}; pass one length per row")
    if lens and max(lens) > L:
        i = max(range(B), key=lambda j: lens[j])
        raise ValueError(f"lengths[{i}] = {lens[i]} > padded.shape[1] = {L}; a length cannot exceed the row width")
    if not padded.is_contiguous():
        raise ValueError("padded must be contiguous; call .contiguous() on it first")


def _pack_fwd(padded: torch.Tensor, lens: list[int], total: int, fill: float) -> torch.Tensor:
    B, L = padded.shape[:2]
    T = sum(lens)
    flat = torch.empty((total, *padded.shape[2:]), dtype=padded.dtype, device=padded.device)
    if total > T:
        flat[T:] = _fill_for(padded.dtype, fill)  # the padding tail (compile-stable bucket)
    if T == 0:
        return flat
    if backend_for(padded) == "triton":
        D = int(torch.Size(padded.shape[2:]).numel())
        len_t = host_ints_to(lens, padded.device)
        cu = cu_seqlens_from_lengths(lens, padded.device)
        BLOCK_T, BLOCK_D, warps = _copy_tiles(D)
        _pack_kernel[(B, triton.cdiv(L, BLOCK_T))](
            _kernel_view(padded), _kernel_view(flat), len_t, cu, L, D, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D,
            num_warps=warps,
        )
    else:
        keep = torch.arange(L, device=padded.device)[None, :] < host_ints_to(lens, padded.device, torch.int64)[:, None]
        flat[:T] = padded[keep]
    return flat


def _unpack_fwd(flat: torch.Tensor, lens: list[int], max_len: int, fill: float) -> torch.Tensor:
    B = len(lens)
    padded = torch.empty((B, max_len, *flat.shape[1:]), dtype=flat.dtype, device=flat.device)
    if B == 0:
        return padded
    if backend_for(flat) == "triton":
        D = int(torch.Size(flat.shape[1:]).numel())
        len_t = host_ints_to(lens, flat.device)
        cu = cu_seqlens_from_lengths(lens, flat.device)
        BLOCK_T, BLOCK_D, warps = _copy_tiles(D)
        _unpack_kernel[(B, triton.cdiv(max_len, BLOCK_T))](
            _kernel_view(flat), _kernel_view(padded), len_t, cu, max_len, D,
            FILL=_fill_for(torch.uint8 if flat.dtype == torch.bool else flat.dtype, fill),
            BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D, num_warps=warps,
        )
    else:
        padded.fill_(_fill_for(flat.dtype, fill))
        lens_t = host_ints_to(lens, flat.device, torch.int64)
        keep = torch.arange(max_len, device=flat.device)[None, :] < lens_t[:, None]
        padded[keep] = flat[: sum(lens)]
    return padded


class _Pack(torch.autograd.Function):
    @staticmethod
    def forward(ctx, padded, lens, total, fill):
        ctx.lens, ctx.L = lens, padded.shape[1]
        return _pack_fwd(padded, lens, total, fill)

    @staticmethod
    def backward(ctx, grad):
        # d flat[cu[b]+t] / d padded[b, t] = 1 for t < len[b]; padded slots past the length got no gradient.
        return _unpack_fwd(grad.contiguous(), ctx.lens, ctx.L, 0.0), None, None, None


class _Unpack(torch.autograd.Function):
    @staticmethod
    def forward(ctx, flat, lens, max_len, fill):
        ctx.lens, ctx.total = lens, flat.shape[0]
        return _unpack_fwd(flat, lens, max_len, fill)

    @staticmethod
    def backward(ctx, grad):
        # The fill slots are constants; the real slots map one to one back onto the flat rows.
        return _pack_fwd(grad.contiguous(), ctx.lens, ctx.total, 0.0), None, None, None


# ---------------------------------------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------------------------------------


def pack(padded: torch.Tensor, lengths: Lengths, *, total: int | None = None, fill: float = 0) -> torch.Tensor:
    """[B, L, ...] -> [total, ...]: the first lengths[b] rows of each padded[b], concatenated.

    `total` (default sum(lengths)) pads the result up to a bucketed length with `fill` (token ids, log-probs,
    masks all work; bool and integer dtypes are copied bit-exactly). Differentiable for float inputs.
    """
    lens = host_lengths(lengths)
    _check_padded(padded, lens)
    T = sum(lens)
    total = T if total is None else int(total)
    if total < T:
        raise ValueError(f"total={total} < sum(lengths) = {T}; the packed row must hold every real token")
    return _Pack.apply(padded, lens, total, fill)


def unpack(flat: torch.Tensor, lengths: Lengths, *, max_len: int | None = None, fill: float = 0) -> torch.Tensor:
    """[N, ...] -> [B, max_len, ...]: inverse of `pack`; slots past each length hold `fill`.

    `flat` may carry a padding tail (N >= sum(lengths)); it is ignored. `max_len` defaults to max(lengths).
    """
    lens = host_lengths(lengths)
    if flat.dim() < 1:
        raise ValueError("flat must be [N, ...], got a 0-d tensor")
    if not flat.is_contiguous():
        raise ValueError("flat must be contiguous; call .contiguous() on it first")
    T = sum(lens)
    if flat.shape[0] < T:
        raise ValueError(f"flat.shape[0] = {flat.shape[0]} < sum(lengths) = {T}; lengths do not match the tensor")
    max_len = (max(lens) if lens else 0) if max_len is None else int(max_len)
    if lens and max_len < max(lens):
        raise ValueError(f"max_len={max_len} < max(lengths) = {max(lens)}; raise max_len or leave it None")
    return _Unpack.apply(flat, lens, max_len, fill)


def packed_layout(cu_seqlens: torch.Tensor, total: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(position_ids [N] int64, seq_index [N] int64) for a row laid out by `cu_seqlens` [S+1].

    N = `total` (default cu_seqlens[-1], read with a marked host sync); tokens past cu_seqlens[-1] are the padding
    tail: seq_index -1 and positions 0, 1, ... (a dummy sequence, so position-based packing detection stays sane).
    """
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be a 1-D int32/int64 tensor [S+1], got {tuple(cu_seqlens.shape)} "
                         f"{cu_seqlens.dtype}; build it with cu_seqlens_from_lengths")
    if not cu_seqlens.is_contiguous():
        raise ValueError("cu_seqlens must be contiguous; call .contiguous() on it first")
    S = cu_seqlens.numel() - 1
    T = int(cu_seqlens[-1]) if total is None else None  # host sync (marked) only when total is not given
    N = T if total is None else int(total)
    if total is not None and not cu_seqlens.is_cuda and N < int(cu_seqlens[-1]):  # free check on the host only
        raise ValueError(f"total={N} < cu_seqlens[-1] = {int(cu_seqlens[-1])}; the row must hold every real token")
    dev = cu_seqlens.device
    pos = torch.empty(N, dtype=torch.int64, device=dev)
    seq = torch.empty(N, dtype=torch.int64, device=dev)
    if N == 0:
        return pos, seq
    if backend_for(cu_seqlens) == "triton":
        _layout_kernel[(triton.cdiv(N, _TOKEN_BLOCK),)](cu_seqlens, pos, seq, N, S,
                                                        N_ITERS=max(S, 1).bit_length(), BLOCK=_TOKEN_BLOCK)
    else:
        cu = cu_seqlens.long()
        i = torch.arange(N, device=dev)
        s = torch.searchsorted(cu, i, right=True) - 1  # max b with cu[b] <= i
        pos.copy_(i - cu[s])
        seq.copy_(torch.where(s == S, -1, s))
    return pos, seq


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values, seq_index, fill):
        ctx.save_for_backward(seq_index)
        ctx.S = values.shape[0]
        out = torch.empty(seq_index.shape[0], dtype=values.dtype, device=values.device)
        N = out.numel()
        if N == 0:
            return out
        if backend_for(values) == "triton":
            _broadcast_kernel[(triton.cdiv(N, _TOKEN_BLOCK),)](values, seq_index, out, N,
                                                               FILL=_fill_for(values.dtype, fill), BLOCK=_TOKEN_BLOCK)
        else:
            valid = seq_index >= 0
            out.copy_(torch.where(valid, values[seq_index.clamp(min=0)], _fill_for(values.dtype, fill)))
        return out

    @staticmethod
    def backward(ctx, grad):
        # d out[i] / d values[s] = [seq_index[i] == s]: the gradient of a value is the sum over its tokens.
        (seq,) = ctx.saved_tensors
        valid = seq >= 0
        g = torch.zeros(ctx.S, dtype=grad.dtype, device=grad.device)
        g.index_add_(0, seq.clamp(min=0), torch.where(valid, grad, 0))
        return g, None, None


def broadcast_to_tokens(values: torch.Tensor, seq_index: torch.Tensor, *, fill: float = 0) -> torch.Tensor:
    """[S] per-sequence values (e.g. advantages) -> [N] per-token values; `fill` on the padding tail (index -1)."""
    if values.dim() != 1:
        raise ValueError(f"values must be [S] (one value per sequence), got shape {tuple(values.shape)}")
    if seq_index.dim() != 1 or seq_index.dtype != torch.int64:
        raise ValueError(f"seq_index must be a 1-D int64 tensor [N] (from packed_layout), got "
                         f"{tuple(seq_index.shape)} {seq_index.dtype}")
    if values.device != seq_index.device:
        raise ValueError(f"values on {values.device} but seq_index on {seq_index.device}; move them together")
    if not (values.is_contiguous() and seq_index.is_contiguous()):
        raise ValueError("values and seq_index must be contiguous; call .contiguous() first")
    if values.dtype == torch.bool:
        raise ValueError("values must be numeric; convert a bool tensor with .to(torch.uint8) or .float()")
    return _Broadcast.apply(values, seq_index, fill)


def shift_left(values: torch.Tensor, seq_index: torch.Tensor, *, fill: float = 0) -> torch.Tensor:
    """out[i] = values[i+1] when token i+1 belongs to the same sequence as token i, else `fill`.

    Next-token targets of a packed row: the hidden state at token i predicts token i+1 of the same sequence, so
    the last token of every sequence (and the padding tail) gets `fill` (e.g. -100 / mask 0). [N, ...] -> [N, ...].
    """
    if values.shape[:1] != seq_index.shape:
        raise ValueError(f"values.shape[0] = {values.shape[0]} != seq_index.shape[0] = {seq_index.shape[0]}")
    nxt = torch.roll(values, -1, dims=0)
    same = torch.roll(seq_index, -1, dims=0) == seq_index
    same[-1:] = False
    same &= seq_index >= 0
    same = same.view(-1, *([1] * (values.dim() - 1)))
    return torch.where(same, nxt, torch.as_tensor(_fill_for(values.dtype, fill), dtype=values.dtype,
                                                  device=values.device))


# ---------------------------------------------------------------------------------------------------------
# PackedBatch: one packed row, ready for packed attention (trainer/backend/attention.py)
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class PackedBatch:
    """One packed row of S sequences: T real tokens followed by N - T padding tokens (loss_mask 0).

    input_ids    [N] int64     token ids (pad_id on the padding tail)
    position_ids [N] int64     restarting at 0 per sequence
    seq_index    [N] int64     sequence of each token, -1 on the padding tail
    cu_seqlens   [S+1] int32   cumulative real lengths (cu_seqlens[-1] == T)
    loss_mask    [N]           the caller's per-token mask packed (default 1.0 on real tokens), 0 on the tail
    lengths      host tuple of the S lengths (no device reads needed for sizes)
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    seq_index: torch.Tensor
    cu_seqlens: torch.Tensor
    loss_mask: torch.Tensor
    lengths: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        """Real tokens T."""
        return sum(self.lengths)

    @property
    def padded_len(self) -> int:
        """Row length N (bucketed), T <= N."""
        return self.input_ids.shape[0]

    @property
    def max_seqlen(self) -> int:
        return max(self.lengths) if self.lengths else 0


def pack_batch(input_ids: torch.Tensor | Sequence[torch.Tensor], lengths: Lengths | None = None, *,
               loss_mask: torch.Tensor | Sequence[torch.Tensor] | None = None, pad_to: int | None = None,
               pad_id: int = 0) -> PackedBatch:
    """Build a PackedBatch from padded ids [B, L] + lengths, or from a list of 1-D id tensors.

    `loss_mask` has the same layout as `input_ids` (padded [B, L] or a list); `pad_to` (e.g. a planner bucket,
    trainer.batching.planner.bucket_length) sets the row length N >= sum(lengths) so compiled graphs see few shapes.
    """
    if isinstance(input_ids, torch.Tensor):
        if lengths is None:
            raise ValueError("lengths is required with padded input_ids [B, L]; pass one length per row")
        padded = input_ids
    else:
        seqs = list(input_ids)
        if lengths is None:
            lengths = [s.shape[0] for s in seqs]
        if not seqs:
            raise ValueError("input_ids is an empty list; pack at least one sequence")
        padded = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=pad_id)
        if loss_mask is not None and not isinstance(loss_mask, torch.Tensor):
            loss_mask = torch.nn.utils.rnn.pad_sequence(list(loss_mask), batch_first=True, padding_value=0)
    lens = host_lengths(lengths)
    if padded.dim() != 2:
        raise ValueError(f"input_ids must be [B, L], got shape {tuple(padded.shape)}")
    T = sum(lens)
    N = T if pad_to is None else int(pad_to)
    if N < T:
        raise ValueError(f"pad_to={N} < sum(lengths) = {T}; use a bucket at least as long as the packed tokens")
    ids = pack(padded.contiguous(), lens, total=N, fill=pad_id)
    if loss_mask is None:
        mask = torch.zeros(N, dtype=torch.float32, device=padded.device)
        mask[:T] = 1.0
    else:
        if tuple(loss_mask.shape) != tuple(padded.shape):
            raise ValueError(f"loss_mask shape {tuple(loss_mask.shape)} != input_ids shape {tuple(padded.shape)}")
        mask = pack(loss_mask.contiguous(), lens, total=N, fill=0)
    cu = cu_seqlens_from_lengths(lens, padded.device)
    pos, seq = packed_layout(cu, N)
    return PackedBatch(input_ids=ids, position_ids=pos, seq_index=seq, cu_seqlens=cu, loss_mask=mask,
                       lengths=tuple(lens))
