"""F3 norm_rope / B1 rope_bwd: GEMM + deferred rstd + RoPE (the fused QKV projection), and the
RoPE backward + zdz.

Columns of the (M, Q) output, Q = (Hq + 2 Hkv) * head_dim: q heads, then k heads, then v heads
(GQA widths). The first ``n_rope_heads = Hq + Hkv`` heads are rotated, v passes through.

Forward, H = X * gamma from the producer epilogue, W_qkv = [wq; wk; wv] (Q, d):
    p = r * (H @ W_qkv^T)
    for each rotated head and pair j:  (y0 + i y1) = (p0 + i p1) * exp(i theta[pos, j])
which is TorchTitan's rotation exactly: adjacent pairs (2j, 2j+1) read as one complex number,
multiplied by ``freqs_cis`` (angle +theta). theta[pos, j] = pos * freqs[j], with ``freqs`` the
(head_dim/2,) fp64 per-pair frequencies (Llama-3.1 scaling already applied, see
``coda_titan.model.rope.rope_freqs``); pos = row % seqlen for rows laid out (bs, seqlen). Angles
are formed in fp64, so cos/sin are exact to the compute dtype.

Backward (B1), elementwise: dp = R^T dy (rotation by -theta) on q/k, dp = dy on v, and
zdz = sum_n y_n dy_n per row, which equals sum_n p_n dp_n because R is orthogonal, so the pre-RoPE
values never need saving. B1 returns da = r * dp, the gradient of the *unscaled* GEMM output
a = H @ W_qkv^T: the deferred rstd is folded here, so the dgrad (B2) and wgrad GEMMs are plain.
Saved: the post-RoPE output y (which attention saves anyway) and r.

FP8 (precision = "fp8"):
    norm_rope_fp8  acc = Hq @ W_qkv,q^T on e4m3 operands; the dequantization scale s_a * s_w rides
                   the deferred-rstd column vector: p = (r * s) * acc
    rope_bwd_fp8   B1 that also casts da to e5m2 and reports amax |da|: with a delayed scale
                   (``fp8_dgrad``: the QKV gradient site's history, as B3's da) in the same pass;
                   without one (the calibration step) with the current amax's scale
"""

from __future__ import annotations

from typing import Optional

import torch

from ._common import acc_dtype, check_2d, mm, program_op
from .scaling import E5M2, check_e4m3, compute_dtype, quantize_e5m2_site


def rope_cos_sin(freqs: torch.Tensor, seqlen: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each (seqlen, head_dim/2), from fp64 angles pos * freqs[j], rounded once to ``dtype``."""
    pos = torch.arange(seqlen, dtype=torch.float64, device=freqs.device)
    angles = torch.outer(pos, freqs.to(torch.float64))
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(
    t: torch.Tensor, freqs: torch.Tensor, seqlen: int, *, n_rope_heads: int, head_dim: int, inverse: bool
) -> torch.Tensor:
    """RoPE (by +theta, or -theta if ``inverse``) of the first ``n_rope_heads`` heads of ``t`` (M, Q)."""
    m = t.shape[0]
    if seqlen <= 0 or m % seqlen:
        raise ValueError(f"rows ({m}) must be a whole number of sequences of length {seqlen}")
    if freqs.shape != (head_dim // 2,):
        raise ValueError(f"freqs must be ({head_dim // 2},), got {tuple(freqs.shape)}")
    cos, sin = rope_cos_sin(freqs, seqlen, t.dtype)
    rope_cols = n_rope_heads * head_dim
    x = t[:, :rope_cols].reshape(m // seqlen, seqlen, n_rope_heads, head_dim // 2, 2)
    c = cos[None, :, None, :]  # (1, seqlen, 1, head_dim/2)
    s = sin[None, :, None, :]
    if inverse:
        s = -s
    x0, x1 = x[..., 0], x[..., 1]
    rot = torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1).reshape(m, rope_cols)
    return torch.cat([rot, t[:, rope_cols:]], dim=-1)


def norm_rope(
    *, h: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor, freqs: torch.Tensor, seqlen: int,
    n_rope_heads: int, head_dim: int, weight2: torch.Tensor | None = None, weight3: torch.Tensor | None = None,
) -> torch.Tensor:
    """Post-RoPE qkv (M, Q) in h's dtype; with ``weight2`` (and ``weight3``) the weight is [weight; weight2;
    weight3] (W_q, W_k, W_v: ``[coda] stacked_weights``)."""
    weight = weight if weight2 is None else torch.cat([w for w in (weight, weight2, weight3) if w is not None])
    check_2d("h", h, weight.shape[1])
    acc = mm(h, weight.t())
    p = acc * rstd.to(acc.dtype)[:, None]
    y = rotate(p, freqs, seqlen, n_rope_heads=n_rope_heads, head_dim=head_dim, inverse=False)
    return y.to(h.dtype)


def norm_rope_fp8(
    *, hq: torch.Tensor, rstd: torch.Tensor, weight_q: torch.Tensor, scale: torch.Tensor, freqs: torch.Tensor,
    seqlen: int, n_rope_heads: int, head_dim: int, out_dtype: torch.dtype,
) -> torch.Tensor:
    """Post-RoPE qkv as ``norm_rope``, from e4m3 Hq and W_qkv,q; the rstd vector carries ``scale``."""
    check_2d("hq", hq, weight_q.shape[1])
    check_e4m3(hq, weight_q)
    ct = compute_dtype(out_dtype)
    y = norm_rope(
        h=hq.to(ct), rstd=rstd.to(ct) * scale.to(ct), weight=weight_q.to(ct), freqs=freqs,
        seqlen=seqlen, n_rope_heads=n_rope_heads, head_dim=head_dim,
    )
    return y.to(out_dtype)


def rope_bwd_acc(*, dy, y, rstd, freqs, seqlen: int, n_rope_heads: int, head_dim: int):
    """``rope_bwd``'s (da, zdz) with da still in the accumulator dtype (the fp8 B1 casts from it)."""
    check_2d("dy", dy, y.shape[1])
    ct = acc_dtype(dy, y)
    dyf = dy.to(ct)
    zdz = (y.to(ct) * dyf).sum(-1)
    dp = rotate(dyf, freqs, seqlen, n_rope_heads=n_rope_heads, head_dim=head_dim, inverse=True)
    return dp * rstd.to(ct)[:, None], zdz


def rope_bwd(
    *, dy: torch.Tensor, y: torch.Tensor, rstd: torch.Tensor, freqs: torch.Tensor, seqlen: int,
    n_rope_heads: int, head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(da, zdz): da = r * R^T dy (M, Q) in dy's dtype, zdz (M,) in the accumulator dtype."""
    da, zdz = rope_bwd_acc(dy=dy, y=y, rstd=rstd, freqs=freqs, seqlen=seqlen, n_rope_heads=n_rope_heads, head_dim=head_dim)
    return da.to(dy.dtype), zdz


def rope_bwd_fp8(
    *, dy: torch.Tensor, y: torch.Tensor, rstd: torch.Tensor, freqs: torch.Tensor, seqlen: int,
    n_rope_heads: int, head_dim: int, inv_scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(da, zdz, daq, amax): ``rope_bwd`` plus daq = sat(da * inv) in e5m2, inv = ``inv_scale`` (the
    delayed scale; None = the current amax's, E5M2_MAX / amax), and amax |da| (accumulator dtype)."""
    da, zdz = rope_bwd_acc(dy=dy, y=y, rstd=rstd, freqs=freqs, seqlen=seqlen, n_rope_heads=n_rope_heads, head_dim=head_dim)
    return da.to(dy.dtype), zdz, *quantize_e5m2_site(da, inv_scale)


# --- custom ops ------------------------------------------------------------------------------------


@program_op("norm_rope")
def norm_rope_op(
    h: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor, freqs: torch.Tensor, seqlen: int,
    n_rope_heads: int, head_dim: int, weight2: Optional[torch.Tensor] = None, weight3: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    return norm_rope(h=h, rstd=rstd, weight=weight, freqs=freqs, seqlen=seqlen, n_rope_heads=n_rope_heads,
                     head_dim=head_dim, weight2=weight2, weight3=weight3)


@norm_rope_op.register_fake
def _(h, rstd, weight, freqs, seqlen, n_rope_heads, head_dim, weight2=None, weight3=None):
    return h.new_empty((h.shape[0], sum(w.shape[0] for w in (weight, weight2, weight3) if w is not None)))


@program_op("norm_rope_fp8")
def norm_rope_fp8_op(
    hq: torch.Tensor, rstd: torch.Tensor, weight_q: torch.Tensor, scale: torch.Tensor, freqs: torch.Tensor,
    seqlen: int, n_rope_heads: int, head_dim: int, out_dtype: torch.dtype,
) -> torch.Tensor:
    return norm_rope_fp8(hq=hq, rstd=rstd, weight_q=weight_q, scale=scale, freqs=freqs, seqlen=seqlen,
                         n_rope_heads=n_rope_heads, head_dim=head_dim, out_dtype=out_dtype)


@norm_rope_fp8_op.register_fake
def _(hq, rstd, weight_q, scale, freqs, seqlen, n_rope_heads, head_dim, out_dtype):
    return hq.new_empty((hq.shape[0], weight_q.shape[0]), dtype=out_dtype)


@program_op("rope_tables")
def rope_tables_op(freqs: torch.Tensor, seqlen: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rope_cos_sin`` in fp32 as an op: a compiled caller that traces B1 reads the tables through it,
    so inductor never inlines their fp64 cos / sin into B1's kernel."""
    return rope_cos_sin(freqs, seqlen, torch.float32)


@rope_tables_op.register_fake
def _(freqs, seqlen):
    return (freqs.new_empty((seqlen, freqs.shape[0]), dtype=torch.float32),
            freqs.new_empty((seqlen, freqs.shape[0]), dtype=torch.float32))


@program_op("rope_bwd")
def rope_bwd_op(
    dy: torch.Tensor, y: torch.Tensor, rstd: torch.Tensor, freqs: torch.Tensor, seqlen: int, n_rope_heads: int,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    return rope_bwd(dy=dy, y=y, rstd=rstd, freqs=freqs, seqlen=seqlen, n_rope_heads=n_rope_heads, head_dim=head_dim)


@rope_bwd_op.register_fake
def _(dy, y, rstd, freqs, seqlen, n_rope_heads, head_dim):
    return torch.empty_like(dy), dy.new_empty((dy.shape[0],), dtype=acc_dtype(dy, y))


@program_op("rope_bwd_fp8")
def rope_bwd_fp8_op(
    dy: torch.Tensor, y: torch.Tensor, rstd: torch.Tensor, freqs: torch.Tensor, seqlen: int, n_rope_heads: int,
    head_dim: int, inv_scale: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return rope_bwd_fp8(dy=dy, y=y, rstd=rstd, freqs=freqs, seqlen=seqlen, n_rope_heads=n_rope_heads,
                        head_dim=head_dim, inv_scale=inv_scale)


@rope_bwd_fp8_op.register_fake
def _(dy, y, rstd, freqs, seqlen, n_rope_heads, head_dim, inv_scale):
    ct = acc_dtype(dy, y)
    return (torch.empty_like(dy), dy.new_empty((dy.shape[0],), dtype=ct),
            dy.new_empty(dy.shape, dtype=E5M2), dy.new_empty((), dtype=ct))
