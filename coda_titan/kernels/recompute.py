"""Full activation checkpointing without the block's last GEMM in its recompute.

A checkpointed block keeps its inputs and reruns its forward in the backward to remake what its
programs saved. The MLP's Function saves what F2 made (and its inputs); its F1, the down-projection
GEMM with the residual add and the next norm's partial sums, saves nothing, and what it returns (the
block's outputs) the recompute drops. Stock TorchTitan under compile skips that GEMM: its partitioner
recomputes only what the backward reads (one forward GEMM a layer fewer than CODA's recompute ran in
the 8B profiles of 2026-11-26). CODA wraps each *compiled* block in the checkpoint
(``titan/parallelize.py``), so the whole compiled forward reran, F1 included: 32 x 1.36 ms of 8B's
bf16 step.

The decision is made where the GEMM runs, not where the graph is traced: a second graph for the
recompute (a compile guard on a flag) saved a different set of tensors than the forward's graph, which
the checkpoint refuses. So ``install`` gives each full-AC checkpoint wrapper a ``context_fn`` whose
recompute context sets ``RECOMPUTING`` and counts F1 calls; the F1 programs' kernels (``skip_tail``)
return their op's fake outputs, allocated and not computed, for the block's second F1 call in a
recompute (the MLP's: a block runs the out-projection's F1, then F2, then the down-projection's F1,
each reading the one before): the CUDA kernels and the ops' CPU kernels alike. The reference backend
(plain functions, no ops) runs F1 as before.
``CODA_TITAN_AC_TAIL=recompute`` keeps the old recompute (for an A/B).
"""

from __future__ import annotations

import contextlib
import functools
import os

ENV = "CODA_TITAN_AC_TAIL"
TAIL = 2  # the block's F1 calls in a recompute: 1 the out-projection's, 2 the down-projection's
RECOMPUTING = False
_F1_CALLS = 0


def take_tail() -> bool:
    """Called by each F1 kernel: True for the block's down-projection F1 inside a recompute (skip it)."""
    global _F1_CALLS
    if not RECOMPUTING:
        return False
    _F1_CALLS += 1
    return _F1_CALLS == TAIL


@contextlib.contextmanager
def _recompute():
    global RECOMPUTING, _F1_CALLS
    before = RECOMPUTING, _F1_CALLS
    RECOMPUTING, _F1_CALLS = True, 0
    try:
        yield
    finally:
        RECOMPUTING, _F1_CALLS = before


def contexts():
    """``torch.utils.checkpoint``'s ``context_fn``: nothing around the forward, the count around its recompute."""
    return contextlib.nullcontext(), _recompute()


def skip_tail(op):
    """Decorator of an F1 kernel of the custom op ``op``: where ``take_tail()``, ``op``'s fake outputs
    (real tensors of the right shapes and dtypes, uninitialized) instead of the program."""
    def wrap(kernel):
        @functools.wraps(kernel)
        def run(*args, **kwargs):
            fake = getattr(op, "_abstract_fn", None)  # (torch.library's registered fake; none: nothing is skipped)
            if fake is not None and take_tail():
                return fake(*args, **kwargs)
            return kernel(*args, **kwargs)

        return run

    return wrap


def install(layers) -> int:
    """Give every non-reentrant checkpoint wrapper among ``layers``' children (TorchTitan's full AC)
    the recompute context; returns how many it changed (0 under ``CODA_TITAN_AC_TAIL=recompute``)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, CheckpointWrapper

    value = os.environ.get(ENV, "skip")
    if value not in ("skip", "recompute"):
        raise ValueError(f"{ENV} must be 'skip' (the default) or 'recompute', got {value!r}")
    if value == "recompute":
        return 0
    n = 0
    for block in layers.children():
        if isinstance(block, CheckpointWrapper) and block.checkpoint_impl == CheckpointImpl.NO_REENTRANT:
            block.checkpoint_fn = functools.partial(block.checkpoint_fn, context_fn=contexts)
            n += 1
    return n
