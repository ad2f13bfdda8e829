"""Probe (GPU, torch alone): the fp8 weight pass's transposed e4m3 copies.

    python3 -m scripts.probes.fp8_transpose        (no bundle needed: torch and triton only)

The weight pass (``kernels/gemm.py`` ``fp8_layer_weights``, ``model._weight_pass``) makes each layer's
e4m3 W13^T (``fp8_mlp_dgrad``), W2^T (``fp8_down_dgrad``) and, with ``fp8_dgrad``, W_qkv^T as
``q.t().contiguous()``: aten's float8 copy. At the 1B shapes this times, per weight: that copy; the
cast alone (bf16 -> e4m3 with a given scale, row-major); the copy done by an inductor kernel
(``torch.compile``); and one inductor kernel that casts and writes both layouts. Median of 20
CUDA-event timings after 3 warm-up calls (the first compiles), each synced; random bf16 weights at
the 1B's init scale. The compiled outputs are checked bit for bit against aten's. Writes
``$OUT/probe_fp8_transpose_<gpu>.json``.
"""

from __future__ import annotations

import torch

from scripts.bench.common import header, log_row, out_json
from scripts.probes.fp8_configs import _time

E4M3 = torch.float8_e4m3fn
SHAPES = {"w13": (16384, 2048), "w2": (2048, 8192), "wqkv": (3072, 2048)}


def _cast(w, inv):
    return (w.float() * inv).clamp(-448.0, 448.0).to(E4M3)


def _both(w, inv):
    q = _cast(w, inv)
    return q, q.t().contiguous()


def main() -> int:
    doc = {**header(), "kind": "probe_fp8_transpose", "shapes": SHAPES,
           "timing": "median of 20 CUDA-event timings after 3 warm-up calls (the first compiles), each synced",
           "rows": []}
    path = out_json("probe_fp8_transpose")
    g = torch.Generator(device="cuda").manual_seed(0)
    copy_c, both_c = torch.compile(lambda q: q.t().contiguous()), torch.compile(_both)
    for name, shape in SHAPES.items():
        w = (torch.randn(*shape, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
        inv = 448.0 / w.float().abs().amax()
        q = _cast(w, inv)
        row = {"weight": name, "shape": list(shape),
               "aten_copy": _time(lambda: q.t().contiguous()), "cast": _time(lambda: _cast(w, inv)),
               "inductor_copy": _time(lambda: copy_c(q)), "inductor_cast_both": _time(lambda: both_c(w, inv))}
        want = q.t().contiguous()
        got_q, got_t = both_c(w, inv)
        row["bits_equal"] = bool(torch.equal(copy_c(q).view(torch.uint8), want.view(torch.uint8))
                                 and torch.equal(got_q.view(torch.uint8), q.view(torch.uint8))
                                 and torch.equal(got_t.view(torch.uint8), want.view(torch.uint8)))
        log_row(doc, "rows", row, path)
    print("wrote", path, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
