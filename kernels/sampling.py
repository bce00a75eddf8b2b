"""`sample_tokens(probs, key, position)`: one token per row of probs [B, V], drawn by inverse CDF with a uniform from
Philox keyed by the row's seed and counted by the position the token takes.

Math. Row b draws u_b in [0, 1) and takes the first token whose cumulative probability passes u_b of the row's mass:

    C_v = p_0 + ... + p_v (float64),   token = #{v : C_v <= u_b * C_{V-1}}   so   P(token = v) = p_v / sum(p)

(the token is v iff C_{v-1} <= u C < C_v, an interval of length p_v / C). A token of probability 0 is never drawn:
its C_v equals C_{v-1}, so the count passes it or stops before it. u <= 1 - 2^-52, so u * C_{V-1} rounds to at
least one float64 spacing below C_{V-1} and the count is at most V - 1 (a row of mass 0, or NaN, gives token 0: the
engine reads the NaN in its log-probs and raises). float64 sums make the boundaries exact to ~1e-16 of the mass; the
two paths sum in different orders, so they could differ only where u * C falls within that rounding of a boundary.

Randomness: Philox4x32-10 (Salmon et al., SC'11; Random123's known answers are in the tests), key = the row's 64-bit
seed as two 32-bit words `key` [B, 2], counter = (position mod 2^32, position // 2^32, 0, 0): the first two output
words give the 52 bits of u = n * 2^-52. This is Triton's `tl.randint4x(seed, position)`, so the Triton kernel calls
it and the torch path computes the same words: numpy uint64 arithmetic on the CPU, int64 torch ops elsewhere (16-bit
halves, no overflow). A token therefore depends on (seed, position, the row's probabilities) only: not on the other
rows of the batch, their number or order, or how many tokens were drawn before (no generator state).

Cost: one uniform per row (B Philox calls, not B x V as an exponential race needs) and one pass over each row for the
mass and one for the count. On CUDA one kernel (one program per row); on the CPU a float64 cumsum and searchsorted.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from kernels.device import backend_for

MASK32 = 0xFFFFFFFF
# Philox4x32's multipliers and Weyl key increments (Random123's PHILOX_M4x32_0/1, PHILOX_W32_0/1).
PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85
PHILOX_ROUNDS = 10
U_SCALE = 2.0 ** -52  # u = n * 2^-52, n the top 20 bits of word 0 then all 32 of word 1


def seed_words(seed: int) -> tuple[int, int]:
    """A seed (any Python int; taken mod 2^64) -> Philox's key words (low, high 32 bits), each exact in float64 and
    int64 (so the host can ship them with its other step inputs)."""
    s = seed % (1 << 64)
    return s & MASK32, s >> 32


# ------------------------------------------------------------------------------------------------------ Triton
@triton.jit
def _sample_kernel(p_ptr, key_ptr, pos_ptr, out_ptr, B, V, stride_row, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    # ROWS rows a program: u [ROWS] from Philox(seed, position), then two passes over the rows' V probabilities in
    # [ROWS, BLOCK] tiles (float64): the mass C, then the count of prefix sums <= u * C. Both passes carry the prefix
    # from tile to tile as the tile's last prefix sum (its max: p >= 0, so the sums never decrease), so the count
    # sees one non-decreasing sequence ending at exactly the mass the target was taken from: the count stays below
    # V and never stops on a zero. int64 row offsets: B * V passes 2^31 at B = 16k rows of Qwen2's 151936.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    live = rows < B
    lo = tl.load(key_ptr + 2 * rows, mask=live, other=0).to(tl.uint64)
    hi = tl.load(key_ptr + 2 * rows + 1, mask=live, other=0).to(tl.uint64)
    w0, w1, _, _ = tl.randint4x((hi << 32) | lo, tl.load(pos_ptr + rows, mask=live, other=0))
    n = ((w0 >> 12).to(tl.uint64) << 32) | w1.to(tl.uint64)  # [ROWS] 52 random bits
    u = n.to(tl.float64) * 2.220446049250313e-16  # 2^-52
    base = p_ptr + rows[:, None] * stride_row  # [ROWS, 1]
    offs = tl.arange(0, BLOCK)[None, :]  # [1, BLOCK]
    mass = tl.zeros((ROWS,), dtype=tl.float64)
    for start in range(0, V, BLOCK):
        p = tl.load(base + start + offs, mask=live[:, None] & (start + offs < V), other=0.0).to(tl.float64)
        mass = tl.max(mass[:, None] + tl.cumsum(p, axis=1), axis=1)
    target = u * mass  # [ROWS]
    carry = tl.zeros((ROWS,), dtype=tl.float64)
    count = tl.zeros((ROWS,), dtype=tl.int64)
    for start in range(0, V, BLOCK):
        inb = live[:, None] & (start + offs < V)  # [ROWS, BLOCK]
        p = tl.load(base + start + offs, mask=inb, other=0.0).to(tl.float64)
        cdf = carry[:, None] + tl.cumsum(p, axis=1)
        count += tl.sum(((cdf <= target[:, None]) & inb).to(tl.int64), axis=1)
        carry = tl.max(cdf, axis=1)
    tl.store(out_ptr + rows, count, mask=live)


def _launch_config(B: int, V: int, device: torch.device) -> tuple[int, int, int]:
    """(ROWS, BLOCK, num_warps). On CUDA one row a program (B programs stream their rows in parallel) and up to 4096
    float64 values a tile (16 a thread at 8 warps). Under the interpreter (CPU) every row in one program: the
    interpreter's cost is per program and per op, not per element."""
    block = min(triton.next_power_of_2(V), 4096)
    rows = 1 if device.type == "cuda" else min(triton.next_power_of_2(max(B, 1)), 64)
    return rows, block, 8 if block >= 2048 else 4


def _sample_triton(probs: torch.Tensor, key: torch.Tensor, position: torch.Tensor,
                   rows_per_program: int | None = None) -> torch.Tensor:
    B, V = probs.shape
    out = torch.empty(B, dtype=torch.int64, device=probs.device)
    if B:
        rows, block, warps = _launch_config(B, V, probs.device)
        rows = rows_per_program or rows
        _sample_kernel[(triton.cdiv(B, rows),)](probs, key, position, out, B, V, probs.stride(0), ROWS=rows,
                                                BLOCK=block, num_warps=warps)
    return out


# ------------------------------------------------------------------------------------------------------- torch
def _mulhilo(a: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """a [B] int64 in [0, 2^32) times the 32-bit constant m -> (high, low) 32-bit words of the 64-bit product, in
    int64 without overflow: a = ah 2^16 + al, so a m = x 2^16 + y with x = ah m, y = al m < 2^48."""
    x, y = (a >> 16) * m, (a & 0xFFFF) * m
    return (x + (y >> 16)) >> 16, (((x & 0xFFFF) << 16) + y) & MASK32


def philox4x32(counter: tuple[torch.Tensor, ...], key: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Philox4x32-10 on int64 tensors holding 32-bit words: counter (c0, c1, c2, c3), key (k0, k1), all [B] ->
    the four output words [B] (Random123's philox4x32_R(10, ...), Triton's randint4x)."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(PHILOX_ROUNDS):
        hi0, lo0 = _mulhilo(c0, PHILOX_M0)
        hi1, lo1 = _mulhilo(c2, PHILOX_M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + PHILOX_W0) & MASK32, (k1 + PHILOX_W1) & MASK32
    return c0, c1, c2, c3


def philox4x32_u64(counter: tuple[np.ndarray, ...], key: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, ...]:
    """Philox4x32-10 on numpy uint64 arrays holding 32-bit words (the words of `philox4x32`). A 32 x 32-bit product
    fits a uint64 exactly, so each multiply is one op (the int64 torch path needs six for its 16-bit halves)."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    m0, m1, w0, w1 = (np.uint64(x) for x in (PHILOX_M0, PHILOX_M1, PHILOX_W0, PHILOX_W1))
    mask, s32 = np.uint64(MASK32), np.uint64(32)
    for _ in range(PHILOX_ROUNDS):
        p0, p1 = c0 * m0, c2 * m1
        c0, c1, c2, c3 = (p1 >> s32) ^ c1 ^ k0, p1 & mask, (p0 >> s32) ^ c3 ^ k1, p0 & mask
        k0, k1 = (k0 + w0) & mask, (k1 + w1) & mask
    return c0, c1, c2, c3


def philox_uniform(key: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """key [B, 2] int64 words, position [B] int64 -> u [B] float64 in [0, 1 - 2^-52], the kernel's uniform.

    On the CPU the words come from numpy (`philox4x32_u64`): ~40 array ops of ~1 us against the int64 torch path's
    ~110 ops of ~5 us, 0.08 against 0.63 ms for the 128 rows of an agent step's decode (one call per decode step), the
    same bits. Other devices run the torch words (`philox4x32`) where the tensors are."""
    if key.device.type == "cpu":
        pos = position.numpy().astype(np.uint64)  # two's complement: the low 64 bits, as the int64 path's masks
        k = key.numpy().astype(np.uint64)
        zero = np.zeros_like(pos)
        w0, w1, _, _ = philox4x32_u64((pos & np.uint64(MASK32), pos >> np.uint64(32), zero, zero), (k[:, 0], k[:, 1]))
        n = ((w0 >> np.uint64(12)) << np.uint64(32)) | w1  # < 2^52: exact in float64
        return torch.from_numpy(n.astype(np.float64) * U_SCALE)
    zero = torch.zeros_like(position)
    w0, w1, _, _ = philox4x32((position & MASK32, (position >> 32) & MASK32, zero, zero), (key[:, 0], key[:, 1]))
    return (((w0 >> 12) << 32) | w1).to(torch.float64) * U_SCALE


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs [B, V], u [B] float64 in [0, 1 - 2^-52] -> [B] int64: #{v : C_v <= u * C_{V-1}}, C the float64 prefix
    sums of each row (the torch path's draw, given its uniforms)."""
    cdf = probs.to(torch.float64).cumsum(-1)  # [B, V]
    target = u * cdf[:, -1]  # [B]
    return torch.searchsorted(cdf, target[:, None], right=True)[:, 0]


def _sample_torch(probs: torch.Tensor, key: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    return inverse_cdf(probs, philox_uniform(key, position))


# ------------------------------------------------------------------------------------------------------ public
def sample_tokens(probs: torch.Tensor, key: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """Token [B] int64 drawn from each row of probs [B, V] (non-negative, any positive mass: rows are normalised by
    their sum), with the uniform of Philox(key [B, 2] int64 seed words (seed_words), position [B] int64): the same
    (key, position, row) always draws the same token, on either path."""
    if probs.dim() != 2 or probs.shape[1] == 0 or not probs.dtype.is_floating_point:
        raise ValueError(f"probs must be a float [B, V] tensor with V >= 1, got {probs.dtype} "
                         f"{tuple(probs.shape)}; pass one row of probabilities per sampled token")
    B = probs.shape[0]
    if key.shape != (B, 2) or key.dtype != torch.int64 or position.shape != (B,) or position.dtype != torch.int64:
        raise ValueError(f"key must be int64 [B, 2] (seed_words) and position int64 [B] for B = {B} rows, got key "
                         f"{key.dtype} {tuple(key.shape)} and position {position.dtype} {tuple(position.shape)}")
    if not (probs.device == key.device == position.device):
        raise ValueError(f"probs, key and position must be on one device, got {probs.device}, {key.device}, "
                         f"{position.device}; move them with the step's other inputs")
    if probs.stride(-1) != 1 or not (key.is_contiguous() and position.is_contiguous()):
        raise ValueError("probs needs contiguous rows and key/position must be contiguous; call .contiguous()")
    if backend_for(probs) == "triton":
        return _sample_triton(probs, key, position)
    return _sample_torch(probs, key, position)
