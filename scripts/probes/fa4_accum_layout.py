"""Probe (GPU): the storage order of FlashAttention-4's fp32 gradient accumulators on SM90 (dq, and dk, dv under
GQA), which its backward's three postprocess kernels convert to bf16, at the 1B's attention shapes (batch 2,
seq 8192, 32 query heads, 8 key/value heads, head dim 64, causal).

    source .gpu/part2/activate.sh && python3 -m scripts.probes.fa4_accum_layout        (gpu_train.sh fa4accum)

Why: a B1 that reads the accumulators in place of the bf16 gradients would skip writing and re-reading 100 MB a
layer (docs/fp8.md, forty-sixth session), if it can read the order the postprocess decodes. Method: one backward
with the postprocess calls recorded; then each recorded call run again on synthetic accumulators whose element i
holds the 7-bit digit (i >> 7k) & 127, divided by the call's scale (a power of two), four times: each output
element's four digits give the accumulator index it came from. Reported per accumulator: its shape, the output's
shape and strides, whether every (batch, head, row block) tile is its first tile's permutation shifted by a
constant, the first tile's offsets (row-major over the tile's rows and head-dim columns), and each row's and
column's index bits as offset bits (the order as a permutation of address bits, where it is one). Writes
``$OUT/probe_fa4_accum_layout_<gpu>.json``.
"""

from __future__ import annotations

import torch

from scripts.bench.common import header, log_row, out_json

B, S, HQ, HKV, D = 2, 8192, 32, 8, 64
BF = torch.bfloat16


def _positions(orig, call) -> torch.Tensor:
    """For each output element (flat, in the output's own index order), the accumulator index it reads."""
    accum, out, scale, args, kwargs = call
    i = torch.arange(accum.numel(), device=accum.device, dtype=torch.int64)
    pos = torch.zeros(out.numel(), device=accum.device, dtype=torch.int64)
    for k in range(4):
        synthetic = (((i >> (7 * k)) & 127).to(torch.float32) / float(scale)).view(accum.shape)
        o = torch.full_like(out, -1.0)
        orig(synthetic, o, scale, *args, **kwargs)
        digit = o.float().round().long()
        assert bool((digit >= 0).all()) and bool((digit < 128).all()), "an output the postprocess did not write"
        pos |= digit.reshape(-1) << (7 * k)
    return pos


def _bits(offsets: torch.Tensor, rows: int, cols: int) -> dict:
    """Each row / column index bit's offset bit: offset(r, c) = XOR of the bits' images, where it is so."""
    rb, cb = rows.bit_length() - 1, cols.bit_length() - 1
    base = int(offsets[0, 0])
    image = {f"r{b}": int(offsets[1 << b, 0]) ^ base for b in range(rb)}
    image.update({f"c{b}": int(offsets[0, 1 << b]) ^ base for b in range(cb)})
    r = torch.arange(rows, device=offsets.device)[:, None]
    c = torch.arange(cols, device=offsets.device)[None, :]
    pred = torch.full((rows, cols), base, device=offsets.device, dtype=torch.int64)
    for b in range(rb):
        pred ^= ((r >> b) & 1) * image[f"r{b}"]
    for b in range(cb):
        pred ^= ((c >> b) & 1) * image[f"c{b}"]
    return {"image": image, "is_bit_permutation": bool(torch.equal(pred, offsets))}


def _report(name, call, pos, tile_m) -> dict:
    accum, out = call[0], call[1]
    b, s, h, d = out.shape
    # the output's own index order is (b, s, h, d) with its strides; view pos as that grid
    grid = pos.view(b, s, h, d).permute(0, 2, 1, 3)  # (b, h, s, d)
    tiles = grid.reshape(b, h, s // tile_m, tile_m, d)
    first = tiles[0, 0, 0]
    shifted = tiles - tiles[..., :1, :1]
    same = bool((shifted == (first - first[0, 0])).all())
    return {"name": name, "accum_shape": list(accum.shape), "out_shape": list(out.shape),
            "out_stride": list(out.stride()), "scale": float(call[2]), "tile_m": tile_m,
            "tiles_are_shifted_copies": same, "tile_bases": tiles[0, 0, :4, 0, 0].tolist(),
            "tile_base_next_head": int(tiles[0, 1, 0, 0, 0]), "tile_base_next_batch": int(tiles[1, 0, 0, 0, 0]),
            "bits": _bits(first - first[0, 0], tile_m, d), "first_tile": (first - first[0, 0]).tolist()}


def backward_with_postprocess_calls(seed: int = 0):
    """FA4's forward and backward at this probe's shapes with the backward's postprocess calls recorded:
    (q, k, v, (dq, dk, dv), [(accumulator, output, scale, args, kwargs) of each call], the postprocess function)."""
    import flash_attn.cute.interface as fi

    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, S, HQ, D, device="cuda", generator=gen).to(BF)
    k, v = (torch.randn(B, S, HKV, D, device="cuda", generator=gen).to(BF) for _ in range(2))
    scale = D ** -0.5
    out, lse, *_ = fi._flash_attn_fwd(q, k, v, softmax_scale=scale, causal=True, return_lse=True)
    dout = torch.randn_like(out)
    calls, orig = [], fi._bwd_postprocess_convert

    def spy(accum, o, s, *args, **kwargs):
        calls.append((accum, o, s, args, kwargs))
        return orig(accum, o, s, *args, **kwargs)

    spy.compile_cache = orig.compile_cache  # (the function finds its cache through its module name)
    fi._bwd_postprocess_convert = spy
    try:
        grads = fi._flash_attn_bwd(q, k, v, out, dout, lse, scale, True)[:3]
    finally:
        fi._bwd_postprocess_convert = orig
    return q, k, v, grads, calls, orig


def main():
    import flash_attn.cute.interface as fi

    _, _, _, _, calls, orig = backward_with_postprocess_calls()
    cfg = fi._tile_size_bwd_sm90(D, D, True, False)
    fields = ("m_block_size", "n_block_size", "SdP_swapAB", "dKV_swapAB", "dQ_swapAB", "AtomLayoutMSdP",
              "AtomLayoutNdKV", "AtomLayoutMdQ")
    doc = {**header(), "kind": "probe_fa4_accum_layout", "shapes": {"B": B, "S": S, "HQ": HQ, "HKV": HKV, "D": D},
           "bwd_config": {f: getattr(cfg, f) for f in fields}, "calls": len(calls), "rows": []}
    path = out_json("probe_fa4_accum_layout")
    for name, call, tile_m in zip(("dq", "dk", "dv"), calls, (cfg.m_block_size, cfg.n_block_size, cfg.n_block_size)):
        pos = _positions(orig, call)
        log_row(doc, "rows", _report(name, call, pos, tile_m), path)


if __name__ == "__main__":
    main()
