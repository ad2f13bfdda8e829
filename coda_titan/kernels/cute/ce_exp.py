"""The per-row kernels of F4 without its gradient pass (``CODA_TITAN_CE_PASS=exp``; docs/cute_backend.md,
"F4 without its gradient pass"; the reference is ``kernels.lm_head_ce.lm_head_ce_exp``).

F4's epilogue (``exp_epilogues.rstd_exp_lse_target_epi``) stores E = exp(l - c) in bf16 over all V columns (the
target's column too), with the per-N-tile partials of the log-sum-exp of l and of sum E l, and l at the
target. Between that GEMM and the two backward GEMMs, which take E as it is, these run on M values only:

- ``sq_norms``: the squared row norms in fp32 (H's rows and W's rows: the offsets c = r ||H_row|| max ||W_n||
  - EXP_MARGIN, ``kernels.lm_head_ce.exp_offsets``, known before the GEMM).
- ``_exp_rows_kernel``: per row the log-sum-exp (the partials' fold), the loss term, and the range check
  (``lm_head_ce.exp_range``, judged from the lse: l_max <= lse <= l_max + ln V): a row whose largest e may
  underflow (its largest l below c - EXP_FLOOR) or may exceed e^EXP_MARGIN is listed, with c = its lse for the
  repair.
- ``_exp_repair_kernel``: for each listed row (none at the 1B's measured slack: the launch reads a zero count and
  exits), its logits again (a GEMV of its H row against W, fp32), E rewritten at the new c, and the row's sum E l,
  sum E and target logit from those logits: its gradient takes p = E / sum E (the epilogue's lse and these logits
  differ in fp32's last places, which softmax amplifies at large |l|). Its loss term stays the epilogue's.
- ``_exp_coefs_kernel``: per row q = exp(c - lse) (a listed row: 1 / sum E), s = r q, k = r (p_t - 1) with p_t = q
  exp(l_t - c), zdz = q sum E l - l_t (E's target term included: q E_t l_t = p_t l_t), B2's corr = -(r^2 / d) zdz,
  and the target's correction. E's target element is the bf16 rounding of e_t: the GEMMs take s E, whose target term
  s rnd(e_t) is replaced by the exact k: B2 adds kt W[t] with kt = k - s rnd(e_t)
  (``exp_epilogues.exp_norm_bwd_last_epi``, W's target rows as its C), and dW adds k H_row - rnd(e_t) rnd(s H_row) at
  the target's row (the same bf16 values its GEMM took), so the target's term is exact up to fp32, as in the
  reference (which stores 0 there).

Ignored rows (target -100): loss, s, k, kt, corr and the correction 0; they are never listed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..lm_head_ce import exp_range
from .ce_grad_pass import fold_lse
from .row_vectors import fp32_reciprocal


@triton.jit
def _sq_norms_kernel(x_ptr, out_ptr, R, D, stride, BR: tl.constexpr, BD: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    acc = tl.zeros([BR, BD], dtype=tl.float32)
    for k in range(0, D, BD):
        cols = k + tl.arange(0, BD)
        m = (rows[:, None] < R) & (cols[None, :] < D)
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride + cols[None, :], mask=m, other=0.0).to(tl.float32)
        acc += x * x
    tl.store(out_ptr + rows, tl.sum(acc, axis=1), mask=rows < R)


def sq_norms(x: torch.Tensor) -> torch.Tensor:
    """Each row's sum of squares, fp32 (rows,), of a 2-D tensor with unit column stride (no copy of it)."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"sq_norms takes a 2-D tensor with unit column stride, got {tuple(x.shape)} {x.stride()}")
    out = torch.empty(x.shape[0], device=x.device, dtype=torch.float32)
    br = 16
    _sq_norms_kernel[(triton.cdiv(x.shape[0], br),)](x, out, x.shape[0], x.shape[1], x.stride(0), BR=br, BD=128)
    return out


@triton.jit
def _exp_rows_kernel(parts_ptr, tlogit_ptr, target_ptr, c_ptr, lse_ptr, loss_ptr, list_ptr, count_ptr, flag_ptr, NT,
                     HI, LO, IGNORE: tl.constexpr, PBLOCK: tl.constexpr):
    row = tl.program_id(0)
    lse = fold_lse(parts_ptr, row, NT, PBLOCK)
    valid = tl.load(target_ptr + row) != IGNORE
    tl.store(loss_ptr + row, tl.where(valid, lse - tl.load(tlogit_ptr + row), 0.0))
    tl.store(lse_ptr + row, lse)
    off = lse - tl.load(c_ptr + row)
    if valid & ((off > HI) | (off < LO)):
        slot = tl.atomic_add(count_ptr, 1)
        tl.store(list_ptr + slot, row)
        tl.store(c_ptr + row, lse)  # (the repair's offset: every e of the row at most 1, its largest >= 1 / V)
        tl.store(flag_ptr + row, 1)


@triton.jit
def _exp_repair_kernel(h_ptr, w_ptr, e_ptr, r_ptr, c_ptr, target_ptr, list_ptr, count_ptr, fix_ptr, V, D, stride_h,
                       stride_w, stride_e, BV: tl.constexpr, BD: tl.constexpr):
    n = tl.load(count_ptr)
    cols = tl.program_id(0) * BV + tl.arange(0, BV)
    inside = cols < V
    for i in range(0, n):
        row = tl.load(list_ptr + i)
        acc = tl.zeros([BV], dtype=tl.float32)
        for k in range(0, D, BD):
            ks = k + tl.arange(0, BD)
            hk = tl.load(h_ptr + row.to(tl.int64) * stride_h + ks, mask=ks < D, other=0.0).to(tl.float32)
            wk = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_w + ks[None, :],
                         mask=inside[:, None] & (ks[None, :] < D), other=0.0).to(tl.float32)
            acc += tl.sum(wk * hk[None, :], axis=1)
        l = tl.where(inside, acc * tl.load(r_ptr + row), 0.0)
        e = tl.where(inside, tl.exp(l - tl.load(c_ptr + row)), 0.0)
        tl.store(e_ptr + row.to(tl.int64) * stride_e + cols, e.to(e_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
                 mask=inside)
        # (the row's sums and target logit from these logits: the gradient of a listed row is made of them alone,
        # since the epilogue's fp32 logits differ from them in the last places, by more than softmax allows at
        # large |l|)
        fix = fix_ptr + row.to(tl.int64) * 3
        tl.atomic_add(fix, tl.sum(e * l, axis=0))
        tl.atomic_add(fix + 1, tl.sum(e, axis=0))
        t = tl.load(target_ptr + row)
        tl.store(fix + 2 + cols * 0, l, mask=inside & (cols == t))


@triton.jit
def _exp_coefs_kernel(el_ptr, tlogit_ptr, target_ptr, r_ptr, c_ptr, lse_ptr, e_ptr, fix_ptr, flag_ptr, s_ptr, k_ptr,
                      kt_ptr, et_ptr, corr_ptr, NT, stride_e, inv_d, IGNORE: tl.constexpr, PBLOCK: tl.constexpr):
    row = tl.program_id(0)
    target = tl.load(target_ptr + row)
    valid = target != IGNORE
    c = tl.load(c_ptr + row)
    pcols = tl.arange(0, PBLOCK)
    el = tl.sum(tl.load(el_ptr + row.to(tl.int64) * NT + pcols, mask=pcols < NT, other=0.0), axis=0)
    lt = tl.load(tlogit_ptr + row)
    q = tl.exp(c - tl.load(lse_ptr + row))
    if tl.load(flag_ptr + row) != 0:  # (a listed row: the repair's sums and target logit, p = e / sum e)
        fix = fix_ptr + row.to(tl.int64) * 3
        el = tl.load(fix)
        q = 1.0 / tl.load(fix + 1)
        lt = tl.load(fix + 2)
    r = tl.load(r_ptr + row)
    et = tl.load(e_ptr + row.to(tl.int64) * stride_e + tl.where(valid, target, 0)).to(tl.float32)
    s = r * q
    k = r * (q * tl.exp(lt - c) - 1.0)
    zdz = q * el - lt
    tl.store(s_ptr + row, tl.where(valid, s, 0.0))
    tl.store(k_ptr + row, tl.where(valid, k, 0.0))
    tl.store(kt_ptr + row, tl.where(valid, k - s * et, 0.0))
    tl.store(et_ptr + row, tl.where(valid, et, 0.0))
    tl.store(corr_ptr + row, tl.where(valid, -((r * r) * inv_d) * zdz, 0.0))


@triton.jit
def _wgrad_operands_kernel(h_ptr, s_ptr, k_ptr, et_ptr, sh_ptr, fix_ptr, D, stride_h, BD: tl.constexpr):
    row = tl.program_id(0)
    s = tl.load(s_ptr + row)
    k = tl.load(k_ptr + row)
    et = tl.load(et_ptr + row)
    for start in range(0, D, BD):
        cols = start + tl.arange(0, BD)
        inside = cols < D
        hf = tl.load(h_ptr + row.to(tl.int64) * stride_h + cols, mask=inside, other=0.0).to(tl.float32)
        sh = (hf * s).to(sh_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(sh_ptr + row.to(tl.int64) * D + cols, sh, mask=inside)
        tl.store(fix_ptr + row.to(tl.int64) * D + cols, hf * k - et * sh.to(tl.float32), mask=inside)


def wgrad_operands(h: torch.Tensor, s: torch.Tensor, k: torch.Tensor, et: torch.Tensor):
    """(rnd(s H) in H's dtype, the target rows' correction k H - rnd(e_t) rnd(s H) in fp32), (rows, d) each, in
    one pass over H (the aten ops of the same arithmetic were about eight a chunk)."""
    if h.dim() != 2 or h.stride(1) != 1:
        raise ValueError(f"wgrad_operands takes H with unit column stride, got {tuple(h.shape)} {h.stride()}")
    rows, d = h.shape
    sh = torch.empty((rows, d), device=h.device, dtype=h.dtype)
    fix = torch.empty((rows, d), device=h.device, dtype=torch.float32)
    _wgrad_operands_kernel[(rows,)](h, s, k, et, sh, fix, d, h.stride(0), BD=1024, num_warps=4)
    return sh, fix


def exp_program(e, el_parts, lse_parts, tgt_logit, targets, rstd, offsets, h, weight, ignore_index: int, dim: int,
                loss_rows):
    """The per-row work between F4 and the backward GEMMs, on one chunk: ``e`` (rows, V) bf16, F4's stored E
    (rewritten on listed rows); the partials (rows, NT) fp32; ``tgt_logit``, ``rstd``, ``offsets`` (rows,) fp32;
    ``targets`` (rows,); ``h`` (rows, d) and ``weight`` (V, d) the GEMM's operands (read only for listed rows).
    Writes the loss terms into ``loss_rows``. Returns (s, k, kt, et, corr, count), (rows,) fp32 each but count,
    the number of rows repaired as a (1,) int32 device tensor."""
    for name, t in (("e", e), ("h", h), ("weight", weight)):
        if t.dim() != 2 or t.stride(1) != 1:
            raise ValueError(f"exp_program: {name} must be 2-D with unit column stride, got {tuple(t.shape)}")
    rows, vocab = e.shape
    if el_parts.shape != lse_parts.shape or lse_parts.shape[0] != rows or offsets.dtype != torch.float32:
        raise ValueError(f"exp_program: partials {tuple(el_parts.shape)} / {tuple(lse_parts.shape)} for {rows} rows, "
                         f"offsets {offsets.dtype} (fp32)")
    hi, lo = exp_range(vocab)
    el_parts, lse_parts = el_parts.float().contiguous(), lse_parts.float().contiguous()
    tgt_logit, targets = tgt_logit.float().contiguous(), targets.contiguous()
    dev = e.device
    nt = lse_parts.shape[1]
    lse = torch.empty(rows, device=dev, dtype=torch.float32)
    listed = torch.empty(rows, device=dev, dtype=torch.int32)
    count = torch.zeros(1, device=dev, dtype=torch.int32)
    fix = torch.zeros((rows, 3), device=dev, dtype=torch.float32)  # (a listed row's sum e l, sum e, target logit)
    flag = torch.zeros(rows, device=dev, dtype=torch.int32)
    pblock = triton.next_power_of_2(nt)
    r = rstd.float().contiguous()
    _exp_rows_kernel[(rows,)](lse_parts, tgt_logit, targets, offsets, lse, loss_rows, listed, count, flag, nt, hi, lo,
                              IGNORE=ignore_index, PBLOCK=pblock)
    bv = 64
    _exp_repair_kernel[(triton.cdiv(vocab, bv),)](h, weight, e, r, offsets, targets, listed, count, fix, vocab,
                                                  h.shape[1], h.stride(0), weight.stride(0), e.stride(0), BV=bv, BD=64)
    s, k, kt, et, corr = (torch.empty(rows, device=dev, dtype=torch.float32) for _ in range(5))
    _exp_coefs_kernel[(rows,)](el_parts, tgt_logit, targets, r, offsets, lse, e, fix, flag, s, k, kt, et, corr,
                               nt, e.stride(0), fp32_reciprocal(dim), IGNORE=ignore_index, PBLOCK=pblock)
    return s, k, kt, et, corr, count
