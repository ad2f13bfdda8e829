"""Weight- and input-gradient GEMMs with fp32 accumulation.

    wgrad:  dW = grad^T @ inp            (N, K)
    dgrad:  dX = grad @ W                (M, K)

No row scales are needed: every backward program folds the deferred rstd into the gradient it
produces (da = r * dp, see ``norm_residual_bwd``), so for a norm consumer dW = da^T @ H with
H = X * gamma exactly as the producer epilogue saved it. Outputs are in ``out_dtype``.
"""

from __future__ import annotations

import torch

from ._common import acc_dtype, check_2d


def wgrad_torch(*, grad: torch.Tensor, inp: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    check_2d("grad", grad)
    check_2d("inp", inp)
    if grad.shape[0] != inp.shape[0]:
        raise ValueError(f"grad and inp need the same rows, got {tuple(grad.shape)} and {tuple(inp.shape)}")
    ct = acc_dtype(grad, inp)
    return (grad.to(ct).t() @ inp.to(ct)).to(out_dtype)


def dgrad_torch(*, grad: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    check_2d("grad", grad, weight.shape[0])
    return (grad @ weight).to(out_dtype)
