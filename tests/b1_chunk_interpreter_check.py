"""Run by tests/test_probes.py in a subprocess with TRITON_INTERPRET=1: B1's pass (``kernels/cute/rope_bwd_pass.py``)
at other shapes (rows a program, the row in column blocks) against one power-of-two block of a row a program,
the pass's form until the forty-first session, on CPU tensors, through Triton's interpreter: da, the
e5m2 codes and the row amax compared bit for bit, zdz by its largest difference over its derived bound (another
order of the same exact terms).
Prints one JSON line of measurements; the test judges them."""

import json

import torch
from interpreter_stub import cute_module

cute_module("rope_bwd_pass")  # (quack stood in for, as tests/b1_interpreter_check.py)
from coda_titan.kernels.cute.rope_bwd_pass import _launch  # noqa: E402

torch.manual_seed(0)
m, half, seqlen = 8, 4, 4  # (rows of 3 q heads, 1 k head, 1 v head of 8; q and k rotated)
q, rot = 5 * 2 * half, 4 * 2 * half
dy = (torch.randn(m, q) * 1e-3).to(torch.bfloat16)
y = torch.randn(m, q).to(torch.bfloat16)
rstd = torch.rand(m) + 0.5
ang = torch.rand(seqlen, half) * 6
cos, sin = ang.cos(), ang.sin()
inv = torch.tensor([2.0**20])
# zdz's bound: each y * dy (two bf16s) is exact in fp32, so the two passes differ only in the order of one fp32
# sum of q terms, each within gamma_{q-1} sum |y dy| of the exact sum (Higham, 4.3): apart by at most twice that
u = 2.0**-24
zdz_bound = 2 * (q - 1) * u / (1 - (q - 1) * u) * (y.double() * dy.double()).abs().sum(-1)
got = {}
for fp8 in (False, True):
    want = _launch(dy, y, rstd, cos, sin, rot, inv if fp8 else None, (64, 1, 8))
    for ch, rows in ((16, 2), (8, 4), (32, 1), (None, 2)):  # (a ragged last block; blocks in a head; a row; pow2)
        da, zdz, daq, amax = _launch(dy, y, rstd, cos, sin, rot, inv if fp8 else None, (ch, rows, 4))
        key = f"{'fp8_' if fp8 else ''}ch{ch}_r{rows}"
        got[key + "_da_equal"] = torch.equal(da, want[0])
        got[key + "_zdz_over_bound"] = float(((zdz - want[1]).double().abs() / zdz_bound).max())
        if fp8:
            got[key + "_codes_equal"] = torch.equal(daq.view(torch.uint8), want[2].view(torch.uint8))
            got[key + "_amax_equal"] = torch.equal(amax, want[3])
print(json.dumps(got))
