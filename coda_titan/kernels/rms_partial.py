"""Partial RMS statistics: the prologue's epilogue, shared with F1, and the finalize step.

Forward (one row i, tiles t of width ``tile_n`` over the d columns):

    H[i, :]  = X[i, :] * gamma                  (the *un-normalized* input of the next GEMM)
    S[i, t]  = sum_{j in tile t} X[i, j]^2      (fp32 partial sums)
    r[i]     = rsqrt(sum_t S[i, t] / d + eps)   (``rstd_finalize``: reads M * ceil(d / tile_n)
                                                  floats, not M * d)

No backward of its own: H, S and r are non-differentiable; the gradient of the norm is assembled
by the consumer's backward (``norm_residual_bwd``) through the zdz identity. Saves nothing.

``rms_partial`` alone is the embedding-norm prologue (no GEMM); ``residual_rms`` runs the same
epilogue behind the out-/down-projection GEMM. ``rms_partial_fp8`` also writes the next consumer's
e4m3 operand Hq = sat(H * inv) and amax |H| (``h_and_q``, shared with ``residual_rms_fp8``).

The ops return S as (M, 1): the kernel folds its per-tile partials itself, and ``rstd_finalize``
only ever sums S over its last dim.
"""

from __future__ import annotations

from typing import Optional

import torch

from ._common import acc_dtype, check_2d, program_op, tile_sumsq
from .scaling import E4M3, inv_scale_from_amax, quantize_e4m3


def rms_partial(*, x: torch.Tensor, gamma: torch.Tensor, tile_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(H, S) for X = ``x`` (M, d). H has x's dtype; S is (M, ceil(d/tile_n)) fp32 (fp64 for fp64 x)."""
    check_2d("x", x, gamma.shape[0])
    xf = x.to(acc_dtype(x, gamma))
    h = (xf * gamma.to(xf.dtype)).to(x.dtype)
    return h, tile_sumsq(xf, tile_n)


def h_and_q(xf: torch.Tensor, gamma: torch.Tensor, inv_scale: torch.Tensor | None, out_dtype: torch.dtype):
    """(H, Hq, amax |H|) from X in its compute dtype; ``inv_scale=None`` quantizes with the current amax."""
    hf = xf * gamma.to(xf.dtype)
    amax = hf.abs().amax()
    inv = inv_scale_from_amax(amax) if inv_scale is None else inv_scale
    return hf.to(out_dtype), quantize_e4m3(hf, inv), amax


def rms_partial_fp8(
    *, x: torch.Tensor, gamma: torch.Tensor, tile_n: int, inv_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(H, S, Hq, amax) of the prologue; ``inv_scale=None`` quantizes with the current amax."""
    check_2d("x", x, gamma.shape[0])
    xf = x.to(acc_dtype(x, gamma))
    h, hq, amax = h_and_q(xf, gamma, inv_scale, x.dtype)
    return h, tile_sumsq(xf, tile_n), hq, amax


def rstd_finalize(*, partials: torch.Tensor, dim: int, eps: float) -> torch.Tensor:
    """r = rsqrt(sum_t S[:, t] / dim + eps), (M,) in S's dtype."""
    if partials.dim() != 2:
        raise ValueError(f"partials must be (M, n_tiles), got {tuple(partials.shape)}")
    return torch.rsqrt(partials.sum(-1) / dim + eps)


# --- custom ops ------------------------------------------------------------------------------------


@program_op("rms_partial")
def rms_partial_op(x: torch.Tensor, gamma: torch.Tensor, tile_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    h, s = rms_partial(x=x, gamma=gamma, tile_n=tile_n)
    return h, s.sum(-1, keepdim=True)


@rms_partial_op.register_fake
def _(x, gamma, tile_n):
    return torch.empty_like(x), x.new_empty((x.shape[0], 1), dtype=acc_dtype(x, gamma))


@program_op("rms_partial_fp8")
def rms_partial_fp8_op(
    x: torch.Tensor, gamma: torch.Tensor, tile_n: int, inv_scale: Optional[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    h, s, hq, amax = rms_partial_fp8(x=x, gamma=gamma, tile_n=tile_n, inv_scale=inv_scale)
    return h, s.sum(-1, keepdim=True), hq, amax


@rms_partial_fp8_op.register_fake
def _(x, gamma, tile_n, inv_scale):
    ct = acc_dtype(x, gamma)
    return (
        torch.empty_like(x), x.new_empty((x.shape[0], 1), dtype=ct),
        x.new_empty(x.shape, dtype=E4M3), x.new_empty((), dtype=ct),
    )


@program_op("rstd_finalize")
def rstd_finalize_op(partials: torch.Tensor, dim: int, eps: float) -> torch.Tensor:
    return rstd_finalize(partials=partials, dim=dim, eps=eps)


@rstd_finalize_op.register_fake
def _(partials, dim, eps):
    return partials.new_empty((partials.shape[0],))
