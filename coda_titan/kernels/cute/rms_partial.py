"""CUDA kernels of the prologue and the finalize (``coda_titan.kernels.rms_partial``).

rms_partial       H = X * gamma and sum X^2 once per step (torch ops: no GEMM to fuse with)
rms_partial_fp8   the same plus e4m3 H and amax |H|, as one inductor-fused pass
rstd_finalize     ``quack.rms_final_reduce`` (CuTeDSL): r = rsqrt(sum S / d + eps); traced by a compiled caller
                  (``rstd_finalize_traced``): the same arithmetic, fused by inductor into the caller's graph
"""

from __future__ import annotations

import torch
from quack.rms_final_reduce import rms_final_reduce

from .. import rms_partial as ref
from ._dispatch import fallback, fused


@torch.library.register_kernel("coda::rms_partial", "cuda")
def _rms_partial(x, gamma, tile_n):
    xf = x.float()
    h = (xf * gamma.float()).to(x.dtype)
    return h, (xf * xf).sum(-1, keepdim=True)


@torch.library.register_kernel("coda::rms_partial_fp8", "cuda")
def _rms_partial_fp8(x, gamma, tile_n, inv_scale):
    h, s, hq, amax = fused(f"rms_partial_fp8_{tile_n}_{inv_scale is None}", lambda x_, g_, i_: ref.rms_partial_fp8(
        x=x_, gamma=g_, tile_n=tile_n, inv_scale=i_))(x, gamma, inv_scale)
    return h, s.sum(-1, keepdim=True), hq, amax


def _finalize_unsupported(partials) -> bool:
    """quack's finalize takes contiguous fp32 partials only (the op falls back to its reference for others)."""
    return partials.dtype != torch.float32 or not partials.is_contiguous()


@torch.library.register_kernel("coda::rstd_finalize", "cuda")
def _rstd_finalize(partials, dim, eps):
    if _finalize_unsupported(partials):
        return fallback(ref.rstd_finalize_op, f"partials of dtype {partials.dtype}", partials, dim, eps)
    return rms_final_reduce(partials, 1.0 / dim, eps)


def rstd_finalize_traced(*, partials, dim, eps):
    """``coda::rstd_finalize`` as code a compiled caller traces (``TRACED``): quack's arithmetic, r = rsqrt(sum S *
    s + eps) with s the fp32 1 / d, in fp32, which inductor fuses into the block's graph. The op launches quack's
    CuTeDSL kernel behind two custom ops (its own and quack's), 32 calls a forward, in a forward the host bounds
    (``probe_host_slack_…json``; what one custom-op layer costs there: ``probe_op_layers_…json``)."""
    if _finalize_unsupported(partials):
        return ref.rstd_finalize_op(partials, dim, eps)  # (the op says why, once)
    return torch.rsqrt(partials.sum(-1) * (1.0 / dim) + eps)
