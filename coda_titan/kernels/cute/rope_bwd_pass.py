"""B1 in one pass: a Triton kernel that reads each row of dy and y once and writes da, zdz and, with a
delayed scale, da's e5m2 codes and row amax (``fp8_dgrad``).

Inductor compiles B1's arithmetic (``norm_rope._rope_bwd_f32``) to two kernels, the rotation at 0.147 ms
a layer and the row sum at 0.065 (1B, H100, the fp8 profile); rewrites of it measured 0.165 ms at best
against 0.189 for both, and 0.180 against 0.240 with the cast (``probe_rope_bwd_…json``), where reading
dy and y and writing da take about 0.09 ms. Here one program handles one token row, in blocks of whole
heads (``heads_per_block``): it loads a block of dy and y as (head, pair, 2) tiles, splits each pair in
registers, rotates the q and k heads back by -theta with the row's cos / sin (one table row, shared by
every head), passes the v heads through, scales by r, stores da in bf16, and reduces zdz = sum(y * dy)
and, for fp8, amax |da| beside it. (The first version loaded each element's partner again and gathered
the tables per element: ``scripts/probes/b1_pass.py`` times both.) Same arithmetic as the reference in
fp32; the row sum's order and the compiler's contraction of x0 c + x1 s differ, as any kernel's may (the
GPU tests' derived bounds).

``rope_bwd_op`` and ``rope_bwd_fp8_op`` are ``torch.library.triton_op``s: a compiled caller traces into
them and inductor launches the kernel itself (the traced B1, ``TRACED``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from ..scaling import E5M2, E5M2_MAX


@triton.jit
def _kernel(dy_ptr, y_ptr, rstd_ptr, cos_ptr, sin_ptr, inv_ptr, da_ptr, zdz_ptr, daq_ptr, amax_ptr, seqlen,
            Q: tl.constexpr, ROT: tl.constexpr, HALF: tl.constexpr, HEADS: tl.constexpr, FP8: tl.constexpr,
            FMAX: tl.constexpr):
    row = tl.program_id(0)
    base = row.to(tl.int64) * Q
    pos = row % seqlen
    pair = tl.arange(0, HALF)
    c = tl.load(cos_ptr + pos * HALF + pair)[None, :]  # (one table row, shared by every head)
    s = tl.load(sin_ptr + pos * HALF + pair)[None, :]
    r = tl.load(rstd_ptr + row)
    head = tl.arange(0, HEADS)
    # the element (head, pair, e) of a block of HEADS heads sits at column head 2 HALF + 2 pair + e
    offs = head[:, None, None] * (2 * HALF) + pair[None, :, None] * 2 + tl.arange(0, 2)[None, None, :]
    zdz = tl.zeros([HEADS, HALF, 2], tl.float32)
    amax = tl.zeros([HEADS, HALF, 2], tl.float32)
    for b in tl.static_range(Q // (2 * HALF * HEADS)):
        cols = base + b * (2 * HALF * HEADS) + offs
        dy = tl.load(dy_ptr + cols).to(tl.float32)
        zdz += tl.load(y_ptr + cols).to(tl.float32) * dy
        x0, x1 = tl.split(dy)  # (the pair (x0, x1) rotated back: (x0 c + x1 s, x1 c - x0 s); v heads pass through)
        rope = (b * HEADS + head)[:, None] < ROT // (2 * HALF)
        da = tl.join(tl.where(rope, x0 * c + x1 * s, x0), tl.where(rope, x1 * c - x0 * s, x1)) * r
        tl.store(da_ptr + cols, da.to(tl.bfloat16, fp_downcast_rounding="rtne"))
        if FP8:
            amax = tl.maximum(amax, tl.abs(da))
            q = tl.clamp(da * tl.load(inv_ptr), -FMAX, FMAX)
            tl.store(daq_ptr + cols, q.to(tl.float8e5, fp_downcast_rounding="rtne"))
    tl.store(zdz_ptr + row, tl.sum(tl.reshape(zdz, [2 * HALF * HEADS]), axis=0))
    if FP8:
        tl.store(amax_ptr + row, tl.max(tl.reshape(amax, [2 * HALF * HEADS]), axis=0))


def heads_per_block(q: int, half: int) -> int:
    """Heads per block of the pass: the largest power of two (at most 8) that divides the row's head count."""
    heads = q // (2 * half)
    return min(heads & -heads, 8)


def _launch(dy, y, rstd, cos, sin, rot: int, inv, num_warps: int = 4):
    m, q = dy.shape
    da = torch.empty_like(dy)
    zdz = torch.empty(m, device=dy.device, dtype=torch.float32)
    fp8 = inv is not None
    daq = torch.empty((m, q) if fp8 else (0,), device=dy.device, dtype=E5M2)
    amax = torch.empty(m if fp8 else 0, device=dy.device, dtype=torch.float32)
    half = cos.shape[1]
    wrap_triton(_kernel)[(m,)](dy, y, rstd, cos, sin, inv if fp8 else rstd, da, zdz, daq, amax, cos.shape[0],
                                Q=q, ROT=rot, HALF=half, HEADS=heads_per_block(q, half), FP8=fp8,
                                FMAX=E5M2_MAX, num_warps=num_warps)
    return da, zdz, daq, amax


@triton_op("coda::rope_bwd_pass", mutates_args={})
def rope_bwd_op(dy: torch.Tensor, y: torch.Tensor, rstd: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                rot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(da bf16, zdz fp32) of B1 in one pass; dy, y (M, Q) bf16 rows, rstd (M,) fp32, cos / sin
    (seqlen, head_dim / 2) fp32, the first ``rot`` columns rotated."""
    da, zdz, _, _ = _launch(dy, y, rstd, cos, sin, rot, None)
    return da, zdz


@triton_op("coda::rope_bwd_fp8_pass", mutates_args={})
def rope_bwd_fp8_op(dy: torch.Tensor, y: torch.Tensor, rstd: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    rot: int, inv_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``rope_bwd_op`` plus daq = sat(da * inv_scale) in e5m2 (da before its bf16 rounding, as the
    reference) and amax |da| over the whole tensor (fp32, 0-dim)."""
    da, zdz, daq, amax = _launch(dy, y, rstd, cos, sin, rot, inv_scale.float().reshape(1))
    return da, zdz, daq, amax.amax()
