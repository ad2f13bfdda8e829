"""B2: GEMM + RMSNorm/residual backward (the dgrad GEMM of every norm consumer).

A consumer GEMM computed a = H @ W^T with H = X * gamma, and applied the deferred rstd in its
epilogue: p = r * a. The consumer's backward program (B1, B3 or the CE gradient) hands over
da = r * dp, the gradient of the unscaled a, and zdz = sum_n p_n * dp_n (one float per row). With
the gradient already flowing down the residual stream dX_res:

    acc = da @ W                                     (M, d), fp32  (= r * g, g = dL/d norm(X))
    D   = dX_res + acc * gamma - (r^2 / d) * X * zdz
    dgamma = sum_i acc[i] * X[i]                     (reduced over rows; per-tile partials on GPU)

This is the RMSNorm backward dX = r (g * gamma) - (r^3 / d) X sum_k g_k gamma_k X_k with the row
dot product replaced by zdz / r (the zdz identity of CODA.md), so the norm's input never has to be
re-read for a reduction first. The correction is one column vector, corr = -(r^2/d) * zdz.
D is returned in X's dtype, dgamma in the accumulator dtype.
"""

from __future__ import annotations

import torch

from ._common import check_2d, mm


def norm_residual_bwd_torch(
    *,
    da: torch.Tensor,
    weight: torch.Tensor,
    x: torch.Tensor,
    gamma: torch.Tensor,
    rstd: torch.Tensor,
    zdz: torch.Tensor,
    dresidual: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(D, dgamma). da (M, N), weight (N, d), x (M, d), rstd/zdz (M,), dresidual (M, d) or None."""
    check_2d("da", da, weight.shape[0])
    check_2d("x", x, weight.shape[1])
    return norm_residual_apply(mm(da, weight), x=x, gamma=gamma, rstd=rstd, zdz=zdz, dresidual=dresidual)


def norm_residual_apply(
    acc: torch.Tensor, *, x: torch.Tensor, gamma: torch.Tensor, rstd: torch.Tensor, zdz: torch.Tensor,
    dresidual: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """B2's epilogue on the dgrad accumulator ``acc`` = da @ W (its compute dtype): (D, dgamma)."""
    ct = acc.dtype
    r = rstd.to(ct)
    xf = x.to(ct)
    corr = -(r * r / x.shape[1]) * zdz.to(ct)
    dx = acc * gamma.to(ct) + xf * corr[:, None]
    if dresidual is not None:
        dx = dx + dresidual.to(ct)
    dgamma = (acc * xf).sum(0)
    return dx.to(x.dtype), dgamma
