"""F1 residual_rms: outputs and backward (gradcheck, fp64), the fp8 producers (e4m3 H and its amax),
the ops, and the cute kernels against the reference (GPU)."""

import pytest
import torch
from torch.library import opcheck

from coda_titan.kernels import get_backend
from coda_titan.kernels._common import tile_sumsq
from coda_titan.kernels.scaling import E4M3_MAX, e4m3_step, inv_scale_from_amax, quantize_e4m3
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
        step = e4m3_step(want)
        assert (diff <= step * 1.0001).all()
        assert (diff > 0).float().mean() < 1e-2


def _q_inputs(gen, m, k, d, device="cpu"):
    """e4m3 yq, Wq with their dequantization scales, and the residual / gamma (fp64 on the CPU)."""
    from coda_titan.kernels.scaling import E4M3

    yq = (torch.randn(m, k, generator=gen, device=device) * 40).clamp(-448, 448).to(E4M3)
    wq = (torch.randn(d, k, generator=gen, device=device) * 40).clamp(-448, 448).to(E4M3)
    s_y, s_w = torch.tensor(0.03125, device=device), torch.tensor(1 / (40 * 40 * k**0.5), device=device)
    return yq, wq, s_y, s_w


@pytest.mark.parametrize("inv", [None, 64.0])
def test_fp8_mainloop_f1_is_f1_on_the_dequantized_operands(inv):
    """``residual_rms_q[_fp8]`` (fp8 mainloop) equals ``residual_rms[_fp8]`` on yq * s_y and Wq * s_w:
    in fp64 the e4m3 products are exact and the scale factors out of the sum, so the two agree to a
    few fp64 roundings; Hq and amax follow H as in the bf16-mainloop producer."""
    gen = torch.Generator().manual_seed(11)
    m, k, d = 40, 64, 48
    yq, wq, s_y, s_w = _q_inputs(gen, m, k, d)
    res, gamma = torch.randn(m, d, generator=gen, dtype=torch.float64), torch.rand(d, generator=gen, dtype=torch.float64) + 0.5
    y, w = yq.double() * s_y.double(), wq.double() * s_w.double()
    got = TORCH.residual_rms_q(yq=yq, wq=wq, scale=s_y * s_w, residual=res, gamma=gamma, tile_n=16)
    want = TORCH.residual_rms(y=y, weight=w, residual=res, gamma=gamma, tile_n=16)
    for g, w_ in zip(got, want):
        torch.testing.assert_close(g, w_, rtol=1e-12, atol=1e-12)
    inv_t = None if inv is None else torch.tensor(inv, dtype=torch.float64)
    x, h, s, hq, amax = TORCH.residual_rms_q_fp8(yq=yq, wq=wq, scale=s_y * s_w, residual=res, gamma=gamma, tile_n=16,
                                                 inv_scale=inv_t)
    assert torch.equal(x, got[0]) and torch.equal(h, got[1]) and torch.equal(s, got[2])
    assert amax == h.abs().amax()
    used = inv_scale_from_amax(amax) if inv is None else inv_t
    assert torch.equal(hq.float(), quantize_e4m3(h, used).float())
    # bf16 residual: fp32 accumulator, one rounding of X on store (as every F1). Against fp64 on the
    # unrounded residual, X moves by the residual's own bf16 rounding (<= u |res|, u = 2^-8), by the
    # store's (<= u |X|, plus the first two's carry, hence the 1.01) and by the fp32 sum of the k exact
    # products (<= k 2^-24 sum |products|, the standard recursive-summation bound)
    xb, hb, sb = TORCH.residual_rms_q(yq=yq, wq=wq, scale=s_y * s_w, residual=res.to(BF), gamma=gamma.to(BF), tile_n=16)
    assert xb.dtype == BF and sb.dtype == torch.float32
    abs_products = (yq.double().abs() @ wq.double().abs().t()) * (s_y * s_w).double()
    bound = 2**-8 * (got[0].abs() + res.abs()) * 1.01 + k * 2**-24 * abs_products
    assert ((xb.double() - got[0]).abs() <= bound).all()


def test_fp8_mainloop_f1_ops_schemas_and_fakes():
    gen = torch.Generator().manual_seed(12)
    yq, wq, s_y, s_w = _q_inputs(gen, 32, 48, 64)
    res, g = torch.randn(32, 64, generator=gen), torch.rand(64, generator=gen)
    opcheck(torch.ops.coda.residual_rms_q.default, (yq, wq, s_y * s_w, res, g, 16), test_utils=("test_faketensor",))
    for inv in (None, torch.tensor(3.0)):
        for op in (torch.ops.coda.residual_rms_q_fp8, torch.ops.coda.residual_rms_q_fp8_t):
            opcheck(op.default, (yq, wq, s_y * s_w, res, g, 16, inv), test_utils=("test_faketensor",))
        # residual_rms_q_fp8_t (fp8_mlp_h_t, fp8_qkv_wgrad): residual_rms_q_fp8's outputs but H, and Hq^T, (d, M)
        # token-major
        x, s, hq, hq_t, amax_t = TORCH.residual_rms_q_fp8_t(yq=yq, wq=wq, scale=s_y * s_w, residual=res, gamma=g,
                                                          tile_n=16, inv_scale=inv)
        want = TORCH.residual_rms_q_fp8(yq=yq, wq=wq, scale=s_y * s_w, residual=res, gamma=g, tile_n=16, inv_scale=inv)
        assert all(torch.equal(a.float(), b.float()) for a, b in zip((x, s, hq, amax_t), want[:1] + want[2:]))
        assert hq_t.shape == (64, 32) and hq_t.is_contiguous() and torch.equal(hq_t.float(), want[3].t().float())


@pytest.mark.gpu
@pytest.mark.parametrize("transposed", [False, True], ids=["hq", "hq_t"])
@pytest.mark.parametrize("d", DIMS)
def test_cute_fp8_mainloop_f1_matches_reference(d, transposed):
    """The fp8-mainloop F1 kernels against the reference in fp64 on the same e4m3 operands, with the
    bound of ``helpers.check_cute_matches_reference`` (2 x the in-precision reference's error + 2^-24),
    and Hq against the fp64 H quantized with the same scale: within one e4m3 step plus the kernel H's
    own elementwise error (its accumulator's, ``helpers.fp8_mma_error``) on the scaled grid.

    The in-precision reference of an fp8 mainloop is not an fp32 sum: on SM90 an fp8 MMA keeps its
    running sum in the tensor core with fewer mantissa bits than fp32 (DeepSeek-V3, sec. 3.3.2:
    "around 14 bits" on H800), and quack's mainloop, like cuBLAS with fast accumulation, never
    promotes it. So the reference's X is cuBLAS's fp8 GEMM with fast accumulation on the same
    operands (the same accumulator, another order), plus the residual in fp32, and S, H and X
    follow from it as in the epilogue. (The first run held the fp32-summed reference to the fp32
    output S: 2.9e-6 against a bound of 1.4e-7 at d = 2048; the bf16 outputs hid it under their own
    rounding.) ``transposed``: the F1 that also stores Hq^T through an M-major 8-bit output
    (``residual_rms_q_fp8_t``, whose D is X and which writes no H) is held to the same bounds, and its Hq^T
    must be its Hq transposed, bit for bit (the same fp32 values through the same saturating conversion)."""
    from .helpers import assert_codes_within, fp8_mma_error, log_bound, poison, rel

    cute = get_backend("cute")
    gen = torch.Generator(device="cuda").manual_seed(d)
    m, k = 4000, 4 * d  # (K: the down-projection's FFN width)
    yq, wq, s_y, s_w = _q_inputs(gen, m, k, d, device="cuda")
    res = torch.randn(m, d, generator=gen, device="cuda").to(BF)
    gamma = (torch.rand(d, generator=gen, device="cuda") + 0.5).to(BF)
    kw = dict(yq=yq, wq=wq, scale=s_y * s_w, residual=res, gamma=gamma, tile_n=128)
    ref64 = list(TORCH.residual_rms_q(**{**kw, "residual": res.double(), "gamma": gamma.double()}))
    one = torch.ones((), device="cuda")
    acc = torch._scaled_mm(yq, wq.t(), scale_a=one, scale_b=one, out_dtype=torch.float32, use_fast_accum=True)
    x = acc * kw["scale"] + res.float()
    bf = [x.to(BF), (x * gamma.float()).to(BF), tile_sumsq(x, kw["tile_n"])]
    ref64[-1], bf[-1] = ref64[-1].sum(-1, keepdim=True), bf[-1].sum(-1, keepdim=True)
    poison()
    out = list(cute.residual_rms_q(**kw))
    inv = inv_scale_from_amax(ref64[1].abs().amax().float())
    if transposed:
        x8, s8, hq8, hq_t, amax8 = cute.residual_rms_q_fp8_t(**kw, inv_scale=inv)  # (no H: D is X)
        out8 = [x8, None, s8, hq8, amax8]
        assert hq_t.shape == (d, m) and hq_t.is_contiguous()
        apart = (hq_t.view(torch.uint8) != out8[3].t().contiguous().view(torch.uint8)).float().mean().item()
        log_bound(f"residual_rms_q_fp8_t Hq^T codes apart from its Hq transposed d={d}", err=apart, bound=0.0)
        assert apart == 0.0
    else:
        out8 = cute.residual_rms_q_fp8(**kw, inv_scale=inv)
    torch.cuda.synchronize()
    for i, (o, r64, b) in enumerate(zip(out, ref64, bf)):
        assert o.shape == r64.shape and o.dtype == b.dtype and not o.isnan().any()
        err, err_ref = rel(o, r64), rel(b, r64)
        bound = 2 * err_ref + 2.0**-24
        log_bound(f"residual_rms_q[{i}] d={d}", dtype=str(o.dtype), err=err, err_ref=err_ref, bound=bound)
        assert err <= bound, f"residual_rms_q d={d} output {i}: rel err {err:.3e} > 2 x {err_ref:.3e} + 2^-24"
    assert torch.equal(out8[0], out[0]) and (out8[1] is None or torch.equal(out8[1], out[1]))
    # Hq against the exact H quantized with the same scale. The kernel's H (fp32, before its cast) is off
    # the exact one by its accumulator's error (helpers.fp8_mma_error, elementwise) plus the fp32
    # residual add and gamma product (2^-23 |X|), times |gamma|; and two round-to-nearest casts of
    # values that far apart land at most that far plus one e4m3 step (of the larger code) apart.
    err_acc, _ = fp8_mma_error(yq, wq, kw["scale"])
    err_h = (err_acc + 2.0**-23 * ref64[0].abs()) * gamma.double().abs()
    got, want = out8[3].double(), quantize_e4m3(ref64[1].float(), inv).double()
    assert_codes_within(f"residual_rms_q_fp8 Hq d={d}", got, want, e4m3_step(torch.maximum(got.abs(), want.abs())),
                        err_h * inv.double())
    amax = ref64[1].abs().amax().item()  # (the amax moves by at most the largest H error)
    assert abs(out8[4].item() - amax) <= err_h.max().item() + 2.0**-24 * amax
