"""FA4 on CODA's F3 output: q, k, v read in place from the layout F3 writes, gradients written in it.

F3 writes q, k and v as column blocks of one (tokens, (h + 2 h_kv) d) buffer (``packed``), or, with
``[coda] q_apart``, q as one contiguous (tokens, h d) tensor and k, v as column blocks of one
(tokens, 2 h_kv d) buffer (``q_kv``: F3 as two calls). For each layout, a forward and a backward op
(CPU kernels: the exact reference of ``fa4``; CUDA: FA4's) with fakes and a registered autograd
formula, and :func:`attention_on_packed`, the model's call: FA4's ops for :class:`fa4.FA4Attention`,
the (b, h, s, d) views for any other attention module (SDPA on the CPU).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .fa4 import FA4Attention, _check_gqa, _fa4_bwd, _reference_bwd, flash_attn_fwd


# --- the same on F3's packed q, k, v ---------------------------------------------------------------
# CODA's F3 writes q, k and v as column blocks of one (tokens, (h + 2 h_kv) d) buffer. FA4 reads
# their slices in place, and its backward writes dq, dk, dv as slices of one buffer of that layout:
# the gradient F3's backward reads, with no concatenation. On the H100 the backward on packed slices
# runs 2.90 ms writing packed gradients against 3.27 ms writing three contiguous ones
# (benchmarks/results/probe_fa4_layouts_*.json); stock TorchTitan's contiguous q, k, v: 2.80 ms.


def split_packed(qkv: torch.Tensor, seqlen: int, n_heads: int, n_kv_heads: int) -> tuple:
    """(b, s, heads, d) views of q, k, v in the packed (tokens, (h + 2 h_kv) d) buffer ``qkv``."""
    m, n = qkv.shape
    d = n // (n_heads + 2 * n_kv_heads)
    parts = qkv.split([n_heads * d, n_kv_heads * d, n_kv_heads * d], dim=1)
    return tuple(t.view(m // seqlen, seqlen, -1, d) for t in parts)


@torch.library.custom_op("coda::flash_attn_packed_fwd", mutates_args=(), device_types="cpu")
def flash_attn_packed_fwd(
    qkv: torch.Tensor, seqlen: int, n_heads: int, n_kv_heads: int, scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`flash_attn_fwd` on the packed q, k, v of ``qkv`` (tokens, (h + 2 h_kv) d): out (b, s, h, d)
    contiguous, lse (b, h, s) float32."""
    return flash_attn_fwd(*split_packed(qkv, seqlen, n_heads, n_kv_heads), scale, causal)


@flash_attn_packed_fwd.register_fake
def _(qkv, seqlen, n_heads, n_kv_heads, scale, causal):
    q, _, v = split_packed(qkv, seqlen, n_heads, n_kv_heads)
    b, s, h, _ = q.shape
    return qkv.new_empty(q.shape[:3] + (v.shape[3],)), qkv.new_empty((b, h, s), dtype=torch.float32)


@torch.library.custom_op("coda::flash_attn_packed_bwd", mutates_args=(), device_types="cpu")
def flash_attn_packed_bwd(
    dout: torch.Tensor, qkv: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, seqlen: int, n_heads: int,
    n_kv_heads: int, scale: float, causal: bool,
) -> torch.Tensor:
    """Gradient of :func:`flash_attn_packed_fwd`: dq, dk, dv packed as ``qkv`` (contiguous)."""
    grads = _reference_bwd(dout, *split_packed(qkv, seqlen, n_heads, n_kv_heads), out, scale, causal)
    return torch.cat([g.flatten(2) for g in grads], dim=2).view(qkv.shape)


@flash_attn_packed_bwd.register_fake
def _(dout, qkv, out, lse, seqlen, n_heads, n_kv_heads, scale, causal):
    return torch.empty_like(qkv, memory_format=torch.contiguous_format)


@flash_attn_packed_fwd.register_kernel("cuda")
def _(qkv, seqlen, n_heads, n_kv_heads, scale, causal):
    from flash_attn.cute.interface import _flash_attn_fwd

    q, k, v = split_packed(qkv, seqlen, n_heads, n_kv_heads)
    out, lse, *_ = _flash_attn_fwd(q, k, v, softmax_scale=scale, causal=causal, return_lse=True)
    return out, lse


@flash_attn_packed_bwd.register_kernel("cuda")
def _(dout, qkv, out, lse, seqlen, n_heads, n_kv_heads, scale, causal):
    dqkv = torch.empty(qkv.shape, dtype=qkv.dtype, device=qkv.device)
    dq, dk, dv = split_packed(dqkv, seqlen, n_heads, n_kv_heads)
    q, k, v = split_packed(qkv, seqlen, n_heads, n_kv_heads)
    _fa4_bwd(dout, q, k, v, out, lse, scale, causal, dq, dk, dv)
    return dqkv


def _setup_context_packed(ctx, inputs, output):
    qkv, seqlen, n_heads, n_kv_heads, scale, causal = inputs
    out, lse = output
    ctx.save_for_backward(qkv, out, lse)
    ctx.args = (seqlen, n_heads, n_kv_heads, scale, causal)


def _backward_packed(ctx, dout, dlse):
    qkv, out, lse = ctx.saved_tensors
    return flash_attn_packed_bwd(dout, qkv, out, lse, *ctx.args), None, None, None, None, None


torch.library.register_autograd("coda::flash_attn_packed_fwd", _backward_packed, setup_context=_setup_context_packed)


# --- the same on q apart from one k v buffer (``[coda] q_apart``: F3 as two calls) -----------------
# FA4's forward ran 1.029 ms on a contiguous q against 1.078 on the packed slice (the probe above);
# here q is contiguous (tokens, h d), k and v are slices of one (tokens, 2 h_kv d) buffer, and the
# backward writes dq and dk dv in the same two tensors, which B1 reads in place (``rope_bwd``'s parts).


def split_q_kv(q: torch.Tensor, kv: torch.Tensor, seqlen: int, n_heads: int, n_kv_heads: int) -> tuple:
    """(b, s, heads, d) views of q (tokens, h d) and of k, v in kv (tokens, 2 h_kv d)."""
    m, d = q.shape[0], q.shape[1] // n_heads
    if kv.shape != (m, 2 * n_kv_heads * d):
        raise ValueError(f"kv must be ({m}, {2 * n_kv_heads * d}) beside q {tuple(q.shape)}, got {tuple(kv.shape)}")
    k, v = kv.split([n_kv_heads * d, n_kv_heads * d], dim=1)
    return tuple(t.view(m // seqlen, seqlen, -1, d) for t in (q, k, v))


@torch.library.custom_op("coda::flash_attn_q_kv_fwd", mutates_args=(), device_types="cpu")
def flash_attn_q_kv_fwd(
    q: torch.Tensor, kv: torch.Tensor, seqlen: int, n_heads: int, n_kv_heads: int, scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`flash_attn_fwd` on q (tokens, h d) and the k, v of kv (tokens, 2 h_kv d): out (b, s, h, d)
    contiguous, lse (b, h, s) float32."""
    return flash_attn_fwd(*split_q_kv(q, kv, seqlen, n_heads, n_kv_heads), scale, causal)


@flash_attn_q_kv_fwd.register_fake
def _(q, kv, seqlen, n_heads, n_kv_heads, scale, causal):
    q4, _, v4 = split_q_kv(q, kv, seqlen, n_heads, n_kv_heads)
    b, s, h, _ = q4.shape
    return q.new_empty(q4.shape[:3] + (v4.shape[3],)), q.new_empty((b, h, s), dtype=torch.float32)


@torch.library.custom_op("coda::flash_attn_q_kv_bwd", mutates_args=(), device_types="cpu")
def flash_attn_q_kv_bwd(
    dout: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, seqlen: int,
    n_heads: int, n_kv_heads: int, scale: float, causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradient of :func:`flash_attn_q_kv_fwd`: dq like q, dk dv packed like kv (both contiguous)."""
    dq, dk, dv = _reference_bwd(dout, *split_q_kv(q, kv, seqlen, n_heads, n_kv_heads), out, scale, causal)
    return dq.reshape(q.shape), torch.cat([dk.flatten(2), dv.flatten(2)], dim=2).view(kv.shape)


@flash_attn_q_kv_bwd.register_fake
def _(dout, q, kv, out, lse, seqlen, n_heads, n_kv_heads, scale, causal):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(kv, memory_format=torch.contiguous_format))


@flash_attn_q_kv_fwd.register_kernel("cuda")
def _(q, kv, seqlen, n_heads, n_kv_heads, scale, causal):
    from flash_attn.cute.interface import _flash_attn_fwd

    q4, k4, v4 = split_q_kv(q, kv, seqlen, n_heads, n_kv_heads)
    out, lse, *_ = _flash_attn_fwd(q4, k4, v4, softmax_scale=scale, causal=causal, return_lse=True)
    return out, lse


@flash_attn_q_kv_bwd.register_kernel("cuda")
def _(dout, q, kv, out, lse, seqlen, n_heads, n_kv_heads, scale, causal):
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dkv = torch.empty(kv.shape, dtype=kv.dtype, device=kv.device)
    _fa4_bwd(dout, *split_q_kv(q, kv, seqlen, n_heads, n_kv_heads), out, lse, scale, causal,
             *split_q_kv(dq, dkv, seqlen, n_heads, n_kv_heads))
    return dq, dkv


def _setup_context_q_kv(ctx, inputs, output):
    q, kv, seqlen, n_heads, n_kv_heads, scale, causal = inputs
    out, lse = output
    ctx.save_for_backward(q, kv, out, lse)
    ctx.args = (seqlen, n_heads, n_kv_heads, scale, causal)


def _backward_q_kv(ctx, dout, dlse):
    q, kv, out, lse = ctx.saved_tensors
    return *flash_attn_q_kv_bwd(dout, q, kv, out, lse, *ctx.args), None, None, None, None, None


torch.library.register_autograd("coda::flash_attn_q_kv_fwd", _backward_q_kv, setup_context=_setup_context_q_kv)


def attention_on_packed(inner: nn.Module, qkv: torch.Tensor | tuple, seqlen: int, n_heads: int, n_kv_heads: int,
                        enable_gqa: bool) -> torch.Tensor:
    """Causal attention (tokens, h d) of ``inner`` (TorchTitan's attention wrapper, or
    :class:`FA4Attention`) on the packed q, k, v of ``qkv``, or on q apart from one k v buffer where
    ``qkv`` is the pair (q, kv) (``q_apart``): FA4 runs its packed (or q, kv) ops, whose gradients come
    back in the same layout, any other module the (b, h, s, d) views of the slices."""
    apart = isinstance(qkv, tuple)
    m = qkv[0].shape[0] if apart else qkv.shape[0]
    if isinstance(inner, FA4Attention):
        _check_gqa(n_heads, n_kv_heads, enable_gqa)
        d = qkv[0].shape[1] // n_heads if apart else qkv.shape[1] // (n_heads + 2 * n_kv_heads)
        fwd = flash_attn_q_kv_fwd if apart else flash_attn_packed_fwd
        out, _ = fwd(*(qkv if apart else (qkv,)), seqlen, n_heads, n_kv_heads, 1.0 / math.sqrt(d), True)
    else:
        views = split_q_kv(*qkv, seqlen, n_heads, n_kv_heads) if apart else split_packed(qkv, seqlen, n_heads, n_kv_heads)
        q, k, v = (t.transpose(1, 2) for t in views)
        out = inner(q, k, v, enable_gqa=enable_gqa).transpose(1, 2)  # (b, s, h, d)
    return out.reshape(m, -1)
