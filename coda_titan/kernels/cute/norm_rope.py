"""CUDA kernels of F3 and B1 (``coda_titan.kernels.norm_rope``).

norm_rope      quack's ``rstd_rope_posfreq_epi``: r * acc, then rotation by +theta with the angle
               pos * freq formed in-kernel as a float-float (v columns: zero frequency)
norm_rope_fp8  the same epilogue on e4m3 Hq and W_qkv,q; s_a * s_w rides the rstd column vector
rope_bwd       one Triton pass over the rows (``rope_bwd_pass``; no GEMM involved), or the inductor
               program of the same arithmetic (``CODA_TITAN_B1_PASS=inductor``)
rope_bwd_fp8   the same pass that also casts da to e5m2 (delayed scale; calibrating, the current amax's,
               in the inductor program) and reduces amax |da|
"""

from __future__ import annotations

import os

import torch
from quack.epilogue.rotary import make_interleaved_inv_freq, rstd_rope_posfreq_epi

from .. import norm_rope as ref
from .._common import stacked_rows
from ..scaling import quantize_e5m2_site
from . import rope_bwd_pass  # (also registers coda::rope_bwd_pass and coda::rope_bwd_fp8_pass)
from ._dispatch import KERNEL_DTYPES, cached, fallback, first_call, fused, gemm, unsupported, unsupported_fp8

B1_PASS_ENV = "CODA_TITAN_B1_PASS"  # "inductor": B1 as the inductor program instead of the Triton pass (A/B)


def _rope_tables(freqs, m: int, seqlen: int, rot: int, q: int, head_dim: int, dev):
    """(freq, pos): quack's interleaved per-column frequencies and each row's position."""
    freq = cached(
        ("freq", freqs.data_ptr(), freqs._version, rot, q, head_dim, dev),
        lambda: make_interleaved_inv_freq(freqs.double(), rot, q - rot, head_dim).float().to(dev),
    )
    pos = cached(("pos", m, seqlen, dev), lambda: (torch.arange(m, device=dev) % seqlen).float())
    return freq, pos


@torch.library.register_kernel("coda::norm_rope", "cuda")
def _norm_rope(h, rstd, weight, freqs, seqlen, n_rope_heads, head_dim, weight2=None, weight3=None):
    rest = [w for w in (weight2, weight3) if w is not None]
    why = unsupported(h, weight, *rest)
    m, q = h.shape[0], weight.shape[0] + sum(w.shape[0] for w in rest)
    rot = n_rope_heads * head_dim
    if why is None and (head_dim % 2 or m % seqlen or rot > q):
        why = f"head_dim {head_dim} / rows {m} vs seqlen {seqlen}"
    if why:
        return fallback(ref.norm_rope_op, why, h, rstd, weight, freqs, seqlen, n_rope_heads, head_dim, weight2,
                        weight3)
    weight = stacked_rows(weight, *rest) if rest else weight  # (a view where they share a buffer)
    freq, pos = _rope_tables(freqs, m, seqlen, rot, q, head_dim, h.device)
    out = h.new_empty((m, q))
    with first_call("norm_rope", h, weight):
        gemm(rstd_rope_posfreq_epi, h, weight.t(), None, {"D": out}, pos=pos, freq=freq, rstd=rstd.float())
    return out


@torch.library.register_kernel("coda::norm_rope_fp8", "cuda")
def _norm_rope_fp8(hq, rstd, weight_q, scale, freqs, seqlen, n_rope_heads, head_dim, out_dtype):
    why = unsupported_fp8(hq, weight_q)
    m, q = hq.shape[0], weight_q.shape[0]
    rot = n_rope_heads * head_dim
    if why is None and (head_dim % 2 or m % seqlen or rot > q or out_dtype not in KERNEL_DTYPES):
        why = f"head_dim {head_dim} / rows {m} vs seqlen {seqlen} / out dtype {out_dtype}"
    if why:
        return fallback(ref.norm_rope_fp8_op, why, hq, rstd, weight_q, scale, freqs, seqlen, n_rope_heads, head_dim,
                        out_dtype)
    freq, pos = _rope_tables(freqs, m, seqlen, rot, q, head_dim, hq.device)
    out = torch.empty((m, q), device=hq.device, dtype=out_dtype)
    with first_call("norm_rope_fp8", hq, weight_q):
        gemm(rstd_rope_posfreq_epi, hq, weight_q.t(), None, {"D": out}, pos=pos, freq=freq,
             rstd=rstd.float() * scale.float())
    return out


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


def _rope_bwd_fp8_math(dy, y, rstd, cos, sin, rot: int, head_dim: int, inv_scale=None):
    da, zdz = _rope_bwd_f32(dy, y, rstd, cos, sin, rot, head_dim)
    return da.to(dy.dtype), zdz, *quantize_e5m2_site(da, inv_scale)


def _rope_bwd_unsupported(dy, y, seqlen, head_dim) -> str | None:
    why = unsupported(dy, y)
    if why is None and (head_dim % 2 or dy.shape[0] % seqlen):
        why = f"head_dim {head_dim} / rows {dy.shape[0]} vs seqlen {seqlen}"
    return why


def _cos_sin(freqs, seqlen):
    return cached(  # (the shape too: a freed freqs' address can come back for another head_dim)
        ("cossin", freqs.data_ptr(), freqs._version, tuple(freqs.shape), seqlen, freqs.device),
        lambda: ref.rope_cos_sin(freqs, seqlen, torch.float32),
    )


@torch.library.register_kernel("coda::rope_tables", "cuda")
def _cos_sin_tables(freqs, seqlen):
    cos, sin = _cos_sin(freqs, seqlen)
    return cos.clone(), sin.clone()  # an op's outputs are its caller's to reuse


def _one_pass(dy, scale) -> bool:
    """B1 runs as one Triton pass (``rope_bwd_pass``) for bf16 rows of at most 8192 columns, bf16 or with a
    delayed e5m2 scale (calibrating, the scale waits for the whole tensor's amax: the inductor program),
    unless ``CODA_TITAN_B1_PASS=inductor`` asks for the inductor program (the A/B's other arm)."""
    return (os.environ.get(B1_PASS_ENV, "triton") != "inductor" and dy.dtype == torch.bfloat16
            and dy.shape[1] <= 8192 and not (scale and scale[0] is None))


def _rope_bwd_pass(op, math, dy, y, rstd, freqs, seqlen, n_rope_heads, head_dim, *scale):
    """B1 (``math`` = _rope_bwd_math or _rope_bwd_fp8_math, ``scale`` = the latter's inv_scale) as one
    Triton pass (``_one_pass``) or one inductor program."""
    why = _rope_bwd_unsupported(dy, y, seqlen, head_dim)
    if why:
        return fallback(op, why, dy, y, rstd, freqs, seqlen, n_rope_heads, head_dim, *scale)
    cos, sin = _cos_sin(freqs, seqlen)
    name = math.__name__.strip("_").removesuffix("_math")
    with first_call(name, dy):
        return _b1(fused(name, math), dy, y, rstd, cos, sin, n_rope_heads * head_dim, head_dim, scale)


def _b1(math, dy, y, rstd, cos, sin, rot: int, head_dim: int, scale: tuple):
    """B1's outputs: the Triton pass where it applies (``_one_pass``; rows read in place at any row
    stride), else ``math`` (eager: its inductor program; traced: the code itself)."""
    if rope_bwd_pass.unit_columns(dy, y) and _one_pass(dy, scale):
        op = torch.ops.coda.rope_bwd_fp8_pass if scale else torch.ops.coda.rope_bwd_pass
        return op(dy, y, rstd.float(), cos, sin, rot, *scale)
    return math(dy, y, rstd.float(), cos, sin, rot, head_dim, *scale)


@torch.library.register_kernel("coda::rope_bwd", "cuda")
def _rope_bwd(dy, y, rstd, freqs, seqlen, n_rope_heads, head_dim):
    return _rope_bwd_pass(ref.rope_bwd_op, _rope_bwd_math, dy, y, rstd, freqs, seqlen, n_rope_heads, head_dim)


@torch.library.register_kernel("coda::rope_bwd_fp8", "cuda")
def _rope_bwd_fp8(dy, y, rstd, freqs, seqlen, n_rope_heads, head_dim, inv_scale):
    # delayed: da in bf16 and e5m2 with the amax beside them; calibrating: the amax reduction first
    return _rope_bwd_pass(ref.rope_bwd_fp8_op, _rope_bwd_fp8_math, dy, y, rstd, freqs, seqlen, n_rope_heads, head_dim,
                          inv_scale)


def _traced_rope_bwd(op, math):
    """B1 as code a compiled caller traces (``TRACED``): the same ``math``, fused by inductor into the
    caller's backward graph; the tables come through ``coda::rope_tables``."""

    def program(*, dy, y, rstd, freqs, seqlen, n_rope_heads, head_dim, **scale):
        if _rope_bwd_unsupported(dy, y, seqlen, head_dim):
            return op(dy, y, rstd, freqs, seqlen, n_rope_heads, head_dim, *scale.values())  # the op says why, once
        cos, sin = torch.ops.coda.rope_tables(freqs, seqlen)
        return _b1(math, dy, y, rstd, cos, sin, n_rope_heads * head_dim, head_dim, tuple(scale.values()))

    return program


rope_bwd_traced = _traced_rope_bwd(ref.rope_bwd_op, _rope_bwd_math)
rope_bwd_fp8_traced = _traced_rope_bwd(ref.rope_bwd_fp8_op, _rope_bwd_fp8_math)
