"""Seeded sampling (kernels/sampling.py): one token per row by inverse CDF, the uniform from Philox4x32-10 keyed by
(seed, position).

- Philox: the torch path's words (numpy uint64 on the CPU, int64 torch ops elsewhere) and the reference's Python
  integers equal Random123's known answers and each other; the Triton kernel calls Triton's randint4x, so equal
  tokens prove its words too.
- Both paths (Triton through the interpreter, also at the CUDA launch's one row a program) draw exactly the float64
  reference's tokens on fresh random rows: odd vocabularies (1, 2, 7, 1271, 50257), zeros, unnormalised rows, seeds
  past 2^63 and negative, positions past 2^32.
- Tokens follow the probabilities (chi-square over 200k draws with a concrete bound, and the same counts reject a
  wrong distribution), never a zero-probability token (also at u = 0 and the largest u), and a draw depends on
  (seed, position, the row) only: not on the batch around it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels import use_backend
from kernels.reference import philox4x32_reference, sample_tokens_reference
from kernels.sampling import (
    MASK32,
    U_SCALE,
    _sample_triton,
    inverse_cdf,
    philox4x32,
    philox4x32_u64,
    philox_uniform,
    sample_tokens,
    seed_words,
)

M = 0xFFFFFFFF
# Random123's kat_vectors for philox4x32_10: (counter, key, output).
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((M, M, M, M), (M, M), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]

# The 0.999 quantile of chi-square with 49 degrees of freedom (50 categories).
CHI2_49_999 = 85.35


def _numpy_words(counter, key):
    """philox4x32_u64 (the CPU path's words) on int64 torch words, back as torch tensors."""
    out = philox4x32_u64(tuple(c.numpy().astype(np.uint64) for c in counter),
                         tuple(k.numpy().astype(np.uint64) for k in key))
    return tuple(torch.from_numpy(o.astype(np.int64)) for o in out)


PHILOX_WORDS = {"torch-int64": philox4x32, "numpy-uint64": _numpy_words}


@pytest.mark.parametrize("impl", list(PHILOX_WORDS))
def test_philox_equals_random123_known_answers(impl):
    for counter, key, expected in KNOWN_ANSWERS:
        assert philox4x32_reference(counter, key) == expected
        words = PHILOX_WORDS[impl](tuple(torch.tensor([c]) for c in counter), tuple(torch.tensor([k]) for k in key))
        assert tuple(int(w) for w in words) == expected


@pytest.mark.parametrize("impl", list(PHILOX_WORDS))
def test_philox_equals_the_reference_on_random_words(impl):
    g = torch.Generator().manual_seed(3)
    words = torch.randint(0, 2**32, (6, 300), generator=g)
    words[:, :4] = torch.tensor([0, 1, M, M - 1])[None, :]  # the edges of the 32-bit range
    out = PHILOX_WORDS[impl](tuple(words[:4]), (words[4], words[5]))
    for j in range(words.shape[1]):
        c = tuple(int(x) for x in words[:4, j])
        k = (int(words[4, j]), int(words[5, j]))
        assert tuple(int(o[j]) for o in out) == philox4x32_reference(c, k)


def test_cpu_uniforms_equal_the_int64_torch_words():
    """philox_uniform on the CPU (numpy words) gives the bits the int64 torch words give, positions past 2^32."""
    g = torch.Generator().manual_seed(11)
    key = torch.randint(0, 2**32, (500, 2), generator=g)
    position = torch.cat([torch.randint(0, 2**62, (250,), generator=g), torch.randint(0, 4096, (250,), generator=g)])
    zero = torch.zeros_like(position)
    w0, w1, _, _ = philox4x32((position & MASK32, (position >> 32) & MASK32, zero, zero), (key[:, 0], key[:, 1]))
    expected = (((w0 >> 12) << 32) | w1).to(torch.float64) * U_SCALE
    u = philox_uniform(key, position)
    assert u.dtype == torch.float64 and torch.equal(u, expected)
    assert 0.0 <= float(u.min()) and float(u.max()) <= 1 - 2**-52


def random_case(g: torch.Generator, V: int) -> tuple[torch.Tensor, list[int], list[int]]:
    """B in 1..9 rows of V probabilities (peaked or flat, a third of them zeroed where small, some unnormalised),
    seeds over the whole 64-bit range and beyond (negative, >= 2^64), positions up to 2^40."""
    B = int(torch.randint(1, 10, (), generator=g))
    scale = float(torch.rand((), generator=g)) * 8
    probs = torch.softmax(torch.randn(B, V, generator=g) * scale, -1)
    if V > 1:
        probs[torch.rand(B, V, generator=g) < 0.33] = 0.0
        probs[:, 0] = torch.where(probs.sum(-1) == 0, 1.0, probs[:, 0])  # at least one token per row
    probs *= torch.rand(B, 1, generator=g) * 3 + 0.1
    seeds = [int(s) for s in torch.randint(-(2**63), 2**63 - 1, (B,), generator=g)]
    seeds[0] += 2**64 * int(torch.randint(0, 2, (), generator=g))  # seeds are taken mod 2^64
    positions = [int(p) for p in torch.randint(0, 2**40, (B,), generator=g)]
    return probs, seeds, positions


def as_inputs(seeds: list[int], positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor([seed_words(s) for s in seeds]).view(-1, 2), torch.tensor(positions)


@pytest.mark.parametrize("V", [1, 2, 7, 1271, 50257])
def test_sample_tokens_equals_the_reference(backend, V):
    g = torch.Generator().manual_seed(V)
    for trial in range(6 if V < 50000 else 2):
        probs, seeds, positions = random_case(g, V)
        key, position = as_inputs(seeds, positions)
        expected = sample_tokens_reference(probs, seeds, positions)
        assert sample_tokens(probs, key, position).tolist() == expected, (trial, seeds, positions)
        if backend == "triton" and trial < 2:  # the CUDA launch: one row a program
            assert _sample_triton(probs, key, position, rows_per_program=1).tolist() == expected
        assert all(probs[i, t] > 0 for i, t in enumerate(expected))


def test_seed_words_take_the_seed_mod_2_64():
    assert seed_words(0) == (0, 0) and seed_words(2**64 + 5) == (5, 0) and seed_words(-1) == (M, M)
    assert seed_words(0x123456789ABCDEF0) == (0x9ABCDEF0, 0x12345678)


def test_zero_probability_tokens_are_never_drawn_even_at_the_extreme_uniforms():
    # u = 0 stops at the first token of positive probability, the largest u (1 - 2^-52) at the last one, and between
    # them every draw lands on a token of positive probability.
    probs = torch.tensor([[0.0, 0.0, 0.3, 0.0, 0.5, 0.2, 0.0, 0.0], [0.0, 1e-30, 0.0, 0.0, 0.0, 0.0, 0.0, 1e-30]])
    lo, hi = torch.zeros(2, dtype=torch.float64), torch.full((2,), 1 - U_SCALE, dtype=torch.float64)
    assert inverse_cdf(probs, lo).tolist() == [2, 1] and inverse_cdf(probs, hi).tolist() == [5, 7]
    key, position = as_inputs([11, 12] * 1000, list(range(2000)))
    drawn = sample_tokens(probs.repeat(1000, 1), key, position)  # the process default: Triton when interpreted
    assert set(drawn[0::2].tolist()) == {2, 4, 5} and set(drawn[1::2].tolist()) == {1, 7}


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() / probs.double().sum() * counts.sum()
    return float(((counts.double() - expected) ** 2 / expected).sum())


def test_draws_follow_the_probabilities():
    # 200k draws of one row (one seed, positions 0..N-1) from p = softmax(z / 0.7) over 50 tokens: Pearson's
    # chi-square stays below the 0.999 quantile for 49 degrees of freedom; the same counts against softmax(z) (the
    # wrong temperature) are far above it, so the bound has power.
    g = torch.Generator().manual_seed(5)
    z = torch.randn(50, generator=g) * 1.5
    p = torch.softmax(z / 0.7, -1)
    n = 200_000
    key, position = as_inputs([987654321] * n, list(range(n)))
    with use_backend("torch"):
        drawn = sample_tokens(p.expand(n, -1).contiguous(), key, position)
    counts = torch.bincount(drawn, minlength=50)
    assert chi_square(counts, p) < CHI2_49_999
    assert chi_square(counts, torch.softmax(z, -1)) > 10 * CHI2_49_999
    # A neighbouring seed is an independent stream with the same distribution: the two draws at a position agree
    # with probability sum(p^2) (here 0.25; the mean of 200k agreements has a standard deviation of 0.001).
    key2, _ = as_inputs([987654322] * n, [])
    with use_backend("torch"):
        other = sample_tokens(p.expand(n, -1).contiguous(), key2, position)
    assert chi_square(torch.bincount(other, minlength=50), p) < CHI2_49_999
    assert abs(float((other == drawn).double().mean() - (p.double() ** 2).sum())) < 0.005


def test_a_draw_depends_on_its_seed_position_and_row_only(backend):
    # Each row alone, then in batches of other rows, permuted, duplicated: the same token every time.
    g = torch.Generator().manual_seed(8)
    probs, seeds, positions = random_case(g, 1271)
    while probs.shape[0] < 4:
        probs, seeds, positions = random_case(g, 1271)
    key, position = as_inputs(seeds, positions)
    alone = [int(sample_tokens(probs[i:i + 1], key[i:i + 1], position[i:i + 1])[0]) for i in range(len(seeds))]
    perm = torch.randperm(len(seeds), generator=g)
    twice = torch.cat([perm, perm[:2]])
    assert sample_tokens(probs, key, position).tolist() == alone
    assert sample_tokens(probs[twice].contiguous(), key[twice].contiguous(), position[twice]).tolist() == \
        [alone[i] for i in twice.tolist()]
    # The uniform changes with the position and with the seed.
    u = philox_uniform(key[:1].expand(1000, 2).contiguous(), torch.arange(1000) + positions[0])
    assert u.unique().numel() == 1000 and 0.45 < float(u.mean()) < 0.55


def test_bad_inputs_name_the_fix():
    key, position = as_inputs([1, 2], [0, 1])
    with pytest.raises(ValueError, match="float \\[B, V\\]"):
        sample_tokens(torch.ones(2, 3, dtype=torch.long), key, position)
    with pytest.raises(ValueError, match="seed_words"):
        sample_tokens(torch.ones(3, 4), key, position)
    with pytest.raises(ValueError, match="contiguous"):
        sample_tokens(torch.ones(4, 2).T, key, position)
