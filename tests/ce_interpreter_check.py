"""Run by tests/test_lm_head_ce.py in a subprocess with TRITON_INTERPRET=1 (set before triton loads): F4's
in-place gradient pass (``kernels/cute/ce_grad_pass.py``) on CPU tensors, through Triton's interpreter,
against the arithmetic of the inductor program it replaces (``kernels/cute/lm_head_ce._ce_grad_math``).
Prints one JSON line of measurements; the test judges them. (``coda_titan.kernels.cute`` imports quack,
which a CPU install lacks: its package is stood in for, so that only the Triton module loads.)"""

import json

import torch
from interpreter_stub import cute_function, cute_module

from coda_titan.kernels import lm_head_ce as ref

ce_pass = cute_module("ce_grad_pass")
ce_grad_math = cute_function("lm_head_ce.py", "def _ce_grad_math", "@torch.library.register_kernel",
                             {"torch": torch, "ref": ref})

torch.manual_seed(0)
rows, vocab = 6, 5000  # two blocks of 4096 columns, the second one partly masked
logits = (torch.randn(rows, vocab) * 3).bfloat16()
targets = torch.tensor([3, ref.IGNORE_INDEX, vocab - 1, 4095, 4096, 0])
rstd = torch.rand(rows) + 0.5
lf = logits.float()
lse = torch.logsumexp(lf, -1)
tgt_logit = lf.gather(1, targets.clamp(min=0)[:, None]).squeeze(1)
da_r, zdz_r = ce_grad_math(logits, lse, tgt_logit, targets, rstd)
p = torch.exp(lf - lse[:, None])
onehot = torch.arange(vocab)[None, :] == targets[:, None]
da_f = (p - onehot.float()) * torch.where(targets != ref.IGNORE_INDEX, rstd, 0.0)[:, None]  # before the bf16 rounding
buf = logits.clone()
da, zdz = ce_pass.ce_grad_inplace(buf, lse, tgt_logit, targets, rstd, ref.IGNORE_INDEX)
# one bf16 rounding of a value whose fp32 inputs (exp) may differ by a few fp32 units: within 2^-7 |da_f|
# (bf16's spacing relative to the value, either rounding direction) plus 4 fp32 units of it
bound = (2.0**-7 + 4 * 2.0**-24) * da_f.abs()
print(json.dumps({
    "in_place": da.data_ptr() == buf.data_ptr(), "da_dtype": str(da.dtype),
    "da_err_over_bound": float(((da.float() - da_f).abs() / bound.clamp(min=1e-30)).max()),
    "ignored_row_zero": bool((da[1] == 0).all()) and float(zdz[1]) == 0.0,
    # a sum of vocab fp32 terms in another order: at most 2 (vocab - 1) u times the sum of their magnitudes
    "zdz_err_over_bound": float(((zdz - zdz_r).abs() / (2 * (vocab - 1) * 2.0**-24 * (p * lf).abs().sum(-1) + 1e-30)).max()),
}))
