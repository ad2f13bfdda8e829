"""Our own ``@gemm_epilogue`` functions (quack's frontend); quack's library supplies the others.

Each is a small function of the accumulator ``acc`` (and the tile ``c`` where there is one); the
frontend turns it into a fused SM90 GEMM epilogue. The program files in this package call them.
"""

from __future__ import annotations

import cutlass.cute as cute
import cutlass.utils
from cutlass import Float32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op
from quack.activation import dswiglu, swiglu
from quack.epilogue.frontend import gemm_epilogue
from quack.epilogue.math import pack, unpack
from quack.epilogue.ops import (ColVecLoad, ColVecReduce, ColVecSelect, OnlineLSEReduce, RowVecLoad, RowVecReduce, Scalar,
                                TileStore, setup_epi_tensor)

from .tstore import TransposedNarrowStore as _T  # M-major 8-bit outputs through stmatrix.trans


_target_idx = ColVecLoad("target")


def _raw(reduce):
    """``reduce`` with its per-tile partials returned unfolded (quack's ``host_finalize`` off, as its own
    ``gemm_rms`` leaves its sum-of-squares partials raw): the caller folds them in one launch of its own
    (``row_vectors``) with what it does to the result, where quack's fold and then the caller's arithmetic
    were two or three launches (about 6 us and a launch gap each)."""
    reduce.host_finalize = None
    return reduce


def _amax():
    """A per-row amax |x| sink, unfolded: every caller folds the (M, n_tiles) partials whole
    (``row_vectors.fold_amax``). Max is exact in any order: the same value."""
    return _raw(ColVecReduce("amax", combine="max_abs"))


def _lse_partials():
    """quack's online log-sum-exp sink, unfolded: F4's gradient pass folds each row's (M, n_tiles) partials
    in the same program that reads the row (``ce_grad_pass``), where ``torch.logsumexp`` over them was nine
    aten kernels a chunk; the loss-only path folds them as quack would."""
    return _raw(OnlineLSEReduce("lse"))


def _bits_op(asm: str):
    """A one-f32-in, one-f32-out inline PTX op for the epilogue functions."""
    @dsl_user_op
    def op(w: Float32, *, loc=None, ip=None) -> Float32:
        return Float32(llvm.inline_asm(T.f32(), [Float32(w).ir_value(loc=loc, ip=ip)], asm, "=f,f",
                                       has_side_effects=False, is_align_stack=False,
                                       asm_dialect=llvm.AsmDialect.AD_ATT))
    return op


# An f32 rounded to nearest even in bf16 / f16, returned as its exact f32: the value a 16-bit D stores.
_round_bf16 = _bits_op("{.reg .b32 t;\ncvt.rn.bf16x2.f32 t, $1, $1;\nand.b32 $0, t, 0xFFFF0000;}")
_round_f16 = _bits_op("{.reg .b16 t;\ncvt.rn.f16.f32 t, $1;\ncvt.f32.f16 $0, t;}")


def _f4_sinks(target_idx) -> dict:
    """F4's epilogue operands and sinks: the row's rstd, its log-sum-exp partials, its target logit."""
    return dict(ops={"rstd": ColVecLoad("rstd")}, extra_ops=(target_idx,),
                outs={"lse": _lse_partials(), "target_logit": ColVecSelect("target_logit", idx_op=target_idx)})


@gemm_epilogue(**_f4_sinks(_target_idx))
def rstd_lse_target_epi(acc, rstd):
    """F4's epilogue, bf16 logits: logits = r * acc (deferred final-norm rstd) rounded to bf16, written as D; each
    row's log-sum-exp over each N tile (``_lse_partials``) and its target logit (rows whose target is -100 are
    left untouched) taken from those rounded values, so that the gradient pass's softmax of the stored logits
    sums to one (the reference's ``stored_logits``)."""
    v = _round_bf16(acc * rstd)
    return {"D": v, "lse": v, "target_logit": v}


@gemm_epilogue(**_f4_sinks(ColVecLoad("target")))
def rstd_lse_target_f16_epi(acc, rstd):
    """``rstd_lse_target_epi`` for float16 logits."""
    v = _round_f16(acc * rstd)
    return {"D": v, "lse": v, "target_logit": v}


@gemm_epilogue(**_f4_sinks(ColVecLoad("target")))
def rstd_lse_target_unrounded_epi(acc, rstd):
    """F4's epilogue before c6d0abd, the probes' other arm (``CODA_TITAN_F4_LSE=unrounded``): log-sum-exp and
    target logit of the unrounded r * acc, D rounded by its store."""
    v = acc * rstd
    return {"D": v, "lse": v, "target_logit": v}


@gemm_epilogue(ops={"w": RowVecLoad("w"), "corr": ColVecLoad("corr")}, reduces={"dw": RowVecReduce("dw", scaled=True)})
def norm_residual_bwd_epi(acc, c, y, w, corr):
    """B2's epilogue (the math of quack's ``rms_bwd_apply_epi``): D = acc * gamma + dres + X * corr and
    the dgamma partials, defined here so that a kernel of it can carry ``stages.ATTR``: quack's compile
    workers re-mint it by importing this module, which installs the patch."""
    return {"D": acc * w + c + y * corr, "dw": (acc, y)}


@gemm_epilogue(ops={"w": RowVecLoad("w"), "corr": ColVecLoad("corr")}, reduces={"dw": RowVecReduce("dw", scaled=True)})
def norm_residual_bwd_last_epi(acc, y, w, corr):
    """``norm_residual_bwd_epi`` without the residual gradient C (quack's ``rms_bwd_apply_last_epi``)."""
    return {"D": acc * w + y * corr, "dw": (acc, y)}


@gemm_epilogue(ops={"w": RowVecLoad("w"), "corr": ColVecLoad("corr")},
               reduces={"dw": RowVecReduce("dw", scaled=True), "amax": _amax()})
def norm_residual_bwd_amax_epi(acc, c, y, w, corr):
    """``norm_residual_bwd_epi`` also reducing amax |D| (the fp8 B2: the layer below casts D to e5m2 at that
    amax). A NaN in D does not reach it (max.abs), where the reference's amax would be NaN."""
    d = acc * w + c + y * corr
    return {"D": d, "dw": (acc, y), "amax": d}


@gemm_epilogue(ops={"w": RowVecLoad("w"), "corr": ColVecLoad("corr")},
               reduces={"dw": RowVecReduce("dw", scaled=True), "amax": _amax()})
def norm_residual_bwd_last_amax_epi(acc, y, w, corr):
    """``norm_residual_bwd_last_epi`` also reducing amax |D|."""
    d = acc * w + y * corr
    return {"D": d, "dw": (acc, y), "amax": d}


@gemm_epilogue(outputs=("postact",), ops={"rstd": ColVecLoad("rstd")}, reduces={"dsum": ColVecReduce("dsum")},
               mode="packed_cd_b16x2")
def dswiglu_rstd_preact_epi(acc, c, rstd):
    """B3's bf16 epilogue (the math of quack's ``dswiglu_rstd_preact_mod``): c = the saved (gate, up)
    pre-activation pairs, D = their gradients r * (dg_s, du_s), postact = y recomputed, dsum = the rstd
    gradient's partials; here, as B2's, so that a kernel of it can carry ``stages.ATTR``."""
    g, u = unpack(c)
    dgs, dus, s = dswiglu(g * rstd, u * rstd, acc)
    return {"D": pack(dgs * rstd, dus * rstd), "postact": s, "dsum": dgs * g + dus * u}


@gemm_epilogue(
    outputs=("resid_out", "hq"),
    ops={"weight": RowVecLoad("weight"), "inv_scale": Scalar("inv_scale")},
    reduces={"sqsum": ColVecReduce("sqsum", scaled=True), "amax": _amax()},
)
def rms_partial_fp8_epi(acc, c, weight, inv_scale):
    """F1's epilogue for precision = "fp8": X = acc + residual (resid_out), H = X * gamma (D, bf16),
    per-tile sum X^2, and the next consumer's e4m3 operand hq = sat(H * inv_scale) (the f32 -> e4m3
    store converts with cvt.rn.satfinite), with the per-row amax |H| for the scale history."""
    x = acc + c
    h = x * weight
    return {"D": h, "resid_out": x, "sqsum": (x, x), "hq": h * inv_scale, "amax": h}


@gemm_epilogue(
    outputs=("resid_out",),
    ops={"weight": RowVecLoad("weight"), "scale": Scalar("scale")},
    reduces={"sqsum": ColVecReduce("sqsum", scaled=True)},
)
def rms_partial_scaled_epi(acc, c, weight, scale):
    """F1's epilogue on e4m3 operands: X = scale * acc + residual (resid_out), H = X * gamma (D),
    per-tile sum X^2; scale = s_y * s_w dequantizes the fp8 product."""
    x = acc * scale + c
    return {"D": x * weight, "resid_out": x, "sqsum": (x, x)}


@gemm_epilogue(
    outputs=("resid_out", "hq"),
    ops={"weight": RowVecLoad("weight"), "scale": Scalar("scale"), "inv_scale": Scalar("inv_scale")},
    reduces={"sqsum": ColVecReduce("sqsum", scaled=True), "amax": _amax()},
)
def rms_partial_scaled_fp8_epi(acc, c, weight, scale, inv_scale):
    """``rms_partial_scaled_epi`` that also writes the next consumer's e4m3 Hq = sat(H * inv) and the
    per-row amax |H| (as ``rms_partial_fp8_epi``)."""
    x = acc * scale + c
    h = x * weight
    return {"D": h, "resid_out": x, "sqsum": (x, x), "hq": h * inv_scale, "amax": h}


@gemm_epilogue(
    outputs=("hq", _T("hqt")),
    ops={"weight": RowVecLoad("weight"), "scale": Scalar("scale"), "inv_scale": Scalar("inv_scale")},
    reduces={"sqsum": ColVecReduce("sqsum", scaled=True), "amax": _amax()},
)
def rms_partial_scaled_fp8_t_epi(acc, c, weight, scale, inv_scale):
    """``rms_partial_scaled_fp8_epi`` storing the same e4m3 values also through an M-major 8-bit output
    ``hqt`` (Hq^T, as B3's da^T: ``residual_rms_q_fp8_t``), and not the bf16 H: D is X."""
    x = acc * scale + c
    h = x * weight
    return {"D": x, "sqsum": (x, x), "hq": h * inv_scale, "hqt": h * inv_scale, "amax": h}


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


class GatedNarrowStore(TileStore):
    """quack's gated (paired-column, half of GEMM-N) ``TileStore``, letting an 8-bit output through on
    SM90. quack 0.6.5 refuses it there in ``to_params`` alone: the store converts with the narrow
    register permute and the universal copy atom quack already has for that case (docs/fp8.md, "The
    8-bit paired-column (gated) store on SM90"; verified by ``scripts/probes/fp8_gated_store.py``)."""

    def to_params(self, gemm, args):
        tensor = getattr(args, self.name)
        if not (self.gated and gemm.arch == 90 and tensor.element_type.width == 8):
            return super().to_params(gemm, args)
        layout = cutlass.utils.LayoutEnum.from_tensor(tensor)
        assert gemm.d_layout is None or gemm.d_layout.is_n_major_c()
        assert layout.is_n_major_c()
        assert gemm.cta_tile_shape_mnk[1] % 32 == 0, "gated epilogue on SM90 requires tile_N divisible by 32"
        setattr(gemm, self._layout_gemm_attr(), layout)
        setattr(gemm, self._dtype_gemm_attr(), tensor.element_type)
        epi_tile = self.epi_tile_fn(gemm, gemm.epi_tile) if self.epi_tile_fn else None
        tma_atom, tma_tensor, smem_layout, epi_tile_out = setup_epi_tensor(gemm, tensor, epi_tile=epi_tile)
        return {
            self._tma_atom_key(): tma_atom,
            self.name: tma_tensor,
            self._smem_layout_key(): smem_layout,
            self._epi_tile_key(): epi_tile_out,
            self._dtype_field(): tensor.element_type,
        }


@gemm_epilogue(
    outputs=(GatedNarrowStore("postact", gated=True),),
    ops={"rstd": ColVecLoad("rstd"), "scale": Scalar("scale"), "inv_y": Scalar("inv_y")},
    reduces={"amax": _amax()},
    mode="acc_pair",
)
def fp8_rstd_swiglu_q_epi(acc, rstd, scale, inv_y):
    """``fp8_rstd_swiglu_preact_epi`` writing y as e4m3 for the down-projection: postact = sat(y *
    inv_y) from the fp32 y (the f32 -> e4m3 store converts with saturation), and each row's amax |y|
    (a sink in acc_pair mode takes one value per lane of the pair: y goes in twice)."""
    v = acc * scale
    g, u = unpack(v)
    gs, us = unpack(v * rstd)
    y = swiglu(gs, us)
    return {"D": pack(g, u), "postact": y * inv_y, "amax": pack(y, y)}


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


def _dswiglu_e5m2(g, u, rstd, dyk, transposed=False, da_scale=None):
    """B3's epilogue outputs from the (gate, up) pre-activation pair (quack's ``dgated_rstd_preact_mod("swiglu")``)
    with da as e5m2, from ``dyk`` = dy r inv_scale: dswiglu's gradients are linear in dy, so they come out
    as da's e5m2 values da inv_scale = (dg_s, du_s) r inv_scale directly, four multiplies an element fewer
    than scaling them after. daq = sat(of those) for the pair, packed into the 16-bit ``daq`` buffer in da's
    interleaved order; dsum (the rstd gradient's per-row partials) and the per-row amax are in the same
    units, r inv_scale times the unscaled ones: the caller divides zdz = r sum(dg_s g + du_s u) and amax |da|
    by inv_scale (``_b3_outputs``). ``da_scale`` (1 / inv_scale) adds da itself as D."""
    dgq, duq, s = dswiglu(g * rstd, u * rstd, dyk)
    out = {
        "postact": s,
        "dsum": dgq * g + duq * u,
        "daq": _e5m2x2_as_f16(dgq, duq),
        "amax": cute.arch.fmax(dgq, duq, abs=True),
    }
    if transposed:  # the same scaled values, stored by 8-bit outputs of their own (``dagt``, ``daut``)
        out["dagt"], out["daut"] = dgq, duq
    if da_scale is not None:
        out["D"] = pack(dgq * da_scale, duq * da_scale)
    return out


# The two bf16 halves of a 32-bit word, each as its exact f32 (its bits in the high half): the low
# half is the even column of a bf16 pair read through a float32 view (W13's gate), the high the odd (up).
_bf16_lo = _bits_op("shl.b32 $0, $1, 16;")
_bf16_hi = _bits_op("and.b32 $0, $1, 0xFFFF0000;")


@gemm_epilogue(
    outputs=("postact", "daq"),
    ops={"rstd": ColVecLoad("rstd"), "inv_scale": Scalar("inv_scale"), "da_scale": Scalar("da_scale")},
    reduces={"dsum": ColVecReduce("dsum"), "amax": _amax()},
    mode="packed_cd_b16x2",
)
def dswiglu_rstd_preact_fp8_epi(acc, c, rstd, inv_scale, da_scale):
    """B3's epilogue (bf16 GEMM) that also writes da as e5m2 for B2's fp8 dgrad (``_dswiglu_e5m2``);
    da_scale = 1 / inv_scale."""
    return _dswiglu_e5m2(*unpack(c), rstd, acc * (rstd * inv_scale), da_scale=da_scale)


@gemm_epilogue(
    outputs=("postact", "daq"),
    ops={"rstd": ColVecLoad("rstd"), "scale": Scalar("scale"), "inv_scale": Scalar("inv_scale"),
         "da_scale": Scalar("da_scale")},
    reduces={"dsum": ColVecReduce("dsum"), "amax": _amax()},
    mode="packed_cd_b16x2",
)
def dswiglu_rstd_preact_q_fp8_epi(acc, c, rstd, scale, inv_scale, da_scale):
    """The same after an fp8 GEMM (``fp8_down_dgrad``): dy = scale * acc, with scale = s_D * s_W2 the
    dequantization of the e5m2 D and the e4m3 W2 (folded into dyk's per-row factor)."""
    return _dswiglu_e5m2(*unpack(c), rstd, acc * (rstd * (scale * inv_scale)), da_scale=da_scale)


def _dswiglu_e5m2_words(c, rstd, dyk, transposed=False):
    """``_dswiglu_e5m2`` with the (gate, up) pair as one 32-bit word of C (a's float32 view), no D."""
    return _dswiglu_e5m2(_bf16_lo(c), _bf16_hi(c), rstd, dyk, transposed)


@gemm_epilogue(
    outputs=("postact", "daq"),
    ops={"rstd": ColVecLoad("rstd"), "inv_scale": Scalar("inv_scale")},
    reduces={"dsum": ColVecReduce("dsum"), "amax": _amax()},
)
def dswiglu_rstd_preact_e5m2_epi(acc, c, rstd, inv_scale):
    """``dswiglu_rstd_preact_fp8_epi`` without the bf16 da (``swiglu_bwd_e5m2``): one accumulator
    element per (gate, up) pair, whose pre-activations come as one 32-bit word of C (a's float32
    view), and no D (the call passes ``store_d=False``)."""
    return _dswiglu_e5m2_words(c, rstd, acc * (rstd * inv_scale))


@gemm_epilogue(
    outputs=("postact", "daq"),
    ops={"rstd": ColVecLoad("rstd"), "inv_scale": Scalar("inv_scale"), "inv_y": Scalar("inv_y")},
    reduces={"dsum": ColVecReduce("dsum"), "amax": _amax()},
)
def dswiglu_rstd_preact_e5m2_yq_epi(acc, c, rstd, inv_scale, inv_y):
    """``dswiglu_rstd_preact_e5m2_epi`` storing y as e4m3 (``fp8_down_wgrad``): postact = sat(y * inv_y)
    from the fp32 y (an 8-bit output buffer; the f32 -> e4m3 store converts with saturation)."""
    out = _dswiglu_e5m2_words(c, rstd, acc * (rstd * inv_scale))
    out["postact"] = out["postact"] * inv_y
    return out


@gemm_epilogue(
    outputs=(_T("postact"), "daq", _T("dagt"), _T("daut")),
    ops={"rstd": ColVecLoad("rstd"), "inv_scale": Scalar("inv_scale")},
    reduces={"dsum": ColVecReduce("dsum"), "amax": _amax()},
)
def dswiglu_rstd_preact_e5m2_t_epi(acc, c, rstd, inv_scale):
    """``dswiglu_rstd_preact_e5m2_epi`` also storing the gate and up halves of da as e5m2 through two
    M-major (transposed) 8-bit outputs ``dagt`` / ``daut`` (``swiglu_bwd_e5m2_t``): ``tstore``'s
    ``stmatrix.trans`` register-to-shared copy and a TMA store of the transposed tile."""
    return _dswiglu_e5m2_words(c, rstd, acc * (rstd * inv_scale), transposed=True)


@gemm_epilogue(
    outputs=(_T("postact"), "daq", _T("dagt"), _T("daut")),
    ops={"rstd": ColVecLoad("rstd"), "inv_scale": Scalar("inv_scale"), "inv_y": Scalar("inv_y")},
    reduces={"dsum": ColVecReduce("dsum"), "amax": _amax()},
)
def dswiglu_rstd_preact_e5m2_t_yq_epi(acc, c, rstd, inv_scale, inv_y):
    """``dswiglu_rstd_preact_e5m2_t_epi`` with y as e4m3 (sat(y * inv_y)); the call gives ``postact`` an
    M-major buffer, so y is stored transposed as well."""
    out = _dswiglu_e5m2_words(c, rstd, acc * (rstd * inv_scale), transposed=True)
    out["postact"] = out["postact"] * inv_y
    return out


@gemm_epilogue(
    outputs=(_T("postact"), "daq", _T("dagt"), _T("daut")),
    ops={"rstd": ColVecLoad("rstd"), "scale": Scalar("scale"), "inv_scale": Scalar("inv_scale")},
    reduces={"dsum": ColVecReduce("dsum"), "amax": _amax()},
)
def dswiglu_rstd_preact_e5m2_t_q_epi(acc, c, rstd, scale, inv_scale):
    """``dswiglu_rstd_preact_e5m2_t_epi`` after an fp8 GEMM (``swiglu_bwd_e5m2_t_q``): dy = scale * acc,
    scale = s_D * s_W2, as ``dswiglu_rstd_preact_q_fp8_epi``."""
    return _dswiglu_e5m2_words(c, rstd, acc * (rstd * (scale * inv_scale)), transposed=True)


@gemm_epilogue(
    outputs=(_T("postact"), "daq", _T("dagt"), _T("daut")),
    ops={"rstd": ColVecLoad("rstd"), "scale": Scalar("scale"), "inv_scale": Scalar("inv_scale"),
         "inv_y": Scalar("inv_y")},
    reduces={"dsum": ColVecReduce("dsum"), "amax": _amax()},
)
def dswiglu_rstd_preact_e5m2_t_yq_q_epi(acc, c, rstd, scale, inv_scale, inv_y):
    """``dswiglu_rstd_preact_e5m2_t_yq_epi`` after an fp8 GEMM (dy = scale * acc)."""
    out = _dswiglu_e5m2_words(c, rstd, acc * (rstd * (scale * inv_scale)), transposed=True)
    out["postact"] = out["postact"] * inv_y
    return out
