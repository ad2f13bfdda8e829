"""Probe (GPU): the token-major copy of 8-bit codes at the 1B shapes, by each way of making it.

    source .gpu/part2/activate.sh && python3 -m scripts.probes.transpose_8bit        (gpu_train.sh t8probe)

For B1's e5m2 da (16384 x 3072, dW_qkv's gradient) and o's e4m3 codes (16384 x 2048, dW_o's input) it
times ``transpose_8bit``'s Triton pass per tile size and warp count, PyTorch's eager ``.t().contiguous()``,
inductor's copy compiled alone, and inductor's copy compiled beside the scale's reciprocal (what the
traced weight gradient ran before: 0.347 ms a layer for B1's codes in the twenty-eighth session's
profile). Each is checked byte for byte against the eager copy, then captured as a CUDA graph of 20
calls and timed as 20 replays between two CUDA events, in 5 rounds that alternate the variants
(``h_t._row``): the kernels' own time, which calls enqueued one by one do not give (the twenty-eighth
session's first run was host-bound: the same 0.042 ms for 50 and 33.5 MB). ``median_ms`` is per call;
the row also gives each variant's effective bandwidth (bytes read + written per second).

Writes ``$OUT/probe_transpose_8bit_<gpu>.json`` (device, versions, date, shapes, every round's ms).
"""

from __future__ import annotations

import json
import os
import re

import torch
import triton

from scripts.probes.fp8_configs import M, _meta
from scripts.probes.h_t import _row

SHAPES = {"b1_da_e5m2": (M, 3072, torch.float8_e5m2), "o_e4m3": (M, 2048, torch.float8_e4m3fn)}
TILES = ((32, 4), (64, 4), (64, 8), (128, 8))
CALLS = 20  # (calls per captured graph)


def _graphed(fn, calls: int = CALLS):
    """``calls`` calls of ``fn`` captured as one CUDA graph (after warm-up on a side stream): its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph.replay


def main() -> int:
    from coda_titan.kernels.cute import transpose_8bit as tr

    doc = _meta()
    doc.update(kind="probe_transpose_8bit", shapes={k: [m, k2, str(dt)] for k, (m, k2, dt) in SHAPES.items()},
               timing=f"a CUDA graph of {CALLS} calls replayed 20 times between CUDA events, median of 5 "
                      "alternating rounds, per call", tiles=[list(t) for t in TILES], rows=[])
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (m, k, dtype) in SHAPES.items():
        x = torch.randint(0, 256, (m, k), generator=gen, device="cuda", dtype=torch.uint8).view(dtype)
        scale = torch.full((), 3.0, device="cuda")
        want = x.t().contiguous().view(torch.uint8)

        def triton_pass(block, warps):  # (the kernel launched directly: wrap_triton outside an op is host-bound)
            out, xb = torch.empty((k, m), device="cuda", dtype=torch.uint8), x.view(torch.uint8)
            grid = (triton.cdiv(m, block), triton.cdiv(k, block))
            return lambda: tr.transpose_8bit_kernel[grid](xb, out, m, k, m, BM=block, BK=block, num_warps=warps)

        alone = torch.compile(lambda t: t.t().contiguous(), fullgraph=True, dynamic=False)
        with_scale = torch.compile(lambda t, s: (t.t().contiguous(), s.float().reciprocal()), fullgraph=True,
                                   dynamic=False)
        variants = {f"triton_{b}x{b}_w{w}": triton_pass(b, w) for b, w in TILES}
        variants.update({"op": lambda: tr.transpose_8bit(x), "eager_torch": lambda: x.t().contiguous(),
                         "inductor_alone": lambda: alone(x), "inductor_with_reciprocal": lambda: with_scale(x, scale)})
        same = {}
        for key, fn in variants.items():
            got = fn()
            got = got[0] if isinstance(got, tuple) else got
            same[key] = bool(torch.equal(got.view(torch.uint8), want))
        row = _row(name, {key: _graphed(fn) for key, fn in variants.items()})
        row["median_ms"] = {key: ms / CALLS for key, ms in row["median_ms"].items()}
        row["rounds_ms"] = {key: [ms / CALLS for ms in v] for key, v in row["rounds_ms"].items()}
        row["bytes_equal"] = same
        row["tb_per_s"] = {key: 2 * m * k / (ms * 1e-3) / 1e12 for key, ms in row["median_ms"].items()}
        print(json.dumps({"per_call_ms": {key: round(ms, 4) for key, ms in row["median_ms"].items()},
                          "bytes_equal": same}), flush=True)
        doc["rows"].append(row)
    slug = re.sub(r"[^A-Za-z0-9]+", "_", doc["device"]).strip("_")
    out = os.path.join(os.environ.get("OUT", "benchmarks/results"), f"probe_transpose_8bit_{slug}.json")
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    print("wrote", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
