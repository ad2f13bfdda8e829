"""CUDA kernel of F4 (``coda_titan.kernels.lm_head_ce``).

Per token chunk: ``epilogues.rstd_lse_target_epi`` (logits = r * acc, online (max, sum exp) and
the target logit in the epilogue); one Triton pass (``ce_grad_pass``) turns the logits into da = r *
(softmax - onehot) in place and reduces zdz; then B2 (``rms_bwd_apply_last_epi``; with
``CODA_TITAN_EPI_C_STAGES``, ``norm_residual_bwd.epilogue``'s) and the dW_out GEMM, accumulated over
chunks in fp32, the last chunk's GEMM writing the sum in the weight's dtype (no cast pass).
``CODA_TITAN_CE_PASS=inductor`` runs the previous program instead (the A/B's other arm): the inductor
pass into a buffer of its own, every chunk accumulated in fp32, then a cast.

``CODA_TITAN_CE_PASS=scaled_exp``: quack's scaled-exp pipeline with CODA's rstd and zdz (``lce_glue``): the
first GEMM stores E = exp(z - k) with per-tile power-of-two offsets instead of the logits
(``epilogues.rstd_scaled_exp_target_epi``), one Triton glue per chunk, then the dX GEMM
(``norm_residual_bwd_last_rv_epi``) and the dW GEMM reading E through a strip of exact power-of-two
scales (A-operand transforms, tile shapes as quack's pipeline); no pass over the logits. Chunks whose rows
are not a multiple of 128 (a ragged last one) take the Triton pass.
"""

from __future__ import annotations

import functools
import os

import torch
from quack.epilogue.library import identity_epi
from quack.gemm_interface import gemm as quack_gemm
from quack.gemm_interface import gemm_add, gemm_add_inplace
from quack.operand_transform.host import transform_a_operand

from .. import lm_head_ce as ref
from . import stages
from .ce_grad_pass import ce_grad_inplace
from ._dispatch import TUNE, fallback, first_call, fused, gemm, unsupported
from .epilogues import (add_c_epi, norm_residual_bwd_last_rv_epi, rstd_lse_target_epi, rstd_scaled_exp_target_epi,
                        strip_scale_cols, strip_scale_rows)
from .lce_glue import scaled_exp_glue
from .norm_residual_bwd import epilogue as b2_epilogue

CE_PASS_ENV = "CODA_TITAN_CE_PASS"  # "inductor": the previous gradient pass and dW accumulation (A/B)


def _ce_grad_math(logits, lse, tgt_logit, targets, rstd):
    """da = r * (softmax - onehot) and zdz = sum logits * (softmax - onehot); zero on ignored rows."""
    lf = logits.float()
    valid = targets != ref.IGNORE_INDEX
    p = torch.exp(lf - lse[:, None])
    zdz = torch.where(valid, (p * lf).sum(-1) - tgt_logit, 0.0)
    onehot = torch.arange(lf.shape[1], device=lf.device)[None, :] == targets[:, None]
    r = torch.where(valid, rstd, 0.0)
    da = ((p - onehot.float()) * r[:, None]).to(logits.dtype)
    return da, zdz


@torch.library.register_kernel("coda::lm_head_ce", "cuda")
def _lm_head_ce(h, rstd, x, gamma, weight, targets, chunk_rows, compute_grad):
    why = unsupported(h, x, weight)
    if why:
        return fallback(ref.lm_head_ce_op, why, h, rstd, x, gamma, weight, targets, chunk_rows, compute_grad)
    m, d = h.shape
    vocab = weight.shape[0]
    loss = torch.zeros((), device=h.device, dtype=torch.float32)
    rstd = rstd.float()
    gamma32 = gamma.float()
    mode = os.environ.get(CE_PASS_ENV, "triton")
    in_place = mode != "inductor" and h.dtype == torch.bfloat16
    tile_n1 = _scaled_exp_tile(h, weight) if compute_grad and mode == "scaled_exp" else None
    if compute_grad:
        dx = torch.empty_like(x)
        dgamma = torch.zeros(d, device=h.device, dtype=torch.float32)
        dw = torch.empty((vocab, d), device=h.device, dtype=torch.float32) if m > chunk_rows or not in_place else None
    logits_buf = h.new_empty((min(chunk_rows, m), vocab))
    grad_fn = fused("ce_grad", _ce_grad_math)
    b2, base = b2_epilogue(last=True)
    for i, start in enumerate(range(0, m, chunk_rows)):
        stop = min(start + chunk_rows, m)
        hc, r, t = h[start:stop], rstd[start:stop], targets[start:stop]
        logits = logits_buf[: stop - start]
        if tile_n1 is not None and (stop - start) % 128 == 0:
            with first_call("lm_head_ce_scaled_exp", hc, weight):
                loss_c, dg_c, a_bundle, xs = _scaled_exp_chunk(hc, r, t, x[start:stop], dx[start:stop], gamma32,
                                                               weight, logits, tile_n1)
                dw = _dw_scaled_exp(i, stop == m, a_bundle, xs, dw, weight)
            loss, dgamma = loss + loss_c, dgamma + dg_c
            continue
        with first_call("lm_head_ce", hc, weight):
            res = gemm(rstd_lse_target_epi, hc, weight.t(), None, {"D": logits}, rstd=r, target=t)
        lse, tl = res["lse"], res["target_logit"]
        loss = loss + torch.where(t != ref.IGNORE_INDEX, lse - tl, 0.0).sum()
        if not compute_grad:
            continue
        if in_place:
            da, zdz = ce_grad_inplace(logits, lse, tl, t, r, ref.IGNORE_INDEX)
        else:
            da, zdz = grad_fn(logits, lse, tl, t, r)
        corr = -(r * r / d) * zdz
        with stages.capped(base):
            out = gemm(b2, da, weight, None, {"D": dx[start:stop]}, y=x[start:stop], w=gamma32, corr=corr)
        dgamma += out["dw"]
        if in_place and stop == m:  # the last chunk: the sum in fp32, rounded once to the weight's dtype
            dw = (quack_gemm(da.t(), hc, out_dtype=weight.dtype, tuned=TUNE) if dw is None
                  else gemm_add(da.t(), hc, dw, out_dtype=weight.dtype, tuned=TUNE))
        elif i == 0:
            quack_gemm(da.t(), hc, out=dw, tuned=TUNE)
        else:
            gemm_add_inplace(da.t(), hc, dw, tuned=TUNE)
    if not compute_grad:
        return ref.op_outputs(loss, None, None, None, h=h, weight=weight)
    return loss, dx, dgamma, dw if in_place else dw.to(weight.dtype)


def _scaled_exp_tile(h, weight) -> int | None:
    """The first GEMM's n-tile (each tile one offset k; a multiple of 64, dividing V) where the scaled-exp path
    can run (bf16, V % 128 for the dW GEMM's tile over the vocabulary, SM90's register-sourced mainloop), else None."""
    vocab = weight.shape[0]
    if h.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or not weight.is_contiguous() or vocab % 128:
        return None
    if torch.cuda.get_device_capability(h.device) != (9, 0):
        return None
    return next((t for t in (192, 256, 128, 64) if vocab % t == 0), None)


def _scaled_exp_chunk(hc, r, t, x_c, dx_c, gamma32, weight, e, tile_n1):
    """One chunk of the scaled-exp path: its loss sum, dX rows written, (dgamma partial, the dW GEMM's A and B)."""
    rows, d = hc.shape
    tiles = weight.shape[0] // tile_n1
    f32 = dict(device=hc.device, dtype=torch.float32)
    k, sum_exp, sum_ze = (torch.empty((rows, tiles), **f32) for _ in range(3))
    z_y = torch.empty(rows, **f32)
    rstd_scaled_exp_target_epi.gemm(hc, weight, e, epi_args=dict(
        max_log2=tile_n1, sum_exp=sum_exp, sum_ze=sum_ze, max_log2_out=k, target=t, target_logit=z_y, rstd=r),
        tile_M=128, tile_N=tile_n1, cluster_M=2, cluster_N=1, pingpong=tile_n1 <= 208)
    loss, rv, corr, xs, strip = scaled_exp_glue(k, sum_exp, sum_ze, z_y, t, r, hc, e, tile_n1, ref.IGNORE_INDEX)
    dgamma = torch.empty((rows // 128, d), **f32)  # the epilogue's per-(128-row tile) partials
    norm_residual_bwd_last_rv_epi.gemm(
        transform_a_operand(strip_scale_rows, e, {"u": strip}, 128, 64), weight.mT, dx_c,
        epi_args=dict(y=x_c, w=gamma32, corr=corr, rv=rv, dw=dgamma), transform_a=strip_scale_rows,
        tile_M=128, tile_N=_tile_n2(d), tile_K=64, cluster_M=2, cluster_N=1)
    return loss.sum(), dgamma.sum(0), transform_a_operand(strip_scale_cols, e.t(), {"u": strip}, 128, 64), xs


@functools.cache
def _tile_n2(d: int) -> int:
    return 192 if d % 192 == 0 else 256


def _dw_scaled_exp(i, last, a_bundle, xs, dw, weight):
    """dW's share of a scaled-exp chunk: stored (first chunk), reduce-added (TMA) to the fp32 sum, or, for the
    last chunk, added to that sum as C and rounded once to the weight's dtype (the returned tensor)."""
    tiles = dict(transform_a=strip_scale_cols, tile_M=128, tile_N=_tile_n2(xs.shape[1]), tile_K=64, cluster_M=1,
                 cluster_N=2)
    if not last:
        identity_epi.gemm(a_bundle, xs.mT, dw, epi_args={}, add_to_output=i > 0, **tiles)
        return dw
    out = torch.empty_like(weight)
    if dw is None:
        identity_epi.gemm(a_bundle, xs.mT, out, epi_args={}, **tiles)
    else:
        add_c_epi.gemm(a_bundle, xs.mT, out, dw, epi_args={}, **tiles)
    return out
