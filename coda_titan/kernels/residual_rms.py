"""F1: GEMM + residual add + partial RMS (the out-projection and the down-projection).

Forward, with acc = y @ W^T (fp32 accumulator), W (d, K) as in nn.Linear:

    X = acc + x_res                  new residual stream, stored in x_res's dtype
    H = X * gamma_next               the next norm's input, un-normalized (deferred rstd)
    S = per-tile sum of X^2          (M, ceil(d/tile_n)) fp32 partials

Backward (run by the autograd wiring in ``coda_titan.model.programs``): the consumer of H returns
the fully assembled residual gradient D (norm backward + residual add, see ``norm_residual_bwd``),
so F1's backward is two plain GEMMs: dy = D @ W (``dgrad``) and dW = D^T @ y (``wgrad``);
d x_res = D.
Saved: y and W (both alive anyway).
"""

from __future__ import annotations

import torch

from ._common import acc_dtype, check_2d, mm, tile_sumsq


def residual_acc(y: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """X = y @ W^T + x_res in the accumulator dtype (not yet rounded): F1's GEMM and residual add."""
    check_2d("y", y, weight.shape[1])
    check_2d("residual", residual, weight.shape[0])
    acc = mm(y, weight.t())
    return acc + residual.to(acc.dtype)


def residual_rms_torch(
    *, y: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, gamma: torch.Tensor, tile_n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(X, H, S) for one F1 program. y (M, K), weight (d, K), residual (M, d), gamma (d,)."""
    x = residual_acc(y, weight, residual)
    h = (x * gamma.to(x.dtype)).to(residual.dtype)
    s = tile_sumsq(x, tile_n)
    # The stored residual is rounded once; S and H come from the same fp32 value, as in the epilogue.
    return x.to(residual.dtype), h, s
