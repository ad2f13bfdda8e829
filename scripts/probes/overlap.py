"""Probe (GPU): programs with a D output, with and without overlapped pingpong epilogues.

    source .gpu/part2/activate.sh && python3 -m scripts.probes.overlap

``coda_titan/kernels/cute/overlap.py`` lets both pingpong warpgroups run their epilogues at once. At
the 1B shapes (M = 16384 tokens) this times F1 (quack's ``rms_partial_epi``: the out-projection, K =
2048, and the down-projection, K = 8192) and B2 (``rms_bwd_apply_epi``: the QKV dgrad, K = 3072, and
W13's, K = 16384) on B3's pinned tile config (128 x 128 pingpong, cluster 1 x 2), plain and
overlapped, beside the bare cuBLAS GEMM of the same shape; the two kernels' outputs are compared bit
for bit. Median of CUDA-event timings of 20 calls after 3 warm-up calls (the first compiles). Writes
``$OUT/probe_overlap_<gpu>.json`` after every row. (B3: ``scripts/probes/fp8_configs.py``, ``b3_t_ov``.)
"""

from __future__ import annotations

import torch

from scripts.bench.common import header, log_row, out_json
from scripts.probes.fp8_configs import _time

M, D = 16384, 2048
SHAPES = [("f1", "out_proj", 2048), ("f1", "down_proj", 8192), ("b2", "qkv_dgrad", 3072), ("b2", "w13_dgrad", 16384)]


def _program(kind, k, cfg, g):
    """(call, its outputs, the bare GEMM) of one program at K = k."""
    from quack.epilogue.library import rms_bwd_apply_epi, rms_partial_epi

    bf = torch.bfloat16
    a = (torch.randn(M, k, generator=g, device="cuda") * (1.0 if kind == "f1" else 1e-2)).to(bf)
    gamma = 1 + 0.1 * torch.randn(D, generator=g, device="cuda")
    if kind == "f1":
        w = (torch.randn(D, k, generator=g, device="cuda") * k**-0.5).to(bf)
        res = torch.randn(M, D, generator=g, device="cuda").to(bf)
        out = {"D": torch.empty_like(res), "resid_out": torch.empty_like(res)}
        keep = {}

        def call():
            keep["r"] = rms_partial_epi(a, w.t(), res, out=out, tuned=False, config=cfg, weight=gamma)
        return call, lambda: [out["D"], out["resid_out"], keep["r"]["sqsum"]], lambda: a @ w.t()
    w = (torch.randn(k, D, generator=g, device="cuda") * k**-0.5).to(bf)
    x = torch.randn(M, D, generator=g, device="cuda").to(bf)
    dres = (torch.randn(M, D, generator=g, device="cuda") * 1e-2).to(bf)
    corr = torch.randn(M, generator=g, device="cuda") * 1e-3
    out, keep = {"D": torch.empty_like(x)}, {}

    def call():
        keep["r"] = rms_bwd_apply_epi(a, w, dres, out=out, tuned=False, config=cfg, y=x, w=gamma, corr=corr)
    return call, lambda: [out["D"], keep["r"]["dw"]], lambda: a @ w


def main() -> int:
    import coda_titan.kernels.cute  # noqa: F401  (installs the overlap hooks)
    from coda_titan.kernels.cute import overlap
    from quack.gemm_config import GemmConfig

    def cfg():
        return GemmConfig(tile_m=128, tile_n=128, pingpong=True, cluster_m=1, cluster_n=2, is_dynamic_persistent=False,
                          device_capacity=9)

    doc = {**header(), "kind": "probe_overlap", "M": M, "d": D, "config": "128 x 128 pingpong, cluster 1 x 2",
           "timing": "median of 20 CUDA-event timings after 3 warm-up calls", "rows": []}
    path = out_json("probe_overlap")
    configs = []  # (kept alive: quack's eager call cache keys a pinned config by its id)
    for kind, name, k in SHAPES:
        plain_cfg, ov_cfg = cfg(), cfg()
        configs += [plain_cfg, ov_cfg]
        plain, plain_out, bare = _program(kind, k, plain_cfg, torch.Generator(device="cuda").manual_seed(k))
        ov, ov_out, _ = _program(kind, k, ov_cfg, torch.Generator(device="cuda").manual_seed(k))
        row = {"program": kind, "gemm": name, "K": k, "bare_cublas_ms": _time(bare), "plain_ms": _time(plain)}
        try:
            with overlap.requested():
                row["overlap_ms"] = _time(ov)
            plain()
            want = [t.clone() for t in plain_out()]
            with overlap.requested():
                ov()
            row["bits_equal"] = all(torch.equal(g, w) for g, w in zip(ov_out(), want))
        except Exception as e:  # noqa: BLE001 - record the failure and go on with the next shape
            row["error"] = f"{type(e).__name__}: {str(e)[:500]}"
        log_row(doc, "rows", row, path)
    print("wrote", path, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
