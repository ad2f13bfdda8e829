"""Shared helpers of the program modules.

Precision contract, mirrored by the fused kernels: GEMM operands stay in their storage dtype, the
accumulator and every epilogue value are fp32 (fp64 when the operands are fp64, which is how the
CPU tests prove the algebra exact), and outputs are rounded once, to the storage dtype, on store.

``program_op`` turns a program's positional op body into the custom op ``torch.ops.coda.<name>``:
one schema per program, its default kernel the torch reference (any device), so a compiled graph
holds one opaque node per program. The ``cute`` backend registers the CUDA kernel of the same op.
"""

from __future__ import annotations

import torch


def program_op(name: str):
    """Decorator: register ``fn`` (positional, type-annotated) as the custom op ``coda::<name>``.

    ``fn`` is the op's default kernel (the reference, on every device). It stays reachable as
    ``op.reference``: the CUDA kernels call it for inputs they cannot take. Give the op its fake
    with ``@op.register_fake``.
    """

    def wrap(fn):
        op = torch.library.custom_op(f"coda::{name}", fn, mutates_args=())
        op.reference = fn
        return op

    return wrap


LEAN_ENV = "CODA_TITAN_LEAN_OPS"  # "0": the device kernels behind torch's custom-op checks again (the A/B's other arm)
_LEAN_LIBS: dict[str, torch.library.Library] = {}


def lean_kernels(namespace: str, device: str, module: str = "") -> list[str]:
    """Register the ``device`` kernel of each ``namespace`` custom op whose reference is defined under ``module``
    (``register_kernel``'s, which the op keeps in ``_backend_fns``) straight at the device's dispatch key, in
    place of torch's wrapper around it, which checks on every call that no output aliases an input (our
    kernels return fresh tensors; the CPU tests' ``opcheck`` of each reference checks the schema). On the GPU
    host's torch 2.11 going past it saved 17-18 us a call of F2 and F3 (``probe_op_layers_…json``), with
    about 110 calls in a forward the host bounds (``probe_host_slack_…json``). Returns the names of the ops
    re-registered (none with ``CODA_TITAN_LEAN_OPS=0``). FlashAttention's ops are left as they are: the
    baseline configs call them too."""
    import os

    from torch._library.custom_ops import OPDEFS

    if os.environ.get(LEAN_ENV, "1") == "0":
        return []
    key = torch._C._dispatch_key_for_device(device)
    if namespace not in _LEAN_LIBS:
        _LEAN_LIBS[namespace] = torch.library.Library(namespace, "IMPL")
    names = []
    for qualname, opdef in sorted(OPDEFS.items()):
        ns, name = qualname.split("::")
        if ns == namespace and device in opdef._backend_fns and opdef._init_fn.__module__.startswith(module):
            _LEAN_LIBS[namespace].impl(name, opdef._backend_fns[device], key, allow_override=True)
            names.append(name)
    return names


def acc_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """fp64 if any operand is fp64, else fp32: the dtype of accumulators and epilogue math."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` accumulated *and returned* in the accumulator dtype: the GEMM of a program as its
    epilogue sees it, never rounded to the storage dtype first (a bf16 ``a @ b`` would round the
    fp32 sum to bf16 before the epilogue, the error the fused kernels do not make).

    On CUDA, bf16/fp16 operands go through cuBLAS with an fp32 output (``out_dtype``), at tensor-core
    speed; elsewhere the operands are widened exactly and multiplied in the accumulator dtype."""
    ct = acc_dtype(a, b)
    if a.is_cuda and a.dtype == b.dtype and a.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(a, b, out_dtype=ct)
    return a.to(ct) @ b.to(ct)


def tile_sumsq(x: torch.Tensor, tile_n: int) -> torch.Tensor:
    """Per-tile partial sums of squares S[i, t] = sum_{j in tile t} x[i, j]^2.

    ``x`` is (M, d) in the accumulator dtype; the result is (M, ceil(d / tile_n)). The last tile is
    ragged when d is not a multiple of ``tile_n``: it sums only the columns that exist.
    """
    m, d = x.shape
    n_tiles = -(-d // tile_n)
    pad = n_tiles * tile_n - d
    sq = x * x
    if pad:
        sq = torch.nn.functional.pad(sq, (0, pad))
    return sq.view(m, n_tiles, tile_n).sum(-1)


def check_2d(name: str, t: torch.Tensor, cols: int | None = None) -> None:
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D (M, N), got shape {tuple(t.shape)}")
    if cols is not None and t.shape[1] != cols:
        raise ValueError(f"{name} must have {cols} columns, got shape {tuple(t.shape)}")


def interleave_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[a0, b0, a1, b1, ...] along dim 0: the paired (gate, up) layout of the SwiGLU programs.

    A GEMM epilogue sees adjacent output columns together, so F2 wants W13 with gate row j and
    up row j next to each other; the checkpoint keeps w1 and w3 separate (this is a runtime view).
    """
    if a.shape != b.shape:
        raise ValueError(f"cannot interleave {tuple(a.shape)} with {tuple(b.shape)}")
    return torch.stack([a, b], dim=1).reshape(2 * a.shape[0], *a.shape[1:])


def stacked_rows(*ts: torch.Tensor) -> torch.Tensor:
    """[t0; t1; ...] along dim 0: a view of their one buffer where each one's rows follow the one before's there
    (``model.storage``, ``[coda] stacked_weights``), else a copy (``torch.cat``). For kernels (opaque to
    ``torch.compile``), which read it and let it go."""
    a = ts[0]
    end = a.storage_offset() + a.numel()
    for b in ts[1:]:
        if not (b.shape[1:] == a.shape[1:] and b.dtype == a.dtype and b.device == a.device and b.is_contiguous()
                and a.is_contiguous() and b.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
                and b.storage_offset() == end):
            return torch.cat(ts)
        end += b.numel()
    return a.as_strided((sum(t.shape[0] for t in ts), *a.shape[1:]), a.stride())


def deinterleave_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of ``interleave_rows``: (t[0::2], t[1::2])."""
    return t[0::2], t[1::2]


def zdz_of_acc(acc: torch.Tensor, x: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """A norm's row dot zdz = sum_k acc_k X_k gamma_k from a dgrad accumulator acc = da @ W (its dtype): the zdz of
    the very gradient da that acc was made of (B2's ``zdz=None``, the LM head's ``acc`` mode, the probe's arms)."""
    return (acc * x.to(acc.dtype) * gamma.to(acc.dtype)).sum(-1)


# a precision probe's arms (``scripts/probes/bf16_step_accuracy.py``), equal in exact math: "dgrad_all", every norm's
# row dot zdz in the torch backend's B2 as sum_k acc_k X_k gamma_k from its dgrad accumulator, not the consumer's
# sum p * dp over its rounded outputs; "dgrad" / "dgrad_mlp", the attention (MLP) norm's only, by one more GEMM
# (``coda_titan.model.autograd``)
ZDZ_ENV = "CODA_TITAN_ZDZ"


ROW_BLOCK = 2048  # (rows a ``by_row_blocks`` block: of the 5 GiB of float32 temporaries B3's reference mapped
#                    at 16384 rows and F = 8192 in the allocator's trace, an eighth)


def by_row_blocks(fn, *ts: torch.Tensor, rows: int | None = None) -> tuple[torch.Tensor, ...]:
    """``fn(*ts)`` over ``rows`` (default ``ROW_BLOCK``) rows of every tensor at a time, each output (rows first)
    written into a tensor of all rows: the same values wherever every output is per element or per row, with one
    block's temporaries alive instead of the whole's. (Why: the fp8 calibration step, a run's first, runs B3's
    reference on a training step's rows, and its temporaries set that step's memory peak: docs/fp8.md.)"""
    m, rows = ts[0].shape[0], rows or ROW_BLOCK
    if m <= rows:
        return fn(*ts)
    first = fn(*(t[:rows] for t in ts))
    outs = tuple(o.new_empty((m, *o.shape[1:])) for o in first)
    for o, b in zip(outs, first):
        o[:rows] = b
    del first
    for i in range(rows, m, rows):
        for o, b in zip(outs, fn(*(t[i:i + rows] for t in ts))):
            o[i:i + rows] = b
    return outs
