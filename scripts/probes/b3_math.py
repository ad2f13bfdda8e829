"""Probe (GPU): how much of the fp8 B3's time (``swiglu_bwd_e5m2_t_q`` with e4m3 y^T, the configured path) is its
epilogue's arithmetic, at the 1B MLP's shapes (M = 16384 tokens, d = 2048, F = 8192).

    source .gpu/part2/activate.sh && python3 -m scripts.probes.b3_math        (gpu_train.sh b3math)

B3 is epilogue-bound (docs/fp8.md, "B3's time, profiled"): its dSwiGLU costs about 10 FMUL, 3 FFMA and 2 MUFU a
(gate, up) pair in fp32. A formulation with fewer instructions (packed f16x2 arithmetic in e5m2 units, say) can
save at most what the arithmetic costs. ``lite`` is the same kernel call (same GEMM, tile config, overlapped
epilogues, operands, outputs, stores and reductions) with the arithmetic cut to one multiply per output: da =
(g, u) dy, y = g u. Its outputs are wrong by design; the difference in time is the ceiling of any cheaper
arithmetic. ``gemm`` is the bare fp8 GEMM of the same operands (cuBLAS ``_scaled_mm``, fast accumulation, bf16
dy: the floor's definition), so ``lite`` - ``gemm`` is what B3's operand and output traffic costs. Timing:
``scripts.bench.common.arms_at_cap`` (at the cap, each arm one CUDA graph, arms alternating for ``ROUNDS``).
Writes ``$OUT/probe_b3_math_<gpu>.json``.
"""

from __future__ import annotations

import os

import torch

from coda_titan.kernels import get_backend
from coda_titan.kernels.cute.epilogues import _T, _amax, _bf16_hi, _bf16_lo, _e5m2x2_as_f16  # (first: quack cache)
from quack.epilogue.frontend import gemm_epilogue  # noqa: E402
from quack.epilogue.ops import ColVecLoad, ColVecReduce, Scalar  # noqa: E402
from scripts.bench.common import arms_at_cap, header, log_row, out_json
from scripts.probes.preact import _operands

SECONDS, ROUNDS = 1.5, 3


def _lite(c, dyk):
    import cutlass.cute as cute

    g, u = _bf16_lo(c), _bf16_hi(c)
    dg, du = g * dyk, u * dyk
    return {"postact": g * u, "dsum": dg, "daq": _e5m2x2_as_f16(dg, du), "amax": cute.arch.fmax(dg, du, abs=True),
            "dagt": dg, "daut": du}


@gemm_epilogue(
    outputs=(_T("postact"), "daq", _T("dagt"), _T("daut")),
    ops={"rstd": ColVecLoad("rstd"), "scale": Scalar("scale"), "inv_scale": Scalar("inv_scale")},
    reduces={"dsum": ColVecReduce("dsum"), "amax": _amax()},
)
def lite_t_q_epi(acc, c, rstd, scale, inv_scale):
    """``dswiglu_rstd_preact_e5m2_t_q_epi``'s operands and outputs, one multiply an output."""
    return _lite(c, acc * (rstd * (scale * inv_scale)))


@gemm_epilogue(
    outputs=(_T("postact"), "daq", _T("dagt"), _T("daut")),
    ops={"rstd": ColVecLoad("rstd"), "scale": Scalar("scale"), "inv_scale": Scalar("inv_scale"),
         "inv_y": Scalar("inv_y")},
    reduces={"dsum": ColVecReduce("dsum"), "amax": _amax()},
)
def lite_t_yq_q_epi(acc, c, rstd, scale, inv_scale, inv_y):
    """``dswiglu_rstd_preact_e5m2_t_yq_q_epi``'s operands and outputs, one multiply an output."""
    out = _lite(c, acc * (rstd * (scale * inv_scale)))
    out["postact"] = out["postact"] * inv_y
    return out


def main():
    os.environ.setdefault("CODA_TITAN_AUTOTUNE", "1")
    from coda_titan.kernels.cute import norm_swiglu as ns  # (the cute package: the CUDA kernels registered)
    from coda_titan.kernels.cute._dispatch import scalar32

    cute = get_backend("cute")
    gen = torch.Generator(device="cuda").manual_seed(0)
    f2, b3 = _operands(cute, gen)
    _, a, _ = cute.norm_swiglu_q_fp8(**f2)  # (the pre-activations B3 reads, as preact's probe makes them)
    q = {k: b3[k] for k in ("rstd", "inv_scale", "inv_y")}

    def lite():
        return ns._b3_e5m2_t("b3_math_lite", (lite_t_q_epi, lite_t_yq_q_epi), b3["doutq"], b3["w_down_tq"].t(), a,
                             scale=scalar32(b3["scale"]), **q)

    one = torch.ones((), device="cuda")
    wt = b3["w_down_tq"].t()  # (W2^T (F, d) row-major, viewed (d, F): the column-major B _scaled_mm takes)

    def gemm():
        return torch._scaled_mm(b3["doutq"], wt, scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                use_fast_accum=True)

    arms = {"b3": lambda: cute.swiglu_bwd_e5m2_t_q(**b3, a=a), "lite": lite, "gemm": gemm}
    doc = {**header(), "kind": "probe_b3_math", "shapes": {"M": a.shape[0], "F": a.shape[1] // 2},
           "seconds": SECONDS, "overlapped": ns.overlap.enabled(True), "rows": []}
    path = out_json("probe_b3_math")
    arms_at_cap(doc, arms, path, SECONDS, ROUNDS)  # (each arm's first call, in the graphing, compiles it)
    log_row(doc, "rows", {"summary": {k: v for k, v in doc.items() if k.startswith("median_ms_")}}, path)


if __name__ == "__main__":
    main()
