"""The fp8 casts of activations and gradients (``[coda] precision = "fp8"``): programs with no GEMM of their own.

    quantize_delayed    an activation (an F1 input: y for the down-projection, o for the out-projection) to
                        e4m3 with its site's delayed scale (``fp8_scaling``), and its amax for the history
    quantize_delayed_t  the same with the codes' token-major copy (o's, dW_o's operand under ``fp8_out_bwd``)
    quantize_grad       a residual-stream gradient to e5m2 at its current amax, the scale rounded down to a
                        power of two (torchao's recipe for gradients), for an fp8 dgrad
    quantize_grad_t     the same with the codes' token-major copy (dW_o's and dW2's operand on the same codes)

Both take the gradient's amax where its producer reduced it (the fp8 B2 returns amax |D|), else reduce it.

References here (any device, fp64 for the tests), their ``torch.ops.coda`` ops and fakes; ``cute/casts.py`` holds
the CUDA kernels (Triton passes, ``cute/transpose_8bit.py``).
"""

from __future__ import annotations

from typing import Optional

import torch

from ._common import acc_dtype, program_op
from .gemm import _pow2_cast
from .scaling import E4M3, E5M2, E5M2_MAX, compute_dtype, inv_scale_from_amax, quantize_e4m3, quantize_e5m2


def quantize_delayed(*, t: torch.Tensor, inv_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(sat(t * inv) as e4m3, amax |t|): an activation quantized with its site's delayed scale
    (``inv_scale``; None = the current amax, the calibration step), reporting the amax for the
    site's history."""
    tf = t.to(acc_dtype(t))
    amax = tf.abs().amax()
    return quantize_e4m3(tf, inv_scale_from_amax(amax) if inv_scale is None else inv_scale), amax


def quantize_delayed_t(*, t: torch.Tensor, inv_scale: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tq, tq_t, amax |t|): ``quantize_delayed`` with the codes' token-major (transposed, contiguous) copy, the
    weight gradient's operand on the same codes (dW_o on o's, ``fp8_out_bwd``)."""
    tq, amax = quantize_delayed(t=t, inv_scale=inv_scale)
    return tq, tq.t().contiguous(), amax


def quantize_grad(*, t: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(tq, s): a gradient as e5m2 with its current tensorwise scale rounded down to a power of two
    (torchao's dynamic recipe, as ``wgrad_fp8_operands``), and its dequantization scale s = 1/inv.
    ``amax``: amax |t| where its producer reduced it already (the fp8 B2's epilogue); None: t's own."""
    return _pow2_cast(t.to(compute_dtype(t.dtype)), amax, quantize_e5m2, E5M2_MAX)


def quantize_grad_t(*, t: torch.Tensor, amax: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tq, tq_t, s): ``quantize_grad``'s codes and scale with the codes' token-major (transposed, contiguous)
    copy, the operand of the weight gradient on the same codes (the out-projection's dW_o, the MLP's dW2)."""
    tq, s = quantize_grad(t=t, amax=amax)
    return tq, tq.t().contiguous(), s


@program_op("quantize_delayed")
def quantize_delayed_op(t: torch.Tensor, inv_scale: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_delayed(t=t, inv_scale=inv_scale)


@quantize_delayed_op.register_fake
def _(t, inv_scale):
    return t.new_empty(t.shape, dtype=E4M3), t.new_empty((), dtype=acc_dtype(t))


@program_op("quantize_delayed_t")
def quantize_delayed_t_op(t: torch.Tensor, inv_scale: Optional[torch.Tensor]
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return quantize_delayed_t(t=t, inv_scale=inv_scale)


@quantize_delayed_t_op.register_fake
def _(t, inv_scale):
    return (t.new_empty(t.shape, dtype=E4M3), t.new_empty((t.shape[1], t.shape[0]), dtype=E4M3),
            t.new_empty((), dtype=acc_dtype(t)))


@program_op("quantize_grad")
def quantize_grad_op(t: torch.Tensor, amax: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_grad(t=t, amax=amax)


@quantize_grad_op.register_fake
def _(t, amax=None):
    return t.new_empty(t.shape, dtype=E5M2), t.new_empty((), dtype=compute_dtype(t.dtype))


@program_op("quantize_grad_t")
def quantize_grad_t_op(t: torch.Tensor, amax: Optional[torch.Tensor] = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return quantize_grad_t(t=t, amax=amax)


@quantize_grad_t_op.register_fake
def _(t, amax=None):
    return (t.new_empty(t.shape, dtype=E5M2), t.new_empty((t.shape[1], t.shape[0]), dtype=E5M2),
            t.new_empty((), dtype=compute_dtype(t.dtype)))
