"""Finalize: r = rsqrt(sum_t S[:, t] / d + eps).

Reads M * ceil(d / tile_n) partial sums instead of the M * d activations. r is (M,) fp32 (fp64 when
S is fp64). Non-differentiable: the consumer's backward accounts for dr through zdz.
"""

from __future__ import annotations

import torch


def rstd_finalize_torch(*, partials: torch.Tensor, dim: int, eps: float) -> torch.Tensor:
    if partials.dim() != 2:
        raise ValueError(f"partials must be (M, n_tiles), got {tuple(partials.shape)}")
    return torch.rsqrt(partials.sum(-1) / dim + eps)
