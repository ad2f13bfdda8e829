"""CUDA kernels of the plain GEMMs (``coda_titan.kernels.gemm``).

wgrad / dgrad        cuBLAS with fp32 accumulation: every backward program already folded r into
                     da, so there is nothing to fuse
quantize_tensorwise  amax reduction + saturated cast, inductor-fused
fp8_layer_weights    every layer's weight pass in one compiled call: per weight one amax reduction
                     and one pass that interleaves (W13) or concatenates (W_qkv) while it casts
fp8_weights          the same for one weight kind (W2 with ``fp8_down_proj``; W2^T for B3's fp8 GEMM)
fp8_weight_t         an e4m3 weight's transpose by ``transpose_8bit``'s pass, in the backward (``fp8_weight_t_bwd``)
wgrad_fp8            e5m2 / e4m3 token-major copies of both operands (one inductor cast-and-transpose
                     pass each, current power-of-two scales), then cuBLAS ``_scaled_mm`` with slow
                     accumulation, as torchao's weight gradients: SM90 fp8 MMAs read K-major
                     operands only, and a weight gradient contracts over the tokens
wgrad_fp8_e5m2       the same on B3's e5m2 da: its token-major copy (no cast), the input's cast-and-transpose
wgrad_fp8_e4m3       the same on an e4m3 input (B3's y, F3's H): its token-major copy, the gradient's
                     cast-and-transpose (with a given amax, B1's, one Triton pass: ``cast_transpose_e5m2``)
wgrad_fp8_q          the same on two fp8 operands with their scales, no cast (B3's da^T, F1's H^T); a
                     row-major operand (B1's da, dX's and o's codes) copied by ``transpose_8bit``
dgrad_fp8_q          cuBLAS ``_scaled_mm`` of an e5m2 gradient and the e4m3 W^T (K-major as given)
"""

from __future__ import annotations

import torch

from .. import gemm as ref
from ..scaling import E4M3, E5M2, E5M2_MAX
from ._dispatch import KERNEL_DTYPES, fallback, first_call, fused, unsupported, unsupported_fp8
from .transpose_8bit import cast_transpose_e5m2, token_major, transpose_8bit


def _mm(a, b, out_dtype):
    out = a @ b
    return out if out.dtype == out_dtype else out.to(out_dtype)


def _mm_takes(a, b) -> bool:
    """cuBLAS takes a @ b here: both bf16 or both fp16."""
    return a.dtype in KERNEL_DTYPES and b.dtype == a.dtype


@torch.library.register_kernel("coda::wgrad", "cuda")
def _wgrad(grad, inp, out_dtype):
    if not _mm_takes(grad, inp):
        return fallback(ref.wgrad_op, f"dtype {grad.dtype}/{inp.dtype}", grad, inp, out_dtype)
    return _mm(grad.t(), inp, out_dtype)


@torch.library.register_kernel("coda::dgrad", "cuda")
def _dgrad(grad, weight, out_dtype):
    if not _mm_takes(grad, weight):
        return fallback(ref.dgrad_op, f"dtype {grad.dtype}/{weight.dtype}", grad, weight, out_dtype)
    return _mm(grad, weight, out_dtype)


def wgrad_traced(*, grad, inp, out_dtype):
    """``coda::wgrad`` as code a compiled caller traces (``TRACED``): inductor's extern cuBLAS GEMM;
    the op (which says why, once) where cuBLAS does not take the dtypes."""
    return _mm(grad.t(), inp, out_dtype) if _mm_takes(grad, inp) else ref.wgrad_op(grad, inp, out_dtype)


def dgrad_traced(*, grad, weight, out_dtype):
    """``coda::dgrad`` as code a compiled caller traces (``TRACED``)."""
    return _mm(grad, weight, out_dtype) if _mm_takes(grad, weight) else ref.dgrad_op(grad, weight, out_dtype)


@torch.library.register_kernel("coda::quantize_tensorwise", "cuda")
def _quantize_tensorwise(w):
    return fused("quantize_tensorwise", lambda t: ref.quantize_tensorwise(w=t))(w)


@torch.library.register_kernel("coda::fp8_layer_weights", "cuda")
def _fp8_layer_weights(w1, w3, wq, wk, wv, w13_t, wqkv_t):
    return fused(f"fp8_layer_weights_{w13_t:d}{wqkv_t:d}", lambda *ws: ref.fp8_layer_weights(
        w1=ws[0], w3=ws[1], wq=ws[2], wk=ws[3], wv=ws[4], w13_t=w13_t, wqkv_t=wqkv_t,
    ))(list(w1), list(w3), list(wq), list(wk), list(wv))


@torch.library.register_kernel("coda::fp8_weights", "cuda")
def _fp8_weights(ws, transposed=False):
    return fused(f"fp8_weights_{transposed:d}", lambda ts: ref.fp8_weights(ws=ts, transposed=transposed))(list(ws))


@torch.library.register_kernel("coda::fp8_weight_t", "cuda")
def _fp8_weight_t(w):
    if w.element_size() != 1 or not w.is_contiguous() or w.dim() != 2:
        return fallback(ref.fp8_weight_t_op, f"a {w.dtype} weight of stride {w.stride()} (need contiguous 8-bit)", w)
    return transpose_8bit(w)


def _wgrad_fp8_operands_t(grad, grad_amax, inp, inp_amax):
    gq, s_g, xq, s_x = ref.wgrad_fp8_operands(grad, grad_amax, inp, inp_amax)
    return gq.t().contiguous(), s_g, xq.t().contiguous(), s_x


def _wgrad_shapes_unsupported(grad, inp, out_dtype) -> str | None:
    if grad.shape[0] != inp.shape[0] or grad.shape[0] % 16 or grad.shape[1] % 16 or inp.shape[1] % 16:
        return f"shapes {tuple(grad.shape)} / {tuple(inp.shape)} (need equal rows, all % 16)"
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"out dtype {out_dtype}"
    return None


def _wgrad_fp8_unsupported(grad, inp, out_dtype) -> str | None:
    return unsupported(grad, inp) or _wgrad_shapes_unsupported(grad, inp, out_dtype)


def _scaled_wgrad(gt, s_g, xt, s_x, out_dtype):
    return torch._scaled_mm(gt, xt.t(), scale_a=s_g, scale_b=s_x, out_dtype=out_dtype, use_fast_accum=False)


@torch.library.register_kernel("coda::wgrad_fp8", "cuda")
def _wgrad_fp8(grad, grad_amax, inp, inp_amax, out_dtype):
    why = _wgrad_fp8_unsupported(grad, inp, out_dtype)
    if why:
        return fallback(ref.wgrad_fp8_op, why, grad, grad_amax, inp, inp_amax, out_dtype)
    fn = fused(f"wgrad_fp8_operands_{grad_amax is None:d}{inp_amax is None:d}", _wgrad_fp8_operands_t)
    with first_call("wgrad_fp8", grad, inp):
        return _scaled_wgrad(*fn(grad, grad_amax, inp, inp_amax), out_dtype)


def wgrad_fp8_traced(*, grad, grad_amax, inp, inp_amax, out_dtype):
    """``coda::wgrad_fp8`` as code a compiled caller traces (``TRACED``): the cast-and-transpose passes
    fused by inductor with their producers, then the same cuBLAS fp8 GEMM."""
    if _wgrad_fp8_unsupported(grad, inp, out_dtype):
        return ref.wgrad_fp8_op(grad, grad_amax, inp, inp_amax, out_dtype)  # the op says why, once
    return _scaled_wgrad(*_wgrad_fp8_operands_t(grad, grad_amax, inp, inp_amax), out_dtype)


def _unsupported_fp8_operand(t, dtypes=(E4M3,)) -> str | None:
    """``unsupported_fp8`` for a weight gradient's fp8 operand, which may also be the transposed view of a
    token-major copy (as ``swiglu_bwd_e5m2_t`` writes da and y): that copy is then the tensor itself."""
    return unsupported_fp8(t if t.is_contiguous() else t.t(), dtypes=dtypes)


def _wgrad_fp8_e5m2_operands_t(gradq, grad_scale, inp, inp_amax):
    """(``_scaled_wgrad``'s operands): gradq's token-major copy with its given scale, inp cast and transposed."""
    xq, s_x = ref.wgrad_fp8_input(inp, inp_amax)
    return gradq.t().contiguous(), grad_scale.float().reshape(()), xq.t().contiguous(), s_x


def _wgrad_fp8_e5m2_unsupported(gradq, inp, out_dtype) -> str | None:
    why = _unsupported_fp8_operand(gradq, dtypes=(E5M2,))
    return why or unsupported(inp) or _wgrad_shapes_unsupported(gradq, inp, out_dtype)


@torch.library.register_kernel("coda::wgrad_fp8_e5m2", "cuda")
def _wgrad_fp8_e5m2(gradq, grad_scale, inp, inp_amax, out_dtype):
    why = _wgrad_fp8_e5m2_unsupported(gradq, inp, out_dtype)
    if why:
        return fallback(ref.wgrad_fp8_e5m2_op, why, gradq, grad_scale, inp, inp_amax, out_dtype)
    fn = fused(f"wgrad_fp8_e5m2_operands_{inp_amax is None:d}", _wgrad_fp8_e5m2_operands_t)
    with first_call("wgrad_fp8_e5m2", gradq, inp):
        return _scaled_wgrad(*fn(gradq, grad_scale, inp, inp_amax), out_dtype)


def wgrad_fp8_e5m2_traced(*, gradq, grad_scale, inp, inp_amax, out_dtype):
    """``coda::wgrad_fp8_e5m2`` as code a compiled caller traces (``TRACED``): the token-major copy of
    the e5m2 gradient and the cast-and-transpose of the input fused by inductor, then cuBLAS's fp8 GEMM."""
    if _wgrad_fp8_e5m2_unsupported(gradq, inp, out_dtype):
        return ref.wgrad_fp8_e5m2_op(gradq, grad_scale, inp, inp_amax, out_dtype)  # the op says why, once
    return _scaled_wgrad(*_wgrad_fp8_e5m2_operands_t(gradq, grad_scale, inp, inp_amax), out_dtype)


def _wgrad_fp8_e4m3_operands_t(grad, grad_amax, inpq, inp_scale):
    """(``_scaled_wgrad``'s operands): grad cast and transposed (with its amax given, a dense bf16 grad by
    ``cast_transpose_e5m2``'s pass: B1's da under ``fp8_qkv_wgrad``), inpq's token-major copy with its given scale."""
    if grad_amax is not None and grad.dtype == torch.bfloat16 and grad.is_contiguous():
        inv = ref.pow2_inv_scale(grad_amax.float(), E5M2_MAX).reshape(1)  # (ref.wgrad_fp8_grad's scale)
        gq_t, s_g = cast_transpose_e5m2(grad, inv), inv.reciprocal().reshape(())
    else:
        gq, s_g = ref.wgrad_fp8_grad(grad, grad_amax)
        gq_t = gq.t().contiguous()
    return gq_t, s_g, inpq.t().contiguous(), inp_scale.float().reshape(())


def _wgrad_fp8_e4m3_unsupported(grad, inpq, out_dtype) -> str | None:
    return _unsupported_fp8_operand(inpq) or unsupported(grad) or _wgrad_shapes_unsupported(grad, inpq, out_dtype)


@torch.library.register_kernel("coda::wgrad_fp8_e4m3", "cuda")
def _wgrad_fp8_e4m3(grad, grad_amax, inpq, inp_scale, out_dtype):
    why = _wgrad_fp8_e4m3_unsupported(grad, inpq, out_dtype)
    if why:
        return fallback(ref.wgrad_fp8_e4m3_op, why, grad, grad_amax, inpq, inp_scale, out_dtype)
    fn = fused(f"wgrad_fp8_e4m3_operands_{grad_amax is None:d}", _wgrad_fp8_e4m3_operands_t)
    with first_call("wgrad_fp8_e4m3", grad, inpq):
        return _scaled_wgrad(*fn(grad, grad_amax, inpq, inp_scale), out_dtype)


def wgrad_fp8_e4m3_traced(*, grad, grad_amax, inpq, inp_scale, out_dtype):
    """``coda::wgrad_fp8_e4m3`` as code a compiled caller traces (``TRACED``)."""
    if _wgrad_fp8_e4m3_unsupported(grad, inpq, out_dtype):
        return ref.wgrad_fp8_e4m3_op(grad, grad_amax, inpq, inp_scale, out_dtype)  # the op says why, once
    return _scaled_wgrad(*_wgrad_fp8_e4m3_operands_t(grad, grad_amax, inpq, inp_scale), out_dtype)


def _wgrad_fp8_q_operands_t(gradq, grad_scale, inpq, inp_scale, traced=False):
    """(``_scaled_wgrad``'s operands): both fp8 operands' token-major copies (none where they are the
    transposed views of token-major buffers, as B3's da^T and F1's H^T; else ``transpose_8bit``'s pass,
    or for a traced caller's input operand inductor's copy) with their given scales."""
    return (token_major(gradq), grad_scale.float().reshape(()), token_major(inpq, traced_input=traced),
            inp_scale.float().reshape(()))


def _wgrad_fp8_q_unsupported(gradq, inpq, out_dtype) -> str | None:
    why = _unsupported_fp8_operand(gradq, dtypes=(E5M2,)) or _unsupported_fp8_operand(inpq)
    return why or _wgrad_shapes_unsupported(gradq, inpq, out_dtype)


@torch.library.register_kernel("coda::wgrad_fp8_q", "cuda")
def _wgrad_fp8_q(gradq, grad_scale, inpq, inp_scale, out_dtype):
    why = _wgrad_fp8_q_unsupported(gradq, inpq, out_dtype)
    if why:
        return fallback(ref.wgrad_fp8_q_op, why, gradq, grad_scale, inpq, inp_scale, out_dtype)
    with first_call("wgrad_fp8_q", gradq, inpq):
        return _scaled_wgrad(*_wgrad_fp8_q_operands_t(gradq, grad_scale, inpq, inp_scale), out_dtype)


def wgrad_fp8_q_traced(*, gradq, grad_scale, inpq, inp_scale, out_dtype):
    """``coda::wgrad_fp8_q`` as code a compiled caller traces (``TRACED``)."""
    if _wgrad_fp8_q_unsupported(gradq, inpq, out_dtype):
        return ref.wgrad_fp8_q_op(gradq, grad_scale, inpq, inp_scale, out_dtype)  # the op says why, once
    return _scaled_wgrad(*_wgrad_fp8_q_operands_t(gradq, grad_scale, inpq, inp_scale, traced=True), out_dtype)


def _dgrad_fp8_q_unsupported(gradq, weight_tq, out_dtype) -> str | None:
    why = unsupported_fp8(gradq, dtypes=(E5M2,)) or unsupported_fp8(weight_tq)
    if why is None and (gradq.shape[1] != weight_tq.shape[1] or gradq.shape[1] % 16 or weight_tq.shape[0] % 16):
        why = f"shapes {tuple(gradq.shape)} / W^T {tuple(weight_tq.shape)} (need equal K, all % 16)"
    if why is None and out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        why = f"out dtype {out_dtype}"
    return why


def _scaled_dgrad(gradq, grad_scale, weight_tq, w_scale, out_dtype):
    return torch._scaled_mm(gradq, weight_tq.t(), scale_a=grad_scale.float().reshape(()),
                            scale_b=w_scale.float().reshape(()), out_dtype=out_dtype, use_fast_accum=False)


@torch.library.register_kernel("coda::dgrad_fp8_q", "cuda")
def _dgrad_fp8_q(gradq, grad_scale, weight_tq, w_scale, out_dtype):
    why = _dgrad_fp8_q_unsupported(gradq, weight_tq, out_dtype)
    if why:
        return fallback(ref.dgrad_fp8_q_op, why, gradq, grad_scale, weight_tq, w_scale, out_dtype)
    with first_call("dgrad_fp8_q", gradq, weight_tq):
        return _scaled_dgrad(gradq, grad_scale, weight_tq, w_scale, out_dtype)


def dgrad_fp8_q_traced(*, gradq, grad_scale, weight_tq, w_scale, out_dtype):
    """``coda::dgrad_fp8_q`` as code a compiled caller traces (``TRACED``)."""
    if _dgrad_fp8_q_unsupported(gradq, weight_tq, out_dtype):
        return ref.dgrad_fp8_q_op(gradq, grad_scale, weight_tq, w_scale, out_dtype)  # the op says why, once
    return _scaled_dgrad(gradq, grad_scale, weight_tq, w_scale, out_dtype)
