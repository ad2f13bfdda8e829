"""B2's epilogue vectors in one Triton launch: the row vector corr = -(r^2 / d) * zdz and the column vector
w = gamma (times the fp8 dgrad's dequantization scale s_da * s_w), both fp32.

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

import numpy as np
import torch
import triton
import triton.language as tl

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
    inv_d = float(np.float32(1.0) / np.float32(d))  # (fp32 1/d, as aten's tensor / scalar; exact for powers of two)
    b2_vectors_kernel[(triton.cdiv(max(m, d), BLOCK),)](rstd, zdz, gamma, corr if sc is None else sc, corr, w, inv_d,
                                                        m, d, HAS_SC=sc is not None, BLOCK=BLOCK)
    return corr, w
