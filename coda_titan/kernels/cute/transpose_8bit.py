"""The token-major copy of 8-bit codes: a Triton kernel that transposes an (M, K) row-major e4m3 / e5m2
tensor into a (K, M) contiguous one, tile by tile, bytes moved as they are.

A weight gradient's fp8 GEMM takes both operands token-major (K = tokens contiguous). Where an operand
arrives row-major (B1's e5m2 da for dW_qkv, ``quantize_grad``'s dX and o's codes for dW_o), its copy
was ``.t().contiguous()``: PyTorch's eager 8-bit copy runs 0.357 ms for B1's 50 MB (``probe_h_t_…json``),
and inside a compiled backward inductor fused B1's copy with the scales' reciprocals into a kernel of
0.347 ms a layer (the twenty-eighth session's profile of ``fp8_qkv_wgrad``, 5.6 ms a step), where moving
100 MB takes about 0.04. Here each program loads a BLOCK x BLOCK tile along its rows and stores it
transposed along the output's rows, in the codes' own dtype: no arithmetic touches them.

``cast_transpose_e5m2`` is the same tile walk over a bf16 gradient that is cast on the way: each element
times a power-of-two inverse scale, saturated to the e5m2 range and rounded to nearest even, as
``scaling.quantize_e5m2`` of the fp32 value, stored token-major (dW_qkv's gradient under ``fp8_qkv_wgrad``,
cast at the current amax B1 reduced; inductor's transposing cast ran 0.347 ms a layer, above).

Both are ``torch.library.triton_op``s: a compiled caller traces into them and inductor launches the kernel
itself, with nothing fused into it.

``grad_e5m2`` is ``coda::quantize_grad``'s kernels (a residual-stream gradient to e5m2 at its current amax,
the scale rounded down to a power of two): one pass for the amax (an integer max over the bits of |x|, so
a NaN wins as in the reference, into 512 partials) and one that reduces those, derives the scale, casts,
and stores the codes row-major and, for ``quantize_grad_t``, token-major too (the weight gradient's operand,
which ``transpose_8bit`` copied from the row-major codes before). Where the eager op ran eight kernels (the
amax, five on the 0-dim scale, the cast, its reciprocal) and the copy, it runs two: the amax and the cast.

``delayed_e4m3_t`` is ``coda::quantize_delayed_t``'s kernel (the out-projection's input o cast to e4m3 with
its site's delayed scale, ``fp8_out_bwd``): with the scale known before the pass, one read of o gives the
codes row-major (F1's GEMM), token-major (dW_o's operand, which inductor copied in the backward) and each
tile's amax for the site's history, where inductor ran the amax and the cast as two passes over o.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from ..scaling import AMAX_EPS, E4M3, E4M3_MAX, E5M2, E5M2_MAX

T8_ENV = "CODA_TITAN_T8"  # A/B switch: "inductor" (every copy .t().contiguous()), "triton" (every copy this pass)
BLOCK = 64  # (a 64 x 64 byte tile per program: 0.042 ms for B1's codes, probe_transpose_8bit_…json)


@triton.jit
def transpose_8bit_kernel(x_ptr, y_ptr, M, K, LD, BM: tl.constexpr, BK: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rk = tl.program_id(1) * BK + tl.arange(0, BK)
    mask = (rm[:, None] < M) & (rk[None, :] < K)
    tile = tl.load(x_ptr + rm[:, None].to(tl.int64) * K + rk[None, :], mask=mask)
    tl.store(y_ptr + rk[:, None].to(tl.int64) * LD + rm[None, :], tl.trans(tile), mask=tl.trans(mask))


@triton.jit
def cast_t_e5m2_kernel(x_ptr, inv_ptr, y_ptr, M, K, FMAX: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rk = tl.program_id(1) * BK + tl.arange(0, BK)
    mask = (rm[:, None] < M) & (rk[None, :] < K)
    tile = tl.load(x_ptr + rm[:, None].to(tl.int64) * K + rk[None, :], mask=mask, other=0.0).to(tl.float32)
    q = tl.clamp(tile * tl.load(inv_ptr), -FMAX, FMAX).to(tl.float8e5, fp_downcast_rounding="rtne")
    tl.store(y_ptr + rk[:, None].to(tl.int64) * M + rm[None, :], tl.trans(q), mask=tl.trans(mask))


@triton.jit
def amax_bits_kernel(x_ptr, part_ptr, N, NPART: tl.constexpr, BLOCK: tl.constexpr):
    """Program p's largest |x| over the BLOCKs p, p + NPART, ..., as the int32 bits of its fp32 value, into
    part_ptr[p]: for |x| >= 0 the bits order as the values, and a NaN's above +inf. (No atomics: one address
    taking every program's atomic serializes them, 0.3 ms at the residual stream's gradient.)"""
    pid = tl.program_id(0)
    acc = tl.zeros((BLOCK,), tl.int32)
    for start in range(pid * BLOCK, N, NPART * BLOCK):
        offs = tl.arange(0, BLOCK).to(tl.int64) + start
        x = tl.load(x_ptr + offs, mask=offs < N, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, x.to(tl.int32, bitcast=True) & 0x7FFFFFFF)
    tl.store(part_ptr + pid, tl.max(acc, axis=0))


@triton.jit
def pow2_inv_scale(amax, FMAX: tl.constexpr, EPS: tl.constexpr):
    """``scaling.pow2_floor(inv_scale_from_amax(amax, FMAX))`` in fp32: FMAX / max(amax, EPS) (IEEE division,
    a NaN amax kept), its exponent bits only (the largest power of two <= it; 0 stays 0, NaN stays NaN)."""
    inv = tl.math.div_rn(tl.full(amax.shape, FMAX, tl.float32), tl.where(amax < EPS, EPS, amax))
    floor = (inv.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    return tl.where(inv != inv, inv, floor)


@triton.jit
def cast_e5m2_kernel(x_ptr, part_ptr, y_ptr, yt_ptr, s_ptr, M, K, FMAX: tl.constexpr, EPS: tl.constexpr,
                     NPART: tl.constexpr, TOKEN_MAJOR: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    amax = tl.max(tl.load(part_ptr + tl.arange(0, NPART)), axis=0)  # (the amax pass's partials, from L2)
    inv = pow2_inv_scale(amax.to(tl.float32, bitcast=True), FMAX, EPS)
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rk = tl.program_id(1) * BK + tl.arange(0, BK)
    mask = (rm[:, None] < M) & (rk[None, :] < K)
    tile = tl.load(x_ptr + rm[:, None].to(tl.int64) * K + rk[None, :], mask=mask, other=0.0).to(tl.float32)
    q = tl.clamp(tile * inv, -FMAX, FMAX, propagate_nan=tl.PropagateNan.ALL).to(tl.float8e5, fp_downcast_rounding="rtne")
    tl.store(y_ptr + rm[:, None].to(tl.int64) * K + rk[None, :], q, mask=mask)
    if TOKEN_MAJOR:
        tl.store(yt_ptr + rk[:, None].to(tl.int64) * M + rm[None, :], tl.trans(q), mask=tl.trans(mask))
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        tl.store(s_ptr, 1.0 / inv)


def _check_cast_inputs(name: str, x: torch.Tensor, inv_scale: torch.Tensor | None = None) -> None:
    """What the cast passes read: a contiguous 2-d bf16 tensor (and a one-element fp32 inverse scale)."""
    if x.dim() != 2 or x.dtype != torch.bfloat16 or not x.is_contiguous():
        raise ValueError(f"{name} takes a contiguous 2-d bf16 tensor, got {x.dtype} {tuple(x.shape)} "
                         f"with strides {x.stride()}")
    if inv_scale is not None and (inv_scale.numel() != 1 or inv_scale.dtype != torch.float32):
        raise ValueError(f"{name} takes a one-element fp32 inverse scale, got {inv_scale.dtype} "
                         f"{tuple(inv_scale.shape)}")


AMAX_BLOCK = 8192  # (elements per program and iteration of the amax pass)
AMAX_PARTS = 512  # (its programs: each cast program reduces their partials again)


def _grad_e5m2(x: torch.Tensor, token_major: bool, wrap, amax: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    _check_cast_inputs("grad_e5m2", x)
    m, k = x.shape
    if m * k > 2**31 - AMAX_PARTS * AMAX_BLOCK:  # (the amax pass's int32 loop offsets)
        raise ValueError(f"grad_e5m2 takes fewer than 2^31 - 2^22 elements, got {tuple(x.shape)}")
    if amax is None:
        part, npart = torch.empty(AMAX_PARTS, device=x.device, dtype=torch.int32), AMAX_PARTS
        wrap(amax_bits_kernel)[(AMAX_PARTS,)](x, part, m * k, NPART=AMAX_PARTS, BLOCK=AMAX_BLOCK, num_warps=8)
    else:  # (its producer's amax, >= 0 or NaN: its fp32 bits are the one partial the cast reduces)
        if amax.numel() != 1 or amax.dtype != torch.float32:
            raise ValueError(f"grad_e5m2 takes a one-element fp32 amax, got {amax.dtype} {tuple(amax.shape)}")
        part, npart = amax.reshape(1).contiguous().view(torch.int32), 1
    y = torch.empty((m, k), device=x.device, dtype=E5M2)
    yt = torch.empty((k, m), device=x.device, dtype=E5M2) if token_major else None
    s = torch.empty((), device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(m, BLOCK), triton.cdiv(k, BLOCK))
    wrap(cast_e5m2_kernel)[grid](x, part, y, y if yt is None else yt, s, m, k, FMAX=E5M2_MAX, EPS=AMAX_EPS,
                                 NPART=npart, TOKEN_MAJOR=token_major, BM=BLOCK, BK=BLOCK, num_warps=4)
    return y, yt, s


def grad_e5m2(x: torch.Tensor, token_major: bool, amax: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(codes (M, K), their (K, M) contiguous copy or None, s = 1 / inv) of a contiguous 2-d bf16 gradient
    ``x``: ``quantize_grad``'s e5m2 cast at the current amax, the scale a power of two; ``amax`` (one fp32
    element): that amax as its producer reduced it, and no amax pass. Eager: the kernels launched by Triton
    itself (through ``wrap_triton`` outside a trace, a call took 0.4 ms of host time,
    ``probe_quantize_grad_…json``); a compiled caller traces ``coda::grad_e5m2`` / ``coda::grad_e5m2_t``
    (``_amax`` with a given amax)."""
    return _grad_e5m2(x, token_major, lambda kernel: kernel, amax)


@triton_op("coda::grad_e5m2", mutates_args={})
def grad_e5m2_op(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``grad_e5m2(x, token_major=False)`` for a compiled caller (inductor launches the kernels): (codes, s)."""
    y, _, s = _grad_e5m2(x, False, wrap_triton)
    return y, s


@triton_op("coda::grad_e5m2_t", mutates_args={})
def grad_e5m2_t_op(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``grad_e5m2(x, token_major=True)`` for a compiled caller: (codes, token-major codes, s)."""
    return _grad_e5m2(x, True, wrap_triton)


@triton_op("coda::grad_e5m2_amax", mutates_args={})
def grad_e5m2_amax_op(x: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``grad_e5m2(x, token_major=False, amax=amax)`` for a compiled caller: (codes, s)."""
    y, _, s = _grad_e5m2(x, False, wrap_triton, amax)
    return y, s


@triton_op("coda::grad_e5m2_t_amax", mutates_args={})
def grad_e5m2_t_amax_op(x: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``grad_e5m2(x, token_major=True, amax=amax)`` for a compiled caller: (codes, token-major codes, s)."""
    return _grad_e5m2(x, True, wrap_triton, amax)


@triton.jit
def cast_e4m3_delayed_kernel(x_ptr, inv_ptr, y_ptr, yt_ptr, part_ptr, M, K, FMAX: tl.constexpr, BM: tl.constexpr,
                             BK: tl.constexpr):
    """One tile of an activation cast with its delayed scale: e4m3 codes row-major and token-major, and the
    tile's largest |x| (int32 bits, as ``amax_bits_kernel``) into part_ptr[program]: one read of x for both."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rk = tl.program_id(1) * BK + tl.arange(0, BK)
    mask = (rm[:, None] < M) & (rk[None, :] < K)
    tile = tl.load(x_ptr + rm[:, None].to(tl.int64) * K + rk[None, :], mask=mask, other=0.0).to(tl.float32)
    q = tl.clamp(tile * tl.load(inv_ptr), -FMAX, FMAX, propagate_nan=tl.PropagateNan.ALL).to(
        tl.float8e4nv, fp_downcast_rounding="rtne")
    tl.store(y_ptr + rm[:, None].to(tl.int64) * K + rk[None, :], q, mask=mask)
    tl.store(yt_ptr + rk[:, None].to(tl.int64) * M + rm[None, :], tl.trans(q), mask=tl.trans(mask))
    bits = tile.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    tl.store(part_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), tl.max(tl.max(bits, axis=1), axis=0))


def _delayed_e4m3_t(x: torch.Tensor, inv_scale: torch.Tensor, wrap) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_cast_inputs("delayed_e4m3_t", x, inv_scale)
    m, k = x.shape
    grid = (triton.cdiv(m, BLOCK), triton.cdiv(k, BLOCK))
    y = torch.empty((m, k), device=x.device, dtype=E4M3)
    yt = torch.empty((k, m), device=x.device, dtype=E4M3)
    part = torch.empty(grid[0] * grid[1], device=x.device, dtype=torch.int32)
    wrap(cast_e4m3_delayed_kernel)[grid](x, inv_scale, y, yt, part, m, k, FMAX=E4M3_MAX, BM=BLOCK, BK=BLOCK, num_warps=4)
    return y, yt, part


def delayed_e4m3_t(x: torch.Tensor, inv_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes (M, K), their (K, M) contiguous copy, amax |x| (fp32, 0-dim)) of a contiguous 2-d bf16 activation
    cast to e4m3 with its delayed ``inv_scale`` (one-element fp32), as ``casts.quantize_delayed`` with the
    token-major copy of ``quantize_delayed_t``: one pass (the amax needs no scale first). Eager launch, as
    ``grad_e5m2``; a compiled caller traces ``coda::delayed_e4m3_t``."""
    y, yt, part = _delayed_e4m3_t(x, inv_scale, lambda kernel: kernel)
    return y, yt, part.amax().view(torch.float32)


@triton_op("coda::delayed_e4m3_t", mutates_args={})
def delayed_e4m3_t_op(x: torch.Tensor, inv_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``delayed_e4m3_t`` for a compiled caller: (codes, token-major codes, the tiles' amax bits (int32))."""
    return _delayed_e4m3_t(x, inv_scale, wrap_triton)


def launch(x: torch.Tensor, out: torch.Tensor, block: int = BLOCK, num_warps: int = 4) -> torch.Tensor:
    """``out`` (K, M) = x (M, K) transposed, 1-byte, x contiguous and ``out``'s rows of consecutive elements at
    any row stride (a column block of a wider token-major buffer; the probe's entry: tile sizes)."""
    m, k = x.shape
    if out.shape != (k, m) or out.stride(1) != 1:
        raise ValueError(f"transpose_8bit writes ({k}, {m}) rows of unit stride, got {tuple(out.shape)} {out.stride()}")
    grid = (triton.cdiv(m, block), triton.cdiv(k, block))
    wrap_triton(transpose_8bit_kernel)[grid](x, out, m, k, out.stride(0), BM=block, BK=block, num_warps=num_warps)
    return out


@triton_op("coda::transpose_8bit", mutates_args={})
def transpose_8bit(x: torch.Tensor) -> torch.Tensor:
    """x (M, K) row-major, a 1-byte dtype -> (K, M) contiguous, the same bytes (x.t().contiguous())."""
    if x.dim() != 2 or x.element_size() != 1 or not x.is_contiguous():
        raise ValueError(f"transpose_8bit takes a contiguous 2-d tensor of a 1-byte dtype, got {x.dtype} "
                         f"{tuple(x.shape)} with strides {x.stride()}")
    out = x.new_empty((x.shape[1], x.shape[0]))
    launch(x, out)
    return out


@triton_op("coda::cast_transpose_e5m2", mutates_args={})
def cast_transpose_e5m2(x: torch.Tensor, inv_scale: torch.Tensor) -> torch.Tensor:
    """x (M, K) contiguous bf16, inv_scale a one-element fp32 tensor -> (K, M) contiguous e5m2 codes of
    sat(x * inv_scale) (``quantize_e5m2(x.float(), inv_scale).t().contiguous()``)."""
    _check_cast_inputs("cast_transpose_e5m2", x, inv_scale)
    m, k = x.shape
    out = torch.empty((k, m), device=x.device, dtype=E5M2)
    grid = (triton.cdiv(m, BLOCK), triton.cdiv(k, BLOCK))
    wrap_triton(cast_t_e5m2_kernel)[grid](x, inv_scale, out, m, k, FMAX=E5M2_MAX, BM=BLOCK, BK=BLOCK, num_warps=4)
    return out


def token_major(t: torch.Tensor, traced_input: bool = False) -> torch.Tensor:
    """The (K, M) contiguous copy of an (M, K) 8-bit operand: the tensor itself where ``t`` is the
    transposed view of a token-major buffer (B3's da^T, F1's Hq^T), else this file's pass;
    ``traced_input`` (a compiled backward's input operand, o's codes for dW_o): ``.t().contiguous()``,
    inductor's copy, which its partitioner may move into the forward. Through this pass o's codes cost
    the fp8 defaults 0.5 GiB of live peak (``compare_t8_{triton,inductor}_…json``)."""
    if t.t().is_contiguous():
        return t.t()
    mode = os.environ.get(T8_ENV) or ("inductor" if traced_input else "triton")
    if mode not in ("inductor", "triton"):
        raise ValueError(f"{T8_ENV}={mode!r}: 'inductor' or 'triton' (or unset: the pass for a gradient, "
                         "inductor's copy for a traced input)")
    return t.t().contiguous() if mode == "inductor" else transpose_8bit(t)
