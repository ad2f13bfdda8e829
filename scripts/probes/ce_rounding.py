"""Probe (CPU, fp64): what rounding the logits to bf16 does to the cross-entropy's gradient, taken two ways.

    stored      lse, loss and softmax all of the rounded logits l16 (stock's bf16 head; CODA's F4 since c6d0abd)
    lse_fp32    softmax exp(l16 - lse(l)) with the log-sum-exp of the unrounded logits l (CODA's F4 before:
                its epilogue took lse and the target logit from fp32 r * acc, its gradient pass read l16)

and each of the two with dlogits cast to e5m2 (``_e5m2``: the fp8 head's ``ce_grad_e5m2``, at its power-of-two
scale from the largest r, 1 here, so that |dlogits| <= 1 never saturates).

Everything but those roundings is exact (fp64), so each error below is the rounding's alone. Rows are a
calibrated model's: H ~ N(0, 1), W ~ N(0, sigma^2 / d), each row's target drawn from its own softmax; sigma sets
how confident the rows are (the median of each row's largest probability is in the file). For each sigma: the
relative error (norm-wise, against exact) of dlogits = softmax - onehot, of dH = dlogits W and of
dW = dlogits^T H, the loss's mean absolute error per row, and the mean |row sum of dlogits| (zero when the
softmax sums to one).

    python -m scripts.probes.ce_rounding          # writes benchmarks/results/probe_ce_rounding_cpu.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from coda_titan.kernels.lm_head_ce import stored_logits
from coda_titan.kernels.scaling import E5M2_MAX, pow2_floor, quantize_e5m2

SIGMAS = (0.5, 1.0, 2.0, 3.0, 4.0, 6.0)
VARIANTS = ("stored", "lse_fp32", "stored_e5m2", "lse_fp32_e5m2")


def measure(rows: int = 1024, vocab: int = 8192, dim: int = 256, sigmas=SIGMAS, seed: int = 0) -> list[dict]:
    """One row of results per sigma (see the module's docstring)."""
    out = []
    inv = pow2_floor(torch.tensor(E5M2_MAX, dtype=torch.float64))  # (the fp8 head's E5M2_MAX / max r, r = 1)
    for sigma in sigmas:
        g = torch.Generator().manual_seed(seed)
        h = torch.randn(rows, dim, generator=g, dtype=torch.float64)
        w = torch.randn(vocab, dim, generator=g, dtype=torch.float64) * (sigma / dim ** 0.5)
        logits = h @ w.t()
        p = torch.softmax(logits, -1)
        targets = torch.multinomial(p, 1, generator=g).squeeze(1)
        onehot = torch.nn.functional.one_hot(targets, vocab).double()
        lse = torch.logsumexp(logits, -1)
        exact = {"dlogits": p - onehot, "loss": lse - logits.gather(1, targets[:, None]).squeeze(1)}
        l16 = stored_logits(logits, torch.bfloat16)
        got = {"stored": (l16, torch.logsumexp(l16, -1)), "lse_fp32": (l16, lse)}
        row = {"sigma": sigma, "top_p_median": float(p.amax(-1).median()), "loss_mean": float(exact["loss"].mean())}
        for name in VARIANTS:
            z, z_lse = got[name.removesuffix("_e5m2")]
            dl = torch.exp(z - z_lse[:, None]) - onehot
            if name.endswith("_e5m2"):
                dl = quantize_e5m2(dl, inv).double() / inv
            loss = z_lse - z.gather(1, targets[:, None]).squeeze(1)
            e = dl - exact["dlogits"]
            row[name] = {
                "dlogits": float(e.norm() / exact["dlogits"].norm()),
                "dh": float((e @ w).norm() / (exact["dlogits"] @ w).norm()),
                "dw": float((e.t() @ h).norm() / (exact["dlogits"].t() @ h).norm()),
                "loss_abs_err": float((loss - exact["loss"]).abs().mean()),
                "row_sum_abs": float(dl.sum(-1).abs().mean()),
            }
        out.append(row)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--dim", type=int, default=256)
    args = ap.parse_args(argv)
    from scripts.bench.common import header, out_json

    doc = {**header(cpu=True), "kind": "probe_ce_rounding",
           "command": "python -m scripts.probes.ce_rounding " + " ".join(sys.argv[1:] if argv is None else argv),
           "shape": {"rows": args.rows, "vocab": args.vocab, "dim": args.dim},
           "rows": measure(args.rows, args.vocab, args.dim)}
    path = out_json("probe_ce_rounding", cpu=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    for r in doc["rows"]:
        print(f"sigma {r['sigma']}: top p {r['top_p_median']:.2f}; dlogits error "
              + ", ".join(f"{v} {r[v]['dlogits']:.2e}" for v in VARIANTS))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
