"""Driver for Nsight Compute (GPU): one program at the 1B shapes, warmed up, then one call inside the NVTX
range ``measure`` that ``ncu --nvtx --nvtx-include measure/`` profiles (``gpu_train.sh ncu``).

    ncu --clock-control none --nvtx --nvtx-include "measure/" ... python3 -m scripts.probes.ncu_driver --program b3

Programs (the cute backend's ops as the fp8 defaults call them):

* ``b3``: ``swiglu_bwd_e5m2_t_q``, the W2 dgrad on fp8 with the dSwiGLU epilogue writing e5m2 da, da^T
  and e4m3 y^T (12.6 ms a step against its bare GEMM's 7.0 in the twenty-sixth session's profile);
* ``f1_down`` / ``f1_down_t``: the down-projection F1 writing Hq, and also Hq^T (0.453 / 0.499 ms in
  ``probe_h_t_…json``): what the M-major 8-bit store adds;
* ``dgrad_fp8_q``: the W_o dgrad of ``fp8_out_bwd`` (cuBLAS), for the bare-GEMM reference.

The profiler's report is what this is for; the driver itself prints nothing but the program's name.
"""

from __future__ import annotations

import argparse

import torch

M, D, F = 16384, 2048, 8192
PROGRAMS = ("b3", "f1_down", "f1_down_t", "dgrad_fp8_q")


def _call(program: str):
    """A zero-argument call of ``program`` on random inputs of the 1B shapes (never zeros)."""
    from coda_titan.kernels import get_backend
    from coda_titan.kernels.scaling import E4M3, E5M2

    be = get_backend("cute", traced=False)
    g = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)

    def codes(t, mult, dtype, fmax):
        return (t.float() * mult).clamp(-fmax, fmax).to(dtype)

    one = torch.ones((), device="cuda")
    if program == "b3":
        kw = dict(doutq=codes(rnd(M, D, scale=1e-3), 2**16, E5M2, 57344.0),
                  w_down_tq=codes(rnd(F, D, scale=0.02), 2**8, E4M3, 448.0), scale=one / 2**24, a=rnd(M, 2 * F),
                  rstd=torch.rand(M, generator=g, device="cuda") + 0.5, inv_scale=one * 2**14, inv_y=one * 16)
        return lambda: be.swiglu_bwd_e5m2_t_q(**kw)
    if program in ("f1_down", "f1_down_t"):
        kw = dict(yq=codes(rnd(M, F, scale=0.1), 16, E4M3, 448.0), wq=codes(rnd(D, F, scale=0.02), 2**8, E4M3, 448.0),
                  scale=one / 2**12, residual=rnd(M, D), gamma=rnd(D).abs() + 0.5, tile_n=128, inv_scale=one * 8)
        fn = be.residual_rms_q_fp8_t if program == "f1_down_t" else be.residual_rms_q_fp8
        return lambda: fn(**kw)
    if program == "dgrad_fp8_q":
        kw = dict(gradq=codes(rnd(M, D, scale=1e-3), 2**16, E5M2, 57344.0),
                  weight_tq=codes(rnd(D, D, scale=0.02), 2**8, E4M3, 448.0), grad_scale=one / 2**16,
                  w_scale=one / 2**8, out_dtype=torch.bfloat16)
        return lambda: be.dgrad_fp8_q(**kw)
    raise ValueError(f"unknown program {program!r}; one of {PROGRAMS}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--program", choices=PROGRAMS, required=True)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("ncu_driver needs a CUDA GPU (it drives the cute kernels for Nsight Compute)")
    call = _call(args.program)
    for _ in range(args.warmup):  # (the first compiles, and autotunes where no tuned config is cached)
        call()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("measure")
    call()
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    print(args.program)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
