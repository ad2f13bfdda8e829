"""F2 / B3: GEMM + deferred rstd + SwiGLU, and its backward with the down-projection GEMM.

Forward, W_gate = w1 (F, d), W_up = w3 (F, d), H = X * gamma from the producer epilogue:

    z = r * (H @ [W_gate; W_up]^T)        (M, 2F) pre-activations, saved for the backward
    y = silu(z_gate) * z_up               (M, F)

Backward (B3), given D = dL/dX_out of the down-projection X_out = X + y @ W_down^T:

    dy   = D @ W_down                                  (the GEMM of B3)
    dz_up   = dy * silu(z_gate)
    dz_gate = dy * z_up * s * (1 + z_gate * (1 - s)),  s = sigmoid(z_gate)
    zdz  = sum_n z_n dz_n                              (per row, for the norm backward B2)
    y    = silu(z_gate) * z_up                         (recomputed, for dW_down = D^T @ y)

Saved: z only (y is cheaper to recompute than to keep).
"""

from __future__ import annotations

import torch

from ._common import acc_dtype, check_2d, mm


def norm_swiglu_torch(
    *, h: torch.Tensor, rstd: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, z): y (M, F) in h's dtype, z (M, 2F) = [z_gate, z_up] in h's dtype."""
    check_2d("h", h, w_gate.shape[1])
    acc = mm(h, torch.cat([w_gate, w_up]).t())
    z = acc * rstd.to(acc.dtype)[:, None]
    zg, zu = z.chunk(2, dim=-1)
    y = torch.nn.functional.silu(zg) * zu
    return y.to(h.dtype), z.to(h.dtype)


def swiglu_bwd_torch(
    *, dout: torch.Tensor, w_down: torch.Tensor, z: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dz, y, zdz) from D = ``dout`` (M, d), W_down (d, F), saved z (M, 2F)."""
    check_2d("dout", dout, w_down.shape[0])
    dy = mm(dout, w_down)
    ct = dy.dtype
    zg, zu = z.to(ct).chunk(2, dim=-1)
    s = torch.sigmoid(zg)
    silu = zg * s
    dzu = dy * silu
    dzg = dy * zu * s * (1 + zg * (1 - s))
    dz = torch.cat([dzg, dzu], dim=-1)
    zdz = (zg * dzg).sum(-1) + (zu * dzu).sum(-1)
    y = silu * zu
    return dz.to(z.dtype), y.to(z.dtype), zdz
