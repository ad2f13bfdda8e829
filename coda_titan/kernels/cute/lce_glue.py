"""F4's glue between its first GEMM and its two gradient GEMMs on the scaled-exp path (``lm_head_ce``).

The first GEMM (``epilogues.rstd_scaled_exp_target_epi``) leaves, per chunk row i and n-tile t of the
vocabulary: E = bf16(2^(z log2 e - k_t)) (no logits), the integer offsets k_t, S_t = sum_t E and
Z_t = sum_t z E (fp32, before E's rounding), and the target's z_y. With k_r = max_t k_t and
s = sum_t 2^(k_t - k_r) S_t (so that e^L = 2^k_r s):

    L = k_r ln 2 + ln s;   loss_i = L - z_y;   p_n = v u_t E_n with v = 1 / s, u_t = 2^(k_t - k_r)
    zdz = sum_n z_n (p_n - onehot_n) = v sum_t u_t Z_t - z_y
    E[y] <- (p_y - 1) / (v u_ty) = (e^(z_y - L) - 1) s 2^(k_r - k_ty)   (the onehot, in place)

so that da = r (p - onehot) = (r v) (u * E) row by row: the dX GEMM reads E through the strip of u and
scales by rv = r v in its epilogue (with corr = -(r^2 / d) zdz, the final norm's backward); the dW GEMM
reads E^T through the same strip and xs = bf16(rv * H) as its other operand. Rows whose target is the
ignore index get loss 0, rv 0, corr 0 and xs 0 (E untouched). u is an exact power of two (integer k).
Limit: a target whose n-tile maximum lies over ~110 powers of two (76 logit units) below its row's
maximum would not fit E's bf16 range; no trained model's logits come near.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rows(k_ptr, se_ptr, sz_ptr, zy_ptr, target_ptr, rstd_ptr, h_ptr, e_ptr, loss_ptr, kr_ptr, rv_ptr, corr_ptr, xs_ptr,
          T, D, V, inv_d, IGNORE: tl.constexpr, TILE_N1: tl.constexpr, BLOCK_T: tl.constexpr,
          BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    tiles = tl.arange(0, BLOCK_T)
    inside = tiles < T
    k = tl.load(k_ptr + row * T + tiles, mask=inside, other=float("-inf"))
    k_r = tl.max(k, axis=0)
    u = tl.where(inside, tl.exp2(k - k_r), 0.0)
    s = tl.sum(tl.load(se_ptr + row * T + tiles, mask=inside, other=0.0) * u, axis=0)
    zp = tl.sum(tl.load(sz_ptr + row * T + tiles, mask=inside, other=0.0) * u, axis=0) / s  # sum_n z_n p_n
    lse = k_r * 0.6931471805599453 + tl.log(s)  # (ln 2)
    target = tl.load(target_ptr + row)
    valid = target != IGNORE
    zy = tl.load(zy_ptr + row, mask=valid, other=0.0)
    r = tl.load(rstd_ptr + row)
    rv = tl.where(valid, r / s, 0.0)
    tl.store(loss_ptr + row, tl.where(valid, lse - zy, 0.0))
    tl.store(kr_ptr + row, k_r)
    tl.store(rv_ptr + row, rv)
    tl.store(corr_ptr + row, tl.where(valid, -(r * r * inv_d) * (zp - zy), 0.0))
    col = tl.where(valid, target, 0)
    k_y = tl.load(k_ptr + row * T + col // TILE_N1, mask=valid, other=0.0)
    fix = (tl.exp(zy - lse) - 1.0) * s * tl.exp2(k_r - k_y)
    tl.store(e_ptr + row.to(tl.int64) * V + col, fix.to(tl.bfloat16, fp_downcast_rounding="rtne"), mask=valid)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        h = tl.load(h_ptr + row.to(tl.int64) * D + cols, mask=cols < D, other=0.0).to(tl.float32)
        tl.store(xs_ptr + row.to(tl.int64) * D + cols, (h * rv).to(tl.bfloat16, fp_downcast_rounding="rtne"),
                 mask=cols < D)


@triton.jit
def _strip(k_ptr, kr_ptr, u_ptr, M, T, REP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr):
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    tiles = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask = (rows[:, None] < M) & (tiles[None, :] < T)
    k = tl.load(k_ptr + rows[:, None] * T + tiles[None, :], mask=mask, other=0.0)
    k_r = tl.load(kr_ptr + rows, mask=rows < M, other=0.0)
    u = tl.trans(tl.exp2(k - k_r[:, None]).to(tl.bfloat16))  # (BLOCK_T, BLOCK_M): stores run along the rows
    for j in tl.static_range(REP):  # the strip is per 64 vocabulary columns: REP of them per n-tile
        tl.store(u_ptr + (tiles[:, None] * REP + j) * M + rows[None, :], u, mask=tl.trans(mask))


def scaled_exp_glue(k: torch.Tensor, sum_exp: torch.Tensor, sum_ze: torch.Tensor, z_y: torch.Tensor,
                    targets: torch.Tensor, rstd: torch.Tensor, h: torch.Tensor, e: torch.Tensor, tile_n1: int,
                    ignore_index: int):
    """(loss per row, rv, corr, xs, strip) of one chunk; E's target column fixed in place. k, sum_exp,
    sum_ze (rows, V / tile_n1) fp32; z_y, rstd (rows,) fp32; targets (rows,) int; h (rows, d) bf16; e (rows, V)
    bf16 contiguous. strip: (V / 64, rows) bf16, u for each 64 vocabulary columns and row."""
    rows, tiles = k.shape
    d, vocab = h.shape[1], e.shape[1]
    f32 = dict(device=h.device, dtype=torch.float32)
    loss, k_r, rv, corr = (torch.empty(rows, **f32) for _ in range(4))
    xs = torch.empty_like(h)
    strip = torch.empty((vocab // 64, rows), device=h.device, dtype=torch.bfloat16)
    _rows[(rows,)](k, sum_exp, sum_ze, z_y, targets, rstd, h, e, loss, k_r, rv, corr, xs, tiles, d, vocab, 1.0 / d,
                   IGNORE=ignore_index, TILE_N1=tile_n1, BLOCK_T=triton.next_power_of_2(tiles), BLOCK_D=512,
                   num_warps=4)
    _strip[(triton.cdiv(tiles, 32), triton.cdiv(rows, 64))](k, k_r, strip, rows, tiles, REP=tile_n1 // 64,
                                                             BLOCK_M=64, BLOCK_T=32, num_warps=4)
    return loss, rv, corr, xs, strip
