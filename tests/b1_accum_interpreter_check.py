"""Run by tests/test_probes.py in a subprocess with TRITON_INTERPRET=1: the probe's B1 pass reading FlashAttention's
fp32 gradient accumulators (``scripts/probes/b1_accum.py``), on CPU tensors laid out in the order
``probe_fa4_accum_layout_…json`` measured, against the configured B1 pass (``kernels/cute/rope_bwd_pass.py``) on
the bf16 dq, dk, dv those accumulators stand for. The accumulators are bf16-exact (the interpreter rounds its
casts to bf16 toward zero, the GPU to nearest). Prints one JSON line of measurements; the test judges them."""

import json
import pathlib
import sys

import torch
from interpreter_stub import cute_module

from coda_titan.kernels.norm_rope import rope_cos_sin
from coda_titan.model.rope import rope_freqs

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # (the checkout: scripts/)
from scripts.probes import b1_accum  # noqa: E402
from torchtitan.models.llama3.model.args import RoPEScalingArgs  # noqa: E402

rbp = cute_module("rope_bwd_pass")


def offset(r, c):
    """The measured order inside a 128 x 64 tile (the probe's docstring)."""
    return ((c & 1) | (((r >> 3) & 1) << 1) | (((c >> 1) & 1) << 2) | (((c >> 2) & 1) << 3) | ((r & 7) << 4)
            | (((r >> 4) & 3) << 7) | (((c >> 3) & 7) << 9) | (((r >> 6) & 1) << 12))


def apart(a, b) -> int:
    return int((a.reshape(-1).view(torch.uint8) != b.reshape(-1).view(torch.uint8)).sum())


B, S, HQ, HKV, D = 2, 256, 2, 1, 64
gen = torch.Generator().manual_seed(0)
scale = D ** -0.5
accs = [torch.randn(B, h, S * D, generator=gen).to(torch.bfloat16).float() for h in (HQ, HKV, HKV)]
s = torch.arange(S)[:, None]
idx = (s // 128) * (128 * D) + offset(s % 128, torch.arange(D)[None, :])
m = B * S
dense = [(a[:, :, idx] * sc).to(torch.bfloat16).permute(0, 2, 1, 3).reshape(m, -1)
         for a, sc in zip(accs, (scale, scale, 1.0))]
dy = torch.cat(dense, 1)
y = torch.randn(m, (HQ + 2 * HKV) * D, generator=gen).to(torch.bfloat16)
rstd = torch.rand(m, generator=gen) + 0.5
cos, sin = (t.contiguous() for t in rope_cos_sin(rope_freqs(D, 500000.0, RoPEScalingArgs()), S, torch.float32))
inv = torch.full((1,), 64.0)
want = rbp._launch(dy, y, rstd, cos, sin, (HQ + HKV) * D, inv, wrap=lambda k: k)
q = y.shape[1]
reassoc = 2 * q * 2.0**-24 * (y.float() * dy.float()).abs().sum(1)  # (two fp32 orders of a q-term sum)
got = {"offsets_are_a_permutation": sorted(offset(torch.arange(128)[:, None], torch.arange(D)[None, :]).reshape(-1)
                                           .tolist()) == list(range(128 * D))}
for rows, warps in ((b1_accum.ROWS, 4), (64, 8)):
    out = b1_accum.launch(*accs, y, rstd, cos, sin, inv, scale, S, HQ, HKV, D, rows, warps)
    got[f"r{rows}"] = {"da": apart(out[0], want[0]), "daq": apart(out[2], want[2]), "amax": apart(out[3], want[3]),
                       "zdz_over_reassociation": float(((out[1] - want[1]).abs() / reassoc).max())}
out = b1_accum.launch_tiles(*accs, y, rstd, cos, sin, inv, scale, S, HQ, HKV, D)
got["tiles"] = {"da": apart(out[0], want[0]), "daq": apart(out[2], want[2]),
                "amax": apart(out[3].reshape(1), want[3].amax().reshape(1)),
                "zdz_over_reassociation": float(((out[1] - want[1]).abs() / reassoc).max())}
print(json.dumps(got))
