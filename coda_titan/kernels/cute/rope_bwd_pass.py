"""B1 in one pass: a Triton kernel that reads each row of dy and y once and writes da, zdz and, with a
delayed scale, da's e5m2 codes and row amax (``fp8_dgrad``).

Inductor compiles B1's arithmetic (``norm_rope._rope_bwd_f32``) to two kernels, the rotation at 0.147 ms
a layer and the row sum at 0.065 (1B, H100, the fp8 profile); rewrites of it measured 0.165 ms at best
against 0.189 for both, and 0.180 against 0.240 with the cast (``probe_rope_bwd_…json``), where reading
dy and y and writing da take about 0.09 ms. Here one program handles ``ROWS`` token rows, each in blocks of
``CH`` columns: it loads dy and y (and each element's pair partner, from L1), rotates the q and k heads
back by -theta, passes the v heads through, scales by r, stores da in bf16, and reduces zdz = sum(y * dy)
and, for fp8, amax |da| beside it (``SHAPE``: the probe's fastest). Same arithmetic as the reference in
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
def rope_bwd_pass_kernel(dy_ptr, y_ptr, rstd_ptr, cos_ptr, sin_ptr, inv_ptr, da_ptr, zdz_ptr, daq_ptr, amax_ptr,
                         seqlen, s_dy, s_y, Q: tl.constexpr, ROT: tl.constexpr, HALF: tl.constexpr, CH: tl.constexpr,
                         ROWS: tl.constexpr, FP8: tl.constexpr, FMAX: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rows64 = rows.to(tl.int64)[:, None]  # (da and codes: dense rows; dy and y: rows s_dy and s_y elements apart)
    r = tl.load(rstd_ptr + rows)[:, None]
    pos = (rows % seqlen)[:, None]
    zdz = tl.zeros([ROWS, CH], tl.float32)  # (the row sums kept per element until the row's end)
    amax = tl.zeros([ROWS, CH], tl.float32)
    for b in tl.static_range((Q + CH - 1) // CH):
        cols = b * CH + tl.arange(0, CH)[None, :]
        inside = cols < Q  # (a (1, CH) mask, broadcast over the rows)
        dy = tl.load(dy_ptr + rows64 * s_dy + cols, mask=inside, other=0.0).to(tl.float32)
        zdz += tl.load(y_ptr + rows64 * s_y + cols, mask=inside, other=0.0).to(tl.float32) * dy
        partner = tl.load(dy_ptr + rows64 * s_dy + (cols ^ 1), mask=inside, other=0.0).to(tl.float32)
        rope = inside & (cols < ROT)
        pair = (cols % (2 * HALF)) // 2
        c = tl.load(cos_ptr + pos * HALF + pair, mask=rope, other=1.0)
        s = tl.load(sin_ptr + pos * HALF + pair, mask=rope, other=0.0)
        # (x0 c + x1 s, x1 c - x0 s) for the pair (x0, x1): the element is x0 at even columns, x1 at odd
        back = tl.where((cols % 2) == 0, dy * c + partner * s, dy * c - partner * s)
        da = tl.where(rope, back, dy) * r
        tl.store(da_ptr + rows64 * Q + cols, da.to(tl.bfloat16, fp_downcast_rounding="rtne"), mask=inside)
        if FP8:
            amax = tl.maximum(amax, tl.where(inside, tl.abs(da), 0.0))
            q = tl.clamp(da * tl.load(inv_ptr), -FMAX, FMAX)
            tl.store(daq_ptr + rows64 * Q + cols, q.to(tl.float8e5, fp_downcast_rounding="rtne"), mask=inside)
    tl.store(zdz_ptr + rows, tl.sum(zdz, axis=1))
    if FP8:
        tl.store(amax_ptr + rows, tl.max(amax, axis=1))


# (columns a block, None: the row's power of two; rows a program; warps): the fastest in the forty-first
# session's probe (``probe_b1_pass_…json``, 1B: 0.141 ms a layer fp8 and 0.110 bf16, against 0.148 and 0.120 at
# 8 warps, and 0.146-0.147 / 0.111 in blocks of 1024 columns)
SHAPE = (None, 1, 4)


def outputs(dy, fp8: bool) -> tuple:
    """What a pass over ``dy``'s rows writes: da, zdz and (fp8, else empty) the e5m2 codes and row amax."""
    m, q = dy.shape
    return (torch.empty((m, q), device=dy.device, dtype=dy.dtype), torch.empty(m, device=dy.device, dtype=torch.float32),
            torch.empty((m, q) if fp8 else (0,), device=dy.device, dtype=E5M2),
            torch.empty(m if fp8 else 0, device=dy.device, dtype=torch.float32))


def unit_columns(*ts: torch.Tensor) -> bool:
    """Whether the pass reads these tensors in place: rows of consecutive elements, any row stride."""
    return all(t.stride(-1) == 1 for t in ts)


def _launch(dy, y, rstd, cos, sin, rot: int, inv, shape=SHAPE, wrap=wrap_triton):
    """The pass's outputs; ``shape`` (columns a block, rows a program dividing the row count, warps); ``wrap``
    the launcher's wrapper (the probe launches the kernel itself: ``lambda k: k``)."""
    if not unit_columns(dy, y):
        raise ValueError(f"B1's pass reads rows of consecutive elements, got strides {dy.stride()} and {y.stride()}")
    m, q = dy.shape
    ch, rows, warps = shape
    ch = ch or triton.next_power_of_2(q)
    fp8 = inv is not None
    da, zdz, daq, amax = outputs(dy, fp8)
    wrap(rope_bwd_pass_kernel)[(triton.cdiv(m, rows),)](
        dy, y, rstd, cos, sin, inv if fp8 else rstd, da, zdz, daq, amax, cos.shape[0], dy.stride(0), y.stride(0),
        Q=q, ROT=rot, HALF=cos.shape[1], CH=ch, ROWS=rows, FP8=fp8, FMAX=E5M2_MAX, num_warps=warps)
    return da, zdz, daq, amax


@triton_op("coda::rope_bwd_pass", mutates_args={})
def rope_bwd_op(dy: torch.Tensor, y: torch.Tensor, rstd: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                rot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(da bf16, zdz fp32) of B1 in one pass; dy, y (M, Q) bf16 rows (column stride 1), rstd (M,) fp32,
    cos / sin (seqlen, head_dim / 2) fp32, the first ``rot`` columns rotated."""
    da, zdz, _, _ = _launch(dy, y, rstd, cos, sin, rot, None)
    return da, zdz


@triton_op("coda::rope_bwd_fp8_pass", mutates_args={})
def rope_bwd_fp8_op(dy: torch.Tensor, y: torch.Tensor, rstd: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    rot: int, inv_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``rope_bwd_op`` plus daq = sat(da * inv_scale) in e5m2 (da before its bf16 rounding, as the
    reference) and amax |da| over the whole tensor (fp32, 0-dim)."""
    da, zdz, daq, amax = _launch(dy, y, rstd, cos, sin, rot, inv_scale.float().reshape(1))
    return da, zdz, daq, amax.amax()
