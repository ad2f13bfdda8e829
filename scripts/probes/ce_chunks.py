"""Probe (GPU): the LM head + cross-entropy program (F4) at each token-chunk size, against its bare GEMMs.

    source .gpu/part2/activate.sh && python3 -m scripts.probes.ce_chunks [--d 2048] [--chunks 2048 4096 8192 16384]
        [--zdz acc rounded]

``[coda] ce_chunk_rows`` trades the chunk's logits buffer (chunk x vocab) against per-chunk overheads
(a GEMM per chunk and direction, the gradient pass, the dW accumulation). At M = 16384 tokens and the
LLaMA-3 vocabulary it times (median of triton's do_bench after one untimed call that compiles and
autotunes) the whole program with its gradients at each chunk size, the peak memory it allocates,
and once the bare GEMMs of the full head (forward, dgrad, wgrad, cuBLAS); with ``--zdz``, each chunk size under
each of those ``CODA_TITAN_F4_ZDZ`` modes (B2 as an fp32 GEMM and a row pass, "acc", the default, against its
epilogue, "rounded"), interleaved per chunk size. Writes
``$OUT/probe_ce_chunks_<gpu>.json`` after every row.
"""

from __future__ import annotations

import argparse
import os

import torch

from scripts.bench.common import BF, EPS, M, VOCAB, bench, header, log_row, out_json, peak_gib


def _bare_gemms(h, w, gen) -> dict:
    """cuBLAS ms of the full head's forward, dgrad and wgrad (the full logits exist only here)."""
    logits = torch.empty(h.shape[0], w.shape[0], device="cuda", dtype=BF)
    dl = torch.randn(h.shape[0], w.shape[0], device="cuda", generator=gen).to(BF)
    return {"fwd": bench(lambda: torch.mm(h, w.t(), out=logits)), "dgrad": bench(lambda: torch.mm(dl, w)),
            "wgrad": bench(lambda: torch.mm(dl.t(), h))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.probes.ce_chunks", description=__doc__.split("\n\n")[0])
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--chunks", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    ap.add_argument("--zdz", nargs="+", default=[None], help="CODA_TITAN_F4_ZDZ modes (default: as set)")
    args = ap.parse_args(argv)
    from coda_titan.kernels import get_backend
    from coda_titan.kernels.lm_head_ce import F4_ZDZ_ENV, f4_zdz_mode

    be = get_backend("cute")
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator(device="cuda").manual_seed(0)
    d = args.d
    x = torch.randn(M, d, device="cuda", generator=gen).to(BF)
    gamma = (1 + 0.1 * torch.randn(d, device="cuda", generator=gen)).to(BF)
    w = (torch.randn(VOCAB, d, device="cuda", generator=gen) * d**-0.5).to(BF)
    tgt = torch.randint(0, VOCAB, (M,), device="cuda", generator=gen)
    h = (x.float() * gamma.float()).to(BF)
    rstd = torch.rsqrt(x.float().pow(2).mean(-1) + EPS)
    doc = {**header(), "kind": "probe_ce_chunks", "M": M, "d": d, "vocab": VOCAB,
           "timing": "triton.testing.do_bench median after one untimed call", "rows": []}
    doc["bare_gemm_ms"] = _bare_gemms(h, w, gen)
    torch.cuda.empty_cache()
    bare = sum(doc["bare_gemm_ms"].values())
    out = out_json("probe_ce_chunks")
    for rows in args.chunks:
        def run():
            return be.lm_head_ce(h=h, rstd=rstd, x=x, gamma=gamma, weight=w, targets=tgt, chunk_rows=rows,
                                 compute_grad=True)
        for mode in args.zdz:
            if mode is not None:
                os.environ[F4_ZDZ_ENV] = mode
            ms = bench(run)
            torch.cuda.empty_cache()
            log_row(doc, "rows", {"chunk_rows": rows, "zdz": f4_zdz_mode(), "ms": ms,
                                  "over_bare_gemms": ms / bare, "peak_gib": peak_gib(run)}, out)
    print("wrote", out, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
