"""Probe (GPU): can F2 write its SwiGLU output y as e4m3 (the down-projection's fp8 operand) from its
epilogue on SM90, and what does it save over a separate cast pass? Issue 19's first experiment.

    source .gpu/part2/activate.sh && python3 -m scripts.probes.fp8_gated_store

quack 0.6.5 stores a gated (paired-column) output of 8 bits on SM100/SM120 only. On SM90 everything
else it needs exists (docs/fp8.md, "The 8-bit paired-column (gated) store on SM90"); one trace-time
assertion in ``TileStore.to_params`` refuses it. ``GatedNarrowStore`` (``coda_titan.kernels.cute.epilogues``,
first written here) is quack's ``TileStore`` with that method letting 8 bits through on SM90. At the 1B shapes (M = 16384,
d = 2048, F = 8192) the probe runs, with quack's default config and then autotuned:

* ``f2_bf16_y``: the F2 program as shipped (``norm_swiglu_fp8``: e4m3 operands, bf16 y);
* ``f2_bf16_y_cast``: the same, then y cast to e4m3 by an inductor pass (the fallback design);
* ``f2_e4m3_y``: F2 with y = sat(SwiGLU * inv_y) stored as e4m3 by its epilogue;
* ``f2_bf16_y_amax_cast``: bf16 y, then its amax and e4m3 cast (the model's ``fp8_down_proj`` path);
* ``f2_e4m3_y_amax``: e4m3 y as ``f2_e4m3_y`` plus each row's amax |y| reduced in the epilogue
  (a ``ColVecReduce`` in acc_pair mode; the model's ``norm_swiglu_q_fp8``), checked against amax |bf16 y|
  (the reduced amax is of the fp32 y: within one bf16 rounding, 2^-8 relative);

checks the e4m3 codes of ``f2_e4m3_y`` against the reference's (the same math in fp32, quantized by
``quantize_e4m3``) and against the kernel's own bf16 y quantized the same way: the fp8 accumulator's
precision, the epilogue's fast math and a bf16 rounding may move a value by one e4m3 step, a
misplaced element by more; the check is the fraction of codes more than one step off the kernel's
own bf16 y (the first run, which counted code differences against the reference alone, found 3.2%
differing, with a largest code distance of 156, which a sign flip of a value near zero also gives). Writes ``$OUT/probe_fp8_gated_store_<gpu>.json``.
"""

from __future__ import annotations

import torch
from quack.activation import swiglu
from quack.epilogue.frontend import gemm_epilogue
from quack.epilogue.math import pack, unpack
from quack.epilogue.ops import ColVecLoad, Scalar

from coda_titan.kernels.cute.epilogues import GatedNarrowStore, fp8_rstd_swiglu_q_epi


@gemm_epilogue(
    outputs=(GatedNarrowStore("postact", gated=True),),
    ops={"rstd": ColVecLoad("rstd"), "scale": Scalar("scale"), "inv_y": Scalar("inv_y")},
    mode="acc_pair",
)
def fp8_swiglu_e4m3_epi(acc, rstd, scale, inv_y):
    """F2 on e4m3 operands with an e4m3 y: v = (s_a s_w) acc saved as D; y = sat(SwiGLU(r v) * inv_y)
    (the f32 -> e4m3 store converts with saturation)."""
    v = acc * scale
    g, u = unpack(v)
    gs, us = unpack(v * rstd)
    return {"D": pack(g, u), "postact": swiglu(gs, us) * inv_y}


def amax_variant(row: dict, f2_e4m3_amax, f2_bf16, y8, y16, inv_y) -> None:
    """Time F2 with e4m3 y and its amax sink (the model's ``norm_swiglu_q_fp8``) and check both: the
    reduced amax is of y in fp32, before the bf16 rounding of y16, so within one bf16 rounding (u =
    2^-8 relative) of amax |y16|; the codes as f2_e4m3_y's (one e4m3 step of y16's own codes)."""
    from coda_titan.kernels.scaling import e4m3_step, quantize_e4m3
    from scripts.bench.common import bench

    try:
        row["ms"]["f2_e4m3_y_amax"] = bench(f2_e4m3_amax)
        res = f2_e4m3_amax()
        codes_amax = y8.clone()
        f2_bf16()
        torch.cuda.synchronize()
        amax_k, amax16 = res["amax"].amax().item(), y16.float().abs().amax().item()
        row["amax_kernel"], row["amax_bf16_y"] = amax_k, amax16
        row["amax_ok"] = abs(amax_k - amax16) <= 2.0**-8 * amax16
        want_q = quantize_e4m3(y16.float(), inv_y)
        err = (codes_amax.float() - want_q.float()).abs()
        row["amax_variant_over_one_step"] = float((err > e4m3_step(want_q.float()) * 1.0001).float().mean())
    except Exception as e:  # noqa: BLE001 - the experiment's outcome, recorded
        row["f2_e4m3_y_amax_error"] = f"{type(e).__name__}: {str(e)[:2000]}"


def main() -> int:
    from coda_titan.kernels import norm_swiglu as ref
    from coda_titan.kernels.cute import _dispatch
    from coda_titan.kernels.cute.epilogues import fp8_rstd_swiglu_preact_epi
    from coda_titan.kernels.scaling import E4M3, e4m3_step, inv_scale_from_amax, quantize_e4m3
    from scripts.bench.common import bench, header, log_row, out_json

    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator(device="cuda").manual_seed(0)
    m, d, f = 16384, 2048, 8192
    hq = (torch.randn(m, d, device="cuda", generator=gen) * 64).clamp(-448, 448).to(E4M3)
    w13q = (torch.randn(2 * f, d, device="cuda", generator=gen) * 64).clamp(-448, 448).to(E4M3)
    rstd = (1 + 0.1 * torch.rand(m, device="cuda", generator=gen)).float()
    scale = torch.tensor(1.0 / (64 * 64 * d**0.5), device="cuda")
    y_ref32, _ = ref.norm_swiglu_fp8(hq=hq, rstd=rstd, w13q=w13q, scale=scale, out_dtype=torch.float32)
    inv_y = inv_scale_from_amax(y_ref32.abs().amax())
    codes_ref = quantize_e4m3(y_ref32, inv_y)
    a = torch.empty(m, 2 * f, device="cuda", dtype=torch.bfloat16)
    y16 = torch.empty(m, f, device="cuda", dtype=torch.bfloat16)
    y8 = torch.empty(m, f, device="cuda", dtype=E4M3)
    ops = dict(rstd=rstd, scale=_dispatch.scalar32(scale))
    cast = torch.compile(lambda t, s: (t.float() * s).clamp(-448, 448).to(E4M3), dynamic=False)
    amax_cast = torch.compile(lambda t, s: ((t.float() * s).clamp(-448, 448).to(E4M3), t.abs().amax()), dynamic=False)
    doc = {**header(), "kind": "probe_fp8_gated_store", "M": m, "d": d, "F": f,
           "timing": "triton.testing.do_bench median after one untimed call", "runs": []}
    out = out_json("probe_fp8_gated_store")
    for tuned in (False, True):
        row = {"tuned": tuned, "ms": {}}

        def f2_bf16():
            fp8_rstd_swiglu_preact_epi(hq, w13q.t(), None, out={"D": a, "postact": y16}, tuned=tuned, **ops)

        def f2_e4m3():
            fp8_swiglu_e4m3_epi(hq, w13q.t(), None, out={"D": a, "postact": y8}, tuned=tuned,
                                inv_y=_dispatch.scalar32(inv_y), **ops)
        row["ms"]["f2_bf16_y"] = bench(f2_bf16)
        row["ms"]["f2_bf16_y_cast"] = bench(lambda: (f2_bf16(), cast(y16, inv_y)))
        row["ms"]["f2_bf16_y_amax_cast"] = bench(lambda: (f2_bf16(), amax_cast(y16, inv_y)))  # the model's path today
        amax_variant(row, lambda: fp8_rstd_swiglu_q_epi(hq, w13q.t(), None, out={"D": a, "postact": y8}, tuned=tuned,
                                                         inv_y=_dispatch.scalar32(inv_y), **ops), f2_bf16, y8, y16, inv_y)
        try:
            row["ms"]["f2_e4m3_y"] = bench(f2_e4m3)
            f2_e4m3()
            torch.cuda.synchronize()
            f2_bf16()
            torch.cuda.synchronize()
            # against the fp32 reference, and against the kernel's own bf16 y quantized (the same
            # epilogue math: what differs there is the store path, i.e. the layout, not the rounding)
            for key, want_q in (("ref", codes_ref), ("own_bf16", quantize_e4m3(y16.float(), inv_y))):
                got, want = (t.view(torch.uint8).int() for t in (y8, want_q))
                got, want = (torch.where(c == 0x80, 0, c) for c in (got, want))  # -0 and +0 alike
                differ = got != want  # (sign-magnitude codes: neighbours of one sign differ by 1)
                err = (y8.float() - want_q.float()).abs()
                row[f"codes_differing_{key}"] = float(differ.float().mean())
                row[f"codes_max_step_{key}"] = int((got - want).abs()[differ].max()) if bool(differ.any()) else 0
                # dequantized error against the e4m3 step of the wanted value (2^-3 relative; 2^-9 absolute
                # in the subnormal range): one step is rounding, more is a misplaced element
                step = e4m3_step(want_q.float())
                row[f"over_one_step_{key}"] = float((err > step * 1.0001).float().mean())
                idx = (err > step * 1.0001).nonzero()[:6].tolist()
                row[f"examples_{key}"] = [(i, j, y8[i, j].float().item(), want_q[i, j].float().item(), y16[i, j].float().item() * inv_y.item())
                                          for i, j in idx]
            row["codes_ok"] = row["over_one_step_own_bf16"] == 0.0
        except Exception as e:  # noqa: BLE001 - the experiment's outcome, recorded
            row["f2_e4m3_y_error"] = f"{type(e).__name__}: {str(e)[:2000]}"
        log_row(doc, "runs", row, out)
    print("wrote", out, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
