"""SFT's data order: each epoch a fresh seeded permutation, resumable from a data position."""

import numpy as np

from trainer.sft import _batch_indices


def _reference(n: int, position: int, batch_size: int, seed: int) -> list[int]:
    # the definition: sample p of the stream is element p % n of epoch p // n's permutation (seed + epoch)
    stream = range(position, position + batch_size)
    return [int(np.random.default_rng(seed + p // n).permutation(n)[p % n]) for p in stream]


def test_batches_follow_one_permutation_per_epoch_from_any_position():
    rng = np.random.default_rng(7)
    for _ in range(200):
        n, pos, b, seed = (int(rng.integers(lo, hi)) for lo, hi in ((1, 40), (0, 150), (1, 90), (0, 9)))
        assert _batch_indices(n, pos, b, seed) == _reference(n, pos, b, seed)


def test_an_epoch_visits_every_example_once_and_resuming_continues_the_stream():
    n, b = 23, 5
    stream = [i for pos in range(0, 4 * n, b) for i in _batch_indices(n, pos, b, seed=3)]
    for e in range(3):
        assert sorted(stream[e * n:(e + 1) * n]) == list(range(n))
    assert stream[:n] != stream[n:2 * n]  # a new order each epoch
    assert _batch_indices(n, 17, 9, seed=3) == stream[17:26]
