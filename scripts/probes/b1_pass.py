"""Probe (GPU): B1's Triton pass (``kernels/cute/rope_bwd_pass.py``: ROWS token rows a program, each row in
blocks of CH columns, each element's pair partner loaded again, the cos / sin tables gathered per element) at
the (CH, ROWS, warps) shapes of ``SHAPES``: (4096, 1, 8) is the pass as it was until the forty-first session
(one power-of-two block of the 3072-column row), ``rope_bwd_pass.SHAPE`` the one it ships with; against a
rewrite tried and dropped in the twenty-sixth session (kept here, ``_heads_kernel``): a program per row over
blocks of whole heads, each pair split from its partner in registers, the table row loaded once and shared by
every head (4 warps; 2 and 8 were slower). The 1B shape, bf16 and fp8 (the e5m2 codes and row amax). Each
launch is the kernel's own (no ``wrap_triton``, whose eager dispatch made the host, not the GPU, the measure).

    source .gpu/part2/activate.sh && python3 -m scripts.probes.b1_pass        (gpu_train.sh b1probe)

Each variant's da, codes and amax are compared bit for bit with the (4096, 1, 8) pass's, zdz by its largest
relative difference (another summation order). Timing: 20 calls enqueued back to back after 3 warm-up
calls, GPU ms per call, in 5 alternations of the variants (``epi_stages._streamed``), beside the time
reading dy and y and writing da (and the codes) would take at ``BANDWIDTH_TBS``. Writes
``$OUT/probe_b1_pass_<gpu>.json``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from coda_titan.kernels.scaling import E5M2_MAX
from scripts.bench.common import header, log_row, out_json
from scripts.probes.epi_stages import _streamed
from scripts.probes.rope_bwd import HD, HKV, M, ROT, H, _tables

BANDWIDTH_TBS = 3.35  # (the H100 SXM's HBM3, its data sheet's figure)


@triton.jit
def _heads_kernel(dy_ptr, y_ptr, rstd_ptr, cos_ptr, sin_ptr, inv_ptr, da_ptr, zdz_ptr, daq_ptr, amax_ptr, seqlen,
            Q: tl.constexpr, ROT: tl.constexpr, HALF: tl.constexpr, HEADS: tl.constexpr, FP8: tl.constexpr,
            FMAX: tl.constexpr):
    row = tl.program_id(0)
    base = row.to(tl.int64) * Q
    pos = row % seqlen
    pair = tl.arange(0, HALF)
    c = tl.load(cos_ptr + pos * HALF + pair)[None, :]  # (one table row, shared by every head)
    s = tl.load(sin_ptr + pos * HALF + pair)[None, :]
    r = tl.load(rstd_ptr + row)
    head = tl.arange(0, HEADS)
    # the element (head, pair, e) of a block of HEADS heads sits at column head 2 HALF + 2 pair + e
    offs = head[:, None, None] * (2 * HALF) + pair[None, :, None] * 2 + tl.arange(0, 2)[None, None, :]
    zdz = tl.zeros([HEADS, HALF, 2], tl.float32)
    amax = tl.zeros([HEADS, HALF, 2], tl.float32)
    for b in tl.static_range(Q // (2 * HALF * HEADS)):
        cols = base + b * (2 * HALF * HEADS) + offs
        dy = tl.load(dy_ptr + cols).to(tl.float32)
        zdz += tl.load(y_ptr + cols).to(tl.float32) * dy
        x0, x1 = tl.split(dy)  # (the pair (x0, x1) rotated back: (x0 c + x1 s, x1 c - x0 s); v heads pass through)
        rope = (b * HEADS + head)[:, None] < ROT // (2 * HALF)
        da = tl.join(tl.where(rope, x0 * c + x1 * s, x0), tl.where(rope, x1 * c - x0 * s, x1)) * r
        tl.store(da_ptr + cols, da.to(tl.bfloat16, fp_downcast_rounding="rtne"))
        if FP8:
            amax = tl.maximum(amax, tl.abs(da))
            q = tl.clamp(da * tl.load(inv_ptr), -FMAX, FMAX)
            tl.store(daq_ptr + cols, q.to(tl.float8e5, fp_downcast_rounding="rtne"))
    tl.store(zdz_ptr + row, tl.sum(tl.reshape(zdz, [2 * HALF * HEADS]), axis=0))
    if FP8:
        tl.store(amax_ptr + row, tl.max(tl.reshape(amax, [2 * HALF * HEADS]), axis=0))


# (columns a block, rows a program, warps) of the shipped kernel timed: the earlier pass (one power-of-two block
# of the row, 8 warps), its shipped shape (``rope_bwd_pass.SHAPE``) and the other candidates of the forty-first session
SHAPES = ((4096, 1, 8), (4096, 1, 4), (4096, 1, 16), (1024, 1, 2), (1024, 1, 4), (1024, 1, 8), (1024, 2, 4),
          (1024, 2, 8), (512, 1, 2), (512, 4, 8))


def _shape_launch(dy, y, rstd, cos, sin, rot: int, inv, shape):
    from coda_titan.kernels.cute.rope_bwd_pass import _launch

    return _launch(dy, y, rstd, cos, sin, rot, inv, shape, wrap=lambda k: k)


def heads_per_block(q: int, half: int) -> int:
    """Heads per block of the pass: the largest power of two (at most 8) that divides the row's head count."""
    heads = q // (2 * half)
    return min(heads & -heads, 8)


def _heads_launch(dy, y, rstd, cos, sin, rot: int, inv, num_warps: int = 4):
    from coda_titan.kernels.cute.rope_bwd_pass import outputs

    m, q = dy.shape
    fp8 = inv is not None
    da, zdz, daq, amax = outputs(dy, fp8)
    half = cos.shape[1]
    _heads_kernel[(m,)](dy, y, rstd, cos, sin, inv if fp8 else rstd, da, zdz, daq, amax, cos.shape[0],
                                Q=q, ROT=rot, HALF=half, HEADS=heads_per_block(q, half), FP8=fp8,
                                FMAX=E5M2_MAX, num_warps=num_warps)
    return da, zdz, daq, amax


def _variants(inv):
    out = {}
    for fp8 in (False, True):
        sfx = "_fp8" if fp8 else ""
        scale = inv if fp8 else None
        for sh in SHAPES:
            out["chunk{}_r{}_w{}{}".format(*sh, sfx)] = (lambda dy, y, r, c, s, scale=scale, sh=sh:
                                                         _shape_launch(dy, y, r, c, s, ROT, scale, sh))
        out[f"heads_w4{sfx}"] = lambda dy, y, r, c, s, scale=scale: _heads_launch(dy, y, r, c, s, ROT, scale, 4)
    return out


def _compare(got, want) -> dict:
    (da, zdz, daq, amax), (da0, zdz0, daq0, amax0) = got, want
    return {"da_equal": torch.equal(da, da0), "codes_equal": torch.equal(daq.view(torch.uint8), daq0.view(torch.uint8)),
            "amax_equal": torch.equal(amax, amax0),
            "zdz_max_rel_diff": float(((zdz - zdz0).abs() / zdz0.abs().clamp_min(1e-30)).max())}


def main() -> int:
    q = (H + 2 * HKV) * HD
    doc = {**header(), "kind": "probe_b1_pass", "shape": {"tokens": M, "columns": q, "rotated": ROT, "head_dim": HD},
           "timing": "GPU ms per call of 20 enqueued back to back after 3 warm-up calls, in 5 alternations of the variants",
           "bandwidth_tbs": BANDWIDTH_TBS, "rows": []}
    path = out_json("probe_b1_pass")
    g = torch.Generator(device="cuda").manual_seed(0)
    dy = (torch.randn(M, q, device="cuda", generator=g) * 1e-3).to(torch.bfloat16)
    y = torch.randn(M, q, device="cuda", generator=g).to(torch.bfloat16)
    rstd = torch.rand(M, device="cuda", generator=g) + 0.5
    cos, sin = _tables("cuda")
    inv = torch.tensor([2.0 ** 20], device="cuda")
    fns = _variants(inv)
    args = (dy, y, rstd, cos, sin)
    want = {fp8: fns["chunk4096_r1_w8_fp8" if fp8 else "chunk4096_r1_w8"](*args) for fp8 in (False, True)}
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(5):
        for k, f in fns.items():
            times[k].append(_streamed(lambda f=f: f(*args))["gpu_ms"])
    for k, f in fns.items():
        fp8 = k.endswith("_fp8")
        moved = M * q * (2 + 2 + 2 + (1 if fp8 else 0))  # (dy and y read, da written, the codes)
        ts = sorted(times[k])
        row = {"variant": k, "gpu_ms": times[k], "median_ms": ts[len(ts) // 2],
               "memory_ms": moved / (BANDWIDTH_TBS * 1e9), **_compare(f(*args), want[fp8])}
        log_row(doc, "rows", row, path)
    print("wrote", path, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
