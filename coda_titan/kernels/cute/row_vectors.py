"""B2's epilogue vectors in one Triton launch: the row vector corr = -(r^2 / d) * zdz and the column vector
w = gamma (times the fp8 dgrad's dequantization scale s_da * s_w), both fp32; and the folds of the fp8
epilogues' amax |x| partials in one launch (``fold_amax``).

As aten ops inside the B2 op these were six to eight kernels a call (``rstd.float()``, ``r * r``, ``/ d``,
the negation, ``* zdz``, ``gamma.float()``, ``* sc``), each a launch of a few microseconds with a gap after
it on the GPU: on the 1B fp8 profile 248 of the backward's 555 small kernels. The arithmetic is the eager
ops', in their order and roundings: ``r * r`` then times the fp32 reciprocal of d (what aten's division by a
Python scalar computes), negated, times zdz; gamma widened to fp32 exactly, then times the scale.

Triton itself launches the kernel (no ``wrap_triton``): the B2 op is opaque to a compiled caller, so it runs
eagerly either way. Kept apart from ``norm_residual_bwd.py`` so that Triton's CPU interpreter can load it
without quack (``tests/b2_vectors_interpreter_check.py``).
"""

from __future__ import annotations

import os

import numpy as np
import torch
import triton
import triton.language as tl
from triton.compiler import CompiledKernel

BLOCK = 1024


@triton.jit
def b2_vectors_kernel(rstd_ptr, zdz_ptr, gamma_ptr, sc_ptr, corr_ptr, w_ptr, inv_d, M, D, HAS_SC: tl.constexpr,
                      BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    rows = offs < M
    r = tl.load(rstd_ptr + offs, mask=rows, other=0.0).to(tl.float32)
    z = tl.load(zdz_ptr + offs, mask=rows, other=0.0).to(tl.float32)
    tl.store(corr_ptr + offs, -((r * r) * inv_d) * z, mask=rows)
    cols = offs < D
    g = tl.load(gamma_ptr + offs, mask=cols, other=0.0).to(tl.float32)
    if HAS_SC:
        g = g * tl.load(sc_ptr)
    tl.store(w_ptr + offs, g, mask=cols)


def fp32_reciprocal(d: int) -> float:
    """1 / d in fp32 (as a Python float): what aten multiplies by when it divides a tensor by the Python
    scalar d (exact for powers of two)."""
    return float(np.float32(1.0) / np.float32(d))


def b2_vectors(rstd: torch.Tensor, zdz: torch.Tensor, gamma: torch.Tensor, d: int,
               sc: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(corr (M,), w (d,)), fp32: corr = -(r * r / d) * zdz, w = gamma (* sc, a one-element fp32 tensor);
    rstd and zdz (M,) or (M, 1)."""
    if rstd.numel() != rstd.shape[0] or zdz.numel() != rstd.numel() or tuple(gamma.shape) != (d,):
        raise ValueError(f"b2_vectors takes rstd and zdz of M values each ((M,) or (M, 1)) and gamma (d,), got "
                         f"{tuple(rstd.shape)}, {tuple(zdz.shape)} and {tuple(gamma.shape)} for d = {d}")
    if sc is not None and (sc.numel() != 1 or sc.dtype != torch.float32):
        raise ValueError(f"b2_vectors takes a one-element fp32 scale, got {sc.dtype} {tuple(sc.shape)}")
    rstd, zdz, gamma = rstd.reshape(-1).contiguous(), zdz.reshape(-1).contiguous(), gamma.contiguous()
    m = rstd.shape[0]
    corr = torch.empty(m, device=rstd.device, dtype=torch.float32)
    w = torch.empty(d, device=rstd.device, dtype=torch.float32)
    inv_d = fp32_reciprocal(d)
    b2_vectors_kernel[(triton.cdiv(max(m, d), BLOCK),)](rstd, zdz, gamma, corr if sc is None else sc, corr, w, inv_d,
                                                        m, d, HAS_SC=sc is not None, BLOCK=BLOCK)
    return corr, w


# programs of a fold: 64, or 256 past 128 blocks of partials (F2's and B3's, 16,384 rows by 64 or 128 N tiles,
# took 11 us a call on 64 programs in the forty-first session's profile, each program's blocks one after another)
FOLD_PROGRAMS, FOLD_PROGRAMS_LARGE, FOLD_BLOCK = 64, 256, 2048


def fold_programs(n: int) -> int:
    """How many programs fold ``n`` partials."""
    return FOLD_PROGRAMS_LARGE if triton.cdiv(n, FOLD_BLOCK) > 2 * FOLD_PROGRAMS else FOLD_PROGRAMS


@triton.jit
def fold_amax_kernel(part_ptr, scratch_ptr, count_ptr, out_ptr, div_ptr, N, ROUND: tl.constexpr,
                     NPROG: tl.constexpr, BLOCK: tl.constexpr, DIV: tl.constexpr):
    """Each of NPROG programs: the largest of its blocks of N partials >= 0 (or NaN) through their int32 bits
    (which order as the values, a NaN's above +inf) into scratch; the program that finishes last (a count
    taken atomically) folds the NPROG of them, rounds the value to bf16 (ROUND 1) or fp16 (ROUND 2), nearest
    even, or not at all (ROUND 0; DIV: then divided by div_ptr[0], rounded to nearest), into out_ptr[0] as
    fp32, and sets the count back to 0 for the next call."""
    pid = tl.program_id(0)
    acc = tl.zeros((BLOCK,), tl.int32)
    for start in range(pid * BLOCK, N, NPROG * BLOCK):
        offs = tl.arange(0, BLOCK).to(tl.int64) + start
        acc = tl.maximum(acc, tl.load(part_ptr + offs, mask=offs < N, other=0.0).to(tl.int32, bitcast=True))
    tl.store(scratch_ptr + pid, tl.max(acc, axis=0))
    tl.debug_barrier()  # (the program's store before its count: the atomic's release then covers it)
    if tl.atomic_add(count_ptr, 1, sem="acq_rel") == NPROG - 1:
        bits = tl.max(tl.load(scratch_ptr + tl.arange(0, NPROG), volatile=True), axis=0)
        if ROUND == 0:
            amax = bits.to(tl.float32, bitcast=True)
            if DIV:
                amax = tl.math.div_rn(amax, tl.load(div_ptr))
        elif ROUND == 2:
            amax = bits.to(tl.float32, bitcast=True).to(tl.float16, fp_downcast_rounding="rtne").to(tl.float32)
        else:  # (bf16 nearest even on the bits, as the GPU's conversion: exact in Triton's interpreter as well)
            b = bits.to(tl.int64)
            b = ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).to(tl.int32)
            amax = tl.where(bits > 0x7F800000, bits, b).to(tl.float32, bitcast=True)
        tl.store(out_ptr, amax)
        tl.store(count_ptr, 0)


_FOLD_STATE: dict = {}  # device -> (scratch, count): the count is 0 between calls
FOLD_ENV = "CODA_TITAN_FOLD_AMAX"  # "aten": the unrounded folds as ``partials.amax()`` (less host time a call; A/B)


_ROUND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def fold_amax(partials: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
              div: torch.Tensor | None = None) -> torch.Tensor:
    """amax as a one-element fp32 tensor from an epilogue's fp32 amax |x| partials (any shape, each >= 0: the
    max.abs sink clears the sign), rounded as a store to ``dtype`` (bf16 or fp16) rounds: the amax of the
    tensor those fp32 values were stored as (rounding is monotonic), what ``partials.amax().to(dtype).float()``
    gave in three launches (the reduction, the two conversions); ``dtype`` fp32: ``partials.amax()``. One
    launch; its programs share a count and a scratch per device, so calls must not run on two streams at once
    (the epilogues' callers run on the main stream). ``div`` (fp32, one element; with ``dtype`` fp32 only):
    the amax divided by it, as ``partials.amax() / div`` (B3's partials come in units of inv_scale)."""
    if partials.dtype != torch.float32 or dtype not in _ROUND:
        raise ValueError(f"fold_amax takes fp32 partials rounded to bf16, fp16 or fp32, got {partials.dtype} to {dtype}")
    if div is not None and (dtype != torch.float32 or div.dtype != torch.float32 or div.numel() != 1):
        raise ValueError(f"fold_amax divides an unrounded fp32 amax by one fp32 value, got {dtype} and "
                         f"{div.dtype} {tuple(div.shape)}")
    if dtype == torch.float32 and os.environ.get(FOLD_ENV) == "aten":
        return partials.amax() if div is None else partials.amax() / div.reshape(())
    parts = partials.reshape(-1).contiguous()
    if parts.device not in _FOLD_STATE:
        _FOLD_STATE[parts.device] = (torch.zeros(FOLD_PROGRAMS_LARGE, device=parts.device, dtype=torch.int32),
                                     torch.zeros(1, device=parts.device, dtype=torch.int32))
    scratch, count = _FOLD_STATE[parts.device]
    out = torch.empty((), device=parts.device, dtype=torch.float32)
    nprog = fold_programs(parts.numel())
    _launch_fold(nprog, parts, scratch, count, out, out if div is None else div, parts.numel(), _ROUND[dtype],
                 div is not None)
    return out


_FOLDS: dict = {}  # (what Triton specializes this kernel on) -> its compiled kernel


def _launch_fold(nprog: int, parts, scratch, count, out, div, n: int, round_: int, has_div: bool) -> None:
    """``fold_amax_kernel`` on ``nprog`` programs: through Triton's JIT launch the first time for a key, then the
    compiled kernel launched directly (its runner), without the JIT's argument binding and cache lookup on each
    of the step's 95 calls (host time; with the session's other host cuts, ``compare_pkg_host2_*_…json``). The
    key holds everything the JIT specializes the kernel on for these arguments: the constexprs, each pointer's
    16-byte alignment, and the count's divisibility by 16, its being 1 and its integer width; the other pointers
    (scratch, count, out) are allocations of their own, 16-byte aligned."""
    key = (parts.device, nprog, round_, has_div, n % 16 == 0, n == 1, n < 2**31, parts.data_ptr() % 16 == 0,
           div.data_ptr() % 16 == 0)
    kernel = _FOLDS.get(key)
    if kernel is None:
        kernel = fold_amax_kernel[(nprog,)](parts, scratch, count, out, div, n, ROUND=round_, NPROG=nprog,
                                            BLOCK=FOLD_BLOCK, DIV=has_div, num_warps=4)
        if isinstance(kernel, CompiledKernel):  # (Triton's CPU interpreter returns none: it launches each time)
            _FOLDS[key] = kernel
        return
    kernel[(nprog, 1, 1)](parts, scratch, count, out, div, n, round_, nprog, FOLD_BLOCK, has_div)
