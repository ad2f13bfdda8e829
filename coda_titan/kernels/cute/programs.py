"""CUDA implementations of the ``torch.ops.coda`` programs: GEMM-epilogue kernels on quack 0.6.5.

Program -> kernel (the math of each is in the reference module of the same name):

==================  ===========================================================================
F1 residual_rms     ``rms_partial_epi``: X = acc + residual, H = X * gamma, per-tile sum X^2
finalize            ``quack.rms_final_reduce`` (CuTeDSL): r = rsqrt(sum S / d + eps)
F2 norm_swiglu      ``rstd_swiglu_preact_epi``: a = acc (saved), y = silu(r a_g) * (r a_u),
                    gate/up as adjacent columns of the interleaved W13
F3 norm_rope        ``rstd_rope_posfreq_epi``: r * acc, then rotation by +theta with the angle
                    pos * freq formed in-kernel as a float-float (v columns: zero frequency)
F4 lm_head_ce       ``rstd_lse_target_epi`` (below): logits = r * acc, online (max, sum exp) and
                    the target logit in the epilogue, per token chunk; then one fused pass makes
                    da = r * (softmax - onehot) and zdz; B2 and dW GEMMs per chunk
B1 rope_bwd         one inductor-fused elementwise + row-reduction pass (no GEMM involved);
                    ``rope_bwd_fp8`` also casts da to e5m2 (current tensorwise scale)
B2 norm_resid_bwd   ``rms_bwd_apply_epi`` / ``..._last_epi``: D = acc * gamma + dres + X * corr,
                    corr = -(r^2/d) zdz, dgamma partials in the epilogue; ``..._fp8``: the
                    same epilogue on e5m2 da x e4m3 W^T, s_da * s_w folded into gamma
B3 swiglu_bwd       ``dswiglu_rstd_preact_mod``: da = r * dz, y recomputed, sum(dz * a) partials;
                    ``swiglu_bwd_fp8``: ``dswiglu_rstd_preact_fp8_epi`` (below) also packs e5m2 da
wgrad / dgrad       plain GEMMs (cuBLAS, fp32 accumulation): every backward program already
                    folded r into da, so there is nothing to fuse
wgrad_fp8           e5m2 / e4m3 token-major copies of both operands (one inductor cast-and-transpose
                    pass each, current scales), then cuBLAS ``_scaled_mm`` (slow accumulation, as
                    torchao's weight gradients)
prologue            rms_partial: H = X * gamma and sum X^2 once per step (torch ops)
==================  ===========================================================================

Inputs the kernels cannot take (dtype other than bf16/fp16, a dimension that is not a multiple of
8, a non-contiguous operand) run the torch reference instead, with one warning per program and
reason. The first call of each program and shape is timed and logged (it compiles and, unless
``CODA_TITAN_AUTOTUNE=0``, autotunes; both are cached on disk, see the package docstring).
"""

from __future__ import annotations

import functools
import logging
import os
import time

import torch
from quack.epilogue.frontend import gemm_epilogue
from quack.epilogue.library import (
    dswiglu_rstd_preact_mod,
    rms_bwd_apply_epi,
    rms_bwd_apply_last_epi,
    rms_partial_epi,
    rstd_swiglu_preact_epi,
)
import cutlass.cute as cute
from cutlass import Float32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op
from quack.activation import dswiglu, swiglu
from quack.epilogue.math import pack, unpack
from quack.epilogue.ops import ColVecLoad, ColVecReduce, ColVecSelect, OnlineLSEReduce, RowVecLoad, Scalar
from quack.epilogue.rotary import make_interleaved_inv_freq, rstd_rope_posfreq_epi
from quack.gemm_config import GemmConfig
from quack.gemm_interface import gemm as quack_gemm
from quack.gemm_interface import gemm_add_inplace
from quack.rms_final_reduce import rms_final_reduce

from .. import ops as _ops
from ..fp8 import (
    E4M3,
    E5M2,
    E5M2_MAX,
    fp8_layer_weights_torch,
    inv_scale_from_amax,
    quantize_e5m2,
    quantize_tensorwise_torch,
    rms_partial_fp8_torch,
    wgrad_fp8_operands,
)
from ..lm_head_ce import IGNORE_INDEX
from ..norm_rope import rope_cos_sin

logger = logging.getLogger("coda_titan")

__all__ = [f"{name}_cute" for name in _ops.OPS] + [
    "rstd_lse_target_epi", "rms_partial_fp8_epi", "fp8_rstd_swiglu_preact_epi", "dswiglu_rstd_preact_fp8_epi",
]

_TUNE = os.environ.get("CODA_TITAN_AUTOTUNE", "1") != "0"
_KERNEL_DTYPES = (torch.bfloat16, torch.float16)


# --- fp8 accumulation -----------------------------------------------------------------------------


_FP8_DTYPES = (E4M3, E5M2)


def _fp8_fast_accumulation() -> bool:
    """Make quack's SM90 GEMMs with 8-bit operands use fast accumulation (the WGMMA accumulates the
    whole K loop in its own registers), as torchao's float8 forward and cuBLAS ``use_fast_accum``
    do. quack 0.6.5's frontend builds every fp8 GEMM with its slow-accumulation path instead, which
    drains the tensor pipe at every k-tile to promote into a second fp32 accumulator: measured on the
    H100, that made the fp8 F2 GEMM slower than the bf16 one. ``CODA_TITAN_FP8_SLOW_ACCUM=1`` keeps
    quack's default. Only fp8 GEMMs are touched; bf16 GEMMs are unchanged.

    The switch rides quack's own ``post_init_attrs`` (attributes set on the kernel object before it
    is traced): they are part of the compile key and they travel with the key to quack's compile
    workers. The autotuner compiles its candidates in forked worker processes, where a patch made in
    this process does not exist, and its ``.o`` cache would hand a kernel compiled there back to this
    process under the same key (measured 2026-11-22 on the H100: after autotuning, B2 of W13 on
    fp8 ran at about twice the time of the same config compiled here)."""
    if os.environ.get("CODA_TITAN_FP8_SLOW_ACCUM", "0") != "0":
        return False
    from quack.epilogue.frontend import EpiMod

    gemm = EpiMod.gemm
    if getattr(gemm, "_coda_fast_accum", False):
        return True

    @functools.wraps(gemm)
    def fast_accum_gemm(self, A, *args, post_init_attrs=(), **kwargs):
        if getattr(A, "dtype", None) in _FP8_DTYPES and all(k != "fp8_slow_accum" for k, _ in post_init_attrs):
            post_init_attrs = (*post_init_attrs, ("fp8_slow_accum", False))
        return gemm(self, A, *args, post_init_attrs=post_init_attrs, **kwargs)

    fast_accum_gemm._coda_fast_accum = True
    EpiMod.gemm = fast_accum_gemm
    return True


FP8_FAST_ACCUM = _fp8_fast_accumulation()


# --- our own epilogue ----------------------------------------------------------------------------

_target_idx = ColVecLoad("target")


@gemm_epilogue(
    ops={"rstd": ColVecLoad("rstd")},
    outs={
        "lse": OnlineLSEReduce("lse"),
        "target_logit": ColVecSelect("target_logit", idx_op=_target_idx),
    },
    extra_ops=(_target_idx,),
)
def rstd_lse_target_epi(acc, rstd):
    """F4's epilogue: logits = r * acc (deferred final-norm rstd), written as D; the online
    (max, sum exp) partials of each row; the row's target logit gathered exactly in fp32 (rows
    whose target is -100 are left untouched)."""
    v = acc * rstd
    return {"D": v, "lse": v, "target_logit": v}


@gemm_epilogue(
    outputs=("resid_out", "hq"),
    ops={"weight": RowVecLoad("weight"), "inv_scale": Scalar("inv_scale")},
    reduces={"sqsum": ColVecReduce("sqsum", scaled=True), "amax": ColVecReduce("amax", combine="max_abs")},
)
def rms_partial_fp8_epi(acc, c, weight, inv_scale):
    """F1's epilogue for precision = "fp8": X = acc + residual (resid_out), H = X * gamma (D, bf16),
    per-tile sum X^2, and the next consumer's e4m3 operand hq = sat(H * inv_scale) (the f32 -> e4m3
    store converts with cvt.rn.satfinite), with the per-row amax |H| for the scale history."""
    x = acc + c
    h = x * weight
    return {"D": h, "resid_out": x, "sqsum": (x, x), "hq": h * inv_scale, "amax": h}


@gemm_epilogue(
    outputs=("postact",),
    ops={"rstd": ColVecLoad("rstd"), "scale": Scalar("scale")},
    mode="acc_pair",
)
def fp8_rstd_swiglu_preact_epi(acc, rstd, scale):
    """F2's epilogue on e4m3 operands: v = (s_a * s_w) * acc is the true-scale pre-activation, saved
    as D for the (bf16) backward; y = SwiGLU(r * v) as the paired-column postact."""
    v = acc * scale
    g, u = unpack(v)
    gs, us = unpack(v * rstd)
    return {"D": pack(g, u), "postact": swiglu(gs, us)}


@dsl_user_op
def _e5m2x2_as_f16(lo: Float32, hi: Float32, *, loc=None, ip=None) -> Float32:
    """Two saturated e5m2 values (lo, hi) packed into one 16-bit word, returned as the f32 value of
    that word read as an f16 (always finite: a satfinite e5m2 never has an all-ones exponent). A
    16-bit output stores it back bit-exactly (f16 -> f32 -> f16 is exact), so a float16 buffer of
    width N holds the e5m2 pairs [lo_j, hi_j], i.e. an e5m2 tensor of width 2N."""
    return Float32(
        llvm.inline_asm(
            T.f32(),
            [Float32(hi).ir_value(loc=loc, ip=ip), Float32(lo).ir_value(loc=loc, ip=ip)],
            "{.reg .b16 t;\ncvt.rn.satfinite.e5m2x2.f32 t, $1, $2;\ncvt.f32.f16 $0, t;}",
            "=f,f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@gemm_epilogue(
    outputs=("postact", "daq"),
    ops={"rstd": ColVecLoad("rstd"), "inv_scale": Scalar("inv_scale")},
    reduces={"dsum": ColVecReduce("dsum"), "amax": ColVecReduce("amax", combine="max_abs")},
    mode="packed_cd_b16x2",
)
def dswiglu_rstd_preact_fp8_epi(acc, c, rstd, inv_scale):
    """B3's epilogue (quack's ``dgated_rstd_preact_mod("swiglu")``) that also writes da as e5m2 for
    B2's fp8 dgrad: daq = sat(da * inv_scale) for the (gate, up) pair of each column, packed into the
    16-bit ``daq`` buffer in da's interleaved order, and the per-row amax |da| for the history."""
    g, u = unpack(c)
    gs, us = g * rstd, u * rstd
    dgs, dus, s = dswiglu(gs, us, acc)
    dg, du = dgs * rstd, dus * rstd
    return {
        "D": pack(dg, du),
        "postact": s,
        "dsum": dgs * g + dus * u,
        "daq": _e5m2x2_as_f16(dg * inv_scale, du * inv_scale),
        "amax": cute.arch.fmax(dg, du, abs=True),
    }


# --- plumbing --------------------------------------------------------------------------------------

_warned: set[tuple[str, str]] = set()
_seen: set[tuple] = set()


def _fallback(name: str, why: str, *args):
    if (name, why) not in _warned:
        _warned.add((name, why))
        logger.warning(f"coda_titan: cute {name} cannot take {why}; running the torch reference for it")
    return _ops.REF[name](*args)


def _unsupported(*tensors: torch.Tensor) -> str | None:
    for t in tensors:
        if not t.is_cuda:
            return f"a {t.device} tensor"
        if t.dtype not in _KERNEL_DTYPES:
            return f"dtype {t.dtype}"
        if t.dim() != 2 or t.stride(-1) != 1 or t.shape[-1] % 8 or (t.shape[0] > 1 and t.stride(0) % 8):
            return f"shape {tuple(t.shape)} / stride {t.stride()} (need 2-D, contiguous rows, width % 8 == 0)"
        if t.shape[0] == 0:
            return "an empty tensor"
    return None


class _first_call:
    """Logs the wall time of the first call of a program for a shape (compile + autotune)."""

    def __init__(self, name: str, *tensors: torch.Tensor):
        self.key = (name, *((tuple(t.shape), t.dtype) for t in tensors))
        self.first = self.key not in _seen

    def __enter__(self):
        if self.first:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.first and exc[0] is None:
            torch.cuda.synchronize()
            _seen.add(self.key)
            logger.info(
                f"coda_titan: cute {self.key[0]} {[s for s, _ in self.key[1:]]} ready in "
                f"{time.perf_counter() - self.t0:.1f} s (first call: compile{' + autotune' if _TUNE else ''})"
            )
        return False


def _gemm(mod, a, b_kn, c, out, **operands):
    return mod(a, b_kn, c, out=out, tuned=_TUNE, **operands)


_compiled: dict[str, object] = {}


def _fused(name: str, fn):
    """``fn`` compiled by inductor into fused kernels (one per shape); eager if compiling fails."""
    if name not in _compiled:
        try:
            _compiled[name] = torch.compile(fn, dynamic=False, fullgraph=True)
        except Exception as e:  # noqa: BLE001 - any compiler failure means: run eager, say so once
            logger.warning(f"coda_titan: could not compile {name} ({e}); running it eagerly")
            _compiled[name] = fn
    return _compiled[name]


_tables: dict[tuple, torch.Tensor] = {}


def _cached(key: tuple, make):
    t = _tables.get(key)
    if t is None:
        if len(_tables) > 64:
            _tables.clear()
        t = _tables[key] = make()
    return t


# --- forward programs ------------------------------------------------------------------------------


@torch.library.register_kernel("coda::rms_partial", "cuda")
def _rms_partial(x, gamma, tile_n):
    # The embedding-norm prologue: no GEMM, once per step.
    xf = x.float()
    h = (xf * gamma.float()).to(x.dtype)
    return h, (xf * xf).sum(-1, keepdim=True)


@torch.library.register_kernel("coda::residual_rms", "cuda")
def _residual_rms(y, weight, residual, gamma, tile_n):
    why = _unsupported(y, weight, residual)
    if why:
        return _fallback("residual_rms", why, y, weight, residual, gamma, tile_n)
    x = torch.empty_like(residual)
    h = torch.empty_like(residual)
    with _first_call("residual_rms", y, weight):
        res = _gemm(rms_partial_epi, y, weight.t(), residual, {"D": h, "resid_out": x}, weight=gamma.float())
    return x, h, res["sqsum"].unsqueeze(1)


@torch.library.register_kernel("coda::rstd_finalize", "cuda")
def _rstd_finalize(partials, dim, eps):
    if partials.dtype != torch.float32 or not partials.is_contiguous():
        return _fallback("rstd_finalize", f"partials of dtype {partials.dtype}", partials, dim, eps)
    return rms_final_reduce(partials, 1.0 / dim, eps)


@torch.library.register_kernel("coda::norm_swiglu", "cuda")
def _norm_swiglu(h, rstd, w13):
    why = _unsupported(h, w13)
    if why or w13.shape[0] % 16:
        return _fallback("norm_swiglu", why or f"hidden {w13.shape[0] // 2} (need % 8)", h, rstd, w13)
    m, f2 = h.shape[0], w13.shape[0]
    a = h.new_empty((m, f2))
    y = h.new_empty((m, f2 // 2))
    with _first_call("norm_swiglu", h, w13):
        _gemm(rstd_swiglu_preact_epi, h, w13.t(), None, {"D": a, "postact": y}, rstd=rstd.float())
    return y, a


@torch.library.register_kernel("coda::norm_rope", "cuda")
def _norm_rope(h, rstd, weight, freqs, seqlen, n_rope_heads, head_dim):
    why = _unsupported(h, weight)
    m, q = h.shape[0], weight.shape[0]
    rot = n_rope_heads * head_dim
    if why is None and (head_dim % 2 or m % seqlen or rot > q):
        why = f"head_dim {head_dim} / rows {m} vs seqlen {seqlen}"
    if why:
        return _fallback("norm_rope", why, h, rstd, weight, freqs, seqlen, n_rope_heads, head_dim)
    dev = h.device
    freq = _cached(
        ("freq", freqs.data_ptr(), freqs._version, rot, q, head_dim, dev),
        lambda: make_interleaved_inv_freq(freqs.double(), rot, q - rot, head_dim).float().to(dev),
    )
    pos = _cached(("pos", m, seqlen, dev), lambda: (torch.arange(m, device=dev) % seqlen).float())
    out = h.new_empty((m, q))
    with _first_call("norm_rope", h, weight):
        _gemm(rstd_rope_posfreq_epi, h, weight.t(), None, {"D": out}, pos=pos, freq=freq, rstd=rstd.float())
    return out


def _ce_grad_math(logits, lse, tgt_logit, targets, rstd):
    """da = r * (softmax - onehot) and zdz = sum logits * (softmax - onehot); zero on ignored rows."""
    lf = logits.float()
    valid = targets != IGNORE_INDEX
    p = torch.exp(lf - lse[:, None])
    zdz = torch.where(valid, (p * lf).sum(-1) - tgt_logit, 0.0)
    onehot = torch.arange(lf.shape[1], device=lf.device)[None, :] == targets[:, None]
    r = torch.where(valid, rstd, 0.0)
    da = ((p - onehot.float()) * r[:, None]).to(logits.dtype)
    return da, zdz


@torch.library.register_kernel("coda::lm_head_ce", "cuda")
def _lm_head_ce(h, rstd, x, gamma, weight, targets, chunk_rows, compute_grad):
    why = _unsupported(h, x, weight)
    if why:
        return _fallback("lm_head_ce", why, h, rstd, x, gamma, weight, targets, chunk_rows, compute_grad)
    m, d = h.shape
    vocab = weight.shape[0]
    loss = torch.zeros((), device=h.device, dtype=torch.float32)
    rstd = rstd.float()
    gamma32 = gamma.float()
    if compute_grad:
        dx = torch.empty_like(x)
        dgamma = torch.zeros(d, device=h.device, dtype=torch.float32)
        dw = torch.empty((vocab, d), device=h.device, dtype=torch.float32)
    logits_buf = h.new_empty((min(chunk_rows, m), vocab))
    grad_fn = _fused("ce_grad", _ce_grad_math)
    for i, start in enumerate(range(0, m, chunk_rows)):
        stop = min(start + chunk_rows, m)
        hc, r, t = h[start:stop], rstd[start:stop], targets[start:stop]
        logits = logits_buf[: stop - start]
        with _first_call("lm_head_ce", hc, weight):
            res = _gemm(rstd_lse_target_epi, hc, weight.t(), None, {"D": logits}, rstd=r, target=t)
        lse, tl = res["lse"], res["target_logit"]
        loss = loss + torch.where(t != IGNORE_INDEX, lse - tl, 0.0).sum()
        if not compute_grad:
            continue
        da, zdz = grad_fn(logits, lse, tl, t, r)
        corr = -(r * r / d) * zdz
        out = _gemm(rms_bwd_apply_last_epi, da, weight, None, {"D": dx[start:stop]}, y=x[start:stop], w=gamma32, corr=corr)
        dgamma += out["dw"]
        if i == 0:
            quack_gemm(da.t(), hc, out=dw, tuned=_TUNE)
        else:
            gemm_add_inplace(da.t(), hc, dw, tuned=_TUNE)
    if not compute_grad:
        return _ops._ce_outputs(loss, None, None, None, h, gamma, weight)
    return loss, dx, dgamma, dw.to(weight.dtype)


# --- FP8 forward programs ([coda] precision = "fp8") ------------------------------------------------


def _unsupported_fp8(*tensors: torch.Tensor, dtypes=(E4M3,)) -> str | None:
    for t in tensors:
        if not t.is_cuda:
            return f"a {t.device} tensor"
        if t.dtype not in dtypes:
            return f"dtype {t.dtype} (need {' or '.join(str(d) for d in dtypes)})"
        if t.dim() != 2 or not t.is_contiguous() or t.shape[-1] % 16 or t.shape[0] == 0:
            return f"shape {tuple(t.shape)} / stride {t.stride()} (need 2-D, contiguous, width % 16 == 0)"
    return None


def _scalar32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float32).reshape(1).contiguous()


@torch.library.register_kernel("coda::quantize_tensorwise", "cuda")
def _quantize_tensorwise(w):
    # amax reduction + saturated cast: two inductor kernels, once per weight and step
    return _fused("quantize_tensorwise", lambda t: quantize_tensorwise_torch(w=t))(w)


@torch.library.register_kernel("coda::fp8_layer_weights", "cuda")
def _fp8_layer_weights(w1, w3, wq, wk, wv, w13_t, wqkv_t):
    # every layer's weight pass in one compiled call: per weight, one amax reduction and one pass
    # that interleaves (W13) or concatenates (W_qkv) while it casts (and the transposed copies asked for)
    return _fused(f"fp8_layer_weights_{w13_t:d}{wqkv_t:d}", lambda *ws: fp8_layer_weights_torch(
        w1=ws[0], w3=ws[1], wq=ws[2], wk=ws[3], wv=ws[4], w13_t=w13_t, wqkv_t=wqkv_t,
    ))(list(w1), list(w3), list(wq), list(wk), list(wv))


@torch.library.register_kernel("coda::rms_partial_fp8", "cuda")
def _rms_partial_fp8(x, gamma, tile_n, inv_scale):
    # The embedding-norm prologue (no GEMM, once per step): one fused pass
    h, s, hq, amax = _fused(f"rms_partial_fp8_{tile_n}_{inv_scale is None}", lambda x_, g_, i_: rms_partial_fp8_torch(
        x=x_, gamma=g_, tile_n=tile_n, inv_scale=i_))(x, gamma, inv_scale)
    return h, s.sum(-1, keepdim=True), hq, amax


@torch.library.register_kernel("coda::residual_rms_fp8", "cuda")
def _residual_rms_fp8(y, weight, residual, gamma, tile_n, inv_scale):
    why = _unsupported(y, weight, residual)
    if why is None and residual.shape[1] % 16:
        why = f"width {residual.shape[1]} (e4m3 H needs % 16)"
    if why is None and inv_scale is None:
        # the calibration step (no amax history yet): a current-amax scale needs the whole of H
        # before its first element is quantized, so that one step runs the reference
        why = "a current-amax scale (the calibration step)"
    if why:
        return _fallback("residual_rms_fp8", why, y, weight, residual, gamma, tile_n, inv_scale)
    x = torch.empty_like(residual)
    h = torch.empty_like(residual)
    hq = torch.empty(residual.shape, device=residual.device, dtype=E4M3)
    with _first_call("residual_rms_fp8", y, weight):
        res = _gemm(
            rms_partial_fp8_epi, y, weight.t(), residual, {"D": h, "resid_out": x, "hq": hq},
            weight=gamma.float(), inv_scale=_scalar32(inv_scale),
        )
    return x, h, res["sqsum"].unsqueeze(1), hq, res["amax"].amax()


@torch.library.register_kernel("coda::norm_swiglu_fp8", "cuda")
def _norm_swiglu_fp8(hq, rstd, w13q, scale, out_dtype):
    why = _unsupported_fp8(hq, w13q)
    if why is None and (w13q.shape[0] % 32 or out_dtype not in _KERNEL_DTYPES):
        why = f"hidden {w13q.shape[0] // 2} / out dtype {out_dtype} (need % 16, bf16/fp16)"
    if why:
        return _fallback("norm_swiglu_fp8", why, hq, rstd, w13q, scale, out_dtype)
    m, f2 = hq.shape[0], w13q.shape[0]
    a = torch.empty((m, f2), device=hq.device, dtype=out_dtype)
    y = torch.empty((m, f2 // 2), device=hq.device, dtype=out_dtype)
    with _first_call("norm_swiglu_fp8", hq, w13q):
        _gemm(fp8_rstd_swiglu_preact_epi, hq, w13q.t(), None, {"D": a, "postact": y},
              rstd=rstd.float(), scale=_scalar32(scale))
    return y, a


@torch.library.register_kernel("coda::norm_rope_fp8", "cuda")
def _norm_rope_fp8(hq, rstd, weight_q, scale, freqs, seqlen, n_rope_heads, head_dim, out_dtype):
    why = _unsupported_fp8(hq, weight_q)
    m, q = hq.shape[0], weight_q.shape[0]
    rot = n_rope_heads * head_dim
    if why is None and (head_dim % 2 or m % seqlen or rot > q or out_dtype not in _KERNEL_DTYPES):
        why = f"head_dim {head_dim} / rows {m} vs seqlen {seqlen} / out dtype {out_dtype}"
    if why:
        return _fallback("norm_rope_fp8", why, hq, rstd, weight_q, scale, freqs, seqlen, n_rope_heads, head_dim, out_dtype)
    dev = hq.device
    freq = _cached(
        ("freq", freqs.data_ptr(), freqs._version, rot, q, head_dim, dev),
        lambda: make_interleaved_inv_freq(freqs.double(), rot, q - rot, head_dim).float().to(dev),
    )
    pos = _cached(("pos", m, seqlen, dev), lambda: (torch.arange(m, device=dev) % seqlen).float())
    out = torch.empty((m, q), device=dev, dtype=out_dtype)
    with _first_call("norm_rope_fp8", hq, weight_q):
        # the dequantization scale s_a * s_w rides the deferred-rstd column vector
        _gemm(rstd_rope_posfreq_epi, hq, weight_q.t(), None, {"D": out}, pos=pos, freq=freq,
              rstd=rstd.float() * scale.float())
    return out


# --- backward programs -----------------------------------------------------------------------------


def _rope_bwd_f32(dy, y, rstd, cos, sin, rot: int, head_dim: int):
    m = dy.shape[0]
    seqlen = cos.shape[0]
    dyf = dy.float()
    zdz = (y.float() * dyf).sum(-1)
    t = dyf[:, :rot].reshape(m // seqlen, seqlen, rot // head_dim, head_dim // 2, 2)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    x0, x1 = t[..., 0], t[..., 1]
    back = torch.stack([x0 * c + x1 * s, x1 * c - x0 * s], dim=-1).reshape(m, rot)
    return torch.cat([back, dyf[:, rot:]], dim=-1) * rstd[:, None], zdz


def _rope_bwd_math(dy, y, rstd, cos, sin, rot: int, head_dim: int):
    da, zdz = _rope_bwd_f32(dy, y, rstd, cos, sin, rot, head_dim)
    return da.to(dy.dtype), zdz


def _rope_bwd_fp8_math(dy, y, rstd, cos, sin, rot: int, head_dim: int):
    da, zdz = _rope_bwd_f32(dy, y, rstd, cos, sin, rot, head_dim)
    inv = inv_scale_from_amax(da.abs().amax(), E5M2_MAX)
    return da.to(dy.dtype), zdz, quantize_e5m2(da, inv), inv.reciprocal()


def _rope_bwd_pass(name, math, dy, y, rstd, freqs, seqlen, n_rope_heads, head_dim):
    """B1 (``math`` = _rope_bwd_math or _rope_bwd_fp8_math) as one inductor program."""
    why = _unsupported(dy, y)
    m = dy.shape[0]
    if why is None and (head_dim % 2 or m % seqlen):
        why = f"head_dim {head_dim} / rows {m} vs seqlen {seqlen}"
    if why:
        return _fallback(name, why, dy, y, rstd, freqs, seqlen, n_rope_heads, head_dim)
    cos, sin = _cached(  # (the shape too: a freed freqs' address can come back for another head_dim)
        ("cossin", freqs.data_ptr(), freqs._version, tuple(freqs.shape), seqlen, dy.device),
        lambda: rope_cos_sin(freqs, seqlen, torch.float32),
    )
    with _first_call(name, dy):
        return _fused(name, math)(dy, y, rstd.float(), cos, sin, n_rope_heads * head_dim, head_dim)


@torch.library.register_kernel("coda::rope_bwd", "cuda")
def _rope_bwd(dy, y, rstd, freqs, seqlen, n_rope_heads, head_dim):
    return _rope_bwd_pass("rope_bwd", _rope_bwd_math, dy, y, rstd, freqs, seqlen, n_rope_heads, head_dim)


@torch.library.register_kernel("coda::rope_bwd_fp8", "cuda")
def _rope_bwd_fp8(dy, y, rstd, freqs, seqlen, n_rope_heads, head_dim):
    # the amax reduction, then da in bf16 and e5m2 in one pointwise pass
    return _rope_bwd_pass("rope_bwd_fp8", _rope_bwd_fp8_math, dy, y, rstd, freqs, seqlen, n_rope_heads, head_dim)


@torch.library.register_kernel("coda::norm_residual_bwd_fp8", "cuda")
def _norm_residual_bwd_fp8(daq, weight_tq, scale, x, gamma, rstd, zdz, dresidual):
    why = _unsupported(*((x,) if dresidual is None else (x, dresidual)))
    why = why or _unsupported_fp8(daq, dtypes=(E4M3, E5M2)) or _unsupported_fp8(weight_tq)
    if why:
        return _fallback("norm_residual_bwd_fp8", why, daq, weight_tq, scale, x, gamma, rstd, zdz, dresidual)
    d = x.shape[1]
    r = rstd.float()
    corr = -(r * r / d) * zdz.float()
    sc = _scalar32(scale)
    w = gamma.float() * sc  # the accumulator's unit s_da * s_w rides the gamma row vector ...
    out = torch.empty_like(x)
    with _first_call("norm_residual_bwd_fp8", daq, weight_tq):
        if dresidual is None:
            res = _gemm(rms_bwd_apply_last_epi, daq, weight_tq.t(), None, {"D": out}, y=x, w=w, corr=corr)
        else:
            res = _gemm(rms_bwd_apply_epi, daq, weight_tq.t(), dresidual, {"D": out}, y=x, w=w, corr=corr)
    return out, res["dw"] * sc  # ... and multiplies the dgamma partials once, after the reduction


@torch.library.register_kernel("coda::norm_residual_bwd", "cuda")
def _norm_residual_bwd(da, weight, x, gamma, rstd, zdz, dresidual):
    ops_ = (da, weight, x) if dresidual is None else (da, weight, x, dresidual)
    why = _unsupported(*ops_)
    if why:
        return _fallback("norm_residual_bwd", why, da, weight, x, gamma, rstd, zdz, dresidual)
    d = x.shape[1]
    r = rstd.float()
    corr = -(r * r / d) * zdz.float()
    out = torch.empty_like(x)
    with _first_call("norm_residual_bwd", da, weight):
        if dresidual is None:
            res = _gemm(rms_bwd_apply_last_epi, da, weight, None, {"D": out}, y=x, w=gamma.float(), corr=corr)
        else:
            res = _gemm(rms_bwd_apply_epi, da, weight, dresidual, {"D": out}, y=x, w=gamma.float(), corr=corr)
    return out, res["dw"]


@torch.library.register_kernel("coda::swiglu_bwd", "cuda")
def _swiglu_bwd(dout, w_down, a, rstd):
    why = _unsupported(dout, w_down, a)
    if why:
        return _fallback("swiglu_bwd", why, dout, w_down, a, rstd)
    r = rstd.float()
    da = torch.empty_like(a)
    y = a.new_empty((a.shape[0], a.shape[1] // 2))
    with _first_call("swiglu_bwd", dout, w_down):
        res = _gemm(dswiglu_rstd_preact_mod, dout, w_down, a, {"D": da, "postact": y}, rstd=r)
    return da, y, res["dsum"] * r


@functools.cache
def _b3_fp8_config(device):
    if torch.cuda.get_device_capability(device)[0] != 9:
        return None  # quack's per-arch default
    return GemmConfig(tile_m=128, tile_n=128, pingpong=True, cluster_m=1, cluster_n=2,
                      is_dynamic_persistent=False, device_capacity=9)


@torch.library.register_kernel("coda::swiglu_bwd_fp8", "cuda")
def _swiglu_bwd_fp8(dout, w_down, a, rstd, inv_scale):
    why = _unsupported(dout, w_down, a)
    if why is None and inv_scale is None:
        why = "a current-amax scale (the calibration step)"  # needs all of da before its first e5m2
    if why:
        return _fallback("swiglu_bwd_fp8", why, dout, w_down, a, rstd, inv_scale)
    r = rstd.float()
    m, f2 = a.shape
    da = torch.empty_like(a)
    y = a.new_empty((m, f2 // 2))
    daq = torch.empty((m, f2 // 2), device=a.device, dtype=torch.float16)  # e5m2 pairs, see _e5m2x2_as_f16
    with _first_call("swiglu_bwd_fp8", dout, w_down):
        # a pinned config, not autotuned: one of the autotuner's candidates of this epilogue (two 16-bit
        # aux outputs in packed_cd mode), 256 x 160 cooperative with a 1 x 2 cluster, never finishes
        # (measured on the H200 and the H100). The pin is the fastest of the others on the H100
        # (benchmarks/results/probe_fp8_configs_*.json) and the bf16 B3's autotuned choice there.
        res = dswiglu_rstd_preact_fp8_epi(dout, w_down, a, out={"D": da, "postact": y, "daq": daq}, tuned=False,
                                          config=_b3_fp8_config(a.device), rstd=r, inv_scale=_scalar32(inv_scale))
    return da, y, res["dsum"] * r, daq.view(E5M2), res["amax"].amax()


@torch.library.register_kernel("coda::wgrad", "cuda")
def _wgrad(grad, inp, out_dtype):
    if grad.dtype not in _KERNEL_DTYPES or inp.dtype != grad.dtype:
        return _fallback("wgrad", f"dtype {grad.dtype}/{inp.dtype}", grad, inp, out_dtype)
    out = grad.t() @ inp
    return out if out.dtype == out_dtype else out.to(out_dtype)


def _wgrad_fp8_operands_t(grad, grad_amax, inp, inp_amax):
    gq, s_g, xq, s_x = wgrad_fp8_operands(grad, grad_amax, inp, inp_amax)
    return gq.t().contiguous(), s_g, xq.t().contiguous(), s_x


@torch.library.register_kernel("coda::wgrad_fp8", "cuda")
def _wgrad_fp8(grad, grad_amax, inp, inp_amax, out_dtype):
    why = _unsupported(grad, inp)
    if why is None and (grad.shape[0] != inp.shape[0] or grad.shape[0] % 16 or grad.shape[1] % 16 or inp.shape[1] % 16):
        why = f"shapes {tuple(grad.shape)} / {tuple(inp.shape)} (need equal rows, all % 16)"
    if why is None and out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        why = f"out dtype {out_dtype}"
    if why:
        return _fallback("wgrad_fp8", why, grad, grad_amax, inp, inp_amax, out_dtype)
    # SM90 fp8 MMAs read both operands K-major, and a weight gradient contracts over the tokens:
    # token-major e5m2 / e4m3 copies, one cast-and-transpose pass each (inductor), as torchao's recipe
    fn = _fused(f"wgrad_fp8_operands_{grad_amax is None:d}{inp_amax is None:d}", _wgrad_fp8_operands_t)
    with _first_call("wgrad_fp8", grad, inp):
        gt, s_g, xt, s_x = fn(grad, grad_amax, inp, inp_amax)
        return torch._scaled_mm(gt, xt.t(), scale_a=s_g, scale_b=s_x, out_dtype=out_dtype, use_fast_accum=False)


@torch.library.register_kernel("coda::dgrad", "cuda")
def _dgrad(grad, weight, out_dtype):
    if grad.dtype not in _KERNEL_DTYPES or weight.dtype != grad.dtype:
        return _fallback("dgrad", f"dtype {grad.dtype}/{weight.dtype}", grad, weight, out_dtype)
    out = grad @ weight
    return out if out.dtype == out_dtype else out.to(out_dtype)


# --- the backend's programs (keyword-only, like the torch reference) --------------------------------

for _name in _ops.OPS:
    globals()[f"{_name}_cute"] = _ops.program(_name)
del _name
