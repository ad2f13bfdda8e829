"""The epilogues of F4 without its gradient pass (``CODA_TITAN_CE_PASS=exp``; ``ce_exp`` has its row kernels,
``lm_head_ce._lm_head_ce_exp`` the program). Beside ``epilogues`` (whose sinks they share) in a module of this
package, which quack's compile workers import to re-mint them, the package's patches with it."""

from __future__ import annotations

from quack.epilogue.frontend import gemm_epilogue
from quack.epilogue.math import pexp
from quack.epilogue.ops import ColVecLoad, ColVecReduce, ColVecSelect, RowVecLoad, RowVecReduce

from .epilogues import _lse_partials, _raw, _target_idx


@gemm_epilogue(ops={"rstd": ColVecLoad("rstd"), "offset": ColVecLoad("offset")}, extra_ops=(_target_idx,),
               outs={"lse": _lse_partials(), "target_logit": ColVecSelect("target_logit", idx_op=_target_idx)},
               reduces={"el": _raw(ColVecReduce("el"))})
def rstd_exp_lse_target_epi(acc, rstd, offset):
    """F4 without its gradient pass (``CODA_TITAN_CE_PASS=exp``, ``ce_exp``): l = r * acc (fp32), D = exp(l - c)
    (c the row's offset, stored in bf16: the backward GEMMs' A as it is), the log-sum-exp partials and the
    target logit of l, and the per-N-tile partials of sum exp(l - c) l (unfolded, for zdz)."""
    v = acc * rstd
    e = pexp(v - offset)
    return {"D": e, "lse": v, "target_logit": v, "el": e * v}


@gemm_epilogue(ops={"w": RowVecLoad("w"), "corr": ColVecLoad("corr"), "s": ColVecLoad("s"), "kt": ColVecLoad("kt")},
               reduces={"dw": RowVecReduce("dw", scaled=True)})
def exp_norm_bwd_last_epi(acc, c, y, w, corr, s, kt):
    """The LM head's B2 on F4's stored E (``CODA_TITAN_CE_PASS=exp``): the gradient of the head's input is
    s (E @ W) + kt W[t], C the target rows of W (``ce_exp``: the target's term made exact), then the final
    norm's backward as ``norm_residual_bwd_last_epi``."""
    a = acc * s + c * kt
    return {"D": a * w + y * corr, "dw": (a, y)}
