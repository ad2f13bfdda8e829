"""CODA programs behind one interface, with two backends.

One module per program family holds the family's math (its docstring), the torch reference of
every precision (keyword-only functions), and its ``torch.ops.coda`` custom ops with their fakes:

    rms_partial        prologue H, S (+ e4m3 H) and the finalize r = rsqrt(sum S / d + eps)
    residual_rms       F1: GEMM + residual + partial RMS (+ e4m3 H)
    norm_swiglu        F2 (GEMM + rstd + SwiGLU) and B3 (GEMM + SwiGLU bwd + zdz), bf16 and fp8
    norm_rope          F3 (GEMM + rstd + RoPE) and B1 (RoPE bwd + zdz), bf16 and fp8
    norm_residual_bwd  B2: dgrad GEMM + norm/residual backward + dgamma, bf16 and fp8
    lm_head_ce         F4: chunked LM head + cross-entropy with its gradient, bf16 and fp8
    gemm               wgrad / dgrad, the fp8 weight pass, the fp8 weight gradient
    casts              the fp8 casts of activations (delayed scale) and gradients (current, power of two)
    scaling            fp8 formats and scale math

``cute/`` holds the CUDA kernels of the same ops, in files of the same names.

A ``Backend`` is one frozen record with one field per program. ``TORCH`` calls the references
directly (any device; fp64 for the exactness tests). ``get_backend("cute")`` registers the fused
SM90 kernels and returns the programs through the custom ops (``op_backend``): one opaque node per
program under ``torch.compile``, the reference wherever the op has no kernel (the CPU).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import Callable

from . import casts, gemm, lm_head_ce, norm_residual_bwd, norm_rope, norm_swiglu, residual_rms, rms_partial

__all__ = ["Backend", "BackendUnavailable", "TORCH", "TRACEABLE", "cute_unavailable_reason", "get_backend", "op_backend",
           "resolve_backend"]

BACKENDS = ("torch", "cute")


class BackendUnavailable(RuntimeError):
    """The requested backend cannot run here; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class Backend:
    """The programs the model calls, each keyword-only with the signature of its reference."""

    name: str
    # forward
    rms_partial: Callable  # prologue: H, S
    rstd_finalize: Callable  # r = rsqrt(sum S / d + eps)
    residual_rms: Callable  # F1
    norm_swiglu: Callable  # F2
    norm_rope: Callable  # F3
    lm_head_ce: Callable  # F4 (+ its gradient)
    lm_head_ce_fp8: Callable  # F4 on e4m3 H and W, its gradient on e5m2 dlogits (the fp8 LM head)
    # backward
    rope_bwd: Callable  # B1
    norm_residual_bwd: Callable  # B2
    swiglu_bwd: Callable  # B3
    wgrad: Callable
    dgrad: Callable
    # precision = "fp8"
    fp8_layer_weights: Callable  # the weight pass
    quantize_tensorwise: Callable
    fp8_weights: Callable  # the weight pass of one kind (W2)
    fp8_weight_t: Callable  # an e4m3 weight's transpose, made in the backward (fp8_weight_t_bwd)
    quantize_delayed: Callable  # an activation to e4m3 with its delayed scale (y for the down-projection)
    quantize_delayed_t: Callable  # the same with the codes' token-major copy (o for dW_o, fp8_out_bwd)
    rms_partial_fp8: Callable
    residual_rms_fp8: Callable
    residual_rms_q: Callable  # F1 with an fp8 mainloop (fp8_down_proj / fp8_out_proj, no e4m3 H after it)
    residual_rms_q_fp8: Callable
    residual_rms_q_fp8_t: Callable  # the same also writing Hq^T, not H (fp8_mlp_h_t, fp8_qkv_wgrad)
    norm_swiglu_fp8: Callable
    norm_swiglu_q_fp8: Callable  # F2 writing e4m3 y and amax |y| (fp8_down_proj after calibration)
    norm_rope_fp8: Callable
    rope_bwd_fp8: Callable
    norm_residual_bwd_fp8: Callable
    swiglu_bwd_fp8: Callable
    swiglu_bwd_q_fp8: Callable  # B3 on an fp8 GEMM (fp8_down_dgrad)
    swiglu_bwd_e5m2: Callable  # B3 writing da as e5m2 only (fp8_mlp_dgrad with fp8_mlp_wgrad)
    swiglu_bwd_e5m2_t: Callable  # the same also writing da^T (fp8_mlp_da_t)
    swiglu_bwd_e5m2_t_q: Callable  # that B3 on an fp8 GEMM (fp8_down_dgrad with fp8_mlp_da_t)
    norm_swiglu_qa_fp8: Callable  # F2 saving a as e4m3 codes (fp8_preact)
    swiglu_bwd_e5m2_t_qa: Callable  # swiglu_bwd_e5m2_t_q on those codes (fp8_preact)
    quantize_grad: Callable  # a gradient to e5m2, current power-of-two scale
    quantize_grad_t: Callable  # the same with the codes' token-major copy (a weight gradient's operand)
    wgrad_fp8: Callable
    wgrad_fp8_e5m2: Callable  # dW13 on B3's e5m2 da
    wgrad_fp8_e4m3: Callable  # dW2 on B3's e4m3 y (fp8_down_wgrad)
    wgrad_fp8_q: Callable  # dW13 on B3's e5m2 da and F1's e4m3 H^T (fp8_mlp_h_t)
    dgrad_fp8_q: Callable  # the W_o dgrad on an e5m2 gradient and the e4m3 W_o^T (fp8_out_bwd)


PROGRAMS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Backend) if f.name != "name")
# The programs with no epilogue of their own: plain torch code on every backend, which a compiled
# caller traces into its graph instead of calling their op (``op_backend(traced=...)``; the cute
# backend's ``TRACED``).
TRACEABLE: tuple[str, ...] = ("rstd_finalize", "rope_bwd", "rope_bwd_fp8", "wgrad", "dgrad", "wgrad_fp8",
                               "wgrad_fp8_e5m2", "wgrad_fp8_e4m3", "wgrad_fp8_q", "dgrad_fp8_q", "quantize_delayed",
                               "quantize_delayed_t", "quantize_grad", "quantize_grad_t")

TORCH = Backend(
    name="torch",
    rms_partial=rms_partial.rms_partial,
    rstd_finalize=rms_partial.rstd_finalize,
    residual_rms=residual_rms.residual_rms,
    norm_swiglu=norm_swiglu.norm_swiglu,
    norm_rope=norm_rope.norm_rope,
    lm_head_ce=lm_head_ce.lm_head_ce,
    lm_head_ce_fp8=lm_head_ce.lm_head_ce_fp8,
    rope_bwd=norm_rope.rope_bwd,
    norm_residual_bwd=norm_residual_bwd.norm_residual_bwd,
    swiglu_bwd=norm_swiglu.swiglu_bwd,
    wgrad=gemm.wgrad,
    dgrad=gemm.dgrad,
    fp8_layer_weights=gemm.fp8_layer_weights,
    quantize_tensorwise=gemm.quantize_tensorwise,
    fp8_weights=gemm.fp8_weights,
    fp8_weight_t=gemm.fp8_weight_t,
    quantize_delayed=casts.quantize_delayed,
    quantize_delayed_t=casts.quantize_delayed_t,
    rms_partial_fp8=rms_partial.rms_partial_fp8,
    residual_rms_fp8=residual_rms.residual_rms_fp8,
    residual_rms_q=residual_rms.residual_rms_q,
    residual_rms_q_fp8=residual_rms.residual_rms_q_fp8,
    residual_rms_q_fp8_t=residual_rms.residual_rms_q_fp8_t,
    norm_swiglu_fp8=norm_swiglu.norm_swiglu_fp8,
    norm_swiglu_q_fp8=norm_swiglu.norm_swiglu_q_fp8,
    norm_rope_fp8=norm_rope.norm_rope_fp8,
    rope_bwd_fp8=norm_rope.rope_bwd_fp8,
    norm_residual_bwd_fp8=norm_residual_bwd.norm_residual_bwd_fp8,
    swiglu_bwd_fp8=norm_swiglu.swiglu_bwd_fp8,
    swiglu_bwd_q_fp8=norm_swiglu.swiglu_bwd_q_fp8,
    swiglu_bwd_e5m2=norm_swiglu.swiglu_bwd_e5m2,
    swiglu_bwd_e5m2_t=norm_swiglu.swiglu_bwd_e5m2_t,
    swiglu_bwd_e5m2_t_q=norm_swiglu.swiglu_bwd_e5m2_t_q,
    norm_swiglu_qa_fp8=norm_swiglu.norm_swiglu_qa_fp8,
    swiglu_bwd_e5m2_t_qa=norm_swiglu.swiglu_bwd_e5m2_t_qa,
    quantize_grad=casts.quantize_grad,
    quantize_grad_t=casts.quantize_grad_t,
    wgrad_fp8=gemm.wgrad_fp8,
    wgrad_fp8_e5m2=gemm.wgrad_fp8_e5m2,
    wgrad_fp8_e4m3=gemm.wgrad_fp8_e4m3,
    wgrad_fp8_q=gemm.wgrad_fp8_q,
    dgrad_fp8_q=gemm.dgrad_fp8_q,
)


def op_backend(name: str = "ops", traced: dict[str, Callable] | None = None) -> Backend:
    """The programs through the ``torch.ops.coda`` custom ops (called with keywords). ``traced`` maps
    a program to plain torch code that ``torch.compile`` traces into the caller's graph in place of
    the op (eager calls still take the op)."""
    be = Backend(
        name=name,
        rms_partial=rms_partial.rms_partial_op,
        rstd_finalize=rms_partial.rstd_finalize_op,
        residual_rms=residual_rms.residual_rms_op,
        norm_swiglu=norm_swiglu.norm_swiglu_op,
        norm_rope=norm_rope.norm_rope_op,
        lm_head_ce=lm_head_ce.lm_head_ce_program,
        lm_head_ce_fp8=lm_head_ce.lm_head_ce_fp8_program,
        rope_bwd=norm_rope.rope_bwd_op,
        norm_residual_bwd=norm_residual_bwd.norm_residual_bwd_op,
        swiglu_bwd=norm_swiglu.swiglu_bwd_op,
        wgrad=gemm.wgrad_op,
        dgrad=gemm.dgrad_op,
        fp8_layer_weights=gemm.fp8_layer_weights_op,
        quantize_tensorwise=gemm.quantize_tensorwise_op,
        fp8_weights=gemm.fp8_weights_op,
        fp8_weight_t=gemm.fp8_weight_t_op,
        quantize_delayed=casts.quantize_delayed_op,
        quantize_delayed_t=casts.quantize_delayed_t_op,
        rms_partial_fp8=rms_partial.rms_partial_fp8_op,
        residual_rms_fp8=residual_rms.residual_rms_fp8_op,
        residual_rms_q=residual_rms.residual_rms_q_op,
        residual_rms_q_fp8=residual_rms.residual_rms_q_fp8_op,
        residual_rms_q_fp8_t=residual_rms.residual_rms_q_fp8_t_op,
        norm_swiglu_fp8=norm_swiglu.norm_swiglu_fp8_op,
        norm_swiglu_q_fp8=norm_swiglu.norm_swiglu_q_fp8_op,
        norm_rope_fp8=norm_rope.norm_rope_fp8_op,
        rope_bwd_fp8=norm_rope.rope_bwd_fp8_op,
        norm_residual_bwd_fp8=norm_residual_bwd.norm_residual_bwd_fp8_op,
        swiglu_bwd_fp8=norm_swiglu.swiglu_bwd_fp8_op,
        swiglu_bwd_q_fp8=norm_swiglu.swiglu_bwd_q_fp8_op,
        swiglu_bwd_e5m2=norm_swiglu.swiglu_bwd_e5m2_op,
        swiglu_bwd_e5m2_t=norm_swiglu.swiglu_bwd_e5m2_t_op,
        swiglu_bwd_e5m2_t_q=norm_swiglu.swiglu_bwd_e5m2_t_q_op,
        norm_swiglu_qa_fp8=norm_swiglu.norm_swiglu_qa_fp8_op,
        swiglu_bwd_e5m2_t_qa=norm_swiglu.swiglu_bwd_e5m2_t_qa_op,
        quantize_grad=casts.quantize_grad_op,
        quantize_grad_t=casts.quantize_grad_t_op,
        wgrad_fp8=gemm.wgrad_fp8_op,
        wgrad_fp8_e5m2=gemm.wgrad_fp8_e5m2_op,
        wgrad_fp8_e4m3=gemm.wgrad_fp8_e4m3_op,
        wgrad_fp8_q=gemm.wgrad_fp8_q_op,
        dgrad_fp8_q=gemm.dgrad_fp8_q_op,
    )
    if set(traced or ()) - set(TRACEABLE):
        raise ValueError(f"only {TRACEABLE} can be traced, not {sorted(set(traced) - set(TRACEABLE))}")
    return dataclasses.replace(be, **{k: _traced_when_compiling(getattr(be, k), fn) for k, fn in (traced or {}).items()})


def _traced_when_compiling(op: Callable, code: Callable) -> Callable:
    import torch

    def program(**kwargs):
        return code(**kwargs) if torch.compiler.is_compiling() else op(**kwargs)

    program.__name__ = program.__qualname__ = getattr(code, "__name__", "program")
    return program


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


_cute: dict[bool, Backend] = {}
# the base of B2's and the bf16 B3's epilogue C-load stages the cute kernels compile with (``cute/stages.py``;
# ``[coda] b2_c_stages``); B3_C_STAGES_ENV, where set, is B3's alone ("0": quack's own epilogue and base)
EPI_C_STAGES_ENV = "CODA_TITAN_EPI_C_STAGES"
B3_C_STAGES_ENV = "CODA_TITAN_B3_C_STAGES"


def requested_c_stage_base(program: str = "b2") -> int | None:
    """The C-stage base ``EPI_C_STAGES_ENV`` asks for (an integer >= 1), or None for quack's own; anything else
    is an error. ``program`` "b3": ``B3_C_STAGES_ENV`` first where it is set ("0": quack's own)."""
    own = program == "b3" and os.environ.get(B3_C_STAGES_ENV, "") != ""
    name = B3_C_STAGES_ENV if own else EPI_C_STAGES_ENV
    raw = os.environ.get(name)
    if raw is None or raw == "" or (own and raw == "0"):
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{name} must be an integer >= 1 (quack's own base is 4{'; 0 for it' if own else ''}), got {raw!r}")
    return int(raw)


# the cute backend's programs to run as their torch references instead (comma-separated program names): a
# precision bisection's switch (``scripts/probes/bf16_step_accuracy.py``'s ``coda_eager_ref_*`` arms), read when a
# model builds its backend
REFERENCE_ENV = "CODA_TITAN_REFERENCE_PROGRAMS"


def with_reference_programs(be: Backend, names: str) -> Backend:
    """``be`` with the programs named in ``names`` (comma-separated, ``REFERENCE_ENV``'s form) as the torch
    reference's: the same math at the same rounding points, in plain torch (fp32 sums)."""
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = sorted(set(wanted) - set(PROGRAMS))
    if unknown:
        raise ValueError(f"{REFERENCE_ENV}: unknown program(s) {unknown}; the programs are {', '.join(PROGRAMS)}")
    if not wanted:
        return be
    return dataclasses.replace(be, name=f"{be.name}+reference:{','.join(wanted)}",
                               **{n: getattr(TORCH, n) for n in wanted})


def get_backend(name: str, traced: bool = True) -> Backend:
    """The programs of backend ``name`` ('torch' or 'cute'; use ``resolve_backend`` for 'auto').
    ``traced``: the cute backend's TRACEABLE programs are traced into a compiled caller's graph
    (``[coda] trace_passes``); the torch backend is plain torch code either way."""
    if name == "torch":
        return TORCH
    if name != "cute":
        raise BackendUnavailable(f"unknown backend {name!r}; choose from {BACKENDS}")
    if traced not in _cute:
        reason = cute_unavailable_reason()
        if reason is not None:
            raise BackendUnavailable(f"cute backend unavailable: {reason}")
        from . import cute  # (registers the CUDA kernels of the ops)

        _cute[traced] = op_backend("cute", traced=cute.TRACED if traced else None)
    return with_reference_programs(_cute[traced], os.environ.get(REFERENCE_ENV, ""))
