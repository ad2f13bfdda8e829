"""fp8 formats and scale math: the e4m3 quantizer against an fp64 emulation of round-to-nearest-even, and the
e5m2 stochastic rounding against its definition, both written here from the formats' definitions."""

import pytest
import torch

from coda_titan.kernels.scaling import E4M3_MAX, E5M2_MAX, amax_abs, lowbias32, quantize_e4m3, quantize_e5m2_sr

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


def _lowbias32_words(x: int) -> int:
    """Wellons' lowbias32 on one 32-bit word, as its author defines it."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_e5m2_stochastic_rounding_picks_a_neighbour_with_the_probability_of_its_distance():
    """``quantize_e5m2_sr`` (``fp8_lm_head_dw``'s codes): each code is one of the two e5m2 values around v (from
    the format: 2 mantissa bits, steps of 2^(e - 2) in binade e, e >= -14), the upper one (in magnitude) with
    probability (|v| - lo) / step, so E[q] = v: over n = 4096 counters the share that rounds up is within 5
    binomial standard deviations of it, for every v. Values on the grid stay, saturation clamps, the same seed
    and counters repeat the codes and another seed draws others; the hash is lowbias32 word for word."""
    words = torch.tensor([0, 1, 5, 2**31, 2**32 - 1, 123456789], dtype=torch.int64)
    assert [int(w) for w in lowbias32(words)] == [_lowbias32_words(int(w)) for w in words]
    gen = torch.Generator().manual_seed(3)
    v = torch.cat([torch.randn(48, generator=gen, dtype=torch.float64) * 10.0 ** torch.randint(-3, 4, (48,),
                                                                                               generator=gen),
                   torch.tensor([1.1, -1.1, 2.0 ** -13 * 1.3, 50000.0, -3.0, 0.0])]).float().double()
    n = 4096
    offsets = torch.arange(n, dtype=torch.int64) * 7919
    e = torch.floor(torch.log2(v.abs().clamp(min=2.0 ** -14)))
    step = 2.0 ** (e - 2)
    lo = torch.floor(v.abs() / step) * step
    frac = (v.abs() - lo) / step
    for i in range(v.numel()):
        q = quantize_e5m2_sr(v[i].expand(n).float(), torch.tensor(1.0), 11, offsets).double()
        up = q.abs() == lo[i] + step[i]
        assert bool(((q.abs() == lo[i]) | up).all() & ((q * v[i]) >= 0).all()), (float(v[i]), q.unique().tolist())
        sd = (frac[i] * (1 - frac[i]) / n) ** 0.5
        assert abs(float(up.double().mean() - frac[i])) <= 5 * sd + 1e-12, (float(v[i]), float(up.double().mean()),
                                                                          float(frac[i]))
    grid = torch.tensor([1.0, -1.25, 1.75 * 2.0 ** 10, 57344.0, 2.0 ** -14])
    assert torch.equal(quantize_e5m2_sr(grid, torch.tensor(1.0), 5, torch.arange(5)).float(), grid)
    big = quantize_e5m2_sr(torch.tensor([1e6, -1e6]), torch.tensor(1.0), 5, torch.arange(2)).float()
    assert big.tolist() == [E5M2_MAX, -E5M2_MAX]
    x = torch.randn(4096, generator=gen)
    a, b = (quantize_e5m2_sr(x, torch.tensor(4.0), s, offsets).view(torch.uint8) for s in (1, 1))
    c = quantize_e5m2_sr(x, torch.tensor(4.0), 2, offsets).view(torch.uint8)
    assert torch.equal(a, b) and not torch.equal(a, c)
