"""Run by tests/test_probes.py in a subprocess with TRITON_INTERPRET=1: B1's pass (``kernels/cute/rope_bwd_pass.py``)
at other shapes (rows a program, the row in column blocks) against one power-of-two block of a row a program,
the pass's form until the forty-first session, on CPU tensors, through Triton's interpreter: da, the
e5m2 codes and the row amax compared bit for bit, zdz by its largest relative difference (another order).
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
got = {}
for fp8 in (False, True):
    want = _launch(dy, y, rstd, cos, sin, rot, inv if fp8 else None, (64, 1, 8))
    for ch, rows in ((16, 2), (8, 4), (32, 1), (None, 2)):  # (a ragged last block; blocks in a head; a row; pow2)
        da, zdz, daq, amax = _launch(dy, y, rstd, cos, sin, rot, inv if fp8 else None, (ch, rows, 4))
        key = f"{'fp8_' if fp8 else ''}ch{ch}_r{rows}"
        got[key + "_da_equal"] = torch.equal(da, want[0])
        got[key + "_zdz_rel"] = float(((zdz - want[1]).abs() / want[1].abs()).max())
        if fp8:
            got[key + "_codes_equal"] = torch.equal(daq.view(torch.uint8), want[2].view(torch.uint8))
            got[key + "_amax_equal"] = torch.equal(amax, want[3])
print(json.dumps(got))
