"""CUDA kernels of F1 (``coda_titan.kernels.residual_rms``).

residual_rms      quack's ``rms_partial_epi``: X = acc + residual, H = X * gamma, per-tile sum X^2
residual_rms_fp8  ``epilogues.rms_partial_fp8_epi``: the same plus e4m3 Hq = sat(H * inv) and
                  the per-row amax |H|; the calibration step (no delayed scale yet) runs the
                  reference, since a current-amax scale needs all of H before its first element
residual_rms_q    ``epilogues.rms_partial_scaled_epi`` on e4m3 yq and Wq (fp8 mainloop, fast
                  accumulation as every fp8 program here): X = scale * acc + residual
residual_rms_q_fp8  ``epilogues.rms_partial_scaled_fp8_epi``: the same plus e4m3 Hq and amax |H|
residual_rms_q_fp8_t  ``epilogues.rms_partial_scaled_fp8_t_epi``: also Hq^T through an M-major 8-bit output
                  (a view of a (d, M) buffer), as B3 stores da^T, and no H (D is X)

Each skips the block's down-projection F1 in full activation checkpointing's recompute
(``kernels/recompute.py``: its outputs are dropped there).
"""

from __future__ import annotations

import torch
from quack.epilogue.library import rms_partial_epi

from .. import residual_rms as ref
from ..recompute import skip_tail
from ..scaling import E4M3
from ._dispatch import CALIBRATION, fallback, first_call, gemm, scalar32, unsupported, unsupported_fp8
from .epilogues import rms_partial_fp8_epi, rms_partial_scaled_epi, rms_partial_scaled_fp8_epi, rms_partial_scaled_fp8_t_epi
from .row_vectors import fold_amax


@torch.library.register_kernel("coda::residual_rms", "cuda")
@skip_tail(ref.residual_rms_op)
def _residual_rms(y, weight, residual, gamma, tile_n):
    why = unsupported(y, weight, residual)
    if why:
        return fallback(ref.residual_rms_op, why, y, weight, residual, gamma, tile_n)
    x = torch.empty_like(residual)
    h = torch.empty_like(residual)
    with first_call("residual_rms", y, weight):
        res = gemm(rms_partial_epi, y, weight.t(), residual, {"D": h, "resid_out": x}, weight=gamma.float())
    return x, h, res["sqsum"].unsqueeze(1)


@torch.library.register_kernel("coda::residual_rms_fp8", "cuda")
@skip_tail(ref.residual_rms_fp8_op)
def _residual_rms_fp8(y, weight, residual, gamma, tile_n, inv_scale):
    why = unsupported(y, weight, residual)
    if why is None and residual.shape[1] % 16:
        why = f"width {residual.shape[1]} (e4m3 H needs % 16)"
    if why is None and inv_scale is None:
        why = CALIBRATION
    if why:
        return fallback(ref.residual_rms_fp8_op, why, y, weight, residual, gamma, tile_n, inv_scale)
    x = torch.empty_like(residual)
    h = torch.empty_like(residual)
    hq = torch.empty(residual.shape, device=residual.device, dtype=E4M3)
    with first_call("residual_rms_fp8", y, weight):
        res = gemm(
            rms_partial_fp8_epi, y, weight.t(), residual, {"D": h, "resid_out": x, "hq": hq},
            weight=gamma.float(), inv_scale=scalar32(inv_scale),
        )
    return x, h, res["sqsum"].unsqueeze(1), hq, fold_amax(res["amax"], torch.float32)


def _q_unsupported(yq, wq, residual) -> str | None:
    why = unsupported_fp8(yq, wq) or unsupported(residual)
    if why is None and residual.shape[1] % 16:
        why = f"width {residual.shape[1]} (need % 16)"
    return why


@torch.library.register_kernel("coda::residual_rms_q", "cuda")
@skip_tail(ref.residual_rms_q_op)
def _residual_rms_q(yq, wq, scale, residual, gamma, tile_n):
    why = _q_unsupported(yq, wq, residual)
    if why:
        return fallback(ref.residual_rms_q_op, why, yq, wq, scale, residual, gamma, tile_n)
    x = torch.empty_like(residual)
    h = torch.empty_like(residual)
    with first_call("residual_rms_q", yq, wq):
        res = gemm(rms_partial_scaled_epi, yq, wq.t(), residual, {"D": h, "resid_out": x},
                   weight=gamma.float(), scale=scalar32(scale))
    return x, h, res["sqsum"].unsqueeze(1)


def _q_fp8_unsupported(yq, wq, residual, inv_scale) -> str | None:
    why = _q_unsupported(yq, wq, residual)
    if why is None and inv_scale is None:
        why = CALIBRATION
    return why


def _f1_q_fp8(name, epi, yq, wq, scale, residual, gamma, inv_scale, out):
    """F1 on the fp8 mainloop writing e4m3 Hq (``epi``, into ``out``): (S, amax |H|)."""
    with first_call(name, yq, wq):
        res = gemm(epi, yq, wq.t(), residual, out, weight=gamma.float(), scale=scalar32(scale),
                   inv_scale=scalar32(inv_scale))
    return res["sqsum"].unsqueeze(1), fold_amax(res["amax"], torch.float32)


@torch.library.register_kernel("coda::residual_rms_q_fp8", "cuda")
@skip_tail(ref.residual_rms_q_fp8_op)
def _residual_rms_q_fp8(yq, wq, scale, residual, gamma, tile_n, inv_scale):
    why = _q_fp8_unsupported(yq, wq, residual, inv_scale)
    if why:
        return fallback(ref.residual_rms_q_fp8_op, why, yq, wq, scale, residual, gamma, tile_n, inv_scale)
    x, h = torch.empty_like(residual), torch.empty_like(residual)
    hq = torch.empty(residual.shape, device=residual.device, dtype=E4M3)
    s, amax = _f1_q_fp8("residual_rms_q_fp8", rms_partial_scaled_fp8_epi, yq, wq, scale, residual, gamma, inv_scale,
                        {"D": h, "resid_out": x, "hq": hq})
    return x, h, s, hq, amax


@torch.library.register_kernel("coda::residual_rms_q_fp8_t", "cuda")
@skip_tail(ref.residual_rms_q_fp8_t_op)
def _residual_rms_q_fp8_t(yq, wq, scale, residual, gamma, tile_n, inv_scale):
    why = _q_fp8_unsupported(yq, wq, residual, inv_scale)
    if why is None and residual.shape[0] % 16:
        why = f"{residual.shape[0]} rows (the transposed store needs % 16)"
    if why:
        return fallback(ref.residual_rms_q_fp8_t_op, why, yq, wq, scale, residual, gamma, tile_n, inv_scale)
    x = torch.empty_like(residual)
    hq = torch.empty(residual.shape, device=residual.device, dtype=E4M3)
    hq_t = torch.empty((residual.shape[1], residual.shape[0]), device=residual.device, dtype=E4M3)  # M-major view
    s, amax = _f1_q_fp8("residual_rms_q_fp8_t", rms_partial_scaled_fp8_t_epi, yq, wq, scale, residual, gamma,
                        inv_scale, {"D": x, "hq": hq, "hqt": hq_t.t()})
    return x, s, hq, hq_t, amax
