"""F4 lm_head_ce: deferred rstd + LM head + cross-entropy, chunked over tokens, with its gradient made in the
forward.

For each chunk of rows (never all M x V logits at once), with H = X * gamma_final:

    logits = rnd(r * (H @ W_out^T))                  (rows, V), rounded to H's dtype, held in fp32
    lse    = logsumexp(logits);  loss_i = lse - logits[target_i]   (rows with target -100 skipped)
    dp     = softmax(logits) - onehot(target)        (zero on ignored rows)
    da     = rnd(r * dp)   (gradient of the unscaled H @ W_out^T, rounded to H's dtype as B2's GEMM reads it)
    acc    = da @ W_out (fp32);  zdz = sum_k acc_k X_k gamma_k   (the final norm's row dot, of that very da)
    (dX, dgamma) = norm_residual_apply(acc, X, gamma, r, zdz, no residual)
    dW_out += da^T @ H

The logits are rounded to H's dtype (the program stores them so, chunk by chunk) *before* the log-sum-exp, the
loss and the softmax: every one of them is taken from the same values, as stock's cross-entropy takes them from
its bf16 logits, so each row's softmax sums to one over the logits the gradient is made of. (A log-sum-exp of the
unrounded logits beside a softmax of the rounded ones leaves sum p - 1 = sum p delta, delta the roundings: on a
confident row the error of dlogits at the top token is p delta where stock's is p (1 - p) delta.)

zdz is taken from B2's accumulator, not as sum_n logits_n dp_n (equal in exact math): that sum, over rounded
logits and the unrounded dp, is not the row dot of the rounded da, and the difference leaves a per-token multiple of
X in dX that a trained residual stream's shared features add up coherently over tokens (``F4_ZDZ_ENV``; the
measurements in docs/cute_backend.md). A row's zdz spans every N tile, so the CUDA program keeps acc in fp32 and
applies the epilogue in one row pass.

The loss is the last op, so d(loss_sum) = 1 and every gradient is final up to the scalar the
trainer multiplies the loss by (1 / global tokens); the autograd wiring scales the saved gradients
by it. Returns the *sum* of token losses (TorchTitan's convention) and the gradients of that sum.

The op ``coda::lm_head_ce`` always returns four tensors; without ``compute_grad`` the three
gradients are empty (0-element) tensors, which ``lm_head_ce_program`` maps back to None.
"""

from __future__ import annotations

import math
import os
from typing import Optional

import torch

from ._common import acc_dtype, check_2d, mm, program_op
from .gemm import wgrad
from .norm_residual_bwd import norm_residual_apply, norm_residual_bwd, norm_residual_bwd_fp8
from .scaling import (E5M2_MAX, check_e4m3, compute_dtype, fp8_mm, inv_scale_from_amax, pow2_floor, quantize_e5m2,
                      quantize_e5m2_sr, sr_offsets, sr_seed_of)

IGNORE_INDEX = -100
# "unrounded": the CUDA program's F4 epilogue takes its log-sum-exp and target logit of the unrounded logits, as
# before c6d0abd (the probes' other arm: bf16_step_accuracy's coda_eager_lse_unrounded, the epilogue's GPU test)
F4_LSE_ENV = "CODA_TITAN_F4_LSE"
# "exp": the CUDA program's F4 without its gradient pass (``cute/ce_exp.py``; the math of ``lm_head_ce_exp``);
# "inductor": its previous gradient pass; unset: the Triton gradient pass
CE_PASS_ENV = "CODA_TITAN_CE_PASS"
# "acc" (the default): the final norm's row dot zdz from B2's accumulator, sum_k (da @ W)_k X_k gamma_k, B2 a plain
# GEMM keeping it in fp32 and its epilogue a row pass (both backends: the zdz of the rounded da B2 reads, as stock's
# norm backward takes its row dot from its own bf16 gradient); "rounded": over the stored (rounded) logits with the
# unrounded dp, the epilogue's row vector (the programs' before 2026-11-29, the A/B's other arm); "exact" /
# "target" / "consistent" / "consistent_rounded" (the torch backend: ``_zdz_variant``; probe arms)
F4_ZDZ_ENV = "CODA_TITAN_F4_ZDZ"


def f4_zdz_mode() -> str:
    """``F4_ZDZ_ENV``'s mode, "acc" when unset (every head, both backends, reads its default here)."""
    return os.environ.get(F4_ZDZ_ENV, "acc")


def lm_head_ce(
    *,
    h: torch.Tensor,
    rstd: torch.Tensor,
    x: torch.Tensor,
    gamma: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_rows: int,
    compute_grad: bool = True,
    hq: torch.Tensor | None = None, s_h: torch.Tensor | None = None, weight_q: torch.Tensor | None = None,
    s_w: torch.Tensor | None = None, fp8_dw: bool = False, fp8_dgrad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(loss_sum, dX, dgamma, dW_out); the gradients are None when ``compute_grad`` is False. With ``hq``, H's e4m3
    codes at scale ``s_h``, and ``weight_q``, W's at ``s_w`` (``fp8_lm_head_fwd``): the logits are
    r s_h s_w (hq @ weight_q^T) (products exact, sums in the compute dtype), and the gradient is made from them as
    above, on the bf16 H and W (the straight-through backward of the quantized forward, as torchao's fp8 linear).
    ``fp8_dw`` (``fp8_lm_head_dw``): dW_out on da's e5m2 codes at ``dlogits_inv_scale`` (from its unrounded value,
    rounded stochastically: ``quantize_e5m2_sr`` with ``sr_seed_of(targets)``, so each code's expected value is
    da's) and H's codes; dX and dgamma stay the bf16 da's. ``fp8_dgrad`` (``fp8_lm_head_dgrad``): B2 on those codes,
    the target's zeroed, and W's: acc = (s_w / inv_g) (codes @ weight_q) + da_t W[t] (unrounded), zdz its row dot."""
    check_2d("h", h, weight.shape[1])
    if not (hq is None) == (s_h is None) == (weight_q is None) == (s_w is None) or fp8_dw and hq is None:
        raise ValueError("the head's fp8 forward takes hq, s_h, weight_q and s_w together, and fp8_dw needs them")
    check_fp8_dgrad(fp8_dw, fp8_dgrad)
    if hq is not None:
        check_e4m3(hq, weight_q)
        if hq.shape != h.shape or weight_q.shape != weight.shape:
            raise ValueError(f"hq and weight_q must have h's and weight's shapes, got {(hq.shape, weight_q.shape)}")
    if targets.shape != (h.shape[0],):
        raise ValueError(f"targets must be ({h.shape[0]},), got {tuple(targets.shape)}")
    if chunk_rows <= 0:
        raise ValueError(f"chunk_rows must be positive, got {chunk_rows}")
    m, loss, dgamma, dweight = h.shape[0], None, None, None
    dx = torch.empty_like(x) if compute_grad else None
    inv_g_all = dlogits_inv_scale(rstd, targets) if fp8_dw else None  # (one scale for every chunk's codes)
    seed = sr_seed_of(targets) if fp8_dw and compute_grad else None
    for start in range(0, m, chunk_rows):
        rows = slice(start, min(start + chunk_rows, m))
        r, tgt = rstd[rows], targets[rows]
        if hq is None:
            acc = mm(h[rows], weight.t())
            lf = acc * r.to(acc.dtype)[:, None]
        else:  # (the fp8 forward: the codes' scales folded into r, as the CUDA epilogue takes them)
            acc = fp8_mm(hq[rows], weight_q, acc_dtype(h, weight))
            lf = acc * (s_h.to(acc.dtype) * s_w.to(acc.dtype) * r.to(acc.dtype))[:, None]
        logits = stored_logits(lf, h.dtype)
        chunk_loss, dp, zdz = _ce(logits, tgt, compute_grad)
        loss = chunk_loss if loss is None else loss + chunk_loss
        if not compute_grad:
            continue
        da = (dp * r.to(dp.dtype)[:, None]).to(h.dtype)
        if fp8_dw:  # (e5m2 codes of the unrounded da, stochastically rounded; H's codes)
            ct, inv_g = dp.dtype, inv_g_all.to(dp.dtype)
            daq = quantize_e5m2_sr(dp * r.to(ct)[:, None], inv_g, seed,
                                   sr_offsets(rows.start, rows.stop, weight.shape[0], dp.device))
        if fp8_dgrad:  # (the fp8 head's B2 on those codes, each target's zeroed, and W's, plus da_t W[t] exact)
            ti = tgt.clamp(min=0)[:, None]  # (an ignored row's da is 0: its index is any row's)
            dx_c, dg_c, _ = norm_residual_bwd_fp8(
                daq=daq.view(torch.uint8).scatter(1, ti, 0).view(daq.dtype), weight_tq=weight_q.t(),
                scale=s_w.to(ct) / inv_g, x=x[rows], gamma=gamma, rstd=r, zdz=None, dresidual=None,
                extra=(dp * r.to(ct)[:, None]).gather(1, ti) * weight[ti[:, 0]].to(ct))
        elif f4_zdz_mode() == "acc":  # (zdz from B2's accumulator: ``norm_residual_apply``'s None)
            dx_c, dg_c = norm_residual_apply(mm(da, weight), x=x[rows], gamma=gamma, rstd=r, zdz=None, dresidual=None)
        else:
            dx_c, dg_c = norm_residual_bwd(da=da, weight=weight, x=x[rows], gamma=gamma, rstd=r,
                                           zdz=_zdz_variant(zdz, dp, lf, logits, tgt, da, r), dresidual=None)
        dx[rows] = dx_c
        if fp8_dw:
            dw_c = (daq.to(ct).t() @ hq[rows].to(ct)) * (s_h.to(ct) / inv_g)
        else:
            dw_c = wgrad(grad=da, inp=h[rows], out_dtype=dg_c.dtype)
        dgamma = dg_c if dgamma is None else dgamma + dg_c
        dweight = dw_c if dweight is None else dweight + dw_c
    assert loss is not None, "empty batch"
    if compute_grad:
        dweight = dweight.to(weight.dtype)
    return loss, dx, dgamma, dweight


EXP_MARGIN = 70.0  # lm_head_ce_exp: every stored e = exp(l - c) at most e^70 (the GEMMs' fp32 sums cannot overflow)
EXP_FLOOR = 87.0  # ... and a row's largest e at least e^-87, a normal bf16 (fp32's exponent range)


def exp_range(vocab: int) -> tuple[float, float]:
    """(HI, LO): ``lm_head_ce_exp`` lists (repairs) a row when lse - c > HI or < LO, judged from the lse since F4's
    kernels have no row maximum (l_max <= lse <= l_max + ln V): a row listed at HI = EXP_MARGIN + ln V has its
    largest l above c + EXP_MARGIN (never, with ``exp_offsets``; and a row not listed keeps sum e <=
    e^(EXP_MARGIN + ln V), finite in fp32); every row whose largest l lies below c - EXP_FLOOR is listed at
    LO = ln V - EXP_FLOOR (and a row within ln V above that may be: a repair it did not need)."""
    return EXP_MARGIN + math.log(vocab), math.log(vocab) - EXP_FLOOR


def exp_offsets(h: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The Cauchy-Schwarz offsets c = r ||H_row|| max_n ||W_n|| - EXP_MARGIN (compute dtype), known before the GEMM:
    no logit r H_row . W_n exceeds the bound, so no e exceeds e^70; a row whose largest logit is more than
    EXP_MARGIN + EXP_FLOOR below its bound is out of range (``lm_head_ce_exp`` repairs it)."""
    ct = acc_dtype(h, weight)
    return rstd.to(ct) * h.to(ct).norm(dim=-1) * weight.to(ct).norm(dim=-1).amax() - EXP_MARGIN


def lm_head_ce_exp(
    *, h: torch.Tensor, rstd: torch.Tensor, x: torch.Tensor, gamma: torch.Tensor, weight: torch.Tensor,
    targets: torch.Tensor, chunk_rows: int, offsets: torch.Tensor, compute_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, int]:
    """The reference of F4 without its gradient pass (docs/cute_backend.md, "F4 without its gradient pass"; not
    yet a program of either backend). ``offsets``: each row's c (``exp_offsets``, or a delayed estimate). Per
    chunk, with l = r (H @ W^T) unrounded (the compute dtype):

        lse = logsumexp(l) (F4's tile-max partials, never c + log sum e);  loss_i = lse - l_t
        e = exp(l - c), stored in H's dtype with 0 at the target: the one M x V tensor, no pass over it.
            A row whose lse - c is outside ``exp_range`` is repaired: its e again with c = its lse (the
            kernels: a GEMV of each listed row; the count is returned)
        q = exp(c - lse) (p_n = q e_n), s = r q, k = r (p_t - 1), zdz = q sum_{n != t} e_n l_n + (p_t - 1) l_t
        da = s e + k onehot_t                        (= r (softmax - onehot), never formed)
        acc = s (e @ W) + k W[t]  ->  B2's epilogue (``norm_residual_apply``)
        dW += e^T @ rnd(s H)  +  k H scattered to the targets' rows

    (ignored rows: s = k = zdz = 0). The target's term is exact (W's row as stored, k in the compute dtype), so
    rounding touches the probabilities, not the logits: against fp64 its dlogits error is several times below the
    bf16 head's (``scripts/probes/ce_rounding.py``). In fp64 it is ``lm_head_ce`` up to fp64's rounding.
    (loss_sum, dX, dgamma, dW_out as ``lm_head_ce``, the number of rows repaired)."""
    check_2d("h", h, weight.shape[1])
    if targets.shape != (h.shape[0],) or offsets.shape != (h.shape[0],) or chunk_rows <= 0:
        raise ValueError(f"targets and offsets must be ({h.shape[0]},) and chunk_rows positive, got "
                         f"{tuple(targets.shape)}, {tuple(offsets.shape)}, {chunk_rows}")
    ct = acc_dtype(h, weight)
    loss = dgamma = dweight = None
    dx = torch.empty_like(x) if compute_grad else None
    repaired = 0
    for start in range(0, h.shape[0], chunk_rows):
        rows = slice(start, min(start + chunk_rows, h.shape[0]))
        r = rstd[rows].to(ct)
        logits = mm(h[rows], weight.t()) * r[:, None]
        chunk_loss, valid, safe_tgt, lse, l_t = _ce_loss(logits, targets[rows])
        loss = chunk_loss if loss is None else loss + chunk_loss
        if not compute_grad:
            continue
        c, (hi, lo) = offsets[rows].to(ct), exp_range(weight.shape[0])
        bad = valid & (((lse - c) > hi) | ((lse - c) < lo))
        repaired += int(bad.sum())
        c = torch.where(bad, lse, c)
        e = torch.exp(logits - c[:, None]).scatter(1, safe_tgt[:, None], 0.0)
        q, dp_t = torch.exp(c - lse), torch.exp(l_t - lse) - 1
        s, k = torch.where(valid, r * q, 0), torch.where(valid, r * dp_t, 0)
        zdz = torch.where(valid, q * (e * logits).sum(-1) + dp_t * l_t, 0)
        stored = e.to(h.dtype)
        acc = mm(stored, weight) * s[:, None] + k[:, None] * weight[safe_tgt].to(ct)
        dx[rows], dg_c = norm_residual_apply(acc, x=x[rows], gamma=gamma, rstd=r, zdz=zdz, dresidual=None)
        hf = h[rows].to(ct)
        dw_c = wgrad(grad=stored, inp=(hf * s[:, None]).to(h.dtype), out_dtype=ct)
        dw_c.index_add_(0, safe_tgt, hf * k[:, None])  # (k = 0 on ignored rows)
        dgamma = dg_c if dgamma is None else dgamma + dg_c
        dweight = dw_c if dweight is None else dweight + dw_c
    assert loss is not None, "empty batch"
    return loss, dx, dgamma, None if dweight is None else dweight.to(weight.dtype), repaired


def _zdz_variant(zdz, dp, lf, logits, tgt, da, r):
    """zdz as ``F4_ZDZ_ENV`` asks (a precision probe's arms, the torch backend): "exact", sum dp l over the
    unrounded logits l; "target", the rounded logits' zdz with the target's term on its unrounded logit;
    "consistent", sum l da / r over the rounded logits (the target's unrounded) and the *rounded* da B2's GEMM
    reads, so that B2's correction cancels the x-component of the gradient it is given, as stock's norm backward
    does with its own bf16 gradient; "consistent_rounded", the same with every logit rounded (what the gradient
    pass has in memory); else ("rounded") the rounded logits' sum dp l."""
    mode = f4_zdz_mode()
    valid = tgt != IGNORE_INDEX
    t = torch.where(valid, tgt, 0)[:, None]
    if mode == "exact":
        return (dp * lf).sum(-1)
    if mode == "target":
        return zdz + torch.where(valid, (logits.gather(1, t) - lf.gather(1, t)).squeeze(1), 0)
    if mode in ("consistent", "consistent_rounded"):
        daf = da.to(lf.dtype)
        dot = (logits * daf).sum(-1)
        if mode == "consistent":
            dot = dot + ((lf.gather(1, t) - logits.gather(1, t)) * daf.gather(1, t)).squeeze(1)
        return torch.where(valid, dot / torch.where(valid, r.to(lf.dtype), 1), 0)
    return zdz


def stored_logits(logits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The logits as the program stores them: rounded to ``dtype`` (to nearest even), held in their own dtype."""
    return logits.to(dtype).to(logits.dtype)


def _ce_loss(logits: torch.Tensor, tgt: torch.Tensor):
    """A chunk's (loss sum, valid rows, targets with ignored rows at 0, lse, target logits) from its logits."""
    valid = tgt != IGNORE_INDEX
    safe_tgt = torch.where(valid, tgt, 0)
    lse = torch.logsumexp(logits, dim=-1)
    tgt_logit = logits.gather(1, safe_tgt[:, None]).squeeze(1)
    return torch.where(valid, lse - tgt_logit, 0).sum(), valid, safe_tgt, lse, tgt_logit


def _ce(logits: torch.Tensor, tgt: torch.Tensor, compute_grad: bool):
    """A chunk's (loss sum, dp = softmax - onehot, zdz = sum logits * dp) from its logits (dp and zdz None
    without ``compute_grad``); rows with target -100 add nothing and get dp = 0."""
    chunk_loss, valid, safe_tgt, _, _ = _ce_loss(logits, tgt)
    if not compute_grad:
        return chunk_loss, None, None
    dp = torch.softmax(logits, dim=-1)
    dp.scatter_add_(1, safe_tgt[:, None], -torch.ones_like(dp[:, :1]))
    dp = dp * valid[:, None]
    return chunk_loss, dp, (logits * dp).sum(-1)


def check_fp8_dgrad(fp8_dw: bool, fp8_dgrad: bool) -> None:
    """``fp8_dgrad`` (``fp8_lm_head_dgrad``) runs B2 on ``fp8_dw``'s codes, with zdz from its accumulator."""
    if fp8_dgrad and (not fp8_dw or f4_zdz_mode() != "acc"):
        raise ValueError(f"fp8_dgrad (fp8_lm_head_dgrad) runs B2 on fp8_dw's codes, zdz of its accumulator: it needs "
                         f"fp8_dw and {F4_ZDZ_ENV}=acc, got fp8_dw={fp8_dw} and {f4_zdz_mode()!r}")


def dlogits_inv_scale(rstd: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The e5m2 scale of the fp8 head's da = r (softmax - onehot): |softmax - onehot| <= 1, so amax |da| <= the
    largest r of a row with a target, known before any logit is: pow2_floor(E5M2_MAX / that r) never saturates
    and needs no amax history (at most one binade of range given up beside the current amax's scale)."""
    r = torch.where(targets != IGNORE_INDEX, rstd.to(compute_dtype(rstd.dtype)), 0)
    return pow2_floor(inv_scale_from_amax(r.amax(), E5M2_MAX))


def lm_head_ce_fp8(
    *, hq: torch.Tensor, s_h: torch.Tensor, rstd: torch.Tensor, x: torch.Tensor, gamma: torch.Tensor,
    weight_q: torch.Tensor, weight_tq: torch.Tensor, s_w: torch.Tensor, targets: torch.Tensor, chunk_rows: int,
    compute_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """F4 on fp8 operands, the fp8 LM head (torchao's formats): logits = r * s_h s_w (hq @ weight_q^T) from e4m3
    H (H ~ hq s_h) and W (~ weight_q s_w), rounded to x's dtype as the bf16 head's (``stored_logits``); backward
    on da = r (softmax - onehot) in e5m2 at ``dlogits_inv_scale``: B2 on it and weight_tq (W^T's codes, (d, V)),
    and dW_out = da^T H on the same codes. zdz as the bf16 head's (``F4_ZDZ_ENV``): by default the row dot of B2's
    accumulator, of the e5m2 da it reads (with H's codes H != X gamma, the logits' sum l dp is not even equal to it
    in exact math); "rounded", the logits' sum. Products exact, sums in x's compute dtype (fp32; fp64 for fp64 x).
    (loss_sum, dX, dgamma, dW_out in x's dtype); the gradients None without ``compute_grad``."""
    check_e4m3(hq, weight_q, weight_tq)
    check_2d("hq", hq, weight_q.shape[1])
    if targets.shape != (hq.shape[0],) or chunk_rows <= 0:
        raise ValueError(f"targets must be ({hq.shape[0]},) and chunk_rows positive, got {tuple(targets.shape)}, "
                         f"{chunk_rows}")
    ct = compute_dtype(x.dtype)
    inv_g = dlogits_inv_scale(rstd, targets).to(ct)
    loss, dgamma, dweight, dxs = None, None, None, []
    for start in range(0, hq.shape[0], chunk_rows):
        rows = slice(start, min(start + chunk_rows, hq.shape[0]))
        r = rstd[rows].to(ct)
        logits = stored_logits(fp8_mm(hq[rows], weight_q, ct) * (s_h.to(ct) * s_w.to(ct) * r)[:, None], x.dtype)
        chunk_loss, dp, zdz = _ce(logits, targets[rows], compute_grad)
        loss = chunk_loss if loss is None else loss + chunk_loss
        if not compute_grad:
            continue
        daq = quantize_e5m2(dp * r[:, None], inv_g)
        zdz = None if f4_zdz_mode() == "acc" else zdz  # (None: of B2's accumulator)
        dx_c, dg_c, _ = norm_residual_bwd_fp8(daq=daq, weight_tq=weight_tq, scale=s_w.to(ct) / inv_g, x=x[rows],
                                              gamma=gamma, rstd=r, zdz=zdz, dresidual=None)
        dw_c = (daq.to(ct).t() @ hq[rows].to(ct)) * (s_h.to(ct) / inv_g)
        dxs.append(dx_c)
        dgamma = dg_c if dgamma is None else dgamma + dg_c
        dweight = dw_c if dweight is None else dweight + dw_c
    return loss, torch.cat(dxs) if dxs else None, dgamma, None if dweight is None else dweight.to(x.dtype)


# --- custom op -------------------------------------------------------------------------------------


@program_op("lm_head_ce")
def lm_head_ce_op(
    h: torch.Tensor, rstd: torch.Tensor, x: torch.Tensor, gamma: torch.Tensor, weight: torch.Tensor,
    targets: torch.Tensor, chunk_rows: int, compute_grad: bool, hq: Optional[torch.Tensor] = None,
    s_h: Optional[torch.Tensor] = None, weight_q: Optional[torch.Tensor] = None, s_w: Optional[torch.Tensor] = None,
    fp8_dw: bool = False, fp8_dgrad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    loss, dx, dgamma, dw = lm_head_ce(
        h=h, rstd=rstd, x=x, gamma=gamma, weight=weight, targets=targets, chunk_rows=chunk_rows,
        compute_grad=compute_grad, hq=hq, s_h=s_h, weight_q=weight_q, s_w=s_w, fp8_dw=fp8_dw, fp8_dgrad=fp8_dgrad,
    )
    return op_outputs(loss, dx, dgamma, dw, h=h, weight=weight)


def op_outputs(loss, dx, dgamma, dw, *, h, weight):
    """The op's four outputs: the gradients, or 0-element tensors when they were not computed."""
    if dx is None:
        dx, dgamma, dw = h.new_empty((0,)), h.new_empty((0,), dtype=acc_dtype(h, weight)), weight.new_empty((0,))
    return loss, dx, dgamma, dw


@lm_head_ce_op.register_fake
def _(h, rstd, x, gamma, weight, targets, chunk_rows, compute_grad, hq=None, s_h=None, weight_q=None, s_w=None,
      fp8_dw=False, fp8_dgrad=False):
    ct = acc_dtype(h, weight)
    loss = h.new_empty((), dtype=ct)
    if not compute_grad:
        return loss, h.new_empty((0,)), h.new_empty((0,), dtype=ct), weight.new_empty((0,))
    return loss, torch.empty_like(x), gamma.new_empty(gamma.shape, dtype=ct), torch.empty_like(weight)


def lm_head_ce_program(*, h, rstd, x, gamma, weight, targets, chunk_rows: int, compute_grad: bool = True, hq=None,
                       s_h=None, weight_q=None, s_w=None, fp8_dw: bool = False, fp8_dgrad: bool = False):
    """``lm_head_ce`` through the op (the ``cute`` backend's program): None for gradients not computed."""
    loss, dx, dgamma, dw = lm_head_ce_op(h, rstd, x, gamma, weight, targets, chunk_rows, compute_grad, hq, s_h,
                                         weight_q, s_w, fp8_dw, fp8_dgrad)
    return (loss, dx, dgamma, dw) if compute_grad else (loss, None, None, None)


@program_op("lm_head_ce_fp8")
def lm_head_ce_fp8_op(
    hq: torch.Tensor, s_h: torch.Tensor, rstd: torch.Tensor, x: torch.Tensor, gamma: torch.Tensor,
    weight_q: torch.Tensor, weight_tq: torch.Tensor, s_w: torch.Tensor, targets: torch.Tensor, chunk_rows: int,
    compute_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    loss, dx, dgamma, dw = lm_head_ce_fp8(hq=hq, s_h=s_h, rstd=rstd, x=x, gamma=gamma, weight_q=weight_q,
                                          weight_tq=weight_tq, s_w=s_w, targets=targets, chunk_rows=chunk_rows,
                                          compute_grad=compute_grad)
    return op_outputs(loss, dx, dgamma, dw, h=x, weight=x)


@lm_head_ce_fp8_op.register_fake
def _(hq, s_h, rstd, x, gamma, weight_q, weight_tq, s_w, targets, chunk_rows, compute_grad):
    ct = compute_dtype(x.dtype)
    loss = x.new_empty((), dtype=ct)
    if not compute_grad:
        return loss, x.new_empty((0,)), x.new_empty((0,), dtype=ct), x.new_empty((0,))
    return loss, torch.empty_like(x), x.new_empty(gamma.shape, dtype=ct), x.new_empty(weight_q.shape)


def lm_head_ce_fp8_program(*, hq, s_h, rstd, x, gamma, weight_q, weight_tq, s_w, targets, chunk_rows: int,
                           compute_grad: bool = True):
    """``lm_head_ce_fp8`` through the op: None for gradients not computed."""
    loss, dx, dgamma, dw = lm_head_ce_fp8_op(hq, s_h, rstd, x, gamma, weight_q, weight_tq, s_w, targets, chunk_rows,
                                             compute_grad)
    return (loss, dx, dgamma, dw) if compute_grad else (loss, None, None, None)
