"""Probe (GPU): F4's gradient pass and dW tail (``kernels/cute/lm_head_ce.py``), the in-place Triton pass
(``kernels/cute/ce_grad_pass.py``) in several block / warp shapes against the inductor program it replaced,
and the last chunk's dW GEMM writing bf16 against the fp32 sum then a cast; then the configured pass (block 4096,
8 warps) alone, writing da's e5m2 codes beside it (``fp8_lm_head_dw`` before the sixty-third session: round to
nearest), and writing them stochastically rounded (``sr_seed``, the knob's codes now, its seed on the device as in
the model), and in the other block / warp shapes: what the codes and the stochastic rounding's hash cost a
chunk, and whether the hash's integer work wants less of it or another shape; then the configured head's chunk
work (that pass, then ``transpose_8bit`` into the (V, M) code buffer) against ``ce_codes_t``'s pass storing the
codes token-major itself, in several tile shapes (rows ``codes``; these rows fold each row's 501 per-tile
partials, as in the head).

    source .gpu/part2/activate.sh && python3 -m scripts.probes.ce_pass        (gpu_train.sh cepassprobe)

At the 1B shape (a 2048-row chunk of 128256 logits, d = 2048): the pass reads the chunk's bf16 logits
and writes da (1.05 GB moved: about 0.31 ms at the H100's 3.35 TB/s). Each variant's da and corr (B2's row
vector, made from zdz) are compared with the inductor program's (da: elements that differ and the largest
difference; corr: the largest relative difference). Timing: 20 calls enqueued back to back after 3 warm-up calls, GPU ms per
call, in 5 alternations of the variants (``epi_stages``' timer). The in-place variants overwrite their
input each call; the arithmetic and the bytes moved do not depend on the values. Writes
``$OUT/probe_ce_pass_<gpu>.json``.
"""

from __future__ import annotations

import torch

from scripts.bench.common import header, log_row, out_json
from scripts.probes.epi_stages import _first_calls, _streamed

ROWS, VOCAB, D = 2048, 128256, 2048
SHAPES = ((4096, 8), (8192, 8), (8192, 16), (2048, 4), (16384, 16))
# ``ce_codes_t``'s tile shapes: (rows a program, columns a step, column ranges, warps)
CODES_T = ((32, 256, 8, 8), (32, 128, 8, 4), (16, 256, 8, 4), (32, 256, 4, 8), (64, 128, 8, 8))


def _runnable(doc, path, key: str, fns: dict) -> dict:
    """``fns`` without the variants whose first call fails (a tile shape Triton cannot compile), each of those
    logged in ``doc[key]`` with its error: the others are still timed."""
    ok = _first_calls(fns)
    for k in fns:
        if "error" in ok[k]:
            log_row(doc, key, {"variant": k, "error": ok[k]["error"]}, path)
    return {k: f for k, f in fns.items() if "error" not in ok[k]}


def _inputs(g):
    logits = (torch.randn(ROWS, VOCAB, device="cuda", generator=g) * 3).to(torch.bfloat16)
    targets = torch.randint(0, VOCAB, (ROWS,), device="cuda", generator=g)
    targets[::7] = -100
    lf = logits.float()
    lse = torch.logsumexp(lf, -1)
    tgt_logit = lf.gather(1, targets.clamp(min=0)[:, None]).squeeze(1)
    rstd = torch.rand(ROWS, device="cuda", generator=g) + 0.5
    return logits, lse, tgt_logit, targets, rstd


def _pass_rows(doc, path):
    from coda_titan.kernels.cute.ce_grad_pass import ce_grad_inplace
    from coda_titan.kernels.cute.lm_head_ce import _ce_grad_math

    g = torch.Generator(device="cuda").manual_seed(0)
    logits, lse, tl, targets, rstd = _inputs(g)
    inductor = torch.compile(_ce_grad_math, dynamic=False, fullgraph=True)
    da_ref, zdz_ref = inductor(logits, lse, tl, targets, rstd)
    buf = logits.clone()
    fns = {"inductor": lambda: inductor(logits, lse, tl, targets, rstd)}
    for b, w in SHAPES:
        fns[f"triton_b{b}_w{w}"] = lambda b=b, w=w: ce_grad_inplace(buf, lse[:, None], tl, targets, rstd, -100, D,
                                                                     None, b, w)
    fns = _runnable(doc, path, "pass", fns)
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(5):
        for k, f in fns.items():
            times[k].append(_streamed(f)["gpu_ms"])
    for k in fns:
        row = {"variant": k, "gpu_ms": times[k], "median_ms": sorted(times[k])[2]}
        if k != "inductor":
            b, w = (int(x[1:]) for x in k.split("_")[1:])
            buf.copy_(logits)
            da, corr = ce_grad_inplace(buf, lse[:, None], tl, targets, rstd, -100, D, None, b, w)
            corr_ref = -(rstd * rstd / D) * zdz_ref
            diff = (da.float() - da_ref.float()).abs()
            row.update(da_elements_differ=int((da != da_ref).sum()), da_max_abs_diff=float(diff.max()),
                       corr_max_rel_diff=float(((corr - corr_ref).abs() / corr_ref.abs().clamp(min=1e-30)).max()))
        log_row(doc, "pass", row, path)


def _codes_rows(doc, path):
    from coda_titan.kernels.cute import transpose_8bit
    from coda_titan.kernels.cute.ce_codes_t import ce_grad_codes_t
    from coda_titan.kernels.cute.ce_grad_pass import ce_grad_inplace

    g = torch.Generator(device="cuda").manual_seed(2)
    logits, lse, tl, targets, rstd = _inputs(g)
    buf, inv = logits.clone(), torch.tensor(2.0 ** 15, device="cuda")
    parts = torch.logsumexp(logits.float().view(ROWS, -1, 256), -1)  # (as F4's epilogue gives them: 501 a row)
    args = (buf, parts, tl, targets, rstd, -100, D, None, 4096, 8)
    seed = torch.tensor(7, device="cuda")  # (a device tensor, as ``sr_seed_of`` gives the model: no copy a call)
    fns = {"bf16_da": lambda: ce_grad_inplace(*args),
           "codes_nearest": lambda: ce_grad_inplace(*args, codes_inv=inv),
           "codes_stochastic": lambda: ce_grad_inplace(*args, codes_inv=inv, sr_seed=seed)}
    daq_t = torch.empty((VOCAB, 8 * ROWS), device="cuda", dtype=torch.float8_e5m2)  # (the head's (V, M) buffer)

    def then_transpose():
        daq = ce_grad_inplace(*args, codes_inv=inv, sr_seed=seed, row0=ROWS)[2]
        transpose_8bit.launch(daq, daq_t[:, ROWS:2 * ROWS])

    fns["codes_stochastic_then_transpose"] = then_transpose  # (the configured head's per-chunk work)
    loss = torch.empty(ROWS, device="cuda")
    for rb, bv, ns, w in CODES_T:  # (``ce_codes_t``: the codes stored token-major by the pass)
        fns[f"codes_t_rb{rb}_bv{bv}_s{ns}_w{w}"] = lambda rb=rb, bv=bv, ns=ns, w=w: ce_grad_codes_t(
            buf, parts, tl, targets, rstd, -100, D, loss, inv, daq_t, ROWS, seed, ROWS, rb, bv, ns, w)
    for b, w in SHAPES[1:]:  # (the stochastic pass in the other block / warp shapes: more work an element)
        fns[f"codes_stochastic_b{b}_w{w}"] = lambda b=b, w=w: ce_grad_inplace(*args[:8], b, w, codes_inv=inv,
                                                                               sr_seed=seed)
    fns = _runnable(doc, path, "codes", fns)
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(5):
        for k, f in fns.items():
            times[k].append(_streamed(f)["gpu_ms"])
    buf.copy_(logits)  # (the same codes both ways, but where the folds' lse differ in a last bit)
    then_transpose()
    ref_codes = daq_t[:, ROWS:2 * ROWS].clone()
    buf.copy_(logits)
    ce_grad_codes_t(buf, parts, tl, targets, rstd, -100, D, loss, inv, daq_t, ROWS, seed, ROWS)
    same = float((daq_t[:, ROWS:2 * ROWS].view(torch.uint8) == ref_codes.view(torch.uint8)).double().mean())
    for k in fns:
        row = {"variant": k, "gpu_ms": times[k], "median_ms": sorted(times[k])[2]}
        log_row(doc, "codes", {**row, "codes_equal_share": same} if k.startswith("codes_t_") else row, path)


def _tail_rows(doc, path):
    from quack.gemm_interface import gemm_add, gemm_add_inplace

    g = torch.Generator(device="cuda").manual_seed(1)
    da = (torch.randn(ROWS, VOCAB, device="cuda", generator=g) * 1e-3).to(torch.bfloat16)
    h = torch.randn(ROWS, D, device="cuda", generator=g).to(torch.bfloat16)
    dw32 = torch.randn(VOCAB, D, device="cuda", generator=g) * 1e-2

    def cast():
        acc = dw32.clone()
        gemm_add_inplace(da.t(), h, acc)
        return acc.to(torch.bfloat16)

    def fused():
        dw32.clone()  # (the same clone as ``cast``: equal bytes moved besides the tail itself)
        return gemm_add(da.t(), h, dw32, out_dtype=torch.bfloat16)

    fns = {"fp32_then_cast": cast, "gemm_add_bf16_out": fused}
    fns = _runnable(doc, path, "tail", fns)
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(5):
        for k, f in fns.items():
            times[k].append(_streamed(f)["gpu_ms"])
    same = torch.equal(cast(), fused())
    for k in fns:
        log_row(doc, "tail", {"variant": k, "gpu_ms": times[k], "median_ms": sorted(times[k])[2],
                              "bits_equal": same}, path)


def main() -> int:
    doc = {**header(), "kind": "probe_ce_pass", "shape": {"rows": ROWS, "vocab": VOCAB, "d": D},
           "timing": "GPU ms per call of 20 enqueued back to back after 3 warm-up calls, in 5 alternations of the variants",
           "pass": [], "tail": [], "codes": []}
    path = out_json("probe_ce_pass")
    _pass_rows(doc, path)
    _tail_rows(doc, path)
    _codes_rows(doc, path)
    print("wrote", path, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
