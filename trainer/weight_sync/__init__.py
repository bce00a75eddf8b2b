"""The weight sync, trainer side: the sender (sender.py: FSDP2 gather -> buckets -> every engine, by broadcast or
through shared slots on the trainer's own device), the disk fallback (disk.py), the check that the engines serve
the trained weights (verify.py), and what they share (common.py). The wire format and the engines' receivers:
engines/weight_sync/. What an engine must provide: engines.protocol.WeightSyncEndpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

from trainer.weight_sync.disk import DiskWeightSync
from trainer.weight_sync.sender import BUCKETING_MODES, TRANSPORTS, WeightSyncSender, default_master_address
from trainer.weight_sync.verify import VERIFY_TOL, VerifyResult, verify_sync, verify_tolerance

__all__ = ["BUCKETING_MODES", "TRANSPORTS", "VERIFY_TOL", "DiskWeightSync", "VerifyResult", "WeightSync",
           "WeightSyncSender", "default_master_address", "verify_sync", "verify_tolerance"]


@runtime_checkable
class WeightSync(Protocol):
    """What a training loop needs from a weight-sync sender (WeightSyncSender, DiskWeightSync): call every method
    on every trainer rank. `weight_version`: the version the engines serve after the last sync; `last_sync_s`: its
    wall time (nan before the first); `last_sync_bytes`: the tensor bytes it sent (0 before the first; a LoRA run's
    adapter-only sync sends the adapters' bytes)."""

    weight_version: int
    last_sync_s: float
    last_sync_bytes: int

    def init_group(self) -> None:
        """(Re)connect the engines; again after an engine restart."""
        ...

    def sync(self, weight_version: int | None = None,
             on_bucket: Callable[[int, int], None] | None = None) -> int:
        """Send the current weights to every engine; returns the new version (default: the last one + 1)."""
        ...

    def close(self) -> None: ...
