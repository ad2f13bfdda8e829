"""CUDA kernels of F1 (``coda_titan.kernels.residual_rms``).

residual_rms      quack's ``rms_partial_epi``: X = acc + residual, H = X * gamma, per-tile sum X^2
residual_rms_fp8  ``epilogues.rms_partial_fp8_epi``: the same plus e4m3 Hq = sat(H * inv) and
                  the per-row amax |H|; the calibration step (no delayed scale yet) runs the
                  reference, since a current-amax scale needs all of H before its first element
"""

from __future__ import annotations

import torch
from quack.epilogue.library import rms_partial_epi

from .. import residual_rms as ref
from ..scaling import E4M3
from ._dispatch import fallback, first_call, gemm, scalar32, unsupported
from .epilogues import rms_partial_fp8_epi


@torch.library.register_kernel("coda::residual_rms", "cuda")
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
def _residual_rms_fp8(y, weight, residual, gamma, tile_n, inv_scale):
    why = unsupported(y, weight, residual)
    if why is None and residual.shape[1] % 16:
        why = f"width {residual.shape[1]} (e4m3 H needs % 16)"
    if why is None and inv_scale is None:
        why = "a current-amax scale (the calibration step)"
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
    return x, h, res["sqsum"].unsqueeze(1), hq, res["amax"].amax()
