"""Probe (GPU, torch alone): B1, the RoPE backward pass (``kernels/cute/norm_rope.py``), as inductor
compiles it, against rewrites of the same arithmetic.

    source .gpu/part2/activate.sh && python3 -m scripts.probes.rope_bwd        (gpu_train.sh ropebwd)

B1 reads the packed gradient dy (tokens, (h + 2 h_kv) d) and F3's output y, and writes da = R^T(dy) * r
(the inverse rotation on the q and k heads, v passed through) in bf16 and zdz = rowsum(y * dy). In the
fp8 profile it is two inductor kernels: the rotation at 0.147 ms a layer and the row sum at 0.065, where
reading dy and y and writing da take about 0.09 ms at the H100's bandwidth. Variants, each compiled
whole by ``torch.compile`` (one graph, as the traced B1 in the step), at the 1B shape (16384 x 3072,
16 q and 4 kv heads of 128, seq 8192):

* ``current``: ``_rope_bwd_math`` as shipped (a select / stack over pairs, then a cat with the v columns);
* ``masked``:  the rotation over every head with the v heads' output taken from dy by ``where`` (no cat);
* ``flip``:    the pair swap as ``flip`` on a (.., 64, 2) view, the sign folded into the sin table, the
  v heads by ``where`` (no stack, no cat);
* ``*_fp8``:   the same three with the e5m2 cast and row amax of ``rope_bwd_fp8`` (``fp8_dgrad``).

Every variant's da, zdz (and codes, amax) are compared bit for bit with ``current``'s. Timing: 20
calls enqueued back to back after 3 warm-up calls, GPU ms per call, in 5 alternations of the variants
(``epi_stages``' lesson: the clocks move with the order). Writes ``$OUT/probe_rope_bwd_<gpu>.json``.
"""

from __future__ import annotations

import torch

from scripts.bench.common import header, log_row, out_json
from scripts.probes.epi_stages import _streamed

M, SEQ, H, HKV, HD = 16384, 8192, 16, 4, 128
ROT = (H + HKV) * HD


def _tables(dev):
    inv = 1.0 / (500000.0 ** (torch.arange(0, HD, 2, dtype=torch.float64, device=dev) / HD))
    ang = torch.outer(torch.arange(SEQ, dtype=torch.float64, device=dev), inv)
    return ang.cos().float(), ang.sin().float()


def _masked_f32(dy, y, rstd, cos, sin):
    m, q = dy.shape
    dyf = dy.float()
    zdz = (y.float() * dyf).sum(-1)
    t = dyf.view(m // SEQ, SEQ, q // HD, HD // 2, 2)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    x0, x1 = t[..., 0], t[..., 1]
    rot = torch.stack([x0 * c + x1 * s, x1 * c - x0 * s], dim=-1)
    rope = (torch.arange(q // HD, device=dy.device) < ROT // HD)[None, None, :, None, None]
    return (torch.where(rope, rot, t).reshape(m, q) * rstd[:, None]), zdz


def _flip_f32(dy, y, rstd, cos, sin):
    m, q = dy.shape
    dyf = dy.float()
    zdz = (y.float() * dyf).sum(-1)
    t = dyf.view(m // SEQ, SEQ, q // HD, HD // 2, 2)
    c = cos[None, :, None, :, None]
    s = torch.stack([sin, -sin], dim=-1)[None, :, None, :, :]  # (x0 c + x1 s, x1 c + x0 (-s))
    rot = t * c + t.flip(-1) * s
    rope = (torch.arange(q // HD, device=dy.device) < ROT // HD)[None, None, :, None, None]
    return (torch.where(rope, rot, t).reshape(m, q) * rstd[:, None]), zdz


def _variants():
    from coda_titan.kernels.cute.norm_rope import _rope_bwd_f32
    from coda_titan.kernels.scaling import quantize_e5m2_site

    def current(dy, y, rstd, cos, sin):
        return _rope_bwd_f32(dy, y, rstd, cos, sin, ROT, HD)

    out = {}
    for name, f32 in (("current", current), ("masked", _masked_f32), ("flip", _flip_f32)):
        def bf16(dy, y, rstd, cos, sin, f32=f32):
            da, zdz = f32(dy, y, rstd, cos, sin)
            return da.to(dy.dtype), zdz

        def fp8(dy, y, rstd, cos, sin, inv, f32=f32):
            da, zdz = f32(dy, y, rstd, cos, sin)
            return (da.to(dy.dtype), zdz, *quantize_e5m2_site(da, inv))

        out[name] = bf16
        out[f"{name}_fp8"] = fp8
    return out


def main() -> int:
    doc = {**header(), "kind": "probe_rope_bwd", "shape": {"tokens": M, "seq": SEQ, "q_heads": H, "kv_heads": HKV,
                                                           "head_dim": HD},
           "timing": "GPU ms per call of 20 enqueued back to back after 3 warm-up calls, in 5 alternations of the variants",
           "rows": []}
    path = out_json("probe_rope_bwd")
    g = torch.Generator(device="cuda").manual_seed(0)
    q = (H + 2 * HKV) * HD
    dy = (torch.randn(M, q, device="cuda", generator=g) * 1e-3).to(torch.bfloat16)
    y = torch.randn(M, q, device="cuda", generator=g).to(torch.bfloat16)
    rstd = torch.rand(M, device="cuda", generator=g) + 0.5
    cos, sin = _tables("cuda")
    inv = torch.tensor(2.0 ** 20, device="cuda")
    fns = {k: torch.compile(v, dynamic=False, fullgraph=True) for k, v in _variants().items()}
    args = {k: (dy, y, rstd, cos, sin) + ((inv,) if k.endswith("_fp8") else ()) for k in fns}
    want = {k: fns["current_fp8" if k.endswith("_fp8") else "current"](*args[k]) for k in fns}
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(5):
        for k, f in fns.items():
            times[k].append(_streamed(lambda f=f, a=args[k]: f(*a))["gpu_ms"])
    for k, f in fns.items():
        got = f(*args[k])
        same = all(torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a, b.view(torch.uint8)
                               if b.dtype.itemsize == 1 else b) for a, b in zip(got, want[k]))
        ts = sorted(times[k])
        log_row(doc, "rows", {"variant": k, "gpu_ms": times[k], "median_ms": ts[len(ts) // 2], "bits_equal_current": same},
                path)
        print(f"{k:14s} {ts[len(ts) // 2]:.4f} ms  bits equal to current: {same}", flush=True)
    print("wrote", path, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
