"""Probe (GPU): B2 with a lower base for its epilogue's C-load stages (``CODA_TITAN_EPI_C_STAGES``).

    source .gpu/part2/activate.sh && python3 -m scripts.probes.epi_stages [--base 2]

``coda_titan/kernels/cute/stages.py``: quack gives B2's two tile-sized epilogue inputs 4-5 shared-memory
stages before the mainloop's, so a 256 x 128 cooperative tile keeps 2 A/B stages (3 with the base at 2;
``scripts/dev/compile_check.py`` prints the counts). At the 1B shapes (M = 16384 tokens, d = 2048) this
times B2 of the QKV dgrad (K = 3072) and of W13's (K = 16384), bf16 and fp8 (e5m2 x e4m3), through the
cute op as training calls it (autotuned, quack's base against ``--base``), the pinned 256 x 128
cooperative tile with each base (whose outputs must agree bit for bit: the stage count does not change
the arithmetic), and the bare GEMM (cuBLAS; ``torch._scaled_mm`` for fp8). Median of CUDA-event timings
of 20 calls after 3 warm-up calls (the first compiles and autotunes), each call synced (its host time
counts), and ``*_streamed``: 20 calls enqueued back to back (the GPU's time and the host's, per call). Writes
``$OUT/probe_epi_stages_<gpu>.json`` after every row.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from scripts.bench.common import header, log_row, out_json
from scripts.probes.fp8_configs import _time

M, D = 16384, 2048
# (name, rows, K, fp8 or not); the LM head's dgrad (4096 rows, K = 128256) is left out: its tuned 256 x 128
# tile keeps 3 A/B stages with either base (scripts/dev/compile_check.py b2_last_wide b2_last_wide_c2)
SHAPES = [("qkv_dgrad", M, 3072, (False, True)), ("w13_dgrad", M, 16384, (False, True))]


def _operands(m: int, k: int, fp8: bool, g, last: bool):
    from coda_titan.kernels import get_backend

    be = get_backend("cute")
    bf = torch.bfloat16
    da = (torch.randn(m, k, generator=g, device="cuda") * 1e-2).to(bf)
    w = (torch.randn(k, D, generator=g, device="cuda") * k**-0.5).to(bf)
    norm = dict(x=torch.randn(m, D, generator=g, device="cuda").to(bf), gamma=1 + 0.1 * torch.randn(D, generator=g, device="cuda"),
                rstd=torch.rand(m, generator=g, device="cuda") + 0.5, zdz=torch.randn(m, generator=g, device="cuda") * 1e-3,
                dresidual=None if last else (torch.randn(m, D, generator=g, device="cuda") * 1e-2).to(bf))
    if not fp8:
        return (lambda: be.norm_residual_bwd(da=da, weight=w, **norm)), (lambda: da @ w), (da, w, norm)
    daq, s_da = be.quantize_grad(t=da)
    wq, s_w = be.quantize_tensorwise(w=w.t().contiguous())  # (d, K) e4m3: the weight pass's W^T, B2's weight_tq
    call = lambda: be.norm_residual_bwd_fp8(daq=daq, weight_tq=wq, scale=s_da * s_w, **norm)  # noqa: E731
    bare = lambda: torch._scaled_mm(daq, wq.t(), scale_a=s_da.float(), scale_b=s_w.float(), out_dtype=bf)  # noqa: E731
    return call, bare, (daq, wq, norm)


# GPU cycles the stream sleeps before the first timed call (about 5 ms at the H100's clocks): the host enqueues
# the calls meanwhile, so kernels shorter than their launch are timed back to back, not at the host's pace
# (until the forty-first session they were not: a 4 us Triton kernel read 43 us, its Python launch)
QUEUE_AHEAD_CYCLES = 10_000_000


def _streamed(fn, reps: int = 20) -> dict:
    """Per call, of ``reps`` calls enqueued back to back (after 3 warm-up calls) behind a GPU sleep of
    ``QUEUE_AHEAD_CYCLES``: the GPU's ms between two events (a call's GPU time with the host ahead, as in
    training, where the host enqueues them in less than the sleep; ``_time`` syncs after each call, so there
    its host time counts too) and the host's ms to enqueue them (``time.perf_counter``)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(QUEUE_AHEAD_CYCLES)
    a.record()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    host = (time.perf_counter() - t0) * 1e3 / reps
    b.record()
    b.synchronize()
    return {"gpu_ms": a.elapsed_time(b) / reps, "host_ms": host}


def _first_calls(fns: dict, judge=lambda out: {}) -> dict:
    """{name: ``judge`` of its output, or {"error": ...}, with "first_call_s"}: one call of each of ``fns`` (a
    shape's first quack call compiles and autotunes: its wall seconds, to the GPU's end); an arm this torch or
    quack cannot run is recorded as such."""
    ok = {}
    for k, f in fns.items():
        t0 = time.perf_counter()
        try:
            out = f()
            torch.cuda.synchronize()
            ok[k] = {**judge(out), "first_call_s": time.perf_counter() - t0}
        except Exception as e:  # noqa: BLE001 - recorded in the results, the other arms still run
            ok[k] = {"error": f"{type(e).__name__}: {str(e)[:300]}", "first_call_s": time.perf_counter() - t0}
            torch.cuda.synchronize()
    return ok


def _alternated(fns: dict, ok: dict, rounds: int = 3, reps: int = 5) -> dict:
    """{name: [GPU ms a call, one per round]}: ``_streamed`` over each of ``fns`` that ran (its ``ok`` entry
    has no "error"; the others get []), the rounds alternating between them so that the clocks' drift
    falls on every arm alike."""
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            if "error" not in ok[k]:
                times[k].append(_streamed(f, reps=reps)["gpu_ms"])
    return times


def _pinned(base, fp8, ops):
    """The pinned 256 x 128 cooperative tile with C-stage ``base`` (None: quack's): call and its outputs."""
    from coda_titan.kernels.cute import epilogues, stages
    from quack.gemm_config import GemmConfig

    cfg = GemmConfig(tile_m=256, tile_n=128, pingpong=False, cluster_m=1, cluster_n=2, is_dynamic_persistent=False,
                     device_capacity=9)
    a, w, norm = ops
    b_kn = w.t() if fp8 else w
    out, keep = {"D": torch.empty_like(norm["x"])}, {}
    corr = -(norm["rstd"] ** 2 / D) * norm["zdz"]

    last = norm["dresidual"] is None
    epi = epilogues.norm_residual_bwd_last_epi if last else epilogues.norm_residual_bwd_epi
    c = (norm["dresidual"],)  # (None for the last: no C)

    def call():
        with stages.capped(base):
            keep["r"] = epi(a, b_kn, *c, out=out, tuned=False, config=cfg, y=norm["x"], w=norm["gamma"], corr=corr)
    return call, lambda: [out["D"].clone(), keep["r"]["dw"].clone()], cfg


def _interleaved(call, pinned, base: int, rounds: int, keep: list) -> dict:
    """``rounds`` alternations of the tuned op and the pinned tile, both with C-stage ``base``: GPU ms per
    call of each (``_streamed``), in the order they ran, and the output bits of the two against each other."""
    from coda_titan.kernels.cute import stages

    run, got, cfg = pinned
    keep.append(cfg)
    os.environ[stages.ENV] = str(base)
    try:
        out = {"tuned_gpu_ms": [], "pinned_gpu_ms": []}
        for _ in range(rounds):
            out["tuned_gpu_ms"].append(_streamed(call)["gpu_ms"])
            out["pinned_gpu_ms"].append(_streamed(run)["gpu_ms"])
        tuned_d = call()
        run()
        out["bits_equal"] = bool(torch.equal(tuned_d[0], got()[0]))
    finally:
        os.environ.pop(stages.ENV, None)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.probes.epi_stages", description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", type=int, default=2)
    ap.add_argument("--interleave", type=int, default=0,
                    help="then N rounds, per row, of the tuned op and the pinned tile (both with --base) timed back to "
                         "back in turn: is a gap between them the kernels' or the order's (clocks, power)?")
    args = ap.parse_args()
    import coda_titan.kernels.cute  # noqa: F401  (installs the hooks)
    from coda_titan.kernels.cute import stages

    doc = {**header(), "kind": "probe_epi_stages", "M": M, "d": D, "base": args.base,
           "timing": "median of 20 CUDA-event timings after 3 warm-up calls (the first autotunes), each synced; "
                     "*_streamed: 20 calls back to back, per call: GPU ms between two events, host ms to enqueue", "rows": []}
    path = out_json("probe_epi_stages")
    keep = []  # (quack's eager call cache keys a pinned config by its id)
    for name, m, k, precisions in SHAPES:
        for fp8 in precisions:
            row = {"gemm": name, "M": m, "K": k, "precision": "fp8" if fp8 else "bf16"}
            try:
                call, bare, ops = _operands(m, k, fp8, torch.Generator(device="cuda").manual_seed(k), name == "lm_head_dgrad")
                row["bare_ms"] = _time(bare)
                os.environ.pop(stages.ENV, None)
                row["tuned_quack_base_ms"] = _time(call)
                row["tuned_quack_base_streamed"] = _streamed(call)
                os.environ[stages.ENV] = str(args.base)
                row["tuned_base_ms"] = _time(call)
                row["tuned_base_streamed"] = _streamed(call)
                os.environ.pop(stages.ENV, None)
                outs = {}
                for base in (None, args.base):
                    run, got, cfg = _pinned(base, fp8, ops)
                    keep.append(cfg)
                    row[f"pinned_256x128_base_{base or 'quack'}_ms"] = _time(run)
                    row[f"pinned_256x128_base_{base or 'quack'}_streamed"] = _streamed(run)
                    outs[base] = got()
                row["pinned_bits_equal"] = all(torch.equal(a, b) for a, b in zip(outs[None], outs[args.base]))
                if args.interleave:
                    row["interleaved"] = _interleaved(call, _pinned(args.base, fp8, ops), args.base, args.interleave, keep)
            except Exception as e:  # noqa: BLE001 - record the failure and go on with the next shape
                row["error"] = f"{type(e).__name__}: {str(e)[:500]}"
            finally:
                os.environ.pop(stages.ENV, None)
            log_row(doc, "rows", row, path)
    print("wrote", path, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
