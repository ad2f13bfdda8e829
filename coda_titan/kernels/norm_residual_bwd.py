"""B2 norm_residual_bwd: GEMM + RMSNorm/residual backward (the dgrad GEMM of every norm consumer).

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

``norm_residual_bwd_fp8`` (precision = "fp8", ``fp8_dgrad`` / ``fp8_mlp_dgrad``): the same epilogue
behind acc = daq @ W^T on an e5m2 gradient and the e4m3 transposed weight of the weight pass, in
units of s_da * s_w; the kernel folds that scale into the gamma row vector and the dgamma partials.
It also returns amax |D| (of D as returned, in the compute dtype): D is the residual-stream gradient
the layer below casts to e5m2 at its current amax (``casts.quantize_grad``), which takes this one
instead of reducing D again (the epilogue reduces it per tile).
"""

from __future__ import annotations

import os

import torch

from typing import Optional

from ._common import ZDZ_ENV, acc_dtype, check_2d, mm, program_op, zdz_of_acc
from .scaling import E4M3, E5M2, amax_abs, compute_dtype


def norm_residual_bwd(
    *,
    da: torch.Tensor,
    weight: torch.Tensor,
    x: torch.Tensor,
    gamma: torch.Tensor,
    rstd: torch.Tensor,
    zdz: torch.Tensor,
    dresidual: torch.Tensor | None,
    weight2: torch.Tensor | None = None,
    weight3: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(D, dgamma). da (M, N), weight (N, d), x (M, d), rstd/zdz (M,), dresidual (M, d) or None; with
    ``weight2`` (and ``weight3``) the weight is [weight; weight2; weight3] (N rows; ``[coda] stacked_weights``)."""
    weight = weight if weight2 is None else torch.cat([w for w in (weight, weight2, weight3) if w is not None])
    check_2d("da", da, weight.shape[0])
    check_2d("x", x, weight.shape[1])
    return norm_residual_apply(mm(da, weight), x=x, gamma=gamma, rstd=rstd, zdz=zdz, dresidual=dresidual)


def norm_residual_apply(
    acc: torch.Tensor, *, x: torch.Tensor, gamma: torch.Tensor, rstd: torch.Tensor, zdz: torch.Tensor | None,
    dresidual: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """B2's epilogue on the dgrad accumulator ``acc`` = da @ W (its compute dtype): (D, dgamma). ``zdz=None``: the
    row dot from ``acc`` itself, sum_k acc_k X_k gamma_k: the zdz of the very gradient ``acc`` was made from,
    whatever that gradient's rounding (the LM head's ``F4_ZDZ_ENV=acc``)."""
    ct = acc.dtype
    r = rstd.to(ct)
    xf = x.to(ct)
    if zdz is None or os.environ.get(ZDZ_ENV) == "dgrad_all":  # ("dgrad_all": a probe's arm, every norm's so)
        zdz = zdz_of_acc(acc, xf, gamma)
    corr = -(r * r / x.shape[1]) * zdz.to(ct)
    dx = acc * gamma.to(ct) + xf * corr[:, None]
    if dresidual is not None:
        dx = dx + dresidual.to(ct)
    dgamma = (acc * xf).sum(0)
    return dx.to(x.dtype), dgamma


def norm_residual_bwd_fp8(
    *, daq: torch.Tensor, weight_tq: torch.Tensor, scale: torch.Tensor, x: torch.Tensor, gamma: torch.Tensor,
    rstd: torch.Tensor, zdz: torch.Tensor | None, dresidual: torch.Tensor | None, extra: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """B2 on fp8 operands: acc = daq @ weight_tq^T (e5m2 or e4m3 x e4m3, exact products, fp32 sum;
    weight_tq is W^T, (d, N)), in units of ``scale`` = s_da * s_w (plus ``extra``, (rows, d), when given), then
    ``norm_residual_bwd``'s epilogue: (D, dgamma, amax |D|) (``zdz=None``: ``norm_residual_apply``'s, the row dot
    of acc)."""
    check_2d("daq", daq, weight_tq.shape[1])
    check_2d("x", x, weight_tq.shape[0])
    if daq.dtype not in (E4M3, E5M2) or weight_tq.dtype != E4M3:
        raise TypeError(f"B2 fp8 takes an e5m2/e4m3 gradient and an e4m3 weight, got {daq.dtype} and {weight_tq.dtype}")
    ct = compute_dtype(x.dtype)
    acc = (daq.to(ct) @ weight_tq.to(ct).t()) * scale.to(ct)
    acc = acc if extra is None else acc + extra.to(ct)
    dx, dgamma = norm_residual_apply(acc, x=x, gamma=gamma, rstd=rstd, zdz=zdz, dresidual=dresidual)
    return dx, dgamma, amax_abs(dx).to(ct)


# --- custom ops ------------------------------------------------------------------------------------


@program_op("norm_residual_bwd")
def norm_residual_bwd_op(
    da: torch.Tensor, weight: torch.Tensor, x: torch.Tensor, gamma: torch.Tensor, rstd: torch.Tensor,
    zdz: torch.Tensor, dresidual: Optional[torch.Tensor], weight2: Optional[torch.Tensor] = None,
    weight3: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return norm_residual_bwd(da=da, weight=weight, x=x, gamma=gamma, rstd=rstd, zdz=zdz, dresidual=dresidual,
                             weight2=weight2, weight3=weight3)


@norm_residual_bwd_op.register_fake
def _(da, weight, x, gamma, rstd, zdz, dresidual, weight2=None, weight3=None):
    return torch.empty_like(x), x.new_empty((x.shape[1],), dtype=acc_dtype(da, weight))


@program_op("norm_residual_bwd_fp8")
def norm_residual_bwd_fp8_op(
    daq: torch.Tensor, weight_tq: torch.Tensor, scale: torch.Tensor, x: torch.Tensor, gamma: torch.Tensor,
    rstd: torch.Tensor, zdz: torch.Tensor, dresidual: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return norm_residual_bwd_fp8(
        daq=daq, weight_tq=weight_tq, scale=scale, x=x, gamma=gamma, rstd=rstd, zdz=zdz, dresidual=dresidual
    )


@norm_residual_bwd_fp8_op.register_fake
def _(daq, weight_tq, scale, x, gamma, rstd, zdz, dresidual):
    ct = compute_dtype(x.dtype)
    return torch.empty_like(x), x.new_empty((x.shape[1],), dtype=ct), x.new_empty((), dtype=ct)
