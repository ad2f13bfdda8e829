"""F1 residual_rms: GEMM + residual add + partial RMS (the out-projection and the down-projection).

Forward, with acc = y @ W^T (fp32 accumulator), W (d, K) as in nn.Linear:

    X = acc + x_res                  new residual stream, stored in x_res's dtype
    H = X * gamma_next               the next norm's input, un-normalized (deferred rstd)
    S = per-tile sum of X^2          (M, ceil(d/tile_n)) fp32 partials (see ``rms_partial``)

``residual_rms_fp8`` (precision = "fp8"): the same bf16 GEMM, whose epilogue also writes the next
consumer's e4m3 operand Hq = sat(H * inv) and reports amax |H| (inv: the site's delayed scale;
None = the current amax, the calibration step).

``residual_rms_q`` / ``residual_rms_q_fp8``: the same programs with an fp8 mainloop, acc = scale *
(yq @ Wq^T) on e4m3 operands (scale = s_y * s_w, their dequantization scales), for the
down-projection and the out-projection forward in fp8 (``fp8_down_proj``, ``fp8_out_proj``).
``residual_rms_q_fp8_t`` also writes Hq^T (d, M), the next consumer's weight-gradient operand
(``fp8_mlp_h_t``, ``fp8_qkv_wgrad``), and not H: its consumers read Hq and Hq^T only.

Backward (``coda_titan.model.autograd``): the consumer of H returns the fully assembled residual
gradient D (norm backward + residual add, see ``norm_residual_bwd``), so F1's backward is two
plain GEMMs: dy = D @ W (``gemm.dgrad``) and dW = D^T @ y (``gemm.wgrad``); d x_res = D.
Saved: y and W (both alive anyway).
"""

from __future__ import annotations

from typing import Optional

import torch

from ._common import acc_dtype, check_2d, mm, program_op, tile_sumsq
from .recompute import skip_tail
from .rms_partial import h_and_q
from .scaling import E4M3, compute_dtype, fp8_mm


def residual_acc(y: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """X = y @ W^T + x_res in the accumulator dtype (not yet rounded): F1's GEMM and residual add."""
    check_2d("y", y, weight.shape[1])
    check_2d("residual", residual, weight.shape[0])
    acc = mm(y, weight.t())
    return acc + residual.to(acc.dtype)


def residual_rms(
    *, y: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, gamma: torch.Tensor, tile_n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(X, H, S) for one F1 program. y (M, K), weight (d, K), residual (M, d), gamma (d,)."""
    x = residual_acc(y, weight, residual)
    h = (x * gamma.to(x.dtype)).to(residual.dtype)
    s = tile_sumsq(x, tile_n)
    # The stored residual is rounded once; S and H come from the same fp32 value, as in the epilogue.
    return x.to(residual.dtype), h, s


def residual_rms_fp8(
    *, y: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, gamma: torch.Tensor, tile_n: int,
    inv_scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(X, H, S, Hq, amax): F1 (bf16 GEMM) whose epilogue also quantizes H for the next consumer."""
    xf = residual_acc(y, weight, residual)
    h, hq, amax = h_and_q(xf, gamma, inv_scale, residual.dtype)
    return xf.to(residual.dtype), h, tile_sumsq(xf, tile_n), hq, amax


def residual_q_acc(yq: torch.Tensor, wq: torch.Tensor, scale: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """X = scale * (yq @ Wq^T) + x_res in the accumulator dtype, from e4m3 operands: the products are
    exact and summed in fp32 (the tensor core's accumulator; fp64 for fp64 residuals, in tests)."""
    check_2d("yq", yq, wq.shape[1])
    check_2d("residual", residual, wq.shape[0])
    ct = compute_dtype(residual.dtype)
    return fp8_mm(yq, wq, ct) * scale.to(ct) + residual.to(ct)


def residual_rms_q(
    *, yq: torch.Tensor, wq: torch.Tensor, scale: torch.Tensor, residual: torch.Tensor, gamma: torch.Tensor,
    tile_n: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(X, H, S) of F1 on e4m3 yq (M, K) and Wq (d, K); ``scale`` = s_y * s_w (0-dim)."""
    x = residual_q_acc(yq, wq, scale, residual)
    return x.to(residual.dtype), (x * gamma.to(x.dtype)).to(residual.dtype), tile_sumsq(x, tile_n)


def residual_rms_q_fp8(
    *, yq: torch.Tensor, wq: torch.Tensor, scale: torch.Tensor, residual: torch.Tensor, gamma: torch.Tensor,
    tile_n: int, inv_scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(X, H, S, Hq, amax): ``residual_rms_q`` whose epilogue also quantizes H for the next consumer."""
    xf = residual_q_acc(yq, wq, scale, residual)
    h, hq, amax = h_and_q(xf, gamma, inv_scale, residual.dtype)
    return xf.to(residual.dtype), h, tile_sumsq(xf, tile_n), hq, amax


def residual_rms_q_fp8_t(
    *, yq: torch.Tensor, wq: torch.Tensor, scale: torch.Tensor, residual: torch.Tensor, gamma: torch.Tensor,
    tile_n: int, inv_scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(X, S, Hq, Hq^T, amax): ``residual_rms_q_fp8`` that also writes Hq transposed, (d, M) token-major
    (the consumer's weight gradient reads the forward's codes as cuBLAS takes them: ``fp8_mlp_h_t``,
    ``fp8_qkv_wgrad``), and not the bf16 H, which no consumer of this form reads."""
    x, _, s, hq, amax = residual_rms_q_fp8(yq=yq, wq=wq, scale=scale, residual=residual, gamma=gamma, tile_n=tile_n,
                                           inv_scale=inv_scale)
    return x, s, hq, hq.t().contiguous(), amax


# --- custom ops ------------------------------------------------------------------------------------


@program_op("residual_rms")
def residual_rms_op(
    y: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, gamma: torch.Tensor, tile_n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x, h, s = residual_rms(y=y, weight=weight, residual=residual, gamma=gamma, tile_n=tile_n)
    return x, h, s.sum(-1, keepdim=True)


@residual_rms_op.register_fake
def _(y, weight, residual, gamma, tile_n):
    s = residual.new_empty((residual.shape[0], 1), dtype=acc_dtype(y, weight))
    return torch.empty_like(residual), torch.empty_like(residual), s


@program_op("residual_rms_fp8")
def residual_rms_fp8_op(
    y: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, gamma: torch.Tensor, tile_n: int,
    inv_scale: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    x, h, s, hq, amax = residual_rms_fp8(
        y=y, weight=weight, residual=residual, gamma=gamma, tile_n=tile_n, inv_scale=inv_scale
    )
    return x, h, s.sum(-1, keepdim=True), hq, amax


@residual_rms_fp8_op.register_fake
def _(y, weight, residual, gamma, tile_n, inv_scale):
    ct = acc_dtype(y, weight)
    return (
        torch.empty_like(residual), torch.empty_like(residual), residual.new_empty((residual.shape[0], 1), dtype=ct),
        residual.new_empty(residual.shape, dtype=E4M3), residual.new_empty((), dtype=ct),
    )


@program_op("residual_rms_q")
def residual_rms_q_op(
    yq: torch.Tensor, wq: torch.Tensor, scale: torch.Tensor, residual: torch.Tensor, gamma: torch.Tensor, tile_n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x, h, s = residual_rms_q(yq=yq, wq=wq, scale=scale, residual=residual, gamma=gamma, tile_n=tile_n)
    return x, h, s.sum(-1, keepdim=True)


@residual_rms_q_op.register_fake
def _(yq, wq, scale, residual, gamma, tile_n):
    s = residual.new_empty((residual.shape[0], 1), dtype=compute_dtype(residual.dtype))
    return torch.empty_like(residual), torch.empty_like(residual), s


@program_op("residual_rms_q_fp8")
def residual_rms_q_fp8_op(
    yq: torch.Tensor, wq: torch.Tensor, scale: torch.Tensor, residual: torch.Tensor, gamma: torch.Tensor, tile_n: int,
    inv_scale: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    x, h, s, hq, amax = residual_rms_q_fp8(
        yq=yq, wq=wq, scale=scale, residual=residual, gamma=gamma, tile_n=tile_n, inv_scale=inv_scale
    )
    return x, h, s.sum(-1, keepdim=True), hq, amax


@residual_rms_q_fp8_op.register_fake
def _(yq, wq, scale, residual, gamma, tile_n, inv_scale):
    ct = compute_dtype(residual.dtype)
    return (
        torch.empty_like(residual), torch.empty_like(residual), residual.new_empty((residual.shape[0], 1), dtype=ct),
        residual.new_empty(residual.shape, dtype=E4M3), residual.new_empty((), dtype=ct),
    )


@program_op("residual_rms_q_fp8_t")
def residual_rms_q_fp8_t_op(
    yq: torch.Tensor, wq: torch.Tensor, scale: torch.Tensor, residual: torch.Tensor, gamma: torch.Tensor, tile_n: int,
    inv_scale: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    x, s, hq, hq_t, amax = residual_rms_q_fp8_t(
        yq=yq, wq=wq, scale=scale, residual=residual, gamma=gamma, tile_n=tile_n, inv_scale=inv_scale
    )
    return x, s.sum(-1, keepdim=True), hq, hq_t, amax


@residual_rms_q_fp8_t_op.register_fake
def _(yq, wq, scale, residual, gamma, tile_n, inv_scale):
    # (residual_rms_q_fp8's fake, not its op: a kernel's recompute skip calls this on real tensors)
    x, _, s, hq, amax = residual_rms_q_fp8_op._abstract_fn(yq, wq, scale, residual, gamma, tile_n, inv_scale)
    return x, s, hq, hq.new_empty((hq.shape[1], hq.shape[0])), amax


# In full activation checkpointing's recompute the block's down-projection F1 is not run (its outputs are
# dropped: ``recompute``); the ops' CPU kernels skip it as the CUDA kernels do, so the CPU tests run that path.
for _op in (residual_rms_op, residual_rms_fp8_op, residual_rms_q_op, residual_rms_q_fp8_op, residual_rms_q_fp8_t_op):
    torch.library.register_kernel(_op, "cpu")(skip_tail(_op)(_op.reference))
