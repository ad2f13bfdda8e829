"""Probe (GPU): does an fp8 weight gradient pay for its transposed copies at the 1B shapes?

    source .gpu/part2/activate.sh && python3 -m scripts.probes.fp8_wgrad

On SM90 an fp8 GEMM reads both operands K-major, and a weight gradient dW = G^T X contracts over
the tokens, so both operands need token-major fp8 copies (the passes torchao's float8 recipe runs).
For each of a layer's four weight gradients (M = 16384 tokens, d = 2048, F = 8192) this times:

* ``bf16``: the current path, cuBLAS ``G^T @ X`` (a layout flag, no copies);
* ``prep``: the copies as the model would make them, compiled by inductor: an e4m3/e5m2 operand that
  already exists is only transposed (W13's e5m2 da from B3, the e4m3 H from F1); a bf16 operand gets
  a current tensorwise scale (amax pass) and one cast-and-transpose pass;
* ``mm_fast`` / ``mm_slow``: ``torch._scaled_mm`` (cuBLAS) on the copies, with and without fast
  accumulation (torchao's float8 uses slow accumulation for weight gradients).

and the relative error against float64 of the bf16 and fp8 results. Inputs are random with a
per-row spread of magnitudes. Times are medians of CUDA-event timings (20 calls after 3 warm-up
calls). Writes ``$OUT/probe_fp8_wgrad_<gpu>.json``.
"""

from __future__ import annotations

import json
import os
import re

import torch

from scripts.probes.fp8_configs import _time

M, D, F = 16384, 2048, 8192


def main() -> None:
    from coda_titan.kernels.scaling import E4M3, E4M3_MAX, E5M2, E5M2_MAX
    from scripts.bench.common import header

    gen = torch.Generator(device="cuda").manual_seed(0)

    def rnd(rows, cols, scale):
        row = torch.exp(torch.randn(rows, 1, device="cuda", generator=gen))  # rows of varied magnitude
        return (torch.randn(rows, cols, device="cuda", generator=gen) * row * scale).to(torch.bfloat16)

    def cast_t(x, fp8, fmax):  # current tensorwise scale, then one cast-and-transpose pass
        inv = fmax / x.abs().amax().float().clamp(min=1e-12)
        return (x.float() * inv).clamp(-fmax, fmax).to(fp8).t().contiguous(), inv.reciprocal()

    def transpose(q):
        return q.t().contiguous()

    cast_t_c = torch.compile(cast_t, dynamic=False)
    transpose_c = torch.compile(transpose, dynamic=False)

    def given(x, fp8, fmax):  # an fp8 operand a producer epilogue already wrote (delayed scale)
        inv = fmax / x.abs().amax().float()
        return (x.float() * inv).clamp(-fmax, fmax).to(fp8), inv.reciprocal()

    # (name, G, X, G already fp8?, X already fp8?)
    sites = [
        ("w13", rnd(M, 2 * F, 1e-3), rnd(M, D, 1.0), True, True),
        ("w2", rnd(M, D, 1e-3), rnd(M, F, 1.0), False, False),
        ("wqkv", rnd(M, D + 1024, 1e-3), rnd(M, D, 1.0), False, True),
        ("wo", rnd(M, D, 1e-3), rnd(M, D, 1.0), False, False),
    ]
    out = {**header(), "kind": "probe_fp8_wgrad", "shapes": {"M": M, "d": D, "F": F}, "rows": []}
    path = os.path.join(os.environ.get("OUT", "."), f"probe_fp8_wgrad_{re.sub(r'[^A-Za-z0-9]+', '_', out['device'])}.json")
    for name, g, x, g8, x8 in sites:
        ref = g.double().t() @ x.double()
        gq, s_g = given(g, E5M2, E5M2_MAX) if g8 else (None, None)
        xq, s_x = given(x, E4M3, E4M3_MAX) if x8 else (None, None)

        def prep():
            gt, sg = (transpose_c(gq), s_g) if g8 else cast_t_c(g, E5M2, E5M2_MAX)
            xt, sx = (transpose_c(xq), s_x) if x8 else cast_t_c(x, E4M3, E4M3_MAX)
            return gt, sg, xt, sx

        gt, sg, xt, sx = prep()

        def mm(fast):
            return torch._scaled_mm(gt, xt.t(), scale_a=sg, scale_b=sx, out_dtype=torch.bfloat16, use_fast_accum=fast)

        def err(t):
            return ((t.double() - ref).norm() / ref.norm()).item()

        row = {
            "site": name, "G": list(g.shape), "X": list(x.shape), "G_given_fp8": g8, "X_given_fp8": x8,
            "bf16": _time(lambda: g.t() @ x), "prep": _time(prep),
            "mm_fast": _time(lambda: mm(True)), "mm_slow": _time(lambda: mm(False)),
            "rel_err": {"bf16": err(g.t() @ x), "fp8_fast": err(mm(True)), "fp8_slow": err(mm(False))},
        }
        for k in ("fast", "slow"):
            row[f"saved_ms_{k}"] = row["bf16"]["median_ms"] - row["prep"]["median_ms"] - row[f"mm_{k}"]["median_ms"]
        out["rows"].append(row)
        print(name, {k: (round(v["median_ms"], 3) if isinstance(v, dict) and "median_ms" in v else v)
                     for k, v in row.items() if k not in ("G", "X")}, flush=True)
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
