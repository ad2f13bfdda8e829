"""Checks of a parsed JobConfig before anything is built: the training numbers, the output and
checkpoint folders, a local dataset's first record, the tokenizer against the model's vocabulary,
and the checkpoint a run would resume from. Each problem is one ``PreflightError`` line that names
it and the fix; ``notes`` are lines worth saying (which step a run resumes from, and why)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from .data import LOCAL_SUFFIXES, DataError, local_files


class PreflightError(ValueError):
    """A config that cannot work; the message is one line saying what to change."""


def check_training(config) -> None:
    t = config.training
    for key, low in (("seq_len", 1), ("local_batch_size", 1), ("steps", 1)):
        value = getattr(t, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise PreflightError(f"training.{key} = {value!r} is not allowed: use an integer >= {low}")


def _writable_folder(path: Path, what: str, key: str) -> None:
    path = Path(os.path.abspath(path))  # (normalized: "out/../x" with no "out" yet is "x")
    if path.exists() and not path.is_dir():
        raise PreflightError(f"{what} {str(path)!r} is a file, not a folder: set {key} to a folder")
    probe = path
    while not probe.exists():
        probe = probe.parent
    if not os.access(probe, os.W_OK | os.X_OK):
        raise PreflightError(f"{what} {str(path)!r} cannot be written ({str(probe)!r} is not writable): set {key}")


def check_folders(config) -> None:
    dump = Path(config.job.dump_folder)
    _writable_folder(dump, "job.dump_folder", "job.dump_folder")
    if config.checkpoint.enable:
        _writable_folder(dump / config.checkpoint.folder, "the checkpoint folder", "checkpoint.folder")


def first_record_text(path: str) -> None:
    """Raise DataError unless the first record of the local dataset at ``path`` has a non-empty text."""
    kind, files = local_files(path)
    first = files[0]
    if kind == "parquet":
        import pyarrow.parquet as pq

        meta = pq.ParquetFile(first)
        if "text" not in meta.schema_arrow.names:
            raise DataError(f"{first}: records need a 'text' field, found columns {meta.schema_arrow.names}")
        if meta.metadata.num_rows == 0:
            raise DataError(f"{first} holds no records")
        return
    with open(first, encoding="utf-8", errors="replace") as f:
        head = f.read(1 << 20)
    if not head.strip():
        raise DataError(f"{first} is empty: a dataset needs at least one record")
    if kind == "text":
        return
    record = head.lstrip()
    try:
        if record.startswith("["):  # one JSON array of records
            with open(first, encoding="utf-8") as f:
                first_obj = json.load(f)[0]
        else:  # one JSON object per line
            first_obj = json.loads(record.splitlines()[0])
    except (ValueError, IndexError) as e:
        raise DataError(f"{first}: the first record is not JSON ({e}); use one JSON object per line") from None
    if not isinstance(first_obj, dict) or "text" not in first_obj:
        found = sorted(first_obj) if isinstance(first_obj, dict) else type(first_obj).__name__
        raise DataError(f"{first}: records need a 'text' field, the first has {found}")


def check_dataset(config, local_name: str) -> None:
    path = config.training.dataset_path
    if config.training.dataset.lower() != local_name:
        if path and not Path(path).exists():
            raise PreflightError(f"training.dataset_path {path!r} does not exist; fix it or remove it")
        return
    if not path:
        raise PreflightError(
            f"training.dataset = {local_name!r} needs training.dataset_path: a {'/'.join(sorted(LOCAL_SUFFIXES))} "
            "file or a folder of them"
        )
    try:
        first_record_text(path)
    except DataError as e:
        raise PreflightError(str(e)) from None


def check_tokenizer(tokenizer_dir: str, vocab_size: int) -> None:
    """The tokenizer's vocabulary must fit the model's embedding (``vocab_size`` rows)."""
    path = Path(tokenizer_dir) / "tokenizer.json"
    if not path.is_file():
        return
    from tokenizers import Tokenizer

    n = Tokenizer.from_file(str(path)).get_vocab_size()
    if n > vocab_size:
        raise PreflightError(
            f"the tokenizer in {tokenizer_dir!r} has {n} tokens but the model's vocab_size is {vocab_size}: "
            "use a flavor with a large enough vocabulary or a smaller tokenizer"
        )


def _steps(folder: Path) -> list[tuple[int, Path]]:
    found = [(int(m.group(1)), p) for p in folder.iterdir() if p.is_dir() and (m := re.fullmatch(r"step-(\d+)", p.name))]
    return sorted(found)


def check_shards(step_dir: Path) -> None:
    """Every byte range the DCP metadata names exists in its file (a truncated shard is found here,
    not as a bare EOFError deep inside the load)."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        meta = FileSystemReader(str(step_dir)).read_metadata()
    except Exception as e:  # noqa: BLE001 - any unreadable metadata is a damaged checkpoint
        raise PreflightError(f"checkpoint {str(step_dir)!r} has unreadable metadata ({type(e).__name__}): "
                             "delete that step folder to resume from the one before") from None
    need: dict[str, int] = {}
    for info in (meta.storage_data or {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for rel, size in need.items():
        f = step_dir / rel
        have = f.stat().st_size if f.exists() else -1
        if have < size:
            state = "missing" if have < 0 else f"{have} bytes, its metadata needs {size}"
            raise PreflightError(f"checkpoint {str(step_dir)!r} is damaged ({rel}: {state}): "
                                 "delete that step folder to resume from the one before")


def check_checkpoint(config) -> list[str]:
    """Notes on the checkpoint this run resumes from; PreflightError if it cannot be read."""
    ck = config.checkpoint
    if not ck.enable:
        return []
    folder = Path(config.job.dump_folder) / ck.folder
    if not folder.is_dir() or not (steps := _steps(folder)):
        if ck.initial_load_path:
            path = Path(ck.initial_load_path)
            if not (path / ".metadata").is_file():
                raise PreflightError(f"checkpoint.initial_load_path {str(path)!r} is no checkpoint (no .metadata)")
            check_shards(path)
        return []
    complete = [(n, p) for n, p in steps if (p / ".metadata").is_file()]
    notes = []
    newest = steps[-1][0]
    if not complete:
        return [f"checkpoint folder {str(folder)!r} has no complete step (no .metadata: interrupted saves); "
                "training starts from scratch"]
    step, path = complete[-1]
    if step != newest:
        notes.append(f"checkpoint step-{newest} in {str(folder)!r} has no .metadata (an interrupted save): "
                     f"resuming from step-{step}")
    else:
        notes.append(f"resuming from checkpoint step-{step} in {str(folder)!r}")
    check_shards(path)
    if "dataloader" not in (ck.exclude_from_loading or []):
        check_data_parallel_degree(path, config)
    return notes


def data_parallel_degree(config) -> int:
    """This run's data-parallel degree (replicate x shard), as TorchTitan derives it from the launch."""
    p = config.parallelism
    world = int(os.environ.get("WORLD_SIZE", "1"))
    other = p.tensor_parallel_degree * p.pipeline_parallel_degree * p.context_parallel_degree
    shard = p.data_parallel_shard_degree
    if shard == -1:
        shard = max(world // (other * max(p.data_parallel_replicate_degree, 1)), 1)
    return max(p.data_parallel_replicate_degree, 1) * shard


def check_data_parallel_degree(step_dir: Path, config) -> None:
    """TorchTitan keeps one dataloader position per data-parallel rank and cannot reshard them: a
    checkpoint saved with another degree fails deep in the load. Say it first, with the way out."""
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    saved = sum(1 for k in keys if re.fullmatch(r"dataloader\.dp_rank_\d+", k))
    now = data_parallel_degree(config)
    if saved and saved != now:
        raise PreflightError(
            f"checkpoint {str(step_dir)!r} was saved by {saved} data-parallel ranks and this run has {now}: "
            "TorchTitan cannot move the data loaders' positions between them; resume with "
            "--checkpoint.exclude_from_loading dataloader (model and optimizer resume, the data order restarts) "
            f"or with {saved} ranks")
