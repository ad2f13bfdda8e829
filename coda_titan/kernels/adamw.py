"""AdamW's update for many tensors in one Triton launch, the same arithmetic as torch's fused AdamW.

torch's ``_fused_adamw_`` (``ATen/native/cuda/fused_adam_utils.cuh``) walks its tensors in chunks of
65,536 elements, 512 threads a block, four elements a thread with 8-byte loads for bf16, and launches once
per 320 chunks: on the 1B model's 1.5 B bf16 parameters it moves about 21 GB in 10.8 ms on an H100 (float8
+ compile's profile), under two thirds of the memory's speed. Here one program updates ``BLOCK`` elements
of one tensor with 16-byte loads, and one launch covers every tensor of a step (or of a step's chunk, with
``[coda] step_chunk_layers``): a table holds each tensor's addresses (parameter, exp_avg, exp_avg_sq, step
count) and element count, a vector its gradient's address, a third table each program's tensor and block.

The arithmetic, per element, in fp32 as torch's (opmath) functor: the gradient divided by ``grad_scale``
(written back, as torch does for its AMP / ``[coda] fused_clip`` scale), the decoupled weight decay
``p - (lr wd) p`` (as an fma), ``m = fma(b1, m, fma(-b1, g, g))``, ``v = fma(b2, v, fma(-b2, g g, g g))``, the
bias corrections from the tensor's own step count (``1 - b1^t``, ``sqrt(1 - b2^t)``, the power in fp64 as
torch's build computes it) and ``p - (lr / bc1) m / (sqrt(v) / sqrt(bc2) + eps)``, with IEEE division and square
root: the same bits as torch's kernel (tests/test_adamw.py; scripts/probes/adamw.py on 1B shapes).
"""

from __future__ import annotations

import torch
import triton  # (importable on the CPU machines too, as TorchTitan needs; the kernel runs on CUDA)
import triton.language as tl
from triton.language.extra import libdevice

BLOCK = 2048  # elements a program: 16 a thread at 4 warps, two 16-byte loads of each bf16 operand (the fastest of
WARPS = 4  # five (block, warps) shapes in probe_adamw_*.json: 8.28 ms a chunked 1B step against 9.07 at (4096, 8))
_ALIGN = 16  # bytes: every address in the table is a multiple (checked), so the loads can be 16 bytes wide
_VEC = 8  # element counts are multiples (checked): the mask of a 16-byte bf16 vector is all-or-nothing
_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def adamw_kernel(table, gtab, blocks, scale_ptr, lr, beta1, beta2, wd, eps, DT: tl.constexpr, HAS_SCALE: tl.constexpr,
                 BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.load(blocks + 2 * pid)
    start = tl.load(blocks + 2 * pid + 1) * BLOCK  # (a multiple of BLOCK: the loads stay 16 bytes wide)
    row = table + t * 5  # (addresses / 16 of p, exp_avg, exp_avg_sq, the step count; elements / 8)
    p_ptr = tl.multiple_of((tl.load(row) * 16).to(tl.pointer_type(DT)), 16)
    g_ptr = tl.multiple_of((tl.load(gtab + t) * 16).to(tl.pointer_type(DT)), 16)
    m_ptr = tl.multiple_of((tl.load(row + 1) * 16).to(tl.pointer_type(DT)), 16)
    v_ptr = tl.multiple_of((tl.load(row + 2) * 16).to(tl.pointer_type(DT)), 16)
    s_ptr = (tl.load(row + 3) * 16).to(tl.pointer_type(tl.float32))
    n = tl.load(row + 4) * 8  # (stored in eights: the mask is constant over a 16-byte vector)
    step = tl.load(s_ptr)
    b1 = tl.cast(beta1, tl.float32)  # (tl.cast: Python floats too, under Triton's interpreter)
    b2 = tl.cast(beta2, tl.float32)
    # (b^t in fp64, rounded to fp32: torch's ``at::native::pow_`` resolves to the double pow on Linux)
    bc1 = 1.0 - libdevice.pow(tl.cast(b1, tl.float64), tl.cast(step, tl.float64)).to(tl.float32)
    bc2_sqrt = tl.sqrt_rn(1.0 - libdevice.pow(tl.cast(b2, tl.float64), tl.cast(step, tl.float64)).to(tl.float32))
    lr32 = tl.cast(lr, tl.float32)
    step_size = tl.div_rn(lr32, bc1)
    offs = start + tl.arange(0, BLOCK)
    mask = offs < n
    p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        g = tl.div_rn(g, tl.load(scale_ptr))
        tl.store(g_ptr + offs, g.to(DT), mask=mask)
    p = tl.fma(-(lr32 * tl.cast(wd, tl.float32)), p, p)
    m = tl.fma(b1, m, tl.fma(-b1, g, g))
    gg = g * g
    v = tl.fma(b2, v, tl.fma(-b2, gg, gg))
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + tl.cast(eps, tl.float32)
    p = p - tl.div_rn(step_size * m, denom)
    tl.store(p_ptr + offs, p.to(DT), mask=mask)
    tl.store(m_ptr + offs, m.to(DT), mask=mask)
    tl.store(v_ptr + offs, v.to(DT), mask=mask)


def plan(numels: list[int], block: int = BLOCK) -> list[tuple[int, int]]:
    """(tensor, block) for each program: every element of every tensor in exactly one program."""
    return [(t, b) for t, n in enumerate(numels) for b in range(-(-n // block))]


_DEVICES = ("cuda",)  # (where the kernel runs; tests/adamw_interpreter_check.py adds the CPU for Triton's interpreter)


def supported(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: torch.Tensor) -> str | None:
    """Why the kernel cannot update ``p`` from this gradient, state and step count (None: it can)."""
    return state_unsupported(p, m, v, step) or grad_unsupported(p, g)


def state_unsupported(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: torch.Tensor) -> str | None:
    """``supported``'s checks of what does not change between steps: the parameter, its state, its step count."""
    if any(t.device.type not in _DEVICES for t in (p, m, v, step)):
        return "a tensor off CUDA"
    if p.dtype not in _TL:
        return f"dtype {p.dtype}"
    if any(t.dtype != p.dtype or t.device != p.device or t.shape != p.shape for t in (m, v)):
        return "a state of another dtype, device or shape"
    if step.dtype != torch.float32 or step.numel() != 1 or step.device != p.device:
        return "a step count that is not one fp32 element on the parameter's device"
    if any(not t.is_contiguous() for t in (p, m, v)) or any(t.data_ptr() % _ALIGN for t in (p, m, v, step)):
        return "a tensor not contiguous or not 16-byte aligned"
    if p.numel() % _VEC:
        return f"{p.numel()} elements, not a multiple of {_VEC}"
    return None


def grad_unsupported(p: torch.Tensor, g: torch.Tensor) -> str | None:
    """``supported``'s checks of the gradient, a new tensor every step."""
    if g.dtype != p.dtype or g.device != p.device or g.shape != p.shape:
        return "a gradient of another dtype, device or shape"
    if not g.is_contiguous() or g.data_ptr() % _ALIGN:
        return "a gradient not contiguous or not 16-byte aligned"
    return None


class Tables:
    """The device tables of lists of tensors. Parameters, their state and step counts never move: a list's table of
    them and its programs' table are uploaded once. Gradients are new tensors every step, mostly at the addresses of
    the step before: their column is uploaded only when it changed, from a ring of pinned buffers allocated with the
    list (allocating pinned memory makes the host wait for the GPU: measured as a 170 ms optimizer phase)."""

    RING = 8

    def __init__(self, limit: int = 64):
        self.lists: dict[tuple, _List] = {}
        self.limit = limit

    def get(self, rows: list[tuple[torch.Tensor, ...]], device, block: int = BLOCK):
        """(table, gradient addresses, programs' table, programs) of rows (p, g, m, v, step) for the kernel."""
        key = (block, *((*(r[i].data_ptr() for i in (0, 2, 3, 4)), r[0].numel()) for r in rows))
        lst = self.lists.get(key)
        if lst is None:
            if len(self.lists) >= self.limit:
                self.lists.pop(next(iter(self.lists)))
            lst = self.lists[key] = _List(key[1:], device, block, self.RING)
        lst.set_grads([r[1].data_ptr() // _ALIGN for r in rows])
        return lst.table, lst.grads, lst.blocks, lst.n


class _List:
    def __init__(self, rows: tuple, device, block: int, ring: int):
        self.cuda = torch.device(device).type == "cuda"
        table = [[p // _ALIGN, m // _ALIGN, v // _ALIGN, s // _ALIGN, n // _VEC] for p, m, v, s, n in rows]
        self.table = torch.tensor(table, dtype=torch.int64).to(device)
        blocks = plan([r[4] for r in rows], block)
        self.blocks, self.n = torch.tensor(blocks, dtype=torch.int64).to(device), len(blocks)
        self.grads = torch.empty(len(rows), dtype=torch.int64, device=device)
        self.ring = [torch.empty(len(rows), dtype=torch.int64, pin_memory=self.cuda) for _ in range(ring)]
        self.events: list = [None] * ring
        self.uploads, self.last = 0, None

    def set_grads(self, ptrs: list[int]) -> None:
        if ptrs == self.last:
            return
        slot = self.uploads % len(self.ring)
        if self.events[slot] is not None:  # (the copy from this buffer RING uploads ago; long done in training)
            self.events[slot].synchronize()
        self.ring[slot].copy_(torch.tensor(ptrs, dtype=torch.int64))
        self.grads.copy_(self.ring[slot], non_blocking=self.cuda)  # (on the stream the kernel runs on, before it)
        if self.cuda:
            self.events[slot] = torch.cuda.Event()
            self.events[slot].record()
        self.uploads, self.last = self.uploads + 1, ptrs


def adamw_step(params, grads, exp_avgs, exp_avg_sqs, steps, *, lr: float, beta1: float, beta2: float,
               weight_decay: float, eps: float, grad_scale: torch.Tensor | None = None,
               tables: Tables | None = None, block: int = BLOCK, warps: int = WARPS) -> None:
    """Increment each step count and update every tensor (one launch per dtype): torch's fused AdamW's step on
    tensors ``supported`` accepts. ``steps``: fp32 0-dim CUDA tensors, one per parameter."""
    if not params:
        return
    torch._foreach_add_(steps, 1)
    tables = tables or Tables()
    by_dtype: dict[torch.dtype, list] = {}
    for row in zip(params, grads, exp_avgs, exp_avg_sqs, steps):
        by_dtype.setdefault(row[0].dtype, []).append(row)
    for dtype, rows in by_dtype.items():
        table, gtab, blocks, n = tables.get(rows, rows[0][0].device, block)
        scale = grad_scale if grad_scale is not None else rows[0][4]
        hyper = (float(lr), float(beta1), float(beta2), float(weight_decay), float(eps))
        adamw_kernel[(n,)](table, gtab, blocks, scale, *hyper, DT=_TL[dtype], HAS_SCALE=grad_scale is not None,
                           BLOCK=block, num_warps=warps)
