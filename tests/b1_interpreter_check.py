"""Run by tests/test_norm_rope.py in a subprocess with TRITON_INTERPRET=1 (set before triton loads): B1's
Triton pass (``kernels/cute/rope_bwd_pass.py``) on CPU tensors, through Triton's interpreter, against the
arithmetic of the inductor program it replaces (``kernels/cute/norm_rope._rope_bwd_f32``). Prints one
JSON line of measurements; the test judges them. (``coda_titan.kernels.cute`` imports quack, which a CPU
install lacks: its package is stood in for, so that only the Triton module and the reference load.)"""

import json

import torch
from interpreter_stub import cute_function, cute_module

cute_module("rope_bwd_pass")
from coda_titan.kernels import norm_rope as ref  # noqa: E402
from coda_titan.kernels.scaling import E5M2, quantize_e5m2_site  # noqa: E402

rope_bwd_f32 = cute_function("norm_rope.py", "def _rope_bwd_f32", "def _rope_bwd_math", {"torch": torch})

torch.manual_seed(0)
seq, bs, hd, nq, nkv = 16, 2, 16, 8, 2  # (12 heads: the pass runs three blocks of 4, the last one half rotated)
m, q, rot = seq * bs, (nq + 2 * nkv) * hd, (nq + nkv) * hd
dy, y = (torch.randn(m, q) * 1e-3).bfloat16(), torch.randn(m, q).bfloat16()
dy[5, 3] = 0.0
rstd = torch.rand(m) + 0.5
cos, sin = ref.rope_cos_sin(1.0 / (10000 ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)), seq, torch.float32)
da, zdz = torch.ops.coda.rope_bwd_pass(dy, y, rstd, cos, sin, rot)
da_f, zdz_f = rope_bwd_f32(dy, y, rstd, cos, sin, rot, hd)
rtz = (da_f.view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)  # (the interpreter truncates)
inv = torch.tensor(2.0**14)
_, zdz8, daq, amax = torch.ops.coda.rope_bwd_fp8_pass(dy, y, rstd, cos, sin, rot, inv)
_, amax_r = quantize_e5m2_site(da_f, inv)
# dy and y whose rows lie further apart than their width (slices of wider buffers): the same bytes
wide = [torch.zeros(m, q + 32, dtype=t.dtype) for t in (dy, y)]
for w, t, at in zip(wide, (dy, y), (8, 24)):
    w[:, at:at + q] = t
da_w, zdz_w = torch.ops.coda.rope_bwd_pass(wide[0][:, 8:q + 8], wide[1][:, 24:q + 24], rstd, cos, sin, rot)
da8_w, _, daq_w, _ = torch.ops.coda.rope_bwd_fp8_pass(wide[0][:, 8:q + 8], wide[1][:, 24:q + 24], rstd, cos, sin, rot, inv)
print(json.dumps({
    "wide_same": {"da": bool(torch.equal(da_w, da)), "zdz": bool(torch.equal(zdz_w, zdz)), "da_fp8": bool(torch.equal(da8_w, da)),
                  "daq": bool(torch.equal(daq_w.view(torch.uint8), daq.view(torch.uint8))), "dense_da": da_w.is_contiguous()},
    "da_dtype": str(da.dtype), "da_bits_apart": int((rtz != da).sum()),
    # a sum of q fp32 terms in another order: at most 2 (q - 1) u times the sum of their magnitudes apart
    "zdz_err_over_bound": float(((zdz - zdz_f).abs() / (2 * (q - 1) * 2.0**-24 * (y.float() * dy.float()).abs().sum(-1))).max()),
    "zdz_fp8_same": bool(torch.equal(zdz8, zdz)),
    "daq_dtype": str(daq.dtype), "daq_is_e5m2": daq.dtype == E5M2, "amax_equal": bool(torch.equal(amax, amax_r)),
    "amax_shape": list(amax.shape),
}))
