"""Probe (GPU): the folds of the fp8 epilogues' per-tile partials, each as the training step runs it and as
one launch: amax |x| (``partials.amax()``, with B2's rounding to bf16 and back three launches, against
``row_vectors.fold_amax``), B3's zdz (quack's per-row sum, then times rstd) and the fp8 B2's dgamma (quack's
per-column sum, then times the dequantization scale) against a one-launch candidate kept here (``_rows_kernel``,
``_cols_kernel``: a 2-d tile of partials a program, loaded whole and summed along the tile; the fortieth
session's first form, a thread a row looping over dependent loads, was taken out unmeasured: docs/history.md).

    source .gpu/part2/activate.sh && python3 -m scripts.probes.folds        (gpu_train.sh foldsprobe)

Partials at the 1B step's shapes, 16384 rows (tokens) by the N tiles of each epilogue (``N_TILES``), and
dgamma's 128 M tiles by d = 2048. Each candidate's result is compared with the step's: the amax bit for bit,
the sums by their largest difference over the bound of two fp32 sums of n terms in different orders
(2 (n - 1) units of the sum of the terms' magnitudes, times the factor, plus one unit of the product).
Timing: ``epi_stages._streamed`` (20 calls enqueued back to back after 3 warm-up calls, GPU ms per call),
5 alternations of the variants. Writes ``$OUT/probe_folds_<gpu>.json``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from scripts.bench.common import header, log_row, out_json
from scripts.probes.epi_stages import _streamed

M, D, M_TILES = 16384, 2048, 128
N_TILES = (8, 16, 64, 128)  # (per-N-tile partials: B2 / F1 at d = 2048 on 256- or 128-wide tiles, B3 and F2 at 8192)
U = 2.0**-24


@triton.jit
def _rows_kernel(part_ptr, f_ptr, out_ptr, R, C, BR: tl.constexpr, BC: tl.constexpr):
    """out[i] = sum_j part[i, j] * f[i] for a contiguous (R, C) part: a (BR, BC) tile a step, summed along it."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    acc = tl.zeros((BR,), tl.float32)
    for c0 in range(0, C, BC):
        cols = c0 + tl.arange(0, BC)
        mask = (rows[:, None] < R) & (cols[None, :] < C)
        acc += tl.sum(tl.load(part_ptr + rows[:, None].to(tl.int64) * C + cols[None, :], mask=mask, other=0.0), axis=1)
    tl.store(out_ptr + rows, acc * tl.load(f_ptr + rows, mask=rows < R, other=0.0), mask=rows < R)


@triton.jit
def _cols_kernel(part_ptr, f_ptr, out_ptr, T, N, BT: tl.constexpr, BN: tl.constexpr):
    """out[j] = sum_t part[t, j] * f[0] for a contiguous (T, N) part: a (BT, BN) tile a step, summed along it."""
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    acc = tl.zeros((BT, BN), tl.float32)
    for t0 in range(0, T, BT):
        rows = t0 + tl.arange(0, BT)
        mask = (rows[:, None] < T) & (cols[None, :] < N)
        acc += tl.load(part_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + cols, tl.sum(acc, axis=0) * tl.load(f_ptr), mask=cols < N)


def rows_one_launch(part: torch.Tensor, f: torch.Tensor, br: int = 64) -> torch.Tensor:
    r, c = part.shape
    out = torch.empty(r, device=part.device, dtype=torch.float32)
    _rows_kernel[(triton.cdiv(r, br),)](part, f, out, r, c, BR=br, BC=min(triton.next_power_of_2(c), 128))
    return out


def cols_one_launch(part: torch.Tensor, f: torch.Tensor, bn: int = 64) -> torch.Tensor:
    t, n = part.shape
    out = torch.empty(n, device=part.device, dtype=torch.float32)
    _cols_kernel[(triton.cdiv(n, bn),)](part, f, out, t, n, BT=32, BN=bn)
    return out


def sum_err_over_bound(got: torch.Tensor, part: torch.Tensor, f: torch.Tensor, dim: int) -> float:
    """The largest |got - exact| over its bound: two fp32 sums of n terms in any orders are within 2 (n - 1)
    units of the sum of the terms' magnitudes, times |f|, plus one unit of the rounded product."""
    n = part.shape[dim]
    exact = part.double().sum(dim) * f.double()
    bound = 2 * (n - 1) * U * part.double().abs().sum(dim) * f.double().abs() + U * exact.abs()
    return float(((got.double() - exact).abs() / bound.clamp(min=1e-300)).max())


def _variants(g) -> dict:
    """{name: (step's fn, one-launch fn, judge)} at each shape."""
    from coda_titan.kernels.cute.row_vectors import fold_amax

    out = {}
    for n in N_TILES:
        p = torch.rand(M, n, device="cuda", generator=g) * torch.exp2(torch.randint(-8, 8, (M, n), device="cuda", generator=g).float())
        out[f"amax_{n}"] = (lambda p=p: p.amax(), lambda p=p: fold_amax(p, torch.float32),
                            lambda a, b: {"apart": int(a.view(torch.int32) != b.view(torch.int32))})
        out[f"amax_bf16_{n}"] = (lambda p=p: p.amax().to(torch.bfloat16).float(), lambda p=p: fold_amax(p),
                                 lambda a, b: {"apart": int(a.view(torch.int32) != b.view(torch.int32))})
        s = torch.randn(M, n, device="cuda", generator=g) * 100
        r = torch.rand(M, device="cuda", generator=g) + 0.5
        out[f"rows_{n}"] = (lambda s=s, r=r: s.sum(-1) * r, lambda s=s, r=r: rows_one_launch(s, r),
                            lambda a, b, s=s, r=r: {"err_over_bound": sum_err_over_bound(b, s, r, 1),
                                                    "step_err_over_bound": sum_err_over_bound(a, s, r, 1)})
    pg = torch.randn(M_TILES, D, device="cuda", generator=g)
    sc = torch.tensor([2.0**-9 * 1.37], device="cuda")
    out["cols"] = (lambda: pg.sum(0) * sc, lambda: cols_one_launch(pg, sc),
                   lambda a, b: {"err_over_bound": sum_err_over_bound(b, pg, sc, 0),
                                 "step_err_over_bound": sum_err_over_bound(a, pg, sc, 0)})
    return out


def main() -> None:
    path = out_json("probe_folds")
    doc = {"kind": "probe_folds", **header(), "rows": M, "d": D, "m_tiles": M_TILES, "n_tiles": list(N_TILES),
           "results": []}
    g = torch.Generator(device="cuda").manual_seed(0)
    variants = _variants(g)
    times = {(k, arm): [] for k in variants for arm in ("step", "one_launch")}
    for _ in range(5):
        for k, (step, one, _) in variants.items():
            times[(k, "step")].append(_streamed(step)["gpu_ms"])
            times[(k, "one_launch")].append(_streamed(one)["gpu_ms"])
    for k, (step, one, judge) in variants.items():
        a, b = step(), one()
        row = {"fold": k, "step_gpu_ms": times[(k, "step")], "one_launch_gpu_ms": times[(k, "one_launch")],
               "step_median_ms": sorted(times[(k, "step")])[2], "one_launch_median_ms": sorted(times[(k, "one_launch")])[2],
               **judge(a, b)}
        log_row(doc, "results", row, path)


if __name__ == "__main__":
    main()
