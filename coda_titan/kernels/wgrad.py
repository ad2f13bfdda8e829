"""Weight- and input-gradient GEMMs with fp32 accumulation.

    wgrad:  dW = grad^T @ (diag(row_scale) @ inp)           (N, K)
    dgrad:  dX = grad @ W                                    (M, K)

``row_scale`` folds the deferred rstd into the operand instead of materializing the normalized
activations n = r * X * gamma: for a norm consumer, dW = dp^T @ (r * H) with H = X * gamma as saved
by the producer epilogue. Outputs are in the weight's dtype.
"""

from __future__ import annotations

import torch

from ._common import acc_dtype, check_2d


def wgrad_torch(
    *, grad: torch.Tensor, inp: torch.Tensor, row_scale: torch.Tensor | None = None, out_dtype: torch.dtype
) -> torch.Tensor:
    check_2d("grad", grad)
    check_2d("inp", inp)
    if grad.shape[0] != inp.shape[0]:
        raise ValueError(f"grad and inp need the same rows, got {tuple(grad.shape)} and {tuple(inp.shape)}")
    ct = acc_dtype(grad, inp)
    a = inp.to(ct)
    if row_scale is not None:
        a = a * row_scale.to(ct)[:, None]
    return (grad.to(ct).t() @ a).to(out_dtype)


def dgrad_torch(*, grad: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    check_2d("grad", grad, weight.shape[0])
    return (grad @ weight).to(out_dtype)
