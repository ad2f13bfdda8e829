"""Run by tests/test_gemm.py in a subprocess with TRITON_INTERPRET=1 (set before triton loads): the 8-bit
transpose pass (``kernels/cute/transpose_8bit.py``) on CPU tensors, through Triton's interpreter, against
``x.t().contiguous()``, byte for byte, on shapes that fill whole tiles and shapes that leave partial ones.
Prints one JSON line of measurements; the test judges them. (``coda_titan.kernels.cute`` imports quack,
which a CPU install lacks: its package is stood in for, so that only the Triton module loads.)"""

import json

import torch
from interpreter_stub import cute_module

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
x = torch.zeros(64, 64, dtype=torch.uint8).view(torch.float8_e5m2)
got["token_major_of_a_view_is_the_buffer"] = tr.token_major(x.t()).data_ptr() == x.data_ptr()
try:
    tr.transpose_8bit(x.t())
    got["refuses_a_strided_input"] = False
except ValueError as e:
    got["refuses_a_strided_input"] = "contiguous 2-d" in str(e)
print(json.dumps(got))
