"""Probe (CPU, fp64): what rounding the logits to bf16 does to the cross-entropy's gradient, taken two ways.

    stored      lse, loss and softmax all of the rounded logits l16 (stock's bf16 head; CODA's F4 since c6d0abd)
    lse_fp32    softmax exp(l16 - lse(l)) with the log-sum-exp of the unrounded logits l (CODA's F4 before:
                its epilogue took lse and the target logit from fp32 r * acc, its gradient pass read l16)

and each of the two with dlogits cast to e5m2 (``_e5m2``: the fp8 head's ``ce_grad_e5m2``, at its power-of-two
scale from the largest r, 1 here, so that |dlogits| <= 1 never saturates). Then a third way, the numerics of a
head without its gradient pass (docs/cute_backend.md, "F4 without its gradient pass"), against ``stored_bf16``
(``stored`` with dlogits rounded to bf16, as the bf16 head's gradient pass stores them):

    exp_stored  F4 would store e_n = exp(l_n - c) in bf16 instead of the logits (c a per-row constant known before
                the GEMM) and zero at the target, so that the row as stored is dlogits / s off the target,
                s = exp(c - lse(l)) a per-row scale for the backward GEMMs' epilogues, which add the target's
                term, (p_t - 1) times a row of W or H, in fp32; lse and the loss of the unrounded logits.
                c = max_n l_n here (``exp_stored``), and
                c = ||h|| max_n ||w_n|| - 70 (``exp_stored_bound``: Cauchy-Schwarz, computable before the GEMM,
                70 keeping every e below e^70); ``c_margin_min``: the smallest max_n l_n - c over the rows, which
                must stay above -87 for the top e to be a normal bf16. Their dW has the wgrad GEMM's operand
                s h rounded to bf16 (a rounding the bf16 head's wgrad, on H as it is, does not have).

Everything but those roundings is exact (fp64), so each error below is the rounding's alone. Rows are a
calibrated model's: H ~ N(0, 1), W ~ N(0, sigma^2 / d), each row's target drawn from its own softmax; sigma sets
how confident the rows are (the median of each row's largest probability is in the file). For each sigma: the
relative error (norm-wise, against exact) of dlogits = softmax - onehot, of dH = dlogits W and of
dW = dlogits^T H, the loss's mean absolute error per row, and the mean |row sum of dlogits| (zero when the
softmax sums to one).

Last (``dw_rounding``), what e5m2 dlogits do to dW_out = dlogits^T H summed over batches, as the optimizer's
momentum sums it: for each sigma and a hidden state with or without a direction every row shares (H + m, |m| =
``shared`` times a row's own norm, as a trained residual stream's common features; m W^T is then a per-token bias
of the logits, which the targets are drawn with), ``batches`` batches of rows, each batch's dlogits cast by
round-to-nearest-even (``e5m2``, ``fp8_lm_head_dw`` before the sixty-third session), stochastically
(``e5m2_sr``: ``quantize_e5m2_sr``, a seed a batch) and to bf16 (``bf16``). Per variant: one batch's relative dW
error, the summed dW's, and the coherence ||sum_k err_k|| / sqrt(sum_k ||err_k||^2): 1 for errors independent
between batches, sqrt(batches) for one error repeated. The same for dH = dlogits W (``fp8_lm_head_dgrad``: B2 on
the same codes) and for what a weight gradient below the head sums of it, G = dH^T H over the batches' tokens;
there also ``e5m2_sr_tx``, the stochastic codes with each row's target entry exact (``fp8_lm_head_dgrad`` since the
sixty-seventh session: B2 adds the target's term unrounded; dW keeps the target's code, so this cast's dW columns
are not the program's).

    python -m scripts.probes.ce_rounding          # writes benchmarks/results/probe_ce_rounding_cpu.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from coda_titan.kernels.lm_head_ce import exp_offsets, stored_logits
from coda_titan.kernels.scaling import E5M2_MAX, pow2_floor, quantize_e5m2, quantize_e5m2_sr, sr_offsets

SIGMAS = (0.5, 1.0, 2.0, 3.0, 4.0, 6.0)
VARIANTS = ("stored", "lse_fp32", "stored_e5m2", "lse_fp32_e5m2", "stored_bf16", "exp_stored", "exp_stored_bound")


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
        bound = exp_offsets(h, torch.ones(rows, dtype=h.dtype), w)  # (the reference's offsets; r = 1 here)
        offsets = {"exp_stored": logits.amax(-1), "exp_stored_bound": bound}
        row = {"sigma": sigma, "top_p_median": float(p.amax(-1).median()), "loss_mean": float(exact["loss"].mean()),
               "c_margin_min": float((logits.amax(-1) - bound).min())}
        for name in VARIANTS:
            dw = None
            if name in offsets:
                dl, dw = _exp_stored(logits, targets, offsets[name], lse, h)
                loss = exact["loss"]  # (lse and the target logit of the unrounded logits: exact here)
            else:
                z, z_lse = got[name.removesuffix("_e5m2").removesuffix("_bf16")]
                dl = torch.exp(z - z_lse[:, None]) - onehot
                if name.endswith("_e5m2"):
                    dl = quantize_e5m2(dl, inv).double() / inv
                if name.endswith("_bf16"):
                    dl = dl.to(torch.bfloat16).double()
                loss = z_lse - z.gather(1, targets[:, None]).squeeze(1)
            e, dw_exact = dl - exact["dlogits"], exact["dlogits"].t() @ h
            row[name] = {
                "dlogits": float(e.norm() / exact["dlogits"].norm()),
                "dh": float((e @ w).norm() / (exact["dlogits"] @ w).norm()),
                "dw": float((e.t() @ h if dw is None else dw - dw_exact).norm() / dw_exact.norm()),
                "loss_abs_err": float((loss - exact["loss"]).abs().mean()),
                "row_sum_abs": float(dl.sum(-1).abs().mean()),
            }
        out.append(row)
    return out


def dw_rounding(rows: int = 1024, vocab: int = 8192, dim: int = 256, sigmas=(1.0, 3.0), shared=(0.0, 2.0),
                batches: int = 8, seed: int = 0) -> list[dict]:
    """One row per (sigma, shared): dW_out's error under each cast of dlogits, per batch and summed over batches
    (the module's docstring)."""
    inv = pow2_floor(torch.tensor(E5M2_MAX, dtype=torch.float64))
    offsets = sr_offsets(0, rows, vocab, "cpu")
    casts = {"e5m2": lambda dl, k, t: quantize_e5m2(dl, inv).double() / inv,
             "e5m2_sr": lambda dl, k, t: quantize_e5m2_sr(dl, inv, k + 1, offsets).double() / inv,
             "e5m2_sr_tx": lambda dl, k, t: (quantize_e5m2_sr(dl, inv, k + 1, offsets).double() / inv).scatter(
                 1, t[:, None], dl.gather(1, t[:, None])),
             "bf16": lambda dl, k, t: dl.to(torch.bfloat16).double()}
    out = []
    for sigma in sigmas:
        for sh in shared:
            g = torch.Generator().manual_seed(seed)
            w = torch.randn(vocab, dim, generator=g, dtype=torch.float64) * (sigma / dim ** 0.5)
            m = torch.randn(dim, generator=g, dtype=torch.float64)
            m = m * (sh * dim ** 0.5 / m.norm())
            exact_sum, g_sum, one, one_dh = 0.0, 0.0, {}, {}
            errs, g_errs = {c: [] for c in casts}, {c: [] for c in casts}
            for k in range(batches):
                h = torch.randn(rows, dim, generator=g, dtype=torch.float64) + m
                p = torch.softmax(h @ w.t(), -1)
                targets = torch.multinomial(p, 1, generator=g).squeeze(1)
                dl = p - torch.nn.functional.one_hot(targets, vocab).double()
                dw, dh = dl.t() @ h, dl @ w
                exact_sum, g_sum = exact_sum + dw, g_sum + dh.t() @ h
                for c, cast in casts.items():
                    err = cast(dl, k, targets) - dl
                    errs[c].append(err.t() @ h)
                    g_errs[c].append((err @ w).t() @ h)
                    if k == 0:
                        one[c], one_dh[c] = float(errs[c][0].norm() / dw.norm()), float((err @ w).norm() / dh.norm())
            row = {"sigma": sigma, "shared": sh, "batches": batches}
            for c in casts:
                row[c] = {"dw": one[c], **_summed(errs[c], exact_sum, "dw_sum", "coherence"), "dh": one_dh[c],
                          **_summed(g_errs[c], g_sum, "dh_wgrad_sum", "dh_coherence")}
            out.append(row)
    return out


def _summed(errs: list, exact, name: str, coherence: str) -> dict:
    """The summed error's norm relative to ``exact``'s and its coherence over the batches (the module's docstring)."""
    total = sum(errs)
    return {name: float(total.norm() / exact.norm()),
            coherence: float(total.norm() / sum(e.norm() ** 2 for e in errs) ** 0.5)}


def _exp_stored(logits, targets, c, lse, h):
    """(dlogits, dW) as a head without its gradient pass would make them: e = exp(l - c) rounded to bf16 and zero
    at the target, the row times s = exp(c - lse), and the target's own p_t - 1 unrounded (the backward GEMMs would
    add its term in their epilogues in fp32: -(1 - p_t) times W's target row, exact in bf16, for dH); dW is
    e^T (s h) with s h rounded to bf16 (the wgrad GEMM's operand), plus (p_t - 1) h scattered to the targets' rows."""
    e = torch.exp(logits - c[:, None]).scatter(1, targets[:, None], 0.0).to(torch.bfloat16).double()
    s = torch.exp(c - lse)
    p_t = torch.exp(logits.gather(1, targets[:, None]) - lse[:, None])
    dw = e.t() @ (s[:, None] * h).to(torch.bfloat16).double()
    dw = dw.index_add(0, targets, (p_t - 1) * h)
    return (e * s[:, None]).scatter(1, targets[:, None], p_t - 1), dw


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
           "rows": measure(args.rows, args.vocab, args.dim),
           "dw_rounding": dw_rounding(args.rows, args.vocab, args.dim)}
    path = out_json("probe_ce_rounding", cpu=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    for r in doc["rows"]:
        print(f"sigma {r['sigma']}: top p {r['top_p_median']:.2f}; dlogits error "
              + ", ".join(f"{v} {r[v]['dlogits']:.2e}" for v in VARIANTS))
    for r in doc["dw_rounding"]:
        print(f"sigma {r['sigma']}, shared {r['shared']}: dW summed over {r['batches']} batches, relative error "
              + ", ".join(f"{c} {r[c]['dw_sum']:.2e} (coherence {r[c]['coherence']:.2f})" for c in ("e5m2", "e5m2_sr",
                                                                                                   "bf16")))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
