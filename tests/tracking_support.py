"""Readers for what the tracking backends wrote, for tests: an offline W&B run's .wandb file and TensorBoard text.

wandb has no Python reader for its run files (its core, which writes them, is a Go binary). The file is LevelDB's log
format behind a 7-byte header: ":W&B", two magic bytes, a version byte; then 32 KiB blocks of records, each a 7-byte
header (checksum: 4 bytes, length: 2 bytes, type: 1 byte, little-endian) and its data; a record too long for its
block is split FIRST / MIDDLE... / LAST; a block tail shorter than a header is zero padding. Unlike LevelDB (masked
crc32c), W&B's checksum is the plain IEEE crc32 (zlib's) of the type byte and the data: checked here on every record.
Each whole record is a `wandb.proto.wandb_internal_pb2.Record`.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path
from typing import Any

_HEADER = b":W&B\xe1\xbe\x00"  # ident, magic 0xBEE1 (little-endian), version 0
_BLOCK = 32 * 1024
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def read_wandb_records(path: str | Path) -> list[Any]:
    """Every record of a .wandb run file, decoded with wandb's own protobuf."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:len(_HEADER)] == _HEADER, f"{path}: header {data[:7]!r} is not W&B's {_HEADER!r}"
    records, parts, pos = [], [], len(_HEADER)
    while pos < len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:  # padding at the end of a block
            pos += left
            continue
        crc, length, kind = struct.unpack_from("<IHB", data, pos)
        if crc == length == kind == 0:  # a zeroed tail (a file preallocated or cut mid-block)
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + length]
        assert len(chunk) == length, f"{path}: record at byte {pos} is cut short"
        assert zlib.crc32(bytes([kind]) + chunk) == crc, f"{path}: bad checksum of the record at byte {pos}"
        pos += 7 + length
        if kind in (_FULL, _FIRST):
            parts = [chunk]
        else:
            parts.append(chunk)
        if kind in (_FULL, _LAST):
            record = pb.Record()
            record.ParseFromString(b"".join(parts))
            records.append(record)
    return records


def _key(item: Any) -> str:
    # a flat key, or the path of a nested one (a table's fields: "samples/_type")
    return "/".join(item.nested_key) if item.nested_key else item.key


def wandb_run_file(run_dir: str | Path) -> Path:
    """The one offline run file under <run_dir>/wandb."""
    files = sorted(Path(run_dir).glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, f"expected one offline W&B run under {run_dir}/wandb, found {files}"
    return files[0]


def wandb_history(records: list[Any]) -> list[dict[str, Any]]:
    """The history rows (one per step), {key: value} with the values decoded from JSON."""
    return [{_key(i): json.loads(i.value_json) for i in r.history.item} for r in records
            if r.WhichOneof("record_type") == "history"]


def wandb_config(records: list[Any]) -> dict[str, Any]:
    """The run's config: the run record's, then any later config updates, W&B's own "_wandb" key left out."""
    config: dict[str, Any] = {}
    for r in records:
        kind = r.WhichOneof("record_type")
        updates = r.run.config.update if kind == "run" else r.config.update if kind == "config" else []
        config.update({_key(i): json.loads(i.value_json) for i in updates})
    config.pop("_wandb", None)
    return config


def wandb_run_info(records: list[Any]) -> dict[str, str]:
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    return {"project": run.project, "name": run.display_name, "group": run.run_group}


def read_tensorboard_text(log_dir: str | Path) -> dict[str, list[tuple[int, str]]]:
    """Every text summary (add_text) in the event files of `log_dir`, {tag: [(step, text), ...]}."""
    from tensorboard.backend.event_processing import event_accumulator as ea

    acc = ea.EventAccumulator(str(log_dir), size_guidance={ea.TENSORS: 0})
    acc.Reload()
    # add_text("name", ...) stores the tag "name/text_summary"
    return {tag.removesuffix("/text_summary"): [(e.step, e.tensor_proto.string_val[0].decode()) for e in
                                                acc.Tensors(tag)] for tag in acc.Tags()["tensors"]}
