"""fp8 formats and scale math: the e4m3 quantizer against an fp64 emulation of round-to-nearest-even,
written here from the format's definition."""

import pytest
import torch

from coda_titan.kernels.scaling import E4M3_MAX, amax_abs, quantize_e4m3

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


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_amax_abs_is_the_max_of_abs_bit_for_bit(device, dtype):
    """The one-pass amax (``amax_abs``) that the cute backend's eager gradient casts use gives
    ``t.abs().amax()``'s value and dtype exactly (a max is exact): a negative extreme, the
    2-D shape of a gradient, an inf, and NaN propagated, as the scale's callers expect."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gen = torch.Generator().manual_seed(1)
    t = (torch.randn(257, 96, generator=gen, dtype=torch.float64) * 3).to(dtype).to(device)
    t[100, 7] = -41.5  # the extreme is negative
    cases = [t, t[:, :64], t.t()]
    for special in (float("inf"), float("nan")):
        s = t.clone()
        s[3, 5] = special
        cases.append(s)
    for c in cases:
        got, want = amax_abs(c), c.abs().amax()
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want) or (got.isnan() and want.isnan()), (got, want)
    assert amax_abs(t).item() == 41.5
