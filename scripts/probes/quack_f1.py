"""Probe (GPU): quack 0.6.5's ``rms_partial_epi`` as the F1 program, against our torch reference.

Checks the calling convention the cute backend will use (operand layouts, epilogue args, ragged M),
measures the error against an fp64 reference next to plain torch-bf16's error, and times it against
the bare GEMM. Writes $OUT/probe_quack_f1.json. A probe for the kernel work, not a benchmark table.

    source .gpu/part2/activate.sh && python3 -m scripts.probes.quack_f1
"""

import datetime
import json
import os

import torch
from triton.testing import do_bench

from coda_titan.kernels.residual_rms import residual_rms as residual_rms_torch


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main():
    from quack.epilogue.library import rms_partial_epi

    dev = "cuda"
    results = []
    for m, d in ((16000, 2048), (16384, 4096)):
        k, tile_n = d, 128
        torch.manual_seed(0)
        y = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(d, k, device=dev, dtype=torch.bfloat16) / k**0.5
        res = torch.randn(m, d, device=dev, dtype=torch.bfloat16)
        gamma = (torch.rand(d, device=dev) + 0.5).to(torch.bfloat16)
        h = torch.full((m, d), float("nan"), device=dev, dtype=torch.bfloat16)
        x = torch.full_like(h, float("nan"))
        s = torch.full((m, d // tile_n), float("nan"), device=dev, dtype=torch.float32)

        def fused():
            rms_partial_epi.gemm(y, w, h, res, epi_args={"weight": gamma.float(), "resid_out": x, "sqsum": s},
                                 tile_M=128, tile_N=tile_n, cluster_M=1, cluster_N=1)

        fused()
        torch.cuda.synchronize()
        x64, h64, s64 = residual_rms_torch(y=y.double(), weight=w.double(), residual=res.double(),
                                           gamma=gamma.double(), tile_n=tile_n)
        xb, hb, sb = residual_rms_torch(y=y, weight=w, residual=res, gamma=gamma, tile_n=tile_n)
        err = {"X": rel(x, x64), "H": rel(h, h64), "S": rel(s, s64)}
        err_torch_bf16 = {"X": rel(xb, x64), "H": rel(hb, h64), "S": rel(sb, s64)}
        ok = all(err[t] <= 2 * err_torch_bf16[t] + 1e-6 for t in err) and not any(
            t.isnan().any().item() for t in (x, h, s))
        ms = {
            "coda": do_bench(fused, warmup=50, rep=300, return_mode="median"),
            "bare_gemm": do_bench(lambda: torch.mm(y, w.t()), warmup=50, rep=300, return_mode="median"),
            "eager": do_bench(lambda: residual_rms_torch(y=y, weight=w, residual=res, gamma=gamma, tile_n=tile_n),
                              warmup=50, rep=300, return_mode="median"),
        }
        results.append({"op": "residual_rms", "direction": "fwd", "M": m, "d": d, "ok": ok,
                        "rel_err": err, "rel_err_torch_bf16": err_torch_bf16, "ms": ms})
        print(results[-1], flush=True)
    import quack

    out = {"device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
           "versions": {"torch": torch.__version__, "quack": getattr(quack, "__version__", "?")}, "results": results}
    path = os.path.join(os.environ.get("OUT", "."), "probe_quack_f1.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
