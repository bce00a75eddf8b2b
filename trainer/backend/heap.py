"""The Python heap a training loop starts with, kept out of the cyclic garbage collector's full passes.

By the first step a run holds ~460k Python objects (transformers' and torch's modules, the model, the engine), and
every few steps CPython's oldest-generation collection walks all of them: 195 ms a pass, every ~7 steps of the demo's
RL loop (the sync run's generate time jumped from 0.135 to 0.33 s on those steps: 9 % of its loop), measured with
gc.callbacks. gc.freeze moves the objects alive now into a permanent generation that no collection scans (what
CPython's docs advise before fork, and what inference servers do after loading a model); objects made later are
collected as before, and unfreeze hands the frozen ones back to the collector when the loop ends, so a process that
runs several loops (tests, sft+rl) reclaims their cycles in the end.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Freeze the objects alive now for the block (a training loop); unfreeze them after it.

    Freezing is process-wide: where something else already froze the heap (a process that froze for its life, an
    enclosing loop), the block leaves it as it is, so leaving the block does not undo their freeze. No collection
    runs first (0.2 s): cyclic garbage alive at the start stays until the end (66 objects, no tensor, after building
    the demo's engine)."""
    if gc.get_freeze_count() > 0:
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
