"""The LM head's B2 epilogue as one row pass over its fp32 dgrad accumulator (``lm_head_ce``'s default, zdz from
the accumulator: ``kernels/lm_head_ce.py``'s ``F4_ZDZ_ENV``).

The final norm's row dot zdz = sum_k acc_k X_k gamma_k has to be the row dot of the very gradient B2's GEMM reads
(the rounded da): a zdz made from the logits keeps a per-token multiple of X in dX that a trained residual stream
sums coherently (docs/cute_backend.md, "Fifty-seventh session"). A row's zdz spans every N tile, so a tile's
epilogue cannot apply it; the head's dgrad GEMM keeps acc = da @ W in fp32 and this pass, one program per
``ROWS`` rows, reads each row once:

    zdz = sum_k (acc_k gamma_k) X_k;  corr = -(r * r / d) zdz;  D = acc * gamma + X * corr   (rounded to X's dtype)
    dgamma partial = sum over its rows of acc * X                                              (fp32, per program)

``norm_residual_bwd.norm_residual_apply`` (``zdz=None``) is the reference; the order of each row's sum and of the
dgamma partials differs, as any kernel's may (the GPU test's derived bound).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .row_vectors import fp32_reciprocal

ROWS = 16  # rows a program: 256 programs over a 4096-row chunk, a 2 MiB fp32 dgamma partial at d = 2048


@triton.jit
def norm_apply_kernel(acc_ptr, x_ptr, gamma_ptr, rstd_ptr, dx_ptr, dgp_ptr, w_ptr, t_ptr, c_ptr, M, D, inv_d,
                      ROWS: tl.constexpr, BLOCK: tl.constexpr, TX: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < D
    g = tl.load(gamma_ptr + cols, mask=inside, other=0.0)
    dg = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(ROWS):
        row = pid * ROWS + i
        live = row < M
        mask = cols < tl.where(live, D, 0)
        off = row.to(tl.int64) * D
        a = tl.load(acc_ptr + off + cols, mask=mask, other=0.0)
        if TX:  # (the target's term: c W[t], in fp32)
            t = tl.load(t_ptr + row, mask=live, other=0).to(tl.int64)
            c = tl.load(c_ptr + row, mask=live, other=0.0)
            a += c * tl.load(w_ptr + t * D + cols, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + off + cols, mask=mask, other=0.0).to(tl.float32)
        ag = a * g
        zdz = tl.sum(ag * x, axis=0)
        r = tl.load(rstd_ptr + row, mask=live, other=0.0)
        dx = ag + x * (-((r * r) * inv_d) * zdz)
        tl.store(dx_ptr + off + cols, dx.to(dx_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
        dg += a * x
    tl.store(dgp_ptr + pid.to(tl.int64) * D + cols, dg, mask=inside)


def norm_apply_rows(acc: torch.Tensor, x: torch.Tensor, gamma: torch.Tensor, rstd: torch.Tensor,
                    dx: torch.Tensor, tx: tuple | None = None) -> torch.Tensor:
    """B2's epilogue with zdz from ``acc`` (rows, d) fp32 contiguous: D written to ``dx`` (rows, d), contiguous,
    X's dtype; returns dgamma (d,) fp32 for these rows. ``gamma`` (d,), ``rstd`` (rows,), any float dtype.
    ``tx`` = (W, t, c) (``fp8_lm_head_dgrad``: the targets' exact term): each row's accumulator is first
    acc + c W[t] in fp32, W (V, d) contiguous, t (rows,) integer indices into its rows, c (rows,) fp32."""
    rows, d = acc.shape
    if acc.dtype != torch.float32 or not acc.is_contiguous():
        raise ValueError(f"the norm apply pass takes a contiguous fp32 accumulator, got {acc.dtype}")
    for name, t in (("x", x), ("dx", dx)):
        if t.shape != acc.shape or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous {tuple(acc.shape)}, got {tuple(t.shape)}")
    if dx.dtype != x.dtype or rstd.shape != (rows,) or gamma.shape != (d,):
        raise ValueError(f"dx {dx.dtype} (x {x.dtype}), rstd {tuple(rstd.shape)}, gamma {tuple(gamma.shape)} do not "
                         f"fit a ({rows}, {d}) accumulator")
    w, t, c = (acc, rstd, rstd) if tx is None else tx
    if tx is not None and (w.shape[1:] != (d,) or not w.is_contiguous() or t.shape != (rows,) or c.shape != (rows,)
                           or c.dtype != torch.float32):
        raise ValueError(f"tx takes a contiguous (V, {d}) W, and ({rows},) indices and fp32 factors, got "
                         f"{tuple(w.shape)}, {tuple(t.shape)}, {c.dtype} {tuple(c.shape)}")
    programs = triton.cdiv(rows, ROWS)
    parts = torch.empty((programs, d), device=acc.device, dtype=torch.float32)
    block = triton.next_power_of_2(d)
    norm_apply_kernel[(programs,)](acc, x, gamma.float().contiguous(), rstd.float().contiguous(), dx, parts, w, t, c,
                                   rows, d, fp32_reciprocal(d), ROWS=ROWS, BLOCK=block, TX=tx is not None,
                                   num_warps=8 if block <= 4096 else 16)
    return parts.sum(0)
