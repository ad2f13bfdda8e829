"""CUDA kernel of F4 (``coda_titan.kernels.lm_head_ce``).

Per token chunk: ``epilogues.rstd_lse_target_epi`` (logits = r * acc rounded to the stored dtype, online
(max, sum exp) per N tile and the target logit of those rounded logits in the epilogue); one Triton pass
(``ce_grad_pass``) folds the row's log-sum-exp partials, turns the logits into da = r * (softmax - onehot)
in place and writes the row's loss term; then B2: da @ W in fp32 (cuBLAS) and one row pass
(``norm_apply_pass``) taking the final norm's row dot zdz from that accumulator (``ref.F4_ZDZ_ENV``'s default,
"acc"), and the dW_out GEMM, accumulated over chunks in fp32, the last chunk's GEMM writing the sum in the weight's
dtype (no cast pass). The loss is one sum of every row's term after the last chunk.
``CODA_TITAN_F4_ZDZ=rounded`` runs the previous B2 (the A/B's other arm): zdz from the pass (over the stored
logits and the unrounded dp) as the GEMM epilogue's row vector (``rms_bwd_apply_last_epi``; with
``CODA_TITAN_EPI_C_STAGES``, ``norm_residual_bwd.epilogue``'s).
``CODA_TITAN_CE_PASS=inductor`` runs the previous program instead (the A/B's other arm): the inductor
pass into a buffer of its own, every chunk accumulated in fp32, then a cast.
``CODA_TITAN_F4_ZDZ=consistent`` / ``consistent_rounded`` (probe arms): the pass's zdz of the rounded da it
writes (``ce_grad_inplace``'s ``tdelta``), the target's term on its unrounded logit (one row dot per token here) or
on the stored one.
``CODA_TITAN_CE_PASS=exp`` (bf16, with gradients) runs F4 without its gradient pass (``_lm_head_ce_exp``,
``ce_exp``; the reference ``lm_head_ce.lm_head_ce_exp``): F4 stores E = exp(l - c) and the backward GEMMs take
it as their A, with the per-row scales and the target's exact term in their epilogue and one correction each.

With ``hq``, ``s_h``, ``weight_q`` and ``s_w`` (``[coda] fp8_lm_head_fwd``) the chunk's GEMM is the fp8 head's e4m3
one (its scales folded into r) and everything after it the bf16 head's: the gradient pass, B2 and dW on the bf16 da,
H and W. ``fp8_dw`` (``fp8_lm_head_dw``): the pass also writes da's e5m2 codes, rounded stochastically, and dW is
the fp8 head's one GEMM on them (``_Fp8Dw``; its probe arms: ``CODA_TITAN_CE_CODES_T=1``, the codes stored
token-major by the pass itself; ``CODA_TITAN_DW_BLOCKS=k``, dW summed over k token blocks).

``coda::lm_head_ce_fp8`` (the fp8 head): the same epilogue on the e4m3 GEMM (the codes'
scales folded into r), ``ce_grad_e5m2`` writing da's e5m2 codes at the head's scale (``dlogits_inv_scale``),
B2 on them and W^T's codes (cuBLAS's ``_scaled_mm`` to fp32 and the row pass; with ``CODA_TITAN_F4_ZDZ=rounded``
the fp8 B2 with the pass's zdz), each chunk's codes copied token-major into one buffer, and dW as one fp8
GEMM over every token (cuBLAS's ``_scaled_mm``: e5m2 da^T times e4m3 H).
"""

from __future__ import annotations

import os

import torch
from quack.gemm_interface import gemm as quack_gemm
from quack.gemm_interface import gemm_add, gemm_add_inplace

from .. import lm_head_ce as ref
from . import ce_codes_t, ce_exp, stages
from ..scaling import E5M2, sr_seed_of
from . import transpose_8bit
from .ce_grad_pass import ce_grad_e5m2, ce_grad_inplace
from ._dispatch import TUNE, fallback, first_call, fused, gemm, unsupported, unsupported_fp8
from .epilogues import rstd_lse_target_epi, rstd_lse_target_f16_epi, rstd_lse_target_unrounded_epi
from .exp_epilogues import exp_norm_bwd_last_epi, rstd_exp_lse_target_epi
from .norm_apply_pass import norm_apply_rows
from .norm_residual_bwd import epilogue as b2_epilogue

CE_PASS_ENV = ref.CE_PASS_ENV  # "inductor": the previous gradient pass and dW accumulation (A/B); "exp": no pass
DW_BLOCKS_ENV = "CODA_TITAN_DW_BLOCKS"  # fp8_lm_head_dw's dW over k token blocks (``_Fp8Dw``; a probe arm)
# rows F4 without its pass repaired (their largest logit outside the offset's range), counted on the device (one
# counter a device) over every call since the last ``take_repaired()``
_REPAIRED: dict[torch.device, torch.Tensor] = {}


def take_repaired() -> int:
    """The number of LM-head rows repaired (``CODA_TITAN_CE_PASS=exp``) since the last call (a host sync)."""
    n = sum(int(t.item()) for t in _REPAIRED.values())
    for t in _REPAIRED.values():
        t.zero_()
    return n


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


def _target_logit(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """Each row's unrounded target logit r * (H_row . W[t]) in fp32 (ignored rows: row 0's, unused)."""
    safe = torch.where(targets != ref.IGNORE_INDEX, targets, 0)
    return rstd * (h.float() * weight.index_select(0, safe).float()).sum(-1)


def f4_epilogue(dtype: torch.dtype):
    """F4's epilogue for logits stored in ``dtype``: each rounds them to it before the log-sum-exp (the unrounded
    arm with ``CODA_TITAN_F4_LSE=unrounded``)."""
    if os.environ.get(ref.F4_LSE_ENV, "rounded") == "unrounded":
        return rstd_lse_target_unrounded_epi
    return {torch.bfloat16: rstd_lse_target_epi, torch.float16: rstd_lse_target_f16_epi}[dtype]


@torch.library.register_kernel("coda::lm_head_ce", "cuda")
def _lm_head_ce(h, rstd, x, gamma, weight, targets, chunk_rows, compute_grad, hq=None, s_h=None, weight_q=None,
                s_w=None, fp8_dw=False, fp8_dgrad=False):
    if fp8_dw and hq is None:
        raise ValueError("fp8_dw (fp8_lm_head_dw) needs the head's fp8 forward: hq, s_h, weight_q and s_w")
    ref.check_fp8_dgrad(fp8_dw, fp8_dgrad)
    why = unsupported(h, x, weight) or (hq is not None and unsupported_fp8(hq, weight_q))
    if why:
        return fallback(ref.lm_head_ce_op, why, h, rstd, x, gamma, weight, targets, chunk_rows, compute_grad, hq,
                        s_h, weight_q, s_w, fp8_dw, fp8_dgrad)
    fp8_fwd = hq is not None  # (``fp8_lm_head_fwd``: the logits of the e4m3 GEMM, the rest as the bf16 head's)
    # (``fp8_lm_head_dw``: dW on da's e5m2 codes and H's; ``fp8_lm_head_dgrad``: B2 on them and W's too)
    fp8_dw, fp8_dgrad = fp8_dw and compute_grad, fp8_dgrad and compute_grad
    if fp8_fwd and compute_grad:
        _refuse_probe_arms()
    if compute_grad and h.dtype == torch.bfloat16 and os.environ.get(CE_PASS_ENV) == "exp":
        return _lm_head_ce_exp(h, rstd, x, gamma, weight, targets, chunk_rows)
    (m, d), vocab = h.shape, weight.shape[0]
    loss_rows = torch.empty(m, device=h.device, dtype=torch.float32)
    rstd, gamma32, x = rstd.float(), gamma.float(), x.contiguous()
    in_place = os.environ.get(CE_PASS_ENV, "triton") != "inductor" and h.dtype == torch.bfloat16
    if compute_grad:
        dx = torch.empty_like(x)
        dgamma = torch.zeros(d, device=h.device, dtype=torch.float32)
        fp32_sum = (m > chunk_rows or not in_place) and not fp8_dw
        dw = torch.empty((vocab, d), device=h.device, dtype=torch.float32) if fp32_sum else None
        if fp8_dw:  # (every chunk's codes, token-major, and their scale, as the fp8 head's)
            codes = _Fp8Dw(rstd, targets, hq, s_h, vocab, chunk_rows, weight.dtype, fp8_dgrad and (weight_q, s_w))
    logits_buf = h.new_empty((min(chunk_rows, m), vocab))
    epi = f4_epilogue(logits_buf.dtype)
    grad_fn = fused("ce_grad", _ce_grad_math)
    b2, base = b2_epilogue(last=True)
    zdz_mode = ref.f4_zdz_mode() if compute_grad else "rounded"
    zdz_acc, consist = zdz_mode == "acc", zdz_mode in ("consistent", "consistent_rounded")
    if consist and not in_place:
        raise ValueError(f"{ref.F4_ZDZ_ENV}={zdz_mode} is a mode of the Triton gradient pass, not of "
                         f"{CE_PASS_ENV}=inductor's")
    for i, start in enumerate(range(0, m, chunk_rows)):
        stop = min(start + chunk_rows, m)
        hc, r, t = h[start:stop], rstd[start:stop], targets[start:stop]
        logits = logits_buf[: stop - start]
        if fp8_fwd:
            with first_call("lm_head_ce_fp8", hq, weight_q):
                res = gemm(epi, hq[start:stop], weight_q.t(), None, {"D": logits},
                           rstd=r * (s_h.float() * s_w.float()).reshape(()), target=t)
        else:
            with first_call("lm_head_ce", hc, weight):
                res = gemm(epi, hc, weight.t(), None, {"D": logits}, rstd=r, target=t)
        parts, tl = res["lse"], res["target_logit"]  # (the per-N-tile log-sum-exp partials: _lse_partials)
        if fp8_dw:  # (and da's codes token-major; fp8_dgrad: the codes alone, B2's, and corr (t, da_t), its exact term)
            da, corr = codes.chunk(logits, parts, tl, t, r, d, loss_rows[start:stop], start, stop)
        elif compute_grad and in_place:
            tdelta = None if not consist else (torch.zeros_like(r) if zdz_mode == "consistent_rounded"
                                               else _target_logit(hc, weight, t, r) - tl)
            da, corr = ce_grad_inplace(logits, parts, tl, t, r, ref.IGNORE_INDEX, d, loss_rows[start:stop],
                                       tdelta=tdelta)
        else:
            lse = torch.logsumexp(parts, dim=-1)
            loss_rows[start:stop] = torch.where(t != ref.IGNORE_INDEX, lse - tl, 0.0)
            if not compute_grad:
                continue
            da, zdz = grad_fn(logits, lse, tl, t, r)
            corr = -(r * r / d) * zdz
        if zdz_acc:  # (zdz from B2's accumulator: cuBLAS keeps it in fp32, one row pass applies the epilogue)
            acc = codes.b2(da) if fp8_dgrad else torch.mm(da, weight, out_dtype=torch.float32)
            dgamma += norm_apply_rows(acc, x[start:stop], gamma32, r, dx[start:stop],
                                      tx=(weight, *corr) if fp8_dgrad else None)
        else:
            with stages.capped(base):
                out = gemm(b2, da, weight, None, {"D": dx[start:stop]}, y=x[start:stop], w=gamma32, corr=corr)
            dgamma += out["dw"]
        if not fp8_dw:
            dw = _dw_chunk(da, hc, dw, weight.dtype, first=i == 0, last=in_place and stop == m)
    loss = loss_rows.sum()
    if not compute_grad:
        return ref.op_outputs(loss, None, None, None, h=h, weight=weight)
    if fp8_dw:  # (dW's GEMM last: the chunks' buffers, the logits' and fp8_dgrad's codes and W^T, let go before it)
        logits_buf = logits = da = acc = res = None
        dw = codes.result()
    return loss, dx, dgamma, dw if in_place else dw.to(weight.dtype)


class _Fp8Dw:
    """``fp8_lm_head_dw`` over one call's chunks: da's stochastically rounded e5m2 codes (their scale, the batch's
    seed) into a token-major buffer, then dW = their product with H's codes: one cuBLAS fp8 GEMM over every token
    (``_fp8_dw``). With ``CODA_TITAN_DW_BLOCKS=k`` (a probe arm of the memory target) the buffer holds one of k token
    blocks (whole chunks) and each full block adds its product into dW in W's dtype (quack: the first block's GEMM
    writes it, the next ones add to it in place), so the buffer is k times smaller for k - 1 more roundings of dW's
    partial sums. ``w_codes`` (``fp8_lm_head_dgrad``: W's e4m3 codes and their scale): the pass writes the codes
    alone (no bf16 da) into one chunk buffer kept across chunks, and each row's unrounded da at its target; once
    the codes are in the token-major buffer (dW's, the target's code kept), the target's code is zeroed in the chunk
    buffer, which ``chunk`` returns for ``b2`` with (t, da_t): B2 adds da_t W[t] in fp32 (``norm_apply_rows``'s tx)
    instead of the target's e5m2 rounding, the largest of a row's."""

    def __init__(self, rstd, targets, hq, s_h, vocab: int, chunk_rows: int, dtype, w_codes=()):
        m = hq.shape[0]
        self.inv_g = ref.dlogits_inv_scale(rstd, targets).float().reshape(())
        self.seed, self.hq, self.s_h, self.dtype, self.m = sr_seed_of(targets), hq, s_h, dtype, m
        blocks = int(os.environ.get(DW_BLOCKS_ENV, "1"))
        if blocks < 1:
            raise ValueError(f"{DW_BLOCKS_ENV} must be a positive integer, got {blocks}")
        chunks = -(-m // chunk_rows)
        self.width = min(m, -(-chunks // blocks) * chunk_rows)  # (whole chunks a block)
        self.daq_t = torch.empty((vocab, self.width), device=hq.device, dtype=E5M2)
        self.hq_t = transpose_8bit.transpose_8bit(hq) if self.width < m else None
        self.alpha = (s_h.float() / self.inv_g).reshape(1)  # (the blocks' GEMMs: the codes' scales)
        self.codes_t, self.dgrad = os.environ.get(ce_codes_t.ENV) == "1", bool(w_codes)
        if self.dgrad and self.codes_t:
            raise ValueError(f"fp8_lm_head_dgrad's B2 reads the row pass's codes, not {ce_codes_t.ENV}=1's")
        if self.dgrad:  # (W^T's e4m3 codes, (d, V): B2's K-major operand, and their scale)
            self.w_tq, self.s_w = transpose_8bit.transpose_8bit(w_codes[0]), w_codes[1].float().reshape(())
            self.rows = torch.empty((min(chunk_rows, m), vocab), device=hq.device, dtype=E5M2)
        self.dw = None

    def chunk(self, logits, parts, tl, t, r, d: int, loss_rows, start: int, stop: int):
        """The gradient pass of rows [start, stop): (da, corr) in place, the codes into the buffer (the row pass then
        ``transpose_8bit``, or with ``CODA_TITAN_CE_CODES_T=1``, a probe arm, ``ce_codes_t``'s pass storing them
        there itself); a block's product into dW once its last chunk is in. With ``w_codes``: (the codes, (t, da_t))."""
        b0 = start - start % self.width
        if self.dgrad:  # (``fp8_lm_head_dgrad``: the codes alone, returned for B2 with the targets' exact term)
            da, da_t = ce_grad_e5m2(logits, parts, tl, t, r, self.inv_g, ref.IGNORE_INDEX, loss_rows, sr_seed=self.seed,
                                    row0=start, target_da=True, out=self.rows[:stop - start])
            transpose_8bit.launch(da, self.daq_t[:, start - b0:stop - b0])
            ti = t.clamp(min=0)  # (an ignored row's codes and da_t are 0: its index is any row's)
            da.view(torch.uint8).scatter_(1, ti[:, None], 0)
            corr = (ti, da_t)
        elif self.codes_t:
            da, corr = ce_codes_t.ce_grad_codes_t(logits, parts, tl, t, r, ref.IGNORE_INDEX, d, loss_rows, self.inv_g,
                                                  self.daq_t, start - b0, sr_seed=self.seed, row0=start)
        else:
            da, corr, daq = ce_grad_inplace(logits, parts, tl, t, r, ref.IGNORE_INDEX, d, loss_rows,
                                            codes_inv=self.inv_g, sr_seed=self.seed, row0=start)
            transpose_8bit.launch(daq, self.daq_t[:, start - b0:stop - b0])
        if self.width < self.m and stop in (b0 + self.width, self.m):
            a, b = self.daq_t[:, :stop - b0], self.hq_t[:, b0:stop].t()
            if self.dw is None:
                self.dw = quack_gemm(a, b, out_dtype=self.dtype, alpha=self.alpha, tuned=TUNE)
            else:
                gemm_add_inplace(a, b, self.dw, alpha=self.alpha, tuned=TUNE)
        return da, corr

    def b2(self, daq):
        """``fp8_lm_head_dgrad``'s B2 accumulator of a chunk: its codes times W's on cuBLAS's fp8 GEMM, fp32 out."""
        return torch._scaled_mm(daq, self.w_tq.t(), self.inv_g.reciprocal(), self.s_w, out_dtype=torch.float32)

    def result(self):
        """dW_out in W's dtype (fp8_lm_head_dgrad's chunk buffer and W^T's codes let go first)."""
        self.rows = self.w_tq = None
        return _fp8_dw(self.daq_t, self.hq, self.inv_g, self.s_h, self.dtype) if self.dw is None else self.dw


def _refuse_probe_arms() -> None:
    """The bf16 head's probe arms that remake logits from the bf16 H and W have no fp8-forward form."""
    if os.environ.get(CE_PASS_ENV) in ("exp", "inductor") or ref.f4_zdz_mode() in ("consistent", "consistent_rounded"):
        raise ValueError(f"the LM head's fp8 forward takes none of {CE_PASS_ENV}=exp or inductor, {ref.F4_ZDZ_ENV}="
                         f"consistent(_rounded): probe arms of the bf16 head")


def _dw_chunk(da, hc, dw, dtype, *, first: bool, last: bool):
    """dW_out += da^T H of one chunk: the fp32 sum in ``dw`` (its first chunk written, not added), the last chunk's
    GEMM writing the sum rounded once to ``dtype`` (returned; None in ``dw`` with a single chunk)."""
    if last:
        return (quack_gemm(da.t(), hc, out_dtype=dtype, tuned=TUNE) if dw is None
                else gemm_add(da.t(), hc, dw, out_dtype=dtype, tuned=TUNE))
    if first:
        quack_gemm(da.t(), hc, out=dw, tuned=TUNE)
    else:
        gemm_add_inplace(da.t(), hc, dw, tuned=TUNE)
    return dw


def _lm_head_ce_exp(h, rstd, x, gamma, weight, targets, chunk_rows):
    """F4 without its gradient pass, bf16 with gradients (module docstring; docs/cute_backend.md). Per chunk: F4
    storing E and its partials; ``ce_exp.exp_program`` (M values: loss terms, s, k, kt, corr; rows out of the
    offset's range repaired on the device); B2 on E with C = W's target rows; dW += E^T (s H) in fp32 with each
    row's target correction k H - rnd(e_t) (s H) scattered first (``index_put_``, deterministic), the last chunk's
    GEMM writing the sum in W's dtype."""
    m, d = h.shape
    vocab = weight.shape[0]
    dev = h.device
    r_all = rstd.float()
    # the Cauchy-Schwarz offsets (``ref.exp_offsets``): no logit above c + EXP_MARGIN
    offsets = (r_all * ce_exp.sq_norms(h).sqrt() * ce_exp.sq_norms(weight).amax().sqrt() - ref.EXP_MARGIN).contiguous()
    gamma32 = gamma.float()
    safe_t = torch.where(targets != ref.IGNORE_INDEX, targets, 0)
    loss_rows = torch.empty(m, device=dev, dtype=torch.float32)
    dx = torch.empty_like(x)
    dgamma = torch.zeros(d, device=dev, dtype=torch.float32)
    one = m <= chunk_rows
    dw = (torch.zeros if one else torch.empty)((vocab, d), device=dev, dtype=torch.float32)
    e_buf = h.new_empty((min(chunk_rows, m), vocab))
    base = stages.requested_base()
    repaired = _REPAIRED.setdefault(dev, torch.zeros(1, device=dev, dtype=torch.int64))
    out_w = None
    for i, start in enumerate(range(0, m, chunk_rows)):
        stop = min(start + chunk_rows, m)
        hc, r, t, c, st = h[start:stop], r_all[start:stop], targets[start:stop], offsets[start:stop], safe_t[start:stop]
        e = e_buf[: stop - start]
        with first_call("lm_head_ce_exp", hc, weight):
            res = gemm(rstd_exp_lse_target_epi, hc, weight.t(), None, {"D": e}, rstd=r, offset=c, target=t)
        s, k, kt, et, corr, count = ce_exp.exp_program(e, res["el"], res["lse"], res["target_logit"], t, r, c, hc,
                                                       weight, ref.IGNORE_INDEX, d, loss_rows[start:stop])
        repaired += count
        with stages.capped(base):
            out = gemm(exp_norm_bwd_last_epi, e, weight, weight.index_select(0, st), {"D": dx[start:stop]},
                       y=x[start:stop], w=gamma32, corr=corr, s=s, kt=kt)
        dgamma += out["dw"]
        sh, fix = ce_exp.wgrad_operands(hc, s, k, et)  # (fix: the target's exact term minus what the GEMM adds)
        if i > 0 or one:
            dw.index_put_((st,), fix, accumulate=True)
        if stop == m:
            out_w = gemm_add(e.t(), sh, dw, out_dtype=weight.dtype, tuned=TUNE)
        elif i == 0:
            quack_gemm(e.t(), sh, out=dw, tuned=TUNE)
            dw.index_put_((st,), fix, accumulate=True)
        else:
            gemm_add_inplace(e.t(), sh, dw, tuned=TUNE)
    return loss_rows.sum(), dx, dgamma, out_w


@torch.library.register_kernel("coda::lm_head_ce_fp8", "cuda")
def _lm_head_ce_fp8(hq, s_h, rstd, x, gamma, weight_q, weight_tq, s_w, targets, chunk_rows, compute_grad):
    why = unsupported(x) or unsupported_fp8(hq, weight_q, weight_tq)
    if why:
        return fallback(ref.lm_head_ce_fp8_op, why, hq, s_h, rstd, x, gamma, weight_q, weight_tq, s_w, targets,
                        chunk_rows, compute_grad)
    m, d = hq.shape
    vocab = weight_q.shape[0]
    rstd, x = rstd.float(), x.contiguous()
    scale = (s_h.float() * s_w.float()).reshape(())
    inv_g = ref.dlogits_inv_scale(rstd, targets).float().reshape(())
    loss_rows = torch.empty(m, device=x.device, dtype=torch.float32)
    if compute_grad:
        dx, dgamma = torch.empty_like(x), torch.zeros(d, device=x.device, dtype=torch.float32)
        daq_t = torch.empty((vocab, m), device=x.device, dtype=E5M2)  # (every chunk's codes, token-major)
    logits_buf = x.new_empty((min(chunk_rows, m), vocab))
    epi = f4_epilogue(logits_buf.dtype)
    zdz_acc, gamma32 = ref.f4_zdz_mode() == "acc", gamma.float()
    for start in range(0, m, chunk_rows):
        stop = min(start + chunk_rows, m)
        r, t = rstd[start:stop], targets[start:stop]
        logits = logits_buf[: stop - start]
        with first_call("lm_head_ce_fp8", hq, weight_q):
            res = gemm(epi, hq[start:stop], weight_q.t(), None, {"D": logits}, rstd=r * scale, target=t)
        parts, tl = res["lse"], res["target_logit"]
        if not compute_grad:
            lse = torch.logsumexp(parts, dim=-1)
            loss_rows[start:stop] = torch.where(t != ref.IGNORE_INDEX, lse - tl, 0.0)
            continue
        daq, zdz = ce_grad_e5m2(logits, parts, tl, t, r, inv_g, ref.IGNORE_INDEX, loss_rows[start:stop])
        if zdz_acc:  # (B2 on cuBLAS, its fp32 accumulator to the row pass: zdz of the e5m2 da it read)
            acc = torch._scaled_mm(daq, weight_tq.t(), inv_g.reciprocal(), s_w.float().reshape(()),
                                   out_dtype=torch.float32)
            dgamma += norm_apply_rows(acc, x[start:stop], gamma32, r, dx[start:stop])
        else:
            dx_c, dg_c, _ = torch.ops.coda.norm_residual_bwd_fp8(daq, weight_tq, s_w.float() / inv_g, x[start:stop],
                                                                 gamma, r, zdz, None)
            dx[start:stop] = dx_c
            dgamma += dg_c
        transpose_8bit.launch(daq, daq_t[:, start:stop])
    loss = loss_rows.sum()
    if not compute_grad:
        return ref.op_outputs(loss, None, None, None, h=x, weight=x)
    return loss, dx, dgamma, _fp8_dw(daq_t, hq, inv_g, s_h, x.dtype)


def _fp8_dw(daq_t, hq, inv_g, s_h, dtype):
    """The fp8 heads' dW_out: one cuBLAS fp8 GEMM over every token of da's token-major e5m2 codes (scale 1 / inv_g)
    and H's codes (s_h), transposed token-major here."""
    return torch._scaled_mm(daq_t, transpose_8bit.transpose_8bit(hq).t(), inv_g.reciprocal(), s_h.float().reshape(()),
                            out_dtype=dtype)
