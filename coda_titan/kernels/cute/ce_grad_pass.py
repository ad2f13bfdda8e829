"""F4's gradient pass in place: a Triton kernel that turns a chunk's logits into da = r * (softmax - onehot)
in the same buffer, and reduces zdz = sum_n logits_n (softmax_n - onehot_n) beside it.

The inductor program of the same arithmetic (``lm_head_ce._ce_grad_math``) reads the logits and writes da
to a buffer of its own: 3.1 ms a step at 1B (eight 2048-row chunks, one read and one write each), and
a second chunk-sized buffer alive at the LM head, where the step's memory peaks. Here one program per
row streams the row's logits in blocks: p = exp(l - lse), zdz's terms summed in fp32, da rounded to bf16
and stored over the logits it was made from (each element is read before the same program writes it).
Rows whose target is the ignore index get da = 0 and zdz = 0, as the reference. Same arithmetic as the
reference in fp32; the row sum's order differs, as any kernel's may (the GPU tests' derived bounds).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def ce_grad_pass_kernel(logits_ptr, lse_ptr, tlogit_ptr, target_ptr, rstd_ptr, zdz_ptr, V, IGNORE: tl.constexpr,
                        BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * V
    lse = tl.load(lse_ptr + row)
    target = tl.load(target_ptr + row)
    valid = target != IGNORE
    r = tl.where(valid, tl.load(rstd_ptr + row), 0.0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < V
        lf = tl.load(base + cols, mask=inside, other=0.0).to(tl.float32)
        p = tl.where(inside, tl.exp(lf - lse), 0.0)
        acc += p * lf
        da = (p - tl.where(cols == target, 1.0, 0.0)) * r
        tl.store(base + cols, da.to(tl.bfloat16, fp_downcast_rounding="rtne"), mask=inside)
    tl.store(zdz_ptr + row, tl.where(valid, tl.sum(acc, axis=0) - tl.load(tlogit_ptr + row), 0.0))


def ce_grad_inplace(logits: torch.Tensor, lse: torch.Tensor, tgt_logit: torch.Tensor, targets: torch.Tensor,
                    rstd: torch.Tensor, ignore_index: int, block: int = 4096,
                    num_warps: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """(da, zdz): da written over ``logits`` (rows, V) bf16 contiguous, and returned as that same tensor;
    lse, tgt_logit, rstd (rows,) fp32, targets (rows,) integer. ``block`` columns per step of a row's
    program, ``num_warps`` per program (``scripts/probes/ce_pass.py`` times the choices)."""
    if logits.dtype != torch.bfloat16 or not logits.is_contiguous():
        raise ValueError(f"the in-place CE gradient takes contiguous bf16 logits, got {logits.dtype}")
    rows, vocab = logits.shape
    zdz = torch.empty(rows, device=logits.device, dtype=torch.float32)
    ce_grad_pass_kernel[(rows,)](logits, lse.float(), tgt_logit.float(), targets, rstd.float(), zdz, vocab,
                                 IGNORE=ignore_index, BLOCK=block, num_warps=num_warps)
    return logits, zdz
