"""F1 residual_rms: outputs and backward (gradcheck, fp64), the fp8 producers (e4m3 H and its amax),
the ops, and the cute kernels against the reference (GPU)."""

import pytest
import torch
from torch.library import opcheck

from coda_titan.kernels import get_backend
from coda_titan.kernels.scaling import E4M3_MAX, inv_scale_from_amax, quantize_e4m3
from coda_titan.model.autograd import ResidualRMS

from .helpers import BF, CFG, D, DIMS, M, TORCH, check_cute_matches_reference, cuda_inputs, op_cases, rand64


def test_residual_rms_backward():
    y, w, res, gamma = rand64(M, 7), rand64(D, 7), rand64(M, D), rand64(D)

    def f(y, w, res):
        return ResidualRMS.apply(y, w, res, gamma, CFG)[0]

    assert torch.autograd.gradcheck(f, (y, w, res))


def test_residual_rms_outputs():
    y, w, res, gamma = rand64(M, 7), rand64(D, 7), rand64(M, D), rand64(D)
    x, h, s = ResidualRMS.apply(y, w, res, gamma, CFG)
    ref = y @ w.t() + res
    torch.testing.assert_close(x, ref)
    torch.testing.assert_close(h, ref * gamma)
    torch.testing.assert_close(s.sum(-1), (ref * ref).sum(-1))
    assert s.shape == (M, 2)  # ceil(24 / 16) tiles
    assert not h.requires_grad and not s.requires_grad


@pytest.mark.parametrize("current", [True, False])
def test_producers_write_h_and_its_e4m3_copy(current):
    gen = torch.Generator().manual_seed(4)
    m, k, d = 40, 48, 64
    y, wo, res = torch.randn(m, k, generator=gen), torch.randn(d, k, generator=gen) * 0.2, torch.randn(m, d, generator=gen)
    gamma = torch.rand(d, generator=gen) + 0.5
    inv = None if current else torch.tensor(100.0)
    x, h, s, hq, amax = TORCH.residual_rms_fp8(y=y, weight=wo, residual=res, gamma=gamma, tile_n=16, inv_scale=inv)
    x0, h0, s0 = TORCH.residual_rms(y=y, weight=wo, residual=res, gamma=gamma, tile_n=16)
    assert torch.equal(x, x0) and torch.equal(h, h0) and torch.equal(s, s0)
    hf = (y @ wo.t() + res) * gamma
    assert torch.allclose(amax, hf.abs().amax(), rtol=1e-6)
    used = inv_scale_from_amax(amax) if current else inv
    assert torch.equal(hq.float(), quantize_e4m3(hf, used).float())
    if current:
        assert hq.float().abs().max() == E4M3_MAX
    else:  # a scale from an older, smaller amax: the outliers saturate, nothing overflows to NaN
        assert (hf.abs() * 100 > E4M3_MAX).any() and hq.float().isfinite().all()
        assert hq.float().abs().max() == E4M3_MAX
    h1, s1, hq1, amax1 = TORCH.rms_partial_fp8(x=x, gamma=gamma, tile_n=16, inv_scale=inv)
    assert torch.equal(h1, TORCH.rms_partial(x=x, gamma=gamma, tile_n=16)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ['residual_rms'])
def test_opcheck(name, dtype):
    """Schema, fake and aot_dispatch of the op (its reference kernel on CPU)."""
    opcheck(getattr(torch.ops.coda, name).default, op_cases(dtype)[name])


def test_fp8_producer_ops_schemas_and_fakes():
    y, wo, res, g = torch.randn(32, 48), torch.randn(64, 48), torch.randn(32, 64), torch.rand(64)
    for inv in (None, torch.tensor(3.0)):
        # (test_schema compares outputs with arithmetic that CPU float8 tensors do not have)
        opcheck(torch.ops.coda.residual_rms_fp8.default, (y, wo, res, g, 16, inv), test_utils=("test_faketensor",))
        opcheck(torch.ops.coda.rms_partial_fp8.default, (res, g, 16, inv), test_utils=("test_faketensor",))


@pytest.mark.gpu
@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("name", ['residual_rms'])
def test_cute_matches_reference(name, d):
    check_cute_matches_reference(name, d)


@pytest.mark.gpu
def test_unsupported_shape_falls_back_with_one_warning(caplog):
    from coda_titan.kernels import get_backend

    be = get_backend("cute")
    y = torch.randn(64, 20, device="cuda", dtype=BF)  # K = 20: not a multiple of 8
    w = torch.randn(32, 20, device="cuda", dtype=BF)
    res, g = torch.randn(64, 32, device="cuda", dtype=BF), torch.randn(32, device="cuda", dtype=BF)
    with caplog.at_level("WARNING", logger="coda_titan"):
        for _ in range(3):
            x, h, s = be.residual_rms(y=y, weight=w, residual=res, gamma=g, tile_n=128)
    ref = get_backend("torch").residual_rms(y=y, weight=w, residual=res, gamma=g, tile_n=128)
    torch.testing.assert_close(x, ref[0])
    assert sum("cannot take" in r.message for r in caplog.records) == 1


@pytest.mark.gpu
def test_cute_f1_writes_e4m3_h():
    import coda_titan.kernels.cute  # noqa: F401

    cute = get_backend("cute")
    gen = torch.Generator(device="cuda").manual_seed(1)
    m, k, d = 4000, 2048, 2048
    y, wo, _ = cuda_inputs(m, k, d, gen)
    res = torch.randn(m, d, generator=gen, device="cuda").to(BF)
    gamma = (torch.rand(d, generator=gen, device="cuda") + 0.5).to(BF)
    hf = ((y.double() @ wo.double().t()) + res.double()) * gamma.double()
    for inv in (inv_scale_from_amax(hf.abs().amax().float()), inv_scale_from_amax(hf.abs().amax().float() / 4)):
        x, h, s, hq, amax = cute.residual_rms_fp8(y=y, weight=wo, residual=res, gamma=gamma, tile_n=128, inv_scale=inv)
        x0, h0, s0 = cute.residual_rms(y=y, weight=wo, residual=res, gamma=gamma, tile_n=128)
        assert torch.equal(x, x0) and torch.equal(h, h0) and torch.allclose(s, s0, rtol=1e-6)
        assert abs(amax.item() - hf.abs().amax().item()) <= 1e-5 * hf.abs().amax().item()
        got = hq.float()
        want = quantize_e4m3(hf.float(), inv).float()
        assert got.isfinite().all() and got.abs().max() <= E4M3_MAX
        # the GEMM's summation order differs from fp64's: a value next to a rounding boundary may
        # land one e4m3 step away, never more
        diff = (got - want).abs()
        step = torch.where(want.abs() >= 2**-6, want.abs() * 2**-3, torch.full_like(want, 2**-9))
        assert (diff <= step * 1.0001).all()
        assert (diff > 0).float().mean() < 1e-2
