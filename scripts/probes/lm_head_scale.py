"""Probe (GPU): F4's backward scaling of dX and dW by dloss, as two products against one ``torch._foreach_mul``.

    python3 -m scripts.probes.lm_head_scale

Why: the 1B fp8 profile (``profile_llama3_1b_fp8_coda_compile_…2026-11-27.json``, ``outside_gemms_by_op``)
has the two products at 0.782 ms in unvectorized elementwise kernels (a 0-dim device factor broadcast).
``LMHeadCE.backward`` now makes both in one multi-tensor product. This checks on the GPU that the bits are
the same and times both forms at the 1B shapes (dX 16384 x 2048, dW 128256 x 2048, bf16; CUDA events,
median of 20 after 3 warm-up calls). Writes ``$OUT/probe_lm_head_scale_<gpu>.json``.
"""

from __future__ import annotations

import json
import statistics

import torch

from scripts.bench.common import header, out_json, synced_ms


def _ms(fn, reps: int = 20) -> list[float]:
    for _ in range(3):
        fn()
    return synced_ms(fn, reps)


def main() -> int:
    gen = torch.Generator(device="cuda").manual_seed(0)
    dx = torch.randn(16384, 2048, device="cuda", dtype=torch.bfloat16, generator=gen)
    dw = torch.randn(128256, 2048, device="cuda", dtype=torch.bfloat16, generator=gen)
    g = (1.0 / torch.tensor(16384.0, device="cuda")).to(torch.bfloat16)
    two = lambda: (dx * g, dw * g)  # noqa: E731
    one = lambda: torch._foreach_mul([dx, dw], g)  # noqa: E731
    same = all(torch.equal(a, b) for a, b in zip(two(), one()))
    t2, t1 = _ms(two), _ms(one)
    doc = {**header(), "kind": "probe_lm_head_scale", "shapes": {"dx": list(dx.shape), "dw": list(dw.shape)},
           "same_bits": same, "two_products_ms": t2, "foreach_ms": t1,
           "median_ms": {"two_products": statistics.median(t2), "foreach": statistics.median(t1)}}
    path = out_json("probe_lm_head_scale")
    with open(path, "w") as f:
        f.write(json.dumps(doc, indent=1) + "\n")
    print(doc["same_bits"], doc["median_ms"], "->", path, flush=True)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
