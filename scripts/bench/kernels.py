"""Benchmark (GPU): each fused CODA program against its bare GEMM, eager torch, torch.compile, Liger.

    source .gpu/part2/activate.sh && python3 -m scripts.bench.kernels --dims 2048 4096 8192 [--precision fp8]

For every program and d it times (median of triton's do_bench, after a warm-up call that compiles
and autotunes) the providers of ``scripts.bench.bf16`` / ``scripts.bench.fp8``. For the chunked LM
head + CE the peak allocated memory of the coda program and of the full-logits eager path are
recorded too. Writes ``$OUT/kernels[_fp8]_<gpu>_d<d>.json`` per d (``python -m scripts.report
--parts DIR`` merges them into ``benchmarks/results/`` and the generated results page).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import time

import torch

from coda_titan.kernels import B3_C_STAGES_ENV

from . import bf16, fp8
from .common import M, Setup, at_cap, bench, header, peak_gib, try_bench


def measure(op: str, direction: str, fns: dict, d: int, precision: str, cap_s: float = 0.0) -> dict:
    """One result row: every provider's median ms and the derived ratios; with ``cap_s``, the program and its
    bare GEMMs also back to back for that many seconds each (``at_cap``: the power cap a step runs at)."""
    t0 = time.perf_counter()
    row = {"op": op, "direction": direction, "M": M, "d": d, "precision": precision, "ms": {}}
    row["ms"]["coda"] = bench(fns["coda"])
    if "coda_bf16" in fns:
        row["ms"]["coda_bf16"] = bench(fns["coda_bf16"])
    row["first_call_s"] = round(time.perf_counter() - t0, 1)
    gemms = [bench(g) for g in fns["bare_gemm"]]
    row["ms"]["bare_gemm"] = sum(gemms) if gemms else None
    eager = fns.get("eager")  # (none for a program that replaces another CODA program: coda_bf16 is that one)
    row["ms"]["eager"] = try_bench(eager) if eager else None
    row["ms"]["torch_compile"] = try_bench(torch.compile(eager, dynamic=False)) if eager else None
    if "liger" not in fns:
        row["liger_note"], row["ms"]["liger"] = "Liger has no fused op for this program", None
    elif fns["liger"] is None:
        row["liger_note"], row["ms"]["liger"] = "liger-kernel is not installed on the benchmark host", None
    else:
        row["liger_note"] = "LigerFusedLinearCrossEntropyLoss (no norm backward)"
        row["ms"]["liger"] = try_bench(fns["liger"])
    if op == "lm_head_ce":
        torch.cuda.empty_cache()
        row["peak_gib"] = {"coda": peak_gib(fns["coda"]), "eager_full_logits": peak_gib(fns["eager"])}
    if cap_s and fns["bare_gemm"]:
        coda, bare = at_cap(fns["coda"], cap_s), at_cap(lambda: [g() for g in fns["bare_gemm"]], cap_s)
        row["ms"]["coda_at_cap"], row["ms"]["bare_gemm_at_cap"] = coda["sustained_ms"], bare["sustained_ms"]
        row["at_cap"] = {"seconds": cap_s, "coda": coda, "bare_gemm": bare}
    if row["ms"]["bare_gemm"]:
        row["coda_over_bare_gemm"] = row["ms"]["coda"] / row["ms"]["bare_gemm"]
    if row["ms"]["torch_compile"]:
        row["speedup_vs_compile"] = row["ms"]["torch_compile"] / row["ms"]["coda"]
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.bench.kernels", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dims", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--ops", nargs="*", default=None, help="only these programs")
    ap.add_argument("--precision", choices=("bf16", "fp8"), default="bf16",
                    help="fp8: the e4m3 programs, written to kernels_fp8_<gpu>_d<d>.json")
    ap.add_argument("--at-cap", type=float, default=0.0, metavar="SECONDS",
                    help="also time each program and its bare GEMMs back to back for SECONDS each (the power cap)")
    ap.add_argument("--c-stages", type=int, default=None,
                    help="the epilogue C-stage base of B2 and the bf16 B3 (0: quack's); default: [coda] b2_c_stages's "
                         "default, as the configs run them")
    args = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    base = _c_stage_base(args.c_stages)
    slug = re.sub(r"[^A-Za-z0-9]+", "_", torch.cuda.get_device_name()).strip("_")
    out_dir = os.environ.get("OUT", "benchmarks/results")
    programs = fp8.PROGRAMS if args.precision == "fp8" else bf16.PROGRAMS
    for d in args.dims:
        setup = Setup(d, torch.Generator(device="cuda").manual_seed(d))
        results, path = [], None
        for program in programs:
            if args.ops and program.__name__ not in args.ops:
                continue
            row = {**measure(*program(setup), d=d, precision=args.precision, cap_s=args.at_cap), "epi_c_stage_base": base}
            if os.environ.get(B3_C_STAGES_ENV):  # (B3's own base, set for an A/B: "0" is quack's)
                row["b3_c_stages"] = os.environ[B3_C_STAGES_ENV]
            print(json.dumps(row), flush=True)
            results.append(row)
            torch.cuda.empty_cache()
            # written after every program: a call cut off by its time limit keeps the rows it measured
            path = _write(out_dir, f"{'kernels_fp8_' if args.precision == 'fp8' else 'kernels_'}{slug}_d{d}.json", results, base)
        print("wrote", path or f"nothing for d = {d} (no program selected)", flush=True)
    return 0


def _c_stage_base(requested: int | None) -> int:
    """Set the C-stage base the programs compile with (``CODA_TITAN_EPI_C_STAGES``; 0 unsets it: quack's) and
    return it: ``requested``, else the ``[coda] b2_c_stages`` default the configs run."""
    from coda_titan.kernels import EPI_C_STAGES_ENV
    from coda_titan.titan.job_config import Coda

    base = requested if requested is not None else next(f.default for f in dataclasses.fields(Coda) if f.name == "b2_c_stages")
    if base:
        os.environ[EPI_C_STAGES_ENV] = str(base)
    else:
        os.environ.pop(EPI_C_STAGES_ENV, None)
    return base


def _write(out_dir: str, name: str, results: list[dict], base: int) -> str:
    doc = {**header(), "epi_c_stage_base": base or "quack's (4)", "autotune": os.environ.get("CODA_TITAN_AUTOTUNE", "1") != "0",
           "timing": "triton.testing.do_bench median (warmup 25 ms, rep 200 ms) after one untimed call",
           "results": results}
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(path + ".tmp", path)
    return path


if __name__ == "__main__":
    raise SystemExit(main())
