"""Probe (GPU): B1's Triton pass (``kernels/cute/rope_bwd_pass.py``) as it is now, a program per token row over
blocks of whole heads (each pair split from its partner in registers, the cos / sin table row loaded once
and shared by every head), against the twenty-fourth session's pass that it replaced (a program per row
over one power-of-two block of the row, each element's partner loaded again and the tables gathered per
element; copied here as ``_row_kernel``), at the 1B shape, bf16 and fp8 (the e5m2 codes and row amax).

    source .gpu/part2/activate.sh && python3 -m scripts.probes.b1_pass        (gpu_train.sh b1probe)

Each variant's da, codes and amax are compared bit for bit with the row kernel's, zdz by its largest
relative difference (another summation order). Timing: 20 calls enqueued back to back after 3 warm-up
calls, GPU ms per call, in 5 alternations of the variants (``epi_stages._streamed``), beside the time
reading dy and y and writing da (and the codes) would take at ``BANDWIDTH_TBS``. Writes
``$OUT/probe_b1_pass_<gpu>.json``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from coda_titan.kernels.scaling import E5M2, E5M2_MAX
from scripts.bench.common import header, log_row, out_json
from scripts.probes.epi_stages import _streamed
from scripts.probes.rope_bwd import HD, HKV, M, ROT, H, _tables

BANDWIDTH_TBS = 3.35  # (the H100 SXM's HBM3, its data sheet's figure)


@triton.jit
def _row_kernel(dy_ptr, y_ptr, rstd_ptr, cos_ptr, sin_ptr, inv_ptr, da_ptr, zdz_ptr, daq_ptr, amax_ptr, seqlen,
            Q: tl.constexpr, ROT: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr, FP8: tl.constexpr,
            FMAX: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < Q
    base = row.to(tl.int64) * Q
    dy = tl.load(dy_ptr + base + cols, mask=inside, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + base + cols, mask=inside, other=0.0).to(tl.float32)
    zdz = tl.sum(y * dy, axis=0)
    partner = tl.load(dy_ptr + base + (cols ^ 1), mask=inside, other=0.0).to(tl.float32)
    rope = inside & (cols < ROT)
    pair = (cols % (2 * HALF)) // 2
    pos = row % seqlen
    c = tl.load(cos_ptr + pos * HALF + pair, mask=rope, other=1.0)
    s = tl.load(sin_ptr + pos * HALF + pair, mask=rope, other=0.0)
    # (x0 c + x1 s, x1 c - x0 s) for the pair (x0, x1): the element is x0 at even columns, x1 at odd
    back = tl.where((cols % 2) == 0, dy * c + partner * s, dy * c - partner * s)
    da = tl.where(rope, back, dy) * tl.load(rstd_ptr + row)
    tl.store(da_ptr + base + cols, da.to(tl.bfloat16, fp_downcast_rounding="rtne"), mask=inside)
    tl.store(zdz_ptr + row, zdz)
    if FP8:
        tl.store(amax_ptr + row, tl.max(tl.where(inside, tl.abs(da), 0.0), axis=0))
        q = tl.clamp(da * tl.load(inv_ptr), -FMAX, FMAX)
        tl.store(daq_ptr + base + cols, q.to(tl.float8e5, fp_downcast_rounding="rtne"), mask=inside)


def _row_launch(dy, y, rstd, cos, sin, rot: int, inv):
    m, q = dy.shape
    da = torch.empty_like(dy)
    zdz = torch.empty(m, device=dy.device, dtype=torch.float32)
    fp8 = inv is not None
    daq = torch.empty((m, q) if fp8 else (0,), device=dy.device, dtype=E5M2)
    amax = torch.empty(m if fp8 else 0, device=dy.device, dtype=torch.float32)
    _row_kernel[(m,)](dy, y, rstd, cos, sin, inv if fp8 else rstd, da, zdz, daq, amax, cos.shape[0],
                                Q=q, ROT=rot, HALF=cos.shape[1], BLOCK=triton.next_power_of_2(q), FP8=fp8,
                                FMAX=E5M2_MAX, num_warps=8)
    return da, zdz, daq, amax



def _variants(inv):
    from coda_titan.kernels.cute.rope_bwd_pass import _launch

    out = {}
    for fp8 in (False, True):
        sfx = "_fp8" if fp8 else ""
        scale = inv if fp8 else None
        out[f"row{sfx}"] = lambda dy, y, r, c, s, scale=scale: _row_launch(dy, y, r, c, s, ROT, scale)
        for w in (2, 4, 8):
            out[f"heads_w{w}{sfx}"] = lambda dy, y, r, c, s, scale=scale, w=w: _launch(dy, y, r, c, s, ROT, scale, w)
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
    want = {fp8: fns["row_fp8" if fp8 else "row"](*args) for fp8 in (False, True)}
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
