"""Probe (GPU): ``fp8_lm_head_dw``'s dW_out at the 1B shape, as the configured head runs it (one cuBLAS fp8 GEMM
over every token of da's token-major e5m2 codes and H's e4m3 codes, ``_fp8_dw``) against the
``CODA_TITAN_DW_BLOCKS=k`` arm's (``_Fp8Dw`` in ``kernels/cute/lm_head_ce.py``: quack's fp8 GEMM on each of k token
blocks, the first writing dW in bf16 with the codes' scales as alpha, the next ones adding to it in place).

    source .gpu/part2/activate.sh && python3 -m scripts.probes.fp8_dw_blocks        (gpu_train.sh dwblocksprobe)

Why: in the sixty-fifth session's ``fp8arms`` call the first training run under ``CODA_TITAN_DW_BLOCKS=2`` wrote
nothing in 320 s, where the other arms took 53-56 s. The training runs autotune quack's GEMMs
(``CODA_TITAN_AUTOTUNE``, on; the GPU tests run untuned), and these two fp8 GEMMs at these shapes were new to the
tune cache. This probe makes each arm's first call alone and records its seconds (compile and the tile sweep),
so that the sweep is paid once, in its own call, and kept in the tune cache ``gpu_train.sh`` returns. Then:
GPU ms per whole dW (the probes' back-to-back event timer, 5 calls after 3 warm-up calls, in 3 alternations)
and each arm's largest difference from the configured one relative to its largest |element| (the blocks' sums
are rounded to bf16 k - 1 more times). Operands: e5m2 codes of r (softmax - onehot) of random logits scaled as
the head scales them, H's e4m3 codes of a random H. Writes ``$OUT/probe_fp8_dw_blocks_<gpu>.json``.
"""

from __future__ import annotations

import torch

from scripts.bench.common import header, log_row, out_json
from scripts.probes.epi_stages import _alternated, _first_calls

TOKENS, VOCAB, D = 16384, 128256, 2048
BLOCKS = (2, 4)


def _operands(g):
    """(da's e5m2 codes (V, M), H's e4m3 codes^T (D, M) token-major, H's codes (M, D), the codes' scales)."""
    from coda_titan.kernels.scaling import E4M3, E5M2

    daq_t = torch.empty((VOCAB, TOKENS), device="cuda", dtype=E5M2)
    for s in range(0, TOKENS, 2048):  # (a chunk at a time: the fp32 softmax of all rows would take 8 GiB)
        logits = torch.randn(2048, VOCAB, device="cuda", generator=g) * 2
        p = torch.softmax(logits, -1)
        p[torch.arange(2048, device="cuda"), torch.randint(0, VOCAB, (2048,), device="cuda", generator=g)] -= 1
        daq_t[:, s:s + 2048] = (p * 2.0 ** 14).clamp(-57344, 57344).to(E5M2).t()
    hq = (torch.randn(TOKENS, D, device="cuda", generator=g) * 64).clamp(-448, 448).to(E4M3)
    return daq_t, hq, torch.tensor(2.0 ** -14, device="cuda"), torch.tensor(1 / 64, device="cuda")


def _arms(daq_t, hq, s_g, s_h) -> dict:
    from quack.gemm_interface import gemm as quack_gemm
    from quack.gemm_interface import gemm_add_inplace

    from coda_titan.kernels.cute import transpose_8bit
    from coda_titan.kernels.cute._dispatch import TUNE
    from coda_titan.kernels.cute.lm_head_ce import _fp8_dw

    inv_g = s_g.reciprocal()
    hq_t = transpose_8bit.transpose_8bit(hq)
    alpha = (s_h / inv_g).reshape(1)
    fns = {"cublas_full": lambda: _fp8_dw(daq_t, hq, inv_g, s_h, torch.bfloat16)}

    def blocks(k):
        w = TOKENS // k

        def run():
            dw = quack_gemm(daq_t[:, :w], hq_t[:, :w].t(), out_dtype=torch.bfloat16, alpha=alpha, tuned=TUNE)
            for b0 in range(w, TOKENS, w):
                gemm_add_inplace(daq_t[:, b0:b0 + w], hq_t[:, b0:b0 + w].t(), dw, alpha=alpha, tuned=TUNE)
            return dw
        return run

    for k in BLOCKS:
        fns[f"quack_blocks{k}"] = blocks(k)
    return fns


def main() -> int:
    doc = {**header(), "kind": "probe_fp8_dw_blocks", "shape": {"tokens": TOKENS, "vocab": VOCAB, "d": D},
           "blocks": list(BLOCKS), "timing": "GPU ms per whole dW, 5 calls enqueued back to back after 3 warm-up "
           "calls, in 3 alternations; first_call_s: the arm's first call alone (compile and autotune)", "rows": []}
    path = out_json("probe_fp8_dw_blocks")
    g = torch.Generator(device="cuda").manual_seed(0)
    fns = _arms(*_operands(g))
    ref = []

    def judge(out):  # (each arm's largest difference from the first arm's, the configured one)
        if not ref:
            ref.append(out.float())
        return {"max_abs_diff_rel": float((out.float() - ref[0]).abs().max() / ref[0].abs().max())}

    ok = {}
    for k, f in fns.items():  # (first calls one by one, timed: the sweep's cost is what this probe is for)
        ok.update(_first_calls({k: f}, judge))
        print(k, ok[k], flush=True)
    times = _alternated(fns, ok, reps=5)
    for k in fns:
        row = {"variant": k, **ok[k]}
        if times[k]:
            row.update(gpu_ms=times[k], median_ms=sorted(times[k])[1])
        log_row(doc, "rows", row, path)
    print("wrote", path, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
