"""CUDA kernels of B2 (``coda_titan.kernels.norm_residual_bwd``).

norm_residual_bwd      quack's ``rms_bwd_apply_epi`` / ``..._last_epi``: D = acc * gamma + dres +
                       X * corr, corr = -(r^2/d) zdz, dgamma partials in the epilogue; ``weight2/3``:
                       B = [weight; weight2; weight3], a view of one buffer where they share one (``stacked_rows``)
norm_residual_bwd_fp8  the same epilogue on e5m2 da x e4m3 W^T; s_da * s_w rides the gamma row
                       vector and multiplies the dgamma partials once, after their reduction

Both make their epilogue's vectors (corr and gamma, scaled) in one Triton launch (``row_vectors``). The fp8
one's epilogue (``epilogues.norm_residual_bwd_amax_epi``) also reduces amax |D| per tile, folded once here.

With ``CODA_TITAN_EPI_C_STAGES`` set (``stages``: a lower base for the epilogue's C-load stages, so
that wide tiles keep their mainloop stages; ``[coda] b2_c_stages`` sets it, 2 by default, measured in
docs/cute_backend.md), both run the same math as our own epilogues (``epilogues.norm_residual_bwd_epi``)
with that base in their compile key.
"""

from __future__ import annotations

import torch
from quack.epilogue.library import rms_bwd_apply_epi, rms_bwd_apply_last_epi

from .. import norm_residual_bwd as ref
from .._common import stacked_rows
from ..scaling import E4M3, E5M2
from . import epilogues, stages
from ._dispatch import fallback, first_call, gemm, scalar32, unsupported, unsupported_fp8
from .row_vectors import b2_vectors, fold_amax


def epilogue(last: bool, amax: bool = False):
    """(B2's epilogue, the C-stage base to compile it with): quack's own epilogue and base, unless
    ``CODA_TITAN_EPI_C_STAGES`` asks for a base (``stages``; our copy of the epilogue then). ``last``:
    without the residual gradient C (the LM head's dgrad, or a B2 with nothing below it). ``amax``: ours
    reducing amax |D| too (the fp8 B2; at quack's base where none is asked for)."""
    base = stages.requested_base()
    if amax:
        return (epilogues.norm_residual_bwd_last_amax_epi if last else epilogues.norm_residual_bwd_amax_epi), base
    if base is None:
        return (rms_bwd_apply_last_epi if last else rms_bwd_apply_epi), None
    return (epilogues.norm_residual_bwd_last_epi if last else epilogues.norm_residual_bwd_epi), base


def _apply(name, a, b_kn, x, gamma, rstd, zdz, dresidual, sc=None):
    """B2's GEMM a @ b_kn with the norm/residual epilogue: (D, dgamma partial sums, and with ``sc`` (fp8) the
    partials of amax |D|). Its vectors (corr, and gamma times ``sc`` where given) come from one launch
    (``row_vectors``)."""
    corr, w = b2_vectors(rstd, zdz, gamma, x.shape[1], sc)
    out = torch.empty_like(x)
    epi, base = epilogue(last=dresidual is None, amax=sc is not None)
    with first_call(name, a, b_kn), stages.capped(base):
        res = gemm(epi, a, b_kn, dresidual, {"D": out}, y=x, w=w, corr=corr)
    return out, res["dw"], res.get("amax")


@torch.library.register_kernel("coda::norm_residual_bwd", "cuda")
def _norm_residual_bwd(da, weight, x, gamma, rstd, zdz, dresidual, weight2=None, weight3=None):
    rest = [w for w in (weight2, weight3) if w is not None]
    why = unsupported(da, weight, x, *rest, *(() if dresidual is None else (dresidual,)))
    if why:
        return fallback(ref.norm_residual_bwd_op, why, da, weight, x, gamma, rstd, zdz, dresidual, weight2, weight3)
    weight = stacked_rows(weight, *rest) if rest else weight  # (a view where they share a buffer)
    return _apply("norm_residual_bwd", da, weight, x, gamma, rstd, zdz, dresidual)[:2]


@torch.library.register_kernel("coda::norm_residual_bwd_fp8", "cuda")
def _norm_residual_bwd_fp8(daq, weight_tq, scale, x, gamma, rstd, zdz, dresidual):
    why = unsupported(*((x,) if dresidual is None else (x, dresidual)))
    why = why or unsupported_fp8(daq, dtypes=(E4M3, E5M2)) or unsupported_fp8(weight_tq)
    if why:
        return fallback(ref.norm_residual_bwd_fp8_op, why, daq, weight_tq, scale, x, gamma, rstd, zdz, dresidual)
    sc = scalar32(scale)
    out, dgamma, amax = _apply("norm_residual_bwd_fp8", daq, weight_tq.t(), x, gamma, rstd, zdz, dresidual, sc)
    # (the fp32 D's largest |value| rounded as D's stores are: the amax of D as returned, the reference's)
    return out, dgamma * sc, fold_amax(amax, out.dtype)
