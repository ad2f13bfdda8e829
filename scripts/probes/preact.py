"""Probe (GPU): ``[coda] fp8_preact``'s two kernels against the ones they replace, at the 1B MLP's shapes
(M = 16384 tokens, d = 2048, F = 8192): F2 writing a as e4m3 codes (``norm_swiglu_qa_fp8``) against F2 writing
a in bf16 (``norm_swiglu_q_fp8``), and the fp8 B3 with da^T reading the codes (``swiglu_bwd_e5m2_t_qa``) against
it reading the bf16 a (``swiglu_bwd_e5m2_t_q``), both with e4m3 y^T (the configured path).

    source .gpu/part2/activate.sh && python3 -m scripts.probes.preact        (gpu_train.sh preactprobe)

Timing: each arm back to back for ``SECONDS`` (``at_cap``: the GPU's ms per call over the second half, at the
power cap a training step runs at), the arms alternating for ``ROUNDS`` rounds; B3's outputs compared bit for bit
with the bf16-a B3 on the decoded a (the GPU test's claim, on these shapes). Writes ``$OUT/probe_preact_<gpu>.json``.
"""

from __future__ import annotations

import os

import torch

from coda_titan.kernels import get_backend
from coda_titan.kernels._common import interleave_rows
from coda_titan.kernels.scaling import E5M2_MAX, inv_scale_from_amax, pow2_floor, quantize_e4m3
from scripts.bench.common import at_cap, header, log_row, out_json

M, D, F = 16384, 2048, 8192
SECONDS, ROUNDS = 2.0, 2
BF = torch.bfloat16


def _operands(cute, gen):
    h = torch.randn(M, D, device="cuda", generator=gen).to(BF)
    inv_h = inv_scale_from_amax(h.float().abs().amax())
    hq = quantize_e4m3(h.float(), inv_h)
    w1, w3 = ((torch.randn(F, D, device="cuda", generator=gen) * D**-0.5).to(BF) for _ in range(2))
    w13q, s_w = cute.quantize_tensorwise(w=interleave_rows(w1, w3))
    rstd = torch.rand(M, device="cuda", generator=gen) + 0.5
    f2 = dict(hq=hq, rstd=rstd, w13q=w13q, scale=s_w / inv_h, inv_y=torch.tensor(8.0, device="cuda"), out_dtype=BF)
    dout = (torch.randn(M, D, device="cuda", generator=gen) * 1e-2).to(BF)
    w2 = (torch.randn(D, F, device="cuda", generator=gen) * F**-0.5).to(BF)
    dq, s_d = cute.quantize_grad(t=dout)
    (w2q_t,), (s_w2,), _ = cute.fp8_weights(ws=[w2.t().contiguous()])
    b3 = dict(doutq=dq, w_down_tq=w2q_t, scale=s_d * s_w2, rstd=rstd,
              inv_scale=inv_scale_from_amax(torch.tensor(0.5, device="cuda"), E5M2_MAX), inv_y=torch.tensor(30.0, device="cuda"))
    return f2, b3


PINNED = {"128x192_pp_2x1": dict(tile_m=128, tile_n=192, cluster_m=2, cluster_n=1),
          "192x128_pp_1x2": dict(tile_m=192, tile_n=128, cluster_m=1, cluster_n=2)}  # (the two tuners' picks)


def _pinned_f2(f2, inv_a) -> dict:
    """Both F2s on each of ``PINNED``'s pingpong tile configs (the epilogue calls of their ops, not tuned): is a
    difference the epilogue's or the tuner's pick's?"""
    from quack.gemm_config import GemmConfig

    from coda_titan.kernels.cute.epilogues import fp8_rstd_swiglu_q_epi
    from coda_titan.kernels.cute.preact_e4m3 import fp8_rstd_swiglu_qa_epi
    from coda_titan.kernels.scaling import E4M3

    one = lambda t: t.float().reshape(1)  # noqa: E731
    ops = dict(rstd=f2["rstd"], scale=one(f2["scale"]), inv_y=one(f2["inv_y"]))
    a = torch.empty(M, 2 * F, device="cuda", dtype=BF)
    yq, aq = torch.empty(M, F, device="cuda", dtype=E4M3), torch.empty(M, 2 * F, device="cuda", dtype=E4M3)
    arms = {}
    for name, kw in PINNED.items():
        cfg = GemmConfig(**kw, pingpong=True, is_dynamic_persistent=False, device_capacity=9)
        _KEEP.append(cfg)
        arms[f"f2_bf16_a_{name}"] = lambda cfg=cfg: fp8_rstd_swiglu_q_epi(
            f2["hq"], f2["w13q"].t(), None, out={"D": a, "postact": yq}, tuned=False, config=cfg, **ops)
        arms[f"f2_e4m3_a_{name}"] = lambda cfg=cfg: fp8_rstd_swiglu_qa_epi(
            f2["hq"], f2["w13q"].t(), None, out={"postact": yq, "aq": aq.view(BF)}, store_d=False, tuned=False,
            config=cfg, inv_a=one(inv_a), **ops)
    return arms


_KEEP = []  # (quack's eager call cache keys a pinned config by its id)


def main():
    os.environ.setdefault("CODA_TITAN_AUTOTUNE", "1")  # (F2 autotuned, as in training; B3's config is pinned)
    import coda_titan.kernels.cute  # noqa: F401

    cute = get_backend("cute")
    gen = torch.Generator(device="cuda").manual_seed(0)
    f2, b3 = _operands(cute, gen)
    _, a, _ = cute.norm_swiglu_q_fp8(**f2)
    inv_a = pow2_floor(inv_scale_from_amax(a.float().abs().amax() * 2))  # (the configured margin: one power of two)
    _, aq, _, amax_a = cute.norm_swiglu_qa_fp8(**f2, inv_a=inv_a)
    a_dec = (aq.float() / inv_a).to(BF)
    arms = {
        "f2_bf16_a": lambda: cute.norm_swiglu_q_fp8(**f2),
        "f2_e4m3_a": lambda: cute.norm_swiglu_qa_fp8(**f2, inv_a=inv_a),
        "b3_bf16_a": lambda: cute.swiglu_bwd_e5m2_t_q(**b3, a=a_dec),
        "b3_e4m3_a": lambda: cute.swiglu_bwd_e5m2_t_qa(**b3, aq=aq, a_scale=1 / inv_a, out_dtype=BF),
    }
    arms.update(_pinned_f2(f2, inv_a))
    got, want = arms["b3_e4m3_a"](), arms["b3_bf16_a"]()
    bits = [int((x.reshape(-1).view(torch.uint8) != y.reshape(-1).view(torch.uint8)).sum()) for x, y in zip(got, want)]
    doc = {**header(), "kind": "probe_preact", "shapes": {"M": M, "d": D, "F": F}, "seconds": SECONDS,
           "b3_bytes_apart_per_output": bits, "amax_a": amax_a.item(), "inv_a": inv_a.item(), "rows": []}
    path = out_json("probe_preact")
    for arm, fn in arms.items():  # (compile + tune before any timing)
        fn()
    torch.cuda.synchronize()
    for r in range(ROUNDS):
        for arm, fn in arms.items():
            log_row(doc, "rows", {"round": r, "arm": arm, **at_cap(fn, SECONDS)}, path)
    for arm in arms:
        ts = sorted(row["sustained_ms"] for row in doc["rows"] if row["arm"] == arm)
        doc[f"median_ms_{arm}"] = ts[len(ts) // 2]
    log_row(doc, "rows", {"summary": {k: v for k, v in doc.items() if k.startswith("median_ms_")}}, path)


if __name__ == "__main__":
    main()
