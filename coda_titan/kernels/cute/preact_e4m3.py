"""Epilogues of ``[coda] fp8_preact``: F2 saves the pre-activations a as e4m3 codes, B3 reads them.

The interleaved (gate, up) pair of a is one 16-bit word: gate in the low byte, up in the high, so the
(M, 2F) e4m3 tensor is an (M, F) 16-bit tensor, one word per GEMM column of B3's accumulator (whose
acc has one element per pair). The words travel as bfloat16: quack loads and stores 16-bit tiles
natively, a word's f32 is its bits shifted left by 16 (exact both ways), and a bf16 with an all-ones
exponent (Inf / NaN, which a conversion might canonicalize) would need an up code of 0x7F or 0xFF,
the e4m3 NaN, which a saturating cast never writes.

F2 (``fp8_rstd_swiglu_qa_epi``) quantizes the fp32 v (before any bf16 rounding) with the site's
delayed power-of-two scale and reduces amax |v| for its history; B3 (``dswiglu_rstd_preact_e5m2_t_*qa_epi``)
decodes each code exactly to f32 and multiplies by the dequantization (a power of two: exact), so it
computes on the very values the bf16 B3 computes on when handed the decoded a in bf16 (its GPU test).
"""

from __future__ import annotations

from cutlass import Float32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op
from quack.activation import swiglu
from quack.epilogue.frontend import gemm_epilogue
from quack.epilogue.math import pack, unpack
from quack.epilogue.ops import ColVecLoad, ColVecReduce, Scalar

from .epilogues import GatedNarrowStore, _amax, _dswiglu_e5m2, _raw
from .tstore import TransposedNarrowStore as _T


def _asm(asm: str, *args, loc=None, ip=None) -> Float32:
    return Float32(llvm.inline_asm(T.f32(), [Float32(a).ir_value(loc=loc, ip=ip) for a in args], asm,
                                   "=f" + ",f" * len(args), has_side_effects=False, is_align_stack=False,
                                   asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def e4m3x2_word(lo: Float32, hi: Float32, *, loc=None, ip=None) -> Float32:
    """sat(lo), sat(hi) as e4m3 (round to nearest even), packed lo | hi << 8 into a 16-bit word,
    returned as the f32 whose bits are that word << 16 (a bf16 output stores the word bit-exactly)."""
    return _asm("{.reg .b16 t;\n.reg .b32 w;\ncvt.rn.satfinite.e4m3x2.f32 t, $1, $2;\ncvt.u32.u16 w, t;\n"
                "shl.b32 $0, w, 16;}", hi, lo, loc=loc, ip=ip)


def _decode(half: str):
    @dsl_user_op
    def op(w: Float32, *, loc=None, ip=None) -> Float32:
        return _asm("{.reg .b16 lo, hi, l, h;\n.reg .b32 p;\nmov.b32 {lo, hi}, $1;\ncvt.rn.f16x2.e4m3x2 p, hi;\n"
                    f"mov.b32 {{l, h}}, p;\ncvt.f32.f16 $0, {half};}}", w, loc=loc, ip=ip)
    return op


# The exact f32 of the gate (low byte) and up (high byte) code of a word read through a bf16 view.
e4m3_lo, e4m3_hi = _decode("l"), _decode("h")


@gemm_epilogue(
    outputs=(GatedNarrowStore("postact", gated=True), "aq"),
    ops={"rstd": ColVecLoad("rstd"), "scale": Scalar("scale"), "inv_y": Scalar("inv_y"), "inv_a": Scalar("inv_a")},
    reduces={"amax": _amax(), "amax_a": _raw(ColVecReduce("amax_a", combine="max_abs"))},
    mode="acc_pair",
)
def fp8_rstd_swiglu_qa_epi(acc, rstd, scale, inv_y, inv_a):
    """``epilogues.fp8_rstd_swiglu_q_epi`` (e4m3 y and amax |y|) saving a as e4m3 pairs instead of bf16
    (no D): aq = sat(v inv_a) of the fp32 v, one 16-bit word a pair, and amax |v| (both lanes)."""
    v = acc * scale
    g, u = unpack(v)
    gs, us = unpack(v * rstd)
    y = swiglu(gs, us)
    return {"postact": y * inv_y, "aq": e4m3x2_word(g * inv_a, u * inv_a), "amax": pack(y, y), "amax_a": pack(g, u)}


def _dswiglu_e5m2_codes(c, rstd, dyk, a_scale):
    """``epilogues._dswiglu_e5m2`` (transposed) with the (gate, up) pair decoded from one e4m3 word of C."""
    return _dswiglu_e5m2(e4m3_lo(c) * a_scale, e4m3_hi(c) * a_scale, rstd, dyk, transposed=True)


def _b3_outs():
    return (_T("postact"), "daq", _T("dagt"), _T("daut"))


def _b3_reduces():
    return {"dsum": ColVecReduce("dsum"), "amax": _amax()}


@gemm_epilogue(
    outputs=_b3_outs(),
    ops={"rstd": ColVecLoad("rstd"), "scale": Scalar("scale"), "inv_scale": Scalar("inv_scale"),
         "a_scale": Scalar("a_scale")},
    reduces=_b3_reduces(),
)
def dswiglu_rstd_preact_e5m2_t_qa_epi(acc, c, rstd, scale, inv_scale, a_scale):
    """``epilogues.dswiglu_rstd_preact_e5m2_t_q_epi`` on a's e4m3 codes (C: their bf16 view; a = code * a_scale)."""
    return _dswiglu_e5m2_codes(c, rstd, acc * (rstd * (scale * inv_scale)), a_scale)


@gemm_epilogue(
    outputs=_b3_outs(),
    ops={"rstd": ColVecLoad("rstd"), "scale": Scalar("scale"), "inv_scale": Scalar("inv_scale"),
         "a_scale": Scalar("a_scale"), "inv_y": Scalar("inv_y")},
    reduces=_b3_reduces(),
)
def dswiglu_rstd_preact_e5m2_t_yq_qa_epi(acc, c, rstd, scale, inv_scale, a_scale, inv_y):
    """``dswiglu_rstd_preact_e5m2_t_qa_epi`` with y as e4m3 (sat(y * inv_y)), stored transposed."""
    out = _dswiglu_e5m2_codes(c, rstd, acc * (rstd * (scale * inv_scale)), a_scale)
    out["postact"] = out["postact"] * inv_y
    return out
