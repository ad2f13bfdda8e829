"""What coda_titan changes in quack 0.6.5, in one place.

``fp8_fast_accumulation``: quack's SM90 GEMMs with 8-bit operands use fast accumulation (the WGMMA
accumulates the whole K loop in its own registers), as torchao's float8 forward and cuBLAS
``use_fast_accum`` do. quack 0.6.5's frontend builds every fp8 GEMM with its slow-accumulation
path, which drains the tensor pipe at every k-tile to promote into a second fp32 accumulator.
``CODA_TITAN_FP8_SLOW_ACCUM=1`` keeps quack's default. bf16 GEMMs are unchanged.

The switch rides quack's own ``post_init_attrs`` (attributes set on the kernel object before it is
traced): they are part of the compile key and travel with the key to quack's forked autotune
workers, where a patch made in this process would not exist (docs/history.md: the constructor patch
that the workers never saw).
"""

from __future__ import annotations

import functools
import os

from ..scaling import E4M3, E5M2

_FP8_DTYPES = (E4M3, E5M2)


def fp8_fast_accumulation() -> bool:
    """Install the switch (idempotent); False when ``CODA_TITAN_FP8_SLOW_ACCUM`` asks for quack's default."""
    if os.environ.get("CODA_TITAN_FP8_SLOW_ACCUM", "0") != "0":
        return False
    from quack.epilogue.frontend import EpiMod

    gemm = EpiMod.gemm
    if getattr(gemm, "_coda_fast_accum", False):
        return True

    @functools.wraps(gemm)
    def fast_accum_gemm(self, A, *args, post_init_attrs=(), **kwargs):
        if getattr(A, "dtype", None) in _FP8_DTYPES and all(k != "fp8_slow_accum" for k, _ in post_init_attrs):
            post_init_attrs = (*post_init_attrs, ("fp8_slow_accum", False))
        return gemm(self, A, *args, post_init_attrs=post_init_attrs, **kwargs)

    fast_accum_gemm._coda_fast_accum = True
    EpiMod.gemm = fast_accum_gemm
    return True


FP8_FAST_ACCUM = fp8_fast_accumulation()
