"""Run by tests/test_lm_head_ce.py in a subprocess with TRITON_INTERPRET=1 (set before triton loads): F4's
scaled-exp glue (``kernels/cute/lce_glue.py``) on CPU tensors, through Triton's interpreter. Its inputs are
what the first GEMM's epilogue writes, emulated here in fp32 from random logits (per n-tile integer
offsets, bf16 E, fp32 partial sums). Prints one JSON line of measurements; the test judges them."""

import json
import math

import torch
from interpreter_stub import cute_module

from coda_titan.kernels import lm_head_ce as ref

glue = cute_module("lce_glue")
U = 2.0**-24  # fp32's unit roundoff
torch.manual_seed(0)
rows, vocab, tile, d = 6, 768, 192, 40
tiles = vocab // tile
z = torch.randn(rows, vocab) * 3
z[4, :tile] -= 30  # a row whose first tile lies far below its maximum
targets = torch.tensor([3, ref.IGNORE_INDEX, vocab - 1, tile - 1, 5, tile])
r = torch.rand(rows) + 0.5
h = torch.randn(rows, d).bfloat16()
# the first GEMM's epilogue: k = rne(tile max * log2 e), E = 2^(z log2 e - k), its sums in fp32 before E's rounding
zt = z.view(rows, tiles, tile)
k = torch.round(zt.amax(-1) * math.log2(math.e))
e32 = torch.exp2(zt * math.log2(math.e) - k[..., None])
sum_exp, sum_ze = e32.sum(-1), (zt * e32).sum(-1)
e = e32.reshape(rows, vocab).bfloat16()
valid = targets != ref.IGNORE_INDEX
z_y = torch.where(valid, z.gather(1, targets.clamp(min=0)[:, None]).squeeze(1), 0.0)
buf = e.clone()
loss, rv, corr, xs, strip = glue.scaled_exp_glue(k, sum_exp, sum_ze, z_y, targets, r, h, buf, tile, ref.IGNORE_INDEX)

# the glue's formulas in fp64 on the same inputs
k64, s64 = k.double(), None
k_r = k64.amax(-1)
u64 = torch.exp2(k64 - k_r[:, None])
s64 = (sum_exp.double() * u64).sum(-1)
lse = k_r * math.log(2) + s64.log()
zp = (sum_ze.double() * u64).sum(-1) / s64
r64 = r.double()
want = {
    "loss": torch.where(valid, lse - z_y.double(), 0.0),
    "rv": torch.where(valid, r64 / s64, 0.0),
    "corr": torch.where(valid, -(r64 * r64 / d) * (zp - z_y.double()), 0.0),
}
# each is a sum of `tiles` fp32 terms, a log/exp and a few products: (tiles + 8) fp32 units of its magnitude
scale = {"loss": 1 + lse.abs() + z_y.double().abs(), "rv": r64 / s64,
         "corr": (r64 * r64 / d) * ((sum_ze.double().abs() * u64).sum(-1) / s64 + z_y.double().abs())}
out = {"loss": loss, "rv": rv, "corr": corr}
err = {n: float(((out[n].double() - want[n]).abs() / ((tiles + 8) * U * scale[n])).max()) for n in out}
# the strip: 2^(k_t - k_row) for every 64 vocabulary columns, exactly
strip_want = torch.exp2(k - k.amax(-1, keepdim=True)).repeat_interleave(tile // 64, dim=1).t().bfloat16()
# da rebuilt as the two GEMMs see it, (r v) * u * E, against r (softmax - onehot) in fp64: E's one bf16 rounding
# (the fix's too; the interpreter truncates where the GPU rounds: a whole bf16 step, at most 2^-7 of the value)
# plus the glue's fp32 units
p = torch.softmax(z.double(), -1)
onehot = torch.nn.functional.one_hot(targets.clamp(min=0), vocab).double()
da_want = torch.where(valid[:, None], r64[:, None] * (p - onehot), 0.0)
da_got = rv.double()[:, None] * strip.t().double().repeat_interleave(64, dim=1) * buf.double()
da_bound = (2.0**-7 + (tiles + 8) * U) * da_want.abs() + 1e-300
# zdz against sum z (p - onehot) in fp64 from the logits themselves: the epilogue's fp32 sums (emulated) as well
zdz_want = torch.where(valid, (z.double() * (p - onehot)).sum(-1), 0.0)
zdz_got = -(d / (r64 * r64)) * corr.double()
zdz_bound = (vocab + tiles + 8) * U * ((z.double() * p).abs().sum(-1) + z_y.double().abs()) + 1e-300
xs_want = rv.double()[:, None] * h.double()
changed = (buf != e) & ~((buf.isnan()) & (e.isnan()))
print(json.dumps({
    **{f"{n}_err_over_bound": v for n, v in err.items()},
    "strip_exact": bool(torch.equal(strip, strip_want)),
    "da_err_over_bound": float(((da_got - da_want).abs() / da_bound).max()),
    "zdz_err_over_bound": float(((zdz_got - zdz_want).abs() / zdz_bound).max()),
    # xs = bf16(rv * h): one bf16 step of the product (2^-7 of it) and rv's own error (within its bound above)
    "xs_err_over_bound": float(((xs.double() - rv.double()[:, None] * h.double()).abs()
                                / (2.0**-7 * xs_want.abs() + 1e-300)).max()),
    "ignored_row": bool(loss[1] == 0 and rv[1] == 0 and corr[1] == 0 and (xs[1] == 0).all()),
    "changed_only_targets": sorted(map(tuple, changed.nonzero().tolist()))
    == sorted((i, int(t)) for i, t in enumerate(targets) if t != ref.IGNORE_INDEX),
}))
