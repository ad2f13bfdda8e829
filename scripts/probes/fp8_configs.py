"""Probe (GPU): quack SM90 tile configs of the fp8 MLP dgrad programs, against bf16 and cuBLAS.

    source .gpu/part2/activate.sh && python3 -m scripts.probes.fp8_configs [--skip b2 cublas] [--b3 b3_t b3_t_q] [--configs 0 3]

At the 1B shapes (M = 16384 tokens, d = 2048, F = 8192) it times, for each pinned ``GemmConfig``:

* ``b2_fp8``: B2 of W13 (``rms_bwd_apply_epi`` on e5m2 da x e4m3 W13^T, K = 2F), the fp8 dgrad
  that ``[coda] fp8_mlp_dgrad`` runs; ``plain_fp8``: the same fp8 GEMM with an identity epilogue
  (is the mainloop or the epilogue slow?); ``b2_bf16``: the bf16 program on the same config;
* ``b3_fp8`` / ``b3_bf16``: B3 (dout @ W2 with the dSwiGLU epilogue) with and without the e5m2
  output; ``b3_t``: the defaults' B3 since the fifteenth session (da, da^T and y^T in 8 bits, bf16
  GEMM, ``swiglu_bwd_e5m2_t``), ``b3_t_q`` the same on the fp8 GEMM (``swiglu_bwd_e5m2_t_q``), and
  ``plain_fp8`` that fp8 GEMM with an identity epilogue (how much of B3 is its epilogue?), ``c_only_fp8``
  and ``b3_nt_q`` the steps between (``_diag_epis``); ``b3_t_ov`` / ``b3_t_q_ov`` those two with
  overlapped pingpong epilogues (``coda_titan.kernels.cute.overlap``), their outputs checked bit for
  bit against the plain ones'; ``b3_t_e64`` / ``b3_t_q_e64`` with a 64 x 64 epilogue subtile instead of
  quack's 64 x 32 (``stages.epi_tile``: half the subtile rounds, 3 A/B stages instead of 5) and
  ``b3_t_q_e64_c2`` with the C-stage base at 2 too (4 A/B stages), bits checked likewise; ``OV_VARIANTS``
  the overlapped ``b3_t_q`` (the defaults' B3) with a 64 x 16 subtile and / or another C-stage base; ``--b3``
  picks them. One of quack's candidate configs of ``b3_fp8`` never finished on the H200, so every
  B3 config runs in a child process with a timeout; a hang is recorded as such.

and once: cuBLAS bf16 (``torch.mm``) and fp8 (``torch._scaled_mm``, fast accumulation) of both GEMMs.
Inputs are random; each time is the median of CUDA-event timings of 20 calls after 3 warm-up calls
(the first compiles). Writes ``$OUT/probe_fp8_configs_<gpu>.json`` after every row (so a
timed-out call still returns what it measured).
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

from scripts.bench.common import synced_ms

M, D, F = 16384, 2048, 8192
# (tile_m, tile_n, pingpong, cluster_m, cluster_n): quack's SM90 space holds these
CONFIGS = [
    (128, 128, True, 1, 2), (128, 128, True, 2, 1), (128, 192, True, 2, 1), (192, 128, True, 1, 2),
    (128, 256, False, 2, 1), (256, 128, False, 1, 2), (256, 160, False, 1, 2),
    # cooperative 128 x 128: two warpgroups (8 warps) share each tile's epilogue (B3's is longer than its mainloop)
    (128, 128, False, 1, 2), (128, 128, False, 2, 1),
]
B3_TIMEOUT_S = 240


def _cfg(t):
    from quack.gemm_config import GemmConfig

    tm, tn, pp, cm, cn = t
    return GemmConfig(tile_m=tm, tile_n=tn, pingpong=pp, cluster_m=cm, cluster_n=cn,
                      is_dynamic_persistent=False, device_capacity=9)


def _time(fn, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = sorted(synced_ms(fn, reps))
    return {"median_ms": ts[len(ts) // 2], "min_ms": ts[0], "raw_ms": ts}


def _inputs(gen):
    from coda_titan.kernels.scaling import E4M3, E5M2

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(torch.bfloat16)

    t = {
        "da": rnd(M, 2 * F, scale=1e-3), "w13": rnd(2 * F, D, scale=0.02), "x": rnd(M, D),
        "dres": rnd(M, D, scale=1e-3), "gamma": torch.rand(D, device="cuda", generator=gen) + 0.5,
        "rstd": torch.rand(M, device="cuda", generator=gen) + 0.5, "zdz": rnd(M, D).float()[:, 0].contiguous(),
        "dout": rnd(M, D, scale=1e-3), "w2": rnd(D, F, scale=0.02), "a": rnd(M, 2 * F),
    }
    t["daq"] = (t["da"].float() * 2**14).clamp(-57344, 57344).to(E5M2)
    t["w13q_t"] = (t["w13"].float() * 2**8).clamp(-448, 448).to(E4M3).t().contiguous()
    return t


def _meta():
    from scripts.bench.common import header

    return {
        **header(),
        "shapes": {"M": M, "d": D, "F": F},
        "timing": "CUDA events, median of 20 calls after 3 warm-up calls (the first compiles)",
    }


def _plain_epi():
    """The identity epilogue (D = acc): a GEMM's mainloop share of a program's time."""
    from quack.epilogue.frontend import gemm_epilogue

    @gemm_epilogue()
    def plain_epi(acc):
        return {"D": acc}

    return plain_epi


def _diag_epis():
    """Two probe-only epilogues that split B3's fp8 time: ``c_only`` reads B3's C (a's float32 view) and
    stores D = acc * gate (what loading C adds to the plain GEMM), ``nt_q`` is ``b3_t_q`` less its
    three transposed stores (da as e5m2 pairs and y as e4m3, both row-major)."""
    from quack.epilogue.frontend import gemm_epilogue
    from quack.epilogue.ops import ColVecLoad, ColVecReduce, Scalar

    from coda_titan.kernels.cute import epilogues as P

    @gemm_epilogue()
    def c_only_epi(acc, c):
        return {"D": acc * P._bf16_lo(c)}

    @gemm_epilogue(
        outputs=("postact", "daq"),
        ops={"rstd": ColVecLoad("rstd"), "scale": Scalar("scale"), "inv_scale": Scalar("inv_scale"),
             "inv_y": Scalar("inv_y")},
        reduces={"dsum": ColVecReduce("dsum"), "amax": ColVecReduce("amax", combine="max_abs")},
    )
    def nt_q_epi(acc, c, rstd, scale, inv_scale, inv_y):
        out = P._dswiglu_e5m2_words(c, rstd, acc * (rstd * (scale * inv_scale)))
        out["postact"] = out["postact"] * inv_y
        return out

    return c_only_epi, nt_q_epi


# the defaults' B3 (b3_t_q_ov: overlapped epilogues on the fp8 GEMM) with a narrower epilogue subtile and / or another
# C-stage base (``stages``): (epi tile, C base) of each; the overlapped epilogues' smem then leaves the mainloop more
# A/B stages (the twenty-eighth session's Nsight Compute profile: its warps wait on A/B data 56% of the mainloop)
OV_VARIANTS = {"b3_t_q_ov_e16": ((64, 16), None), "b3_t_q_ov_e16_c2": ((64, 16), 2), "b3_t_q_ov_c2": (None, 2),
               "b3_t_q_ov_e16_c6": ((64, 16), 6)}
B3_KERNELS = ("b3_bf16", "b3_fp8", "plain_fp8", "b3_t", "b3_t_q", "c_only_fp8", "b3_nt_q", "b3_t_ov", "b3_t_q_ov",
              "b3_t_e64", "b3_t_q_e64", "b3_t_q_e64_c2", *OV_VARIANTS)


def _b3_child(idx: int, kernels) -> dict:
    from coda_titan.kernels.cute import epilogues as P  # (importing cute also installs fast fp8 accumulation)
    from coda_titan.kernels.cute import norm_swiglu as NS
    from coda_titan.kernels.cute._dispatch import scalar32
    from quack.epilogue.library import dswiglu_rstd_preact_mod

    plain_epi = _plain_epi()
    t = _inputs(torch.Generator(device="cuda").manual_seed(0))
    cfg = _cfg(CONFIGS[idx])
    r = t["rstd"]
    inv = torch.full((1,), 2.0**14, device="cuda")
    doutq = (t["dout"].float() * 2**14).clamp(-57344, 57344).to(torch.float8_e5m2)
    w2q_kn = (t["w2"].float() * 2**8).clamp(-448, 448).to(torch.float8_e4m3fn).t().contiguous().t()  # K-major B
    inv_y, one = torch.tensor(30.0, device="cuda"), scalar32(torch.ones((), device="cuda"))
    y_t = {"t": (P.dswiglu_rstd_preact_e5m2_t_epi, P.dswiglu_rstd_preact_e5m2_t_yq_epi),
           "t_q": (P.dswiglu_rstd_preact_e5m2_t_q_epi, P.dswiglu_rstd_preact_e5m2_t_yq_q_epi)}
    da = torch.empty_like(t["a"])
    y = t["a"].new_empty((M, F))
    daq = torch.empty((M, F), device="cuda", dtype=torch.float16)
    c_only_epi, nt_q_epi = _diag_epis()
    a32 = t["a"].view(torch.float32)
    y_q = torch.empty((M, F), device="cuda", dtype=torch.float8_e4m3fn)
    runs = {
        # the split of b3_t_q's time: + C loaded (c_only_fp8), + the row-major outputs (b3_nt_q), + the transposed ones
        "c_only_fp8": lambda: c_only_epi(doutq, w2q_kn, a32, out={"D": y}, config=cfg, tuned=False),
        "b3_nt_q": lambda: nt_q_epi(doutq, w2q_kn, a32, out={"postact": y_q, "daq": daq}, store_d=False, config=cfg,
                                    tuned=False, rstd=r, scale=one, inv_scale=scalar32(inv), inv_y=scalar32(inv_y)),
        # the packed-mode B3s (bf16 da written): quack's bf16 B3, and with the e5m2 da too
        "b3_bf16": lambda: dswiglu_rstd_preact_mod(t["dout"], t["w2"], t["a"], out={"D": da, "postact": y}, config=cfg,
                                                   tuned=False, rstd=r),
        "b3_fp8": lambda: P.dswiglu_rstd_preact_fp8_epi(t["dout"], t["w2"], t["a"], out={"D": da, "postact": y, "daq": daq},
                                                        config=cfg, tuned=False, rstd=r, inv_scale=inv, da_scale=1.0 / inv),
        # B3's fp8 GEMM with nothing in its epilogue (the mainloop's share), and the defaults' B3 (da, da^T and
        # y^T in 8 bits; bf16 GEMM) and the same on the fp8 GEMM (fp8_down_dgrad)
        "plain_fp8": lambda: plain_epi(doutq, w2q_kn, None, out={"D": y}, config=cfg, tuned=False),
        "b3_t": lambda: NS._b3_e5m2_t("probe_b3_t", y_t["t"], t["dout"], t["w2"], t["a"], r, inv, inv_y, config=cfg),
        "b3_t_q": lambda: NS._b3_e5m2_t("probe_b3_t_q", y_t["t_q"], doutq, w2q_kn, t["a"], r, inv, inv_y, config=cfg,
                                        scale=one),
    }
    # b3_t / b3_t_q with overlapped pingpong epilogues (``coda_titan.kernels.cute.overlap``; pingpong configs only),
    # on a config object of their own (quack's eager call cache keys a pinned config by its id)
    cfg_ov = _cfg(CONFIGS[idx])
    for k in ("t", "t_q"):
        runs[f"b3_{k}_ov"] = _overlapped(lambda k=k: NS._b3_e5m2_t(
            f"probe_b3_{k}_ov", y_t[k], *((t["dout"], t["w2"]) if k == "t" else (doutq, w2q_kn)), t["a"], r, inv, inv_y,
            config=cfg_ov, **({} if k == "t" else {"scale": one})))
    # b3_t / b3_t_q with a 64 x 64 epilogue subtile (``stages.epi_tile``: half the subtile rounds of quack's
    # 64 x 32), and b3_t_q so with the C-stage base at 2 too (the larger subtile's staging costs mainloop stages)
    for k, tile_base in (("t_e64", None), ("t_q_e64", None), ("t_q_e64_c2", 2)):
        q = "_q" in k
        runs[f"b3_{k}"] = _epi_tiled(lambda k=k, q=q, cfg_e=_cfg(CONFIGS[idx]): NS._b3_e5m2_t(
            f"probe_b3_{k}", y_t["t_q" if q else "t"], *((doutq, w2q_kn) if q else (t["dout"], t["w2"])), t["a"], r, inv,
            inv_y, config=cfg_e, **({"scale": one} if q else {})), (64, 64), tile_base)
    for k, (tile, base) in OV_VARIANTS.items():
        runs[k] = _overlapped(_epi_tiled(lambda k=k, cfg_v=_cfg(CONFIGS[idx]): NS._b3_e5m2_t(
            f"probe_{k}", y_t["t_q"], doutq, w2q_kn, t["a"], r, inv, inv_y, config=cfg_v, scale=one), tile, base))
    row = {k: _time(runs[k]) for k in kernels}
    plain = {}  # (each plain kernel's outputs, computed once for all its variants)
    for k, other in (("b3_t", "b3_t_ov"), ("b3_t_q", "b3_t_q_ov"), ("b3_t", "b3_t_e64"), ("b3_t_q", "b3_t_q_e64"),
                     ("b3_t_q", "b3_t_q_e64_c2"), *(("b3_t_q", k) for k in OV_VARIANTS)):
        # (the variant's outputs are the plain kernel's, bit for bit)
        if other in kernels:
            if k not in plain:
                plain[k] = [x.clone() for x in runs[k]()]
            row[f"{other}_bits_equal"] = all(torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a, b.view(
                torch.uint8) if b.dtype.itemsize == 1 else b) for a, b in zip(plain[k], runs[other]()))
    return row


def _epi_tiled(fn, tile, base=None):
    from coda_titan.kernels.cute import stages

    def run():
        with stages.epi_tile(tile), stages.capped(base):
            return fn()
    return run


def _overlapped(fn):
    from coda_titan.kernels.cute import overlap

    def run():
        with overlap.requested():
            return fn()
    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--child-b3", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--skip", nargs="*", default=[], help="parts to skip: b2 b3 cublas")
    ap.add_argument("--b3", nargs="*", default=list(B3_KERNELS), choices=B3_KERNELS, help="B3 kernels to time per config")
    ap.add_argument("--configs", nargs="*", type=int, default=None, help="indices into CONFIGS (default: all)")
    args = ap.parse_args()
    if args.child_b3 is not None:
        print("ROW " + json.dumps(_b3_child(args.child_b3, args.b3)), flush=True)
        return

    import coda_titan.kernels.cute  # noqa: F401  (fast fp8 accumulation)
    from quack.epilogue.library import rms_bwd_apply_epi

    plain_epi = _plain_epi()

    doc = _meta()
    doc["configs"] = [dict(zip(("tile_m", "tile_n", "pingpong", "cluster_m", "cluster_n"), c)) for c in CONFIGS]
    doc["rows"] = []
    slug = re.sub(r"[^A-Za-z0-9]+", "_", doc["device"]).strip("_")
    out_dir = os.environ.get("OUT", "benchmarks/results")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"probe_fp8_configs_{slug}.json")

    def emit(row):
        doc["rows"].append(row)
        print(json.dumps({k: (v["median_ms"] if isinstance(v, dict) and "median_ms" in v else v) for k, v in row.items()}),
              flush=True)
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)

    t = _inputs(torch.Generator(device="cuda").manual_seed(0))
    if "cublas" not in args.skip:
        one = torch.ones((), device="cuda")
        w2q_t = (t["w2"].float() * 2**8).clamp(-448, 448).to(torch.float8_e4m3fn)  # (D, F): B = w2q_t.t() is K-major
        doutq = (t["dout"].float() * 2**14).clamp(-57344, 57344).to(torch.float8_e5m2)
        emit({"part": "cublas", "gemm": "da @ W13 (B2-W13)", "bf16": _time(lambda: torch.mm(t["da"], t["w13"])),
              "fp8": _time(lambda: torch._scaled_mm(t["daq"], t["w13q_t"].t(), one, one, out_dtype=torch.bfloat16,
                                                    use_fast_accum=True))})
        w2q_kn = w2q_t.t().contiguous().t()  # (D, F) with D contiguous: K-major B for the (M, D) x (D, F) GEMM
        emit({"part": "cublas", "gemm": "dout @ W2 (B3)", "bf16": _time(lambda: torch.mm(t["dout"], t["w2"])),
              "fp8": _time(lambda: torch._scaled_mm(doutq, w2q_kn, one, one, out_dtype=torch.bfloat16,
                                                    use_fast_accum=True))})

    if "b2" not in args.skip:
        r = t["rstd"]
        corr = -(r * r / D) * t["zdz"]
        w = t["gamma"].float()
        out = torch.empty_like(t["x"])
        for i, c in enumerate(CONFIGS):
            cfg = _cfg(c)
            row = {"part": "b2_w13", "config": i}
            t0 = time.perf_counter()
            try:
                row["plain_fp8"] = _time(lambda: plain_epi(t["daq"], t["w13q_t"].t(), None, out={"D": out},
                                                           config=cfg, tuned=False))
                row["b2_fp8"] = _time(lambda: rms_bwd_apply_epi(t["daq"], t["w13q_t"].t(), t["dres"], out={"D": out},
                                                                config=cfg, tuned=False, y=t["x"], w=w, corr=corr))
                row["b2_bf16"] = _time(lambda: rms_bwd_apply_epi(t["da"], t["w13"], t["dres"], out={"D": out},
                                                                 config=cfg, tuned=False, y=t["x"], w=w, corr=corr))
            except Exception as e:  # noqa: BLE001 - a config quack rejects is a result too
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            row["wall_s"] = round(time.perf_counter() - t0, 1)
            emit(row)

    if "b3" not in args.skip:
        del t
        torch.cuda.empty_cache()
        _b3_children(emit, args.b3, args.configs)
    print("wrote", path, flush=True)


def _b3_children(emit, kernels, configs=None) -> None:
    """B3 per config, each in a child process with a timeout (one candidate hangs)."""
    for i in range(len(CONFIGS)) if configs is None else configs:
        row = {"part": "b3", "config": i}
        t0 = time.perf_counter()
        try:
            p = subprocess.run([sys.executable, "-m", "scripts.probes.fp8_configs", "--child-b3", str(i), "--b3", *kernels],
                               capture_output=True, text=True, timeout=B3_TIMEOUT_S)
            lines = [ln for ln in p.stdout.splitlines() if ln.startswith("ROW ")]
            if lines:
                row.update(json.loads(lines[-1][4:]))
            else:
                row["error"] = f"rc {p.returncode}: {(p.stderr or '')[-400:]}"
        except subprocess.TimeoutExpired:
            row["error"] = f"timed out after {B3_TIMEOUT_S} s (hang)"
        row["wall_s"] = round(time.perf_counter() - t0, 1)
        emit(row)


if __name__ == "__main__":
    main()
