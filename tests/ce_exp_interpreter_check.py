"""Run by tests/test_lm_head_ce.py in a subprocess with TRITON_INTERPRET=1: the per-row kernels of F4 without its
gradient pass (``kernels/cute/ce_exp.py``) on CPU tensors, through Triton's interpreter, against fp64. F4's
epilogue is stood in for by torch (E = exp(l - c) in bf16 and the per-tile partials, in fp32); two rows get an
offset out of range (one that would overflow, one that underflows) so the repair kernel rewrites them. What the
program then hands the backward GEMMs, s E + kt onehot_t, must be r (softmax - onehot) of fp64. Prints one JSON
line of measurements; the test judges them."""

import json
import math

import torch
from interpreter_stub import cute_module, refuses

from coda_titan.kernels import lm_head_ce as ref

ce_exp = cute_module("ce_exp")
U = 2.0**-24

torch.manual_seed(0)
rows, vocab, d, tile = 7, 3000, 64, 1024
h = torch.randn(rows, d).bfloat16()
w = (torch.randn(vocab, d) * 0.6).bfloat16()
r = torch.rand(rows) + 0.5
targets = torch.tensor([5, ref.IGNORE_INDEX, vocab - 1, 1024, 17, 2999, 0])
l64 = (h.double() @ w.double().t()) * r.double()[:, None]
l = ((h.float() @ w.float().t()) * r[:, None])  # (the epilogue's r * acc in fp32)
c = ref.exp_offsets(h, r, w).float()
listed_rows = [3, 5]
c[3] = l[3].max() - 150.0  # (its largest e would be e^150: out of range above)
c[5] = l[5].max() + 100.0  # (every e of the row under e^-100: out of range below)
c_given = c.clone()
e = torch.exp(l - c[:, None]).bfloat16()  # (rows 3 and 5 hold inf / subnormal garbage until repaired)
lse_parts = torch.stack([torch.logsumexp(l[:, s:s + tile], -1) for s in range(0, vocab, tile)], -1)
el_parts = torch.stack([(torch.exp(l[:, s:s + tile] - c[:, None]) * l[:, s:s + tile]).sum(-1)
                        for s in range(0, vocab, tile)], -1)
valid = targets != ref.IGNORE_INDEX
safe = targets.clamp(min=0)
tl_ = l.gather(1, safe[:, None]).squeeze(1)
loss_rows = torch.full((rows,), float("nan"))
s, k, kt, et, corr, count = ce_exp.exp_program(e, el_parts, lse_parts, tl_, targets, r, c, h, w, ref.IGNORE_INDEX,
                                               d, loss_rows)

lse64 = torch.logsumexp(l64, -1)
p64 = torch.exp(l64 - lse64[:, None])
onehot = torch.zeros(rows, vocab, dtype=torch.float64).scatter(1, safe[:, None], 1.0)
da64 = (p64 - onehot) * torch.where(valid, r.double(), 0.0)[:, None]
da = s.double()[:, None] * e.double() + kt.double()[:, None] * onehot
zdz64 = torch.where(valid, (p64 * l64).sum(-1) - l64.gather(1, safe[:, None]).squeeze(1), 0.0)
corr64 = -(r.double() ** 2 / d) * zdz64
loss64 = torch.where(valid, lse64 - l64.gather(1, safe[:, None]).squeeze(1), 0.0)
# the bounds: l in fp32 differs from fp64's by the GEMM's rounding (d u of the sum of |products|, times r), which
# moves p by that much relative; E's bf16 rounding within 2^-7 relative (the interpreter truncates where the GPU
# rounds to nearest: one unit in the last place of 8 significant bits); exp's and the folds' few units: da within
# (2^-7 + 16 u + 2 dl) p r + 8 u r at the target, dl the logits' error
dl = (d * U * (h.double().abs() @ w.double().abs().t()) * r.double()[:, None]).amax(-1) + 16 * U * l64.abs().amax(-1)
bound = ((2.0**-7 + 16 * U + 2 * dl[:, None]) * p64 + 8 * U * onehot) * r.double()[:, None] + 1e-30
# zdz: its sum's terms p l each within 2 dl + 64 u relative (E unrounded in the sums: fp32's d-term units), plus dl
zb = (2 * dl + 64 * U) * (p64 * l64.abs()).sum(-1) + dl * 4 + 1e-30
repaired_e = e[listed_rows].double()
got = {
    "count": int(count.item()),
    "offsets_moved": [int(i) for i in torch.nonzero(c != c_given).flatten()],
    "listed_offsets_are_lse": bool(torch.allclose(c[listed_rows].double(), lse64[listed_rows], atol=1e-4)),
    "repaired_rows_finite": bool(torch.isfinite(repaired_e).all()),
    "repaired_rows_max": float(repaired_e.amax()),
    "da_err_over_bound": float(((da - da64).abs() / bound)[valid].max()),
    "ignored_zero": float(s[1]) == 0.0 and float(kt[1]) == 0.0 and float(corr[1]) == 0.0 and float(loss_rows[1]) == 0.0,
    "loss_err": float((loss_rows.double() - loss64).abs().max()),
    "loss_bound": float((dl * 2 + 8 * U * loss64.abs() + 1e-6).min()),
    "corr_err_over_bound": float(((corr.double() - corr64).abs() / (r.double() ** 2 / d * zb + 4 * U * corr64.abs()))
                                 [valid].max()),
    "k_is_exact_target_term": float(((k.double() - da64.gather(1, safe[:, None]).squeeze(1)).abs()
                                     / (r.double() * (4 * U + 2 * dl)))[valid].max()),
    "et_is_stored": bool(torch.equal(et[valid], e.float().gather(1, safe[:, None]).squeeze(1)[valid])),
    "sq_norms_err": float(((ce_exp.sq_norms(w).double() - (w.double() ** 2).sum(-1)).abs()
                           / (w.double() ** 2).sum(-1)).max() / (d * U)),
    "range_hi_lo": list(ref.exp_range(vocab)),
    "ln_v": math.log(vocab),
}
# the dW operands: rnd(s H) one bf16 step from s H (the interpreter truncates), the correction k H - rnd(e_t) rnd(s H)
# of that very rounding within 2 fp32 units of its terms
sh, fix = ce_exp.wgrad_operands(h, s, k, et)
shf = h.float() * s[:, None]
got["sh_err_over_step"] = float(((sh.float() - shf).abs() / (2.0**-7 * shf.abs() + 1e-30)).max())
fix64 = h.double() * k.double()[:, None] - et.double()[:, None] * sh.double()
got["fix_err_over_bound"] = float(((fix.double() - fix64).abs() / (2 * U * ((h.double() * k.double()[:, None]).abs()
                                   + (et.double()[:, None] * sh.double()).abs()) + 1e-30)).max())
got["sh_dtype"], got["fix_dtype"] = str(sh.dtype), str(fix.dtype)
got["refusals"] = {"strided_e": refuses(ce_exp.exp_program, e.t(), el_parts, lse_parts, tl_, targets, r, c, h, w,
                                        ref.IGNORE_INDEX, d, loss_rows, says="unit column stride")}
print(json.dumps(got))
