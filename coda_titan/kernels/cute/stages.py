"""A lower base for the epilogue's C-load stages of chosen quack GEMMs (SM90), so that wide tiles keep
their mainloop stages.

quack 0.6.5 (``GemmSm90._compute_stages``) gives the epilogue ``min(epi_tiles, epi_c_stage_base = 4)``
C-load stages first, each holding every tile-sized epilogue input, then fills shared memory with A/B
stages, then deepens C again from what is left, up to 5. B2 reads two tiles per stage (the residual
gradient C and X): on a 256 x 128 cooperative tile (128 x 32 subtiles, 16 KiB a C stage) that leaves
the mainloop 2 A/B stages, against 5 on 128 x 128 pingpong, so the tuner never picks the wide tile
that cuBLAS runs this GEMM on (``scripts/dev/compile_check.py``'s stage report, docs/cute_backend.md).
With the base at 2 the same tile gets 3 A/B stages, and C still gets whatever fits after them.

``ATTR`` (a post-init attribute: part of a kernel's compile key, set for the calls inside ``capped``)
holds the base; the kernel's class carries it while its stages are computed. The programs that ask
for it define their epilogue in ``epilogues.py``, so that quack's compile workers, which re-mint an
epilogue's class by importing its module, import this package and its patch too. Inert for kernels
without ``ATTR``.
"""

from __future__ import annotations

import contextlib
import contextvars
import os

from .patches import add_post_init_attrs

ATTR = "_coda_epi_c_stage_base"
ENV = "CODA_TITAN_EPI_C_STAGES"
_BASE = contextvars.ContextVar("coda_epi_c_stage_base", default=None)


def requested_base() -> int | None:
    """The base ``ENV`` asks for (an integer >= 1), or None for quack's own; anything else is an error."""
    raw = os.environ.get(ENV)
    if raw is None or raw == "":
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{ENV} must be an integer >= 1 (quack's own base is 4), got {raw!r}")
    return int(raw)


@contextlib.contextmanager
def capped(base: int | None):
    """quack GEMMs compiled inside this block get ``ATTR`` = ``base`` (None: nothing changes)."""
    token = _BASE.set(base)
    try:
        yield
    finally:
        _BASE.reset(token)


def _attrs(A):
    base = _BASE.get()
    return () if base is None else ((ATTR, base),)


def setup_attributes(original):
    def patched(self, epilogue_args):
        base = getattr(self, ATTR, None)
        if base is None:
            return original(self, epilogue_args)
        cls = type(self)  # (``_compute_stages`` is a classmethod: it reads the base from the class)
        own = cls.__dict__.get("epi_c_stage_base", None)
        cls.epi_c_stage_base = base
        try:
            return original(self, epilogue_args)
        finally:
            if own is None:
                del cls.epi_c_stage_base
            else:
                cls.epi_c_stage_base = own
    return patched


def install() -> None:
    """Patch quack's SM90 GEMM (idempotent); inert unless a kernel carries ``ATTR``."""
    from quack.gemm_sm90 import GemmSm90

    if getattr(GemmSm90._setup_attributes, "_coda_stages", False):
        return
    add_post_init_attrs(_attrs)
    GemmSm90._setup_attributes = setup_attributes(GemmSm90._setup_attributes)
    GemmSm90._setup_attributes._coda_stages = True
