"""The CODA programs as ``torch.library`` custom ops (``torch.ops.coda.*``).

Each op has one schema, a fake (meta) implementation for torch.compile, and a default
implementation that is the torch reference of ``coda_titan.kernels``. The ``cute`` backend
registers its fused SM90 kernels as the ops' CUDA implementations (``coda_titan.kernels.cute``);
anywhere else the op runs the reference. So a compiled graph holds one opaque node per program (no
graph breaks, no tracing into CuTeDSL), and ``torch.library.opcheck`` can test every schema and
fake on CPU.

Two details differ from the plain reference functions, both allowed by the program contracts:

* ``rms_partial`` / ``residual_rms`` return the partial sums S as (M, 1): the kernel folds its
  per-tile partials itself, and ``rstd_finalize`` only ever sums S over its last dim.
* ``lm_head_ce`` always returns four tensors; without ``compute_grad`` the three gradients are
  empty (0-element) tensors. ``lm_head_ce_op`` maps them back to None.
"""

from __future__ import annotations

from typing import Optional

import torch

from ._common import acc_dtype
from .fp8 import (
    fp8_layer_weights_torch,
    norm_residual_bwd_fp8_torch,
    rope_bwd_fp8_torch,
    norm_rope_fp8_torch,
    norm_swiglu_fp8_torch,
    quantize_tensorwise_torch,
    residual_rms_fp8_torch,
    rms_partial_fp8_torch,
    swiglu_bwd_fp8_torch,
    wgrad_fp8_torch,
)
from .lm_head_ce import lm_head_ce_torch
from .norm_residual_bwd import norm_residual_bwd_torch
from .norm_rope import norm_rope_torch, rope_bwd_torch
from .norm_swiglu import norm_swiglu_torch, swiglu_bwd_torch
from .residual_rms import residual_rms_torch
from .rms_partial import rms_partial_torch
from .rstd_finalize import rstd_finalize_torch
from .wgrad import dgrad_torch, wgrad_torch

__all__ = ["OPS", "REF", "program"]

# op name -> its reference implementation (the op's default kernel; the cute kernels fall back to it)
REF: dict = {}


def _op(fn):
    REF[fn.__name__] = fn
    return torch.library.custom_op(f"coda::{fn.__name__}", fn, mutates_args=())


def _acc(*ts: torch.Tensor) -> torch.dtype:
    return acc_dtype(*ts)


# --- forward programs --------------------------------------------------------------------------


@_op
def rms_partial(x: torch.Tensor, gamma: torch.Tensor, tile_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    h, s = rms_partial_torch(x=x, gamma=gamma, tile_n=tile_n)
    return h, s.sum(-1, keepdim=True)


@rms_partial.register_fake
def _(x, gamma, tile_n):
    return torch.empty_like(x), x.new_empty((x.shape[0], 1), dtype=_acc(x, gamma))


@_op
def residual_rms(
    y: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, gamma: torch.Tensor, tile_n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x, h, s = residual_rms_torch(y=y, weight=weight, residual=residual, gamma=gamma, tile_n=tile_n)
    return x, h, s.sum(-1, keepdim=True)


@residual_rms.register_fake
def _(y, weight, residual, gamma, tile_n):
    return (
        torch.empty_like(residual),
        torch.empty_like(residual),
        residual.new_empty((residual.shape[0], 1), dtype=_acc(y, weight)),
    )


@_op
def rstd_finalize(partials: torch.Tensor, dim: int, eps: float) -> torch.Tensor:
    return rstd_finalize_torch(partials=partials, dim=dim, eps=eps)


@rstd_finalize.register_fake
def _(partials, dim, eps):
    return partials.new_empty((partials.shape[0],))


@_op
def norm_swiglu(h: torch.Tensor, rstd: torch.Tensor, w13: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return norm_swiglu_torch(h=h, rstd=rstd, w13=w13)


@norm_swiglu.register_fake
def _(h, rstd, w13):
    m, f2 = h.shape[0], w13.shape[0]
    return h.new_empty((m, f2 // 2)), h.new_empty((m, f2))


@_op
def norm_rope(
    h: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor,
    freqs: torch.Tensor,
    seqlen: int,
    n_rope_heads: int,
    head_dim: int,
) -> torch.Tensor:
    return norm_rope_torch(
        h=h, rstd=rstd, weight=weight, freqs=freqs, seqlen=seqlen, n_rope_heads=n_rope_heads, head_dim=head_dim
    )


@norm_rope.register_fake
def _(h, rstd, weight, freqs, seqlen, n_rope_heads, head_dim):
    return h.new_empty((h.shape[0], weight.shape[0]))


@_op
def lm_head_ce(
    h: torch.Tensor,
    rstd: torch.Tensor,
    x: torch.Tensor,
    gamma: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_rows: int,
    compute_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    loss, dx, dgamma, dw = lm_head_ce_torch(
        h=h, rstd=rstd, x=x, gamma=gamma, weight=weight, targets=targets,
        chunk_rows=chunk_rows, compute_grad=compute_grad,
    )
    return _ce_outputs(loss, dx, dgamma, dw, h, gamma, weight)


def _ce_outputs(loss, dx, dgamma, dw, h, gamma, weight):
    if dx is None:
        ct = _acc(h, weight)
        dx, dgamma, dw = h.new_empty((0,)), h.new_empty((0,), dtype=ct), weight.new_empty((0,))
    return loss, dx, dgamma, dw


@lm_head_ce.register_fake
def _(h, rstd, x, gamma, weight, targets, chunk_rows, compute_grad):
    ct = _acc(h, weight)
    loss = h.new_empty((), dtype=ct)
    if not compute_grad:
        return loss, h.new_empty((0,)), h.new_empty((0,), dtype=ct), weight.new_empty((0,))
    return loss, torch.empty_like(x), gamma.new_empty(gamma.shape, dtype=ct), torch.empty_like(weight)


# --- FP8 forward programs (``coda_titan.kernels.fp8``) ------------------------------------------


@_op
def rms_partial_fp8(
    x: torch.Tensor, gamma: torch.Tensor, tile_n: int, inv_scale: Optional[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    h, s, hq, amax = rms_partial_fp8_torch(x=x, gamma=gamma, tile_n=tile_n, inv_scale=inv_scale)
    return h, s.sum(-1, keepdim=True), hq, amax


@rms_partial_fp8.register_fake
def _(x, gamma, tile_n, inv_scale):
    ct = _acc(x, gamma)
    return (
        torch.empty_like(x), x.new_empty((x.shape[0], 1), dtype=ct),
        x.new_empty(x.shape, dtype=torch.float8_e4m3fn), x.new_empty((), dtype=ct),
    )


@_op
def residual_rms_fp8(
    y: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor,
    gamma: torch.Tensor,
    tile_n: int,
    inv_scale: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    x, h, s, hq, amax = residual_rms_fp8_torch(
        y=y, weight=weight, residual=residual, gamma=gamma, tile_n=tile_n, inv_scale=inv_scale
    )
    return x, h, s.sum(-1, keepdim=True), hq, amax


@residual_rms_fp8.register_fake
def _(y, weight, residual, gamma, tile_n, inv_scale):
    ct = _acc(y, weight)
    return (
        torch.empty_like(residual), torch.empty_like(residual), residual.new_empty((residual.shape[0], 1), dtype=ct),
        residual.new_empty(residual.shape, dtype=torch.float8_e4m3fn), residual.new_empty((), dtype=ct),
    )


@_op
def quantize_tensorwise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_tensorwise_torch(w=w)


@quantize_tensorwise.register_fake
def _(w):
    return w.new_empty(w.shape, dtype=torch.float8_e4m3fn), w.new_empty((), dtype=_acc(w))


@_op
def fp8_layer_weights(
    w1: list[torch.Tensor], w3: list[torch.Tensor], wq: list[torch.Tensor], wk: list[torch.Tensor],
    wv: list[torch.Tensor], w13_t: bool, wqkv_t: bool,
) -> tuple[list[torch.Tensor], torch.Tensor, list[torch.Tensor], torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    return fp8_layer_weights_torch(w1=w1, w3=w3, wq=wq, wk=wk, wv=wv, w13_t=w13_t, wqkv_t=wqkv_t)


@fp8_layer_weights.register_fake
def _(w1, w3, wq, wk, wv, w13_t, wqkv_t):
    e4 = torch.float8_e4m3fn
    n = len(w1)
    ct = _acc(w1[0]) if n else torch.float32
    w13 = [a.new_empty((2 * a.shape[0], a.shape[1]), dtype=e4) for a in w1]
    qkv = [q.new_empty((q.shape[0] + k.shape[0] + v.shape[0], q.shape[1]), dtype=e4) for q, k, v in zip(wq, wk, wv)]
    dev = w1[0].device if n else None
    w13_ts = [t.new_empty((t.shape[1], t.shape[0])) for t in w13] if w13_t else []
    qkv_ts = [t.new_empty((t.shape[1], t.shape[0])) for t in qkv] if wqkv_t else []
    return w13, torch.empty(n, dtype=ct, device=dev), qkv, torch.empty(n, dtype=ct, device=dev), w13_ts, qkv_ts


@_op
def norm_swiglu_fp8(
    hq: torch.Tensor, rstd: torch.Tensor, w13q: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    return norm_swiglu_fp8_torch(hq=hq, rstd=rstd, w13q=w13q, scale=scale, out_dtype=out_dtype)


@norm_swiglu_fp8.register_fake
def _(hq, rstd, w13q, scale, out_dtype):
    m, f2 = hq.shape[0], w13q.shape[0]
    return hq.new_empty((m, f2 // 2), dtype=out_dtype), hq.new_empty((m, f2), dtype=out_dtype)


@_op
def norm_rope_fp8(
    hq: torch.Tensor,
    rstd: torch.Tensor,
    weight_q: torch.Tensor,
    scale: torch.Tensor,
    freqs: torch.Tensor,
    seqlen: int,
    n_rope_heads: int,
    head_dim: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return norm_rope_fp8_torch(
        hq=hq, rstd=rstd, weight_q=weight_q, scale=scale, freqs=freqs, seqlen=seqlen,
        n_rope_heads=n_rope_heads, head_dim=head_dim, out_dtype=out_dtype,
    )


@norm_rope_fp8.register_fake
def _(hq, rstd, weight_q, scale, freqs, seqlen, n_rope_heads, head_dim, out_dtype):
    return hq.new_empty((hq.shape[0], weight_q.shape[0]), dtype=out_dtype)


# --- backward programs -------------------------------------------------------------------------


@_op
def rope_bwd(
    dy: torch.Tensor,
    y: torch.Tensor,
    rstd: torch.Tensor,
    freqs: torch.Tensor,
    seqlen: int,
    n_rope_heads: int,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    return rope_bwd_torch(
        dy=dy, y=y, rstd=rstd, freqs=freqs, seqlen=seqlen, n_rope_heads=n_rope_heads, head_dim=head_dim
    )


@rope_bwd.register_fake
def _(dy, y, rstd, freqs, seqlen, n_rope_heads, head_dim):
    return torch.empty_like(dy), dy.new_empty((dy.shape[0],), dtype=_acc(dy, y))


@_op
def norm_residual_bwd(
    da: torch.Tensor,
    weight: torch.Tensor,
    x: torch.Tensor,
    gamma: torch.Tensor,
    rstd: torch.Tensor,
    zdz: torch.Tensor,
    dresidual: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    return norm_residual_bwd_torch(da=da, weight=weight, x=x, gamma=gamma, rstd=rstd, zdz=zdz, dresidual=dresidual)


@norm_residual_bwd.register_fake
def _(da, weight, x, gamma, rstd, zdz, dresidual):
    return torch.empty_like(x), x.new_empty((x.shape[1],), dtype=_acc(da, weight))


@_op
def rope_bwd_fp8(
    dy: torch.Tensor,
    y: torch.Tensor,
    rstd: torch.Tensor,
    freqs: torch.Tensor,
    seqlen: int,
    n_rope_heads: int,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return rope_bwd_fp8_torch(
        dy=dy, y=y, rstd=rstd, freqs=freqs, seqlen=seqlen, n_rope_heads=n_rope_heads, head_dim=head_dim
    )


@rope_bwd_fp8.register_fake
def _(dy, y, rstd, freqs, seqlen, n_rope_heads, head_dim):
    ct = _acc(dy, y)
    return (torch.empty_like(dy), dy.new_empty((dy.shape[0],), dtype=ct),
            dy.new_empty(dy.shape, dtype=torch.float8_e5m2), dy.new_empty((), dtype=ct))


@_op
def norm_residual_bwd_fp8(
    daq: torch.Tensor,
    weight_tq: torch.Tensor,
    scale: torch.Tensor,
    x: torch.Tensor,
    gamma: torch.Tensor,
    rstd: torch.Tensor,
    zdz: torch.Tensor,
    dresidual: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    return norm_residual_bwd_fp8_torch(
        daq=daq, weight_tq=weight_tq, scale=scale, x=x, gamma=gamma, rstd=rstd, zdz=zdz, dresidual=dresidual
    )


@norm_residual_bwd_fp8.register_fake
def _(daq, weight_tq, scale, x, gamma, rstd, zdz, dresidual):
    ct = torch.float64 if x.dtype == torch.float64 else torch.float32
    return torch.empty_like(x), x.new_empty((x.shape[1],), dtype=ct)


@_op
def swiglu_bwd(
    dout: torch.Tensor, w_down: torch.Tensor, a: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return swiglu_bwd_torch(dout=dout, w_down=w_down, a=a, rstd=rstd)


@swiglu_bwd.register_fake
def _(dout, w_down, a, rstd):
    m = a.shape[0]
    return torch.empty_like(a), a.new_empty((m, a.shape[1] // 2)), a.new_empty((m,), dtype=_acc(dout, w_down))


@_op
def swiglu_bwd_fp8(
    dout: torch.Tensor, w_down: torch.Tensor, a: torch.Tensor, rstd: torch.Tensor, inv_scale: Optional[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return swiglu_bwd_fp8_torch(dout=dout, w_down=w_down, a=a, rstd=rstd, inv_scale=inv_scale)


@swiglu_bwd_fp8.register_fake
def _(dout, w_down, a, rstd, inv_scale):
    m = a.shape[0]
    ct = _acc(dout, w_down)
    return (torch.empty_like(a), a.new_empty((m, a.shape[1] // 2)), a.new_empty((m,), dtype=ct),
            a.new_empty(a.shape, dtype=torch.float8_e5m2), a.new_empty((), dtype=ct))


@_op
def wgrad(grad: torch.Tensor, inp: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return wgrad_torch(grad=grad, inp=inp, out_dtype=out_dtype)


@wgrad.register_fake
def _(grad, inp, out_dtype):
    return grad.new_empty((grad.shape[1], inp.shape[1]), dtype=out_dtype)


@_op
def wgrad_fp8(
    grad: torch.Tensor, grad_amax: Optional[torch.Tensor], inp: torch.Tensor, inp_amax: Optional[torch.Tensor],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return wgrad_fp8_torch(grad=grad, grad_amax=grad_amax, inp=inp, inp_amax=inp_amax, out_dtype=out_dtype)


@wgrad_fp8.register_fake
def _(grad, grad_amax, inp, inp_amax, out_dtype):
    return grad.new_empty((grad.shape[1], inp.shape[1]), dtype=out_dtype)


@_op
def dgrad(grad: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return dgrad_torch(grad=grad, weight=weight, out_dtype=out_dtype)


@dgrad.register_fake
def _(grad, weight, out_dtype):
    return grad.new_empty((grad.shape[0], weight.shape[1]), dtype=out_dtype)


OPS = {
    "rms_partial": rms_partial,
    "residual_rms": residual_rms,
    "rstd_finalize": rstd_finalize,
    "norm_swiglu": norm_swiglu,
    "norm_rope": norm_rope,
    "lm_head_ce": lm_head_ce,
    "rope_bwd": rope_bwd,
    "norm_residual_bwd": norm_residual_bwd,
    "swiglu_bwd": swiglu_bwd,
    "wgrad": wgrad,
    "dgrad": dgrad,
    "quantize_tensorwise": quantize_tensorwise,
    "fp8_layer_weights": fp8_layer_weights,
    "rms_partial_fp8": rms_partial_fp8,
    "residual_rms_fp8": residual_rms_fp8,
    "norm_swiglu_fp8": norm_swiglu_fp8,
    "norm_rope_fp8": norm_rope_fp8,
    "rope_bwd_fp8": rope_bwd_fp8,
    "norm_residual_bwd_fp8": norm_residual_bwd_fp8,
    "swiglu_bwd_fp8": swiglu_bwd_fp8,
    "wgrad_fp8": wgrad_fp8,
}


def program(name: str):
    """The keyword-only program callable of op ``name`` (the ``cute`` backend's interface)."""
    op = getattr(torch.ops.coda, name)
    if name == "lm_head_ce":

        def lm_head_ce_op(*, h, rstd, x, gamma, weight, targets, chunk_rows, compute_grad=True):
            loss, dx, dgamma, dw = op(h, rstd, x, gamma, weight, targets, chunk_rows, compute_grad)
            return (loss, dx, dgamma, dw) if compute_grad else (loss, None, None, None)

        return lm_head_ce_op

    def call(**kwargs):
        return op(**kwargs)

    call.__name__ = f"{name}_op"
    return call
