"""Autograd wiring of the CODA programs: each Function's backward *runs the backward programs*.

Gradient plan (CODA.md): a producer epilogue (F1 or the prologue) writes X, H = X * gamma and the
partial sums S; H and S are non-differentiable. The consumer of H (F2, F3 or F4) owns the norm's
backward: from its output gradient it makes da = r * dp and zdz, runs B2 (dgrad GEMM + norm/residual
epilogue) and returns the *assembled* residual gradient D for X, plus dgamma. For that it needs the
gradient already flowing down the residual stream, so:

* the MLP sub-layer (F2 -> F1) is one Function: its input X is also the down-projection's residual;
* the QKV Function (F3) passes X through as an extra output ``x_pass``, which the out-projection F1
  uses as its residual; autograd therefore hands F3's backward the residual gradient together with
  dq/dk/dv (autograd runs a node's backward only when all of its outputs' gradients are in).

F1's own backward is then just two GEMMs (dgrad, wgrad). F4 makes every gradient in its forward,
chunk by chunk, and its backward only scales them by the incoming scalar.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import Backend
from ..kernels._common import deinterleave_rows, interleave_rows


@dataclass(frozen=True)
class ProgramConfig:
    backend: Backend
    tile_n: int
    eps: float
    ce_chunk_rows: int


def _split_rows(t: torch.Tensor, sizes: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(t.split(list(sizes), dim=0))


class ResidualRMS(torch.autograd.Function):
    """F1: X = y @ W^T + residual; H = X * gamma_next; S partials. Backward: dgrad + wgrad."""

    @staticmethod
    def forward(ctx, y, weight, residual, gamma_next, cfg: ProgramConfig):
        x, h, s = cfg.backend.residual_rms(y=y, weight=weight, residual=residual, gamma=gamma_next, tile_n=cfg.tile_n)
        ctx.mark_non_differentiable(h, s)
        ctx.save_for_backward(y, weight)
        ctx.cfg = cfg
        return x, h, s

    @staticmethod
    def backward(ctx, dx, _dh, _ds):
        y, weight = ctx.saved_tensors
        be = ctx.cfg.backend
        dy = be.dgrad(grad=dx, weight=weight, out_dtype=y.dtype)
        dw = be.wgrad(grad=dx, inp=y, out_dtype=weight.dtype)
        return dy, dw, dx, None, None


class NormRoPE(torch.autograd.Function):
    """F3 (QKV GEMM + deferred rstd + RoPE); backward B1 (RoPE bwd + zdz) -> B2 -> wgrad."""

    @staticmethod
    def forward(ctx, h, rstd, x, gamma, wq, wk, wv, freqs, seqlen, cfg: ProgramConfig, n_rope_heads: int, head_dim: int):
        w = torch.cat([wq, wk, wv])
        qkv = cfg.backend.norm_rope(
            h=h, rstd=rstd, weight=w, freqs=freqs, seqlen=seqlen, n_rope_heads=n_rope_heads, head_dim=head_dim
        )
        ctx.save_for_backward(h, rstd, x, gamma, wq, wk, wv, freqs, qkv)
        ctx.cfg, ctx.seqlen, ctx.n_rope_heads, ctx.head_dim = cfg, seqlen, n_rope_heads, head_dim
        return qkv, x.view_as(x)

    @staticmethod
    def backward(ctx, dqkv, dx_res):
        h, rstd, x, gamma, wq, wk, wv, freqs, qkv = ctx.saved_tensors
        be = ctx.cfg.backend
        da, zdz = be.rope_bwd(
            dy=dqkv.contiguous(), y=qkv, rstd=rstd, freqs=freqs, seqlen=ctx.seqlen,
            n_rope_heads=ctx.n_rope_heads, head_dim=ctx.head_dim,
        )
        w = torch.cat([wq, wk, wv])
        dx, dgamma = be.norm_residual_bwd(da=da, weight=w, x=x, gamma=gamma, rstd=rstd, zdz=zdz, dresidual=dx_res)
        dw = be.wgrad(grad=da, inp=h, out_dtype=w.dtype)
        dwq, dwk, dwv = _split_rows(dw, (wq.shape[0], wk.shape[0], wv.shape[0]))
        return None, None, dx, dgamma.to(gamma.dtype), dwq, dwk, dwv, None, None, None, None, None


class NormSwiGLUResidual(torch.autograd.Function):
    """MLP sub-layer: F2 (W13 GEMM + rstd + SwiGLU) then F1 (W2 GEMM + residual + partial RMS).

    W13 is w1 and w3 with rows interleaved (a runtime view, see ``interleave_rows``). Backward: B3
    (D @ W2 + SwiGLU bwd + zdz), dW2, B2 (da @ W13 + norm/residual bwd), dW13.
    """

    @staticmethod
    def forward(ctx, h, rstd, x, gamma, w1, w3, w2, gamma_next, cfg: ProgramConfig):
        be = cfg.backend
        w13 = interleave_rows(w1, w3)
        y, a = be.norm_swiglu(h=h, rstd=rstd, w13=w13)
        x_out, h_out, s_out = be.residual_rms(y=y, weight=w2, residual=x, gamma=gamma_next, tile_n=cfg.tile_n)
        ctx.mark_non_differentiable(h_out, s_out)
        ctx.save_for_backward(h, rstd, x, gamma, w1, w3, w2, a)
        ctx.cfg = cfg
        return x_out, h_out, s_out

    @staticmethod
    def backward(ctx, dx_out, _dh, _ds):
        h, rstd, x, gamma, w1, w3, w2, a = ctx.saved_tensors
        be = ctx.cfg.backend
        da, y, zdz = be.swiglu_bwd(dout=dx_out, w_down=w2, a=a, rstd=rstd)
        dw2 = be.wgrad(grad=dx_out, inp=y, out_dtype=w2.dtype)
        w13 = interleave_rows(w1, w3)
        dx, dgamma = be.norm_residual_bwd(da=da, weight=w13, x=x, gamma=gamma, rstd=rstd, zdz=zdz, dresidual=dx_out)
        dw13 = be.wgrad(grad=da, inp=h, out_dtype=w13.dtype)
        dw1, dw3 = deinterleave_rows(dw13)
        return None, None, dx, dgamma.to(gamma.dtype), dw1, dw3, dw2, None, None


class LMHeadCE(torch.autograd.Function):
    """F4: chunked LM head + CE; the gradients are made in the forward and scaled in the backward."""

    @staticmethod
    def forward(ctx, h, rstd, x, gamma, weight, targets, cfg: ProgramConfig, compute_grad: bool):
        loss, dx, dgamma, dw = cfg.backend.lm_head_ce(
            h=h, rstd=rstd, x=x, gamma=gamma, weight=weight, targets=targets,
            chunk_rows=cfg.ce_chunk_rows, compute_grad=compute_grad,
        )
        if compute_grad:
            ctx.save_for_backward(dx, dgamma, dw)
            ctx.gamma_dtype = gamma.dtype
        return loss

    @staticmethod
    def backward(ctx, dloss):
        dx, dgamma, dw = ctx.saved_tensors
        g = dloss.to(dgamma.dtype)
        dgamma = (dgamma * g).to(ctx.gamma_dtype)
        return None, None, dx * g.to(dx.dtype), dgamma, dw * g.to(dw.dtype), None, None, None
