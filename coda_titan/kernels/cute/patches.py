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
_PROVIDERS = []  # callables A -> ((attr, value), ...): the post-init attributes a GEMM on A gets


def add_post_init_attrs(provider) -> None:
    """Give every quack epilogue GEMM the post-init attributes ``provider(A)`` returns (A: its first
    operand), unless the call names them itself; idempotent per provider. One wrapper of
    ``EpiMod.gemm`` serves every provider (this module's fp8 switch, ``overlap.requested``)."""
    from quack.epilogue.frontend import EpiMod

    if provider not in _PROVIDERS:
        _PROVIDERS.append(provider)
    gemm = EpiMod.gemm
    if getattr(gemm, "_coda_post_init_attrs", False):
        return

    @functools.wraps(gemm)
    def gemm_with_attrs(self, A, *args, post_init_attrs=(), **kwargs):
        given = {k for k, _ in post_init_attrs}
        extra = tuple(kv for provide in _PROVIDERS for kv in provide(A) if kv[0] not in given)
        return gemm(self, A, *args, post_init_attrs=(*post_init_attrs, *extra), **kwargs)

    gemm_with_attrs._coda_post_init_attrs = True
    EpiMod.gemm = gemm_with_attrs


def _fast_accum_attrs(A):
    return (("fp8_slow_accum", False),) if getattr(A, "dtype", None) in _FP8_DTYPES else ()


def fp8_fast_accumulation() -> bool:
    """Install the switch (idempotent); False when ``CODA_TITAN_FP8_SLOW_ACCUM`` asks for quack's default."""
    if os.environ.get("CODA_TITAN_FP8_SLOW_ACCUM", "0") != "0":
        return False
    add_post_init_attrs(_fast_accum_attrs)
    return True


FP8_FAST_ACCUM = fp8_fast_accumulation()
