"""The ``cute`` backend: CODA's programs as fused SM90 kernels (quack / CuTeDSL, the ``gpu`` extra).

Importing this package registers the kernels as the CUDA implementations of the ``torch.ops.coda``
custom ops; each file holds the kernels of the program module of the same name in
``coda_titan.kernels``. ``_dispatch`` has the shared plumbing (eligibility, the warn-once fallback
to the reference for inputs a kernel cannot take, caches), ``epilogues`` our own
``@gemm_epilogue`` functions, ``patches`` what we change in quack. Only import it on an sm90 GPU
with the extra installed; ``coda_titan.kernels.get_backend('cute')`` checks that first.

Caches (on disk, so a training start does not re-tune what was tuned before):

* quack's autotuning winners live under ``$QUACK_CACHE_DIR``. Unless the user set it, it defaults to
  ``$CODA_TITAN_CACHE/quack/<gpu name>`` (``~/.cache/coda_titan`` by default): one directory per GPU
  model, keyed inside by shape and dtype. The compiled kernels live one folder deeper, named by a digest
  of ``coda_titan.kernels``' sources (``kernel_cache.pin``): quack's own compile key misses changes to
  our classes and to an installed package's epilogues.
* ``CODA_TITAN_AUTOTUNE=0`` skips the sweep and uses quack's default tile configuration.

``TRACED``: the programs without an epilogue of their own (the rstd finalize, B1's pass, the plain and
the fp8 weight and input gradients, the delayed e4m3 cast of an F1 input, the e5m2 casts of the residual stream's
gradients) as plain torch code or ``triton_op``s. Under
``torch.compile`` the model traces them into its graph, where inductor fuses them with their
neighbours, instead of calling their op: an opaque op
whose body calls a compiled pass of its own costs 0.2-0.5 ms of host time per call (guards, wrappers,
launches; ``scripts/probes/host_profile.py``), and the GPU waits for it. ``[coda] trace_passes =
false`` keeps them opaque (the A/B of ``gpu_train.sh tracepasses``).
"""

from __future__ import annotations

import os

from .. import kernel_cache


# quack reads QUACK_CACHE_DIR when it is first imported: set it before anything imports quack.
# (Only when unset: quack's forked compile workers import this module again and inherit the
# variable, and they must not touch CUDA to name the GPU.)
if not os.environ.get("QUACK_CACHE_DIR"):
    os.environ["QUACK_CACHE_DIR"] = kernel_cache.cache_root()

import quack.cache  # noqa: E402

kernel_cache.pin(quack.cache)  # (before any kernel compiles; a compile worker takes the folder from its job)

from . import patches  # noqa: E402,F401  (before any fp8 GEMM is built)
from . import overlap, stages  # noqa: E402

overlap.install()  # (inert unless a call asks for overlapped epilogues: overlap.requested())
stages.install()  # (after overlap's: inert unless a call asks for a C-stage base, stages.capped())
from . import casts, gemm, lm_head_ce, norm_residual_bwd, norm_rope, norm_swiglu, residual_rms, rms_partial  # noqa: E402,F401
from .._common import lean_kernels  # noqa: E402

LEAN = lean_kernels("coda", "cuda", "coda_titan.kernels")  # (after every module above registered its kernels)

TRACED = {
    "rstd_finalize": rms_partial.rstd_finalize_traced,
    "rope_bwd": norm_rope.rope_bwd_traced,
    "rope_bwd_fp8": norm_rope.rope_bwd_fp8_traced,
    "wgrad": gemm.wgrad_traced,
    "dgrad": gemm.dgrad_traced,
    "wgrad_fp8": gemm.wgrad_fp8_traced,
    "wgrad_fp8_e5m2": gemm.wgrad_fp8_e5m2_traced,
    "wgrad_fp8_e4m3": gemm.wgrad_fp8_e4m3_traced,
    "wgrad_fp8_q": gemm.wgrad_fp8_q_traced,
    "dgrad_fp8_q": gemm.dgrad_fp8_q_traced,
    "quantize_delayed": casts.quantize_delayed_traced,
    "quantize_delayed_t": casts.quantize_delayed_t_traced,
    "quantize_grad": casts.quantize_grad_traced,
    "quantize_grad_t": casts.quantize_grad_t_traced,
}
