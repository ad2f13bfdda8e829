"""F2 norm_swiglu / B3 swiglu_bwd: GEMM + deferred rstd + SwiGLU, and its backward with the
down-projection GEMM.

Layout: the gate and up projections are one (2F, d) weight W13 with rows *interleaved*
(``interleave_rows(w1, w3)``: gate row j at 2j, up row j at 2j + 1), so each gate column sits next
to its up column in the GEMM output tile and the epilogue can pair them (given w1 and w3 apart, the
kernel's load interleaves [w1; w3]). H = X * gamma comes from the producer epilogue; r is the deferred rstd.

Forward (F2):
    a = H @ W13^T                         (M, 2F) *unscaled* pre-activations, saved for the backward
    z = r * a;  y = silu(z_gate) * z_up   (M, F)

Backward (B3), given D = dL/dX_out of the down-projection X_out = X + y @ W_down^T:
    dy      = D @ W_down                                  (the GEMM of B3)
    dz_up   = dy * silu(z_gate)
    dz_gate = dy * z_up * s * (1 + z_gate * (1 - s)),  s = sigmoid(z_gate)
    da      = r * dz                       gradient of the unscaled a: the deferred rstd is folded here, so
                                           both GEMMs that consume it (dgrad with W13, dW13 = da^T @ H) are plain
    zdz     = sum_n z_n dz_n               per row, for the norm backward B2
    y       = silu(z_gate) * z_up          recomputed, for dW_down = D^T @ y
Saved: a and r (y is cheaper to recompute than to keep).

FP8 (precision = "fp8"):
    norm_swiglu_fp8  acc = Hq @ W13q^T on e4m3 operands; v = (s_a * s_w) * acc is the true-scale
                     pre-activation, saved as a; y = SwiGLU(r * v)
    norm_swiglu_q_fp8  ``norm_swiglu_fp8`` that writes y as e4m3 for the down-projection's fp8 GEMM (``fp8_down_proj``):
                     yq = sat(y * inv_y) from the fp32 y with the site's delayed scale, and amax |y| (fp32 y)
                     for the site's history; no bf16 y is written
    swiglu_bwd_fp8   B3 (bf16 GEMM) whose epilogue also writes da as e5m2, daq = sat(da * inv) from the fp32
                     da, in da's interleaved column order, and reports amax |da|. The scale is delayed (a tile
                     is stored before the amax of the whole da exists): the gradient site's amax history;
                     ``inv_scale=None`` (calibration) uses the current amax.
    swiglu_bwd_e5m2  ``swiglu_bwd_fp8`` without the bf16 da: when both of da's consumers read the e5m2 copy
                     (B2's fp8 dgrad and dW13 by ``gemm.wgrad_fp8_e5m2``), nothing reads da itself, and not
                     writing it saves a 2-byte store per element of (M, 2F); with ``inv_y`` its y is e4m3
                     too, for dW2 on fp8 (``gemm.wgrad_fp8_e4m3``)
    swiglu_bwd_e5m2_t ``swiglu_bwd_e5m2`` also writing the e5m2 da transposed, daq_t (2F, M) = [gate columns; up
                     columns]^T: dW13's fp8 operand as cuBLAS reads it, so dW13 = daq_t @ H is [dW1; dW3] with
                     no copy pass; with ``inv_y`` its e4m3 y comes transposed too, (F, M), dW2's input as is
    swiglu_bwd_q_fp8 ``swiglu_bwd_fp8`` with its GEMM on fp8 too (``fp8_down_dgrad``): dy = scale *
                     (Dq @ W_down,q), Dq the e5m2 D (current power-of-two scale, ``casts.quantize_grad``)
                     and W_down,q^T the layer's e4m3 W2 transposed (the weight pass), scale = s_D s_W2.
    swiglu_bwd_e5m2_t_q ``swiglu_bwd_e5m2_t`` on that fp8 GEMM (``fp8_down_dgrad`` with the e5m2-only B3)
    norm_swiglu_qa_fp8 ``norm_swiglu_q_fp8`` saving a as e4m3 codes (``fp8_preact``): aq = sat(v inv_a) from the
                     compute-dtype v with the site's delayed power-of-two scale, and amax |v|
    swiglu_bwd_e5m2_t_qa ``swiglu_bwd_e5m2_t_q`` on those codes: a = aq * a_scale (exact: a power of two), then
                     the same outputs (y in ``out_dtype`` without ``inv_y``)
"""

from __future__ import annotations

from typing import Optional

import torch

from ._common import acc_dtype, by_row_blocks, check_2d, interleave_rows, mm, program_op
from .scaling import E4M3, E5M2, compute_dtype, fp8_mm, quantize_e4m3, quantize_e5m2_site_rows


def _swiglu(z: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(z[:, 0::2]) * z[:, 1::2]


def norm_swiglu(*, h: torch.Tensor, rstd: torch.Tensor, w13: torch.Tensor,
                w3: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, a): y (M, F) and the unscaled interleaved pre-activations a (M, 2F), both in h's dtype; with ``w3``,
    ``w13`` is w1 and W13 = interleave_rows(w1, w3) ([coda] stacked_weights)."""
    w13 = w13 if w3 is None else interleave_rows(w13, w3)
    check_2d("h", h, w13.shape[1])
    acc = mm(h, w13.t())
    y = _swiglu(acc * rstd.to(acc.dtype)[:, None])
    return y.to(h.dtype), acc.to(h.dtype)


def norm_swiglu_fp8(
    *, hq: torch.Tensor, rstd: torch.Tensor, w13q: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, a) as ``norm_swiglu``, from e4m3 Hq and W13q; ``scale`` = s_a * s_w (0-dim)."""
    check_2d("hq", hq, w13q.shape[1])
    ct = compute_dtype(out_dtype)
    v = fp8_mm(hq, w13q, ct) * scale.to(ct)
    y = _swiglu(v * rstd.to(ct)[:, None])
    return y.to(out_dtype), v.to(out_dtype)


def norm_swiglu_q_fp8(
    *, hq: torch.Tensor, rstd: torch.Tensor, w13q: torch.Tensor, scale: torch.Tensor, inv_y: torch.Tensor,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(yq, a, amax |y|): ``norm_swiglu_fp8``'s y quantized to e4m3 with ``inv_y`` from its compute
    dtype (never rounded to ``out_dtype`` first), a in ``out_dtype``, and the amax of that y."""
    check_2d("hq", hq, w13q.shape[1])
    ct = compute_dtype(out_dtype)
    v = fp8_mm(hq, w13q, ct) * scale.to(ct)
    y = _swiglu(v * rstd.to(ct)[:, None])
    return quantize_e4m3(y, inv_y), v.to(out_dtype), y.abs().amax()


def swiglu_bwd_acc(
    *, dout: torch.Tensor, w_down: torch.Tensor, a: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``swiglu_bwd``'s (da, y, zdz) in the accumulation dtype, before its outputs are cast (the fp8
    B3 quantizes da from these values)."""
    check_2d("dout", dout, w_down.shape[0])
    check_2d("a", a, 2 * w_down.shape[1])
    return _dswiglu(mm(dout, w_down), a, rstd)


def _dswiglu(dy: torch.Tensor, a: torch.Tensor, rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """B3's epilogue on dy (M, F) in its dtype: (da, y, zdz), in blocks of rows (``by_row_blocks``)."""
    return by_row_blocks(_dswiglu_rows, dy, a, rstd)


def _dswiglu_rows(dy: torch.Tensor, a: torch.Tensor, rstd: torch.Tensor) -> tuple[torch.Tensor, ...]:
    ct = dy.dtype
    r = rstd.to(ct)[:, None]
    af = a.to(ct)
    zg, zu = af[:, 0::2] * r, af[:, 1::2] * r
    s = torch.sigmoid(zg)
    silu = zg * s
    dzu = dy * silu
    dzg = dy * zu * s * (1 + zg * (1 - s))
    zdz = (zg * dzg).sum(-1) + (zu * dzu).sum(-1)
    da = torch.stack([dzg * r, dzu * r], dim=-1).reshape(af.shape)
    return da, silu * zu, zdz


def swiglu_bwd(
    *, dout: torch.Tensor, w_down: torch.Tensor, a: torch.Tensor, rstd: torch.Tensor, concat: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(da, y, zdz) from D = ``dout`` (M, d), W_down (d, F), saved a (M, 2F) and r (M,). ``concat``: da's columns
    as [gate | up], the order of [w1; w3]'s rows (``[coda] stacked_weights``), not a's interleaved pairs."""
    da, y, zdz = swiglu_bwd_acc(dout=dout, w_down=w_down, a=a, rstd=rstd)
    da = torch.cat([da[:, 0::2], da[:, 1::2]], dim=1) if concat else da
    return da.to(a.dtype), y.to(a.dtype), zdz


def swiglu_bwd_fp8(
    *, dout: torch.Tensor, w_down: torch.Tensor, a: torch.Tensor, rstd: torch.Tensor, inv_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(da, y, zdz, daq, amax): ``swiglu_bwd`` plus da as e5m2 (scale ``inv_scale``, None = the
    current amax) and amax |da|."""
    return _with_bf16_da(*swiglu_bwd_acc(dout=dout, w_down=w_down, a=a, rstd=rstd), a, inv_scale)


def _with_bf16_da(da, y, zdz, a, inv_scale):
    """(da, y, zdz, daq, amax |da|): ``_e5m2_only``'s outputs with da in a's dtype in front."""
    return da.to(a.dtype), *_e5m2_only(da, y, zdz, a.dtype, inv_scale, None)


def _e5m2_only(da, y, zdz, dtype, inv_scale, inv_y):
    """B3's outputs without the bf16 da: (y (in ``dtype``, e4m3 with ``inv_y``), zdz, daq, amax |da|)."""
    return y.to(dtype) if inv_y is None else quantize_e4m3(y, inv_y), zdz, *quantize_e5m2_site_rows(da, inv_scale)


def _transposed(y, zdz, daq, amax, inv_y):
    """``_e5m2_only``'s outputs plus daq^T de-interleaved, [gate; up] (2F, M); an e4m3 y as y^T."""
    y = y if inv_y is None else y.t().contiguous()
    return y, zdz, daq, torch.cat([daq[:, 0::2].t(), daq[:, 1::2].t()]).contiguous(), amax


def swiglu_bwd_e5m2(
    *, dout: torch.Tensor, w_down: torch.Tensor, a: torch.Tensor, rstd: torch.Tensor, inv_scale: torch.Tensor | None,
    inv_y: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, zdz, daq, amax): ``swiglu_bwd_fp8`` less its bf16 da. With ``inv_y`` (``fp8_down_wgrad``)
    y comes as e4m3, sat(y * inv_y) from the compute-dtype y: dW2's fp8 operand, with the scale of
    the down-projection's input site (the forward quantized the same y with it)."""
    return _e5m2_only(*swiglu_bwd_acc(dout=dout, w_down=w_down, a=a, rstd=rstd), a.dtype, inv_scale, inv_y)


def swiglu_bwd_e5m2_t(
    *, dout: torch.Tensor, w_down: torch.Tensor, a: torch.Tensor, rstd: torch.Tensor, inv_scale: torch.Tensor | None,
    inv_y: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, zdz, daq, daq_t, amax): ``swiglu_bwd_e5m2`` plus daq's gate and up columns transposed; with
    ``inv_y``, y as e4m3 *transposed*, (F, M) token-major: dW2's input as cuBLAS reads it."""
    return _transposed(*swiglu_bwd_e5m2(dout=dout, w_down=w_down, a=a, rstd=rstd, inv_scale=inv_scale, inv_y=inv_y),
                       inv_y)


def _dy_q(doutq: torch.Tensor, w_down_tq: torch.Tensor, scale: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """B3's GEMM on fp8: dy = scale * (doutq @ w_down_tq^T) in a's compute dtype, doutq the e5m2 D
    (M, d), w_down_tq the e4m3 W_down^T (F, d), products exact and summed in that dtype."""
    check_2d("doutq", doutq, w_down_tq.shape[1])
    check_2d("a", a, 2 * w_down_tq.shape[0])
    if doutq.dtype not in (E4M3, E5M2) or w_down_tq.dtype != E4M3:
        raise TypeError(f"B3 fp8 takes an e5m2/e4m3 gradient and an e4m3 weight, got {doutq.dtype} and {w_down_tq.dtype}")
    ct = compute_dtype(a.dtype)
    return mm(doutq.to(ct), w_down_tq.to(ct).t()) * scale.to(ct)


def swiglu_bwd_q_fp8(
    *, doutq: torch.Tensor, w_down_tq: torch.Tensor, scale: torch.Tensor, a: torch.Tensor, rstd: torch.Tensor,
    inv_scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``swiglu_bwd_fp8`` on an fp8 GEMM (``_dy_q``)."""
    return _with_bf16_da(*_dswiglu(_dy_q(doutq, w_down_tq, scale, a), a, rstd), a, inv_scale)


def swiglu_bwd_e5m2_t_q(
    *, doutq: torch.Tensor, w_down_tq: torch.Tensor, scale: torch.Tensor, a: torch.Tensor, rstd: torch.Tensor,
    inv_scale: torch.Tensor | None, inv_y: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``swiglu_bwd_e5m2_t`` on an fp8 GEMM (``_dy_q``; ``fp8_down_dgrad`` with the e5m2-only B3)."""
    return _transposed(*_e5m2_only(*_dswiglu(_dy_q(doutq, w_down_tq, scale, a), a, rstd), a.dtype, inv_scale, inv_y),
                       inv_y)


def norm_swiglu_qa_fp8(
    *, hq: torch.Tensor, rstd: torch.Tensor, w13q: torch.Tensor, scale: torch.Tensor, inv_y: torch.Tensor,
    inv_a: torch.Tensor, out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(yq, aq, amax |y|, amax |a|): ``norm_swiglu_q_fp8`` with a saved as e4m3 codes, sat(v * inv_a) from
    the compute-dtype v (never rounded to ``out_dtype`` first), interleaved as a; the amaxes of that y and v."""
    check_2d("hq", hq, w13q.shape[1])
    ct = compute_dtype(out_dtype)
    v = fp8_mm(hq, w13q, ct) * scale.to(ct)
    y = _swiglu(v * rstd.to(ct)[:, None])
    return quantize_e4m3(y, inv_y), quantize_e4m3(v, inv_a), y.abs().amax(), v.abs().amax()


def swiglu_bwd_e5m2_t_qa(
    *, doutq: torch.Tensor, w_down_tq: torch.Tensor, scale: torch.Tensor, aq: torch.Tensor, a_scale: torch.Tensor,
    rstd: torch.Tensor, inv_scale: torch.Tensor | None, out_dtype: torch.dtype, inv_y: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``swiglu_bwd_e5m2_t_q`` on a's e4m3 codes (``fp8_preact``): a = aq * a_scale in the compute dtype (with
    a power-of-two ``a_scale`` exactly the values a bf16 a decoded from the codes holds); y in ``out_dtype``."""
    if aq.dtype != E4M3:
        raise TypeError(f"swiglu_bwd_e5m2_t_qa takes a's e4m3 codes, got {aq.dtype}")
    ct = compute_dtype(out_dtype)
    a = aq.to(ct) * a_scale.to(ct)
    return _transposed(*_e5m2_only(*_dswiglu(_dy_q(doutq, w_down_tq, scale, a), a, rstd), out_dtype, inv_scale, inv_y),
                       inv_y)


# --- custom ops ------------------------------------------------------------------------------------


@program_op("norm_swiglu")
def norm_swiglu_op(h: torch.Tensor, rstd: torch.Tensor, w13: torch.Tensor,
                   w3: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    return norm_swiglu(h=h, rstd=rstd, w13=w13, w3=w3)


@norm_swiglu_op.register_fake
def _(h, rstd, w13, w3=None):
    m, f2 = h.shape[0], w13.shape[0] * (1 if w3 is None else 2)
    return h.new_empty((m, f2 // 2)), h.new_empty((m, f2))


@program_op("norm_swiglu_fp8")
def norm_swiglu_fp8_op(
    hq: torch.Tensor, rstd: torch.Tensor, w13q: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    return norm_swiglu_fp8(hq=hq, rstd=rstd, w13q=w13q, scale=scale, out_dtype=out_dtype)


@norm_swiglu_fp8_op.register_fake
def _(hq, rstd, w13q, scale, out_dtype):
    m, f2 = hq.shape[0], w13q.shape[0]
    return hq.new_empty((m, f2 // 2), dtype=out_dtype), hq.new_empty((m, f2), dtype=out_dtype)


@program_op("norm_swiglu_q_fp8")
def norm_swiglu_q_fp8_op(
    hq: torch.Tensor, rstd: torch.Tensor, w13q: torch.Tensor, scale: torch.Tensor, inv_y: torch.Tensor,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return norm_swiglu_q_fp8(hq=hq, rstd=rstd, w13q=w13q, scale=scale, inv_y=inv_y, out_dtype=out_dtype)


@norm_swiglu_q_fp8_op.register_fake
def _(hq, rstd, w13q, scale, inv_y, out_dtype):
    m, f2 = hq.shape[0], w13q.shape[0]
    return (hq.new_empty((m, f2 // 2), dtype=E4M3), hq.new_empty((m, f2), dtype=out_dtype),
            hq.new_empty((), dtype=compute_dtype(out_dtype)))


@program_op("swiglu_bwd")
def swiglu_bwd_op(
    dout: torch.Tensor, w_down: torch.Tensor, a: torch.Tensor, rstd: torch.Tensor, concat: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return swiglu_bwd(dout=dout, w_down=w_down, a=a, rstd=rstd, concat=concat)


@swiglu_bwd_op.register_fake
def _(dout, w_down, a, rstd, concat=False):
    m = a.shape[0]
    return torch.empty_like(a), a.new_empty((m, a.shape[1] // 2)), a.new_empty((m,), dtype=acc_dtype(dout, w_down))


@program_op("swiglu_bwd_fp8")
def swiglu_bwd_fp8_op(
    dout: torch.Tensor, w_down: torch.Tensor, a: torch.Tensor, rstd: torch.Tensor, inv_scale: Optional[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return swiglu_bwd_fp8(dout=dout, w_down=w_down, a=a, rstd=rstd, inv_scale=inv_scale)


@swiglu_bwd_fp8_op.register_fake
def _(dout, w_down, a, rstd, inv_scale):
    m = a.shape[0]
    ct = acc_dtype(dout, w_down)
    return (torch.empty_like(a), a.new_empty((m, a.shape[1] // 2)), a.new_empty((m,), dtype=ct),
            a.new_empty(a.shape, dtype=E5M2), a.new_empty((), dtype=ct))


@program_op("swiglu_bwd_e5m2")
def swiglu_bwd_e5m2_op(
    dout: torch.Tensor, w_down: torch.Tensor, a: torch.Tensor, rstd: torch.Tensor, inv_scale: Optional[torch.Tensor],
    inv_y: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return swiglu_bwd_e5m2(dout=dout, w_down=w_down, a=a, rstd=rstd, inv_scale=inv_scale, inv_y=inv_y)


@swiglu_bwd_e5m2_op.register_fake
def _(dout, w_down, a, rstd, inv_scale, inv_y=None):
    y, *rest = swiglu_bwd_fp8_op(dout, w_down, a, rstd, inv_scale)[1:]
    return (y if inv_y is None else y.new_empty(y.shape, dtype=E4M3)), *rest


@program_op("swiglu_bwd_e5m2_t")
def swiglu_bwd_e5m2_t_op(
    dout: torch.Tensor, w_down: torch.Tensor, a: torch.Tensor, rstd: torch.Tensor, inv_scale: Optional[torch.Tensor],
    inv_y: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return swiglu_bwd_e5m2_t(dout=dout, w_down=w_down, a=a, rstd=rstd, inv_scale=inv_scale, inv_y=inv_y)


@swiglu_bwd_e5m2_t_op.register_fake
def _(dout, w_down, a, rstd, inv_scale, inv_y=None):
    y, zdz, daq, amax = swiglu_bwd_e5m2_op(dout, w_down, a, rstd, inv_scale, inv_y)
    y = y if inv_y is None else y.new_empty((y.shape[1], y.shape[0]))
    return y, zdz, daq, daq.new_empty((daq.shape[1], daq.shape[0])), amax


@program_op("swiglu_bwd_q_fp8")
def swiglu_bwd_q_fp8_op(
    doutq: torch.Tensor, w_down_tq: torch.Tensor, scale: torch.Tensor, a: torch.Tensor, rstd: torch.Tensor,
    inv_scale: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return swiglu_bwd_q_fp8(doutq=doutq, w_down_tq=w_down_tq, scale=scale, a=a, rstd=rstd, inv_scale=inv_scale)


@swiglu_bwd_q_fp8_op.register_fake
def _(doutq, w_down_tq, scale, a, rstd, inv_scale):
    m = a.shape[0]
    ct = compute_dtype(a.dtype)
    return (torch.empty_like(a), a.new_empty((m, a.shape[1] // 2)), a.new_empty((m,), dtype=ct),
            a.new_empty(a.shape, dtype=E5M2), a.new_empty((), dtype=ct))


@program_op("swiglu_bwd_e5m2_t_q")
def swiglu_bwd_e5m2_t_q_op(
    doutq: torch.Tensor, w_down_tq: torch.Tensor, scale: torch.Tensor, a: torch.Tensor, rstd: torch.Tensor,
    inv_scale: Optional[torch.Tensor], inv_y: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return swiglu_bwd_e5m2_t_q(doutq=doutq, w_down_tq=w_down_tq, scale=scale, a=a, rstd=rstd, inv_scale=inv_scale,
                               inv_y=inv_y)


@swiglu_bwd_e5m2_t_q_op.register_fake
def _(doutq, w_down_tq, scale, a, rstd, inv_scale, inv_y=None):
    m, f = a.shape[0], a.shape[1] // 2
    y = a.new_empty((m, f)) if inv_y is None else a.new_empty((f, m), dtype=E4M3)
    return (y, a.new_empty((m,), dtype=compute_dtype(a.dtype)), a.new_empty(a.shape, dtype=E5M2),
            a.new_empty((2 * f, m), dtype=E5M2), a.new_empty((), dtype=compute_dtype(a.dtype)))


@program_op("norm_swiglu_qa_fp8")
def norm_swiglu_qa_fp8_op(
    hq: torch.Tensor, rstd: torch.Tensor, w13q: torch.Tensor, scale: torch.Tensor, inv_y: torch.Tensor,
    inv_a: torch.Tensor, out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return norm_swiglu_qa_fp8(hq=hq, rstd=rstd, w13q=w13q, scale=scale, inv_y=inv_y, inv_a=inv_a, out_dtype=out_dtype)


@norm_swiglu_qa_fp8_op.register_fake
def _(hq, rstd, w13q, scale, inv_y, inv_a, out_dtype):
    m, f2 = hq.shape[0], w13q.shape[0]
    amax = hq.new_empty((), dtype=compute_dtype(out_dtype))
    return hq.new_empty((m, f2 // 2), dtype=E4M3), hq.new_empty((m, f2), dtype=E4M3), amax, torch.empty_like(amax)


@program_op("swiglu_bwd_e5m2_t_qa")
def swiglu_bwd_e5m2_t_qa_op(
    doutq: torch.Tensor, w_down_tq: torch.Tensor, scale: torch.Tensor, aq: torch.Tensor, a_scale: torch.Tensor,
    rstd: torch.Tensor, inv_scale: Optional[torch.Tensor], out_dtype: torch.dtype, inv_y: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return swiglu_bwd_e5m2_t_qa(doutq=doutq, w_down_tq=w_down_tq, scale=scale, aq=aq, a_scale=a_scale, rstd=rstd,
                                inv_scale=inv_scale, out_dtype=out_dtype, inv_y=inv_y)


@swiglu_bwd_e5m2_t_qa_op.register_fake
def _(doutq, w_down_tq, scale, aq, a_scale, rstd, inv_scale, out_dtype, inv_y=None):
    m, f = aq.shape[0], aq.shape[1] // 2
    ct = compute_dtype(out_dtype)
    y = aq.new_empty((m, f), dtype=out_dtype) if inv_y is None else aq.new_empty((f, m), dtype=E4M3)
    return (y, aq.new_empty((m,), dtype=ct), aq.new_empty(aq.shape, dtype=E5M2), aq.new_empty((2 * f, m), dtype=E5M2),
            aq.new_empty((), dtype=ct))
