"""The ``cute`` backend: CODA's programs as fused SM90 kernels (quack / CuTeDSL, the ``gpu`` extra).

Importing this package registers the kernels as the CUDA implementations of the ``torch.ops.coda``
custom ops (``coda_titan.kernels.ops``) and exposes ``<program>_cute`` callables with the same
keyword-only interface as the torch reference. Only import it on an sm90 GPU with the extra
installed; ``coda_titan.kernels.get_backend('cute')`` checks that first.

Caches (on disk, so a training start does not re-tune what was tuned before):

* quack's compiled kernels and autotuning winners live under ``$QUACK_CACHE_DIR``. Unless the user
  set it, it defaults to ``$CODA_TITAN_CACHE/quack/<gpu name>`` (``~/.cache/coda_titan`` by
  default): one directory per GPU model, keyed inside by shape and dtype.
* ``CODA_TITAN_AUTOTUNE=0`` skips the sweep and uses quack's default tile configuration.
"""

from __future__ import annotations

import os
import re


def _gpu_slug() -> str:
    import torch

    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "gpu"


def cache_root() -> str:
    base = os.environ.get("CODA_TITAN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "coda_titan")
    return os.path.join(base, "quack", _gpu_slug())


# quack reads QUACK_CACHE_DIR when it is first imported: set it before anything imports quack.
# (Only when unset: quack's forked compile workers import this module again and inherit the
# variable, and they must not touch CUDA to name the GPU.)
if not os.environ.get("QUACK_CACHE_DIR"):
    os.environ["QUACK_CACHE_DIR"] = cache_root()

from .programs import *  # noqa: E402,F401,F403
from .programs import __all__  # noqa: E402,F401
