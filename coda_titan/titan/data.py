"""Data that needs no network: an embedded corpus, a tokenizer trained on it, and local files.

Datasets are added to TorchTitan's own registry (``torchtitan.hf_datasets.text_datasets.DATASETS``,
its documented extension point), so stock ``llama3`` and ``coda_llama3`` read identical batches
through TorchTitan's ``build_text_dataloader``:

* ``coda_stdlib``: the Python standard library's own sources (with their docstrings), one document
  per module, in sorted order. Present on every machine that runs Python.
* ``local``: the user's own ``.jsonl`` / ``.json`` / ``.txt`` / ``.parquet`` file or a folder of
  them, given as ``training.dataset_path``; records need a ``text`` field (txt: one paragraph per
  sample).
* TorchTitan's own names (``c4``, ``c4_test``, ...) keep working.

Tokenizer: ``model.hf_assets_path = "coda:stdlib-bpe-<vocab>"`` names a byte-level BPE tokenizer
trained with HF ``tokenizers`` on the embedded corpus. ``coda-titan train`` builds it on first use
and caches it under ``$CODA_TITAN_CACHE`` (default ``~/.cache/coda_titan``).
"""

from __future__ import annotations

import json
import os
import re
import sysconfig
from pathlib import Path

EMBEDDED_DATASET = "coda_stdlib"
LOCAL_DATASET = "local"
TOKENIZER_PREFIX = "coda:stdlib-bpe-"
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
LOCAL_SUFFIXES = {".jsonl": "json", ".json": "json", ".txt": "text", ".parquet": "parquet"}
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


class DataError(ValueError):
    """A dataset or tokenizer setting that cannot work; the message says what to change."""


def cache_dir() -> Path:
    return Path(os.environ.get("CODA_TITAN_CACHE", Path.home() / ".cache" / "coda_titan"))


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[Path]:
    root = Path(root) if root else stdlib_dir()
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        files += [Path(dirpath) / f for f in filenames if f.endswith(".py")]
    return sorted(files)


def stdlib_texts(root: Path | None = None, max_bytes: int | None = None) -> list[str]:
    texts, total = [], 0
    for path in stdlib_files(root):
        text = path.read_text(encoding="utf-8", errors="replace")
        if not text.strip():
            continue
        texts.append(text)
        total += len(text)
        if max_bytes is not None and total >= max_bytes:
            break
    return texts


def _load_stdlib(path: str):
    from datasets import Dataset

    root = Path(path) if path else None
    if root is not None and not root.is_dir():
        raise DataError(f"dataset {EMBEDDED_DATASET!r}: {root} is not a folder of Python sources")
    return Dataset.from_dict({"text": stdlib_texts(root)})


def local_files(path: str | os.PathLike) -> tuple[str, list[str]]:
    """(HF builder name, files) for a local file or folder; raises DataError if unusable."""
    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(f"dataset path {str(p)!r} does not exist: set training.dataset_path to a local file or folder")
    files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.suffix in LOCAL_SUFFIXES)
    if not files:
        raise DataError(f"no .jsonl/.json/.txt/.parquet files under {str(p)!r}")
    kinds = {LOCAL_SUFFIXES.get(f.suffix) for f in files}
    if None in kinds:
        raise DataError(f"unsupported file type {p.suffix!r}; use one of {sorted(LOCAL_SUFFIXES)}")
    if len(kinds) > 1:
        raise DataError(f"{str(p)!r} mixes file types {sorted(kinds)}; point training.dataset_path at one kind")
    return kinds.pop(), [str(f) for f in files]


def _load_local(path: str):
    from datasets import load_dataset

    if not path:
        raise DataError(f"dataset {LOCAL_DATASET!r} needs training.dataset_path (a .jsonl/.txt/.parquet file or folder)")
    builder, files = local_files(path)
    extra = {"sample_by": "paragraph"} if builder == "text" else {}
    ds = load_dataset(builder, data_files=files, split="train", **extra)
    if "text" not in ds.column_names:
        raise DataError(f"{path}: records need a 'text' field, found columns {ds.column_names}")
    return ds


def _text(sample) -> str:
    return sample["text"]


def register_datasets() -> None:
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS

    DATASETS.setdefault(
        EMBEDDED_DATASET, DatasetConfig(path=str(stdlib_dir()), loader=_load_stdlib, sample_processor=_text)
    )
    DATASETS.setdefault(LOCAL_DATASET, DatasetConfig(path="", loader=_load_local, sample_processor=_text))


def known_datasets() -> list[str]:
    from torchtitan.hf_datasets.text_datasets import DATASETS

    return sorted(DATASETS)


# --------------------------------------------------------------------------------------- tokenizer


def tokenizer_vocab(spec: str) -> int | None:
    """The vocab size named by a ``coda:stdlib-bpe-<vocab>`` spec, or None for any other path."""
    if not spec.startswith(TOKENIZER_PREFIX):
        return None
    m = re.fullmatch(re.escape(TOKENIZER_PREFIX) + r"(\d+)", spec)
    if not m or int(m.group(1)) < 260:
        raise DataError(f"model.hf_assets_path {spec!r}: write it as '{TOKENIZER_PREFIX}<vocab>' with vocab >= 260")
    return int(m.group(1))


# The first few MB of the corpus are plenty for a small BPE vocabulary and keep the first run short.
_TRAIN_BYTES = 8 << 20


def ensure_tokenizer(spec: str, log=print) -> str:
    """Resolve ``model.hf_assets_path``: build (once) and return the cached tokenizer folder."""
    vocab = tokenizer_vocab(spec)
    if vocab is None:
        if not Path(spec).exists():
            raise DataError(
                f"model.hf_assets_path {spec!r} does not exist: point it at a folder with tokenizer.json, "
                f"or use '{TOKENIZER_PREFIX}<vocab>' for the built-in tokenizer"
            )
        return spec
    out = cache_dir() / "tokenizers" / f"stdlib-bpe-{vocab}"
    if (out / "tokenizer.json").exists():
        return str(out)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    log(f"training the {vocab}-token BPE tokenizer on the Python standard library (first run only) ...")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(stdlib_texts(max_bytes=_TRAIN_BYTES), trainer=trainer)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    tok.save(str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS}))
    try:
        tmp.rename(out)
    except OSError:  # another process won the race; theirs is identical
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    log(f"tokenizer cached at {out}")
    return str(out)
