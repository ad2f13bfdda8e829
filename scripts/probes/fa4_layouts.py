"""Probe (GPU): FA4 forward and backward per q/k/v memory layout, at the 1B attention shape.

    source .gpu/part2/activate.sh && python3 -m scripts.probes.fa4_layouts [--bs 2] [--seqlen 8192]

In the step, FA4 runs slower inside CODA than inside stock TorchTitan (the profiles of
``families``), and the inputs differ only in layout: stock's q, k and v are three contiguous
(bs, seq, heads, hd) tensors, CODA's are column slices of F3's one (tokens, (hq + 2 hkv) hd)
output. This times (median of triton's do_bench after one untimed call), per layout of q, k, v:

* ``separate``: three contiguous tensors (stock; the floor's layout);
* ``packed``: slices of one packed buffer (CODA today);
* ``packed_kv``: q a slice of the packed buffer, k and v contiguous copies (the copy timed apart);
* ``head_major``: (bs, heads, seq, hd) contiguous, seen as (bs, seq, heads, hd);

and for the backward also dq, dk, dv written as slices of one packed buffer (``_packed_grads``), the
layout F3's backward reads, against three contiguous tensors. Writes ``$OUT/probe_fa4_layouts_<gpu>.json``
after every row.
"""

from __future__ import annotations

import argparse

import torch

from scripts.bench.common import BF, bench, header, log_row, out_json


def _layouts(bs, s, hq, hkv, hd, gen):
    """{name: (q, k, v)} of one set of values in each layout (each (bs, seq, heads, hd))."""
    packed = (torch.randn(bs * s, (hq + 2 * hkv) * hd, device="cuda", generator=gen) * 0.5).to(BF)
    q, k, v = (t.view(bs, s, -1, hd) for t in packed.split([hq * hd, hkv * hd, hkv * hd], dim=1))
    head_major = tuple(t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    return {"separate": (q.contiguous(), k.contiguous(), v.contiguous()), "packed": (q, k, v),
            "packed_kv": (q, k.contiguous(), v.contiguous()), "head_major": head_major}


def _packed_grads(q, k, v):
    """dq, dk, dv as slices of one (tokens, (hq + 2 hkv) hd) buffer, as F3's backward reads them."""
    bs, s, hq, hd = q.shape
    hkv = k.shape[2]
    buf = torch.empty(bs * s, (hq + 2 * hkv) * hd, device="cuda", dtype=q.dtype)
    return tuple(t.view(bs, s, -1, hd) for t in buf.split([hq * hd, hkv * hd, hkv * hd], dim=1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.probes.fa4_layouts", description=__doc__.split("\n\n")[0])
    ap.add_argument("--bs", type=int, default=2)
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--heads", type=int, nargs=3, default=[32, 8, 64], metavar=("HQ", "HKV", "HD"))
    args = ap.parse_args(argv)
    from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd

    hq, hkv, hd = args.heads
    bs, s = args.bs, args.seqlen
    gen = torch.Generator(device="cuda").manual_seed(0)
    path = out_json("probe_fa4_layouts")
    doc = {**header(), "kind": "probe_fa4_layouts", "bs": bs, "seqlen": s, "heads": [hq, hkv, hd],
           "timing": "triton.testing.do_bench median after one untimed call", "rows": []}
    scale = hd**-0.5
    dout = (torch.randn(bs, s, hq, hd, device="cuda", generator=gen) * 0.1).to(BF)
    layouts = _layouts(bs, s, hq, hkv, hd, gen)
    packed = layouts["packed"]
    for name, (q, k, v) in layouts.items():
        out, lse, *_ = _flash_attn_fwd(q, k, v, softmax_scale=scale, causal=True, return_lse=True)
        fwd = bench(lambda: _flash_attn_fwd(q, k, v, softmax_scale=scale, causal=True, return_lse=True))
        row = {"layout": name, "strides": [list(t.stride()) for t in (q, k, v)], "fwd_ms": fwd}
        for grads, (dq, dk, dv) in (("separate", tuple(torch.empty(t.shape, dtype=BF, device="cuda") for t in (q, k, v))),
                                    ("packed", _packed_grads(q, k, v))):
            row[f"bwd_ms_grads_{grads}"] = bench(
                lambda dq=dq, dk=dk, dv=dv: _flash_attn_bwd(q, k, v, out, dout, lse, scale, True, dq=dq, dk=dk, dv=dv))
        if name == "packed_kv":  # the two copies this layout costs (from the packed slices)
            _, kp, vp = packed
            row["kv_copy_ms"] = bench(lambda: (k.copy_(kp), v.copy_(vp)))
        log_row(doc, "rows", row, path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
