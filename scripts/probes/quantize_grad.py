"""Probe (GPU): ``quantize_grad``'s Triton passes (``grad_e5m2``) against the previous kernels, at the residual
stream's gradient (16384 x 2048 bf16, the 1B step's 32 sites a step).

    python3 -m scripts.probes.quantize_grad

Why: the 1B fp8 profile (``profile_llama3_1b_fp8_coda_compile_…2026-11-27.json``, ``outside_gemms_by_op``)
charges ``coda::quantize_grad`` an eager amax (1.06 ms a step), the inductor cast (1.07-1.37 ms) and a few
0-dim scale kernels, and its codes' token-major copy (``transpose_8bit``, 0.72 ms with o's codes' copies)
to the weight gradients after it. Times ``quantize_grad`` by each path (``CODA_TITAN_CAST_PASS=inductor`` the
previous), and ``quantize_grad_t`` against the previous ``quantize_grad`` followed by ``transpose_8bit`` (what
the model ran before), and ``quantize_grad_t`` traced into a compiled caller (inductor launches its kernels); and
the out-projection input's delayed e4m3 cast (``quantize_delayed_t``) traced, against the previous traced cast
and its codes' copy; three ways: the GPU's time per call (``bench``: triton's ``do_bench``, calls queued
back to back, L2 flushed between them; where the host launches slower than the GPU runs, its time), the
kernels' own time per call (the profiler's kernel events) and per call synced (CUDA events around one call each, median of 30
after 3 warm-up calls: the host's launches count). Checks the bits of both paths against each other.
Writes ``$OUT/probe_quantize_grad_<gpu>.json``.
"""

from __future__ import annotations

import json
import os
import statistics

import torch

from scripts.bench.common import bench, header, out_json, synced_ms
from scripts.compare.families import trace_events


def _ms(fn, reps: int = 30) -> list[float]:
    for _ in range(3):
        fn()
    return synced_ms(fn, reps)


def _under(env: str, fn):
    from coda_titan.kernels.cute.casts import CAST_PASS_ENV

    def call():
        os.environ[CAST_PASS_ENV] = env
        try:
            return fn()
        finally:
            os.environ.pop(CAST_PASS_ENV)
    return call


def _kernels(fn, reps: int = 20) -> dict:
    """The GPU kernels of ``reps`` calls of ``fn`` under the profiler (its chrome trace's kernel events): the
    kernel time per call in total and by kernel name (us), free of the host's launch time."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = trace_events(f.name)
    by_name: dict[str, float] = {}
    for e in events:
        if e.get("cat") == "kernel":
            by_name[e["name"][:80]] = by_name.get(e["name"][:80], 0.0) + e["dur"] / reps
    return {"us_per_call": sum(by_name.values()), "by_kernel_us": by_name}


def main() -> int:
    from coda_titan.kernels import get_backend
    from coda_titan.kernels.cute import TRACED
    from coda_titan.kernels.cute.transpose_8bit import transpose_8bit

    cute = get_backend("cute")
    gen = torch.Generator(device="cuda").manual_seed(0)
    g = (torch.randn(16384, 2048, device="cuda", generator=gen) * 1e-4).to(torch.bfloat16)
    o = torch.randn(16384, 2048, device="cuda", generator=gen).to(torch.bfloat16)
    inv_o = 448.0 / (o.float().abs().amax() * 1.2)
    quantize_delayed_inductor = torch.compile(lambda **kw: TRACED["quantize_delayed"](**kw), fullgraph=True, dynamic=False)
    copy_inductor = torch.compile(lambda q: q.t().contiguous(), fullgraph=True, dynamic=False)  # (the backward's copy)
    arms = {
        "quantize_grad_previous": _under("inductor", lambda: cute.quantize_grad(t=g)),
        "quantize_grad": _under("triton", lambda: cute.quantize_grad(t=g)),
        "quantize_grad_then_copy_previous": _under("inductor", lambda: transpose_8bit(cute.quantize_grad(t=g)[0])),
        "quantize_grad_t": _under("triton", lambda: cute.quantize_grad_t(t=g)),
        "quantize_grad_t_traced": torch.compile(lambda: TRACED["quantize_grad_t"](t=g), fullgraph=True, dynamic=False),
        # the out-projection input's delayed e4m3 cast: inductor's amax and cast, then its token-major copy (what
        # the model ran, the copy in the backward), against delayed_e4m3_t's one pass
        "quantize_delayed_then_copy_previous": lambda: copy_inductor(quantize_delayed_inductor(t=o, inv_scale=inv_o)[0]),
        "quantize_delayed_t_traced": torch.compile(lambda: TRACED["quantize_delayed_t"](t=o, inv_scale=inv_o),
                                                   fullgraph=True, dynamic=False),
    }
    (q0, s0), (q1, s1) = arms["quantize_grad_previous"](), arms["quantize_grad"]()
    qt = arms["quantize_grad_t"]()
    d0, (d1, d1_t, _) = quantize_delayed_inductor(t=o, inv_scale=inv_o)[0], arms["quantize_delayed_t_traced"]()
    same = (torch.equal(q0.view(torch.uint8), q1.view(torch.uint8)) and torch.equal(s0, s1)
            and torch.equal(qt[1].view(torch.uint8), q0.t().contiguous().view(torch.uint8))
            and torch.equal(d0.view(torch.uint8), d1.view(torch.uint8))
            and torch.equal(d1_t.view(torch.uint8), d0.t().contiguous().view(torch.uint8)))
    times = {name: _ms(fn) for name, fn in arms.items()}
    gpu = {name: bench(fn) for name, fn in arms.items()}
    kernels = {name: _kernels(fn) for name, fn in arms.items()}
    doc = {**header(), "kind": "probe_quantize_grad", "shape": list(g.shape), "same_bits": same,
           "kernel_us": kernels, "gpu_ms": gpu, "synced_ms": times,
           "synced_median_ms": {name: statistics.median(t) for name, t in times.items()}}
    path = out_json("probe_quantize_grad")
    with open(path, "w") as f:
        f.write(json.dumps(doc, indent=1) + "\n")
    print(doc["same_bits"], "kernels us", {k: round(v["us_per_call"], 1) for k, v in kernels.items()}, "gpu", doc["gpu_ms"],
          "synced", doc["synced_median_ms"], "->", path, flush=True)
    for name, k in kernels.items():
        print(name, {n: round(us, 1) for n, us in k["by_kernel_us"].items()}, flush=True)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
