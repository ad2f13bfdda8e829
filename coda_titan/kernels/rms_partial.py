"""Partial RMS statistics: the epilogue shared by the prologue and by F1.

Forward (one row i, tiles t of width ``tile_n`` over the d columns):

    H[i, :]  = X[i, :] * gamma                  (the *un-normalized* input of the next GEMM)
    S[i, t]  = sum_{j in tile t} X[i, j]^2      (fp32 partial sums, finalized by ``rstd_finalize``)

No backward of its own: H and S are non-differentiable; the gradient of the norm is assembled by the
consumer's backward (``norm_residual_bwd``) through the zdz identity. Saves nothing.

``rms_partial`` alone is the embedding-norm prologue (no GEMM). ``residual_rms`` runs it as the
epilogue of the out-/down-projection GEMM.
"""

from __future__ import annotations

import torch

from ._common import acc_dtype, check_2d, tile_sumsq


def rms_partial_torch(*, x: torch.Tensor, gamma: torch.Tensor, tile_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(H, S) for X = ``x`` (M, d). H has x's dtype; S is (M, ceil(d/tile_n)) fp32 (fp64 for fp64 x)."""
    check_2d("x", x, gamma.shape[0])
    xf = x.to(acc_dtype(x, gamma))
    h = (xf * gamma.to(xf.dtype)).to(x.dtype)
    return h, tile_sumsq(xf, tile_n)
