"""Probe (GPU): where the host time of one call of each CODA program goes, by Python function.

    source .gpu/part2/activate.sh && python3 -m scripts.probes.host_profile [--precision bf16 fp8] [--d 2048]

Why: ``scripts.probes.host_overhead`` measured (H100, 2026-11-24) 90-430 us of host time per call of
CODA's programs against 18-40 us for their bare GEMMs, and on the fp8 side several programs take
longer on the host than on the GPU (B2 fp8 427 us host / 397 us GPU, the weight cast 189 / 72): the
step's GPU idle (22.1 ms against float8's 8.8) is host time. This probe says which code that time is
spent in, so that it can be cut where it is.

For every program's ``coda`` provider: one untimed call (compile, autotune), then ``--calls`` calls
under ``cProfile`` with a ``torch.cuda.synchronize()`` every ``--batch`` calls (under the CUDA launch
queue's depth; the time spent waiting in it is reported apart and left out of ``host_us``). Each row
holds the host time per call, its split by where the code lives (coda_titan, quack, cutlass / tvm_ffi,
torch's Python, torch's C++ ops and launches) and the functions with the most own time.
Writes ``$OUT/probe_host_profile_<gpu>.json`` (benchmarks/results without $OUT), one row per program.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from scripts.bench.common import header, log_row, out_json
from scripts.probes.host_overhead import programs

GROUPS = (("coda_titan", "coda_titan"), ("scripts", "probe"), ("quack", "quack"), ("cutlass", "cutlass"),
          ("tvm_ffi", "cutlass"), ("torch", "torch_py"), ("triton", "triton"))


def group_of(path: str, func: str) -> str:
    """Which code a cProfile entry belongs to: the package of its file, or torch_c for the C++
    functions cProfile sees from Python (aten ops, launches)."""
    if path == "~":  # a built-in: C code called from Python
        return "torch_c" if "torch" in func or "Tensor" in func or "_C." in func else "builtin"
    for key, group in GROUPS:
        if f"/{key}/" in path:
            return group
    return "other"


def profile(fn, calls: int, batch: int) -> dict:
    fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for i in range(calls):
        fn()
        if (i + 1) % batch == 0:
            torch.cuda.synchronize()
    prof.disable()
    wall = time.perf_counter() - t0
    torch.cuda.synchronize()
    stats = pstats.Stats(prof)
    sync_s, groups, funcs = 0.0, {}, []
    for (path, line, func), (_, ncalls, tottime, _cum, _) in stats.stats.items():
        if func in ("synchronize", "<method 'synchronize' of 'torch._C._CudaStreamBase' objects>") \
                or "cuda_synchronize" in func or "_cuda_synchronize" in func:
            sync_s += tottime
            continue
        g = group_of(path, func)
        groups[g] = groups.get(g, 0.0) + tottime
        funcs.append((tottime, ncalls, f"{path.split('site-packages/')[-1]}:{line}({func})", g))
    funcs.sort(reverse=True)
    own = sum(groups.values())
    return {
        "host_us": round(own / calls * 1e6, 1),
        "wall_us": round((wall - sync_s) / calls * 1e6, 1),
        "sync_us": round(sync_s / calls * 1e6, 1),
        "groups_us": {g: round(s / calls * 1e6, 1) for g, s in sorted(groups.items(), key=lambda kv: -kv[1])},
        "top": [{"us": round(t / calls * 1e6, 2), "calls_per_call": round(n / calls, 2), "where": w, "group": g}
                for t, n, w, g in funcs[:25]],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.probes.host_profile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--precision", nargs="+", choices=("bf16", "fp8"), default=["fp8", "bf16"])
    ap.add_argument("--d", type=int, default=2048, help="hidden size (2048: the 1B model)")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--batch", type=int, default=10, help="calls between synchronizations")
    args = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    path = out_json("probe_host_profile")
    doc = {**header(), "kind": "probe_host_profile", "calls": args.calls, "batch": args.batch,
           "timing": "cProfile own time per call, synchronize excluded; wall_us: wall per call less the waits",
           "rows": []}
    for precision, setup, program in programs(args.precision, args.d):
        op, direction, fns = program(setup)
        fn = fns.get("coda")
        if fn is None or op == "lm_head_ce":  # F4 is one call per step; its 40 ms of GPU hide its host time
            continue
        row = {"op": op, "direction": direction, "precision": precision, "d": args.d, **profile(fn, args.calls, args.batch)}
        log_row(doc, "rows", row, path)
    print("wrote", path, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
