"""Probe (GPU): the LM head's weight gradient at the 1B shape, CODA's chunked way against one GEMM, on
quack and on cuBLAS, with operands shaped like a cross-entropy gradient and with random ones.

    source .gpu/part2/activate.sh && python3 -m scripts.probes.lm_head_dw        (gpu_train.sh lmheaddw)

Why: in the twenty-sixth session's profiles stock's cuBLAS LM-head wgrad ran 10.17 ms in its step, CODA's
dW (8 chunks of 2048 rows, quack, the sum in fp32 in global memory, the last chunk writing bf16) 11.47,
and the floor script's isolated wgrad 11.58 (random operands, back to back; docs/fp8.md). This probe
times, over all 16384 token rows (vocabulary 128256, d = 2048):

- ``quack_chunks<R>``: CODA's program (``kernels/cute/lm_head_ce.py``) with R rows a chunk;
- ``cublas_chunks<R>``: the same sum on cuBLAS (``torch.mm`` / ``torch.addmm`` with ``out_dtype=float32``),
  then one cast to bf16; ``_in_place`` the sum written over itself (``out=``), ``_bf16_tail`` also the last
  chunk's GEMM writing bf16 from the fp32 sum (recorded as an error where torch or cuBLAS refuses it);
- ``quack_full`` / ``cublas_full``: one GEMM over all rows (stock's way; it needs every chunk's da at once);

each on ``ce`` operands (da = r (softmax - onehot) of random logits, as F4's pass writes it) and on
``randn`` operands (the floor script's kind), to see how much of the floor's gap is the data. Timing: GPU
ms per whole dW (the probes' back-to-back event timer, 5 calls after 3 warm-up calls) in 3 alternations.
Accuracy: each variant's largest difference from cuBLAS's fp32-accumulated full GEMM, relative to that
GEMM's largest |element|. ``cool_ms`` (the full GEMMs and CODA's 2048-row chunks): each call timed alone
after the GPU idled in a sleep kernel as long as the call itself (a 50% duty cycle), the median of 5:
whether back-to-back timing runs the GEMM at lower clocks than a step does (power), beside what the
operands' values change (``ce`` against ``randn``). ``b2_*``: the head's dgrad dX = da W the same ways (CODA's
``acc`` B2 is ``b2_chunks<R>_fp32``; stock's ``b2_full_bf16``), W random at 0.02. ``--cublas-only``: no quack arms,
so it runs on torch alone. ``--at-cap S``: CODA's chunked dW and B2 and stock's two GEMMs also back to back for S
seconds each at the power cap (``scripts.bench.common.arms_at_cap``; ``median_ms_<arm>``). Writes ``$OUT/probe_lm_head_dw_<gpu>.json``.
"""

from __future__ import annotations

import torch

from scripts.bench.common import arms_at_cap, header, log_row, out_json
from scripts.probes.epi_stages import _alternated, _first_calls

TOKENS, VOCAB, D = 16384, 128256, 2048
CHUNK_ROWS = (2048, 4096)
BF = torch.bfloat16


def _operands(kind: str, g) -> tuple[torch.Tensor, torch.Tensor]:
    """(da (TOKENS, VOCAB), h (TOKENS, D)), bf16: ``ce`` da = r (softmax(z) - onehot) row chunk by row chunk
    (z random, scale 3; r in [0.5, 1.5)), ``randn`` da standard normal."""
    h = torch.randn(TOKENS, D, device="cuda", generator=g).to(BF)
    if kind == "randn":
        return torch.randn(TOKENS, VOCAB, device="cuda", generator=g).to(BF), h
    da = torch.empty(TOKENS, VOCAB, device="cuda", dtype=BF)
    for s in range(0, TOKENS, 2048):
        p = torch.softmax(torch.randn(2048, VOCAB, device="cuda", generator=g) * 3, dim=-1)
        p[torch.arange(2048, device="cuda"), torch.randint(0, VOCAB, (2048,), device="cuda", generator=g)] -= 1
        da[s:s + 2048] = (p * (torch.rand(2048, 1, device="cuda", generator=g) + 0.5)).to(BF)
    return da, h


def _variants(da: torch.Tensor, h: torch.Tensor, cublas_only: bool = False) -> dict:
    if not cublas_only:
        from quack.gemm_interface import gemm as quack_gemm
        from quack.gemm_interface import gemm_add, gemm_add_inplace

        from coda_titan.kernels.cute._dispatch import TUNE

    def quack_chunks(rows):
        def run():
            acc = torch.empty(VOCAB, D, device="cuda", dtype=torch.float32)
            for i, s in enumerate(range(0, TOKENS, rows)):
                a, b = da[s:s + rows].t(), h[s:s + rows]
                if s + rows >= TOKENS:  # the last chunk writes the sum in bf16 (the program's tail)
                    return gemm_add(a, b, acc, out_dtype=BF, tuned=TUNE)
                if i == 0:
                    quack_gemm(a, b, out=acc, tuned=TUNE)
                else:
                    gemm_add_inplace(a, b, acc, tuned=TUNE)
        return run

    def cublas_chunks(rows, in_place=False, bf16_tail=False):
        def run():
            acc = torch.empty(VOCAB, D, device="cuda", dtype=torch.float32) if in_place else None
            for i, s in enumerate(range(0, TOKENS, rows)):
                a, b = da[s:s + rows].t(), h[s:s + rows]
                if bf16_tail and s + rows >= TOKENS:  # fp32 C in, bf16 D out, if cuBLAS through torch takes it
                    return torch.addmm(acc, a, b, out_dtype=BF)
                if i == 0:
                    acc = torch.mm(a, b, out_dtype=torch.float32, **({"out": acc} if in_place else {}))
                else:
                    acc = torch.addmm(acc, a, b, out_dtype=torch.float32, **({"out": acc} if in_place else {}))
            return acc.to(BF)
        return run

    fns = {} if cublas_only else {f"quack_chunks{r}": quack_chunks(r) for r in CHUNK_ROWS}
    fns |= {f"cublas_chunks{r}": cublas_chunks(r) for r in CHUNK_ROWS}
    fns |= {f"cublas_chunks{r}_in_place": cublas_chunks(r, in_place=True) for r in CHUNK_ROWS}
    fns |= {f"cublas_chunks{r}_bf16_tail": cublas_chunks(r, in_place=True, bf16_tail=True) for r in CHUNK_ROWS}
    if not cublas_only:
        fns["quack_full"] = lambda: quack_gemm(da.t(), h, out_dtype=BF, tuned=TUNE)
    fns["cublas_full"] = lambda: torch.mm(da.t(), h)
    return fns


def _b2_variants(da: torch.Tensor, w: torch.Tensor) -> dict:
    """The head's dgrad dX = da W over all rows: CODA's ``acc`` B2 (cuBLAS to fp32, a chunk at a time, as
    ``kernels/cute/lm_head_ce.py`` calls it), the same writing bf16, and one GEMM (stock's, bf16; and to fp32)."""
    def chunks(rows, dtype):  # (each chunk's product in a tensor of its own, as the program has it)
        return lambda: [torch.mm(da[s:s + rows], w, out_dtype=dtype) for s in range(0, TOKENS, rows)]

    fns = {f"b2_chunks{r}_{n}": chunks(r, t) for r in CHUNK_ROWS for n, t in (("fp32", torch.float32), ("bf16", BF))}
    fns["b2_full_bf16"] = lambda: torch.mm(da, w)
    fns["b2_full_fp32"] = lambda: torch.mm(da, w, out_dtype=torch.float32)
    return fns


COOLED = ("quack_chunks2048", "quack_full", "cublas_full")


def _cooled(fn, ms: float, reps: int = 5) -> float:
    """The median of ``reps`` calls of ``fn``, each timed alone by CUDA events after a sleep kernel of
    about ``ms`` (``torch.cuda._sleep`` spins cycles; at 1.7 GHz)."""
    cycles = int(ms * 1.7e6)
    got = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles)
        a.record()
        fn()
        b.record()
        b.synchronize()
        got.append(a.elapsed_time(b))
    return sorted(got)[reps // 2]


def _timed_rows(doc, path, kind: str, fns: dict, ref: torch.Tensor) -> None:
    scale = float(ref.abs().max())

    def judge(out):
        out = torch.cat(out) if isinstance(out, list) else out
        return {"max_abs_diff_rel": float((out.float() - ref).abs().max()) / scale}

    ok = _first_calls(fns, judge)
    times = _alternated(fns, ok, reps=5)
    for k in fns:
        row = {"operands": kind, "variant": k, **ok[k]}
        if times[k]:
            row.update(gpu_ms=times[k], median_ms=sorted(times[k])[1])
            if k in COOLED:
                row["cool_ms"] = _cooled(fns[k], row["median_ms"])
        log_row(doc, "rows", row, path)


AT_CAP = ("cublas_chunks4096_in_place", "cublas_full", "b2_chunks4096_fp32", "b2_full_bf16")


def _rows(doc, path, kind: str, g, cublas_only: bool = False, cap_s: float = 0.0) -> None:
    da, h = _operands(kind, g)
    dw = _variants(da, h, cublas_only)
    _timed_rows(doc, path, kind, dw, torch.mm(da.t(), h, out_dtype=torch.float32))
    w = (torch.randn(VOCAB, D, device="cuda", generator=g) * 0.02).to(BF)
    b2 = _b2_variants(da, w)
    _timed_rows(doc, path, kind, b2, torch.mm(da, w, out_dtype=torch.float32))
    if cap_s > 0 and kind == "ce":  # (CODA's head GEMMs and stock's, each back to back at the power cap)
        arms_at_cap(doc, {k: (dw | b2)[k] for k in AT_CAP}, path, cap_s, rounds=2)
    del da, h, w, dw, b2
    torch.cuda.empty_cache()


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m scripts.probes.lm_head_dw", description=__doc__.split("\n\n")[0])
    ap.add_argument("--cublas-only", action="store_true", help="leave out quack's arms (no CuTeDSL needed: torch alone)")
    ap.add_argument("--at-cap", type=float, default=0.0, help="seconds each of " + ", ".join(AT_CAP) + " also runs "
                    "back to back at the power cap (graphed, two rounds, ce operands; 0: not)")
    args = ap.parse_args(argv)
    doc = {**header(), "kind": "probe_lm_head_dw",
           "shape": {"tokens": TOKENS, "vocab": VOCAB, "d": D, "chunk_rows": list(CHUNK_ROWS)},
           "timing": "GPU ms per whole dW (b2_*: per whole dX), 5 calls enqueued back to back after 3 warm-up calls, "
                     "in 3 alternations", "cublas_only": args.cublas_only, "rows": []}
    path = out_json("probe_lm_head_dw")
    g = torch.Generator(device="cuda").manual_seed(0)
    for kind in ("ce", "randn"):
        _rows(doc, path, kind, g, args.cublas_only, args.at_cap)
    print("wrote", path, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
