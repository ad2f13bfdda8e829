"""FlashAttention-4 (the CuTeDSL FlashAttention, ``flash-attn-4``) as TorchTitan attention.

Both model families call ``layer.attention.inner_attention(q, k, v, enable_gqa=...)`` with
(batch, heads, seqlen, head_dim) views, exactly like TorchTitan's SDPA wrapper. The ``fa4`` model
converter swaps that module for :class:`FA4Attention` in stock ``llama3`` and in ``coda_llama3``
alike, so a comparison changes one thing at a time:

    [model]
    converters = ["fa4"]     # leave it out for SDPA

FA4 is wrapped in two ``torch.library`` custom ops (``coda::flash_attn_fwd`` / ``_bwd``) with fakes
and a registered autograd formula, so a ``torch.compile(fullgraph=True)`` layer holds one opaque node
instead of tracing into CuTeDSL. The CUDA kernels are FA4's. The CPU kernels are the exact softmax
attention in float32 (float64 for float64 inputs); they exist so the op schemas, fakes and gradients are tested without a GPU.
The converter refuses to run where FA4 cannot (no sm90/sm100 GPU or ``flash-attn-4`` missing).
"""

from __future__ import annotations

import math
import os

import torch
from torch import nn

NAME = "fa4"


def fa4_unavailable_reason() -> str | None:
    """Why the FA4 converter cannot run here, or None when it can."""
    if not torch.cuda.is_available():
        return "FlashAttention-4 needs an sm90/sm100 GPU and there is no CUDA GPU here"
    major, minor = torch.cuda.get_device_capability()
    if major not in (9, 10):
        return f"FlashAttention-4 needs an sm90/sm100 GPU, this one is sm{major}{minor}"
    try:
        import flash_attn.cute.interface  # noqa: F401
    except Exception as e:  # ImportError, or the DSL failing to load
        return f"flash-attn-4 is not importable ({type(e).__name__}: {e}); install the gpu extra: pip install 'coda_titan[gpu]'"
    return None


# --- reference (CPU) -----------------------------------------------------------------------------


def _expand_kv(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    return t.repeat_interleave(n_heads // t.shape[2], dim=2)


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _reference_fwd(q, k, v, scale: float, causal: bool):
    """(b, s, h, d) softmax attention in float32 (float64 for float64 inputs); returns out
    (b, s, h, d), lse (b, h, s) and the probabilities."""
    qf, kf, vf = (t.to(_compute_dtype(q)) for t in (q, k, v))
    kf, vf = _expand_kv(kf, q.shape[2]), _expand_kv(vf, q.shape[2])
    s = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * scale
    if causal:
        sq, sk = s.shape[-2:]
        s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool, device=s.device).triu(sk - sq + 1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None])
    return torch.einsum("bhqk,bkhd->bqhd", p, vf), lse, p


# --- custom ops ----------------------------------------------------------------------------------


@torch.library.custom_op("coda::flash_attn_fwd", mutates_args=(), device_types="cpu")
def flash_attn_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (b, s, h, d), k/v (b, s, h_kv, d) -> out (b, s, h, d) contiguous, lse (b, h, s) float32."""
    out, lse, _ = _reference_fwd(q, k, v, scale, causal)
    return out.to(q.dtype).contiguous(), lse.float().contiguous()  # (lse is float32, as FA4's)


@flash_attn_fwd.register_fake
def _(q, k, v, scale, causal):
    b, s, h, _ = q.shape
    return q.new_empty(q.shape[:3] + (v.shape[3],)), q.new_empty((b, h, s), dtype=torch.float32)


@torch.library.custom_op("coda::flash_attn_bwd", mutates_args=(), device_types="cpu")
def flash_attn_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`flash_attn_fwd`; dq/dk/dv are contiguous, shaped like q/k/v."""
    return _reference_bwd(dout, q, k, v, out, scale, causal)


def _reference_bwd(dout, q, k, v, out, scale: float, causal: bool):
    """dq, dk, dv (contiguous, in q/k/v's dtypes) of :func:`_reference_fwd`."""
    _, _, p = _reference_fwd(q, k, v, scale, causal)
    h, h_kv = q.shape[2], k.shape[2]
    ct = _compute_dtype(q)
    do = dout.to(ct)
    dv = torch.einsum("bhqk,bqhd->bkhd", p, do)
    dp = torch.einsum("bqhd,bkhd->bhqk", do, _expand_kv(v.to(ct), h))
    delta = (do * out.to(ct)).sum(-1).transpose(1, 2)  # (b, h, s)
    ds = p * (dp - delta[..., None]) * scale
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, _expand_kv(k.to(ct), h))
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q.to(ct))
    group = h // h_kv
    dk = dk.unflatten(2, (h_kv, group)).sum(3)
    dv = dv.unflatten(2, (h_kv, group)).sum(3)
    return tuple(g.to(t.dtype).contiguous() for g, t in ((dq, q), (dk, k), (dv, v)))


@flash_attn_bwd.register_fake
def _(dout, q, k, v, out, lse, scale, causal):
    return (
        q.new_empty(q.shape),
        k.new_empty(k.shape),
        v.new_empty(v.shape),
    )


@flash_attn_fwd.register_kernel("cuda")
def _(q, k, v, scale, causal):
    from flash_attn.cute.interface import _flash_attn_fwd

    out, lse, *_ = _flash_attn_fwd(q, k, v, softmax_scale=scale, causal=causal, return_lse=True)
    return out, lse


@flash_attn_bwd.register_kernel("cuda")
def _(dout, q, k, v, out, lse, scale, causal):
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    _fa4_bwd(dout, q, k, v, out, lse, scale, causal, dq, dk, dv)
    return dq, dk, dv


def _fa4_bwd(dout, q, k, v, out, lse, scale, causal, dq, dk, dv) -> None:
    """FA4's backward into dq, dk, dv. It accumulates dQ (and, with GQA, dK and dV) across thread blocks
    in arrival order unless asked to be deterministic: under ``torch.use_deterministic_algorithms``
    (TorchTitan's ``debug.deterministic``) it is, at some speed."""
    from flash_attn.cute.interface import _flash_attn_bwd

    _flash_attn_bwd(q, k, v, out, dout.contiguous(), lse, scale, causal, dq=dq, dk=dk, dv=dv,
                    deterministic=torch.are_deterministic_algorithms_enabled())


def _setup_context(ctx, inputs, output):
    q, k, v, scale, causal = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.scale, ctx.causal = scale, causal


def _backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = flash_attn_bwd(dout, q, k, v, out, lse, ctx.scale, ctx.causal)
    return dq, dk, dv, None, None


torch.library.register_autograd("coda::flash_attn_fwd", _backward, setup_context=_setup_context)


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


# --- the module and the converter ----------------------------------------------------------------


def _check_gqa(n_heads: int, n_kv_heads: int, enable_gqa: bool) -> None:
    if n_heads != n_kv_heads and not enable_gqa:
        raise ValueError(f"{n_heads} query heads and {n_kv_heads} kv heads need enable_gqa=True")


class FA4Attention(nn.Module):
    """Drop-in for TorchTitan's ``ScaledDotProductAttentionWrapper`` (causal, GQA), running FA4."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float | None = None,
        enable_gqa: bool = False,
        is_causal: bool = True,
    ) -> torch.Tensor:
        # (b, h, s, d) views in, the same out; FA4 works on (b, s, h, d), which is how q/k/v are stored
        _check_gqa(q.shape[1], k.shape[1], enable_gqa)
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        out, _ = flash_attn_fwd(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale, is_causal)
        return out.transpose(1, 2)


# "0": FA4 on contiguous copies of q, k and v, as stock TorchTitan calls it, not on F3's packed slices (a
# precision bisection's arm: ``bf16_step_accuracy``'s ``coda_eager_fa4_unpacked``); read at each call
FA4_PACKED_ENV = "CODA_TITAN_FA4_PACKED"


def attention_on_packed(inner: nn.Module, qkv: torch.Tensor, seqlen: int, n_heads: int, n_kv_heads: int,
                        enable_gqa: bool) -> torch.Tensor:
    """Causal attention (tokens, h d) of ``inner`` (TorchTitan's attention wrapper, or
    :class:`FA4Attention`) on the packed q, k, v of ``qkv``: FA4 runs its packed ops (dq, dk, dv come
    back packed; with ``FA4_PACKED_ENV`` = "0" on contiguous copies), any other module the (b, h, s, d)
    views of the slices."""
    if isinstance(inner, FA4Attention) and os.environ.get(FA4_PACKED_ENV, "1") == "0":
        q, k, v = (t.contiguous().transpose(1, 2) for t in split_packed(qkv, seqlen, n_heads, n_kv_heads))
        return inner(q, k, v, enable_gqa=enable_gqa).transpose(1, 2).reshape(qkv.shape[0], -1)
    if isinstance(inner, FA4Attention):
        _check_gqa(n_heads, n_kv_heads, enable_gqa)
        d = qkv.shape[1] // (n_heads + 2 * n_kv_heads)
        out, _ = flash_attn_packed_fwd(qkv, seqlen, n_heads, n_kv_heads, 1.0 / math.sqrt(d), True)
    else:
        q, k, v = (t.transpose(1, 2) for t in split_packed(qkv, seqlen, n_heads, n_kv_heads))
        out = inner(q, k, v, enable_gqa=enable_gqa).transpose(1, 2)  # (b, s, h, d)
    return out.reshape(qkv.shape[0], -1)


class FA4Converter:
    """TorchTitan model converter ``"fa4"``: every ``attention.inner_attention`` becomes FA4."""

    def __init__(self, job_config, parallel_dims):
        reason = fa4_unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"model.converters lists {NAME!r} but {reason}; remove it to use SDPA")
        if parallel_dims.cp_enabled:
            raise RuntimeError(f"model.converters {NAME!r} does not support context parallelism")

    def convert(self, model: nn.Module) -> None:
        swapped = swap_attention(model)
        if swapped == 0:
            raise RuntimeError(f"model.converters {NAME!r}: the model has no SDPA attention to replace")

    def post_optimizer_hook(self, model) -> None:
        pass


def swap_attention(model: nn.Module) -> int:
    """Replace every SDPA ``inner_attention`` with :class:`FA4Attention`; returns how many."""
    from torchtitan.models.attention import ScaledDotProductAttentionWrapper

    n = 0
    for module in model.modules():
        inner = getattr(module, "inner_attention", None)
        if isinstance(inner, ScaledDotProductAttentionWrapper):
            module.inner_attention = FA4Attention()
            n += 1
    return n


def register() -> None:
    from torchtitan.protocols.model_converter import _registry_model_converter_cls, register_model_converter

    if NAME not in _registry_model_converter_cls:
        register_model_converter(FA4Converter, NAME)
