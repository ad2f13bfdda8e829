"""Autograd wiring of the CODA programs: one Function per fused step, whose backward *runs the
backward programs*.

Gradient plan (docs/design.md): a producer epilogue (F1 or the prologue) writes X, H = X * gamma
and the partial sums S; H and S are non-differentiable. The consumer of H (F2, F3 or F4) owns the
norm's backward: from its output gradient it makes da = r * dp and zdz, runs B2 (dgrad GEMM +
norm/residual epilogue) and returns the *assembled* residual gradient D for X, plus dgamma. For that
it needs the gradient already flowing down the residual stream, so:

* the MLP sub-layer (F2 -> F1) is one Function: its input X is also the down-projection's residual;
* the QKV Function (F3) passes X through as an extra output ``x_pass``, which the out-projection F1
  uses as its residual; autograd therefore hands F3's backward the residual gradient together with
  dq/dk/dv (autograd runs a node's backward only when all of its outputs' gradients are in).

F1's own backward is then just two GEMMs (dgrad, wgrad). F4 makes every gradient in its forward,
chunk by chunk, and its backward only scales them by the incoming scalar.

precision = "fp8": each Function takes its fp8 operands as one optional frozen record (``QuantizeH``,
``Fp8Operands``, ``MlpFp8``). Quantization is straight-through: the backward is the bf16 one on the
same saved bf16 tensors, except where a record asks for an fp8 dgrad or weight gradient. Backward
returns name their gradients (``edges.grads``); nothing counts positions; ``edges`` also has the amax tokens.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..kernels import Backend
from ..kernels._common import ZDZ_ENV, deinterleave_rows, interleave_rows, mm, zdz_of_acc
from ..kernels.scaling import E4M3, E5M2_MAX, amax_abs, dequant_scale, inv_scale_from_amax
from .edges import amax_grad, amax_token, grads, needs
from .fp8_operands import Fp8Input, Fp8Operands, MlpFp8, QuantizeH

DW2_RECAST_ENV = "CODA_TITAN_DW2_RECAST"  # "1": dW2 casts D itself again, not reusing B3's codes (the A/B's other arm)
# ZDZ_ENV = "dgrad" / "dgrad_mlp": the attention (MLP) norm's row dot zdz from the dgrad, sum_k (da @ W)_k x_k gamma_k
# (one more GEMM), not B1's (B3's) sum over its rounded outputs (a precision probe's arm: ``bf16_step_accuracy``)


@dataclass(frozen=True)
class ProgramConfig:
    backend: Backend
    tile_n: int
    eps: float
    ce_chunk_rows: int
    fp8_wgrads: bool = False  # dW_qkv, dW_o and dW2 on fp8 (``fp8_layer_wgrads``, precision fp8)
    fp8_da_wgrad: bool = False  # dW13 on B3's e5m2 da, no bf16 da (``fp8_mlp_wgrad_e5m2``)
    fp8_y_wgrad: bool = False  # with it and the down site calibrated: dW2 on B3's e4m3 y (``fp8_down_wgrad``)
    fp8_da_t: bool = False  # with fp8_da_wgrad: B3 also writes da^T, dW13 without a copy pass (``fp8_mlp_da_t``)
    fp8_qkv_wgrad: bool = False  # dW_qkv on fp8 from F3's e4m3 H, which is kept instead of H (``fp8_qkv_wgrad``)
    fp8_out_bwd: bool = False  # with an Fp8Input's w_t: F1's dgrad and wgrad on one e5m2 cast of dX (``fp8_out_bwd``)
    fp8_weight_t_bwd: bool = False  # every ``w_t`` / ``w2_t`` given is W's own codes, transposed by the backward
    fp8_lm_head: bool = False  # the LM head on e4m3 H and W, its gradient on e5m2 dlogits (``fp8_lm_head``)
    fp8_lm_head_fwd: bool = False  # the head's logits on e4m3 H, W; its gradient the bf16 head's (``fp8_lm_head_fwd``)
    fp8_lm_head_dw: bool = False  # with it: dW_out on stochastically rounded e5m2 da and H's codes (``fp8_lm_head_dw``)
    fp8_lm_head_dgrad: bool = False  # with that: the head's B2 on the same codes and W's (``fp8_lm_head_dgrad``)
    stacked_weights: bool = False  # bf16: W_qkv, W13 read from one buffer; B3's da as [gate | up] (``stacked_weights``)
    amp_dtype: torch.dtype | None = None  # TorchTitan's AMP (fp32 parameters, autocast): the dtype the programs read them in

    def weight(self, w: torch.Tensor) -> torch.Tensor:
        """A parameter as the programs read it: under AMP cast (differentiably: its gradient comes back in the
        parameter's dtype) to ``amp_dtype``, as autocast casts a stock linear's weight; else the parameter."""
        return w if self.amp_dtype is None or w.dtype == self.amp_dtype else w.to(self.amp_dtype)


def _weight_t(cfg: ProgramConfig, w_t: torch.Tensor | None) -> torch.Tensor | None:
    """The e4m3 W^T an fp8 dgrad reads: the weight pass's, or (``fp8_weight_t_bwd``) made here from W's codes."""
    return cfg.backend.fp8_weight_t(w=w_t) if w_t is not None and cfg.fp8_weight_t_bwd else w_t


def _kept_h(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """H as a backward keeps it; an error, not a wrong gradient, where ``_f1`` wrote none (``quantize.transposed``)."""
    if h.numel() == 0 and x.numel() != 0:
        raise RuntimeError("coda_titan: a weight gradient needs the bf16 H, but its F1 wrote Hq and Hq^T only "
                           "(residual_rms_q_fp8_t); its consumer must keep Hq^T (fp8_mlp_h_t / fp8_qkv_wgrad)")
    return h


def _f1(be: Backend, y, weight, residual, gamma_next, tile_n: int, quantize: QuantizeH | None,
        fp8_in: Fp8Input | None, y_amax: torch.Tensor | None = None) -> tuple:
    """F1's outputs: (X, H, S), then (Hq, amax |H|) with ``quantize`` (and Hq^T with its ``transposed``, when
    H is an empty tensor of its dtype: no bf16 H is written, its consumers keep Hq^T and read Hq),
    then amax |y| with ``fp8_in`` (y cast to e4m3 and the GEMM on the fp8 mainloop; with ``y_amax``, y
    is that e4m3 y already, quantized by its producer with ``fp8_in.inv``, and ``y_amax`` its amax)."""
    inv_next = None if quantize is None else quantize.inv_scale
    if fp8_in is None:
        f1 = dict(y=y, weight=weight, residual=residual, gamma=gamma_next, tile_n=tile_n)
        return be.residual_rms(**f1) if quantize is None else be.residual_rms_fp8(**f1, inv_scale=inv_next)
    yq, amax_y = be.quantize_delayed(t=y, inv_scale=fp8_in.inv) if y_amax is None else (y, y_amax)
    inv_y = inv_scale_from_amax(amax_y) if fp8_in.inv is None else fp8_in.inv
    f1 = dict(yq=yq, wq=fp8_in.w, scale=dequant_scale(inv_y, fp8_in.s_w), residual=residual, gamma=gamma_next,
              tile_n=tile_n)
    if quantize is not None and quantize.transposed:
        x, s, hq, hq_t, amax = be.residual_rms_q_fp8_t(**f1, inv_scale=inv_next)
        return x, x.new_empty(0), s, hq, amax, hq_t, amax_y
    outs = be.residual_rms_q(**f1) if quantize is None else be.residual_rms_q_fp8(**f1, inv_scale=inv_next)
    return (*outs, amax_y)


def _f2(be: Backend, fp8: MlpFp8 | None, h, rstd, w1, w3, concat: bool = False) -> tuple:
    """F2's (y, a, amax |y| or None, amax |a| or None, a's dequantization or None). With ``fp8.preact`` and its
    scale, a comes as e4m3 codes and its dequantization is 1 / ``fp8.inv_pre``; calibrating, a in bf16 and its amax.
    ``concat`` (``stacked_weights``): the bf16 F2 gets w1 and w3 apart (no interleaved copy; ``model.storage``)."""
    if fp8 is None:
        w13 = dict(w13=w1, w3=w3) if concat else dict(w13=interleave_rows(w1, w3))
        return (*be.norm_swiglu(h=h, rstd=rstd, **w13), None, None, None)
    f2_args = dict(hq=fp8.f2.hq, rstd=rstd, w13q=fp8.f2.w, scale=dequant_scale(fp8.f2.inv_a, fp8.f2.s_w), out_dtype=h.dtype)
    if fp8.down is None or fp8.down.inv is None:  # (calibrating the down site: y in bf16, cast by F1's input pass)
        y, a = be.norm_swiglu_fp8(**f2_args)
        y_amax = None
    elif fp8.preact and fp8.inv_pre is not None:  # F2 writes the down-projection's e4m3 y and a's e4m3 codes
        y, aq, y_amax, a_amax = be.norm_swiglu_qa_fp8(**f2_args, inv_y=fp8.down.inv, inv_a=fp8.inv_pre)
        return y, aq, y_amax, a_amax, fp8.inv_pre.reciprocal()
    else:  # F2 writes the down-projection's e4m3 y itself
        y, a, y_amax = be.norm_swiglu_q_fp8(**f2_args, inv_y=fp8.down.inv)
    return y, a, y_amax, amax_abs(a).float() if fp8.preact else None, None


def _wgrad(be, fp8: bool, grad: torch.Tensor, inp: torch.Tensor, out_dtype: torch.dtype,
           grad_amax: torch.Tensor | None = None, inp_amax: torch.Tensor | None = None) -> torch.Tensor:
    """dW = grad^T inp: on fp8 (torchao's recipe: current power-of-two scales of the operands' amaxes,
    taken here where not given) or bf16."""
    if fp8:
        return be.wgrad_fp8(grad=grad, grad_amax=grad_amax, inp=inp, inp_amax=inp_amax, out_dtype=out_dtype)
    return be.wgrad(grad=grad, inp=inp, out_dtype=out_dtype)


RESIDUAL_RMS_INPUTS = ("y", "weight", "residual", "gamma_next", "cfg", "quantize", "fp8_in")  # ResidualRMS.forward's inputs, in order


class ResidualRMS(torch.autograd.Function):
    """F1: X = y @ W^T + residual; H = X * gamma_next; S partials (with ``quantize``: also e4m3 H and
    amax |H|; with ``fp8_in``: the GEMM on e4m3 y, and amax |y| last). Backward: dgrad (bf16) +
    wgrad (bf16, or on fp8 with ``cfg.fp8_wgrads``); with ``cfg.fp8_out_bwd`` and ``fp8_in.w_t``, both
    on fp8: dX cast once to e5m2 (current power-of-two scale) times W^T's and the forward's e4m3 y,
    kept instead of y; with ``fp8_in.grad_amax`` at amax |dX| from its consumer (an amax token, last output)."""

    @staticmethod
    def forward(ctx, y, weight, residual, gamma_next, cfg: ProgramConfig, quantize: QuantizeH | None = None,
                fp8_in: Fp8Input | None = None):
        be, saved = cfg.backend, (y, weight, None, None, None)
        if cfg.fp8_out_bwd and fp8_in is not None and fp8_in.w_t is not None:  # (the same cast _f1 makes, and
            # the codes token-major: dW_o's operand, kept instead of the row-major codes F1's GEMM reads)
            yq, yq_t, amax_y = be.quantize_delayed_t(t=y, inv_scale=fp8_in.inv)
            outs = _f1(be, yq, weight, residual, gamma_next, cfg.tile_n, quantize, fp8_in, amax_y)
            inv_y = inv_scale_from_amax(amax_y) if fp8_in.inv is None else fp8_in.inv
            saved = (yq_t.t(), weight, fp8_in.w_t, fp8_in.s_w, inv_y)
        else:
            outs = _f1(be, y, weight, residual, gamma_next, cfg.tile_n, quantize, fp8_in)
        ctx.mark_non_differentiable(*outs[1:])
        ctx.grad_amax = fp8_in is not None and fp8_in.grad_amax
        if ctx.grad_amax:
            outs = (*outs, amax_token(y))
        ctx.save_for_backward(*saved)
        ctx.cfg = cfg
        return outs

    @staticmethod
    def backward(ctx, dx, *rest):
        y, weight, w_t, s_w, inv_y = ctx.saved_tensors
        be = ctx.cfg.backend
        if w_t is not None:  # fp8_out_bwd: one cast of dX for both GEMMs (row-major codes, and token-major for dW)
            dq, dq_t, s_d = be.quantize_grad_t(t=dx, amax=rest[-1] if ctx.grad_amax else None)
            dy = be.dgrad_fp8_q(gradq=dq, grad_scale=s_d, weight_tq=_weight_t(ctx.cfg, w_t), w_scale=s_w,
                                out_dtype=dx.dtype)
            dw = be.wgrad_fp8_q(gradq=dq_t.t(), grad_scale=s_d, inpq=y, inp_scale=inv_y.reciprocal(),
                                out_dtype=weight.dtype)
        else:
            dy = be.dgrad(grad=dx, weight=weight, out_dtype=y.dtype)
            dw = _wgrad(be, ctx.cfg.fp8_wgrads, dx, y, weight.dtype)
        return grads(RESIDUAL_RMS_INPUTS, y=dy, weight=dw, residual=dx)


NORM_ROPE_INPUTS = ("h", "rstd", "x", "gamma", "wq", "wk", "wv", "freqs", "seqlen", "cfg", "n_rope_heads", "head_dim",
              "fp8", "grad_sink", "amax_tok")  # NormRoPE.forward's inputs, in order


class NormRoPE(torch.autograd.Function):
    """F3 (QKV GEMM + deferred rstd + RoPE, on ``fp8``'s operands if given); backward B1 (RoPE bwd +
    zdz, which also casts da to e5m2 with ``fp8.grad_inv`` when ``fp8.w_t`` is given, returning amax
    |da| as the gradient of ``grad_sink``) -> B2 -> wgrad (bf16; with ``cfg.fp8_qkv_wgrad`` on fp8, on
    the e4m3 H F3 read, kept instead of the bf16 H (its producer's H^T if given), times da cast with its
    current scale, from the amax B1 reduced where it has one). Given the layer below's MLP amax token
    (``amax_tok``), returns amax |dX| (B2's) as its gradient."""

    @staticmethod
    def forward(ctx, h, rstd, x, gamma, wq, wk, wv, freqs, seqlen, cfg: ProgramConfig, n_rope_heads: int,
                head_dim: int, fp8: Fp8Operands | None = None, grad_sink: torch.Tensor | None = None,
                amax_tok: torch.Tensor | None = None):
        rope = dict(freqs=freqs, seqlen=seqlen, n_rope_heads=n_rope_heads, head_dim=head_dim)
        if fp8 is None:  # (stacked_weights: W_qkv a view of one buffer in the kernel, no copy here)
            w = dict(weight=wq, weight2=wk, weight3=wv) if cfg.stacked_weights else dict(weight=torch.cat([wq, wk, wv]))
            qkv = cfg.backend.norm_rope(h=h, rstd=rstd, **rope, **w)
        else:
            qkv = cfg.backend.norm_rope_fp8(hq=fp8.hq, rstd=rstd, weight_q=fp8.w, scale=dequant_scale(fp8.inv_a, fp8.s_w),
                                            out_dtype=h.dtype, **rope)
        w_t, s_w, inv_g = (None,) * 3 if fp8 is None or fp8.w_t is None else (fp8.w_t, fp8.s_w, fp8.grad_inv)
        hq, inv_h = (None, None) if fp8 is None or not cfg.fp8_qkv_wgrad else (
            fp8.hq if fp8.hq_t is None else fp8.hq_t.t(), fp8.inv_a)
        ctx.save_for_backward(_kept_h(h, x) if hq is None else None, rstd, x, gamma, wq, wk, wv, freqs, qkv, w_t, s_w,
                              hq, inv_h, inv_g)
        ctx.cfg, ctx.rope = cfg, dict(seqlen=seqlen, n_rope_heads=n_rope_heads, head_dim=head_dim)
        return qkv, x.view_as(x)

    @staticmethod
    def backward(ctx, dqkv, dx_res):
        h, rstd, x, gamma, wq, wk, wv, freqs, qkv, w8_t, s_w, hq, inv_h, inv_g = ctx.saved_tensors
        be = ctx.cfg.backend
        rope = dict(dy=dqkv.contiguous(), y=qkv, rstd=rstd, freqs=freqs, **ctx.rope)
        norm = dict(x=x, gamma=gamma, rstd=rstd, dresidual=dx_res)
        sink = daq = amax_dx = None
        if w8_t is not None:  # fp8_dgrad: B1 casts da to e5m2 (delayed scale), B2 runs on it and W_qkv,q^T
            da, zdz, daq, amax = be.rope_bwd_fp8(**rope, inv_scale=inv_g)
            inv = inv_scale_from_amax(amax, E5M2_MAX) if inv_g is None else inv_g
            dx, dgamma, amax_dx = be.norm_residual_bwd_fp8(daq=daq, weight_tq=_weight_t(ctx.cfg, w8_t),
                                                           scale=dequant_scale(inv, s_w), zdz=zdz, **norm)
            sink = amax.float().reshape(()) if needs(ctx, NORM_ROPE_INPUTS, "grad_sink") else None
        else:
            da, zdz = be.rope_bwd(**rope)
            w = (dict(weight=wq, weight2=wk, weight3=wv) if ctx.cfg.stacked_weights  # (the bf16 dgrad's B)
                 else dict(weight=torch.cat([wq, wk, wv])))
            if os.environ.get(ZDZ_ENV) == "dgrad":
                zdz = zdz_of_acc(mm(da, torch.cat([wq, wk, wv])), x, gamma)
            dx, dgamma = be.norm_residual_bwd(da=da, zdz=zdz, **w, **norm)
        if hq is not None:  # fp8_qkv_wgrad: torchao's recipe, da cast at its current amax (B1's where it has
            # one; not B1's delayed-scale codes, which moved the loss: docs/fp8.md) and the forward's e4m3 input
            dw = be.wgrad_fp8_e4m3(grad=da, grad_amax=None if daq is None else amax, inpq=hq,
                                   inp_scale=inv_h.reciprocal(), out_dtype=wq.dtype)
        else:
            dw = _wgrad(be, ctx.cfg.fp8_wgrads, da, h, wq.dtype)
        dwq, dwk, dwv = dw.split([wq.shape[0], wk.shape[0], wv.shape[0]])
        tok = amax_grad(dx, amax_dx) if needs(ctx, NORM_ROPE_INPUTS, "amax_tok") else None  # (the MLP below casts dx)
        return grads(NORM_ROPE_INPUTS, x=dx, gamma=dgamma.to(gamma.dtype), wq=dwq, wk=dwk, wv=dwv, grad_sink=sink,
                      amax_tok=tok)


NORM_SWIGLU_RESIDUAL_INPUTS = ("h", "rstd", "x", "gamma", "w1", "w3", "w2", "gamma_next", "cfg", "fp8", "grad_sink",
                               "amax_tok")  # NormSwiGLUResidual.forward's inputs, in order


class NormSwiGLUResidual(torch.autograd.Function):
    """MLP sub-layer: F2 (W13 GEMM + rstd + SwiGLU) then F1 (W2 GEMM + residual + partial RMS).

    W13 is w1 and w3 with rows interleaved (a runtime view, see ``interleave_rows``). Backward: B3
    (D @ W2 + SwiGLU bwd + zdz), dW2, B2 (da @ W13 + norm/residual bwd), dW13. On fp8 (``fp8``),
    the backward returns amax |da| as the gradient of ``grad_sink``: the model reads it there to
    update the gradient site's amax history (a side channel through autograd, so it works compiled).
    Amax tokens (``edges``): given the out-projection's (``amax_tok``), it returns amax |dX| (B2's) to it;
    with ``fp8.grad_amax`` its last output is its own, and its cast of dX_out takes the amax returned there.
    """

    @staticmethod
    def forward(ctx, h, rstd, x, gamma, w1, w3, w2, gamma_next, cfg: ProgramConfig, fp8: MlpFp8 | None = None,
                grad_sink: torch.Tensor | None = None, amax_tok: torch.Tensor | None = None):
        be = cfg.backend
        y, a, y_amax, a_amax, a_scale = _f2(be, fp8, h, rstd, w1, w3, cfg.stacked_weights)
        outs = _f1(be, y, w2, x, gamma_next, cfg.tile_n, fp8.quantize_next if fp8 is not None else None,
                   fp8.down if fp8 is not None else None, y_amax)
        outs = (*outs, a_amax) if fp8 is not None and fp8.preact else outs
        ctx.mark_non_differentiable(*outs[1:])
        ctx.e5m2 = fp8 is not None and grad_sink is not None  # B3 writes e5m2 da only with a sink for its amax
        inv_y = fp8.down.inv if ctx.e5m2 and cfg.fp8_y_wgrad and fp8.down is not None else None
        lean = ctx.e5m2 and cfg.fp8_da_wgrad and fp8.f2.w_t is not None and fp8.h_amax is not None  # (as backward's)
        h_t = fp8.hq_t if lean else None  # dW13 on the forward's e4m3 H^T: the bf16 H is not kept
        e5m2 = ((fp8.f2.w_t, fp8.f2.s_w, fp8.grad_inv_scale, fp8.h_amax, fp8.w2_t, fp8.s_w2, inv_y, h_t, fp8.f2.inv_a)
                if ctx.e5m2 else (None,) * 9)
        ctx.save_for_backward(None if h_t is not None else _kept_h(h, x), rstd, x, gamma, w1, w3, w2, a, a_scale, *e5m2)
        ctx.cfg = cfg
        ctx.grad_amax = fp8 is not None and fp8.grad_amax
        return (*outs, amax_token(x)) if ctx.grad_amax else outs

    @staticmethod
    def backward(ctx, dx_out, *rest):
        (h, rstd, x, gamma, w1, w3, w2, a, a_scale, w13q_t, s_w, grad_inv_scale, h_amax, w2q_t, s_w2, inv_y, h_t,
         inv_h) = ctx.saved_tensors
        be = ctx.cfg.backend
        norm = dict(x=x, gamma=gamma, rstd=rstd, dresidual=dx_out)
        lean = ctx.e5m2 and ctx.cfg.fp8_da_wgrad and w13q_t is not None and h_amax is not None
        qa = a.dtype == E4M3 and ctx.e5m2 and w2q_t is not None and lean and ctx.cfg.fp8_da_t  # (B3 on a's codes)
        if a.dtype == E4M3 and not qa:  # (fp8_preact where no B3 reads the codes: decoded, exactly, to bf16)
            a = (a.to(torch.float32) * a_scale).to(x.dtype)
        daq_t = dq = dq_t = None
        concat = False  # (the plain bf16 B3's da in [gate | up] order, ``stacked_weights``)
        recast = os.environ.get(DW2_RECAST_ENV) == "1"  # (dW2 casting D again, not on B3's codes of it)
        if ctx.e5m2 and w2q_t is not None:  # fp8_down_dgrad: B3's GEMM on e5m2 D x e4m3 W2^T
            amax_d = rest[-1] if ctx.grad_amax else None  # (amax |D| from the next layer's B2, where it reports it)
            if lean and ctx.cfg.fp8_da_t and inv_y is not None and not recast:
                dq, dq_t, s_d = be.quantize_grad_t(t=dx_out, amax=amax_d)  # (dW2 on the same codes: token-major too)
            else:
                dq, s_d = be.quantize_grad(t=dx_out, amax=amax_d)
            q = dict(doutq=dq, w_down_tq=_weight_t(ctx.cfg, w2q_t), scale=(s_d * s_w2).reshape(()), rstd=rstd,
                     inv_scale=grad_inv_scale)
            if qa:  # fp8_preact: that B3 on a's e4m3 codes
                da = None
                y, zdz, daq, daq_t, amax = be.swiglu_bwd_e5m2_t_qa(**q, aq=a, a_scale=a_scale, out_dtype=x.dtype,
                                                                   inv_y=inv_y)
            elif lean and ctx.cfg.fp8_da_t:  # the e5m2-only B3 with da^T (and y^T), on that GEMM
                da = None
                y, zdz, daq, daq_t, amax = be.swiglu_bwd_e5m2_t_q(**q, a=a, inv_y=inv_y)
            else:
                da, y, zdz, daq, amax = be.swiglu_bwd_q_fp8(**q, a=a)
        elif lean and ctx.cfg.fp8_da_t:  # and da^T (and e4m3 y^T with inv_y): the wgrads' operands as cuBLAS reads them
            da = None
            y, zdz, daq, daq_t, amax = be.swiglu_bwd_e5m2_t(dout=dx_out, w_down=w2, a=a, rstd=rstd,
                                                            inv_scale=grad_inv_scale, inv_y=inv_y)
        elif lean:  # both consumers of da read its e5m2 copy: B3 writes no bf16 da (and y as e4m3 with inv_y)
            da = None
            y, zdz, daq, amax = be.swiglu_bwd_e5m2(dout=dx_out, w_down=w2, a=a, rstd=rstd, inv_scale=grad_inv_scale,
                                                   inv_y=inv_y)
        elif ctx.e5m2:
            da, y, zdz, daq, amax = be.swiglu_bwd_fp8(dout=dx_out, w_down=w2, a=a, rstd=rstd, inv_scale=grad_inv_scale)
        else:
            concat = ctx.cfg.stacked_weights
            da, y, zdz = be.swiglu_bwd(dout=dx_out, w_down=w2, a=a, rstd=rstd, concat=concat)
            amax = None
        inv_g = inv_scale_from_amax(amax, E5M2_MAX) if ctx.e5m2 and grad_inv_scale is None else grad_inv_scale
        amax_dx = None
        if w13q_t is not None:  # fp8_mlp_dgrad: B2 on e5m2 da x e4m3 W13^T
            dx, dgamma, amax_dx = be.norm_residual_bwd_fp8(daq=daq, weight_tq=_weight_t(ctx.cfg, w13q_t),
                                                           scale=dequant_scale(inv_g, s_w), zdz=zdz, **norm)
        else:  # (the bf16 dgrad: the only reader of the interleaved bf16 W13 in the backward)
            w13 = dict(weight=w1, weight2=w3) if concat else dict(weight=interleave_rows(w1, w3))
            if os.environ.get(ZDZ_ENV) == "dgrad_mlp":
                zdz = zdz_of_acc(mm(da, torch.cat([w1, w3]) if concat else w13["weight"]), x, gamma)
            dx, dgamma = be.norm_residual_bwd(da=da, zdz=zdz, **w13, **norm)
        if y.dtype == E4M3 and dq is not None and not recast:  # and on B3's e5m2 D:
            # the very codes and scale dW2's own cast of D gives (one amax and one cast of D fewer)
            dw2 = be.wgrad_fp8_q(gradq=dq if dq_t is None else dq_t.t(), grad_scale=s_d,
                                 inpq=y if daq_t is None else y.t(), inp_scale=inv_y.reciprocal(), out_dtype=w2.dtype)
        elif y.dtype == E4M3:  # fp8_down_wgrad: dW2 on the e4m3 y B3 wrote (y^T with fp8_mlp_da_t)
            dw2 = be.wgrad_fp8_e4m3(grad=dx_out, grad_amax=None, inpq=y if daq_t is None else y.t(),
                                    inp_scale=inv_y.reciprocal(), out_dtype=w2.dtype)
        else:
            dw2 = _wgrad(be, ctx.cfg.fp8_wgrads, dx_out, y, w2.dtype)
        if lean and h_t is not None:  # fp8_mlp_h_t: and on F2's e4m3 H codes, F1's H^T (no cast of H)
            dw13 = be.wgrad_fp8_q(gradq=daq if daq_t is None else daq_t.t(), grad_scale=inv_g.reciprocal(), inpq=h_t.t(),
                                  inp_scale=inv_h.reciprocal(), out_dtype=w1.dtype)
        elif lean:  # dW13 on the e5m2 da B3 wrote (delayed scale), not on a bf16 da cast again
            dw13 = be.wgrad_fp8_e5m2(gradq=daq if daq_t is None else daq_t.t(), grad_scale=inv_g.reciprocal(), inp=h,
                                     inp_amax=h_amax, out_dtype=w1.dtype)
        else:
            dw13 = _wgrad(be, h_amax is not None, da, h, w1.dtype, amax, h_amax)  # fp8_mlp_wgrad when h_amax is given
        # (da^T or a concat da: [gate; up] rows, two contiguous halves; else every other row, copied here: a compiled
        # backward fuses the copy, where AccumulateGrad's own copy of a strided gradient ran as two eager kernels)
        halves = daq_t is not None or concat
        dw1, dw3 = dw13.chunk(2) if halves else (t.contiguous() for t in deinterleave_rows(dw13))
        sink = amax.float().reshape(()) if amax is not None and needs(ctx, NORM_SWIGLU_RESIDUAL_INPUTS, "grad_sink") else None
        tok = amax_grad(dx, amax_dx) if needs(ctx, NORM_SWIGLU_RESIDUAL_INPUTS, "amax_tok") else None  # (W_o's cast)
        return grads(NORM_SWIGLU_RESIDUAL_INPUTS, x=dx, gamma=dgamma.to(gamma.dtype), w1=dw1, w3=dw3, w2=dw2,
                      grad_sink=sink, amax_tok=tok)


LM_HEAD_CE_INPUTS = ("h", "rstd", "x", "gamma", "weight", "targets", "cfg", "compute_grad")  # LMHeadCE.forward's inputs, in order


class LMHeadCE(torch.autograd.Function):
    """F4: chunked LM head + CE; the gradients are made in the forward and scaled in the backward. With
    ``cfg.fp8_lm_head``, on e4m3 H and W (torchao's current tensorwise casts, W^T's codes for the dgrad); with
    ``cfg.fp8_lm_head_fwd``, its logits on those casts and its gradient on the bf16 H and W (``cfg.fp8_lm_head_dw``:
    but dW, on da's stochastically rounded e5m2 codes and H's; ``cfg.fp8_lm_head_dgrad``: and dX, on them and W's)."""

    @staticmethod
    def forward(ctx, h, rstd, x, gamma, weight, targets, cfg: ProgramConfig, compute_grad: bool):
        be, kw = cfg.backend, dict(rstd=rstd, x=x, gamma=gamma, targets=targets, chunk_rows=cfg.ce_chunk_rows,
                                   compute_grad=compute_grad)
        if cfg.fp8_lm_head or cfg.fp8_lm_head_fwd:
            (hq, s_h), (wq, s_w) = be.quantize_tensorwise(w=h), be.quantize_tensorwise(w=weight)
        if cfg.fp8_lm_head:
            loss, dx, dgamma, dw = be.lm_head_ce_fp8(hq=hq, s_h=s_h, weight_q=wq, weight_tq=be.fp8_weight_t(w=wq),
                                                     s_w=s_w, **kw)
            dw = dw if dw is None else dw.to(weight.dtype)
        elif cfg.fp8_lm_head_fwd:
            loss, dx, dgamma, dw = be.lm_head_ce(h=h, weight=weight, hq=hq, s_h=s_h, weight_q=wq, s_w=s_w,
                                                 fp8_dw=cfg.fp8_lm_head_dw, fp8_dgrad=cfg.fp8_lm_head_dgrad, **kw)
        else:
            loss, dx, dgamma, dw = be.lm_head_ce(h=h, weight=weight, **kw)
        if compute_grad:
            ctx.save_for_backward(dx, dgamma, dw)
            ctx.gamma_dtype = gamma.dtype
        return loss

    @staticmethod
    def backward(ctx, dloss):
        dx, dgamma, dw = ctx.saved_tensors
        g = dloss.to(dgamma.dtype)
        if dx.dtype == dw.dtype:  # (one multi-tensor kernel for both: a 0-dim device factor sent each through the
            # broadcasting, unvectorized elementwise kernel, 0.78 ms a step on the 1B fp8 profile; same rounding)
            dx_g, dw_g = torch._foreach_mul([dx, dw], g.to(dx.dtype))
        else:
            dx_g, dw_g = dx * g.to(dx.dtype), dw * g.to(dw.dtype)
        return grads(LM_HEAD_CE_INPUTS, x=dx_g, gamma=(dgamma * g).to(ctx.gamma_dtype), weight=dw_g)
