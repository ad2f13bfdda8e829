"""F2 / B3: GEMM + deferred rstd + SwiGLU, and its backward with the down-projection GEMM.

Layout: the gate and up projections are one (2F, d) weight W13 with rows *interleaved*
(``interleave_rows(w1, w3)``: gate row j at 2j, up row j at 2j + 1), so each gate column sits next
to its up column in the GEMM output tile and the epilogue can pair them. H = X * gamma comes from
the producer epilogue; r is the deferred rstd.

Forward (F2):
    a = H @ W13^T                         (M, 2F) *unscaled* pre-activations, saved for the backward
    z = r * a;  y = silu(z_gate) * z_up   (M, F)

Backward (B3), given D = dL/dX_out of the down-projection X_out = X + y @ W_down^T:
    dy      = D @ W_down                                  (the GEMM of B3)
    dz_up   = dy * silu(z_gate)
    dz_gate = dy * z_up * s * (1 + z_gate * (1 - s)),  s = sigmoid(z_gate)
    da      = r * dz                       gradient of the unscaled a: the deferred rstd is folded
                                           here, so both GEMMs that consume it (dgrad with W13 and
                                           dW13 = da^T @ H) are plain
    zdz     = sum_n z_n dz_n               per row, for the norm backward B2
    y       = silu(z_gate) * z_up          recomputed, for dW_down = D^T @ y
Saved: a and r (y is cheaper to recompute than to keep).
"""

from __future__ import annotations

import torch

from ._common import acc_dtype, check_2d, mm


def norm_swiglu_torch(*, h: torch.Tensor, rstd: torch.Tensor, w13: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, a): y (M, F) and the unscaled interleaved pre-activations a (M, 2F), both in h's dtype."""
    check_2d("h", h, w13.shape[1])
    acc = mm(h, w13.t())
    z = acc * rstd.to(acc.dtype)[:, None]
    y = torch.nn.functional.silu(z[:, 0::2]) * z[:, 1::2]
    return y.to(h.dtype), acc.to(h.dtype)


def swiglu_bwd_torch(
    *, dout: torch.Tensor, w_down: torch.Tensor, a: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(da, y, zdz) from D = ``dout`` (M, d), W_down (d, F), saved a (M, 2F) and r (M,)."""
    da, y, zdz = swiglu_bwd_acc(dout=dout, w_down=w_down, a=a, rstd=rstd)
    return da.to(a.dtype), y.to(a.dtype), zdz


def swiglu_bwd_acc(
    *, dout: torch.Tensor, w_down: torch.Tensor, a: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``swiglu_bwd``'s math in the accumulation dtype, before its outputs are cast (the fp8 B3
    quantizes da from these values)."""
    check_2d("dout", dout, w_down.shape[0])
    check_2d("a", a, 2 * w_down.shape[1])
    dy = mm(dout, w_down)
    ct = dy.dtype
    r = rstd.to(ct)[:, None]
    af = a.to(ct)
    zg, zu = af[:, 0::2] * r, af[:, 1::2] * r
    s = torch.sigmoid(zg)
    silu = zg * s
    dzu = dy * silu
    dzg = dy * zu * s * (1 + zg * (1 - s))
    zdz = (zg * dzg).sum(-1) + (zu * dzu).sum(-1)
    da = torch.stack([dzg * r, dzu * r], dim=-1).reshape(af.shape)
    return da, silu * zu, zdz
