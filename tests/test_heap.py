"""trainer.backend.heap.frozen_heap: the loop's startup objects frozen for the block, and nothing frozen after it,
however the block ends; a heap someone else froze stays frozen."""

import gc

import pytest

from trainer.backend.heap import frozen_heap


def test_the_block_freezes_what_is_alive_and_unfreezes_after_it():
    assert gc.get_freeze_count() == 0
    with frozen_heap():
        frozen = gc.get_freeze_count()
        assert frozen > 1000  # the interpreter's and the test session's objects
        made_inside = [[] for _ in range(100)]  # tracked by the collector (lists), made after the freeze
        # They stay in the collected generations: the frozen count does not grow (it may shrink as frozen objects die).
        assert gc.get_freeze_count() <= frozen
    assert gc.get_freeze_count() == 0 and made_inside
    with pytest.raises(RuntimeError, match="boom"), frozen_heap():
        raise RuntimeError("boom")
    assert gc.get_freeze_count() == 0


def test_a_heap_frozen_by_someone_else_stays_frozen():
    gc.freeze()
    try:
        before = gc.get_freeze_count()
        with frozen_heap():
            pass
        # Leaving the block did not undo the outer freeze (an unfreeze would empty it). Frozen objects may die
        # meanwhile (another thread of the test process freeing them), so the count may shrink a little.
        assert before * 0.99 <= gc.get_freeze_count() <= before
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0
