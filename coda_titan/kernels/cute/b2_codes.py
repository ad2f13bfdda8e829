"""B2 writing the residual-stream gradient's e5m2 codes itself (``coda::norm_residual_bwd_fp8_codes``).

The fp8 B2's D (dX, the residual-stream gradient) is cast by its consumer to e5m2 at its current
power-of-two scale, row-major and token-major (``casts.quantize_grad_t``: one Triton pass that reads the bf16
D, 46 us a call at the 1B shapes, 32 calls a step). The scale needs amax |D|, which exists only once every
tile is stored, so the epilogue cannot know it. It guesses: ``inv_prov``, a provisional power-of-two inverse
scale (the caller's: the site's previous amax), and stores D's codes at it through two 8-bit outputs, a
row-major one and an M-major one (``tstore``), from each value as D stores it (rounded to bf16, times the
power of two, converted with saturation and nearest-even rounding: the pass's arithmetic). Then one launch of
``recast_e5m2_kernel`` derives D's current scale from the folded amax and, where it equals the guess, only
writes s = 1 / inv; where it does not (or the amax is NaN) it makes the codes again from D, as the pass would.
Either way the codes and s are the pass's, byte for byte (GPU test); the guess moves only time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from quack.epilogue.frontend import gemm_epilogue
from quack.epilogue.ops import ColVecLoad, RowVecLoad, RowVecReduce, Scalar

from .. import norm_residual_bwd as ref
from ..scaling import AMAX_EPS, E4M3, E5M2, E5M2_MAX
from . import stages
from ._dispatch import fallback, first_call, gemm, scalar32, unsupported, unsupported_fp8
from .epilogues import _amax, _bits_op
from .row_vectors import b2_vectors, fold_amax
from .transpose_8bit import pow2_inv_scale
from .tstore import TransposedNarrowStore

# an f32 rounded to bf16 (nearest even, as D's store) and back: the value D holds
_round_bf16 = _bits_op("{.reg .b16 h, z;\ncvt.rn.bf16.f32 h, $1;\nmov.b16 z, 0;\nmov.b32 $0, {z, h};}")


@gemm_epilogue(
    outputs=("dq", TransposedNarrowStore("dqt")),
    ops={"w": RowVecLoad("w"), "corr": ColVecLoad("corr"), "inv": Scalar("inv")},
    reduces={"dw": RowVecReduce("dw", scaled=True), "amax": _amax()},
)
def norm_residual_bwd_codes_epi(acc, c, y, w, corr, inv):
    """The fp8 B2's epilogue (``epilogues.norm_residual_bwd_amax_epi``) also storing D's e5m2 codes at the
    provisional inverse scale ``inv``, row-major (``dq``) and M-major (``dqt``)."""
    d = acc * w + c + y * corr
    q = _round_bf16(d) * inv
    return {"D": d, "dw": (acc, y), "amax": d, "dq": q, "dqt": q}


@triton.jit
def recast_e5m2_kernel(x_ptr, amax_ptr, prov_ptr, y_ptr, yt_ptr, s_ptr, M, K, FMAX: tl.constexpr, EPS: tl.constexpr,
                       NPROG: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """s = 1 / inv at D's current scale inv (``cast_e5m2_kernel``'s); where inv is not the provisional one,
    the codes again from D, row-major and token-major, tiles NPROG apart per program."""
    pid = tl.program_id(0)
    inv = pow2_inv_scale(tl.load(amax_ptr), FMAX, EPS)
    if pid == 0:
        tl.store(s_ptr, 1.0 / inv)
    if inv != tl.load(prov_ptr):  # (a NaN amax: never equal, so the codes are the pass's NaNs)
        nk = tl.cdiv(K, BK)
        for t in range(pid, tl.cdiv(M, BM) * nk, NPROG):
            rm = (t // nk) * BM + tl.arange(0, BM)
            rk = (t % nk) * BK + tl.arange(0, BK)
            mask = (rm[:, None] < M) & (rk[None, :] < K)
            tile = tl.load(x_ptr + rm[:, None].to(tl.int64) * K + rk[None, :], mask=mask, other=0.0).to(tl.float32)
            q = tl.clamp(tile * inv, -FMAX, FMAX, propagate_nan=tl.PropagateNan.ALL).to(
                tl.float8e5, fp_downcast_rounding="rtne")
            tl.store(y_ptr + rm[:, None].to(tl.int64) * K + rk[None, :], q, mask=mask)
            tl.store(yt_ptr + rk[:, None].to(tl.int64) * M + rm[None, :], tl.trans(q), mask=tl.trans(mask))


RECAST_PROGRAMS = 1024  # (a hit: one wave that only compares; a miss: 8 of the 8,192 64 x 64 tiles a program at 1B)
RECAST_BLOCK = 64


def recast(d: torch.Tensor, amax: torch.Tensor, inv_prov: torch.Tensor, dq: torch.Tensor,
           dq_t: torch.Tensor) -> torch.Tensor:
    """s (fp32, 0-dim) of D's current scale; ``dq`` / ``dq_t`` made again from D where ``inv_prov`` was not it."""
    m, k = d.shape
    s = torch.empty((), device=d.device, dtype=torch.float32)
    recast_e5m2_kernel[(RECAST_PROGRAMS,)](d, amax, inv_prov, dq, dq_t, s, m, k, FMAX=E5M2_MAX, EPS=AMAX_EPS,
                                           NPROG=RECAST_PROGRAMS, BM=RECAST_BLOCK, BK=RECAST_BLOCK, num_warps=4)
    return s


def _unsupported(daq, weight_tq, x, dresidual, inv_prov) -> str | None:
    why = unsupported(*((x,) if dresidual is None else (x, dresidual)))
    why = why or unsupported_fp8(daq, dtypes=(E4M3, E5M2)) or unsupported_fp8(weight_tq)
    if why is None and (dresidual is None or x.dtype != torch.bfloat16 or x.shape[0] % 16):
        why = "no residual gradient, or D not bf16 with rows % 16 (the codes' transposed store)"
    if why is None and (inv_prov.numel() != 1 or not inv_prov.is_cuda):
        why = "a provisional scale that is not one CUDA element"
    return why


@torch.library.register_kernel("coda::norm_residual_bwd_fp8_codes", "cuda")
def _norm_residual_bwd_fp8_codes(daq, weight_tq, scale, x, gamma, rstd, zdz, dresidual, inv_prov):
    why = _unsupported(daq, weight_tq, x, dresidual, inv_prov)
    if why:
        return fallback(ref.norm_residual_bwd_fp8_codes_op, why, daq, weight_tq, scale, x, gamma, rstd, zdz, dresidual,
                        inv_prov)
    sc, inv = scalar32(scale), scalar32(inv_prov)
    corr, w = b2_vectors(rstd, zdz, gamma, x.shape[1], sc)
    m, d = x.shape
    out = torch.empty_like(x)
    dq = torch.empty((m, d), device=x.device, dtype=E5M2)
    dq_t = torch.empty((d, m), device=x.device, dtype=E5M2)
    with first_call("norm_residual_bwd_fp8_codes", daq, weight_tq), stages.capped(stages.requested_base()):
        res = gemm(norm_residual_bwd_codes_epi, daq, weight_tq.t(), dresidual, {"D": out, "dq": dq, "dqt": dq_t.t()},
                   y=x, w=w, corr=corr, inv=inv)
    amax = fold_amax(res["amax"], out.dtype)  # (amax |D| as stored, the reference's)
    return out, res["dw"] * sc, amax, dq, dq_t, recast(out, amax, inv, dq, dq_t)
