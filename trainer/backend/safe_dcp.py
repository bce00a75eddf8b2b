"""Reading torch.distributed.checkpoint (DCP) folders without running code from them.

DCP stores two kinds of pickle: the folder's `.metadata` (which tensors live where), read by
`FileSystemReader.read_metadata` with a plain `pickle.load`, and the non-tensor entries of a state dict (an
optimizer's param_groups: lr, betas, ...), read by `DefaultLoadPlanner.load_bytes` with
`torch.load(weights_only=False)`. Either runs whatever a crafted file names (`os.system`, `exec`, ...), and a
crafted file passes the sha256 check when its recorded sum is rewritten too. So every read of a checkpoint here
goes through:

- `read_dcp_metadata`: an Unpickler whose `find_class` returns only the classes a DCP metadata holds (the
  dataclasses of `torch.distributed.checkpoint.metadata`, the file system reader's `_StorageInfo`, `torch.Size`,
  torch dtypes and layouts, pathlib paths) and refuses any other global, naming the file, before anything is
  called;
- `load_dcp`: `dcp.load` with a reader that reads `.metadata` through it and a planner that reads the non-tensor
  entries with `torch.load(weights_only=True)` (tensors and plain data only).

The allowed classes are derived from the installed torch's modules rather than spelled as strings, so the list
follows torch's own (2.11 on the GPU machine, 2.13 here).
"""

from __future__ import annotations

import copyreg
import io
import os
import pathlib
import pickle
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader


class CorruptCheckpointError(ValueError):
    """A checkpoint's file is missing, unreadable, differs from the checksum recorded when it was written, or holds
    a pickle that names code to run."""


def _allowed_globals() -> dict[tuple[str, str], Any]:
    """{(module, name): object} of every global a DCP `.metadata` pickle may name."""
    classes: list[Any] = [v for v in vars(dcp_metadata).values()  # Metadata, TensorStorageMetadata, its enums...
                          if isinstance(v, type) and v.__module__ == dcp_metadata.__name__]
    storage_info = vars(sys.modules[FileSystemReader.__module__]).get("_StorageInfo")  # where each entry lives
    if storage_info is not None:
        classes.append(storage_info)
    classes.append(torch.Size)  # chunk offsets and sizes
    # StorageMeta.checkpoint_id: the folder it was saved to, a str or a pathlib path.
    classes += [pathlib.PosixPath, pathlib.WindowsPath, pathlib.PurePosixPath, pathlib.PureWindowsPath]
    allowed = {(c.__module__, c.__qualname__): c for c in classes}
    allowed.update({("pathlib", c.__name__): c for c in classes if c.__module__.startswith("pathlib")})
    # A dtype pickles as the global `torch.<name>` (its __reduce__ returns the name); a layout through the function
    # torch registers with copyreg (torch.serialization._get_layout), which looks the name up among torch's layouts.
    allowed.update({("torch", name): v for name, v in vars(torch).items() if isinstance(v, torch.dtype)})
    get_layout = copyreg.dispatch_table[torch.layout](torch.strided)[0]
    allowed[(get_layout.__module__, get_layout.__qualname__)] = get_layout
    return allowed


_ALLOWED = _allowed_globals()


class _MetadataUnpickler(pickle.Unpickler):
    """pickle.Unpickler that resolves only the globals of `_ALLOWED`: a pickle can call nothing else (constructing
    the allowed dataclasses, torch.Size and paths runs no user code)."""

    def __init__(self, file: Any, path: Path) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise CorruptCheckpointError(
                f"{self.path}: refused to unpickle {module}.{name}: a DCP .metadata holds only "
                f"torch.distributed.checkpoint's metadata classes, torch.Size, dtypes, layouts and paths, so this "
                f"file was crafted or damaged, and nothing of it was run; load only checkpoints this trainer wrote"
            ) from None

    def persistent_load(self, pid: Any) -> Any:  # DCP never writes persistent ids
        raise CorruptCheckpointError(f"{self.path}: refused to unpickle a persistent id; a DCP .metadata has none")


def read_dcp_metadata(path: str | os.PathLike) -> dcp_metadata.Metadata:
    """The DCP metadata in the file `path` (a checkpoint's `.metadata`), read without running any code from it.
    Raises CorruptCheckpointError naming the file when it is missing, truncated, not DCP metadata, names any
    global beyond the allowed ones, or points at a shard outside its folder."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            metadata = _MetadataUnpickler(f, p).load()
    except CorruptCheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure to decode an untrusted file means a damaged file
        raise CorruptCheckpointError(f"{p}: unreadable DCP metadata ({type(e).__name__}: {e}); the checkpoint is "
                                     f"incomplete or damaged") from e
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise CorruptCheckpointError(f"{p}: holds a {type(metadata).__name__}, not DCP metadata; the checkpoint is "
                                     f"damaged")
    for info in (metadata.storage_data or {}).values():  # a shard path must be a file of this folder, not ../x
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            raise CorruptCheckpointError(f"{p}: names the shard {name!r}, not a file of its folder; the checkpoint "
                                         f"is damaged or crafted")
    return metadata


def shard_names(metadata: dcp_metadata.Metadata) -> set[str]:
    """The shard files (`__0_0.distcp`, ...) that `metadata` reads its entries from."""
    return {info.relative_path for info in (metadata.storage_data or {}).values()}


class _SafeReader(FileSystemReader):
    """FileSystemReader whose `.metadata` goes through read_dcp_metadata instead of pickle.load."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        rank = kwargs.get("rank")  # DCP asks for a rank's own `__<rank>.metadata` when there is no global one
        metadata = read_dcp_metadata(Path(self.path) / (".metadata" if rank is None else f"__{rank}.metadata"))
        if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader.read_metadata does
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _PlainDataPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner whose non-tensor entries (param_groups' numbers, tuples, strings) are read with
    torch.load(weights_only=True), refusing any other object, instead of weights_only=False."""

    def __init__(self, folder: Path) -> None:
        super().__init__()
        self.folder = folder

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            plain = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            # torch's own text (chained below) advises weights_only=False: exactly what must not happen here.
            raise CorruptCheckpointError(f"{self.folder}: the entry {read_item.storage_index.fqn} holds objects "
                                         f"other than tensors and plain data, refused and not run; the checkpoint "
                                         f"was crafted or damaged: load only checkpoints this trainer wrote") from e
        # DCP's own load_bytes unpickles with weights_only=False: hand it the plain data re-serialized, which holds
        # nothing else (rather than copying its private placement logic, which differs between torch versions).
        again = io.BytesIO()
        torch.save(plain, again)
        again.seek(0)
        super().load_bytes(read_item, again)


def load_dcp(state_dict: dict[str, Any], folder: str | os.PathLike, *, no_dist: bool = False) -> None:
    """dcp.load of `folder` into `state_dict` (in place), reading nothing that could run code. A refused or damaged
    file raises CorruptCheckpointError naming it, not DCP's CheckpointException around it (the metadata is read
    first, outside DCP, for the same reason)."""
    p = Path(folder)
    read_dcp_metadata(p / ".metadata")
    try:
        dcp.load(state_dict, checkpoint_id=str(p), storage_reader=_SafeReader(str(p)), planner=_PlainDataPlanner(p),
                 no_dist=no_dist)
    except CheckpointException as e:  # DCP wraps each rank's error: a refusal is ours to report as it is
        refused = [err for err, _ in e.failures.values() if isinstance(err, CorruptCheckpointError)]
        if refused:
            raise refused[0] from e
        raise
