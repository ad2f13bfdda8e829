"""Probe (GPU): B3's transposed 8-bit stores through ``stmatrix.trans`` (``coda_titan.kernels.cute.tstore``)
against quack's universal register-to-shared copy.

    source .gpu/part2/activate.sh && python3 -m scripts.probes.fp8_trans_store [--slots a b]

At the 1B shapes (M = 16384 tokens, d = 2048, F = 8192), on B3's pinned tile config, for the defaults'
B3 (bf16 GEMM, e5m2 da, da^T and e4m3 y^T: ``b3_t``) and the same on the fp8 GEMM (``b3_t_q``):

* **bits**: the interleaved-store B3 (``b3_ti`` / ``b3_ti_q``) must write the same bytes as the
  universal-copy B3 once its tokens are de-interleaved (``scaling.deinterleave16``): da^T, y^T, the
  row-major e5m2 da, the sum(dz a) partials and amax |da|. A mismatch row gives the share of equal
  bytes with and without the de-interleave and one differing 16-token group, so a wrong fragment
  order (``--slots``: ``tstore._SLOTS``) or address shows as such.
* **time**: median of CUDA-event timings of 20 calls after 3 warm-up calls (the first compiles).

Each (kernel, slots) runs in a child process with a timeout (new code may hang the compiler). Writes
``$OUT/probe_fp8_trans_store_<gpu>.json`` after every row.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

import torch

from scripts.probes.fp8_configs import CONFIGS, M, _cfg, _inputs, _meta, _time

TIMEOUT_S = 240


def _epis(slots: str):
    """(bf16-GEMM, fp8-GEMM) B3 epilogues with e4m3 y^T through the interleaved store of ``slots``."""
    from coda_titan.kernels.cute import epilogues as P

    if slots == "a":  # the package's own
        return P.dswiglu_rstd_preact_e5m2_ti_yq_epi, P.dswiglu_rstd_preact_e5m2_ti_yq_q_epi
    from quack.epilogue.frontend import gemm_epilogue

    def ti(name):
        return P.InterleavedTransposedStore(name, slots=slots)

    @gemm_epilogue(outputs=(ti("postact"), "daq", ti("dagt"), ti("daut")), ops=P._b3_t_ops("inv_y"),
                   reduces=P._b3_t_reduces())
    def ti_yq_epi(acc, c, rstd, inv_scale, inv_y):
        out = P._dswiglu_e5m2_words(c, rstd, acc, inv_scale, transposed=True)
        out["postact"] = out["postact"] * inv_y
        return out

    @gemm_epilogue(outputs=(ti("postact"), "daq", ti("dagt"), ti("daut")), ops=P._b3_t_ops("scale", "inv_y"),
                   reduces=P._b3_t_reduces())
    def ti_yq_q_epi(acc, c, rstd, inv_scale, scale, inv_y):
        out = P._dswiglu_e5m2_words(c, rstd, acc * scale, inv_scale, transposed=True)
        out["postact"] = out["postact"] * inv_y
        return out

    return ti_yq_epi, ti_yq_q_epi


def _compare(name, ref, got) -> dict:
    """Bitwise comparison of one output; ``got`` de-interleaved along its tokens (dim 1) where ``name``
    ends in ``_t``."""
    from coda_titan.kernels.scaling import deinterleave16

    r = ref.contiguous().view(torch.uint8) if ref.element_size() == 1 else ref.contiguous()
    g = got.contiguous().view(torch.uint8) if got.element_size() == 1 else got.contiguous()
    row = {"equal": bool(torch.equal(deinterleave16(g, 1) if name.endswith("_t") else g, r))}
    if not row["equal"] and name.endswith("_t"):
        d = deinterleave16(g, 1)
        row["share_equal_deinterleaved"] = (d == r).float().mean().item()
        row["share_equal_raw"] = (g == r).float().mean().item()
        f, m = [int(i) for i in (d != r).nonzero()[0]]
        m0 = m - m % 16
        row["first_diff"] = {"feature": f, "token": m, "ref": r[f, m0:m0 + 16].tolist(), "got": g[f, m0:m0 + 16].tolist()}
    return row


def _child(kernel: str, slots: str) -> dict:
    from coda_titan.kernels.cute import epilogues as P
    from coda_titan.kernels.cute import norm_swiglu as NS
    from coda_titan.kernels.cute._dispatch import scalar32

    t = _inputs(torch.Generator(device="cuda").manual_seed(0))
    cfg = _cfg(CONFIGS[0])  # B3's pinned config (``_b3_fp8_config``)
    r, inv = t["rstd"], torch.full((1,), 2.0**14, device="cuda")
    inv_y, one = torch.tensor(30.0, device="cuda"), scalar32(torch.ones((), device="cuda"))
    ti_yq, ti_yq_q = _epis(slots)
    if kernel == "b3_t":
        args, ops = (t["dout"], t["w2"]), {}
        ref_epis, new_epis = (P.dswiglu_rstd_preact_e5m2_t_epi, P.dswiglu_rstd_preact_e5m2_t_yq_epi), (None, ti_yq)
    else:
        doutq = (t["dout"].float() * 2**14).clamp(-57344, 57344).to(torch.float8_e5m2)
        w2q_kn = (t["w2"].float() * 2**8).clamp(-448, 448).to(torch.float8_e4m3fn).t().contiguous().t()
        args, ops = (doutq, w2q_kn), {"scale": one}
        ref_epis, new_epis = (P.dswiglu_rstd_preact_e5m2_t_q_epi, P.dswiglu_rstd_preact_e5m2_t_yq_q_epi), (None, ti_yq_q)

    def run(name, epis):
        return NS._b3_e5m2_t(name, epis, *args, t["a"], r, inv, inv_y, config=cfg, **ops)

    ref = run(f"probe_{kernel}", ref_epis)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    got = run(f"probe_{kernel}_i{slots}", new_epis)
    torch.cuda.synchronize()
    row = {"compile_s": round(time.perf_counter() - t0, 1)}
    names = ("y_t", "zdz", "daq", "daq_t", "amax")
    row["bits"] = {n: _compare(n, a, b) for n, a, b in zip(names, ref, got)}
    row["all_equal"] = all(v["equal"] for v in row["bits"].values())
    row["ref"] = _time(lambda: run(f"probe_{kernel}", ref_epis))
    row["interleaved"] = _time(lambda: run(f"probe_{kernel}_i{slots}", new_epis))
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--slots", nargs="*", default=["a", "b"], choices=["a", "b"],
                    help="fragment orders to try, in turn, until one writes the same bits")
    ap.add_argument("--kernels", nargs="*", default=["b3_t", "b3_t_q"], choices=["b3_t", "b3_t_q"])
    args = ap.parse_args()
    if args.child:
        print("ROW " + json.dumps(_child(*args.child)), flush=True)
        return
    doc = {**_meta(), "config": CONFIGS[0], "rows": []}
    slug = re.sub(r"[^A-Za-z0-9]+", "_", doc["device"]).strip("_")
    out_dir = os.environ.get("OUT", "benchmarks/results")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"probe_fp8_trans_store_{slug}.json")
    slots = list(args.slots)
    for kernel in args.kernels:
        for s in list(slots):
            row = {"kernel": kernel, "slots": s, "tokens": M}
            t0 = time.perf_counter()
            try:
                p = subprocess.run([sys.executable, "-m", "scripts.probes.fp8_trans_store", "--child", kernel, s],
                                   capture_output=True, text=True, timeout=TIMEOUT_S)
                lines = [ln for ln in p.stdout.splitlines() if ln.startswith("ROW ")]
                row.update(json.loads(lines[-1][4:]) if lines else {"error": f"rc {p.returncode}: {p.stderr[-1500:]}"})
            except subprocess.TimeoutExpired:
                row["error"] = f"timed out after {TIMEOUT_S} s"
            row["wall_s"] = round(time.perf_counter() - t0, 1)
            doc["rows"].append(row)
            print(json.dumps({k: (v["median_ms"] if isinstance(v, dict) and "median_ms" in v else v)
                              for k, v in row.items()}), flush=True)
            with open(path, "w") as f:
                json.dump(doc, f, indent=1)
            if row.get("all_equal"):
                slots = [s]  # this order is the right one: the next kernel uses it alone
                break
    print("wrote", path, flush=True)


if __name__ == "__main__":
    main()
