"""Probe (GPU): B1 reading FlashAttention-4's fp32 gradient accumulators in place of the bf16 dq, dk, dv its
backward's three postprocess kernels write, at the 1B's shapes (batch 2, seq 8192, 32 query and 8 key/value
heads of 64, causal; fp8's B1: da, zdz, e5m2 codes at a delayed scale, row amax).

    source .gpu/part2/activate.sh && python3 -m scripts.probes.b1_accum        (gpu_train.sh b1accum)

The accumulators' order (``probe_fa4_accum_layout_…json``): (batch, head) blocks, tiles of 128 rows x 64 columns,
inside a tile offset(r, c) = c0 + 2 r3 + 4 c1 + 8 c2 + 16 r0 + 32 r1 + 64 r2 + 128 r4 + 256 r5 + 512 c3 + 1024 c4
+ 2048 c5 + 4096 r6. ``rope_bwd_accum_kernel`` is B1's pass (``kernels/cute/rope_bwd_pass.py``) reading them: each
value times its scale rounded to bf16 (the postprocess's dq, dk, dv), so da, the codes and the amax are meant to
be the configured pass's bits (zdz sums in another order). Arms, each one CUDA graph at the cap, ``ROUNDS``
rounds: ``post_b1`` (the three postprocess calls and the configured pass), ``fused`` (this kernel, and
``fused_r*_w*`` at other block shapes), ``tiles`` (``rope_bwd_tile_kernel``: each tile read in its storage order,
whole, and put in token order by a permute of its address bits); the outputs compared. Built into the model and
measured level in the step (forty-seventh session, docs/history.md). Writes ``$OUT/probe_b1_accum_<gpu>.json``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from coda_titan.kernels.scaling import E5M2, E5M2_MAX

B, S, HQ, HKV, D = 2, 8192, 32, 8, 64
ROWS = 16  # (tokens a program: rows 0-15 of a tile cover offset bits 1 and 4-6, so 512-byte runs are read whole)
SECONDS, ROUNDS = 1.5, 3
SHAPES = ((16, 8), (32, 8), (64, 8), (32, 4))  # (rows, warps) beside ROWS with 4 warps


@triton.jit
def rope_bwd_accum_kernel(dq_ptr, dk_ptr, dv_ptr, y_ptr, rstd_ptr, cos_ptr, sin_ptr, inv_ptr, da_ptr, zdz_ptr, daq_ptr,
                          amax_ptr, scale_qk, S, s_y, HQ: tl.constexpr, HKV: tl.constexpr, HD: tl.constexpr,
                          HALF: tl.constexpr, ROWS: tl.constexpr, FP8: tl.constexpr, FMAX: tl.constexpr):
    m0 = tl.program_id(0) * ROWS
    b, s0 = m0 // S, m0 % S
    rows = m0 + tl.arange(0, ROWS)
    rr = ((s0 % 128) + tl.arange(0, ROWS))[:, None]  # (the rows in their 128-row tile)
    c = tl.arange(0, HD)[None, :]
    off = ((c & 1) | (((rr >> 3) & 1) << 1) | (((c >> 1) & 1) << 2) | (((c >> 2) & 1) << 3) | ((rr & 7) << 4)
           | (((rr >> 4) & 3) << 7) | (((c >> 3) & 7) << 9) | (((rr >> 6) & 1) << 12))
    tile = (s0 // 128) * (128 * HD)
    r = tl.load(rstd_ptr + rows)[:, None]
    pos = (rows % S)[:, None]
    cs = tl.load(cos_ptr + pos * HALF + c // 2)
    sn = tl.load(sin_ptr + pos * HALF + c // 2)
    even = (c % 2) == 0
    rows64 = rows.to(tl.int64)[:, None]
    Q: tl.constexpr = (HQ + 2 * HKV) * HD
    zdz = tl.zeros([ROWS, HD], tl.float32)
    amax = tl.zeros([ROWS, HD], tl.float32)
    for hh in tl.static_range(HQ + 2 * HKV):
        if hh < HQ:
            base = dq_ptr + (b * HQ + hh).to(tl.int64) * S * HD + tile
        elif hh < HQ + HKV:
            base = dk_ptr + (b * HKV + hh - HQ).to(tl.int64) * S * HD + tile
        else:
            base = dv_ptr + (b * HKV + hh - HQ - HKV).to(tl.int64) * S * HD + tile
        if hh < HQ + HKV:
            dy = (tl.load(base + off) * scale_qk).to(tl.bfloat16, fp_downcast_rounding="rtne").to(tl.float32)
            partner = (tl.load(base + (off ^ 1)) * scale_qk).to(tl.bfloat16, fp_downcast_rounding="rtne").to(tl.float32)
            da = tl.where(even, dy * cs + partner * sn, dy * cs - partner * sn) * r
        else:
            dy = tl.load(base + off).to(tl.bfloat16, fp_downcast_rounding="rtne").to(tl.float32)
            da = dy * r
        n = hh * HD + c
        zdz += tl.load(y_ptr + rows64 * s_y + n).to(tl.float32) * dy
        tl.store(da_ptr + rows64 * Q + n, da.to(tl.bfloat16, fp_downcast_rounding="rtne"))
        if FP8:
            amax = tl.maximum(amax, tl.abs(da))
            q = tl.clamp(da * tl.load(inv_ptr), -FMAX, FMAX)
            tl.store(daq_ptr + rows64 * Q + n, q.to(tl.float8e5, fp_downcast_rounding="rtne"))
    tl.store(zdz_ptr + rows, tl.sum(zdz, axis=1))
    if FP8:
        tl.store(amax_ptr + rows, tl.max(amax, axis=1))


def launch(dq_acc, dk_acc, dv_acc, y, rstd, cos, sin, inv, scale_qk: float, s: int, hq: int, hkv: int, hd: int,
           rows: int = ROWS, warps: int = 4):
    """(da bf16 (M, Q), zdz (M,), daq e5m2 (M, Q), row amax (M,)) of B1 from the accumulators; ``rows`` tokens a
    program (dividing 128), ``warps`` a program."""
    m, q = y.shape
    da = torch.empty((m, q), device=y.device, dtype=torch.bfloat16)
    daq = torch.empty((m, q), device=y.device, dtype=E5M2)
    zdz, amax = (torch.empty(m, device=y.device, dtype=torch.float32) for _ in range(2))
    rope_bwd_accum_kernel[(triton.cdiv(m, rows),)](
        dq_acc, dk_acc, dv_acc, y, rstd, cos, sin, inv, da, zdz, daq, amax, scale_qk, s, y.stride(0), HQ=hq, HKV=hkv,
        HD=hd, HALF=hd // 2, ROWS=rows, FP8=True, FMAX=E5M2_MAX, num_warps=warps)
    return da, zdz, daq, amax


@triton.jit
def rope_bwd_tile_kernel(acc_ptr, y_ptr, rstd_ptr, cos_ptr, sin_ptr, inv_ptr, da_ptr, zpart_ptr, daq_ptr, apart_ptr,
                         scale, S, s_y, H, HEAD0: tl.constexpr, NHEADS: tl.constexpr, Q: tl.constexpr,
                         ROPE: tl.constexpr, FMAX: tl.constexpr):
    """One (batch, 128-token tile, head) of one accumulator (columns 64 (HEAD0 + head) on), read in its storage
    order (32 KB contiguous) and put in (token, column) order by a reshape and a permute of its address bits:
    (r6, c5-c3, r5-r4, r2-r0, c2-c1, r3, c0) -> (r6, r5-r4, r3, r2-r0, c5-c3, c2-c1, c0). Writes da and its codes,
    and this head's zdz partial per token (zpart, M x NHEADS) and amax (apart, one per program)."""
    t, h = tl.program_id(0), tl.program_id(1)
    nt = S // 128
    b, ti = t // nt, t % nt
    x = tl.load(acc_ptr + (b * H + h).to(tl.int64) * S * 64 + ti * 8192 + tl.arange(0, 8192))
    x = tl.reshape(tl.permute(tl.reshape(x, (2, 8, 4, 8, 4, 2, 2)), (0, 2, 5, 3, 1, 4, 6)), (128, 32, 2))
    x = (x * scale).to(tl.bfloat16, fp_downcast_rounding="rtne").to(tl.float32)  # (the postprocess's bf16 dy)
    x0, x1 = tl.split(x)  # (each token's (even, odd) column pairs: a RoPE pair)
    pos = ti * 128 + tl.arange(0, 128)
    rows = (b * S + pos).to(tl.int64)
    r = tl.load(rstd_ptr + rows)[:, None]
    if ROPE:
        pair = tl.arange(0, 32)[None, :]
        cs = tl.load(cos_ptr + pos[:, None] * 32 + pair)
        sn = tl.load(sin_ptr + pos[:, None] * 32 + pair)
        da = tl.reshape(tl.join((x0 * cs + x1 * sn) * r, (x1 * cs - x0 * sn) * r), (128, 64))
    else:
        da = tl.reshape(tl.join(x0 * r, x1 * r), (128, 64))
    cols = (HEAD0 + h) * 64 + tl.arange(0, 64)[None, :]
    y = tl.load(y_ptr + rows[:, None] * s_y + cols).to(tl.float32)
    tl.store(zpart_ptr + rows * NHEADS + HEAD0 + h, tl.sum(y * tl.reshape(x, (128, 64)), axis=1))
    tl.store(da_ptr + rows[:, None] * Q + cols, da.to(tl.bfloat16, fp_downcast_rounding="rtne"))
    q = tl.clamp(da * tl.load(inv_ptr), -FMAX, FMAX)
    tl.store(daq_ptr + rows[:, None] * Q + cols, q.to(tl.float8e5, fp_downcast_rounding="rtne"))
    tl.store(apart_ptr + t * NHEADS + HEAD0 + h, tl.max(tl.max(tl.abs(da), axis=1), axis=0))


def launch_tiles(dq_acc, dk_acc, dv_acc, y, rstd, cos, sin, inv, scale_qk: float, s: int, hq: int, hkv: int,
                 hd: int, warps: int = 8):
    """``launch``'s da, zdz and codes from ``rope_bwd_tile_kernel`` (head dim 64, 128-token tiles), and amax |da| over
    the tensor (0-dim, what the op returns): one launch per accumulator, then zdz and the amax folded over heads
    (torch; zdz in another order than the row pass's)."""
    assert hd == 64 and s % 128 == 0
    m, q = y.shape
    nh = hq + 2 * hkv
    da = torch.empty((m, q), device=y.device, dtype=torch.bfloat16)
    daq = torch.empty((m, q), device=y.device, dtype=E5M2)
    zpart = torch.empty((m, nh), device=y.device, dtype=torch.float32)
    apart = torch.empty((m // 128, nh), device=y.device, dtype=torch.float32)
    for acc, heads, head0, rope, sc in ((dq_acc, hq, 0, True, scale_qk), (dk_acc, hkv, hq, True, scale_qk),
                                        (dv_acc, hkv, hq + hkv, False, 1.0)):
        rope_bwd_tile_kernel[(m // 128, heads)](acc, y, rstd, cos, sin, inv, da, zpart, daq, apart, sc, s, y.stride(0),
                                                heads, HEAD0=head0, NHEADS=nh, Q=q, ROPE=rope, FMAX=E5M2_MAX,
                                                num_warps=warps)
    return da, zpart.sum(1), daq, apart.amax()


def _bytes_apart(a, b) -> int:
    return int((a.reshape(-1).view(torch.uint8) != b.reshape(-1).view(torch.uint8)).sum())


def main():
    from torchtitan.models.llama3.model.args import RoPEScalingArgs

    from coda_titan.kernels.cute import rope_bwd_pass
    from coda_titan.kernels.cute.norm_rope import _cos_sin
    from coda_titan.model.rope import rope_freqs
    from scripts.bench.common import arms_at_cap, header, log_row, out_json
    from scripts.probes.fa4_accum_layout import backward_with_postprocess_calls

    q, k, v, (dq, dk, dv), calls, orig = backward_with_postprocess_calls()
    gen = torch.Generator(device="cuda").manual_seed(1)
    scale = D ** -0.5
    m = B * S
    y = torch.cat([q.reshape(m, -1), k.reshape(m, -1), v.reshape(m, -1)], 1)
    dy = torch.cat([dq.reshape(m, -1), dk.reshape(m, -1), dv.reshape(m, -1)], 1)
    rstd = torch.rand(m, device="cuda", generator=gen) + 0.5
    cos, sin = _cos_sin(rope_freqs(D, 500000.0, RoPEScalingArgs()).cuda(), S)
    inv = torch.full((1,), 2.0 ** 14, device="cuda")
    rot = (HQ + HKV) * D
    (acc_q, *_), (acc_k, *_), (acc_v, *_) = calls

    def post_b1():
        for call in calls:
            orig(call[0], call[1], call[2], *call[3], **call[4])
        return rope_bwd_pass._launch(dy, y, rstd, cos, sin, rot, inv, wrap=lambda kern: kern)

    def fused():
        return launch(acc_q, acc_k, acc_v, y, rstd, cos, sin, inv, scale, S, HQ, HKV, D)

    want, got = post_b1(), fused()
    doc = {**header(), "kind": "probe_b1_accum", "shapes": {"B": B, "S": S, "HQ": HQ, "HKV": HKV, "D": D},
           "rows_a_program": ROWS, "seconds": SECONDS,
           "bytes_apart": {"da": _bytes_apart(got[0], want[0]), "daq": _bytes_apart(got[2], want[2]),
                           "amax": _bytes_apart(got[3], want[3])},
           "zdz_max_rel": float(((got[1] - want[1]).abs() / want[1].abs().clamp(min=1e-30)).max()), "rows": []}
    path = out_json("probe_b1_accum")
    arms = {"post_b1": post_b1, "fused": fused, "b1": lambda: rope_bwd_pass._launch(dy, y, rstd, cos, sin, rot, inv,
                                                                                   wrap=lambda kern: kern)}
    tiles = launch_tiles(acc_q, acc_k, acc_v, y, rstd, cos, sin, inv, scale, S, HQ, HKV, D)
    doc["tiles_bytes_apart"] = {"da": _bytes_apart(tiles[0], want[0]), "daq": _bytes_apart(tiles[2], want[2]),
                                "amax": _bytes_apart(tiles[3].reshape(1), want[3].amax().reshape(1))}
    arms["tiles"] = lambda: launch_tiles(acc_q, acc_k, acc_v, y, rstd, cos, sin, inv, scale, S, HQ, HKV, D)
    for rows, warps in SHAPES:
        arms[f"fused_r{rows}_w{warps}"] = lambda rows=rows, warps=warps: launch(
            acc_q, acc_k, acc_v, y, rstd, cos, sin, inv, scale, S, HQ, HKV, D, rows, warps)
    arms_at_cap(doc, arms, path, SECONDS, ROUNDS)
    keys = ("median_ms_", "bytes_apart", "tiles", "zdz")
    log_row(doc, "rows", {"summary": {k2: v2 for k2, v2 in doc.items() if k2.startswith(keys)}}, path)


if __name__ == "__main__":
    main()
