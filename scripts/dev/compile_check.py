"""Compile CODA's CuTeDSL epilogue kernels for sm90a on a machine without a GPU (a development check).

    PYTHONPATH=. python3.12 -m scripts.dev.compile_check [NAME ...]

CuTeDSL traces and compiles a kernel to a cubin without a device; only quack's launch path needs one.
This runs each named program's quack call on CPU tensors of the right dtypes, layouts and (small)
shapes, with quack's device queries answered for an H100 (compute capability 9.0, 132 SMs) and its
launch replaced by a no-op: what compiles here is the kernel the GPU would build for those layouts,
so trace and compile errors show before a device call. It checks nothing about values or speed.
Needs Python 3.12 with nvidia-cutlass-dsl, quack-kernels, torch (any build: no CUDA is used) and what
``coda_titan`` imports: ``scripts/dev/setup_py312.sh`` builds such a venv.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # (no device to ask: compile for the H100)
os.environ.setdefault("QUACK_CACHE_DIR", tempfile.mkdtemp(prefix="compile_check_"))  # (compile, never a cache hit)


def _patch_quack_for_cpu():
    import quack.cute_dsl_utils as cdu
    import quack.epilogue.frontend as fe
    import quack.epilogue.ops as ops
    import quack.gemm_runtime.host as host

    ops.Scalar._validate_pointer_value = lambda self, value: None  # (its one check that needs a device: is_cuda)

    def capacity(device=None):
        return (9, 0)

    for mod in (cdu, fe):
        mod.get_device_capacity = capacity
    host.get_max_active_clusters = lambda *a, **k: 132
    launched = []

    def no_launch(plan, *args, **kwargs):
        launched.append(plan)

    host.run_gemm_epi_plan = no_launch
    fe.run_gemm_epi_plan = no_launch
    return launched


def _b3_t(config=None, fp8_gemm=False, inv_y=True, m=512, d=256, f=512, epi=None):
    """B3 writing e5m2 da, da^T and (inv_y) e4m3 y^T: ``coda::swiglu_bwd_e5m2_t``'s quack call (``epi``: another
    epilogue with its operands and outputs, a probe's)."""
    import torch

    from coda_titan.kernels.cute import epilogues as ep
    from coda_titan.kernels.scaling import E4M3, E5M2
    from quack.gemm_config import GemmConfig

    cfg = config or GemmConfig(tile_m=128, tile_n=128, pingpong=True, cluster_m=1, cluster_n=2,
                               is_dynamic_persistent=False, device_capacity=9)
    _KEEP.append(cfg)
    a = torch.zeros(m, 2 * f, dtype=torch.bfloat16)
    if fp8_gemm:
        dout, w = torch.zeros(m, d, dtype=E5M2), torch.zeros(f, d, dtype=E4M3).t()
        epi = epi or (ep.dswiglu_rstd_preact_e5m2_t_yq_q_epi if inv_y else ep.dswiglu_rstd_preact_e5m2_t_q_epi)
        ops = {"scale": torch.ones(1)}
    else:
        dout, w = torch.zeros(m, d, dtype=torch.bfloat16), torch.zeros(d, f, dtype=torch.bfloat16)
        epi = ep.dswiglu_rstd_preact_e5m2_t_yq_epi if inv_y else ep.dswiglu_rstd_preact_e5m2_t_epi
        ops = {}
    daq = torch.empty(m, f, dtype=torch.float16)
    daq_t = torch.empty(2 * f, m, dtype=E5M2)
    y = torch.empty(f, m, dtype=E4M3).t() if inv_y else torch.empty(m, f, dtype=torch.bfloat16)
    if inv_y:
        ops["inv_y"] = torch.ones(1)
    out = {"postact": y, "daq": daq, "dagt": daq_t[:f].t(), "daut": daq_t[f:].t()}
    epi(dout, w, a.view(torch.float32), out=out, store_d=False, tuned=False, config=cfg,
        rstd=torch.ones(m), inv_scale=torch.ones(1), **ops)


def _b3_t_qa(inv_y=True, m=512, d=256, f=512):
    """B3 on a's e4m3 codes (``coda::swiglu_bwd_e5m2_t_qa``'s quack call, overlapped as in training): C is the
    codes' bf16 view."""
    import torch

    from coda_titan.kernels.cute import overlap
    from coda_titan.kernels.cute import preact_e4m3 as pe
    from coda_titan.kernels.scaling import E4M3, E5M2

    dout, w = torch.zeros(m, d, dtype=E5M2), torch.zeros(f, d, dtype=E4M3).t()
    aq = torch.zeros(m, 2 * f, dtype=E4M3)
    daq, daq_t = torch.empty(m, f, dtype=torch.float16), torch.empty(2 * f, m, dtype=E5M2)
    y = torch.empty(f, m, dtype=E4M3).t() if inv_y else torch.empty(m, f, dtype=torch.bfloat16)
    ops = {"scale": torch.ones(1), "a_scale": torch.ones(1), **({"inv_y": torch.ones(1)} if inv_y else {})}
    epi = pe.dswiglu_rstd_preact_e5m2_t_yq_qa_epi if inv_y else pe.dswiglu_rstd_preact_e5m2_t_qa_epi
    out = {"postact": y, "daq": daq, "dagt": daq_t[:f].t(), "daut": daq_t[f:].t()}
    with overlap.requested():
        epi(dout, w, aq.view(torch.bfloat16), out=out, store_d=False, tuned=False, config=_pingpong(),
            rstd=torch.ones(m), inv_scale=torch.ones(1), **ops)


def _f2_qa(m=512, k=256, f=512):
    """F2 saving a as e4m3 codes (``coda::norm_swiglu_qa_fp8``'s quack call), on quack's default config."""
    import torch

    from coda_titan.kernels.cute.preact_e4m3 import fp8_rstd_swiglu_qa_epi
    from coda_titan.kernels.scaling import E4M3

    hq, w13q = torch.zeros(m, k, dtype=E4M3), torch.zeros(2 * f, k, dtype=E4M3)
    out = {"postact": torch.empty(m, f, dtype=E4M3), "aq": torch.empty(m, 2 * f, dtype=E4M3).view(torch.bfloat16)}
    fp8_rstd_swiglu_qa_epi(hq, w13q.t(), None, out=out, store_d=False, tuned=False, rstd=torch.ones(m),
                           scale=torch.ones(1), inv_y=torch.ones(1), inv_a=torch.ones(1))


def _f2_concat(m=512, k=256, f=512):
    """F2 (bf16) on W13 given as [w1; w3] (``coda::norm_swiglu`` with ``w3``, [coda] stacked_weights): quack's
    ``rstd_swiglu_preact_epi`` with ``concat_layout=("B",)``, the rows interleaved by the B load."""
    import torch
    from quack.epilogue.library import rstd_swiglu_preact_epi

    h, w13 = torch.zeros(m, k, dtype=torch.bfloat16), torch.zeros(2 * f, k, dtype=torch.bfloat16)
    out = {"D": torch.empty(m, 2 * f, dtype=torch.bfloat16), "postact": torch.empty(m, f, dtype=torch.bfloat16)}
    rstd_swiglu_preact_epi(h, w13.t(), None, out=out, tuned=False, config=_pingpong(), rstd=torch.ones(m),
                           concat_layout=("B",))


def _f1(config=None, m=512, k=256, d=256):
    """F1 (bf16): quack's ``rms_partial_epi`` as ``coda::residual_rms`` calls it, on a pinned config."""
    import torch
    from quack.epilogue.library import rms_partial_epi

    cfg = config or _pingpong()
    y, w, res = torch.zeros(m, k, dtype=torch.bfloat16), torch.zeros(d, k, dtype=torch.bfloat16), torch.zeros(
        m, d, dtype=torch.bfloat16)
    rms_partial_epi(y, w.t(), res, out={"D": torch.empty_like(res), "resid_out": torch.empty_like(res)}, tuned=False,
                    config=cfg, weight=torch.ones(d))


def _f1_q_fp8(config=None, m=512, k=256, d=256, transposed=False):
    """F1 on the fp8 mainloop writing e4m3 Hq (``coda::residual_rms_q_fp8``'s quack call), on a pinned config;
    ``transposed``: ``coda::residual_rms_q_fp8_t``'s (D = X, Hq and Hq^T, no H)."""
    import torch

    from coda_titan.kernels.cute.epilogues import rms_partial_scaled_fp8_epi, rms_partial_scaled_fp8_t_epi
    from coda_titan.kernels.scaling import E4M3

    cfg = config or _pingpong()
    yq, wq, res = torch.zeros(m, k, dtype=E4M3), torch.zeros(d, k, dtype=E4M3), torch.zeros(m, d, dtype=torch.bfloat16)
    out = {"D": torch.empty_like(res), "hq": torch.empty(m, d, dtype=E4M3)}
    if transposed:
        out["hqt"] = torch.empty(d, m, dtype=E4M3).t()
    else:
        out["resid_out"] = torch.empty_like(res)
    epi = rms_partial_scaled_fp8_t_epi if transposed else rms_partial_scaled_fp8_epi
    epi(yq, wq.t(), res, out=out, tuned=False, config=cfg, weight=torch.ones(d), scale=torch.ones(1),
        inv_scale=torch.ones(1))


def _f4(dtype: str | None = None, unrounded: bool = False, m=512, k=256, v=1024):
    """F4's GEMM with the CE epilogue as ``coda::lm_head_ce`` calls it (``dtype``: torch's name of H's, W's and the
    logits' dtype; None: ``coda::lm_head_ce_fp8``'s, e4m3 H and W on the fp8 mainloop, bf16 logits; ``unrounded``:
    its other arm, ``CODA_TITAN_F4_LSE=unrounded``), on quack's default config."""
    import unittest.mock

    import torch

    from coda_titan.kernels.cute.lm_head_ce import f4_epilogue
    from coda_titan.kernels.lm_head_ce import F4_LSE_ENV
    from coda_titan.kernels.scaling import E4M3

    dt = getattr(torch, dtype) if dtype else E4M3
    hq, wq = torch.zeros(m, k, dtype=dt), torch.zeros(v, k, dtype=dt)
    logits = torch.empty(m, v, dtype=getattr(torch, dtype or "bfloat16"))
    with unittest.mock.patch.dict(os.environ, {F4_LSE_ENV: "unrounded"} if unrounded else {}):
        f4_epilogue(logits.dtype)(hq, wq.t(), None, out={"D": logits}, tuned=False, rstd=torch.ones(m),
                                  target=torch.zeros(m, dtype=torch.int64))


def _f4_exp(m=512, k=256, v=1024):
    """F4 without its gradient pass (``CODA_TITAN_CE_PASS=exp``): E = exp(l - c) stored, its partials."""
    import torch

    from coda_titan.kernels.cute.exp_epilogues import rstd_exp_lse_target_epi

    h, w = torch.zeros(m, k, dtype=torch.bfloat16), torch.zeros(v, k, dtype=torch.bfloat16)
    rstd_exp_lse_target_epi(h, w.t(), None, out={"D": torch.empty(m, v, dtype=torch.bfloat16)}, tuned=False,
                            rstd=torch.ones(m), offset=torch.zeros(m), target=torch.zeros(m, dtype=torch.int64))


def _b2_exp(m=512, v=1024, d=256):
    """The LM head's B2 on E (``CODA_TITAN_CE_PASS=exp``): s (E @ W) + kt W[t] (C), then the norm's backward."""
    import torch

    from coda_titan.kernels.cute.exp_epilogues import exp_norm_bwd_last_epi

    e, w, x = (torch.zeros(m, v, dtype=torch.bfloat16), torch.zeros(v, d, dtype=torch.bfloat16),
               torch.zeros(m, d, dtype=torch.bfloat16))
    exp_norm_bwd_last_epi(e, w, torch.zeros_like(x), out={"D": torch.empty_like(x)}, tuned=False, y=x,
                          w=torch.ones(d), corr=torch.zeros(m), s=torch.ones(m), kt=torch.zeros(m))


def _b2(config=None, m=512, k=512, d=256):
    """B2 (bf16): quack's ``rms_bwd_apply_epi`` as ``coda::norm_residual_bwd`` calls it, on a pinned config."""
    import torch
    from quack.epilogue.library import rms_bwd_apply_epi

    cfg = config or _pingpong()
    da, w, x = torch.zeros(m, k, dtype=torch.bfloat16), torch.zeros(k, d, dtype=torch.bfloat16), torch.zeros(
        m, d, dtype=torch.bfloat16)
    rms_bwd_apply_epi(da, w, torch.zeros_like(x), out={"D": torch.empty_like(x)}, tuned=False, config=cfg, y=x,
                      w=torch.ones(d), corr=torch.zeros(m))


def _b2_capped(base=2, config=None, fp8=False, m=512, k=512, d=256, last=False):
    """B2 as ``coda::norm_residual_bwd`` (``fp8``: ``_fp8``) calls it with ``CODA_TITAN_EPI_C_STAGES`` = ``base``:
    our own copy of the epilogue, the C-stage base in its compile key (``stages.capped``), on a 256 x 128
    cooperative tile unless ``config`` is given (the tile the base is for)."""
    import torch

    from coda_titan.kernels.cute import epilogues as ep
    from coda_titan.kernels.cute import stages
    from coda_titan.kernels.scaling import E4M3, E5M2
    from quack.gemm_config import GemmConfig

    cfg = config or GemmConfig(tile_m=256, tile_n=128, pingpong=False, cluster_m=1, cluster_n=2,
                               is_dynamic_persistent=False, device_capacity=9)
    _KEEP.append(cfg)
    da = torch.zeros(m, k, dtype=E5M2 if fp8 else torch.bfloat16)
    w = torch.zeros(d, k, dtype=E4M3).t() if fp8 else torch.zeros(k, d, dtype=torch.bfloat16)
    x = torch.zeros(m, d, dtype=torch.bfloat16)
    epi, c = (ep.norm_residual_bwd_last_epi, None) if last else (ep.norm_residual_bwd_epi, torch.zeros_like(x))
    with stages.capped(base):
        epi(da, w, c, out={"D": torch.empty_like(x)}, tuned=False, config=cfg, y=x, w=torch.ones(d), corr=torch.zeros(m))


def _b3_bf16(base=None, config=None, m=512, k=256, f=512, concat=False):
    """B3 (bf16) as ``coda::swiglu_bwd`` calls it: quack's ``dswiglu_rstd_preact_mod`` (``base`` None) or our
    copy with that C-stage base (``CODA_TITAN_EPI_C_STAGES``), on a 256 x 128 cooperative tile unless ``config``;
    ``concat``: ``swiglu_bwd(concat=True)``'s epilogue, da's halves as two tiles of one (M, 2F) buffer."""
    import torch

    from coda_titan.kernels.cute import epilogues as ep
    from coda_titan.kernels.cute import stages
    from coda_titan.kernels.cute.norm_swiglu import dswiglu_rstd_preact_concat_epi
    from quack.epilogue.library import dswiglu_rstd_preact_mod
    from quack.gemm_config import GemmConfig

    cfg = config or GemmConfig(tile_m=256, tile_n=128, pingpong=False, cluster_m=1, cluster_n=2,
                               is_dynamic_persistent=False, device_capacity=9)
    _KEEP.append(cfg)
    dout, w, a = (torch.zeros(m, k, dtype=torch.bfloat16), torch.zeros(k, f, dtype=torch.bfloat16),
                  torch.zeros(m, 2 * f, dtype=torch.bfloat16))
    y, da = torch.empty(m, f, dtype=torch.bfloat16), torch.empty_like(a)
    with stages.capped(base):
        if concat:
            dswiglu_rstd_preact_concat_epi(dout, w, a.view(torch.float32), out={"postact": y, "dag": da[:, :f],
                                           "dau": da[:, f:]}, store_d=False, tuned=False, config=cfg, rstd=torch.ones(m))
            return
        epi = dswiglu_rstd_preact_mod if base is None else ep.dswiglu_rstd_preact_epi
        epi(dout, w, a, out={"D": da, "postact": y}, tuned=False, config=cfg, rstd=torch.ones(m))


def _report_stages():
    """Print each compiled kernel's (A/B, D, C) stage counts (the C-stage base's effect)."""
    from quack.gemm_sm90 import GemmSm90

    compute = GemmSm90._compute_stages.__func__
    if getattr(compute, "_coda_report", False):
        return

    def report(cls, cta, epi_tile, *args, **kwargs):
        ab, epi, c = compute(cls, cta, epi_tile, *args, **kwargs)
        print(f"  {cls.__name__[:48]} tile {tuple(cta)[:2]} epi tile {tuple(epi_tile)} base {cls.epi_c_stage_base}: "
              f"{ab} A/B, {epi} D, {c} C stages", flush=True)
        return ab, epi, c

    report._coda_report = True
    GemmSm90._compute_stages = classmethod(report)


def _b3_epi_tile(tile, fp8_gemm=True, overlapped=False, base=None):
    """B3 (``_b3_t``) on its own config object with the epilogue subtile ``tile`` (``stages.epi_tile``) and
    C-stage ``base`` (``stages.capped``)."""
    import contextlib

    from coda_titan.kernels.cute import overlap, stages

    with stages.epi_tile(tile), stages.capped(base), (overlap.requested() if overlapped else contextlib.nullcontext()):
        _b3_t(config=_pingpong(), fp8_gemm=fp8_gemm)


def _pingpong():
    from quack.gemm_config import GemmConfig

    cfg = GemmConfig(tile_m=128, tile_n=128, pingpong=True, cluster_m=1, cluster_n=2, is_dynamic_persistent=False,
                     device_capacity=9)
    _KEEP.append(cfg)
    return cfg


_KEEP = []  # (quack's eager call cache keys a pinned config by id(): a freed config's id may come back)


def _probe_epi(module, name):
    import importlib

    return getattr(importlib.import_module(module), name)


def _overlapped(fn):
    """``fn`` with overlapped pingpong epilogues (``coda_titan.kernels.cute.overlap``) on its own config object."""
    from coda_titan.kernels.cute import overlap

    with overlap.requested():
        fn(config=_pingpong())


PROGRAMS = {
    "b3_t": lambda: _b3_t(),
    "b3_t_q": lambda: _b3_t(fp8_gemm=True),
    "b3_t_overlap": lambda: _overlapped(_b3_t),
    "b3_t_q_overlap": lambda: _overlapped(lambda config: _b3_t(config=config, fp8_gemm=True)),
    "b3_t_qa": lambda: _b3_t_qa(),
    "b3_t_qa_bf16_y": lambda: _b3_t_qa(inv_y=False),
    "b3_math_lite": lambda: _overlapped(lambda config: _b3_t(config=config, fp8_gemm=True, epi=_probe_epi(
        "scripts.probes.b3_math", "lite_t_yq_q_epi"))),
    "f2_qa": lambda: _f2_qa(),
    "f1": lambda: _f1(),
    "f4": lambda: _f4("bfloat16"),
    "f4_f16": lambda: _f4("float16"),
    "f4_fp8": lambda: _f4(),
    "f4_unrounded": lambda: _f4("bfloat16", unrounded=True),
    "f4_exp": lambda: _f4_exp(),
    "b2_exp": lambda: _b2_exp(),
    "f1_overlap": lambda: _overlapped(_f1),
    "f1_q_fp8": lambda: _f1_q_fp8(),
    "f1_q_fp8_t": lambda: _f1_q_fp8(transposed=True),
    "f1_q_fp8_overlap": lambda: _overlapped(_f1_q_fp8),
    "b2": lambda: _b2(),
    "b2_overlap": lambda: _overlapped(_b2),
    "b2_wide": lambda: _b2_capped(base=None),
    "b2_wide_c2": lambda: _b2_capped(base=2),
    "b2_wide_c1": lambda: _b2_capped(base=1),
    "b2_wide_c2_fp8": lambda: _b2_capped(base=2, fp8=True),
    "b3_t_epi64x64": lambda: _b3_epi_tile((64, 64), fp8_gemm=False),
    "b3_t_q_epi64x64": lambda: _b3_epi_tile((64, 64)),
    "b3_t_q_overlap_epi64x64": lambda: _b3_epi_tile((64, 64), overlapped=True),
    "b3_t_q_epi128x32": lambda: _b3_epi_tile((128, 32)),
    "b3_t_q_epi64x64_c2": lambda: _b3_epi_tile((64, 64), base=2),
    "b3_t_q_overlap_epi64x16": lambda: _b3_epi_tile((64, 16), overlapped=True),
    "b3_t_q_overlap_epi64x16_c2": lambda: _b3_epi_tile((64, 16), overlapped=True, base=2),
    "b3_t_q_overlap_epi64x16_c6": lambda: _b3_epi_tile((64, 16), overlapped=True, base=6),
    "b3_t_q_overlap_c2": lambda: _b3_epi_tile(None, overlapped=True, base=2),
    "b3_t_q_overlap_c6": lambda: _b3_epi_tile(None, overlapped=True, base=6),
    "b3_t_q_overlap_c8": lambda: _b3_epi_tile(None, overlapped=True, base=8),
    "b2_last_wide": lambda: _b2_capped(base=None, last=True),
    "b2_last_wide_c2": lambda: _b2_capped(base=2, last=True),
    "b3_bf16_wide": lambda: _b3_bf16(),
    "b3_bf16_wide_c2": lambda: _b3_bf16(base=2),
    "b3_bf16_wide_c1": lambda: _b3_bf16(base=1),
    "f2_concat": lambda: _f2_concat(),
    "b3_concat": lambda: _b3_bf16(base=2, config=_pingpong(), concat=True),
    "b3_concat_wide_c2": lambda: _b3_bf16(base=2, concat=True),
    "b3_bf16_pingpong_c2": lambda: _b3_bf16(base=2, config=_pingpong()),
}


def main(argv=None) -> int:
    names = (sys.argv[1:] if argv is None else argv) or list(PROGRAMS)
    launched = _patch_quack_for_cpu()
    _report_stages()
    failed = 0
    for name in names:
        t0 = time.time()
        try:
            PROGRAMS[name]()
            print(f"{name}: compiled ({len(launched)} launches recorded) in {time.time() - t0:.1f} s", flush=True)
        except Exception as e:  # noqa: BLE001 - report each program's error and go on
            failed += 1
            print(f"{name}: FAILED after {time.time() - t0:.1f} s: {type(e).__name__}: {str(e)[:2000]}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
