"""B2: GEMM + RMSNorm/residual backward (the dgrad GEMM of every norm consumer).

A consumer GEMM computed p = r * (H @ W^T) with H = X * gamma. Given dp (its output gradient),
zdz = sum_n p_n * dp_n (one float per row, produced by whichever program made dp), and the
gradient already flowing down the residual stream dX_res:

    acc = dp @ W                                     (M, d), fp32
    D   = dX_res + r * (acc * gamma) - (r^2 / d) * X * zdz
    dgamma = sum_i acc[i] * X[i] * r[i]              (reduced over rows; per-tile partials on GPU)

This is the RMSNorm backward with its row dot product sum_k g_k gamma_k x_k replaced by zdz / r
(the zdz identity of CODA.md), so the norm's input never has to be re-read for a reduction first.
D is returned in X's dtype, dgamma in the accumulator dtype.
"""

from __future__ import annotations

import torch

from ._common import acc_dtype, check_2d, mm


def norm_residual_bwd_torch(
    *,
    dp: torch.Tensor,
    weight: torch.Tensor,
    x: torch.Tensor,
    gamma: torch.Tensor,
    rstd: torch.Tensor,
    zdz: torch.Tensor,
    dresidual: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(D, dgamma). dp (M, N), weight (N, d), x (M, d), rstd/zdz (M,), dresidual (M, d) or None."""
    check_2d("dp", dp, weight.shape[0])
    check_2d("x", x, weight.shape[1])
    acc = mm(dp, weight)
    ct = acc.dtype
    r = rstd.to(ct)[:, None]
    xf = x.to(ct)
    d = x.shape[1]
    dx = r * (acc * gamma.to(ct)) - (r * r / d) * xf * zdz.to(ct)[:, None]
    if dresidual is not None:
        dx = dx + dresidual.to(ct)
    dgamma = (acc * xf * r).sum(0)
    return dx.to(x.dtype), dgamma
