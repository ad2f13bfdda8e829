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
* ``q_kv``: q contiguous, k and v slices of one (tokens, 2 hkv hd) buffer (F3 as two GEMMs: q, then k v);

and for the backward also dq, dk, dv written as slices of one packed buffer (``_packed_grads``), the
layout F3's backward reads, and as dq apart from one dk dv buffer (``_q_kv_grads``), against three
contiguous tensors.

Then F3 itself (``--f3``, on by default): the program (``coda::norm_rope`` / ``norm_rope_fp8``, the
cute kernels, autotuned) on all of W_qkv against the same program on row slices of it (``f3_splits``:
q then k v, and q, k, v apart), GPU ms per layer each way: what writing q (and k, v) contiguous would
cost F3, beside what the layouts above gain FA4. Writes ``$OUT/probe_fa4_layouts_<gpu>.json`` after
every row.
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
    kv = torch.cat([k, v], dim=2).reshape(bs * s, 2 * hkv * hd)  # one (tokens, 2 hkv hd) buffer
    k2, v2 = (t.view(bs, s, -1, hd) for t in kv.split([hkv * hd, hkv * hd], dim=1))
    return {"separate": (q.contiguous(), k.contiguous(), v.contiguous()), "packed": (q, k, v),
            "packed_kv": (q, k.contiguous(), v.contiguous()), "head_major": head_major,
            "q_kv": (q.contiguous(), k2, v2)}


def f3_splits(n_q: int, n_kv: int, head_dim: int) -> dict:
    """{name: [(first row, rows, rotated heads), ...]}: F3 on all of W_qkv's rows (``packed``) or as
    calls on row slices of it, each rotating its leading heads as the whole program does (q's and k's
    heads, v's not): ``q_kv`` (q, then k and v) and ``q_k_v`` (three calls)."""
    q, kv = n_q * head_dim, n_kv * head_dim
    return {"packed": [(0, q + 2 * kv, n_q + n_kv)], "q_kv": [(0, q, n_q), (q, 2 * kv, n_kv)],
            "q_k_v": [(0, q, n_q), (q, kv, n_kv), (q + kv, kv, 0)]}


def f3_calls(split, h, rstd, weight, freqs, seqlen: int, head_dim: int, scale=None):
    """The F3 program's calls of one ``f3_splits`` entry: a callable returning each call's output."""
    import coda_titan.kernels  # noqa: F401  (registers the coda ops)

    ops = torch.ops.coda

    def call(first, rows, rot):
        w = weight[first:first + rows]
        if scale is None:
            return ops.norm_rope(h, rstd, w, freqs, seqlen, rot, head_dim)
        return ops.norm_rope_fp8(h, rstd, w, scale, freqs, seqlen, rot, head_dim, BF)

    return lambda: [call(*c) for c in split]


def _packed_grads(q, k, v):
    """dq, dk, dv as slices of one (tokens, (hq + 2 hkv) hd) buffer, as F3's backward reads them."""
    bs, s, hq, hd = q.shape
    hkv = k.shape[2]
    buf = torch.empty(bs * s, (hq + 2 * hkv) * hd, device="cuda", dtype=q.dtype)
    return tuple(t.view(bs, s, -1, hd) for t in buf.split([hq * hd, hkv * hd, hkv * hd], dim=1))


def _q_kv_grads(q, k, v):
    """dq contiguous, dk and dv as slices of one (tokens, 2 hkv hd) buffer (the ``q_kv`` layout's)."""
    bs, s, hkv, hd = k.shape
    dkv = torch.empty(bs * s, 2 * hkv * hd, device="cuda", dtype=q.dtype)
    return (torch.empty(q.shape, device="cuda", dtype=q.dtype),
            *(t.view(bs, s, -1, hd) for t in dkv.split([hkv * hd, hkv * hd], dim=1)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.probes.fa4_layouts", description=__doc__.split("\n\n")[0])
    ap.add_argument("--bs", type=int, default=2)
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--heads", type=int, nargs=3, default=[32, 8, 64], metavar=("HQ", "HKV", "HD"))
    ap.add_argument("--no-f3", dest="f3", action="store_false", help="skip F3's rows")
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
                                    ("packed", _packed_grads(q, k, v)), ("q_kv", _q_kv_grads(q, k, v))):
            row[f"bwd_ms_grads_{grads}"] = bench(
                lambda dq=dq, dk=dk, dv=dv: _flash_attn_bwd(q, k, v, out, dout, lse, scale, True, dq=dq, dk=dk, dv=dv))
        if name == "packed_kv":  # the two copies this layout costs (from the packed slices)
            _, kp, vp = packed
            row["kv_copy_ms"] = bench(lambda: (k.copy_(kp), v.copy_(vp)))
        log_row(doc, "rows", row, path)
    if args.f3:
        _f3_rows(doc, path, bs * s, s, hq, hkv, hd, gen)
    return 0


def _f3_rows(doc, path, m, seqlen, hq, hkv, hd, gen):
    """``f3`` rows: F3 per ``f3_splits`` entry in bf16 and fp8 (1B shapes: d = 2048), ms per layer."""
    import coda_titan.kernels.cute  # noqa: F401  (the CUDA kernels of the coda ops)
    from coda_titan.kernels.scaling import E4M3
    from coda_titan.model.rope import rope_freqs
    from torchtitan.models.llama3.model.args import RoPEScalingArgs

    d = 2048
    freqs = rope_freqs(hd, 500000.0, RoPEScalingArgs()).cuda()
    h = (torch.randn(m, d, device="cuda", generator=gen) * 0.5).to(BF)
    w = (torch.randn((hq + 2 * hkv) * hd, d, device="cuda", generator=gen) * d**-0.5).to(BF)
    rstd = torch.rand(m, device="cuda", generator=gen) + 0.5
    operands = {"bf16": (h, w, None), "fp8": (h.to(E4M3), (w * 16).to(E4M3), torch.tensor(1 / 16, device="cuda"))}
    doc.setdefault("f3", [])
    for prec, (a, b, scale) in operands.items():
        full = None
        for name, split in f3_splits(hq, hkv, hd).items():
            fn = f3_calls(split, a, rstd, b, freqs, seqlen, hd, scale)
            row = {"precision": prec, "split": name, "calls": len(split)}
            try:
                got = torch.cat(fn(), dim=1)  # (untimed: compiles and autotunes each new shape)
                full = got if full is None else full
                row.update(ms=bench(fn), same_as_packed=bool(torch.equal(got, full)))
            except Exception as e:  # noqa: BLE001 - a split the kernels refuse is recorded as such
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            log_row(doc, "f3", row, path)


if __name__ == "__main__":
    raise SystemExit(main())
