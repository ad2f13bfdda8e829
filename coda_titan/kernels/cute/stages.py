"""A lower base for the epilogue's C-load stages of chosen quack GEMMs (SM90: B2, and B3 on the bf16 GEMM,
whose C is the saved pre-activation pairs), so that wide tiles keep their mainloop stages.

quack 0.6.5 (``GemmSm90._compute_stages``) gives the epilogue ``min(epi_tiles, epi_c_stage_base = 4)``
C-load stages first, each holding every tile-sized epilogue input, then fills shared memory with A/B
stages, then deepens C again from what is left, up to 5. B2 reads two tiles per stage (the residual
gradient C and X): on a 256 x 128 cooperative tile (128 x 32 subtiles, 16 KiB a C stage) that leaves
the mainloop 2 A/B stages, against 5 on 128 x 128 pingpong, so the tuner never picks the wide tile
that cuBLAS runs this GEMM on (``scripts/dev/compile_check.py``'s stage report, docs/cute_backend.md).
With the base at 2 the same tile gets 3 A/B stages, and C still gets whatever fits after them.

``ATTR`` (a post-init attribute: part of a kernel's compile key, set for the calls inside ``capped``)
holds the base; the kernel's class carries it while its stages are computed. ``TILE_ATTR`` (inside
``epi_tile``) likewise sets the epilogue's subtile, which quack derives from the CTA tile (64 x 32 on
128 x 128 with a 16-bit D): each subtile is one round of C loads, one shared-memory barrier and one TMA
store per output, so a larger one halves those rounds (B3, whose epilogue is longer than its mainloop). The programs that ask
for it define their epilogue in ``epilogues.py``, so that quack's compile workers, which re-mint an
epilogue's class by importing its module, import this package and its patch too. Inert for kernels
without ``ATTR`` or ``TILE_ATTR``.
"""

from __future__ import annotations

import contextlib
import contextvars

from .. import B3_C_STAGES_ENV, EPI_C_STAGES_ENV, requested_c_stage_base as requested_base  # noqa: F401
from .patches import add_post_init_attrs

ATTR = "_coda_epi_c_stage_base"
TILE_ATTR = "_coda_epi_tile"
ENV = EPI_C_STAGES_ENV  # (``[coda] b2_c_stages`` sets it: titan/parallelize.py)
B3_ENV = B3_C_STAGES_ENV  # (B3's alone, for an A/B: unset follows ``ENV``)
_BASE = contextvars.ContextVar("coda_epi_c_stage_base", default=None)
_TILE = contextvars.ContextVar("coda_epi_tile", default=None)


@contextlib.contextmanager
def capped(base: int | None):
    """quack GEMMs compiled inside this block get ``ATTR`` = ``base`` (None: nothing changes)."""
    token = _BASE.set(base)
    try:
        yield
    finally:
        _BASE.reset(token)


@contextlib.contextmanager
def epi_tile(tile: tuple[int, int] | None):
    """quack GEMMs compiled inside this block get ``TILE_ATTR`` = ``tile`` (M x N of the epilogue's
    subtile; None: quack's)."""
    token = _TILE.set(None if tile is None else tuple(tile))
    try:
        yield
    finally:
        _TILE.reset(token)


def _attrs(A):
    base, tile = _BASE.get(), _TILE.get()
    return (() if base is None else ((ATTR, base),)) + (() if tile is None else ((TILE_ATTR, tile),))


def setup_attributes(original):
    def patched(self, epilogue_args):
        base, tile = getattr(self, ATTR, None), getattr(self, TILE_ATTR, None)
        if base is None and tile is None:
            return original(self, epilogue_args)
        cls = type(self)  # (``_compute_stages`` is a classmethod: it reads the base from the class)
        own = cls.__dict__.get("epi_c_stage_base", None)
        if base is not None:
            cls.epi_c_stage_base = base
        if tile is not None:  # (``_compute_tile_shape_or_override``, a staticmethod, is looked up on the instance)
            self._compute_tile_shape_or_override = lambda *args, **kwargs: tile
        try:
            return original(self, epilogue_args)
        finally:
            self.__dict__.pop("_compute_tile_shape_or_override", None)
            if base is not None and own is None:
                del cls.epi_c_stage_base
            elif base is not None:
                cls.epi_c_stage_base = own
    return patched


def install() -> None:
    """Patch quack's SM90 GEMM (idempotent); inert unless a kernel carries ``ATTR`` or ``TILE_ATTR``."""
    from quack.gemm_sm90 import GemmSm90

    if getattr(GemmSm90._setup_attributes, "_coda_stages", False):
        return
    add_post_init_attrs(_attrs)
    GemmSm90._setup_attributes = setup_attributes(GemmSm90._setup_attributes)
    GemmSm90._setup_attributes._coda_stages = True
