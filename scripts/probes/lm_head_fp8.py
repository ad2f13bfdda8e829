"""Probe (GPU): how much an fp8 LM head could take off the 1B step, at the power cap. The LM head is the step's
largest GEMM family left in bf16 (issue 19: it stays bf16 as in float8 + compile; an fp8 head may be an option,
off by default). Bare GEMMs of the 1B's head (16384 tokens, vocab 128256, dim 2048; ``CHUNK`` rows a chunk as
the configs' ``ce_chunk_rows``), each arm one CUDA graph at the cap (``scripts.bench.common.arms_at_cap``):

- ``bf16_*``: cuBLAS bf16 as the head runs today: per chunk the logits H_c W^T and dH_c = G_c W, and dW
  accumulated over the chunks (``addmm_``);
- ``fp8_*``: ``torch._scaled_mm`` tensorwise, torchao's formats and accumulation (fast accumulation in the forward
  only): e4m3 H and W, e5m2 dlogits G; dW as one GEMM over all tokens (G^T e5m2 row-major times H), bf16 out.

``*_fwd`` / ``*_dgrad`` / ``*_wgrad`` time one family, ``*_all`` the three together. The operands' casts and
transposed copies (W^T e4m3 once a step; G and G^T e5m2 in the CE's epilogue) are not in the fp8 arms: this is
the ceiling of the lever, not a design. With ``--programs`` (added after the first run), two more arms: the
head's whole programs as the model calls them, ``coda::lm_head_ce`` (bf16) against the casts of H and W, W^T's
codes and ``coda::lm_head_ce_fp8``; and the configured head (``fp8_lm_head_fwd`` with ``fp8_lm_head_dw``) without
and with ``fp8_lm_head_dgrad`` (B2 on dW's codes), ``program_fwd_dw[_dgrad]``. ``--programs-only``: those arms
alone. Writes ``$OUT/probe_lm_head_fp8_<gpu>.json``.

    source .gpu/part2/activate.sh && python3 -m scripts.probes.lm_head_fp8      (gpu_train.sh lmheadfp8)
"""

from __future__ import annotations

import torch

M, V, K = 16384, 128256, 2048
CHUNK = 4096
SECONDS, ROUNDS = 1.5, 3
E4M3, E5M2, BF = torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16


def operands(seed: int = 0) -> dict:
    """Random operands of the head's sizes (never zeros: a GEMM's power depends on its operands' bits)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(M, K, device="cuda", generator=gen).to(BF)
    w = (torch.randn(V, K, device="cuda", generator=gen) * 0.02).to(BF)
    g = torch.randn(M, V, device="cuda", generator=gen).to(BF)  # (dlogits, in the units its e5m2 cast would see)
    return {"h": h, "w": w, "g": g, "h8": h.to(E4M3), "w8": (w * 32).to(E4M3), "wt8": (w * 32).t().contiguous().to(E4M3),
            "g8": g.to(E5M2), "gt8": g.t().contiguous().to(E5M2), "ht8": h.t().contiguous().to(E4M3),
            "one": torch.ones((), device="cuda"), "logits": torch.empty(CHUNK, V, device="cuda", dtype=BF),
            "dh": torch.empty(M, K, device="cuda", dtype=BF), "dw": torch.empty(V, K, device="cuda", dtype=BF)}


def arms(t: dict) -> dict:
    chunks = [slice(i, i + CHUNK) for i in range(0, M, CHUNK)]
    one = t["one"]

    def bf16_fwd():
        for c in chunks:
            torch.mm(t["h"][c], t["w"].t(), out=t["logits"])

    def bf16_dgrad():
        for c in chunks:
            torch.mm(t["g"][c], t["w"], out=t["dh"][c])

    def bf16_wgrad():
        t["dw"].zero_()
        for c in chunks:
            t["dw"].addmm_(t["g"][c].t(), t["h"][c])

    def fp8_fwd():
        for c in chunks:
            torch._scaled_mm(t["h8"][c], t["w8"].t(), one, one, out_dtype=BF, use_fast_accum=True, out=t["logits"])

    def fp8_dgrad():
        for c in chunks:
            torch._scaled_mm(t["g8"][c], t["wt8"].t(), one, one, out_dtype=BF, out=t["dh"][c])

    def fp8_wgrad():
        torch._scaled_mm(t["gt8"], t["ht8"].t(), one, one, out_dtype=BF, out=t["dw"])

    fams = {"bf16": (bf16_fwd, bf16_dgrad, bf16_wgrad), "fp8": (fp8_fwd, fp8_dgrad, fp8_wgrad)}
    out = {}
    for prec, fns in fams.items():
        for name, fn in zip(("fwd", "dgrad", "wgrad"), fns):
            out[f"{prec}_{name}"] = fn
        out[f"{prec}_all"] = lambda fns=fns: [fn() for fn in fns]
    return out


def program_arms(t: dict) -> dict:
    """The head's programs on the cute backend, gradients on: bf16 as configured, and fp8 with its casts."""
    from coda_titan.kernels import get_backend

    be = get_backend("cute")
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(M, K, device="cuda", generator=gen).to(BF)
    gamma = (torch.rand(K, device="cuda", generator=gen) + 0.5).to(BF)
    rstd = torch.rsqrt(x.float().square().mean(-1) + 1e-5)
    h = (x.float() * gamma.float()).to(BF)
    targets = torch.randint(0, V, (M,), device="cuda", generator=gen)
    kw = dict(rstd=rstd, x=x, gamma=gamma, targets=targets, chunk_rows=CHUNK, compute_grad=True)

    def casts():  # (each fp8 arm's casts of H and W, timed with it, as the model makes them each step)
        (hq, s_h), (wq, s_w) = be.quantize_tensorwise(w=h), be.quantize_tensorwise(w=t["w"])
        return dict(hq=hq, s_h=s_h, weight_q=wq, s_w=s_w)

    def fp8():
        c = casts()
        return be.lm_head_ce_fp8(**c, weight_tq=be.fp8_weight_t(w=c["weight_q"]), **kw)

    def fwd_dw(dgrad: bool):
        return be.lm_head_ce(h=h, weight=t["w"], **casts(), fp8_dw=True, fp8_dgrad=dgrad, **kw)

    return {"program_bf16": lambda: be.lm_head_ce(h=h, weight=t["w"], **kw), "program_fp8": fp8,
            "program_fwd_dw": lambda: fwd_dw(False), "program_fwd_dw_dgrad": lambda: fwd_dw(True)}


def main():
    import argparse

    from scripts.bench.common import arms_at_cap, header, log_row, out_json

    ap = argparse.ArgumentParser()
    ap.add_argument("--programs", action="store_true", help="also the head's whole programs")
    ap.add_argument("--programs-only", action="store_true", help="the head's whole programs alone")
    a = ap.parse_args()
    t = operands()
    doc = {**header(), "kind": "probe_lm_head_fp8", "shapes": {"M": M, "V": V, "K": K, "chunk": CHUNK},
           "seconds": SECONDS, "rows": []}
    path = out_json("probe_lm_head_fp8")
    chosen = {} if a.programs_only else arms(t)
    arms_at_cap(doc, {**chosen, **(program_arms(t) if a.programs or a.programs_only else {})}, path, SECONDS, ROUNDS)
    log_row(doc, "rows", {"summary": {k: v for k, v in doc.items() if k.startswith("median_ms_")}}, path)


if __name__ == "__main__":
    main()
