"""Plain GEMMs of the step: weight and input gradients, and the fp8 weight pass.

    wgrad:  dW = grad^T @ inp            (N, K), fp32 accumulation
    dgrad:  dX = grad @ W                (M, K)

No row scales are needed: every backward program folds the deferred rstd into the gradient it
produces (da = r * dp, see ``norm_residual_bwd``), so for a norm consumer dW = da^T @ H with
H = X * gamma exactly as the producer epilogue saved it. Outputs are in ``out_dtype``.

FP8 (precision = "fp8"):

    quantize_tensorwise  W -> (e4m3 Wq, s): current-amax tensorwise scale (torchao's weights)
    fp8_layer_weights    the weight pass of every layer at once: W13 = interleave_rows(w1, w3) and
                         W_qkv = cat(wq, wk, wv), each quantized as above, plus the transposed copies
                         B2's fp8 dgrads read (fp8 WGMMA operands must be K-major, and B2 contracts
                         over the weight's rows). One call per forward: the host launches it once.
    wgrad_fp8            dW = grad^T @ inp as torchao's float8 weight gradient: grad cast to e5m2 and
                         inp to e4m3, each with a *current* tensorwise scale rounded down to a power
                         of two (``wgrad_fp8_operands``), exact products summed in fp32, times
                         s_g * s_x. The amaxes come from the epilogues that produced the operands
                         (B3 reports amax |da|, F1 amax |H|); None: computed here.
    wgrad_fp8_e5m2       the same with the gradient already e5m2 (B3's da, written by its epilogue
                         with the gradient site's delayed scale; ``grad_scale`` = 1 / inv dequantizes
                         it): no cast of the gradient, only its token-major copy.
    wgrad_fp8_e4m3       the same with the input already e4m3 (B3's y, with the down-projection input
                         site's delayed scale; ``inp_scale`` = 1 / inv) and the gradient cast.
    dgrad_fp8_q          dX = grad @ W on an e5m2 gradient and the e4m3 W^T, both with their scales
                         (``fp8_out_bwd``: the W_o dgrad on the cast dW_o reads too).
"""

from __future__ import annotations

from typing import Optional

import torch

from ._common import acc_dtype, check_2d, interleave_rows, mm, program_op
from .scaling import (
    E4M3, E4M3_MAX, E5M2, E5M2_MAX, compute_dtype, inv_scale_from_amax, pow2_floor, quantize_e4m3, quantize_e5m2,
)


def _check_rows(grad: torch.Tensor, inp: torch.Tensor) -> None:
    check_2d("grad", grad)
    check_2d("inp", inp)
    if grad.shape[0] != inp.shape[0]:
        raise ValueError(f"grad and inp need the same rows, got {tuple(grad.shape)} and {tuple(inp.shape)}")


def wgrad(*, grad: torch.Tensor, inp: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    _check_rows(grad, inp)
    return mm(grad.t(), inp).to(out_dtype)


def dgrad(*, grad: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    check_2d("grad", grad, weight.shape[0])
    return mm(grad, weight).to(out_dtype)


def quantize_tensorwise(*, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(wq, s): current-amax tensorwise e4m3 of ``w`` and its dequantization scale s = 1/inv (0-dim)."""
    wf = w.to(acc_dtype(w))
    inv = inv_scale_from_amax(wf.abs().amax())
    return quantize_e4m3(wf, inv), inv.reciprocal()


def fp8_layer_weights(
    *, w1: list[torch.Tensor], w3: list[torch.Tensor], wq: list[torch.Tensor], wk: list[torch.Tensor],
    wv: list[torch.Tensor], w13_t: bool = False, wqkv_t: bool = False,
) -> tuple[list[torch.Tensor], torch.Tensor, list[torch.Tensor], torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """(W13q per layer, their scales (L,), W_qkv,q per layer, their scales (L,), W13q^T per layer if
    ``w13_t`` else [], W_qkv,q^T per layer if ``wqkv_t`` else [])."""
    if not (len(w1) == len(w3) == len(wq) == len(wk) == len(wv)):
        raise ValueError(f"need one weight of each kind per layer, got {[len(t) for t in (w1, w3, wq, wk, wv)]}")
    w13 = [quantize_tensorwise(w=interleave_rows(a, b)) for a, b in zip(w1, w3)]
    qkv = [quantize_tensorwise(w=torch.cat([q, k, v])) for q, k, v in zip(wq, wk, wv)]

    def scales(pairs):
        return torch.stack([s for _, s in pairs]) if pairs else torch.empty(0)

    def transposed(pairs, want: bool):
        return [q.t().contiguous() for q, _ in pairs] if want else []

    return ([q for q, _ in w13], scales(w13), [q for q, _ in qkv], scales(qkv),
            transposed(w13, w13_t), transposed(qkv, wqkv_t))


def fp8_weights(*, ws: list[torch.Tensor], transposed: bool = False
                ) -> tuple[list[torch.Tensor], torch.Tensor, list[torch.Tensor]]:
    """(e4m3 W per layer, their dequantization scales (L,), e4m3 W^T per layer if ``transposed`` else []):
    the weight pass of one weight kind (tensorwise, current amax), e.g. every layer's W2 for
    ``fp8_down_proj`` and, transposed, for B3's fp8 GEMM (``fp8_down_dgrad``)."""
    pairs = [quantize_tensorwise(w=w) for w in ws]
    return ([q for q, _ in pairs], torch.stack([s for _, s in pairs]) if pairs else torch.empty(0),
            [q.t().contiguous() for q, _ in pairs] if transposed else [])


def fp8_weight_t(*, w: torch.Tensor) -> torch.Tensor:
    """W^T's e4m3 codes (K-major for an fp8 dgrad) from W's, the same codes the weight pass would transpose
    (``fp8_weight_t_bwd``: made by the backward that reads them instead of held through the step)."""
    check_2d("w", w)
    return w.t().contiguous()


def pow2_inv_scale(amax: torch.Tensor, fmax: float) -> torch.Tensor:
    """The tensorwise inverse scale fmax / amax rounded down to a power of two (the weight gradients' recipe)."""
    return pow2_floor(inv_scale_from_amax(amax, fmax))


def _pow2_cast(t: torch.Tensor, amax: torch.Tensor | None, quantize, fmax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(``quantize``(t), s): ``t`` (in its compute dtype) cast with the tensorwise scale of ``amax``
    (None: t's own) rounded down to a power of two, and its dequantization scale s = 1/inv."""
    inv = pow2_inv_scale(t.abs().amax() if amax is None else amax.to(t.dtype), fmax)
    return quantize(t, inv), inv.reciprocal()


def wgrad_fp8_operands(
    grad: torch.Tensor, grad_amax: torch.Tensor | None, inp: torch.Tensor, inp_amax: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(gq, s_g, xq, s_x): grad as e5m2 and inp as e4m3, each with the current tensorwise scale of
    its amax (computed here when None) rounded down to a power of two, in the compute dtype's
    arithmetic (fp64 for fp64 inputs).

    Why a power of two: with ``fmax / amax`` itself, the whole rounding grid moves with the amax, a
    single element, so two correct runs whose gradients differ at the fp8-noise level would round
    every element independently. With a power-of-two scale an element's rounding is its own."""
    ct = compute_dtype(grad.dtype)
    return (*_pow2_cast(grad.to(ct), grad_amax, quantize_e5m2, E5M2_MAX),
            *_pow2_cast(inp.to(ct), inp_amax, quantize_e4m3, E4M3_MAX))


def wgrad_fp8(
    *, grad: torch.Tensor, grad_amax: torch.Tensor | None, inp: torch.Tensor, inp_amax: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """dW = grad^T @ inp on fp8 operands (module docstring), in ``out_dtype``."""
    _check_rows(grad, inp)
    return _scaled_product(*wgrad_fp8_operands(grad, grad_amax, inp, inp_amax), out_dtype)


def _scaled_product(gq: torch.Tensor, s_g: torch.Tensor, xq: torch.Tensor, s_x: torch.Tensor,
                    out_dtype: torch.dtype) -> torch.Tensor:
    """(s_g gq)^T @ (s_x xq) of a weight gradient's fp8 operands: exact products, summed in the compute
    dtype of ``out_dtype``, scaled once, rounded once to ``out_dtype``."""
    ct = compute_dtype(out_dtype)
    return ((gq.to(ct).t() @ xq.to(ct)) * (s_g.to(ct) * s_x.to(ct))).to(out_dtype)


def wgrad_fp8_grad(grad: torch.Tensor, grad_amax: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(gq, s_g): a weight gradient's gradient operand as e5m2 with the current power-of-two scale of
    its amax (``wgrad_fp8_operands``' first half)."""
    return _pow2_cast(grad.to(compute_dtype(grad.dtype)), grad_amax, quantize_e5m2, E5M2_MAX)


def wgrad_fp8_input(inp: torch.Tensor, inp_amax: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(xq, s_x): a weight gradient's input as e4m3 with the current power-of-two scale of its amax
    (``wgrad_fp8_operands``' second half)."""
    return _pow2_cast(inp.to(compute_dtype(inp.dtype)), inp_amax, quantize_e4m3, E4M3_MAX)


def wgrad_fp8_e5m2(
    *, gradq: torch.Tensor, grad_scale: torch.Tensor, inp: torch.Tensor, inp_amax: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """dW = (grad_scale * gradq)^T @ inp: ``wgrad_fp8`` on an e5m2 gradient given with its scale."""
    _check_rows(gradq, inp)
    if gradq.dtype != E5M2:
        raise TypeError(f"wgrad_fp8_e5m2 takes an e5m2 gradient, got {gradq.dtype}")
    return _scaled_product(gradq, grad_scale, *wgrad_fp8_input(inp, inp_amax), out_dtype)


def wgrad_fp8_e4m3(
    *, grad: torch.Tensor, grad_amax: torch.Tensor | None, inpq: torch.Tensor, inp_scale: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """dW = grad^T @ (inp_scale * inpq): ``wgrad_fp8`` on an e4m3 input given with its scale."""
    _check_rows(grad, inpq)
    if inpq.dtype != E4M3:
        raise TypeError(f"wgrad_fp8_e4m3 takes an e4m3 input, got {inpq.dtype}")
    return _scaled_product(*wgrad_fp8_grad(grad, grad_amax), inpq, inp_scale, out_dtype)


def wgrad_fp8_q(
    *, gradq: torch.Tensor, grad_scale: torch.Tensor, inpq: torch.Tensor, inp_scale: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """dW = (grad_scale * gradq)^T @ (inp_scale * inpq): both operands already fp8 (an e5m2 gradient, an
    e4m3 input) with their scales, no cast of either (``fp8_mlp_h_t``)."""
    _check_rows(gradq, inpq)
    if gradq.dtype != E5M2 or inpq.dtype != E4M3:
        raise TypeError(f"wgrad_fp8_q takes an e5m2 gradient and an e4m3 input, got {gradq.dtype} and {inpq.dtype}")
    return _scaled_product(gradq, grad_scale, inpq, inp_scale, out_dtype)


def dgrad_fp8_q(
    *, gradq: torch.Tensor, grad_scale: torch.Tensor, weight_tq: torch.Tensor, w_scale: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """dX = (grad_scale * gradq) @ (w_scale * Wq): a dgrad on an e5m2 gradient and the e4m3 weight given
    transposed (``weight_tq`` = Wq^T, (in, out): K-major for the fp8 MMA), no cast of either
    (``fp8_out_bwd``: the W_o dgrad on the gradient's one cast, which dW_o reads too)."""
    if gradq.dtype != E5M2 or weight_tq.dtype != E4M3:
        raise TypeError(f"dgrad_fp8_q takes an e5m2 gradient and an e4m3 weight, got {gradq.dtype} and {weight_tq.dtype}")
    if gradq.shape[1] != weight_tq.shape[1]:
        raise ValueError(f"dgrad_fp8_q: gradient {tuple(gradq.shape)} against W^T {tuple(weight_tq.shape)}")
    ct = compute_dtype(out_dtype)
    return ((gradq.to(ct) @ weight_tq.to(ct).t()) * (grad_scale.to(ct) * w_scale.to(ct))).to(out_dtype)


# --- custom ops ------------------------------------------------------------------------------------


@program_op("wgrad")
def wgrad_op(grad: torch.Tensor, inp: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return wgrad(grad=grad, inp=inp, out_dtype=out_dtype)


@wgrad_op.register_fake
def _(grad, inp, out_dtype):
    return grad.new_empty((grad.shape[1], inp.shape[1]), dtype=out_dtype)


@program_op("dgrad")
def dgrad_op(grad: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return dgrad(grad=grad, weight=weight, out_dtype=out_dtype)


@dgrad_op.register_fake
def _(grad, weight, out_dtype):
    return grad.new_empty((grad.shape[0], weight.shape[1]), dtype=out_dtype)


@program_op("quantize_tensorwise")
def quantize_tensorwise_op(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_tensorwise(w=w)


@quantize_tensorwise_op.register_fake
def _(w):
    return w.new_empty(w.shape, dtype=E4M3), w.new_empty((), dtype=acc_dtype(w))


@program_op("fp8_layer_weights")
def fp8_layer_weights_op(
    w1: list[torch.Tensor], w3: list[torch.Tensor], wq: list[torch.Tensor], wk: list[torch.Tensor],
    wv: list[torch.Tensor], w13_t: bool, wqkv_t: bool,
) -> tuple[list[torch.Tensor], torch.Tensor, list[torch.Tensor], torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    return fp8_layer_weights(w1=w1, w3=w3, wq=wq, wk=wk, wv=wv, w13_t=w13_t, wqkv_t=wqkv_t)


@fp8_layer_weights_op.register_fake
def _(w1, w3, wq, wk, wv, w13_t, wqkv_t):
    n = len(w1)
    ct = acc_dtype(w1[0]) if n else torch.float32
    w13 = [a.new_empty((2 * a.shape[0], a.shape[1]), dtype=E4M3) for a in w1]
    qkv = [q.new_empty((q.shape[0] + k.shape[0] + v.shape[0], q.shape[1]), dtype=E4M3) for q, k, v in zip(wq, wk, wv)]
    dev = w1[0].device if n else None
    w13_ts = [t.new_empty((t.shape[1], t.shape[0])) for t in w13] if w13_t else []
    qkv_ts = [t.new_empty((t.shape[1], t.shape[0])) for t in qkv] if wqkv_t else []
    return w13, torch.empty(n, dtype=ct, device=dev), qkv, torch.empty(n, dtype=ct, device=dev), w13_ts, qkv_ts


@program_op("fp8_weights")
def fp8_weights_op(ws: list[torch.Tensor], transposed: bool = False
                   ) -> tuple[list[torch.Tensor], torch.Tensor, list[torch.Tensor]]:
    return fp8_weights(ws=ws, transposed=transposed)


@fp8_weights_op.register_fake
def _(ws, transposed=False):
    return ([w.new_empty(w.shape, dtype=E4M3) for w in ws],
            torch.empty(len(ws), dtype=acc_dtype(ws[0]) if ws else torch.float32, device=ws[0].device if ws else None),
            [w.new_empty((w.shape[1], w.shape[0]), dtype=E4M3) for w in ws] if transposed else [])


@program_op("fp8_weight_t")
def fp8_weight_t_op(w: torch.Tensor) -> torch.Tensor:
    return fp8_weight_t(w=w)


@fp8_weight_t_op.register_fake
def _(w):
    return w.new_empty((w.shape[1], w.shape[0]))


@program_op("wgrad_fp8")
def wgrad_fp8_op(
    grad: torch.Tensor, grad_amax: Optional[torch.Tensor], inp: torch.Tensor, inp_amax: Optional[torch.Tensor],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return wgrad_fp8(grad=grad, grad_amax=grad_amax, inp=inp, inp_amax=inp_amax, out_dtype=out_dtype)


@wgrad_fp8_op.register_fake
def _(grad, grad_amax, inp, inp_amax, out_dtype):
    return grad.new_empty((grad.shape[1], inp.shape[1]), dtype=out_dtype)


@program_op("wgrad_fp8_e5m2")
def wgrad_fp8_e5m2_op(
    gradq: torch.Tensor, grad_scale: torch.Tensor, inp: torch.Tensor, inp_amax: Optional[torch.Tensor],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return wgrad_fp8_e5m2(gradq=gradq, grad_scale=grad_scale, inp=inp, inp_amax=inp_amax, out_dtype=out_dtype)


@wgrad_fp8_e5m2_op.register_fake
def _(gradq, grad_scale, inp, inp_amax, out_dtype):
    return inp.new_empty((gradq.shape[1], inp.shape[1]), dtype=out_dtype)


@program_op("wgrad_fp8_e4m3")
def wgrad_fp8_e4m3_op(
    grad: torch.Tensor, grad_amax: Optional[torch.Tensor], inpq: torch.Tensor, inp_scale: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return wgrad_fp8_e4m3(grad=grad, grad_amax=grad_amax, inpq=inpq, inp_scale=inp_scale, out_dtype=out_dtype)


@wgrad_fp8_e4m3_op.register_fake
def _(grad, grad_amax, inpq, inp_scale, out_dtype):
    return grad.new_empty((grad.shape[1], inpq.shape[1]), dtype=out_dtype)


@program_op("wgrad_fp8_q")
def wgrad_fp8_q_op(
    gradq: torch.Tensor, grad_scale: torch.Tensor, inpq: torch.Tensor, inp_scale: torch.Tensor, out_dtype: torch.dtype,
) -> torch.Tensor:
    return wgrad_fp8_q(gradq=gradq, grad_scale=grad_scale, inpq=inpq, inp_scale=inp_scale, out_dtype=out_dtype)


@wgrad_fp8_q_op.register_fake
def _(gradq, grad_scale, inpq, inp_scale, out_dtype):
    return inpq.new_empty((gradq.shape[1], inpq.shape[1]), dtype=out_dtype)


@program_op("dgrad_fp8_q")
def dgrad_fp8_q_op(
    gradq: torch.Tensor, grad_scale: torch.Tensor, weight_tq: torch.Tensor, w_scale: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return dgrad_fp8_q(gradq=gradq, grad_scale=grad_scale, weight_tq=weight_tq, w_scale=w_scale, out_dtype=out_dtype)


@dgrad_fp8_q_op.register_fake
def _(gradq, grad_scale, weight_tq, w_scale, out_dtype):
    return gradq.new_empty((gradq.shape[0], weight_tq.shape[0]), dtype=out_dtype)
