"""CUDA kernels of F2 and B3 (``coda_titan.kernels.norm_swiglu``).

norm_swiglu      quack's ``rstd_swiglu_preact_epi``: a = acc (saved), y = silu(r a_g) * (r a_u),
                 gate/up as adjacent columns of the interleaved W13; with ``w3``, B = [w1; w3] (``stacked_rows``)
                 interleaved by quack's ``concat_layout`` as its TMA loads it ([coda] stacked_weights)
norm_swiglu_fp8  ``epilogues.fp8_rstd_swiglu_preact_epi`` on e4m3 Hq and W13q
norm_swiglu_q_fp8 ``epilogues.fp8_rstd_swiglu_q_epi``: the same writing e4m3 y (our 8-bit paired-column
                 store, ``epilogues.GatedNarrowStore``) and reducing amax |y|
swiglu_bwd       quack's ``dswiglu_rstd_preact_mod``: da = r * dz, y recomputed, sum(dz * a) partials; with
                 ``CODA_TITAN_EPI_C_STAGES`` (B2's C-stage base, ``stages``) our copy of it with that base
                 (``CODA_TITAN_B3_C_STAGES``, where set, is B3's alone: 0 = quack's); ``concat``:
                 ``dswiglu_rstd_preact_concat_epi``, da's halves stored as two tiles ([coda] stacked_weights)
swiglu_bwd_fp8   ``epilogues.dswiglu_rstd_preact_fp8_epi``: also packs e5m2 da two per 16-bit word
                 (delayed scale) and reduces amax |da|; a pinned tile config (see ``_b3_fp8_config``)
swiglu_bwd_e5m2  ``epilogues.dswiglu_rstd_preact_e5m2_epi``: the same less the bf16 da (no D store; a read
                 through its float32 view, a (gate, up) pair per word), the same pinned config; with
                 inv_y, ``epilogues.dswiglu_rstd_preact_e5m2_yq_epi`` (y stored as e4m3)
swiglu_bwd_e5m2_t ``epilogues.dswiglu_rstd_preact_e5m2_t_epi``: also da's gate and up halves as M-major e5m2
                 outputs, views of the rows of one (2F, M) buffer; with inv_y, ``..._t_yq_epi`` and y^T as
                 e4m3 through an M-major view of an (F, M) buffer
swiglu_bwd_q_fp8 the same on an fp8 GEMM (e5m2 D x e4m3 W2^T, ``epilogues.dswiglu_rstd_preact_q_fp8_epi``
                 folds the dequantization into dy's per-row factor), the same pinned config
swiglu_bwd_e5m2_t_q ``swiglu_bwd_e5m2_t`` on that fp8 GEMM (``epilogues.dswiglu_rstd_preact_e5m2_t_q_epi``,
                 ``..._t_yq_q_epi``)
norm_swiglu_qa_fp8 ``preact_e4m3.fp8_rstd_swiglu_qa_epi``: ``norm_swiglu_q_fp8`` saving a as e4m3 pairs, no D
swiglu_bwd_e5m2_t_qa ``swiglu_bwd_e5m2_t_q`` on those pairs (``preact_e4m3.dswiglu_rstd_preact_e5m2_t_qa_epi``,
                 ``..._t_yq_qa_epi``): C is the codes' bf16 view, half of a's bytes
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch
from quack.activation import dswiglu
from quack.epilogue.frontend import gemm_epilogue
from quack.epilogue.library import dswiglu_rstd_preact_mod, rstd_swiglu_preact_epi
from quack.epilogue.ops import ColVecLoad, ColVecReduce
from quack.gemm_config import GemmConfig

from .. import norm_swiglu as ref
from .._common import stacked_rows
from ..scaling import E4M3, E5M2, compute_dtype
from . import overlap, stages
from ._dispatch import CALIBRATION, KERNEL_DTYPES, fallback, first_call, gemm, scalar32, unsupported, unsupported_fp8
from .epilogues import _bf16_hi, _bf16_lo
from .epilogues import (dswiglu_rstd_preact_e5m2_epi, dswiglu_rstd_preact_e5m2_t_epi, dswiglu_rstd_preact_e5m2_t_q_epi,
                        dswiglu_rstd_preact_e5m2_t_yq_epi, dswiglu_rstd_preact_epi, dswiglu_rstd_preact_e5m2_t_yq_q_epi,
                        dswiglu_rstd_preact_e5m2_yq_epi, dswiglu_rstd_preact_fp8_epi, dswiglu_rstd_preact_q_fp8_epi,
                        fp8_rstd_swiglu_preact_epi, fp8_rstd_swiglu_q_epi)
from .preact_e4m3 import dswiglu_rstd_preact_e5m2_t_qa_epi, dswiglu_rstd_preact_e5m2_t_yq_qa_epi, fp8_rstd_swiglu_qa_epi
from .row_vectors import fold_amax


@torch.library.register_kernel("coda::norm_swiglu", "cuda")
def _norm_swiglu(h, rstd, w13, w3=None):
    why = unsupported(h, w13) if w3 is None else unsupported(h, w13, w3)
    f2 = w13.shape[0] * (1 if w3 is None else 2)
    if why or f2 % 16:
        return fallback(ref.norm_swiglu_op, why or f"hidden {f2 // 2} (need % 8)", h, rstd, w13, w3)
    m = h.shape[0]
    a = h.new_empty((m, f2))
    y = h.new_empty((m, f2 // 2))
    # (with w3: B = [w1; w3], a view where they share a buffer, its rows interleaved by the load: ``concat_layout``)
    b, concat = (w13, {}) if w3 is None else (stacked_rows(w13, w3), {"concat_layout": ("B",)})
    with first_call("norm_swiglu" if w3 is None else "norm_swiglu_concat", h, b):
        gemm(rstd_swiglu_preact_epi, h, b.t(), None, {"D": a, "postact": y}, rstd=rstd.float(), **concat)
    return y, a


@torch.library.register_kernel("coda::norm_swiglu_fp8", "cuda")
def _norm_swiglu_fp8(hq, rstd, w13q, scale, out_dtype):
    why = unsupported_fp8(hq, w13q)
    if why is None and (w13q.shape[0] % 32 or out_dtype not in KERNEL_DTYPES):
        why = f"hidden {w13q.shape[0] // 2} / out dtype {out_dtype} (need % 16, bf16/fp16)"
    if why:
        return fallback(ref.norm_swiglu_fp8_op, why, hq, rstd, w13q, scale, out_dtype)
    m, f2 = hq.shape[0], w13q.shape[0]
    a = torch.empty((m, f2), device=hq.device, dtype=out_dtype)
    y = torch.empty((m, f2 // 2), device=hq.device, dtype=out_dtype)
    with first_call("norm_swiglu_fp8", hq, w13q):
        gemm(fp8_rstd_swiglu_preact_epi, hq, w13q.t(), None, {"D": a, "postact": y},
             rstd=rstd.float(), scale=scalar32(scale))
    return y, a


@torch.library.register_kernel("coda::norm_swiglu_q_fp8", "cuda")
def _norm_swiglu_q_fp8(hq, rstd, w13q, scale, inv_y, out_dtype):
    why = unsupported_fp8(hq, w13q)
    if why is None and (w13q.shape[0] % 32 or out_dtype not in KERNEL_DTYPES):
        why = f"hidden {w13q.shape[0] // 2} / out dtype {out_dtype} (need % 16, bf16/fp16)"
    if why:
        return fallback(ref.norm_swiglu_q_fp8_op, why, hq, rstd, w13q, scale, inv_y, out_dtype)
    m, f2 = hq.shape[0], w13q.shape[0]
    a = torch.empty((m, f2), device=hq.device, dtype=out_dtype)
    yq = torch.empty((m, f2 // 2), device=hq.device, dtype=E4M3)
    with first_call("norm_swiglu_q_fp8", hq, w13q):
        res = gemm(fp8_rstd_swiglu_q_epi, hq, w13q.t(), None, {"D": a, "postact": yq},
                   rstd=rstd.float(), scale=scalar32(scale), inv_y=scalar32(inv_y))
    return yq, a, fold_amax(res["amax"], torch.float32).to(compute_dtype(out_dtype))


@gemm_epilogue(outputs=("postact", "dag", "dau"), ops={"rstd": ColVecLoad("rstd")}, reduces={"dsum": ColVecReduce("dsum")})
def dswiglu_rstd_preact_concat_epi(acc, c, rstd):
    """B3's bf16 epilogue with da in [gate | up] column order (``swiglu_bwd(concat=True)``): the math of
    ``epilogues.dswiglu_rstd_preact_epi``, its (gate, up) pair one 32-bit word of C (a's float32 view), no D;
    ``dag`` and ``dau`` are the two halves of one (M, 2F) da, so dW13 = da^T H comes out as [dW1; dW3]."""
    g, u = _bf16_lo(c), _bf16_hi(c)
    dgs, dus, s = dswiglu(g * rstd, u * rstd, acc)
    return {"postact": s, "dsum": dgs * g + dus * u, "dag": dgs * rstd, "dau": dus * rstd}


@torch.library.register_kernel("coda::swiglu_bwd", "cuda")
def _swiglu_bwd(dout, w_down, a, rstd, concat=False):
    why = unsupported(dout, w_down, a)
    if why is None and concat and a.dtype != torch.bfloat16:
        why = f"a in {a.dtype} with concat (the epilogue splits bf16 pairs)"
    if why:
        return fallback(ref.swiglu_bwd_op, why, dout, w_down, a, rstd, concat)
    r = rstd.float()
    da = torch.empty_like(a)
    f = a.shape[1] // 2
    y = a.new_empty((a.shape[0], f))
    base = stages.requested_base("b3")  # (a wide tile keeps a third A/B stage beside the C tile)
    if concat:
        epi, c, out = dswiglu_rstd_preact_concat_epi, a.view(torch.float32), {"dag": da[:, :f], "dau": da[:, f:]}
    else:
        epi, c, out = dswiglu_rstd_preact_mod if base is None else dswiglu_rstd_preact_epi, a, {"D": da}
    with first_call("swiglu_bwd_concat" if concat else "swiglu_bwd", dout, w_down), stages.capped(base):
        res = gemm(epi, dout, w_down, c, {**out, "postact": y}, rstd=r, **({"store_d": False} if concat else {}))
    return da, y, res["dsum"] * r


@functools.cache
def _b3_fp8_config(device):
    """The pinned tile config of the fp8 B3: the autotuner's 256 x 160 cooperative 1 x 2 candidate of
    this epilogue never finishes; this one is the fastest of the others on the H100
    (benchmarks/results/archive/probe_fp8_configs_packed_b3_*.json) and the bf16 B3's autotuned choice there."""
    if torch.cuda.get_device_capability(device)[0] != 9:
        return None  # quack's per-arch default
    return GemmConfig(tile_m=128, tile_n=128, pingpong=True, cluster_m=1, cluster_n=2,
                      is_dynamic_persistent=False, device_capacity=9)


def _b3_outputs(res, inv):
    """(zdz, amax |da|) from a ``_dswiglu_e5m2`` epilogue's dsum and amax partials, which come in units of
    r inv (zdz's r included) and inv: each divided by inv (the (1,) fp32 e5m2 scale)."""
    return res["dsum"] / inv, fold_amax(res["amax"], torch.float32, div=inv)


def _b3_e5m2(name, epi, dout, b_kn, a, rstd, inv, **ops):
    """B3 with an e5m2 da (``epi``: a ``_dswiglu_e5m2`` epilogue with D) on the pinned tile config at the
    (1,) fp32 scale ``inv``: (da, y, zdz, daq, amax |da|)."""
    m, f2 = a.shape
    da = torch.empty_like(a)
    y = a.new_empty((m, f2 // 2))
    daq = torch.empty((m, f2 // 2), device=a.device, dtype=torch.float16)  # e5m2 pairs, see _e5m2x2_as_f16
    with first_call(name, dout, b_kn):
        res = epi(dout, b_kn, a, out={"D": da, "postact": y, "daq": daq}, tuned=False, config=_b3_fp8_config(a.device),
                  rstd=rstd.float(), inv_scale=inv, da_scale=1.0 / inv, **ops)
    zdz, amax = _b3_outputs(res, inv)
    return da, y, zdz, daq.view(E5M2), amax


@torch.library.register_kernel("coda::swiglu_bwd_fp8", "cuda")
def _swiglu_bwd_fp8(dout, w_down, a, rstd, inv_scale):
    why = unsupported(dout, w_down, a)
    if why is None and inv_scale is None:
        why = CALIBRATION  # needs all of da before its first e5m2
    if why:
        return fallback(ref.swiglu_bwd_fp8_op, why, dout, w_down, a, rstd, inv_scale)
    return _b3_e5m2("swiglu_bwd_fp8", dswiglu_rstd_preact_fp8_epi, dout, w_down, a, rstd, scalar32(inv_scale))


@torch.library.register_kernel("coda::swiglu_bwd_e5m2", "cuda")
def _swiglu_bwd_e5m2(dout, w_down, a, rstd, inv_scale, inv_y=None):
    why = unsupported(dout, w_down, a)
    if why is None and inv_scale is None:
        why = CALIBRATION
    if why is None and a.dtype != torch.bfloat16:
        why = f"a in {a.dtype} (the epilogue splits bf16 pairs)"
    if why:
        return fallback(ref.swiglu_bwd_e5m2_op, why, dout, w_down, a, rstd, inv_scale, inv_y)
    m, f2 = a.shape
    inv = scalar32(inv_scale)
    y = torch.empty((m, f2 // 2), device=a.device, dtype=a.dtype if inv_y is None else E4M3)
    daq = torch.empty((m, f2 // 2), device=a.device, dtype=torch.float16)  # e5m2 pairs, see _e5m2x2_as_f16
    epi, ops = ((dswiglu_rstd_preact_e5m2_epi, {}) if inv_y is None else
                (dswiglu_rstd_preact_e5m2_yq_epi, {"inv_y": scalar32(inv_y)}))
    with first_call("swiglu_bwd_e5m2", dout, w_down):
        res = epi(dout, w_down, a.view(torch.float32), out={"postact": y, "daq": daq}, store_d=False, tuned=False,
                  config=_b3_fp8_config(a.device), rstd=rstd.float(), inv_scale=inv, **ops)
    zdz, amax = _b3_outputs(res, inv)
    return y, zdz, daq.view(E5M2), amax


@functools.cache
def _b3_overlap_config(device):
    """The pinned config as an object of its own for B3 with overlapped epilogues (quack's eager call
    cache keys a pinned config by its id), or None where the pinned one is quack's default."""
    base = _b3_fp8_config(device)
    return None if base is None else dataclasses.replace(base)


def _b3_e5m2_t(name, epis, a_op, b_kn, a, rstd, inv_scale, inv_y, config=None, y_dtype=None, **ops):
    """B3 writing e5m2 da and da^T (``epis``: the epilogue without and with an e4m3 y^T) on the pinned
    tile config (or ``config``: ``scripts/probes/fp8_configs.py``): (y or y^T, zdz, daq, daq_t, amax |da|).
    Without ``config``, on the fp8 GEMM (``scale`` given), its two pingpong warpgroups' epilogues overlap
    (``overlap``: 5% faster at the 1B shapes, the same bits; on the bf16 GEMM 8% slower, so only with
    ``CODA_TITAN_OVERLAP_EPILOGUES=1``; ``gpu_train.sh overlap``)."""
    m, f2 = a.shape
    inv = scalar32(inv_scale)
    daq = torch.empty((m, f2 // 2), device=a.device, dtype=torch.float16)  # e5m2 pairs, see _e5m2x2_as_f16
    daq_t = torch.empty((f2, m), device=a.device, dtype=E5M2)  # [gate; up] rows, each (F, M): M-major views
    if inv_y is None:
        y = torch.empty((m, f2 // 2), device=a.device, dtype=y_dtype or a.dtype)
        epi, y_out = epis[0], y
    else:  # y^T, e4m3: the output (M, F) as an M-major view
        y = torch.empty((f2 // 2, m), device=a.device, dtype=E4M3)
        epi, y_out, ops = epis[1], y.t(), {**ops, "inv_y": scalar32(inv_y)}
    out = {"postact": y_out, "daq": daq, "dagt": daq_t[: f2 // 2].t(), "daut": daq_t[f2 // 2:].t()}
    overlapped = config is None and overlap.enabled("scale" in ops) and _b3_overlap_config(a.device) is not None
    if config is None:
        config = _b3_overlap_config(a.device) if overlapped else _b3_fp8_config(a.device)
    with first_call(name, a_op, b_kn), (overlap.requested() if overlapped else contextlib.nullcontext()):
        c = a.view(torch.bfloat16) if a.dtype == E4M3 else a.view(torch.float32)  # (one word a (gate, up) pair)
        res = epi(a_op, b_kn, c, out=out, store_d=False, tuned=False, config=config,
                  rstd=rstd.float(), inv_scale=inv, **ops)
    zdz, amax = _b3_outputs(res, inv)
    return y, zdz, daq.view(E5M2), daq_t, amax


def _b3_t_unsupported(a, inv_scale):
    if inv_scale is None:
        return CALIBRATION  # needs all of da before its first e5m2
    if a.dtype != torch.bfloat16 or a.shape[0] % 16:
        return f"a in {a.dtype} with {a.shape[0]} rows (need bf16, rows % 16 for the transposed store)"
    return None


@torch.library.register_kernel("coda::swiglu_bwd_e5m2_t", "cuda")
def _swiglu_bwd_e5m2_t(dout, w_down, a, rstd, inv_scale, inv_y=None):
    why = unsupported(dout, w_down, a) or _b3_t_unsupported(a, inv_scale)
    if why:
        return fallback(ref.swiglu_bwd_e5m2_t_op, why, dout, w_down, a, rstd, inv_scale, inv_y)
    return _b3_e5m2_t("swiglu_bwd_e5m2_t", (dswiglu_rstd_preact_e5m2_t_epi, dswiglu_rstd_preact_e5m2_t_yq_epi),
                      dout, w_down, a, rstd, inv_scale, inv_y)


@torch.library.register_kernel("coda::swiglu_bwd_e5m2_t_q", "cuda")
def _swiglu_bwd_e5m2_t_q(doutq, w_down_tq, scale, a, rstd, inv_scale, inv_y=None):
    why = (unsupported(a) or unsupported_fp8(doutq, dtypes=(E4M3, E5M2)) or unsupported_fp8(w_down_tq)
           or _b3_t_unsupported(a, inv_scale))
    if why:
        return fallback(ref.swiglu_bwd_e5m2_t_q_op, why, doutq, w_down_tq, scale, a, rstd, inv_scale, inv_y)
    return _b3_e5m2_t("swiglu_bwd_e5m2_t_q", (dswiglu_rstd_preact_e5m2_t_q_epi, dswiglu_rstd_preact_e5m2_t_yq_q_epi),
                      doutq, w_down_tq.t(), a, rstd, inv_scale, inv_y, scale=scalar32(scale))


@torch.library.register_kernel("coda::swiglu_bwd_q_fp8", "cuda")
def _swiglu_bwd_q_fp8(doutq, w_down_tq, scale, a, rstd, inv_scale):
    why = unsupported(a) or unsupported_fp8(doutq, dtypes=(E4M3, E5M2)) or unsupported_fp8(w_down_tq)
    if why is None and inv_scale is None:
        why = CALIBRATION  # needs all of da before its first e5m2
    if why:
        return fallback(ref.swiglu_bwd_q_fp8_op, why, doutq, w_down_tq, scale, a, rstd, inv_scale)
    return _b3_e5m2("swiglu_bwd_q_fp8", dswiglu_rstd_preact_q_fp8_epi, doutq, w_down_tq.t(), a, rstd,
                    scalar32(inv_scale), scale=scalar32(scale))


@torch.library.register_kernel("coda::norm_swiglu_qa_fp8", "cuda")
def _norm_swiglu_qa_fp8(hq, rstd, w13q, scale, inv_y, inv_a, out_dtype):
    why = unsupported_fp8(hq, w13q)
    if why is None and (w13q.shape[0] % 32 or out_dtype not in KERNEL_DTYPES):
        why = f"hidden {w13q.shape[0] // 2} / out dtype {out_dtype} (need % 16, bf16/fp16)"
    if why:
        return fallback(ref.norm_swiglu_qa_fp8_op, why, hq, rstd, w13q, scale, inv_y, inv_a, out_dtype)
    m, f2 = hq.shape[0], w13q.shape[0]
    yq = torch.empty((m, f2 // 2), device=hq.device, dtype=E4M3)
    aq = torch.empty((m, f2), device=hq.device, dtype=E4M3)
    with first_call("norm_swiglu_qa_fp8", hq, w13q):
        res = gemm(fp8_rstd_swiglu_qa_epi, hq, w13q.t(), None, {"postact": yq, "aq": aq.view(torch.bfloat16)},
                   store_d=False, rstd=rstd.float(), scale=scalar32(scale), inv_y=scalar32(inv_y), inv_a=scalar32(inv_a))
    ct = compute_dtype(out_dtype)
    return yq, aq, fold_amax(res["amax"], torch.float32).to(ct), fold_amax(res["amax_a"], torch.float32).to(ct)


@torch.library.register_kernel("coda::swiglu_bwd_e5m2_t_qa", "cuda")
def _swiglu_bwd_e5m2_t_qa(doutq, w_down_tq, scale, aq, a_scale, rstd, inv_scale, out_dtype, inv_y=None):
    why = unsupported_fp8(aq) or unsupported_fp8(doutq, dtypes=(E4M3, E5M2)) or unsupported_fp8(w_down_tq)
    if why is None and (inv_scale is None or aq.shape[0] % 16 or out_dtype not in KERNEL_DTYPES):
        why = f"a current-amax scale, {aq.shape[0]} rows or out dtype {out_dtype} (need a delayed scale, % 16, bf16)"
    if why:
        return fallback(ref.swiglu_bwd_e5m2_t_qa_op, why, doutq, w_down_tq, scale, aq, a_scale, rstd, inv_scale,
                        out_dtype, inv_y)
    return _b3_e5m2_t("swiglu_bwd_e5m2_t_qa", (dswiglu_rstd_preact_e5m2_t_qa_epi, dswiglu_rstd_preact_e5m2_t_yq_qa_epi),
                      doutq, w_down_tq.t(), aq, rstd, inv_scale, inv_y, y_dtype=out_dtype, scale=scalar32(scale),
                      a_scale=scalar32(a_scale))
