"""Run by tests/test_gemm.py in a subprocess with TRITON_INTERPRET=1 (set before triton loads): the 8-bit
transpose pass (``kernels/cute/transpose_8bit.py``) on CPU tensors, through Triton's interpreter, against
``x.t().contiguous()``, byte for byte, on shapes that fill whole tiles and shapes that leave partial ones.
Prints one JSON line of measurements; the test judges them. (``coda_titan.kernels.cute`` imports quack,
which a CPU install lacks: its package is stood in for, so that only the Triton module loads.)"""

import json
import os

import torch
from interpreter_stub import cute_module, refuses

from coda_titan.kernels.scaling import quantize_e5m2

tr = cute_module("transpose_8bit")

torch.manual_seed(0)
got = {}
for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
    for m, k in ((128, 192), (100, 70), (1, 65)):
        x = torch.randint(0, 256, (m, k), dtype=torch.uint8).view(dtype)  # (every byte, NaN codes included)
        y = torch.ops.coda.transpose_8bit(x)
        ref = x.t().contiguous()
        got[f"{dtype}_{m}x{k}"] = {
            "dtype": str(y.dtype), "shape": list(y.shape), "contiguous": y.is_contiguous(),
            "bytes_apart": int((y.view(torch.uint8) != ref.view(torch.uint8)).sum()),
        }
# into a column block of a wider token-major buffer (the fp8 head's dlogits chunks): that block written, the rest kept
wide = torch.zeros(70, 300, dtype=torch.uint8)
x = torch.randint(1, 256, (100, 70), dtype=torch.uint8)
tr.launch(x, wide[:, 150:250])
got["into_a_column_block"] = {"bytes_apart": int((wide[:, 150:250] != x.t()).sum()),
                              "outside_kept": bool((wide[:, :150] == 0).all() and (wide[:, 250:] == 0).all())}
got["refuses_a_column_out"] = refuses(tr.launch, x, torch.zeros(100, 70, dtype=torch.uint8).t(), says="unit stride")
x = torch.zeros(64, 64, dtype=torch.uint8).view(torch.float8_e5m2)
got["token_major_of_a_view_is_the_buffer"] = tr.token_major(x.t()).data_ptr() == x.data_ptr()
calls, the_pass = [], tr.transpose_8bit
tr.transpose_8bit = lambda t: calls.append(1) or the_pass(t)  # (token_major calls it through the module)
x = torch.randint(0, 256, (96, 64), dtype=torch.uint8).view(torch.float8_e5m2)
for env in (None, "inductor", "triton"):
    for traced_input in (False, True):
        os.environ.pop(tr.T8_ENV, None) if env is None else os.environ.__setitem__(tr.T8_ENV, env)
        calls.clear()
        y = tr.token_major(x, traced_input=traced_input)
        got[f"token_major_{env}_{traced_input:d}"] = {
            "pass": bool(calls), "same": bool(torch.equal(y.view(torch.uint8), x.t().contiguous().view(torch.uint8)))}
os.environ[tr.T8_ENV] = "Triton"
try:
    tr.token_major(x)
    got["token_major_refuses_an_unknown_mode"] = False
except ValueError as e:
    got["token_major_refuses_an_unknown_mode"] = tr.T8_ENV in str(e)
os.environ.pop(tr.T8_ENV, None)
tr.transpose_8bit = the_pass
try:
    tr.transpose_8bit(x.t())
    got["refuses_a_strided_input"] = False
except ValueError as e:
    got["refuses_a_strided_input"] = "contiguous 2-d" in str(e)
# cast_transpose_e5m2 on values whose scaled value is an e5m2 number (x = code / inv, inv a power of two):
# the interpreter's own fp32 -> e5m2 conversion is not the hardware's rounding (the GPU test checks that),
# but an exact value has one code either way; and values beyond the range, which must saturate
codes = torch.randint(0, 256, (100, 70), dtype=torch.uint8).view(torch.float8_e5m2).float()
codes = torch.where(codes.isfinite(), codes, 0.0)
inv = torch.tensor([2.0**-3])
x = (codes / inv).to(torch.bfloat16)
x[0, :3] = torch.tensor([1e6, -1e6, 57344.0 * 8])  # |x| inv beyond E5M2_MAX: saturated codes
y = torch.ops.coda.cast_transpose_e5m2(x, inv)
want = quantize_e5m2(x.float(), inv).t().contiguous()
got["cast_e5m2"] = {"dtype": str(y.dtype), "shape": list(y.shape), "contiguous": y.is_contiguous(),
                    "bytes_apart": int((y.view(torch.uint8) != want.view(torch.uint8)).sum()),
                    "saturated": [float(v) for v in y[:3, 0].float()]}
for bad in (x.t(), x.float()):
    got[f"cast_refuses_{bad.dtype}_{bad.is_contiguous():d}"] = refuses(tr.cast_transpose_e5m2, bad, inv,
                                                                        says="contiguous 2-d bf16")
print(json.dumps(got))
