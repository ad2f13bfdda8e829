"""FP8 programs (precision = "fp8"): one setup per program. Providers: ``coda`` (the fp8 program),
``coda_bf16`` (its bf16 twin), ``bare_gemm`` (the same GEMM as one cuBLAS fp8 ``_scaled_mm``), and
``eager`` (stock's computation with torchao float8 tensorwise linears; ``torch_compile`` under
inductor)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from coda_titan.kernels.gemm import wgrad_fp8_operands
from coda_titan.kernels.scaling import E5M2_MAX, inv_scale_from_amax, quantize_e4m3, quantize_e5m2

from .bf16 import b2_eager, qkv_eager
from .common import BF, EPS, M, Setup, float8_linears


def _one():
    return torch.ones((), device="cuda")


def scaled_mm(a8, w8):
    """cuBLAS fp8 GEMM a8 @ w8^T, unit scales, fast accumulation (the bare fp8 GEMM)."""
    one = _one()
    return lambda: torch._scaled_mm(a8, w8.t(), scale_a=one, scale_b=one, out_dtype=BF, use_fast_accum=True)


def residual_rms_fp8(s: Setup):
    """F1 producing e4m3 H (bf16 GEMM; its A operand is the attention / SwiGLU output)."""
    d, k = s.d, s.hq * s.hd
    y, wo, res = s.r(M, k), s.r(d, k, scale=k**-0.5), s.r(M, d)
    f8_wo = float8_linears(wo)[0]
    _, inv_h = s.h8

    def eager():
        x = res + f8_wo(y)
        return x, F.rms_norm(x, (d,), s.gamma, EPS)

    return "residual_rms_fp8", "fwd", dict(
        coda=lambda: s.be.residual_rms_fp8(y=y, weight=wo, residual=res, gamma=s.gamma, tile_n=128, inv_scale=inv_h),
        coda_bf16=lambda: s.be.residual_rms(y=y, weight=wo, residual=res, gamma=s.gamma, tile_n=128),
        bare_gemm=[lambda: torch.mm(y, wo.t())], eager=eager)



def residual_rms_q_w2(s: Setup):
    """F1 with an fp8 mainloop at the down-projection (e4m3 y of width F, e4m3 W2), writing e4m3 H:
    issue 19's program for W2's forward."""
    d, k = s.d, s.ff
    y = s.r(M, k, scale=0.5)
    inv_y = inv_scale_from_amax(y.float().abs().amax())
    yq = quantize_e4m3(y.float(), inv_y)
    w2q, s_w2 = s.be.quantize_tensorwise(w=s.w2)
    res = s.r(M, d)
    f8_w2 = float8_linears(s.w2)[0]
    _, inv_h = s.h8

    def eager():
        x = res + f8_w2(y)
        return x, F.rms_norm(x, (d,), s.gamma, EPS)

    return "residual_rms_q_w2", "fwd", dict(
        coda=lambda: s.be.residual_rms_q_fp8(yq=yq, wq=w2q, scale=s_w2 / inv_y, residual=res, gamma=s.gamma,
                                             tile_n=128, inv_scale=inv_h),
        coda_bf16=lambda: s.be.residual_rms_fp8(y=y, weight=s.w2, residual=res, gamma=s.gamma, tile_n=128,
                                                inv_scale=inv_h),
        bare_gemm=[scaled_mm(yq, w2q)], eager=eager)


def norm_swiglu_fp8(s: Setup):
    """F2 on e4m3 operands."""
    h8, inv_h = s.h8
    w13q, s_w13 = s.w13q
    f8_w1, f8_w3 = float8_linears(*s.w1_w3)

    def eager():
        n = F.rms_norm(s.h, (s.d,), None, EPS)
        return F.silu(f8_w1(n)) * f8_w3(n)

    return "norm_swiglu_fp8", "fwd", dict(
        coda=lambda: s.be.norm_swiglu_fp8(hq=h8, rstd=s.rstd, w13q=w13q, scale=s_w13 / inv_h, out_dtype=BF),
        coda_bf16=lambda: s.be.norm_swiglu(h=s.h, rstd=s.rstd, w13=s.w13),
        bare_gemm=[scaled_mm(h8, w13q)], eager=eager)



def norm_rope_fp8(s: Setup):
    """F3 on e4m3 operands."""
    h8, inv_h = s.h8
    wqkv8, s_qkv = s.wqkv8
    linears = float8_linears(*s.wqkv.split([s.hq * s.hd, s.hkv * s.hd, s.hkv * s.hd]))
    return "norm_rope_fp8", "fwd", dict(
        coda=lambda: s.be.norm_rope_fp8(hq=h8, rstd=s.rstd, weight_q=wqkv8, scale=s_qkv / inv_h, out_dtype=BF,
                                        **s.rope),
        coda_bf16=lambda: s.be.norm_rope(h=s.h, rstd=s.rstd, weight=s.wqkv, **s.rope),
        bare_gemm=[scaled_mm(h8, wqkv8)], eager=qkv_eager(s, linears))



def rope_bwd_fp8(s: Setup):
    """B1 with its e5m2 copy of da (delayed scale, ``fp8_dgrad``; the history's amax: this one's)."""
    b1 = s.b1
    dy = b1["dy"].float()
    inv = inv_scale_from_amax(s.be.rope_bwd_fp8(**b1, inv_scale=None)[3], E5M2_MAX)
    return "rope_bwd_fp8", "bwd", dict(
        coda=lambda: s.be.rope_bwd_fp8(**b1, inv_scale=inv), coda_bf16=lambda: s.be.rope_bwd(**b1), bare_gemm=[],
        eager=lambda: quantize_e5m2(dy, inv_scale_from_amax(dy.abs().amax(), E5M2_MAX)))



def _b2_fp8(s: Setup, name, da, daq, s_da, zdz, weight, weight_q, s_w):
    """B2 on e5m2 da x the e4m3 weight transposed, against its bf16 twin and stock's fp8 version."""
    x, dres = s.b2
    w_t = weight_q.t().contiguous()
    norm = dict(x=x, gamma=s.gamma, rstd=s.rstd, zdz=zdz, dresidual=dres)

    def gemm():
        return torch._scaled_mm(daq, w_t.t(), scale_a=s_da.float(), scale_b=s_w.float(), out_dtype=BF)

    return name, "bwd", dict(
        coda=lambda: s.be.norm_residual_bwd_fp8(daq=daq, weight_tq=w_t, scale=s_da * s_w, **norm),
        coda_bf16=lambda: s.be.norm_residual_bwd(da=da, weight=weight, **norm),
        bare_gemm=[scaled_mm(daq, w_t)], eager=b2_eager(s, gemm, x, dres))


def norm_residual_bwd_fp8(s: Setup):
    """F3's dgrad B2 on e5m2 da x e4m3 W_qkv^T (``fp8_dgrad``)."""
    da, zdz, daq, amax = s.be.rope_bwd_fp8(**s.b1, inv_scale=None)
    s_da = inv_scale_from_amax(amax, E5M2_MAX).reciprocal()
    wqkv8, s_qkv = s.wqkv8
    return _b2_fp8(s, "norm_residual_bwd_fp8", da, daq, s_da, zdz, s.wqkv, wqkv8, s_qkv)



def swiglu_bwd_fp8(s: Setup):
    """B3 also writing e5m2 da with a delayed scale (``fp8_mlp_dgrad``)."""
    b3, da, _, inv_g = s.b3
    return "swiglu_bwd_fp8", "bwd", dict(
        coda=lambda: s.be.swiglu_bwd_fp8(**b3, inv_scale=inv_g), coda_bf16=lambda: s.be.swiglu_bwd(**b3),
        bare_gemm=[lambda: torch.mm(b3["dout"], s.w2)],
        eager=lambda: quantize_e5m2(da.float(), inv_scale_from_amax(da.float().abs().amax(), E5M2_MAX)))


def swiglu_bwd_e5m2(s: Setup):
    """B3 writing only e5m2 da (``fp8_mlp_wgrad_e5m2``): coda_bf16 is the fp8 B3 it replaces
    (``swiglu_bwd_fp8``, bf16 da too)."""
    b3, _, _, inv_g = s.b3
    return "swiglu_bwd_e5m2", "bwd", dict(
        coda=lambda: s.be.swiglu_bwd_e5m2(**b3, inv_scale=inv_g), coda_bf16=lambda: s.be.swiglu_bwd_fp8(**b3, inv_scale=inv_g),
        bare_gemm=[lambda: torch.mm(b3["dout"], s.w2)])


def wgrad_fp8_e5m2_w13(s: Setup):
    """dW13 on B3's e5m2 da (``fp8_mlp_wgrad_e5m2``): its token-major copy and H's cast-and-transpose,
    then cuBLAS fp8. coda_bf16 is the fp8 wgrad it replaces (``wgrad_fp8`` on the bf16 da)."""
    b3, da, _, inv_g = s.b3
    daq = s.be.swiglu_bwd_e5m2(**b3, inv_scale=inv_g)[2]
    amax_da, amax_h = da.float().abs().amax(), s.h.float().abs().amax()
    daq_t, h8_t, one = daq.t().contiguous(), s.h8[0].t().contiguous(), _one()
    return "wgrad_fp8_e5m2_w13", "bwd", dict(
        coda=lambda: s.be.wgrad_fp8_e5m2(gradq=daq, grad_scale=1 / inv_g, inp=s.h, inp_amax=amax_h, out_dtype=BF),
        coda_bf16=lambda: s.be.wgrad_fp8(grad=da, grad_amax=amax_da, inp=s.h, inp_amax=amax_h, out_dtype=BF),
        bare_gemm=[lambda: torch._scaled_mm(daq_t, h8_t.t(), scale_a=one, scale_b=one, out_dtype=BF)])


def swiglu_bwd_e5m2_t(s: Setup):
    """B3 also storing da transposed (M-major 8-bit outputs; `fp8_mlp_da_t`): coda_bf16 is the
    B3 it would replace (``swiglu_bwd_e5m2``)."""
    b3, _, _, inv_g = s.b3
    return "swiglu_bwd_e5m2_t", "bwd", dict(
        coda=lambda: s.be.swiglu_bwd_e5m2_t(**b3, inv_scale=inv_g), coda_bf16=lambda: s.be.swiglu_bwd_e5m2(**b3, inv_scale=inv_g),
        bare_gemm=[lambda: torch.mm(b3["dout"], s.w2)])


def swiglu_bwd_e5m2_t_q(s: Setup):
    """That B3 on an fp8 GEMM (``fp8_down_dgrad`` with ``fp8_mlp_da_t``), D's e5m2 cast included as the
    model runs it (``quantize_grad``: amax, then the cast): coda_bf16 is the B3 it would replace
    (``swiglu_bwd_e5m2_t``, bf16 GEMM); bare_gemm the fp8 GEMM alone."""
    b3, _, _, inv_g = s.b3
    (w2q_t,), (s_w,), _ = s.be.fp8_weights(ws=[s.w2.t().contiguous()])
    dq = s.be.quantize_grad(t=b3["dout"])[0]
    ops = dict(a=b3["a"], rstd=b3["rstd"], inv_scale=inv_g)

    def coda():
        q, s_d = s.be.quantize_grad(t=b3["dout"])
        return s.be.swiglu_bwd_e5m2_t_q(doutq=q, w_down_tq=w2q_t, scale=(s_d * s_w).reshape(()), **ops)

    return "swiglu_bwd_e5m2_t_q", "bwd", dict(
        coda=coda, coda_bf16=lambda: s.be.swiglu_bwd_e5m2_t(**b3, inv_scale=inv_g), bare_gemm=[scaled_mm(dq, w2q_t)])


def b3_and_dw13_t(s: Setup):
    """B3 + dW13 with da^T from B3's epilogue (one fp8 GEMM on the whole (2F, M) da^T: [dW1; dW3], no
    copy pass), against B3 + dW13 as the model runs them (``swiglu_bwd_e5m2`` + ``wgrad_fp8_e5m2``,
    one copy pass). (The row of 2026-11-24 ran an earlier form: one GEMM per half, H cast twice.)"""
    b3, _, _, inv_g = s.b3
    amax_h, scale = s.h.float().abs().amax(), 1 / inv_g
    w = dict(grad_scale=scale, inp=s.h, inp_amax=amax_h, out_dtype=BF)

    def with_t():
        return s.be.wgrad_fp8_e5m2(gradq=s.be.swiglu_bwd_e5m2_t(**b3, inv_scale=inv_g)[3].t(), **w)

    def as_now():
        return s.be.wgrad_fp8_e5m2(gradq=s.be.swiglu_bwd_e5m2(**b3, inv_scale=inv_g)[2], **w)

    return "b3_and_dw13_t", "bwd", dict(coda=with_t, coda_bf16=as_now, bare_gemm=[lambda: torch.mm(b3["dout"], s.w2)])


def norm_residual_bwd_fp8_w13(s: Setup):
    """The MLP's dgrad B2 on e5m2 da x e4m3 W13^T (``fp8_mlp_dgrad``)."""
    b3, da, zdz, inv_g = s.b3
    daq = s.be.swiglu_bwd_fp8(**b3, inv_scale=inv_g)[3]
    w13q, s_w13 = s.w13q
    return _b2_fp8(s, "norm_residual_bwd_fp8_w13", da, daq, inv_g.reciprocal(), zdz, s.w13, w13q, s_w13)


def wgrad_fp8_w13(s: Setup):
    """dW13 = da^T H as torchao's float8 weight gradient with the amaxes B3 and F1 report
    (``fp8_mlp_wgrad``). Bare GEMM: cuBLAS fp8 on token-major copies made beforehand; eager:
    torchao's steps, amax passes included."""
    b3, da, _, inv_g = s.b3
    daq_t = s.be.swiglu_bwd_fp8(**b3, inv_scale=inv_g)[3].t().contiguous()
    h8_t = s.h8[0].t().contiguous()
    amax_da, amax_h = da.float().abs().amax(), s.h.float().abs().amax()
    one = _one()

    def eager():
        g8, s_g8, x8, s_x8 = wgrad_fp8_operands(da, None, s.h, None)
        return torch._scaled_mm(g8.t().contiguous(), x8.t().contiguous().t(), scale_a=s_g8, scale_b=s_x8,
                                out_dtype=BF, use_fast_accum=False)

    return "wgrad_fp8_w13", "bwd", dict(
        coda=lambda: s.be.wgrad_fp8(grad=da, grad_amax=amax_da, inp=s.h, inp_amax=amax_h, out_dtype=BF),
        coda_bf16=lambda: s.be.wgrad(grad=da, inp=s.h, out_dtype=BF),
        bare_gemm=[lambda: torch._scaled_mm(daq_t, h8_t.t(), scale_a=one, scale_b=one, out_dtype=BF)],
        eager=eager)


def quantize_tensorwise(s: Setup):
    """The per-step weight pass: amax + cast of W13."""
    w = s.w13
    return "quantize_tensorwise", "fwd", dict(
        coda=lambda: s.be.quantize_tensorwise(w=w), bare_gemm=[],
        eager=lambda: quantize_e4m3(w.float(), inv_scale_from_amax(w.float().abs().amax())))


PROGRAMS = (residual_rms_fp8, residual_rms_q_w2, norm_swiglu_fp8, norm_rope_fp8, rope_bwd_fp8, norm_residual_bwd_fp8, swiglu_bwd_fp8,
            norm_residual_bwd_fp8_w13, wgrad_fp8_w13, swiglu_bwd_e5m2, wgrad_fp8_e5m2_w13, swiglu_bwd_e5m2_t,
            swiglu_bwd_e5m2_t_q, b3_and_dw13_t, quantize_tensorwise)
