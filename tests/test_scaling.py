"""fp8 formats and scale math: the e4m3 quantizer against an fp64 emulation of round-to-nearest-even,
written here from the format's definition."""

import torch

from coda_titan.kernels.scaling import E4M3_MAX, quantize_e4m3

from .helpers import e4m3_round_fp64


def test_quantizer_is_round_to_nearest_even_with_saturation():
    gen = torch.Generator().manual_seed(0)
    grid = e4m3_round_fp64(torch.logspace(-10, 8.8, 300, base=2, dtype=torch.float64))
    grid = torch.unique(grid)
    ties = (grid[:-1] + grid[1:]) / 2  # exact midpoints: ties must go to the even neighbour
    v = torch.cat([
        torch.randn(2000, generator=gen, dtype=torch.float64) * 100,
        torch.randn(500, generator=gen, dtype=torch.float64) * 1e-3,
        ties, -ties, torch.tensor([0.0, 447.9, 448.0, 464.0, 1e6, -1e6], dtype=torch.float64),
    ]).float().double()  # representable in fp32, the kernel's compute dtype
    got = quantize_e4m3(v.float(), torch.tensor(1.0)).double()
    want = e4m3_round_fp64(v)
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} mismatches, e.g. {v[bad[:5]].tolist()} -> {got[bad[:5]].tolist()} vs {want[bad[:5]].tolist()}"
    assert got.abs().max() == E4M3_MAX and got.isfinite().all()
