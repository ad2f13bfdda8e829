"""F4's gradient pass in place: a Triton kernel that turns a chunk's logits into da = r * (softmax - onehot)
in the same buffer, and makes the row's B2 vector and loss term beside it.

The inductor program of the same arithmetic (``lm_head_ce._ce_grad_math``) reads the logits and writes da
to a buffer of its own: 3.1 ms a step at 1B (eight 2048-row chunks, one read and one write each), and
a second chunk-sized buffer alive at the LM head, where the step's memory peaks. Here one program per
row streams the row's logits in blocks: p = exp(l - lse), zdz's terms summed in fp32, da rounded to bf16
and stored over the logits it was made from (each element is read before the same program writes it).
Rows whose target is the ignore index get da = 0 and zdz = 0, as the reference. Same arithmetic as the
reference in fp32; the row sum's order differs, as any kernel's may (the GPU tests' derived bounds).

The same program also does the per-row work that ran as aten ops around it, about 19 launches a chunk:
the log-sum-exp fold of the GEMM epilogue's per-N-tile partials (``torch.logsumexp``'s: the max, zero
where infinite, the sum of exp(x - max), its log plus the max), the row's loss term (lse - target logit,
0 where ignored) and B2's row vector corr = -(r * r / d) * zdz (aten's division by a Python scalar: r * r
times the fp32 reciprocal of d; ``row_vectors.b2_vectors`` computes it the same way).

``ce_grad_e5m2`` is the same pass for the fp8 head (``lm_head_ce.lm_head_ce_fp8``): da's e5m2 codes at the
head's power-of-two scale into a buffer of their own (from da's fp32 value, not its bf16 rounding), zdz in
place of corr (the fp8 B2 takes zdz), the logits left as they are. ``ce_grad_inplace`` with ``codes_inv`` does
both in one read: the bf16 da in place with corr, and the codes (``fp8_lm_head_dw``), rounded stochastically
(``sr_seed``: ``scaling.quantize_e5m2_sr``'s bits, each element's counter its flat index in the whole batch, the
seed read on the device).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..scaling import E5M2, E5M2_MAX, SR_DROP
from .row_vectors import fp32_reciprocal


@triton.jit
def fold_lse(parts_ptr, row, NT, PBLOCK: tl.constexpr):
    """A row's log-sum-exp from its NT per-tile partials (``torch.logsumexp``'s fold: the max, zero where
    infinite, the sum of exp(x - max), its log plus the max)."""
    pcols = tl.arange(0, PBLOCK)
    parts = tl.load(parts_ptr + row.to(tl.int64) * NT + pcols, mask=pcols < NT, other=-float("inf"))
    pmax = tl.max(parts, axis=0)
    pmax = tl.where(tl.abs(pmax) == float("inf"), 0.0, pmax)
    return tl.log(tl.sum(tl.exp(parts - pmax), axis=0)) + pmax


@triton.jit
def lowbias32(x):
    """``scaling.lowbias32`` on uint32 words."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def sr_row_state(seed_ptr, grow, V):
    """(key, rbase) of the rows ``grow`` (their indices in the batch) for ``scaling.sr_words``: the seed's hash and
    each row's first counter, grow V mod 2^32."""
    key = lowbias32(tl.load(seed_ptr).to(tl.uint32))
    return key, (grow.to(tl.int64) * V).to(tl.uint32)


@triton.jit
def sr_word(key, rbase, cols):
    """``scaling.sr_words`` of the elements at columns ``cols`` of rows with ``sr_row_state``'s ``rbase``."""
    return lowbias32((rbase + cols.to(tl.uint32)) ^ key)


@triton.jit
def e5m2_sr(v, word, DROP: tl.constexpr):
    """fp32 v (saturated) stochastically rounded to e5m2 as ``scaling.quantize_e5m2_sr``: its low DROP bits plus
    the top DROP bits of its random uint32 ``word`` (``scaling.sr_words``), the carry kept, those bits cleared;
    exact in e5m2 from 2^-14 up (RNE below)."""
    rnd = word >> (32 - DROP)
    kept = (v.to(tl.uint32, bitcast=True) + rnd) & (0xFFFFFFFF ^ ((1 << DROP) - 1))
    return kept.to(tl.float32, bitcast=True).to(tl.float8e5, fp_downcast_rounding="rtne")


@triton.jit(do_not_specialize=["row0"])
def ce_grad_pass_kernel(logits_ptr, parts_ptr, tlogit_ptr, target_ptr, rstd_ptr, corr_ptr, loss_ptr, V, NT, inv_d,
                        daq_ptr, inv_ptr, tdelta_ptr, row0, seed_ptr, IGNORE: tl.constexpr, BLOCK: tl.constexpr,
                        PBLOCK: tl.constexpr, FP8: tl.constexpr, FMAX: tl.constexpr, CONSIST: tl.constexpr,
                        BOTH: tl.constexpr, SR: tl.constexpr, DROP: tl.constexpr, TGT: tl.constexpr):
    row = tl.program_id(0)
    lse = fold_lse(parts_ptr, row, NT, PBLOCK)
    base = logits_ptr + row.to(tl.int64) * V
    target = tl.load(target_ptr + row)
    valid = target != IGNORE
    rstd = tl.load(rstd_ptr + row)
    r = tl.where(valid, rstd, 0.0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    dat = tl.zeros([BLOCK], dtype=tl.float32)  # (CONSIST: the target's rounded da, where the row holds it; TGT: fp32)
    if SR:  # (once a row: the seed's hash and the row's first counter)
        key, rbase = sr_row_state(seed_ptr, row0 + row, V)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < V
        lf = tl.load(base + cols, mask=inside, other=0.0).to(tl.float32)
        p = tl.where(inside, tl.exp(lf - lse), 0.0)
        if not CONSIST:
            acc += p * lf
        da = (p - tl.where(cols == target, 1.0, 0.0)) * r
        if FP8:  # (the fp8 head: da's e5m2 codes from its fp32 value, into their own buffer)
            q = tl.clamp(da * tl.load(inv_ptr), -FMAX, FMAX)
            if SR:  # (each element's counter: its flat index in the batch, (row0 + row) V + col, mod 2^32)
                q8 = e5m2_sr(q, sr_word(key, rbase, cols), DROP)
            else:
                q8 = q.to(tl.float8e5, fp_downcast_rounding="rtne")
            tl.store(daq_ptr + row.to(tl.int64) * V + cols, q8, mask=inside)
            if TGT:  # (the target's da itself, unrounded: ``fp8_lm_head_dgrad`` adds its term to B2 in fp32)
                dat += tl.where(cols == target, da, 0.0)
        if not FP8 or BOTH:  # (BOTH: the codes and the bf16 da in place, the bf16 B2's corr)
            dab = da.to(tl.bfloat16, fp_downcast_rounding="rtne")
            tl.store(base + cols, dab, mask=inside)
            if CONSIST:  # (zdz of the rounded da B2 reads: sum l da / r, l the stored logits)
                daf = dab.to(tl.float32)
                acc += tl.where(inside, lf * daf, 0.0)
                dat += tl.where(cols == target, daf, 0.0)
    tlogit = tl.load(tlogit_ptr + row)
    if CONSIST:  # (the target's term on its unrounded logit: tdelta = l_t - its stored rounding)
        zdz = tl.sum(acc, axis=0) + tl.load(tdelta_ptr + row) * tl.sum(dat, axis=0)
        zdz = tl.where(valid, zdz / tl.where(valid, rstd, 1.0), 0.0)
    else:
        zdz = tl.where(valid, tl.sum(acc, axis=0) - tlogit, 0.0)
    if TGT:
        tl.store(corr_ptr + row, tl.sum(dat, axis=0))
    else:
        tl.store(corr_ptr + row, zdz if FP8 and not BOTH else -((rstd * rstd) * inv_d) * zdz)
    tl.store(loss_ptr + row, tl.where(valid, lse - tlogit, 0.0))


def ce_grad_inplace(logits: torch.Tensor, lse_parts: torch.Tensor, tgt_logit: torch.Tensor, targets: torch.Tensor,
                    rstd: torch.Tensor, ignore_index: int, dim: int, loss_rows: torch.Tensor | None = None,
                    block: int = 4096, num_warps: int = 8, tdelta: torch.Tensor | None = None,
                    codes_inv: torch.Tensor | None = None, sr_seed: torch.Tensor | int | None = None,
                    row0: int = 0) -> tuple[torch.Tensor, ...]:
    """(da, corr): da written over ``logits`` (rows, V) bf16 contiguous, and returned as that same tensor;
    corr (rows,) fp32, B2's row vector for width ``dim``. ``lse_parts`` (rows, n) fp32 are the row's
    log-sum-exp partials (a finished lse is its own single partial: (rows, 1)); tgt_logit, rstd (rows,) fp32,
    targets (rows,) integer. Each row's loss term (lse - target logit, 0 where ignored) goes to ``loss_rows``
    (rows,) fp32 when given. ``block`` columns per step of a row's program, ``num_warps`` per program
    (``scripts/probes/ce_pass.py`` times the choices). ``tdelta`` (rows,) fp32: zdz is then that of the
    rounded da the pass writes, sum_n l_n da_n / r over the stored logits, its target's term on l_t + tdelta (the
    unrounded target logit: ``CODA_TITAN_F4_ZDZ=consistent``; zeros: ``consistent_rounded``). ``codes_inv`` (0-dim
    or (1,) fp32; not with ``tdelta``): also da's e5m2 codes at that scale, as ``ce_grad_e5m2`` writes them, returned
    third (``fp8_lm_head_dw``: dW on the codes, B2 on the bf16 da); with ``sr_seed`` rounded stochastically
    (``scaling.quantize_e5m2_sr`` with that seed, a 0-dim integer tensor read on the device or an int; ``row0``:
    the chunk's first row in the batch, which the elements' counters count from)."""
    if codes_inv is not None and tdelta is not None:
        raise ValueError("the CE gradient pass writes e5m2 codes beside the bf16 da without tdelta only")
    if sr_seed is not None and codes_inv is None:
        raise ValueError("sr_seed rounds the e5m2 codes that codes_inv asks for")
    out = _ce_grad(logits, lse_parts, tgt_logit, targets, rstd, ignore_index, dim, loss_rows,
                   None if codes_inv is None else codes_inv.float().reshape(1), block, num_warps, tdelta,
                   both=codes_inv is not None, sr=(sr_seed, row0))
    return out if codes_inv is not None else out[:2]


def ce_grad_e5m2(logits: torch.Tensor, lse_parts: torch.Tensor, tgt_logit: torch.Tensor, targets: torch.Tensor,
                 rstd: torch.Tensor, inv_scale: torch.Tensor, ignore_index: int, loss_rows: torch.Tensor | None = None,
                 block: int = 4096, num_warps: int = 8, sr_seed: torch.Tensor | int | None = None,
                 row0: int = 0, target_da: bool = False, out: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """The fp8 head's pass: (daq, zdz), daq (rows, V) the e5m2 codes of da * ``inv_scale`` (0-dim or (1,) fp32;
    saturated, rounded to nearest even from da's fp32 value; with ``sr_seed`` and ``row0`` stochastically, as
    ``ce_grad_inplace``'s: ``fp8_lm_head_dgrad``'s codes, no bf16 da), zdz (rows,) fp32 (B2 fp8 takes zdz, not
    corr); the logits are read, not written. Otherwise ``ce_grad_inplace``. ``target_da`` (``fp8_lm_head_dgrad``): in
    place of zdz, each row's fp32 da at its target (0 where ignored), the term B2 adds unrounded; ``out``: the
    codes into that (rows, V) e5m2 contiguous buffer (a buffer kept across chunks), not a new one."""
    return _ce_grad(logits, lse_parts, tgt_logit, targets, rstd, ignore_index, 1, loss_rows,
                    inv_scale.float().reshape(1), block, num_warps, sr=(sr_seed, row0), tgt=target_da, out=out)


def _ce_grad(logits, lse_parts, tgt_logit, targets, rstd, ignore_index: int, dim: int, loss_rows, inv, block: int,
             num_warps: int, tdelta=None, both: bool = False, sr: tuple = (None, 0), tgt: bool = False, out=None):
    if logits.dtype != torch.bfloat16 or not logits.is_contiguous():
        raise ValueError(f"the CE gradient pass takes contiguous bf16 logits, got {logits.dtype}")
    rows, vocab = logits.shape
    if lse_parts.dim() != 2 or lse_parts.shape[0] != rows:
        raise ValueError(f"the CE gradient pass takes (rows, n) log-sum-exp partials for its {rows} rows, got "
                         f"{tuple(lse_parts.shape)}")
    corr = torch.empty(rows, device=logits.device, dtype=torch.float32)
    loss_rows = torch.empty_like(corr) if loss_rows is None else loss_rows
    if loss_rows.shape != (rows,) or loss_rows.dtype != torch.float32 or not loss_rows.is_contiguous():
        raise ValueError(f"loss_rows must be a contiguous fp32 ({rows},) tensor, got {loss_rows.dtype} "
                         f"{tuple(loss_rows.shape)}")
    parts = lse_parts.float().contiguous()
    inv_d = fp32_reciprocal(dim)
    fp8 = inv is not None
    daq = torch.empty((rows, vocab) if fp8 else (0,), device=logits.device, dtype=E5M2) if out is None else out
    if out is not None and (out.shape != (rows, vocab) or out.dtype != E5M2 or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous e5m2 ({rows}, {vocab}) buffer, got {out.dtype} {tuple(out.shape)}")
    consist = tdelta is not None and not fp8
    if consist and tdelta.shape != (rows,):
        raise ValueError(f"tdelta must be ({rows},), got {tuple(tdelta.shape)}")
    ce_grad_pass_kernel[(rows,)](logits, parts, tgt_logit.float(), targets, rstd.float(), corr, loss_rows, vocab,
                                 parts.shape[1], inv_d, daq, inv if fp8 else corr,
                                 tdelta.float().contiguous() if consist else corr, sr[1],
                                 corr if sr[0] is None else torch.as_tensor(sr[0], dtype=torch.int64,
                                                                            device=logits.device).reshape(1),
                                 IGNORE=ignore_index, BLOCK=block,
                                 PBLOCK=triton.next_power_of_2(parts.shape[1]), FP8=fp8, FMAX=E5M2_MAX,
                                 CONSIST=consist, BOTH=both, SR=sr[0] is not None, DROP=SR_DROP, TGT=tgt,
                                 num_warps=num_warps)
    return (logits, corr, daq) if both else ((daq if fp8 else logits), corr)
