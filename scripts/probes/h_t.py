"""Probe (GPU): what the producers' e4m3 H^T costs and what it saves, kernel by kernel, at the 1B shapes.

    source .gpu/part2/activate.sh && python3 -m scripts.probes.h_t        (gpu_train.sh htprobe)

``fp8_qkv_wgrad`` / ``fp8_mlp_h_t`` measured slower in training (``compare_h_t_…json``) although each
removes a cast pass and halves a saved activation. This times the pieces in one process, each as 20
calls back to back between two CUDA events (the GPU never waits for the host), in 5 rounds that
alternate the variants of a row so that clock drift hits all of them:

* **F1 with and without Hq^T** (``residual_rms_q_fp8`` / ``_t``), for the down-projection (K = F) and
  the out-projection (K = d): what the M-major 8-bit store adds to the producer;
* **dW_qkv**: the bf16 cuBLAS wgrad (the defaults), ``wgrad_fp8_q`` on B1's row-major e5m2 da (a
  transposing copy, eager and compiled), the same on a token-major da (no copy: the GEMM alone), and
  the copy alone;
* **dW13**: ``wgrad_fp8_e5m2`` on B3's da^T and the bf16 H (the defaults: H cast and transposed, eager
  and compiled) against ``wgrad_fp8_q`` on da^T and Hq^T (no cast).

Writes ``$OUT/probe_h_t_<gpu>.json`` (device, versions, date, shapes, every round's ms).
"""

from __future__ import annotations

import json
import os
import statistics

import torch

from scripts.probes.epi_stages import _streamed
from scripts.probes.fp8_configs import D, F, M, _meta

ROUNDS, REPS = 5, 20


def _row(name: str, variants: dict) -> dict:
    """Each variant warmed up (compiles, autotunes), then ROUNDS rounds in alternation."""
    for fn in variants.values():
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    rounds = {k: [] for k in variants}
    for _ in range(ROUNDS):
        for k, fn in variants.items():
            rounds[k].append(_streamed(fn, REPS)["gpu_ms"])
    row = {"row": name, "median_ms": {k: statistics.median(v) for k, v in rounds.items()}, "rounds_ms": rounds}
    print(json.dumps({"row": name, **{k: round(v, 4) for k, v in row["median_ms"].items()}}), flush=True)
    return row


def _e4m3(t: torch.Tensor) -> torch.Tensor:
    return (t * 16).clamp(-448, 448).to(torch.float8_e4m3fn)


def _e5m2(t: torch.Tensor) -> torch.Tensor:
    return (t * 1024).clamp(-57344, 57344).to(torch.float8_e5m2)


def main() -> int:
    from coda_titan.kernels import get_backend

    be = get_backend("cute", traced=False)
    traced = get_backend("cute", traced=True)
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16)

    one = torch.ones((), device="cuda")
    res = {**_meta(), "rounds": ROUNDS, "reps": REPS,
           "timing": f"CUDA events around {REPS} calls back to back, median of {ROUNDS} alternating rounds",
           "rows": []}
    out = os.path.join(os.environ.get("OUT", "."), f"probe_h_t_{torch.cuda.get_device_name().replace(' ', '_')}.json")

    def keep(row):
        res["rows"].append(row)
        with open(out, "w") as f:
            json.dump(res, f, indent=1)

    residual, gamma = randn(M, D), randn(D).abs() + 0.5
    for site, k in (("down", F), ("out", D)):
        yq, wq = _e4m3(randn(M, k) * 0.1), _e4m3(randn(D, k) * 0.02)
        f1 = dict(yq=yq, wq=wq, scale=one / 256, residual=residual, gamma=gamma, tile_n=128, inv_scale=one * 8)
        keep(_row(f"F1 {site} (K {k})", {"hq": lambda f1=f1: be.residual_rms_q_fp8(**f1),
                                         "hq_and_hq_t": lambda f1=f1: be.residual_rms_q_fp8_t(**f1)}))

    n_qkv = 3072
    da, h = randn(M, n_qkv) * 0.01, randn(M, D)
    daq, hq = _e5m2(da), _e4m3(h)
    daq_t, hq_t = daq.t().contiguous(), hq.t().contiguous()
    q = dict(grad_scale=one / 1024, inp_scale=one / 16, out_dtype=torch.bfloat16)
    compiled_q = torch.compile(lambda gq, x: traced.wgrad_fp8_q(gradq=gq, inpq=x, **q), fullgraph=True)
    keep(_row("dW_qkv", {
        "bf16_cublas": lambda: be.wgrad(grad=da, inp=h, out_dtype=torch.bfloat16),
        "fp8_q_copy_eager": lambda: be.wgrad_fp8_q(gradq=daq, inpq=hq_t.t(), **q),
        "fp8_q_copy_compiled": lambda: compiled_q(daq, hq_t.t()),
        "fp8_q_no_copy": lambda: be.wgrad_fp8_q(gradq=daq_t.t(), inpq=hq_t.t(), **q),
        "copy_alone": lambda: daq.t().contiguous(),
    }))

    da13_t = _e5m2(randn(2 * F, M) * 0.01)
    h13 = randn(M, D)
    amax = h13.abs().amax().float()  # (as F1 reports it: the cast needs no amax pass)
    compiled_e5m2 = torch.compile(lambda gq, x: traced.wgrad_fp8_e5m2(gradq=gq, grad_scale=one / 1024, inp=x,
                                                                      inp_amax=amax, out_dtype=torch.bfloat16),
                                  fullgraph=True)
    keep(_row("dW13", {
        "fp8_e5m2_cast_h_eager": lambda: be.wgrad_fp8_e5m2(gradq=da13_t.t(), grad_scale=one / 1024, inp=h13,
                                                           inp_amax=amax, out_dtype=torch.bfloat16),
        "fp8_e5m2_cast_h_compiled": lambda: compiled_e5m2(da13_t.t(), h13),
        "fp8_q_h_t": lambda: be.wgrad_fp8_q(gradq=da13_t.t(), inpq=hq_t.t(), **q),
    }))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
