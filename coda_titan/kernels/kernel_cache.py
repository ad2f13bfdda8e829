"""Where the ``cute`` backend's compiled kernels and autotuning winners live on disk, and why a kernel compiled
from other sources is never handed back.

quack keeps two disk caches under ``$QUACK_CACHE_DIR``: autotuning winners (``quack.autotuner``, keyed by shape,
dtype and the candidate configs; a choice among kernels, not numerics) and compiled kernels as ``.o`` files
(``quack.cache.jit``, in a folder named by a digest of quack's own sources, then by the compile key). The compile
key fingerprints an epilogue function's source only where the function lives outside ``site-packages``, and a
class it uses (our epilogue ops, such as ``tstore``'s transposed stores, and the SM90 GEMM we patch) only by its
name. So after an upgrade of an installed coda_titan, or an edit of one of those classes, quack would hand back
a kernel compiled from the earlier code: other math, silently.

``pin(cache)`` puts the compiled kernels one folder deeper, named by a digest of every source file of
``coda_titan.kernels`` (``sources_digest``), by setting ``quack.cache.CACHE_DIR``: quack's compile workers take
that folder from the path they are handed, so they agree with the process that asks. The autotuning winners stay
where they were (quack reads ``$QUACK_CACHE_DIR`` itself for them), so a change of code recompiles but does not
re-tune. The folders of sources no longer run are removed but the last two (``prune``), so that edits and upgrades
do not fill the disk.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
from pathlib import Path

KERNELS = Path(__file__).resolve().parent  # the package whose sources name the compiled kernels' folder
KEEP = 3  # compiled-kernel folders kept: these sources' and the two used before (an A/B of two versions)
logger = logging.getLogger(__name__)


def sources_digest(root: Path = KERNELS) -> str:
    """A digest of every ``.py`` file under ``root`` (its path and bytes), 16 hex digits."""
    h = hashlib.sha256()
    for src in sorted(root.rglob("*.py")):
        h.update(src.relative_to(root).as_posix().encode())
        data = src.read_bytes()
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()[:16]


def gpu_slug() -> str:
    """The current GPU's name as a folder name ("cpu" without one)."""
    import torch

    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "gpu"


def cache_root() -> str:
    """``$CODA_TITAN_CACHE/quack/<gpu>`` (``~/.cache/coda_titan`` by default): the default ``$QUACK_CACHE_DIR``."""
    base = os.environ.get("CODA_TITAN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "coda_titan")
    return os.path.join(base, "quack", gpu_slug())


def compiled_dir(quack_dir: str, digest: str) -> str:
    """The compiled kernels' folder under ``quack_dir`` for sources of ``digest``."""
    return os.path.join(quack_dir, f"kernels-{digest}")


def pin(cache, quack_dir: str | None = None, digest: str | None = None, keep: int = KEEP) -> str:
    """Point ``cache`` (the ``quack.cache`` module) at the compiled kernels' folder of these sources and mark it
    used now; of the other sources' folders keep the ``keep - 1`` used last (``prune``). Returns the folder.
    ``quack_dir``: ``$QUACK_CACHE_DIR`` unless given, which must then be set. A ``cache`` already at this digest's
    folder keeps it: quack's compile worker sets the folder from its job's path before it imports the job's
    module, and its environment (a forkserver's, from when the pool started) need not name the same root."""
    digest = digest or sources_digest()
    current = getattr(cache, "CACHE_DIR", None)
    if quack_dir is None and current and os.path.basename(os.path.normpath(current)) == f"kernels-{digest}":
        return current  # (a compile worker: quack set the folder of the job it was handed, which stays)
    quack_dir = quack_dir or os.environ.get("QUACK_CACHE_DIR")
    if not quack_dir:
        raise RuntimeError("QUACK_CACHE_DIR is not set: set it (or CODA_TITAN_CACHE) before importing the cute backend")
    folder = compiled_dir(quack_dir, digest)
    try:
        os.makedirs(folder, exist_ok=True)
        os.utime(folder)
        prune(quack_dir, folder, keep)
    except OSError as e:  # (a read-only cache: quack says so at its first compile, as without this folder)
        logger.warning(f"Could not prepare the compiled-kernel cache {folder}: {e}")
    cache.CACHE_DIR = folder
    return folder


def prune(quack_dir: str, current: str, keep: int) -> list[str]:
    """Remove the compiled kernels of other sources but the ``keep - 1`` used last (each folder holds every
    kernel and autotuning candidate compiled from its sources: a new one per upgrade or edit). Returns those
    removed. The autotuning winners, in other folders, stay."""
    others = [p for p in Path(quack_dir).glob("kernels-*") if p.is_dir() and str(p) != current]
    others.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    gone = [str(p) for p in others[max(keep - 1, 0):]]
    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    if gone:
        logger.info(f"Removed the compiled kernels of {len(gone)} earlier source version(s) under {quack_dir}")
    return gone
