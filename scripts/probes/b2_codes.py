"""Probe (GPU): the fp8 B2 writing D's e5m2 codes itself (``norm_residual_bwd_fp8_codes``) against the fp8 B2 and
the gradient cast pass that makes them now (``quantize_grad_t`` on its D and amax), at the 1B shapes of both B2 sites
(M = 16384 tokens, d = 2048): W13's dgrad (K = 16384) and W_qkv's (K = 3072).

    source .gpu/part2/activate.sh && python3 -m scripts.probes.b2_codes        (gpu_train.sh b2codes)

Arms per site: ``b2`` (the fp8 B2 alone), ``b2_pass`` (it and the cast pass: the configured path), ``codes_hit``
(the new op, its provisional scale D's current one: the epilogue's codes kept), ``codes_miss`` (a power of two
off: the codes made again from D). Timing as ``preact``: each arm back to back for ``SECONDS`` (``at_cap``), the
arms alternating for ``ROUNDS`` rounds; each arm replayed as one CUDA graph (``graphed``), since eager calls of
the QKV site's 0.3 ms programs are host-bound (the first run: the GPU under 650 W and at up to 1,965 MHz); the
codes compared byte for byte with the pass's on the same D. Writes ``$OUT/probe_b2_codes_<gpu>.json``.
"""

from __future__ import annotations

import os

import torch

from coda_titan.kernels import get_backend
from coda_titan.kernels.scaling import E5M2_MAX, inv_scale_from_amax, pow2_floor, quantize_e5m2
from scripts.bench.common import at_cap, header, log_row, out_json

M, D = 16384, 2048
SITES = {"w13": 16384, "qkv": 3072}  # (the dgrad's K: W13's 2F rows, W_qkv's q + k + v rows)
SECONDS, ROUNDS = 1.5, 3
BF = torch.bfloat16


def _operands(cute, k, gen):
    def r(*s):
        return torch.randn(*s, device="cuda", generator=gen)

    da = r(M, k) * 1e-2
    inv_da = inv_scale_from_amax(da.abs().amax(), E5M2_MAX)
    wq, s_w = cute.quantize_tensorwise(w=(r(k, D) * D**-0.5).to(BF))
    return dict(daq=quantize_e5m2(da, inv_da), weight_tq=wq.t().contiguous(), scale=s_w / inv_da, x=r(M, D).to(BF),
                gamma=(torch.rand(D, device="cuda", generator=gen) + 0.5).to(BF),
                rstd=torch.rand(M, device="cuda", generator=gen) + 0.5, zdz=r(M), dresidual=r(M, D).to(BF))


def _bytes_apart(a, b) -> int:
    return int((a.reshape(-1).view(torch.uint8) != b.reshape(-1).view(torch.uint8)).sum())


def _graphed(fn, doc, arm):
    """``fn`` captured as one CUDA graph (its replay), or ``fn`` itself where capture fails (said in ``doc``)."""
    try:
        fn()  # (a warm call on the capture's side stream's memory pool is not needed: the kernels are built)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        g.replay()
        torch.cuda.synchronize()
        doc.setdefault("graphed", {})[arm] = True
        return g.replay
    except Exception as e:  # noqa: BLE001 - time it eagerly, and say why
        doc.setdefault("graphed", {})[arm] = f"{type(e).__name__}: {str(e)[:200]}"
        return fn


def main():
    os.environ.setdefault("CODA_TITAN_AUTOTUNE", "1")  # (tuned, as in training)
    os.environ.setdefault("CODA_TITAN_EPI_C_STAGES", "2")  # (the configs' [coda] b2_c_stages)
    import coda_titan.kernels.cute  # noqa: F401

    cute = get_backend("cute")
    gen = torch.Generator(device="cuda").manual_seed(0)
    doc = {**header(), "kind": "probe_b2_codes", "shapes": {"M": M, "d": D, "K": SITES}, "seconds": SECONDS,
           "c_stage_base": os.environ["CODA_TITAN_EPI_C_STAGES"], "rows": []}
    path = out_json("probe_b2_codes")
    arms = {}
    for site, k in SITES.items():
        kw = _operands(cute, k, gen)
        d, _, amax = cute.norm_residual_bwd_fp8(**kw)
        inv = pow2_floor(inv_scale_from_amax(amax.float(), E5M2_MAX)).reshape(1)
        for name, prov in (("hit", inv), ("miss", inv * 2)):
            d, _, amax, dq, dq_t, s = cute.norm_residual_bwd_fp8_codes(**kw, inv_prov=prov)
            want = cute.quantize_grad_t(t=d, amax=amax)
            doc[f"{site}_{name}_bytes_apart"] = [_bytes_apart(x, y) for x, y in zip((dq, dq_t, s), want)]

        def b2_pass(kw=kw):
            d, _, amax = cute.norm_residual_bwd_fp8(**kw)
            return cute.quantize_grad_t(t=d, amax=amax)

        arms[f"{site}_b2"] = lambda kw=kw: cute.norm_residual_bwd_fp8(**kw)
        arms[f"{site}_b2_pass"] = b2_pass
        arms[f"{site}_codes_hit"] = lambda kw=kw, p=inv: cute.norm_residual_bwd_fp8_codes(**kw, inv_prov=p)
        arms[f"{site}_codes_miss"] = lambda kw=kw, p=inv * 2: cute.norm_residual_bwd_fp8_codes(**kw, inv_prov=p)
    for fn in arms.values():  # (compile + tune before any timing)
        fn()
    torch.cuda.synchronize()
    arms = {arm: _graphed(fn, doc, arm) for arm, fn in arms.items()}
    log_row(doc, "rows", {"bytes_apart": {k: v for k, v in doc.items() if k.endswith("bytes_apart")}}, path)
    for r in range(ROUNDS):
        for arm, fn in arms.items():
            log_row(doc, "rows", {"round": r, "arm": arm, **at_cap(fn, SECONDS)}, path)
    for arm in arms:
        ts = sorted(row["sustained_ms"] for row in doc["rows"] if row.get("arm") == arm)
        doc[f"median_ms_{arm}"] = ts[len(ts) // 2]
    log_row(doc, "rows", {"summary": {k: v for k, v in doc.items() if k.startswith("median_ms_")}}, path)


if __name__ == "__main__":
    main()
