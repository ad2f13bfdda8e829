"""Probe (GPU): the LM head + cross-entropy with its gradients at the 1B shape, CODA's program against quack
0.6.5's two chunked linear-CE pipelines, before any of quack's scaled-exp path is adapted (docs/fp8.md,
"The LM head without its CE pass").

    source .gpu/part2/activate.sh && python3 -m scripts.probes.lce_scaled_exp      (gpu_train.sh lcescaledexp)

Arms, each the whole forward with dX and dW (16384 tokens, d = 2048, vocabulary 128256), per chunk size:

- ``coda``: ``coda::lm_head_ce`` on the cute backend (the deferred rstd, the final norm's backward in B2's
  epilogue, dW summed over chunks in fp32 and written in bf16 by the last chunk's GEMM);
- ``quack_chunked``: ``chunked_linear_cross_entropy_fwd`` (logits stored, quack's CE pass over them in
  place, dx and dW GEMMs; the last chunk's dW left to the backward, timed here after the loop);
- ``quack_scaled_exp``: ``scaled_exp_linear_cross_entropy_fwd`` (no logits: bf16 exp with power-of-two
  offsets from the first GEMM's epilogue, a Triton glue, dx and dW through the A-operand transform, dW
  accumulated by TMA reduce-add; dW left in fp32).

The quack arms have no rstd and no norm backward (their input is the normalized H), so ``quack_chunked``
against ``quack_scaled_exp`` is what the pipeline change buys, and ``coda`` beside them what CODA's
program costs now. Timing: GPU ms (the probes' back-to-back event timer, 3 calls after 3 warm-up calls)
in 3 alternations, the median. Writes ``$OUT/probe_lce_scaled_exp_<gpu>.json``.
"""

from __future__ import annotations

import torch

from scripts.bench.common import header, log_row, out_json
from scripts.probes.epi_stages import _alternated, _first_calls

TOKENS, VOCAB, D = 16384, 128256, 2048
CHUNK_ROWS = (2048, 4096)
BF = torch.bfloat16


def _inputs(g):
    x = torch.randn(TOKENS, D, device="cuda", generator=g).to(BF)
    gamma = (1 + 0.1 * torch.randn(D, device="cuda", generator=g)).to(BF)
    weight = (torch.randn(VOCAB, D, device="cuda", generator=g) * D**-0.5).to(BF)
    targets = torch.randint(0, VOCAB, (TOKENS,), device="cuda", generator=g)
    targets[::97] = -100
    h = (x.float() * gamma.float()).to(BF)  # CODA's un-normalized H = X * gamma
    rstd = torch.rsqrt(x.float().square().mean(-1) + 1e-5)
    hn = (h.float() * rstd[:, None]).to(BF)  # the normalized H quack's arms take
    return x, gamma, weight, targets, h, rstd, hn


def _arms(x, gamma, weight, targets, h, rstd, hn, rows: int) -> dict:
    import coda_titan.kernels.cute  # noqa: F401  (the CUDA kernels of the coda ops)
    from quack.gemm_interface import gemm_add
    from quack.linear_cross_entropy import chunked_linear_cross_entropy_fwd, scaled_exp_linear_cross_entropy_fwd

    def coda():
        return torch.ops.coda.lm_head_ce(h, rstd, x, gamma, weight, targets, rows, True)

    def quack_chunked():
        loss, dx, dw, last_d, last_x = chunked_linear_cross_entropy_fwd(hn, weight, targets, chunk_size=rows)
        return loss, dx, gemm_add(last_d.t(), last_x, dw, out_dtype=BF) if dw is not None else None

    def quack_scaled_exp():
        return scaled_exp_linear_cross_entropy_fwd(hn, weight, targets, rows)

    return {"coda": coda, "quack_chunked": quack_chunked, "quack_scaled_exp": quack_scaled_exp}


def main() -> int:
    doc = {**header(), "kind": "probe_lce_scaled_exp", "shape": {"tokens": TOKENS, "vocab": VOCAB, "d": D},
           "timing": "GPU ms per whole LM head (forward, dX, dW), 3 calls enqueued back to back after 3 warm-up "
                     "calls, in 3 alternations", "rows": []}
    path = out_json("probe_lce_scaled_exp")
    g = torch.Generator(device="cuda").manual_seed(0)
    ins = _inputs(g)
    for rows in CHUNK_ROWS:
        fns = _arms(*ins, rows)
        ok = _first_calls(fns)
        times = _alternated(fns, ok, reps=3)
        for k in fns:
            row = {"chunk_rows": rows, "arm": k, **ok[k]}
            if times[k]:
                row.update(gpu_ms=times[k], median_ms=sorted(times[k])[1])
            log_row(doc, "rows", row, path)
        torch.cuda.empty_cache()
    print("wrote", path, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
