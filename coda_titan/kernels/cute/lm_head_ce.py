"""CUDA kernel of F4 (``coda_titan.kernels.lm_head_ce``).

Per token chunk: ``epilogues.rstd_lse_target_epi`` (logits = r * acc, online (max, sum exp) and
the target logit in the epilogue); one Triton pass (``ce_grad_pass``) turns the logits into da = r *
(softmax - onehot) in place and reduces zdz; then B2 (``rms_bwd_apply_last_epi``; with
``CODA_TITAN_EPI_C_STAGES``, ``norm_residual_bwd.epilogue``'s) and the dW_out GEMM, accumulated over
chunks in fp32, the last chunk's GEMM writing the sum in the weight's dtype (no cast pass).
``CODA_TITAN_CE_PASS=inductor`` runs the previous program instead (the A/B's other arm): the inductor
pass into a buffer of its own, every chunk accumulated in fp32, then a cast.
``lm_head_ce_deferred`` (``CODA_TITAN_LM_HEAD_DW_BWD=1``) runs the same loop less the last chunk's dW
GEMM, returning that chunk's da (the logits buffer) and the fp32 sum; ``lm_head_dw_finish``, in the
backward, is that GEMM with the trainer's scalar as quack ``gemm_add``'s tensor alpha and beta.
"""

from __future__ import annotations

import os

import torch
from quack.gemm_interface import gemm as quack_gemm
from quack.gemm_interface import gemm_add, gemm_add_inplace

from .. import lm_head_ce as ref
from . import stages
from .ce_grad_pass import ce_grad_inplace
from ._dispatch import TUNE, fallback, first_call, fused, gemm, scalar32, unsupported
from .epilogues import rstd_lse_target_epi
from .norm_residual_bwd import epilogue as b2_epilogue

CE_PASS_ENV = "CODA_TITAN_CE_PASS"  # "inductor": the previous gradient pass and dW accumulation (A/B)
# "cublas": dW's chunks summed by cuBLAS (fp32 ``out_dtype``, in place), then one cast (the A/B of
# ``scripts/probes/lm_head_dw.py``: in stock's step cuBLAS ran the LM-head wgrad 1.3 ms under CODA's chunks)
DW_ENV = "CODA_TITAN_LM_HEAD_DW"


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
    loss, dx, dgamma, dw, _ = _chunks(h, rstd, x, gamma, weight, targets, chunk_rows, compute_grad, defer=False)
    if not compute_grad:
        return ref.op_outputs(loss, None, None, None, h=h, weight=weight)
    return loss, dx, dgamma, dw if dw.dtype == weight.dtype else dw.to(weight.dtype)


@torch.library.register_kernel("coda::lm_head_ce_deferred", "cuda")
def _lm_head_ce_deferred(h, rstd, x, gamma, weight, targets, chunk_rows):
    why = unsupported(h, x, weight)
    if why:
        return fallback(ref.lm_head_ce_deferred_op, why, h, rstd, x, gamma, weight, targets, chunk_rows)
    loss, dx, dgamma, dw_head, da_last = _chunks(h, rstd, x, gamma, weight, targets, chunk_rows, True, defer=True)
    return loss, dx, dgamma, dgamma.new_empty((0,)) if dw_head is None else dw_head, da_last


@torch.library.register_kernel("coda::lm_head_dw_finish", "cuda")
def _lm_head_dw_finish(dw_head, da_last, h_last, scale, out_dtype):
    why = unsupported(da_last, h_last)
    if why is None and dw_head.numel() and dw_head.dtype != torch.float32:
        why = f"dW_head in {dw_head.dtype}"
    if why:
        return fallback(ref.lm_head_dw_finish_op, why, dw_head, da_last, h_last, scale, out_dtype)
    s = scalar32(scale)  # (alpha and beta: the trainer's scalar, no pass over dW of its own)
    if dw_head.numel() == 0:
        return quack_gemm(da_last.t(), h_last, out_dtype=out_dtype, alpha=s, tuned=TUNE)
    return gemm_add(da_last.t(), h_last, dw_head, out_dtype=out_dtype, alpha=s, beta=s, tuned=TUNE)


def _chunks(h, rstd, x, gamma, weight, targets, chunk_rows, compute_grad, defer):
    """F4's chunk loop: (loss, dx, dgamma, dW, da of the last chunk if ``defer``). dW: every chunk's sum,
    in the weight's dtype where the last chunk's GEMM wrote it, else in fp32; with ``defer`` every chunk's
    but the last (None with one chunk), whose da is returned for ``lm_head_dw_finish`` instead."""
    m, d = h.shape
    vocab = weight.shape[0]
    loss = torch.zeros((), device=h.device, dtype=torch.float32)
    rstd = rstd.float()
    gamma32 = gamma.float()
    in_place = os.environ.get(CE_PASS_ENV, "triton") != "inductor" and h.dtype == torch.bfloat16
    dw_sum = os.environ.get(DW_ENV, "quack")
    if dw_sum not in ("quack", "cublas"):
        raise ValueError(f"{DW_ENV}={dw_sum!r}: 'quack' (the default) or 'cublas'")
    dx = dgamma = dw = da_last = None
    if compute_grad:
        dx = torch.empty_like(x)
        dgamma = torch.zeros(d, device=h.device, dtype=torch.float32)
        fp32_dw = m > chunk_rows if defer else (m > chunk_rows or not in_place or dw_sum == "cublas")
        dw = torch.empty((vocab, d), device=h.device, dtype=torch.float32) if fp32_dw else None
    logits_buf = h.new_empty((min(chunk_rows, m), vocab))
    grad_fn = fused("ce_grad", _ce_grad_math)
    b2, base = b2_epilogue(last=True)
    for i, start in enumerate(range(0, m, chunk_rows)):
        stop = min(start + chunk_rows, m)
        hc, r, t = h[start:stop], rstd[start:stop], targets[start:stop]
        logits = logits_buf[: stop - start]
        with first_call("lm_head_ce", hc, weight):
            res = gemm(rstd_lse_target_epi, hc, weight.t(), None, {"D": logits}, rstd=r, target=t)
        lse, tl = res["lse"], res["target_logit"]
        loss = loss + torch.where(t != ref.IGNORE_INDEX, lse - tl, 0.0).sum()
        if not compute_grad:
            continue
        da, zdz = ce_grad_inplace(logits, lse, tl, t, r, ref.IGNORE_INDEX) if in_place else grad_fn(logits, lse, tl, t, r)
        corr = -(r * r / d) * zdz
        with stages.capped(base):
            out = gemm(b2, da, weight, None, {"D": dx[start:stop]}, y=x[start:stop], w=gamma32, corr=corr)
        dgamma += out["dw"]
        if defer and stop == m:
            da_last = da
        else:
            dw = _add_dw(dw, da.t(), hc, i, last=stop == m and in_place and dw_sum == "quack", dtype=weight.dtype,
                         cublas=dw_sum == "cublas")
    return loss, dx, dgamma, dw, da_last


def _add_dw(dw, a, b, i: int, last: bool, dtype, cublas: bool):
    """dW += a @ b (``i``: the chunk's index): into the fp32 sum (cuBLAS with ``cublas``: mm / addmm with an
    fp32 out_dtype, in place), or for the ``last`` chunk the sum rounded once to ``dtype`` by its GEMM."""
    if cublas and i == 0:
        return torch.mm(a, b, out_dtype=torch.float32, out=dw)
    if cublas:
        return torch.addmm(dw, a, b, out_dtype=torch.float32, out=dw)
    if last:
        return quack_gemm(a, b, out_dtype=dtype, tuned=TUNE) if dw is None else gemm_add(a, b, dw, out_dtype=dtype, tuned=TUNE)
    if i == 0:
        quack_gemm(a, b, out=dw, tuned=TUNE)
    else:
        gemm_add_inplace(a, b, dw, tuned=TUNE)
    return dw
