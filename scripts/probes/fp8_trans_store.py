"""Probe (GPU): B3's transposed 8-bit stores through ``stmatrix.trans`` (``coda_titan.kernels.cute.tstore``)
against quack's universal register-to-shared copy.

    source .gpu/part2/activate.sh && python3 -m scripts.probes.fp8_trans_store

At the 1B shapes (M = 16384 tokens, d = 2048, F = 8192), on B3's pinned tile config, for the defaults'
B3 (bf16 GEMM, e5m2 da, da^T and e4m3 y^T: ``b3_t``) and the same on the fp8 GEMM (``b3_t_q``):

* **bits**: the package's B3 (``stmatrix.trans``) must write the bytes of the same epilogue with quack's
  universal copy (built here): da^T, y^T, the row-major e5m2 da, the sum(dz a) partials and amax |da|.
  A mismatch row gives the share of equal bytes and one differing 16-token group.
* **time**: the two kernels timed in alternation, 5 rounds of 20 calls (after 3 warm-up calls) each, so
  that clock drift hits both: the median over the 100 calls per kernel and each round's median.

Each kernel runs in a child process with a timeout (new code may hang the compiler). Writes
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
ROUNDS = 5


def _universal_epis():
    """(bf16-GEMM, fp8-GEMM) B3 epilogues with e4m3 y^T, all outputs through quack's own ``TileStore``."""
    from quack.epilogue.frontend import gemm_epilogue
    from quack.epilogue.ops import ColVecLoad, ColVecReduce, Scalar

    from coda_titan.kernels.cute import epilogues as P

    def ops(*names):
        return {"rstd": ColVecLoad("rstd"), **{k: Scalar(k) for k in names}}

    def reduces():
        return {"dsum": ColVecReduce("dsum"), "amax": ColVecReduce("amax", combine="max_abs")}

    @gemm_epilogue(outputs=("postact", "daq", "dagt", "daut"), ops=ops("inv_scale", "inv_y"), reduces=reduces())
    def t_yq_universal_epi(acc, c, rstd, inv_scale, inv_y):
        out = P._dswiglu_e5m2_words(c, rstd, acc * (rstd * inv_scale), transposed=True)
        out["postact"] = out["postact"] * inv_y
        return out

    @gemm_epilogue(outputs=("postact", "daq", "dagt", "daut"), ops=ops("scale", "inv_scale", "inv_y"), reduces=reduces())
    def t_yq_q_universal_epi(acc, c, rstd, scale, inv_scale, inv_y):
        out = P._dswiglu_e5m2_words(c, rstd, acc * (rstd * (scale * inv_scale)), transposed=True)
        out["postact"] = out["postact"] * inv_y
        return out

    return t_yq_universal_epi, t_yq_q_universal_epi


def _compare(ref, got) -> dict:
    """Bitwise comparison of one output."""
    r = ref.contiguous().view(torch.uint8) if ref.element_size() == 1 else ref.contiguous()
    g = got.contiguous().view(torch.uint8) if got.element_size() == 1 else got.contiguous()
    row = {"equal": bool(torch.equal(g, r))}
    if not row["equal"] and g.dim() == 2:
        row["share_equal"] = (g == r).float().mean().item()
        f, m = [int(i) for i in (g != r).nonzero()[0]]
        m0 = m - m % 16
        row["first_diff"] = {"row": f, "col": m, "ref": r[f, m0:m0 + 16].tolist(), "got": g[f, m0:m0 + 16].tolist()}
    return row


def _child(kernel: str) -> dict:
    from coda_titan.kernels.cute import epilogues as P
    from coda_titan.kernels.cute import norm_swiglu as NS
    from coda_titan.kernels.cute._dispatch import scalar32

    t = _inputs(torch.Generator(device="cuda").manual_seed(0))
    cfg = _cfg(CONFIGS[0])  # B3's pinned config (``_b3_fp8_config``)
    r, inv = t["rstd"], torch.full((1,), 2.0**14, device="cuda")
    inv_y, one = torch.tensor(30.0, device="cuda"), scalar32(torch.ones((), device="cuda"))
    uni_yq, uni_yq_q = _universal_epis()
    if kernel == "b3_t":
        args, ops = (t["dout"], t["w2"]), {}
        ref_epis, new_epis = (None, uni_yq), (None, P.dswiglu_rstd_preact_e5m2_t_yq_epi)
    else:
        doutq = (t["dout"].float() * 2**14).clamp(-57344, 57344).to(torch.float8_e5m2)
        w2q_kn = (t["w2"].float() * 2**8).clamp(-448, 448).to(torch.float8_e4m3fn).t().contiguous().t()
        args, ops = (doutq, w2q_kn), {"scale": one}
        ref_epis, new_epis = (None, uni_yq_q), (None, P.dswiglu_rstd_preact_e5m2_t_yq_q_epi)

    def run(name, epis):
        return NS._b3_e5m2_t(name, epis, *args, t["a"], r, inv, inv_y, config=cfg, **ops)

    ref = run(f"probe_{kernel}_universal", ref_epis)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    got = run(f"probe_{kernel}", new_epis)
    torch.cuda.synchronize()
    row = {"compile_s": round(time.perf_counter() - t0, 1)}
    row["bits"] = {n: _compare(a, b) for n, a, b in zip(("y_t", "zdz", "daq", "daq_t", "amax"), ref, got)}
    row["all_equal"] = all(v["equal"] for v in row["bits"].values())
    row.update(_time_ab({"universal": lambda: run(f"probe_{kernel}_universal", ref_epis),
                         "stmatrix_trans": lambda: run(f"probe_{kernel}", new_epis)}))
    return row


def _time_ab(fns: dict, rounds: int = ROUNDS) -> dict:
    """Each of ``fns`` timed in alternation (``_time``: 20 calls after 3 warm-up calls) for ``rounds``
    rounds, so clock drift hits both: per arm the median over every call and the per-round medians."""
    per = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            per[k].append(_time(fn))
    out = {}
    for k, ts in per.items():
        raw = sorted(x for t in ts for x in t["raw_ms"])
        out[k] = {"median_ms": raw[len(raw) // 2], "min_ms": raw[0], "round_medians_ms": [t["median_ms"] for t in ts],
                  "raw_ms": [t["raw_ms"] for t in ts]}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--kernels", nargs="*", default=["b3_t", "b3_t_q"], choices=["b3_t", "b3_t_q"])
    args = ap.parse_args()
    if args.child:
        print("ROW " + json.dumps(_child(args.child)), flush=True)
        return
    doc = {**_meta(), "config": CONFIGS[0], "rows": []}
    slug = re.sub(r"[^A-Za-z0-9]+", "_", doc["device"]).strip("_")
    out_dir = os.environ.get("OUT", "benchmarks/results")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"probe_fp8_trans_store_{slug}.json")
    for kernel in args.kernels:
        row = {"kernel": kernel, "tokens": M}
        t0 = time.perf_counter()
        try:
            p = subprocess.run([sys.executable, "-m", "scripts.probes.fp8_trans_store", "--child", kernel],
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
    print("wrote", path, flush=True)


if __name__ == "__main__":
    main()
