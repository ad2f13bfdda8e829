"""Probe (GPU): tile configs of the bf16 programs under sustained load (the 700 W cap), against a short burst.

    source .gpu/part2/activate.sh && python3 -m scripts.probes.sustained [--seconds 2] [--rounds 2]

Why: quack's autotuner times each candidate for a few milliseconds on a cool GPU, while a training step
runs the same kernels back to back for hundreds of milliseconds at the power cap, where every step of
CODA and stock alike draws 680-700 W and CODA's runs at lower SM clocks (1,440 against 1,500 MHz in the
bf16 headline). Under a power cap a config's time is its energy per call over the cap, so a config
that moves fewer bytes per FLOP (a wider tile, a cluster) can win at the cap while it loses the burst.

For B3 (``swiglu_bwd``), F2 (``norm_swiglu``) and B2 of W13 (``norm_residual_bwd``) at the 1B shapes
(M = 16384, d = 2048) and a few pinned tile configs each, with cuBLAS's bare GEMM of the same shape as
a reference: ``burst_ms``, the median of 5 synced calls after 0.3 s idle (what a tuner sees), and
``sustained_ms``, calls enqueued back to back for ``--seconds`` with the GPU's time per call over the
last half (CUDA events), beside the SM clock and power ``nvidia-smi`` sampled over that half. The arms
alternate in ``--rounds`` rounds so that drift falls on each alike. Writes
``$OUT/probe_sustained_<gpu>.json`` after every row.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from scripts.bench.common import BF, M, at_cap, header, log_row, out_json, synced_ms
from scripts.probes.fp8_configs import _cfg

D, F = 2048, 8192
# (tile_m, tile_n, pingpong, cluster_m, cluster_n)
CONFIGS = [(128, 128, True, 1, 2), (128, 128, True, 2, 1), (128, 256, False, 1, 2), (256, 128, False, 1, 2),
           (256, 128, False, 2, 1)]


def _parse(text: str) -> tuple:
    """``128x192pp1x2`` -> (128, 192, True, 1, 2)."""
    import re

    m = re.fullmatch(r"(\d+)x(\d+)(pp|coop)(\d)x(\d)", text)
    if not m:
        raise SystemExit(f"--configs: {text!r} is not tmxtn[pp|coop]cmxcn")
    return int(m[1]), int(m[2]), m[3] == "pp", int(m[4]), int(m[5])


def _programs(gen):
    """{name: (call of a pinned config, bare cuBLAS call)} on random operands (never zeros)."""
    from coda_titan.kernels.cute import epilogues, stages
    from quack.epilogue.library import rstd_swiglu_preact_epi

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(BF)

    rstd = torch.rand(M, device="cuda", generator=gen) + 0.5
    h, w13 = rnd(M, D), rnd(2 * F, D, scale=D**-0.5)
    dout, w2, a = rnd(M, D, scale=1e-2), rnd(D, F, scale=F**-0.5), rnd(M, 2 * F, scale=2)
    da, x, dres = rnd(M, 2 * F, scale=1e-2), rnd(M, D), rnd(M, D, scale=1e-2)
    gamma, corr = 1 + 0.1 * torch.randn(D, device="cuda", generator=gen), torch.randn(M, device="cuda", generator=gen) * 1e-5
    f2_out = {"D": torch.empty(M, 2 * F, device="cuda", dtype=BF), "postact": torch.empty(M, F, device="cuda", dtype=BF)}
    b3_out = {"D": torch.empty_like(a), "postact": torch.empty(M, F, device="cuda", dtype=BF)}
    b2_out = {"D": torch.empty_like(x)}

    def f2(cfg):
        return lambda: rstd_swiglu_preact_epi(h, w13.t(), None, out=f2_out, tuned=False, config=cfg, rstd=rstd)

    def b3(cfg):
        def call():
            with stages.capped(2):
                epilogues.dswiglu_rstd_preact_epi(dout, w2, a, out=b3_out, tuned=False, config=cfg, rstd=rstd)
        return call

    def b2(cfg):
        def call():
            with stages.capped(2):
                epilogues.norm_residual_bwd_epi(da, w13, dres, out=b2_out, tuned=False, config=cfg, y=x, w=gamma,
                                                corr=corr)
        return call

    return {"norm_swiglu": (f2, lambda: h @ w13.t()), "swiglu_bwd": (b3, lambda: dout @ w2),
            "norm_residual_bwd_w13": (b2, lambda: da @ w13)}


def _burst(fn) -> float:
    time.sleep(0.3)
    return statistics.median(synced_ms(fn, 5))


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.probes.sustained", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--programs", nargs="*", default=None, help="only these (norm_swiglu swiglu_bwd norm_residual_bwd_w13)")
    ap.add_argument("--configs", nargs="*", default=None,
                    help="tile configs as tmxtn[pp|coop]cmxcn, e.g. 128x192pp1x2 (default: CONFIGS)")
    args = ap.parse_args()
    configs = [_parse(c) for c in args.configs] if args.configs else CONFIGS
    import coda_titan.kernels.cute  # noqa: F401  (installs the hooks)

    doc = {**header(), "kind": "probe_sustained", "M": M, "d": D, "ffn": F, "seconds": args.seconds,
           "configs": [list(c) for c in configs], "rows": []}
    path = out_json("probe_sustained")
    keep = []  # (quack's eager call cache keys a pinned config by its id)
    arms = {}
    for name, (make, bare) in _programs(torch.Generator(device="cuda").manual_seed(0)).items():
        if args.programs and name not in args.programs:
            continue
        arms[(name, "cublas")] = bare
        for t in configs:
            cfg = _cfg(t)
            keep.append(cfg)
            arms[(name, "x".join(map(str, t[:2])) + ("pp" if t[2] else "coop") + f"{t[3]}x{t[4]}")] = make(cfg)
    ok = {}
    for key, fn in arms.items():  # (the first call of each compiles)
        try:
            fn()
            torch.cuda.synchronize()
            ok[key] = None
        except Exception as e:  # noqa: BLE001 - recorded, the other arms still run
            ok[key] = f"{type(e).__name__}: {str(e)[:300]}"
    for rnd in range(args.rounds):
        for (name, arm), fn in arms.items():
            row = {"round": rnd, "program": name, "arm": arm}
            if ok[(name, arm)]:
                row["error"] = ok[(name, arm)]
            else:
                row["burst_ms"] = _burst(fn)
                row.update(at_cap(fn, args.seconds))
            log_row(doc, "rows", row, path)
    print("wrote", path, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
