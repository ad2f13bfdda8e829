"""Plumbing shared by the CUDA kernels: eligibility, the warn-once fallback to the reference, the
first-call log, quack's GEMM call, inductor-fused elementwise passes and small constant caches."""

from __future__ import annotations

import logging
import os
import time

import torch

from ..scaling import E4M3

logger = logging.getLogger("coda_titan")

TUNE = os.environ.get("CODA_TITAN_AUTOTUNE", "1") != "0"
KERNEL_DTYPES = (torch.bfloat16, torch.float16)

_warned: set[tuple[str, str]] = set()
_seen: set[tuple] = set()
CALIBRATION = "a current-amax scale (the calibration step)"  # (a delayed fp8 site's first step: no history yet)


def fallback(op, why: str, *args):
    """Run ``op``'s reference on ``args``, warning once per program and reason.

    A fallback of the calibration step (``CALIBRATION``: a delayed fp8 site without history, the first
    step of a run) then gives the allocator's free cached blocks back to the device. The references
    there run their GEMMs to float32 (1 GiB temporaries at the 1B MLP's shapes), in a step that
    keeps every layer's pre-activations in bf16; without it the caching allocator kept 2.9 GiB more
    reserved after that step than any later step needs, and that first step set the run's reserved
    peak (28.18 GiB on the 1B fp8 config on an H100, against 25.3 in every later step:
    ``gpu_train.sh memsnap``, docs/fp8.md). One ``empty_cache`` per fallback, in that step only."""
    name = op.reference.__name__.removesuffix("_op")
    if (name, why) not in _warned:
        _warned.add((name, why))
        logger.warning(f"coda_titan: cute {name} cannot take {why}; running the torch reference for it")
    out = op.reference(*args)
    if why == CALIBRATION and torch.cuda.is_available() and not torch.cuda.is_current_stream_capturing():
        torch.cuda.empty_cache()
    return out


def unsupported(*tensors: torch.Tensor) -> str | None:
    """Why the bf16 kernels cannot take these tensors, or None."""
    for t in tensors:
        if not t.is_cuda:
            return f"a {t.device} tensor"
        if t.dtype not in KERNEL_DTYPES:
            return f"dtype {t.dtype}"
        if t.dim() != 2 or t.stride(-1) != 1 or t.shape[-1] % 8 or (t.shape[0] > 1 and t.stride(0) % 8):
            return f"shape {tuple(t.shape)} / stride {t.stride()} (need 2-D, contiguous rows, width % 8 == 0)"
        if t.shape[0] == 0:
            return "an empty tensor"
    return None


def unsupported_fp8(*tensors: torch.Tensor, dtypes=(E4M3,)) -> str | None:
    """Why the fp8 kernels cannot take these 8-bit operands, or None."""
    for t in tensors:
        if not t.is_cuda:
            return f"a {t.device} tensor"
        if t.dtype not in dtypes:
            return f"dtype {t.dtype} (need {' or '.join(str(d) for d in dtypes)})"
        if t.dim() != 2 or not t.is_contiguous() or t.shape[-1] % 16 or t.shape[0] == 0:
            return f"shape {tuple(t.shape)} / stride {t.stride()} (need 2-D, contiguous, width % 16 == 0)"
    return None


class first_call:
    """Logs the wall time of the first call of a program for a shape (compile + autotune), then gives
    the autotune sweep's memory back to the device.

    quack's sweep benchmarks every candidate on 4 to 16 clones of the call's tensors (L2-cold inputs,
    up to half the free memory), inside the training step. PyTorch's caching allocator keeps those
    blocks reserved after they are freed, so without ``empty_cache`` a process that tuned holds them
    for the rest of the run: more reserved memory (what TorchTitan logs as ``memory``) and less for
    everyone else on the device, though nothing live uses it."""

    def __init__(self, name: str, *tensors: torch.Tensor):
        self.key = (name, *((tuple(t.shape), t.dtype) for t in tensors))
        self.first = self.key not in _seen

    def __enter__(self):
        if self.first:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.first and exc[0] is None:
            torch.cuda.synchronize()
            _seen.add(self.key)
            if TUNE and not torch.cuda.is_current_stream_capturing():
                torch.cuda.empty_cache()
            logger.info(
                f"coda_titan: cute {self.key[0]} {[s for s, _ in self.key[1:]]} ready in "
                f"{time.perf_counter() - self.t0:.1f} s (first call: compile{' + autotune' if TUNE else ''})"
            )
        return False


def gemm(mod, a, b_kn, c, out, **operands):
    """quack's eager epilogue GEMM: a (M, K) @ b_kn (K, N) [+ c] into ``out``, autotuned unless disabled."""
    return mod(a, b_kn, c, out=out, tuned=TUNE, **operands)


def scalar32(t: torch.Tensor) -> torch.Tensor:
    """A 0-dim scale as the (1,) fp32 tensor a ``Scalar`` epilogue operand reads."""
    return t.to(torch.float32).reshape(1).contiguous()


_compiled: dict[str, object] = {}


def fused(name: str, fn):
    """``fn`` compiled by inductor into fused kernels (one per shape); eager if compiling fails."""
    if name not in _compiled:
        try:
            _compiled[name] = torch.compile(fn, dynamic=False, fullgraph=True)
        except Exception as e:  # noqa: BLE001 - any compiler failure means: run eager, say so once
            logger.warning(f"coda_titan: could not compile {name} ({e}); running it eagerly")
            _compiled[name] = fn
    return _compiled[name]


_tables: dict[tuple, torch.Tensor] = {}


def cached(key: tuple, make):
    """A small constant tensor (RoPE tables, positions) kept per key; the cache is bounded."""
    t = _tables.get(key)
    if t is None:
        if len(_tables) > 64:
            _tables.clear()
        t = _tables[key] = make()
    return t
