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
from ..kernels.fp8 import E5M2_MAX, inv_scale_from_amax


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
        return _residual_rms_backward(ctx, dx)


# The backward bodies are plain functions so that the FP8 Functions below can share them (dynamo
# cannot trace one Function's backward calling another Function's).


def _residual_rms_backward(ctx, dx):
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
        return _norm_rope_backward(ctx, dqkv, dx_res)


def _norm_rope_backward(ctx, dqkv, dx_res):
    h, rstd, x, gamma, wq, wk, wv, freqs, qkv, *fp8 = ctx.saved_tensors
    be = ctx.cfg.backend
    kw = dict(dy=dqkv.contiguous(), y=qkv, rstd=rstd, freqs=freqs, seqlen=ctx.seqlen,
              n_rope_heads=ctx.n_rope_heads, head_dim=ctx.head_dim)
    w = torch.cat([wq, wk, wv])
    if fp8 and fp8[0] is not None:  # NormRoPEFp8 with fp8_dgrad: B1 casts da to e5m2, B2 runs on it and W_qkv,q^T
        w_t8, s_w = fp8
        da, zdz, daq, s_da = be.rope_bwd_fp8(**kw)
        dx, dgamma = be.norm_residual_bwd_fp8(
            daq=daq, weight_tq=w_t8, scale=s_da * s_w, x=x, gamma=gamma, rstd=rstd, zdz=zdz, dresidual=dx_res
        )
    else:
        da, zdz = be.rope_bwd(**kw)
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
        return _norm_swiglu_residual_backward(ctx, dx_out)[0]


def _norm_swiglu_residual_backward(ctx, dx_out):
    """The MLP's backward; also returns amax |da| when B3 wrote e5m2 da (else None)."""
    h, rstd, x, gamma, w1, w3, w2, a, *fp8 = ctx.saved_tensors
    be = ctx.cfg.backend
    w13 = interleave_rows(w1, w3)
    amax = None
    if fp8:  # NormSwiGLUResidualFp8 with fp8_mlp_dgrad and/or fp8_mlp_wgrad: B3 also writes e5m2 da
        w_t8, s_w, inv_g, h_amax = fp8  # and reports amax |da|
        da, y, zdz, daq, amax = be.swiglu_bwd_fp8(dout=dx_out, w_down=w2, a=a, rstd=rstd, inv_scale=inv_g)
        inv = inv_scale_from_amax(amax, E5M2_MAX) if inv_g is None else inv_g  # None: calibrated on amax
    else:
        da, y, zdz = be.swiglu_bwd(dout=dx_out, w_down=w2, a=a, rstd=rstd)
    if fp8 and w_t8 is not None:  # fp8_mlp_dgrad: B2 on e5m2 da x e4m3 W13^T
        dx, dgamma = be.norm_residual_bwd_fp8(
            daq=daq, weight_tq=w_t8, scale=_dequant_scale(inv, s_w), x=x, gamma=gamma, rstd=rstd, zdz=zdz,
            dresidual=dx_out,
        )
    else:
        dx, dgamma = be.norm_residual_bwd(da=da, weight=w13, x=x, gamma=gamma, rstd=rstd, zdz=zdz, dresidual=dx_out)
    dw2 = be.wgrad(grad=dx_out, inp=y, out_dtype=w2.dtype)
    if fp8 and h_amax is not None:  # fp8_mlp_wgrad: torchao's fp8 dW, current scales from B3's and F1's amaxes
        dw13 = be.wgrad_fp8(grad=da, grad_amax=amax, inp=h, inp_amax=h_amax, out_dtype=w13.dtype)
    else:
        dw13 = be.wgrad(grad=da, inp=h, out_dtype=w13.dtype)
    dw1, dw3 = deinterleave_rows(dw13)
    return (None, None, dx, dgamma.to(gamma.dtype), dw1, dw3, dw2, None, None), amax


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


# --- FP8 ([coda] precision = "fp8"; coda_titan.kernels.fp8 has the recipe) -------------------------
# Each Function below runs the FP8 forward program; the quantization is straight-through, and the
# backward is its BF16 twin's on the same saved bf16 tensors, except that F3's dgrad (B1 -> B2) runs
# on an e5m2 gradient and the e4m3 weight.


class ResidualRMSFp8(torch.autograd.Function):
    """F1 whose epilogue also writes e4m3 H (scale ``inv_scale``, None = current amax) and amax |H|."""

    @staticmethod
    def forward(ctx, y, weight, residual, gamma_next, cfg: ProgramConfig, inv_scale):
        x, h, s, hq, amax = cfg.backend.residual_rms_fp8(
            y=y, weight=weight, residual=residual, gamma=gamma_next, tile_n=cfg.tile_n, inv_scale=inv_scale
        )
        ctx.mark_non_differentiable(h, s, hq, amax)
        ctx.save_for_backward(y, weight)
        ctx.cfg = cfg
        return x, h, s, hq, amax

    @staticmethod
    def backward(ctx, dx, *_):
        return (*_residual_rms_backward(ctx, dx), None)


def _dequant_scale(inv_a, s_w):
    """s_a * s_w: the accumulator's unit, folded into the consumer's epilogue vector."""
    return (s_w / inv_a).reshape(())


class NormRoPEFp8(torch.autograd.Function):
    """F3 on e4m3 Hq (scale 1/inv_a) and W_qkv,q = w8 (scale s_w, from ``fp8_layer_weights``).
    Backward: NormRoPE's; with W_qkv,q^T = w8_t given (``fp8_dgrad``), B1 also casts da to e5m2 and
    B2 runs on it and w8_t. The wgrad is bf16 either way."""

    @staticmethod
    def forward(ctx, hq, h, rstd, x, gamma, wq, wk, wv, freqs, seqlen, cfg: ProgramConfig, n_rope_heads, head_dim, inv_a,
                w8, s_w, w8_t):
        qkv = cfg.backend.norm_rope_fp8(
            hq=hq, rstd=rstd, weight_q=w8, scale=_dequant_scale(inv_a, s_w), freqs=freqs, seqlen=seqlen,
            n_rope_heads=n_rope_heads, head_dim=head_dim, out_dtype=h.dtype,
        )
        ctx.save_for_backward(h, rstd, x, gamma, wq, wk, wv, freqs, qkv, w8_t, s_w)
        ctx.cfg, ctx.seqlen, ctx.n_rope_heads, ctx.head_dim = cfg, seqlen, n_rope_heads, head_dim
        return qkv, x.view_as(x)

    @staticmethod
    def backward(ctx, dqkv, dx_res):
        return (None, *_norm_rope_backward(ctx, dqkv, dx_res), None, None, None, None)


class NormSwiGLUResidualFp8(torch.autograd.Function):
    """F2 on e4m3 Hq and W13q = w13_8 (scale s_w, from ``fp8_layer_weights``), then F1 (bf16 GEMM: its A operand, the SwiGLU output,
    cannot be stored as e4m3 by quack's SM90 paired-column epilogue) writing e4m3 H for the next
    layer's F3 when ``inv_next`` is given (``quantize_next``). Backward = NormSwiGLUResidual's, except
    that with ``g_sink`` given (``fp8_mlp_dgrad`` or ``fp8_mlp_wgrad``) B3 also writes da as e5m2 with
    the delayed inverse scale ``inv_g`` (None: calibrate on the current amax) and reports amax |da|;
    then B2 runs on e5m2 da and W13q^T = w13_8t when that is given (``fp8_mlp_dgrad``), and dW13 is
    torchao's fp8 weight gradient of da and H with current scales when ``h_amax`` (amax |H|, from F1)
    is given (``fp8_mlp_wgrad``). The backward returns amax |da| as the gradient of ``g_sink``: the
    model reads it there to update the gradient site's amax history (a side channel through
    autograd, so it works compiled too)."""

    @staticmethod
    def forward(ctx, hq, h, rstd, x, gamma, w1, w3, w2, gamma_next, cfg: ProgramConfig, inv_a, quantize_next, inv_next,
                w13_8, s_w, w13_8t=None, inv_g=None, g_sink=None, h_amax=None):
        be = cfg.backend
        y, a = be.norm_swiglu_fp8(hq=hq, rstd=rstd, w13q=w13_8, scale=_dequant_scale(inv_a, s_w), out_dtype=h.dtype)
        if quantize_next:
            x_out, h_out, s_out, hq_out, amax = be.residual_rms_fp8(
                y=y, weight=w2, residual=x, gamma=gamma_next, tile_n=cfg.tile_n, inv_scale=inv_next
            )
            outs = (x_out, h_out, s_out, hq_out, amax)
        else:
            outs = be.residual_rms(y=y, weight=w2, residual=x, gamma=gamma_next, tile_n=cfg.tile_n)
        ctx.mark_non_differentiable(*outs[1:])
        fp8 = (w13_8t, s_w, inv_g, h_amax) if g_sink is not None else ()
        ctx.save_for_backward(h, rstd, x, gamma, w1, w3, w2, a, *fp8)
        ctx.cfg = cfg
        return outs

    @staticmethod
    def backward(ctx, dx_out, *_):
        grads, amax = _norm_swiglu_residual_backward(ctx, dx_out)
        sink = amax.float().reshape(()) if ctx.needs_input_grad[17] else None
        return (None, *grads, None, None, None, None, None, None, None, sink, None)
