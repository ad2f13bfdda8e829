"""F4 lm_head_ce: deferred rstd + LM head + cross-entropy, chunked over tokens, with its gradient made in the
forward.

For each chunk of rows (never all M x V logits at once), with H = X * gamma_final:

    logits = r * (H @ W_out^T)                       (rows, V) fp32
    lse    = logsumexp(logits);  loss_i = lse - logits[target_i]   (rows with target -100 skipped)
    dp     = softmax(logits) - onehot(target)        (zero on ignored rows)
    zdz    = sum_n logits_n dp_n;   da = r * dp   (gradient of the unscaled H @ W_out^T)
    (dX, dgamma) = norm_residual_bwd(da, W_out, X, gamma, r, zdz, no residual)
    dW_out += da^T @ H

The loss is the last op, so d(loss_sum) = 1 and every gradient is final up to the scalar the
trainer multiplies the loss by (1 / global tokens); the autograd wiring scales the saved gradients
by it. Returns the *sum* of token losses (TorchTitan's convention) and the gradients of that sum.

The op ``coda::lm_head_ce`` always returns four tensors; without ``compute_grad`` the three
gradients are empty (0-element) tensors, which ``lm_head_ce_program`` maps back to None.

With ``CODA_TITAN_LM_HEAD_DW_BWD=1`` (off until measured) training runs it as two programs, so that the
trainer's scalar costs no pass over dW_out (0.5 GB):
``lm_head_ce_deferred`` (the forward: everything above but the last chunk's dW GEMM, whose da it
returns) and ``lm_head_dw_finish`` (the backward: dW_out = s (da_last^T @ H_last) + s dW_head, with the
scalar s as the GEMM's alpha and beta, rounded once).
"""

from __future__ import annotations

import torch

from ._common import acc_dtype, check_2d, mm, program_op
from .gemm import wgrad
from .norm_residual_bwd import norm_residual_bwd

IGNORE_INDEX = -100


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
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(loss_sum, dX, dgamma, dW_out); the gradients are None when ``compute_grad`` is False."""
    loss, dx, dgamma, dweight, last = _chunked(h, rstd, x, gamma, weight, targets, chunk_rows, compute_grad)
    if compute_grad:
        dweight = last if dweight is None else dweight + last
        dweight = dweight.to(weight.dtype)
    return loss, dx, dgamma, dweight


def lm_head_ce_deferred(
    *, h: torch.Tensor, rstd: torch.Tensor, x: torch.Tensor, gamma: torch.Tensor, weight: torch.Tensor,
    targets: torch.Tensor, chunk_rows: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``lm_head_ce`` with its gradient, less the last chunk's dW GEMM: (loss_sum, dX, dgamma, dW_head,
    da_last). dW_head: the other chunks' sum in the accumulator dtype (0 elements with one chunk);
    da_last: the last chunk's da (its rows of H are the last ``da_last.shape[0]``)."""
    loss, dx, dgamma, dw_head, da_last = _chunked(h, rstd, x, gamma, weight, targets, chunk_rows, True, defer=True)
    return loss, dx, dgamma, weight.new_empty((0,), dtype=dgamma.dtype) if dw_head is None else dw_head, da_last


def lm_head_dw_finish(
    *, dw_head: torch.Tensor, da_last: torch.Tensor, h_last: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype,
) -> torch.Tensor:
    """dW_out = s (da_last^T @ h_last) + s dW_head (dW_head: 0 elements for none), in the accumulator dtype,
    rounded once to ``out_dtype``; s = ``scale`` (0-dim)."""
    check_2d("da_last", da_last)
    check_2d("h_last", h_last)
    last = wgrad(grad=da_last, inp=h_last, out_dtype=acc_dtype(da_last, h_last))
    s = scale.to(last.dtype)
    out = s * last if dw_head.numel() == 0 else s * last + s * dw_head.to(last.dtype)
    return out.to(out_dtype)


def _chunked(h, rstd, x, gamma, weight, targets, chunk_rows: int, compute_grad: bool, defer: bool = False):
    """The chunk loop: (loss_sum, dX, dgamma, dW of every chunk but the last, the last chunk's dW term, or
    with ``defer`` its da)."""
    check_2d("h", h, weight.shape[1])
    if targets.shape != (h.shape[0],):
        raise ValueError(f"targets must be ({h.shape[0]},), got {tuple(targets.shape)}")
    if chunk_rows <= 0:
        raise ValueError(f"chunk_rows must be positive, got {chunk_rows}")
    m = h.shape[0]
    loss = last = None
    dx = torch.empty_like(x) if compute_grad else None
    dgamma = dweight = None
    for start in range(0, m, chunk_rows):
        rows = slice(start, min(start + chunk_rows, m))
        r = rstd[rows]
        tgt = targets[rows]
        acc = mm(h[rows], weight.t())
        logits = acc * r.to(acc.dtype)[:, None]
        valid = tgt != IGNORE_INDEX
        safe_tgt = torch.where(valid, tgt, 0)
        lse = torch.logsumexp(logits, dim=-1)
        tgt_logit = logits.gather(1, safe_tgt[:, None]).squeeze(1)
        chunk_loss = torch.where(valid, lse - tgt_logit, 0).sum()
        loss = chunk_loss if loss is None else loss + chunk_loss
        if not compute_grad:
            continue
        dp = torch.softmax(logits, dim=-1)
        dp.scatter_add_(1, safe_tgt[:, None], -torch.ones_like(dp[:, :1]))
        dp = dp * valid[:, None]
        zdz = (logits * dp).sum(-1)
        da = (dp * r.to(dp.dtype)[:, None]).to(h.dtype)
        dx_c, dg_c = norm_residual_bwd(
            da=da, weight=weight, x=x[rows], gamma=gamma, rstd=r, zdz=zdz, dresidual=None
        )
        dx[rows] = dx_c
        dgamma = dg_c if dgamma is None else dgamma + dg_c
        if rows.stop == m:  # the last chunk: its term apart (the sum's order: the earlier chunks', then it)
            last = da if defer else wgrad(grad=da, inp=h[rows], out_dtype=dg_c.dtype)
            continue
        dw_c = wgrad(grad=da, inp=h[rows], out_dtype=dg_c.dtype)
        dweight = dw_c if dweight is None else dweight + dw_c
    assert loss is not None, "empty batch"
    return loss, dx, dgamma, dweight, last


# --- custom op -------------------------------------------------------------------------------------


@program_op("lm_head_ce")
def lm_head_ce_op(
    h: torch.Tensor, rstd: torch.Tensor, x: torch.Tensor, gamma: torch.Tensor, weight: torch.Tensor,
    targets: torch.Tensor, chunk_rows: int, compute_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    loss, dx, dgamma, dw = lm_head_ce(
        h=h, rstd=rstd, x=x, gamma=gamma, weight=weight, targets=targets, chunk_rows=chunk_rows,
        compute_grad=compute_grad,
    )
    return op_outputs(loss, dx, dgamma, dw, h=h, weight=weight)


def op_outputs(loss, dx, dgamma, dw, *, h, weight):
    """The op's four outputs: the gradients, or 0-element tensors when they were not computed."""
    if dx is None:
        dx, dgamma, dw = h.new_empty((0,)), h.new_empty((0,), dtype=acc_dtype(h, weight)), weight.new_empty((0,))
    return loss, dx, dgamma, dw


@lm_head_ce_op.register_fake
def _(h, rstd, x, gamma, weight, targets, chunk_rows, compute_grad):
    ct = acc_dtype(h, weight)
    loss = h.new_empty((), dtype=ct)
    if not compute_grad:
        return loss, h.new_empty((0,)), h.new_empty((0,), dtype=ct), weight.new_empty((0,))
    return loss, torch.empty_like(x), gamma.new_empty(gamma.shape, dtype=ct), torch.empty_like(weight)


@program_op("lm_head_ce_deferred")
def lm_head_ce_deferred_op(
    h: torch.Tensor, rstd: torch.Tensor, x: torch.Tensor, gamma: torch.Tensor, weight: torch.Tensor,
    targets: torch.Tensor, chunk_rows: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return lm_head_ce_deferred(h=h, rstd=rstd, x=x, gamma=gamma, weight=weight, targets=targets, chunk_rows=chunk_rows)


@lm_head_ce_deferred_op.register_fake
def _(h, rstd, x, gamma, weight, targets, chunk_rows):
    ct, m = acc_dtype(h, weight), h.shape[0]
    head = weight.new_empty(weight.shape if m > chunk_rows else (0,), dtype=ct)
    return (h.new_empty((), dtype=ct), torch.empty_like(x), gamma.new_empty(gamma.shape, dtype=ct), head,
            h.new_empty((m - (m - 1) // chunk_rows * chunk_rows, weight.shape[0])))


@program_op("lm_head_dw_finish")
def lm_head_dw_finish_op(
    dw_head: torch.Tensor, da_last: torch.Tensor, h_last: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype,
) -> torch.Tensor:
    return lm_head_dw_finish(dw_head=dw_head, da_last=da_last, h_last=h_last, scale=scale, out_dtype=out_dtype)


@lm_head_dw_finish_op.register_fake
def _(dw_head, da_last, h_last, scale, out_dtype):
    return da_last.new_empty((da_last.shape[1], h_last.shape[1]), dtype=out_dtype)


def lm_head_ce_program(*, h, rstd, x, gamma, weight, targets, chunk_rows: int, compute_grad: bool = True):
    """``lm_head_ce`` through the op (the ``cute`` backend's program): None for gradients not computed."""
    loss, dx, dgamma, dw = lm_head_ce_op(h, rstd, x, gamma, weight, targets, chunk_rows, compute_grad)
    return (loss, dx, dgamma, dw) if compute_grad else (loss, None, None, None)
