"""Read the logged history of a W&B run directory offline (no network, no wandb service).

A W&B run writes ``run-<id>.wandb``: a 7-byte header (":W&B", magic 0xBEE1, version) then 32 KiB
blocks of LevelDB-log records (crc32 u32, length u16, type u8: 1 full, 2 first, 3 middle, 4 last),
each whole record a serialized ``wandb_internal_pb2.Record``. This reader returns the ``history``
records as dicts, e.g. to check that an offline run holds the loss series.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path


_HEADER = 7  # file header
_REC_HEADER = 7  # per-record header: crc32 u32, length u16, type u8
_BLOCK = 32 * 1024
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _records(data: bytes):
    if data[:4] != b":W&B":
        raise ValueError("not a W&B run file (bad header)")
    pos, pending = _HEADER, b""
    while pos + _REC_HEADER <= len(data):
        left_in_block = _BLOCK - (pos % _BLOCK)
        if left_in_block < _REC_HEADER:  # block trailer padding
            pos += left_in_block
            continue
        _crc, length, kind = struct.unpack_from("<IHB", data, pos)
        pos += _REC_HEADER
        chunk = data[pos : pos + length]
        pos += length
        if kind == _FULL:
            yield chunk
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            yield pending + chunk
            pending = b""
        elif kind == 0 and length == 0:  # zero padding at the end of a file still being written
            break


def read_history(run_dir: str | Path) -> list[dict]:
    """History rows (one dict per ``wandb.log`` call) of a W&B run directory or .wandb file."""
    from wandb.proto import wandb_internal_pb2

    path = Path(run_dir)
    if path.is_dir():
        files = sorted(path.glob("*.wandb"))
        if not files:
            raise FileNotFoundError(f"no .wandb file in {path}")
        path = files[0]
    rows = []
    for raw in _records(path.read_bytes()):
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(raw)
        if rec.WhichOneof("record_type") == "history":
            rows.append(
                {(it.key or "/".join(it.nested_key)): json.loads(it.value_json) for it in rec.history.item}
            )
    return rows
