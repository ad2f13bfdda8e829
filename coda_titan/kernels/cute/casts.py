"""CUDA kernels of the fp8 casts (``coda_titan.kernels.casts``).

quantize_delayed     an activation's amax and scale (eager, the reference's roundings), its e4m3 cast
                     inductor-fused; traced whole into a compiled caller (``quantize_delayed_traced``)
quantize_grad        a gradient's amax and power-of-two e5m2 scale and its e5m2 cast: ``transpose_8bit``'s
                     ``grad_e5m2`` passes
quantize_grad_t      the same also storing the codes token-major (no ``transpose_8bit`` copy after it); both
                     skip the amax pass where the gradient's producer gave its amax (the fp8 B2's)
quantize_delayed_t   an activation's e4m3 cast with its delayed scale, its codes row-major and token-major and
                     its amax in one pass (``delayed_e4m3_t``; calibrating: the reference's math, then a copy)

``CODA_TITAN_CAST_PASS=inductor`` runs the previous kernels of ``quantize_grad(_t)`` and ``quantize_delayed_t`` (the
A/B's other arm): the eager amax and scale ops and the inductor-fused cast, then the codes' copy.
"""

from __future__ import annotations

import os

import torch

from .. import casts as ref
from ..scaling import E5M2_MAX, amax_abs, compute_dtype, inv_scale_from_amax, pow2_floor, quantize_e4m3, quantize_e5m2
from ._dispatch import fused
from .transpose_8bit import delayed_e4m3_t, grad_e5m2, transpose_8bit

CAST_PASS_ENV = "CODA_TITAN_CAST_PASS"  # A/B switch: "inductor" (the eager amax, scale ops and fused cast, then the copy)


def _fused_cast(quantize, t, inv):
    """``quantize``(t in its compute dtype, inv), one inductor pass. The amax and the scale are taken
    in eager ops before it, as the reference rounds them (a calibration step's scale must be the one
    the caller derives from the returned amax): only the cast is fused."""
    return fused(quantize.__name__, lambda a, i: quantize(a.to(compute_dtype(a.dtype)), i))(t, inv)


@torch.library.register_kernel("coda::quantize_delayed", "cuda")
def _quantize_delayed(t, inv_scale):
    amax = amax_abs(t).to(compute_dtype(t.dtype))
    return _fused_cast(quantize_e4m3, t, inv_scale_from_amax(amax) if inv_scale is None else inv_scale), amax


def quantize_delayed_traced(*, t, inv_scale):
    """``coda::quantize_delayed`` as code a compiled caller traces (``TRACED``): the amax reduction and
    the cast in the caller's graph, one read of ``t`` each and no ``|t|`` stored, instead of the op's
    eager amax and nested compiled cast (two dynamo calls' host time per F1 input)."""
    return ref.quantize_delayed(t=t, inv_scale=inv_scale)


def _quantize_grad_inductor(t, amax=None):
    """The previous kernels (``CODA_TITAN_CAST_PASS=inductor``, the A/B's other arm): the eager amax (unless
    given) and scale ops, then the inductor-fused cast."""
    amax = amax_abs(t) if amax is None else amax
    inv = pow2_floor(inv_scale_from_amax(amax.to(compute_dtype(t.dtype)), E5M2_MAX))
    return _fused_cast(quantize_e5m2, t, inv), inv.reciprocal()


def _cast_pass(t, amax=None) -> bool:
    """Whether ``quantize_grad`` runs ``grad_e5m2``'s Triton passes: a contiguous 2-d bf16 gradient, with no
    amax or one it takes as given (one element in t's compute dtype, fp32), unless
    ``CODA_TITAN_CAST_PASS=inductor`` asks for the previous kernels."""
    mode = os.environ.get(CAST_PASS_ENV, "triton")
    if mode not in ("triton", "inductor"):
        raise ValueError(f"{CAST_PASS_ENV}={mode!r}: 'triton' (the default) or 'inductor'")
    given = amax is None or (amax.numel() == 1 and amax.dtype == compute_dtype(t.dtype))
    return mode == "triton" and t.dim() == 2 and t.dtype == torch.bfloat16 and t.is_contiguous() and given


def _with_token_major(tq, *rest):
    """(tq, its token-major copy, *rest) for the previous kernels' codes: ``transpose_8bit``'s pass where the codes
    are dense rows, which it reads, else ``.t().contiguous()``."""
    return tq, transpose_8bit(tq) if tq.is_contiguous() else tq.t().contiguous(), *rest


@torch.library.register_kernel("coda::quantize_grad", "cuda")
def _quantize_grad(t, amax=None):
    if _cast_pass(t, amax):
        tq, _, s = grad_e5m2(t, token_major=False, amax=amax)
        return tq, s
    return _quantize_grad_inductor(t, amax)


@torch.library.register_kernel("coda::quantize_grad_t", "cuda")
def _quantize_grad_t(t, amax=None):
    if _cast_pass(t, amax):
        return grad_e5m2(t, token_major=True, amax=amax)
    return _with_token_major(*_quantize_grad_inductor(t, amax))


def _delayed_pass(t, inv_scale) -> bool:
    """Whether ``quantize_delayed_t`` runs ``delayed_e4m3_t``'s one pass: a delayed scale (the calibration step
    needs the amax first: the reference's math) and a contiguous 2-d bf16 activation, unless
    ``CODA_TITAN_CAST_PASS=inductor``."""
    return inv_scale is not None and _cast_pass(t)


@torch.library.register_kernel("coda::quantize_delayed_t", "cuda")
def _quantize_delayed_t(t, inv_scale):
    if _delayed_pass(t, inv_scale):
        return delayed_e4m3_t(t, inv_scale.float().reshape(1))
    return _with_token_major(*_quantize_delayed(t, inv_scale))


def quantize_delayed_t_traced(*, t, inv_scale):
    """``coda::quantize_delayed_t`` as code a compiled caller traces (``TRACED``): ``delayed_e4m3_t``'s
    ``triton_op`` and the max of its tiles' amaxes; calibrating (no scale yet), the reference's math traced
    (as ``quantize_delayed_traced``) and the codes' copy, inductor's; so too under
    ``CODA_TITAN_CAST_PASS=inductor`` (the A/B's other arm: inductor's amax, cast and copy)."""
    if _delayed_pass(t, inv_scale):
        y, yt, part = torch.ops.coda.delayed_e4m3_t(t, inv_scale.float().reshape(1))
        return y, yt, part.amax().view(torch.float32)
    return ref.quantize_delayed_t(t=t, inv_scale=inv_scale)


def quantize_grad_traced(*, t, amax=None):
    """``coda::quantize_grad`` as code a compiled caller traces (``TRACED``): ``grad_e5m2``'s ``triton_op``, whose
    kernels inductor launches (``_amax``: with the producer's amax, no amax pass), or, under
    ``CODA_TITAN_CAST_PASS=inductor``, the op as before."""
    if not _cast_pass(t, amax):
        return ref.quantize_grad_op(t, amax)
    return torch.ops.coda.grad_e5m2(t) if amax is None else torch.ops.coda.grad_e5m2_amax(t, amax.reshape(1))


def quantize_grad_t_traced(*, t, amax=None):
    """``coda::quantize_grad_t`` as code a compiled caller traces (``TRACED``), as ``quantize_grad_traced``."""
    if not _cast_pass(t, amax):
        return ref.quantize_grad_t_op(t, amax)
    return torch.ops.coda.grad_e5m2_t(t) if amax is None else torch.ops.coda.grad_e5m2_t_amax(t, amax.reshape(1))
