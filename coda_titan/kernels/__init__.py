"""CODA programs behind one interface, with two backends.

Each program lives in its own module and has one keyword-only signature. ``torch`` is the exact
reparameterized math in plain PyTorch (any device; the reference). ``cute`` is the fused SM90
GEMM-epilogue kernels (quack / CuTeDSL, the ``gpu`` extra), reached through the ``torch.ops.coda``
custom ops of ``coda_titan.kernels.ops``. ``get_backend(name)`` returns a
``Backend`` whose attributes are the programs; the model only ever calls programs through it.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from typing import Callable

__all__ = ["Backend", "BackendUnavailable", "PROGRAMS", "cute_unavailable_reason", "get_backend", "resolve_backend"]

# program name -> module that defines ``<name>_<backend>``
PROGRAMS: dict[str, str] = {
    # forward
    "rms_partial": "rms_partial",  # embedding-norm prologue (no GEMM)
    "residual_rms": "residual_rms",  # F1: GEMM + residual + partial RMS
    "rstd_finalize": "rstd_finalize",  # finalize: r = rsqrt(sum S / d + eps)
    "norm_swiglu": "norm_swiglu",  # F2: GEMM + deferred rstd + SwiGLU
    "norm_rope": "norm_rope",  # F3: GEMM + deferred rstd + RoPE
    "lm_head_ce": "lm_head_ce",  # F4: chunked LM head + CE (+ its gradient)
    # backward
    "rope_bwd": "norm_rope",  # B1: RoPE bwd + zdz
    "norm_residual_bwd": "norm_residual_bwd",  # B2: GEMM + norm/residual bwd + dgamma
    "swiglu_bwd": "norm_swiglu",  # B3: GEMM + SwiGLU bwd + zdz
    "wgrad": "wgrad",  # dW GEMMs (row-scale folding)
    "dgrad": "wgrad",  # plain dX GEMM
    # FP8 ([coda] precision = "fp8"; the other backward programs are the ones above)
    "quantize_tensorwise": "fp8",  # weight -> e4m3 + scale
    "fp8_layer_weights": "fp8",  # every layer's W13 and W_qkv -> e4m3 + scales, once per forward
    "rms_partial_fp8": "fp8",  # prologue + e4m3 H
    "residual_rms_fp8": "fp8",  # F1 + e4m3 H for the next consumer
    "norm_swiglu_fp8": "fp8",  # F2 on e4m3 operands
    "norm_rope_fp8": "fp8",  # F3 on e4m3 operands
    "rope_bwd_fp8": "fp8",  # B1 + e5m2 da
    "norm_residual_bwd_fp8": "fp8",  # B2 on e5m2 da and e4m3 W^T
    "swiglu_bwd_fp8": "fp8",  # B3 + e5m2 da (delayed scale) and amax |da|
    "wgrad_fp8": "fp8",  # dW on an e5m2 gradient and e4m3 input (token-major copies in the kernel)
}

BACKENDS = ("torch", "cute")


class BackendUnavailable(RuntimeError):
    """The requested backend cannot run here; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class Backend:
    name: str
    programs: dict[str, Callable]

    def __getattr__(self, item: str) -> Callable:
        try:
            return self.programs[item]
        except KeyError:
            raise AttributeError(f"backend {self.name!r} has no program {item!r}") from None


def cute_unavailable_reason() -> str | None:
    """None when the fused kernels can run here, else why not (one line, user-facing)."""
    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU is visible"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        return f"the fused kernels need an sm90 GPU (H100/H200), this one is sm{major}{minor}"
    for mod in ("cutlass", "quack"):
        if importlib.util.find_spec(mod) is None:
            return f"the 'gpu' extra is not installed (no module {mod!r}): pip install 'coda-titan[gpu]'"
    if importlib.util.find_spec("coda_titan.kernels.cute") is None:
        return "this coda_titan build has no cute kernels yet"
    return None


def resolve_backend(requested: str) -> str:
    """Map ``auto`` / ``torch`` / ``cute`` to the backend that will run, or raise BackendUnavailable."""
    if requested not in ("auto", *BACKENDS):
        raise BackendUnavailable(f"[coda] backend must be one of 'auto', 'torch', 'cute'; got {requested!r}")
    if requested == "torch":
        return "torch"
    reason = cute_unavailable_reason()
    if requested == "cute" and reason is not None:
        raise BackendUnavailable(
            f"[coda] backend = 'cute' cannot run here: {reason}. "
            "Set [coda] backend = 'auto' (or 'torch') to use the reference backend."
        )
    return "cute" if reason is None else "torch"


_cache: dict[str, Backend] = {}


def get_backend(name: str) -> Backend:
    """The programs of backend ``name`` ('torch' or 'cute'; use ``resolve_backend`` for 'auto')."""
    if name not in BACKENDS:
        raise BackendUnavailable(f"unknown backend {name!r}; choose from {BACKENDS}")
    if name not in _cache:
        if name == "cute":
            reason = cute_unavailable_reason()
            if reason is not None:
                raise BackendUnavailable(f"cute backend unavailable: {reason}")
        programs = {}
        for prog, module in PROGRAMS.items():
            # torch: one module per program; cute: the package registers every kernel at import
            mod = importlib.import_module(f"{__name__}.{module}" if name == "torch" else f"{__name__}.cute")
            programs[prog] = getattr(mod, f"{prog}_{name}")
        _cache[name] = Backend(name, programs)
    return _cache[name]
