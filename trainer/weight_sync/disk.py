"""The disk fallback of the weight sync: a safetensors folder per version, reloaded by every engine."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import weakref
from collections.abc import Sequence

import torch
from torch import nn

from engines.protocol import WeightSyncEndpoint
from engines.weight_sync.wire import SHM_DIR, WeightSyncError
from trainer.weight_sync.common import EngineCalls, any_rank, gathered_weights, named_weights, trainer_rank


def _shm_or_tmp() -> str:
    return SHM_DIR if os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK) else tempfile.gettempdir()


class DiskWeightSync:
    """The disk fallback, for when no weight-update group can form (a firewall, an engine of another kind): each
    sync writes a consolidated safetensors folder (full tensors, HF names, the sent dtype) atomically (a temporary
    folder renamed into place, so an engine never reads a half-written one) and asks every engine to reload it
    (SGLang's /update_weights_from_disk, vLLM's reload_weights). Same interface as WeightSyncSender.

    folder: where this run's sync folder goes (default /dev/shm when writable, else the temp dir); the engines
    must read the same path (same host, or a shared file system, as the same user). The sync folder itself is
    made by init_group with an unguessable name and mode 0700 (tempfile.mkdtemp: no other user can read the
    weights or plant a folder for the engines to load) and removed by close(), at interpreter exit, or when the
    object is collected, whichever comes first. Only the newest version is kept."""

    def __init__(self, model: nn.Module, engines: Sequence[WeightSyncEndpoint], *, folder: str | None = None,
                 dtype: torch.dtype | None = None, timeout_s: float = 300.0, weight_version: int = 0):
        self.model, self.engines = model, list(engines)
        params = named_weights(model)
        self.dtype = dtype or params[0][1].dtype
        self.base = os.path.abspath(folder or _shm_or_tmp())
        self.folder: str | None = None  # this run's folder inside `base`, made by init_group (rank 0)
        self._cleanup: weakref.finalize | None = None
        self.timeout_s, self.weight_version = timeout_s, weight_version
        self.rank = trainer_rank()
        self.device = params[0][1].device
        self.last_sync_s = float("nan")
        # every sync writes every engine-held weight, full and merged (numel of a DTensor is the full tensor's)
        self.last_sync_bytes = 0
        self._bytes = sum(p.numel() for _, p in params) * self.dtype.itemsize
        self._current: str | None = None

    def init_group(self) -> None:
        """Nothing to form; makes this run's sync folder (rank 0; once: a second call keeps it)."""
        if self.rank == 0 and self.folder is None:
            os.makedirs(self.base, exist_ok=True)
            self.folder = tempfile.mkdtemp(prefix="rlkernels-disk-sync-", dir=self.base)
            # Also on an exception or Ctrl-C that skips close(); only kill -9 can leave it (in a temp dir).
            self._cleanup = weakref.finalize(self, shutil.rmtree, self.folder, ignore_errors=True)

    def write(self, version: int) -> str | None:
        """Gather every parameter (all ranks) and, on rank 0, write folder/v{version} atomically; returns it."""
        full = dict(gathered_weights(self.model, self.dtype))
        if self.rank != 0:
            return None
        return self.write_tensors(version, full)

    def write_tensors(self, version: int, full: dict[str, torch.Tensor]) -> str:
        """Rank 0: write `full` (HF name -> full tensor) as folder/v{version}, atomically; returns the folder."""
        import json
        import uuid

        from safetensors.torch import save_file
        from transformers import PretrainedConfig

        if self.folder is None:
            raise WeightSyncError("the disk sync has no folder: call init_group() first")
        final = os.path.join(self.folder, f"v{version}")
        tmp = os.path.join(self.folder, f".tmp-v{version}-{uuid.uuid4().hex[:8]}")
        os.makedirs(tmp)
        try:
            save_file({n: t.cpu().contiguous() for n, t in full.items()}, os.path.join(tmp, "model.safetensors"),
                      metadata={"format": "pt", "weight_version": str(version)})
            config = getattr(self.model, "config", None)  # a Hugging Face model's; a plain nn.Module has none
            if isinstance(config, PretrainedConfig):
                with open(os.path.join(tmp, "config.json"), "w") as f:
                    f.write(config.to_json_string())
            else:
                with open(os.path.join(tmp, "weight_version.json"), "w") as f:
                    json.dump({"weight_version": version}, f)
            if os.path.exists(final):
                shutil.rmtree(final)
            os.rename(tmp, final)  # atomic on one file system: readers see no folder or a complete one
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final

    def sync(self, weight_version: int | None = None, on_bucket=None) -> int:
        version = self.weight_version + 1 if weight_version is None else weight_version
        t0 = time.perf_counter()
        path = self.write(version)
        error = None
        if self.rank == 0:
            try:
                self.reload(path, version)
            except BaseException as e:  # noqa: BLE001 - re-raised below, after the other ranks heard of it
                error = e
        if any_rank(error is not None, self.device):
            raise error if error is not None else WeightSyncError("the disk sync failed on trainer rank 0")
        self.weight_version = version
        self.last_sync_s = time.perf_counter() - t0
        self.last_sync_bytes = self._bytes
        return version

    def reload(self, path: str, version: int) -> None:
        """Rank 0: every engine reloads folder `path` and reports `version`; the previous version's folder goes."""
        EngineCalls(self.engines, lambda i, eng: eng.update_weights_from_disk(path, weight_version=version),
                    "update_weights_from_disk").join(self.timeout_s, "the disk weight update")
        if self._current is not None and self._current != path:
            shutil.rmtree(self._current, ignore_errors=True)
        self._current = path

    def close(self) -> None:
        """Remove this run's sync folder (every version in it); a later init_group() makes a new one."""
        if self._cleanup is not None:
            self._cleanup()  # rmtree, once
        self.folder, self._cleanup, self._current = None, None, None
