"""Probe (GPU): the host time of one call of each CODA program, beside the GPU time it launches.

    source .gpu/part2/activate.sh && python3 -m scripts.probes.host_overhead [--precision bf16 fp8] [--d 2048]

Why: the profiled CODA fp8 step (2026-11-23, docs/results.md) left the GPU idle 22.1 ms in 1411
gaps, 15.6 us each on average, against 8.8 ms in 2087 gaps (4.2 us) for float8 + compile, and its
largest gaps (about 1 ms) sat inside host calls of CODA's programs. Idle time is host time the GPU
waits for, so this probe separates the two for every program of ``scripts.bench.bf16`` /
``scripts.bench.fp8`` and its bare GEMM (cuBLAS):

* ``host_us``: wall time per call of ``--calls`` calls enqueued behind a long ``torch.cuda._sleep``
  on the same stream. The stream is busy all along, so the enqueue never waits for the GPU: what is
  measured is the host's own cost (Python, quack's frontend, tensor wrapping, launches).
* ``syncs``: the enqueue outlasted the sleep; the call waited for the GPU (a host synchronization
  inside the program), so ``host_us`` is not host time alone.
* ``gpu_us``: the GPU time of one call (triton's ``do_bench`` median).

Every program is called once first (compile, autotune). Writes ``$OUT/probe_host_overhead_<gpu>.json``
(benchmarks/results without $OUT), one row per program and provider, rewritten after each row.
"""

from __future__ import annotations

import argparse
import time

import torch

from scripts.bench import bf16, fp8
from scripts.bench.common import Setup, bench, header, log_row, out_json

SLEEP_CYCLES = 400_000_000  # about 0.2 s on an H100 or H200 (1.98 GHz): far longer than any enqueue here


def host_us(fn, calls: int) -> tuple[float, bool]:
    """(host wall time per call in us, whether the enqueue had to wait for the GPU)."""
    fn()
    torch.cuda.synchronize()
    start, slept = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(SLEEP_CYCLES)
    slept.record()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    wall = time.perf_counter() - t0
    torch.cuda.synchronize()
    return wall / calls * 1e6, wall * 1e3 >= start.elapsed_time(slept)


def programs(precisions, d: int):
    """(precision, setup, program) for every program of ``scripts.bench.bf16`` / ``.fp8`` at width d;
    the cache is emptied after each program's rows."""
    for precision in precisions:
        setup = Setup(d, torch.Generator(device="cuda").manual_seed(d))
        for program in (fp8.PROGRAMS if precision == "fp8" else bf16.PROGRAMS):
            yield precision, setup, program
            torch.cuda.empty_cache()


def measure(program, setup: Setup, calls: int, precision: str) -> list[dict]:
    op, direction, fns = program(setup)
    rows = []
    for provider in ("coda", "bare_gemm"):
        fn = fns.get(provider)
        if isinstance(fn, list):  # the bare GEMMs of one program, called one after another
            fn = (lambda gs: lambda: [g() for g in gs])(fn) if fn else None
        if fn is None:
            continue
        us, syncs = host_us(fn, calls)
        rows.append({"op": op, "direction": direction, "precision": precision, "provider": provider, "d": setup.d,
                     "host_us": round(us, 1), "syncs": syncs, "gpu_us": round(bench(fn) * 1e3, 1), "calls": calls})
    return rows


def probe_args(prog: str, doc: str, argv, precisions=("bf16", "fp8")):
    """The host probes' command line (``--precision``, ``--d``, ``--calls``), parsed; TF32 off."""
    ap = argparse.ArgumentParser(prog=f"python -m {prog}", description=doc.split("\n\n")[0])
    ap.add_argument("--precision", nargs="+", choices=("bf16", "fp8"), default=list(precisions))
    ap.add_argument("--d", type=int, default=2048, help="hidden size (2048: the 1B model)")
    ap.add_argument("--calls", type=int, default=20, help="calls enqueued behind the sleep")
    torch.backends.cuda.matmul.allow_tf32 = False
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = probe_args("scripts.probes.host_overhead", __doc__, argv)
    path = out_json("probe_host_overhead")
    doc = {**header(), "kind": "probe_host_overhead", "sleep_cycles": SLEEP_CYCLES,
           "timing": "host_us: wall time per call enqueued behind torch.cuda._sleep; gpu_us: do_bench median",
           "rows": []}
    for precision, setup, program in programs(args.precision, args.d):
        for row in measure(program, setup, args.calls, precision):
            log_row(doc, "rows", row, path)
    print("wrote", path, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
