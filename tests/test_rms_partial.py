"""rms_partial (prologue) and rstd_finalize: the op schemas; the fp8 prologue is checked with F1 in
test_residual_rms.py, the finalize kernel on the GPU."""

import pytest
import torch
from torch.library import opcheck


from .helpers import DIMS, check_cute_matches_reference, op_cases


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ['rms_partial', 'rstd_finalize'])
def test_opcheck(name, dtype):
    """Schema, fake and aot_dispatch of the op (its reference kernel on CPU)."""
    opcheck(getattr(torch.ops.coda, name).default, op_cases(dtype)[name])


@pytest.mark.gpu
@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("name", ['rstd_finalize'])
def test_cute_matches_reference(name, d):
    check_cute_matches_reference(name, d)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [2048, 4096, 3000])
def test_traced_rstd_finalize_under_compile_equals_the_op(d):
    """The rstd finalize as the compiled model runs it (``TRACED``: rsqrt(sum S * fp32(1/d) + eps), fused by
    inductor) against the op (quack's CuTeDSL kernel) on the same (M, n) partials, n = 1 (the model's) and 4.
    Bound: the two fp32 sums of the n positive partials, in possibly different orders, are each within
    gamma_{n-1} of the exact sum, so at most 2 (n - 1) 2^-24 apart relative; then product-plus-eps, one possibly
    an FMA where the other rounds the product first (1 ulp of the rsqrt's argument, 2^-23 relative); r moves
    by half its argument's relative change, and each side's rsqrt.approx adds at most 2^-22.9 relative error:
    |r - r'| <= ((n - 1) 2^-24 + 2^-24 + 2 * 2^-22.9) |r'|. Where d is a power of two and n = 1, s is exact and
    there is no sum, so both arguments are the same fp32 value and so is r (same instruction): no difference is
    allowed there."""
    import coda_titan.kernels.cute as cute_pkg
    from coda_titan.kernels import get_backend

    gen = torch.Generator(device="cuda").manual_seed(d)
    cute = get_backend("cute")
    torch._dynamo.reset()
    traced = torch.compile(lambda **kw: cute_pkg.TRACED["rstd_finalize"](**kw), fullgraph=True, dynamic=False)
    for tiles in (1, 4):
        s = torch.rand(16384, tiles, generator=gen, device="cuda") * d * 3 + 1e-3
        s[:7] = torch.tensor([0.0, 1e-30, 1e-8, 1.0, 1e6, 3e7, 0.5], device="cuda")[:, None]
        want = cute.rstd_finalize(partials=s, dim=d, eps=1e-5)
        got = traced(partials=s, dim=d, eps=1e-5)
        assert got.shape == want.shape and got.dtype == want.dtype == torch.float32
        if d & (d - 1) == 0 and tiles == 1:
            assert torch.equal(got, want), f"d {d}: {(got != want).sum().item()} of {got.numel()} differ"
        bound = ((tiles - 1) * 2.0**-24 + 2.0**-24 + 2 * 2.0**-22.9) * want.abs()
        worst = ((got - want).abs() / bound).max().item()
        assert worst <= 1.0, f"d {d}, {tiles} tiles: {worst:.3f} of the bound"
