"""F4's gradient pass for ``fp8_lm_head_dw`` with da's e5m2 codes stored token-major: a probe arm
(``CODA_TITAN_CE_CODES_T=1``) of ``ce_grad_pass.ce_grad_inplace(codes_inv=, sr_seed=)`` followed by
``transpose_8bit`` into the head's (V, M) code buffer.

The row-per-program pass writes each chunk's codes row-major (rows, V), and a second kernel copies them into the
token-major buffer dW's fp8 GEMM reads: the codes are written, read and written again (three times 263 MB a
2048-row chunk at the 1B vocabulary), and the row-major copy is a chunk-sized buffer of its own. Here a program
takes RB rows and one of NSPLIT column ranges, walks its range in BV-column tiles, and stores each tile's codes
straight into the token-major buffer: RB consecutive bytes a column (RB = 32: whole 32-byte sectors). The bf16 da
goes back over the logits as in the row pass, and the codes are the same function of da's fp32 value
(``scaling.quantize_e5m2_sr``'s bits, each element's counter its flat index in the batch).

The row sums split: each program stores its rows' partial sum of p l for its range (``acc``: (rows, NSPLIT)),
and ``finish_kernel`` adds a row's NSPLIT partials in a fixed order (deterministic) into zdz and B2's corr. Every
program folds its rows' log-sum-exp from the GEMM epilogue's partials (the max, then the sum of exp(x - max) over
blocks of PB partials); the programs of column range 0 store the loss terms. So lse, the loss and corr are the row
pass's arithmetic summed in another order: within the same derived bounds, not its bits
(``tests/ce_interpreter_check.py``, section ``codes_t``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..scaling import E5M2, E5M2_MAX, SR_DROP
from .ce_grad_pass import e5m2_sr, sr_row_state, sr_word
from .row_vectors import fp32_reciprocal

ENV = "CODA_TITAN_CE_CODES_T"


@triton.jit
def _lse_rows(parts_ptr, rows, rmask, NT, PB: tl.constexpr, RB: tl.constexpr):
    """The log-sum-exp of rows ``rows`` from their NT partials (``ce_grad_pass.fold_lse``'s fold, over blocks)."""
    m = tl.full([RB], float("-inf"), tl.float32)
    for p0 in range(0, NT, PB):
        pc = p0 + tl.arange(0, PB)
        parts = tl.load(parts_ptr + rows[:, None].to(tl.int64) * NT + pc[None, :],
                        mask=rmask[:, None] & (pc[None, :] < NT), other=float("-inf"))
        m = tl.maximum(m, tl.max(parts, axis=1))
    m = tl.where(tl.abs(m) == float("inf"), 0.0, m)
    s = tl.zeros([RB], dtype=tl.float32)
    for p0 in range(0, NT, PB):
        pc = p0 + tl.arange(0, PB)
        parts = tl.load(parts_ptr + rows[:, None].to(tl.int64) * NT + pc[None, :],
                        mask=rmask[:, None] & (pc[None, :] < NT), other=float("-inf"))
        s += tl.sum(tl.exp(parts - m[:, None]), axis=1)
    return tl.log(s) + m


@triton.jit(do_not_specialize=["row0", "col0", "M"])
def codes_t_kernel(logits_ptr, parts_ptr, tlogit_ptr, target_ptr, rstd_ptr, acc_ptr, loss_ptr, ROWS, V, NT,
                   daq_t_ptr, M, col0, inv_ptr, row0, seed_ptr, IGNORE: tl.constexpr, RB: tl.constexpr,
                   BV: tl.constexpr, PB: tl.constexpr, NSPLIT: tl.constexpr, FMAX: tl.constexpr, SR: tl.constexpr,
                   DROP: tl.constexpr):
    split = tl.program_id(1)
    rows = tl.program_id(0) * RB + tl.arange(0, RB)
    rmask = rows < ROWS
    lse = _lse_rows(parts_ptr, rows, rmask, NT, PB, RB)
    target = tl.load(target_ptr + rows, mask=rmask, other=IGNORE)
    valid = target != IGNORE
    r = tl.where(valid, tl.load(rstd_ptr + rows, mask=rmask, other=0.0), 0.0)
    inv = tl.load(inv_ptr)
    if SR:  # (as the row pass: the seed's hash and each row's first counter)
        key, rbase = sr_row_state(seed_ptr, row0 + rows, V)
    span = tl.cdiv(tl.cdiv(V, NSPLIT), BV) * BV
    c_lo = split * span
    c_hi = tl.minimum(c_lo + span, V)
    acc = tl.zeros([RB], dtype=tl.float32)
    for c0 in range(c_lo, c_hi, BV):
        cols = c0 + tl.arange(0, BV)
        inside = rmask[:, None] & (cols < c_hi)[None, :]
        ptr = logits_ptr + rows[:, None].to(tl.int64) * V + cols[None, :]
        lf = tl.load(ptr, mask=inside, other=0.0).to(tl.float32)
        p = tl.where(inside, tl.exp(lf - lse[:, None]), 0.0)
        acc += tl.sum(p * lf, axis=1)
        da = (p - tl.where(cols[None, :] == target[:, None], 1.0, 0.0)) * r[:, None]
        q = tl.clamp(da * inv, -FMAX, FMAX)
        if SR:
            q8 = e5m2_sr(q, sr_word(key, rbase[:, None], cols[None, :]), DROP)
        else:
            q8 = q.to(tl.float8e5, fp_downcast_rounding="rtne")
        tl.store(daq_t_ptr + cols[None, :].to(tl.int64) * M + (col0 + rows)[:, None], q8, mask=inside)
        tl.store(ptr, da.to(tl.bfloat16, fp_downcast_rounding="rtne"), mask=inside)
    tl.store(acc_ptr + rows * NSPLIT + split, acc, mask=rmask)
    if split == 0:
        tlogit = tl.load(tlogit_ptr + rows, mask=rmask, other=0.0)
        tl.store(loss_ptr + rows, tl.where(valid, lse - tlogit, 0.0), mask=rmask)


@triton.jit
def finish_kernel(acc_ptr, tlogit_ptr, target_ptr, rstd_ptr, corr_ptr, ROWS, inv_d, IGNORE: tl.constexpr,
                  NSPLIT: tl.constexpr, BR: tl.constexpr):
    """corr = -(r^2 / d) zdz, zdz = the row's partials added in split order minus its target logit (0 ignored)."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    rmask = rows < ROWS
    acc = tl.load(acc_ptr + rows * NSPLIT, mask=rmask, other=0.0)
    for s in tl.static_range(1, NSPLIT):
        acc += tl.load(acc_ptr + rows * NSPLIT + s, mask=rmask, other=0.0)
    valid = tl.load(target_ptr + rows, mask=rmask, other=IGNORE) != IGNORE
    zdz = tl.where(valid, acc - tl.load(tlogit_ptr + rows, mask=rmask, other=0.0), 0.0)
    rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
    tl.store(corr_ptr + rows, -((rstd * rstd) * inv_d) * zdz, mask=rmask)


def ce_grad_codes_t(logits: torch.Tensor, lse_parts: torch.Tensor, tgt_logit: torch.Tensor, targets: torch.Tensor,
                    rstd: torch.Tensor, ignore_index: int, dim: int, loss_rows: torch.Tensor, codes_inv: torch.Tensor,
                    daq_t: torch.Tensor, col0: int, sr_seed: torch.Tensor | int | None = None, row0: int = 0,
                    rb: int = 32, bv: int = 256, nsplit: int = 8,
                    num_warps: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """(da, corr) as ``ce_grad_inplace(codes_inv=, sr_seed=, row0=)`` returns them, da over ``logits``;
    the codes go to ``daq_t[:, col0:col0 + rows]`` ((V, M) contiguous e5m2) instead of a buffer of their own.
    ``sr_seed`` None: round to nearest even. ``rb`` rows and one of ``nsplit`` column ranges a program, ``bv``
    columns a step (``scripts/probes/ce_pass.py`` times them)."""
    if logits.dtype != torch.bfloat16 or not logits.is_contiguous():
        raise ValueError(f"the CE gradient pass takes contiguous bf16 logits, got {logits.dtype}")
    rows, vocab = logits.shape
    if daq_t.dtype != E5M2 or not daq_t.is_contiguous() or daq_t.shape[0] != vocab or col0 + rows > daq_t.shape[1]:
        raise ValueError(f"daq_t must be a contiguous e5m2 ({vocab}, M) tensor with M >= col0 + {rows}, got "
                         f"{daq_t.dtype} {tuple(daq_t.shape)}, col0 {col0}")
    if lse_parts.dim() != 2 or lse_parts.shape[0] != rows:
        raise ValueError(f"the CE gradient pass takes (rows, n) log-sum-exp partials for its {rows} rows, got "
                         f"{tuple(lse_parts.shape)}")
    if loss_rows.shape != (rows,) or loss_rows.dtype != torch.float32 or not loss_rows.is_contiguous():
        raise ValueError(f"loss_rows must be a contiguous fp32 ({rows},) tensor, got {loss_rows.dtype} "
                         f"{tuple(loss_rows.shape)}")
    dev = logits.device
    parts, tgt_logit, rstd = lse_parts.float().contiguous(), tgt_logit.float(), rstd.float()
    acc = torch.empty((rows, nsplit), device=dev, dtype=torch.float32)
    corr = torch.empty(rows, device=dev, dtype=torch.float32)
    seed = corr if sr_seed is None else torch.as_tensor(sr_seed, dtype=torch.int64, device=dev).reshape(1)
    codes_t_kernel[(triton.cdiv(rows, rb), nsplit)](
        logits, parts, tgt_logit, targets, rstd, acc, loss_rows, rows, vocab, parts.shape[1], daq_t, daq_t.shape[1],
        col0, codes_inv.float().reshape(1), row0, seed, IGNORE=ignore_index, RB=rb, BV=bv, PB=128, NSPLIT=nsplit,
        FMAX=E5M2_MAX, SR=sr_seed is not None, DROP=SR_DROP, num_warps=num_warps)
    finish_kernel[(triton.cdiv(rows, 1024),)](acc, tgt_logit, targets, rstd, corr, rows, fp32_reciprocal(dim),
                                              IGNORE=ignore_index, NSPLIT=nsplit, BR=1024)
    return logits, corr
