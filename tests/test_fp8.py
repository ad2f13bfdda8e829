"""precision = "fp8": the e4m3 reference programs on CPU, and the cute kernels against them on the GPU.

CPU: the quantizer against an fp64 emulation of round-to-nearest-even e4m3 written here from the
format's definition; each fp8 program against the same math in fp64 on the same e4m3 operands; the
producers against the bf16 programs; the model (torch backend) against its bf16 twin, its delayed
scaling and its checkpoint compatibility.

GPU (``pytest -m gpu tests/test_fp8.py``): each fp8 kernel against the fp8 reference on the same
operands, bounded by torchao's own float8 error on the same inputs; the 1B model on the cute backend
against the torch backend.
"""

import copy
import dataclasses
import math
import os

import pytest
import torch

from coda_titan.kernels import get_backend
from coda_titan.kernels._common import interleave_rows
from coda_titan.kernels.scaling import E4M3, E4M3_MAX, inv_scale_from_amax, quantize_e4m3
from coda_titan.kernels.norm_rope import rotate as _rotate
from coda_titan.model.rope import rope_freqs
from coda_titan.titan.job_config import Coda
from torchtitan.models.llama3.model.args import RoPEScalingArgs

TORCH = get_backend("torch")


def _e4m3_round_fp64(v: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even onto the e4m3fn grid, saturating at 448, in fp64 (from the format:
    3 mantissa bits, exponent bias 7, min normal 2^-6, subnormal step 2^-9)."""
    out = torch.empty_like(v)
    for i, x in enumerate(v.tolist()):
        a = min(abs(x), E4M3_MAX)
        e = max(math.floor(math.log2(a)), -6) if a > 0 else -6
        step = 2.0 ** (e - 3)
        q = a / step
        lo = math.floor(q)
        frac = q - lo
        n = lo + (1 if frac > 0.5 or (frac == 0.5 and lo % 2 == 1) else 0)
        out[i] = math.copysign(min(n * step, E4M3_MAX), x)
    return out


def test_quantizer_is_round_to_nearest_even_with_saturation():
    gen = torch.Generator().manual_seed(0)
    grid = _e4m3_round_fp64(torch.logspace(-10, 8.8, 300, base=2, dtype=torch.float64))
    grid = torch.unique(grid)
    ties = (grid[:-1] + grid[1:]) / 2  # exact midpoints: ties must go to the even neighbour
    v = torch.cat([
        torch.randn(2000, generator=gen, dtype=torch.float64) * 100,
        torch.randn(500, generator=gen, dtype=torch.float64) * 1e-3,
        ties, -ties, torch.tensor([0.0, 447.9, 448.0, 464.0, 1e6, -1e6], dtype=torch.float64),
    ]).float().double()  # representable in fp32, the kernel's compute dtype
    got = quantize_e4m3(v.float(), torch.tensor(1.0)).double()
    want = _e4m3_round_fp64(v)
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} mismatches, e.g. {v[bad[:5]].tolist()} -> {got[bad[:5]].tolist()} vs {want[bad[:5]].tolist()}"
    assert got.abs().max() == E4M3_MAX and got.isfinite().all()


def test_tensorwise_weight_quantization():
    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    wq, s = TORCH.quantize_tensorwise(w=w)
    assert wq.dtype == E4M3 and s.shape == () and s.dtype == torch.float32
    assert wq.float().abs().max() == E4M3_MAX  # the amax element lands on the top of the range
    deq = wq.float() * s
    big = w.float().abs() > 2**-6 * s * 448 / 448  # normals of the scaled grid
    assert ((deq - w.float()).abs() <= 2**-4 * w.float().abs() + 1e-30)[big].all()


def test_layer_weight_pass_is_the_per_weight_quantization():
    from coda_titan.kernels._common import interleave_rows

    gen = torch.Generator().manual_seed(11)
    d, f, nq, nkv, layers = 32, 48, 32, 16, 3
    mk = lambda n, scale=1.0: [(torch.randn(n, d, generator=gen) * scale * (i + 1)).to(torch.bfloat16) for i in range(layers)]  # noqa: E731
    w1, w3, wq, wk, wv = mk(f), mk(f, 2.0), mk(nq), mk(nkv, 0.5), mk(nkv, 3.0)
    w13q, s13, qkvq, sqkv, w13t, qkvt = TORCH.fp8_layer_weights(w1=w1, w3=w3, wq=wq, wk=wk, wv=wv, w13_t=True, wqkv_t=True)
    assert len(w13q) == len(qkvq) == layers and s13.shape == sqkv.shape == (layers,)
    lean = TORCH.fp8_layer_weights(w1=w1, w3=w3, wq=wq, wk=wk, wv=wv, w13_t=False, wqkv_t=False)
    assert lean[4] == [] and lean[5] == []  # the transposed copies only when a fp8 dgrad asks for them
    assert all(torch.equal(a.float(), b.float()) for a, b in zip(lean[0] + lean[2], w13q + qkvq))
    for i in range(layers):
        want, s = TORCH.quantize_tensorwise(w=interleave_rows(w1[i], w3[i]))
        assert torch.equal(w13q[i].float(), want.float()) and s13[i] == s
        want, s = TORCH.quantize_tensorwise(w=torch.cat([wq[i], wk[i], wv[i]]))
        assert torch.equal(qkvq[i].float(), want.float()) and sqkv[i] == s
        assert torch.equal(qkvt[i].float(), want.float().t()) and qkvt[i].is_contiguous()
        assert torch.equal(w13t[i].float(), w13q[i].float().t()) and w13t[i].is_contiguous()
    assert s13[0] != s13[1]  # per weight, not one scale for all
    with pytest.raises(ValueError, match="one weight of each kind per layer"):
        TORCH.fp8_layer_weights(w1=w1, w3=w3[:2], wq=wq, wk=wk, wv=wv)


def _fp8_operands(m, k, n, gen, dtype=torch.float32):
    h = torch.randn(m, k, generator=gen, dtype=dtype) * 3
    w = torch.randn(n, k, generator=gen, dtype=dtype) * k**-0.5
    inv_h = inv_scale_from_amax(h.abs().amax().float())
    hq = quantize_e4m3(h.float(), inv_h)
    wq, s_w = TORCH.quantize_tensorwise(w=w.float())
    rstd = torch.rand(m, generator=gen, dtype=torch.float32) + 0.5
    return hq, wq, (s_w / inv_h).float(), rstd


def _rel(a, ref):
    a, ref = a.double(), ref.double()
    return ((a - ref).norm() / ref.norm()).item()


def test_norm_swiglu_fp8_matches_fp64_emulation():
    gen = torch.Generator().manual_seed(2)
    hq, wq, scale, rstd = _fp8_operands(70, 256, 2 * 96, gen)
    y, a = TORCH.norm_swiglu_fp8(hq=hq, rstd=rstd, w13q=wq, scale=scale, out_dtype=torch.float32)
    acc = hq.double() @ wq.double().t()  # e4m3 products are exact; fp64 sum
    v = acc * scale.double()
    z = v * rstd.double()[:, None]
    y64 = torch.nn.functional.silu(z[:, 0::2]) * z[:, 1::2]
    assert _rel(a, v) < 1e-6 and _rel(y, y64) < 1e-6
    y2, a2 = TORCH.norm_swiglu_fp8(hq=hq, rstd=rstd.double(), w13q=wq, scale=scale.double(), out_dtype=torch.float64)
    assert _rel(a2, v) < 1e-13 and _rel(y2, y64) < 1e-13
    with pytest.raises(TypeError, match="e4m3"):
        TORCH.norm_swiglu_fp8(hq=hq.float(), rstd=rstd, w13q=wq, scale=scale, out_dtype=torch.float32)


def test_norm_rope_fp8_matches_fp64_emulation():
    gen = torch.Generator().manual_seed(3)
    hd, hq_, hkv, seqlen = 32, 4, 2, 16
    q = (hq_ + 2 * hkv) * hd
    hq, wq, scale, rstd = _fp8_operands(2 * seqlen, 128, q, gen)
    freqs = rope_freqs(hd, 500000.0, RoPEScalingArgs())
    kw = dict(freqs=freqs, seqlen=seqlen, n_rope_heads=hq_ + hkv, head_dim=hd)
    y = TORCH.norm_rope_fp8(hq=hq, rstd=rstd, weight_q=wq, scale=scale, out_dtype=torch.float32, **kw)
    p = (hq.double() @ wq.double().t()) * (rstd.double() * scale.double())[:, None]
    y64 = _rotate(p, freqs, seqlen, n_rope_heads=hq_ + hkv, head_dim=hd, inverse=False)
    assert _rel(y, y64) < 1e-6
    assert y.dtype == torch.float32 and y.shape == (2 * seqlen, q)


def test_b1_fp8_casts_its_gradient_to_e5m2_with_a_current_scale():
    from coda_titan.kernels.scaling import E5M2, E5M2_MAX, quantize_e5m2

    gen = torch.Generator().manual_seed(12)
    hd, nh, seqlen = 16, 3, 8
    q = (nh + 1) * hd
    dy, y = torch.randn(2 * seqlen, q, generator=gen) * 1e-3, torch.randn(2 * seqlen, q, generator=gen)
    rstd = torch.rand(2 * seqlen, generator=gen) + 0.5
    kw = dict(dy=dy, y=y, rstd=rstd, freqs=rope_freqs(hd, 500000.0, RoPEScalingArgs()), seqlen=seqlen,
              n_rope_heads=nh, head_dim=hd)
    da, zdz, daq, s = TORCH.rope_bwd_fp8(**kw)
    da0, zdz0 = TORCH.rope_bwd(**kw)
    assert torch.equal(da, da0) and torch.equal(zdz, zdz0)  # the bf16 outputs are B1's own
    assert daq.dtype == E5M2 and daq.shape == da.shape and s.shape == ()
    assert daq.float().abs().max() == E5M2_MAX  # current scale: the amax lands on the top of the range
    da32 = _rotate(dy, kw["freqs"], seqlen, n_rope_heads=nh, head_dim=hd, inverse=True) * rstd[:, None]
    inv = inv_scale_from_amax(da32.abs().amax(), E5M2_MAX)
    assert torch.equal(daq.float(), quantize_e5m2(da32, inv).float()) and s == inv.reciprocal()  # cast from fp32 da
    rel = ((daq.double() * s.double() - da.double()).abs() / da.double().abs().clamp(min=1e-30))
    big = da.double().abs() > da.double().abs().max() * 2.0**-14  # e5m2 normals under this scale
    assert (rel[big] <= 2.0**-3 + 1e-6).all()  # 2 mantissa bits: half a step is 2^-3 relative


def test_b2_fp8_matches_fp64_emulation_and_its_bf16_twin():
    from coda_titan.kernels.scaling import E5M2, E5M2_MAX, quantize_e5m2
    from coda_titan.kernels.norm_residual_bwd import norm_residual_apply

    gen = torch.Generator().manual_seed(13)
    m, n, d = 24, 96, 64
    da = torch.randn(m, n, generator=gen) * 1e-2
    w = torch.randn(n, d, generator=gen) * d**-0.5
    x, dres = torch.randn(m, d, generator=gen), torch.randn(m, d, generator=gen)
    gamma, rstd, zdz = torch.rand(d, generator=gen) + 0.5, torch.rand(m, generator=gen) + 0.5, torch.randn(m, generator=gen)
    inv_da = inv_scale_from_amax(da.abs().amax(), E5M2_MAX)
    daq = quantize_e5m2(da, inv_da)
    wq, s_w = TORCH.quantize_tensorwise(w=w)
    scale = s_w / inv_da
    for dresidual in (dres, None):
        kw = dict(x=x, gamma=gamma, rstd=rstd, zdz=zdz, dresidual=dresidual)
        out, dgamma = TORCH.norm_residual_bwd_fp8(daq=daq, weight_tq=wq.t().contiguous(), scale=scale, **kw)
        acc = (daq.double() @ wq.double()) * scale.double()  # exact products, fp64 sum
        want, want_dg = norm_residual_apply(acc, **{k: (v.double() if v is not None else None) for k, v in kw.items()})
        assert _rel(out, want) < 1e-6 and _rel(dgamma, want_dg) < 1e-6
        ref, ref_dg = TORCH.norm_residual_bwd(da=da, weight=w, **kw)  # no quantization
        assert 1e-4 < _rel(out, ref) < 0.1 and _rel(dgamma, ref_dg) < 0.1
    with pytest.raises(TypeError, match="e5m2/e4m3"):
        TORCH.norm_residual_bwd_fp8(daq=da, weight_tq=wq.t().contiguous(), scale=scale, **kw)
    assert daq.dtype == E5M2


def test_b3_fp8_writes_e5m2_da_with_a_delayed_scale():
    from coda_titan.kernels.scaling import E5M2, E5M2_MAX, quantize_e5m2

    gen = torch.Generator().manual_seed(14)
    m, d, f = 24, 32, 40
    dout = torch.randn(m, d, generator=gen, dtype=torch.float64) * 1e-2
    w2 = torch.randn(d, f, generator=gen, dtype=torch.float64) * f**-0.5
    a = torch.randn(m, 2 * f, generator=gen, dtype=torch.float64) * 2
    rstd = torch.rand(m, generator=gen, dtype=torch.float64) + 0.5
    kw = dict(dout=dout, w_down=w2, a=a, rstd=rstd)
    da0, y0, zdz0 = TORCH.swiglu_bwd(**kw)
    # fp64 emulation of the SwiGLU backward, written out independently of the reference
    r = rstd[:, None]
    zg, zu = a[:, 0::2] * r, a[:, 1::2] * r
    dy = dout @ w2
    sg = torch.sigmoid(zg)
    dzg, dzu = dy * zu * sg * (1 + zg * (1 - sg)), dy * zg * sg
    da64 = torch.stack([dzg, dzu], dim=-1).reshape(m, 2 * f) * r
    amax64 = da64.abs().amax()
    for inv in (None, inv_scale_from_amax(amax64 / 4, E5M2_MAX)):  # calibration, and a stale (too small) amax
        da, y, zdz, daq, amax = TORCH.swiglu_bwd_fp8(**kw, inv_scale=inv)
        assert torch.equal(da, da0) and torch.equal(y, y0) and torch.equal(zdz, zdz0)  # B3's own outputs
        assert _rel(da, da64) < 1e-12 and amax == da.abs().amax() and torch.allclose(amax, amax64, rtol=1e-12)
        used = inv_scale_from_amax(amax64, E5M2_MAX) if inv is None else inv
        assert daq.dtype == E5M2 and daq.shape == da.shape
        assert torch.equal(daq.float(), quantize_e5m2(da64, used).float())  # interleaved like da
        assert daq.float().abs().max() == E5M2_MAX and daq.float().isfinite().all()  # stale: saturates
    # gate and up columns stay interleaved: the e5m2 pairs follow da's (and W13's) row order
    assert ((daq.float()[:, 0::2] != 0) | (da64[:, 0::2] == 0)).all()


def test_wgrad_fp8_is_torchaos_weight_gradient_with_current_scales():
    from coda_titan.kernels.scaling import E5M2, E5M2_MAX

    gen = torch.Generator().manual_seed(9)
    m, n, k = 96, 32, 48
    g = torch.randn(m, n, generator=gen, dtype=torch.float64) * torch.rand(m, 1, generator=gen, dtype=torch.float64)
    x = torch.randn(m, k, generator=gen, dtype=torch.float64) * 3
    dw = TORCH.wgrad_fp8(grad=g, grad_amax=g.abs().amax(), inp=x, inp_amax=x.abs().amax(), out_dtype=torch.float64)
    # fp64 emulation written out: round-to-nearest-even e5m2 / e4m3 codes of the scaled operands (the
    # fp8 dtypes' own casts), saturated, every token's product of the decoded codes summed; the scales
    # are max / fmax rounded up to a power of two (torchao's round_scales_to_power_of_2)
    s_g = 2.0 ** math.ceil(math.log2(g.abs().max().item() / E5M2_MAX))
    s_x = 2.0 ** math.ceil(math.log2(x.abs().max().item() / E4M3_MAX))
    gq = (g / s_g).clamp(-E5M2_MAX, E5M2_MAX).to(E5M2).double() * s_g
    xq = (x / s_x).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).double() * s_x
    want = torch.einsum("mn,mk->nk", gq, xq)
    assert dw.shape == (n, k) and _rel(dw, want) < 1e-12
    # the amaxes may come from the producers or be computed here: the same thing
    assert torch.equal(dw, TORCH.wgrad_fp8(grad=g, grad_amax=None, inp=x, inp_amax=None, out_dtype=torch.float64))
    # it is the exact wgrad up to the e5m2 / e4m3 rounding of the operands
    exact = TORCH.wgrad(grad=g, inp=x, out_dtype=torch.float64)
    assert 1e-4 < _rel(dw, exact) < 0.2
    # a current scale: no saturation, whatever the gradient's size (a delayed one would clip it)
    big = TORCH.wgrad_fp8(grad=g * 2.0**20, grad_amax=None, inp=x, inp_amax=None, out_dtype=torch.float64)
    assert _rel(big, dw * 2.0**20) < 1e-12
    assert TORCH.wgrad_fp8(grad=g.float(), grad_amax=None, inp=x.float(), inp_amax=None,
                           out_dtype=torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="same rows"):
        TORCH.wgrad_fp8(grad=g[1:], grad_amax=None, inp=x, inp_amax=None, out_dtype=torch.float64)


def test_wgrad_fp8_rounding_does_not_move_with_the_amax():
    """Two runs whose amaxes differ by a few percent (an outlier element computed slightly apart)
    cast every other element identically: the power-of-two scale keeps each element's rounding its
    own. A plain fmax / amax scale rounds them on a shifted grid."""
    from coda_titan.kernels.gemm import wgrad_fp8_operands
    from coda_titan.kernels.scaling import E5M2_MAX, inv_scale_from_amax, quantize_e5m2

    gen = torch.Generator().manual_seed(3)
    g = torch.randn(256, 64, generator=gen) * 1e-3
    x = torch.randn(256, 32, generator=gen)
    amax = g.abs().amax()
    gq0, s_g0, _, _ = wgrad_fp8_operands(g, amax, x, None)
    for factor in (1.0, 1.06, 0.97, 1.9):  # (1.9: a scale one power of two apart: exact too)
        gq, s_g, _, _ = wgrad_fp8_operands(g, amax * factor, x, None)
        assert torch.equal(gq.float() * s_g, gq0.float() * s_g0), factor
    plain = [quantize_e5m2(g, inv_scale_from_amax(amax * f, E5M2_MAX)).float() / inv_scale_from_amax(amax * f, E5M2_MAX)
             for f in (1.0, 1.06)]
    assert (plain[0] != plain[1]).float().mean() > 0.05  # what the power of two avoids


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


def test_fp8_ops_schemas_and_fakes():
    from torch.library import opcheck

    import coda_titan.kernels  # noqa: F401  (registers torch.ops.coda)

    gen = torch.Generator().manual_seed(5)
    hq, wq, scale, rstd = _fp8_operands(32, 64, 2 * 48, gen)
    opcheck(torch.ops.coda.norm_swiglu_fp8.default, (hq, rstd, wq, scale, torch.float32),
            test_utils=("test_faketensor",))
    y, wo, res, g = torch.randn(32, 48), torch.randn(64, 48), torch.randn(32, 64), torch.rand(64)
    for inv in (None, torch.tensor(3.0)):
        # (test_schema compares outputs with arithmetic that CPU float8 tensors do not have)
        opcheck(torch.ops.coda.residual_rms_fp8.default, (y, wo, res, g, 16, inv), test_utils=("test_faketensor",))
        opcheck(torch.ops.coda.rms_partial_fp8.default, (res, g, 16, inv), test_utils=("test_faketensor",))
    opcheck(torch.ops.coda.quantize_tensorwise.default, (wo,), test_utils=("test_faketensor",))
    ws = [[torch.randn(n, 16) for _ in range(2)] for n in (8, 8, 8, 4, 4)]
    for flags in ((False, False), (True, True)):
        opcheck(torch.ops.coda.fp8_layer_weights.default, (*ws, *flags), test_utils=("test_faketensor",))
    for inv in (None, torch.tensor(2.0**10)):
        opcheck(torch.ops.coda.swiglu_bwd_fp8.default,
                (torch.randn(8, 16), torch.randn(16, 24) * 0.2, torch.randn(8, 48), torch.rand(8) + 0.5, inv),
                test_utils=("test_faketensor",))
    freqs = rope_freqs(16, 500000.0, RoPEScalingArgs())
    dy, yq = torch.randn(16, 48), torch.randn(16, 48)
    opcheck(torch.ops.coda.rope_bwd_fp8.default, (dy, yq, torch.rand(16) + 0.5, freqs, 8, 2, 16),
            test_utils=("test_faketensor",))
    daq = TORCH.rope_bwd_fp8(dy=dy, y=yq, rstd=torch.rand(16), freqs=freqs, seqlen=8, n_rope_heads=2, head_dim=16)[2]
    wt = TORCH.quantize_tensorwise(w=torch.randn(48, 64))[0].t().contiguous()
    for dres in (res[:16], None):
        opcheck(torch.ops.coda.norm_residual_bwd_fp8.default,
                (daq, wt, torch.tensor(0.5), res[:16], g, torch.rand(16), torch.randn(16), dres),
                test_utils=("test_faketensor",))
    for amaxes in ((None, None), (torch.tensor(2.0), torch.tensor(3.0))):
        opcheck(torch.ops.coda.wgrad_fp8.default, (dy, amaxes[0], res[:16], amaxes[1], torch.float32),
                test_utils=("test_faketensor",))


# --- the model -----------------------------------------------------------------------------------


def _models(**kw):
    from coda_titan.model.args import coda_llama3_args
    from coda_titan.model.model import CodaTransformer

    args = copy.deepcopy(coda_llama3_args["debugmodel"])
    args.coda = Coda(backend="torch")
    torch.manual_seed(0)
    bf16 = CodaTransformer(args)
    with torch.no_grad():
        bf16.init_weights()
    fp8_args = copy.deepcopy(args)
    fp8_args.coda = dataclasses.replace(
        args.coda, precision=kw.get("precision", "fp8"), fp8_dgrad=kw.get("fp8_dgrad", False),
        fp8_mlp_dgrad=kw.get("fp8_mlp_dgrad", False), fp8_mlp_wgrad=kw.get("fp8_mlp_wgrad", False),
        fp8_grad_margin=kw.get("fp8_grad_margin", args.coda.fp8_grad_margin),
    )
    fp8 = CodaTransformer(fp8_args)
    fp8.load_state_dict(bf16.state_dict())
    return bf16, fp8


def _batch(vocab, bs=2, seqlen=32):
    gen = torch.Generator().manual_seed(7)
    return torch.randint(0, vocab, (bs, seqlen), generator=gen), torch.randint(0, vocab, (bs, seqlen), generator=gen)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("fp8_dgrad,fp8_mlp_dgrad,fp8_mlp_wgrad",
                         [(False, False, False), (True, False, False), (False, True, False), (False, False, True),
                          (False, True, True)])
def test_fp8_model_tracks_bf16_model_and_keeps_stock_checkpoints(fp8_dgrad, fp8_mlp_dgrad, fp8_mlp_wgrad):
    bf16, fp8 = _models(fp8_dgrad=fp8_dgrad, fp8_mlp_dgrad=fp8_mlp_dgrad, fp8_mlp_wgrad=fp8_mlp_wgrad)
    tokens, labels = _batch(bf16.model_args.vocab_size)
    loss = bf16(tokens, labels=labels)
    loss.backward()
    assert not fp8.fp8_scaling.activations_calibrated
    loss8 = fp8(tokens, labels=labels)
    loss8.backward()
    assert fp8.fp8_scaling.activations_calibrated
    assert abs(loss8.item() - loss.item()) <= 1e-2 * abs(loss.item())
    assert loss8.item() != loss.item()  # it did quantize
    g, g8 = _grads(bf16), _grads(fp8)
    assert g.keys() == g8.keys()
    for n in g:
        cos = torch.nn.functional.cosine_similarity(g[n].flatten(), g8[n].flatten(), dim=0).item()
        assert cos > 0.98, (n, cos)
    # parameters and state dict are stock llama3's: the amax history is not checkpointed
    assert fp8.state_dict().keys() == bf16.state_dict().keys()
    assert not any("fp8" in k for k in fp8.state_dict())
    if fp8_dgrad:  # the e5m2 dgrad moves exactly the gradients that flow through F3's B2, and only those
        _, plain = _models()
        plain(tokens, labels=labels)  # calibrate like fp8 above
        plain(tokens, labels=labels).backward()
        fp8.zero_grad()
        fp8(tokens, labels=labels).backward()
        g8, gp = _grads(fp8), _grads(plain)
        assert not torch.equal(g8["tok_embeddings.weight"], gp["tok_embeddings.weight"])
        assert torch.equal(g8["output.weight"], gp["output.weight"]) and torch.equal(g8["norm.weight"], gp["norm.weight"])
    if fp8_mlp_dgrad or fp8_mlp_wgrad:
        last = f"layers.{fp8.model_args.n_layers - 1}."
        _, plain = _models()
        plain(tokens, labels=labels)
        plain(tokens, labels=labels).backward()
        fp8.zero_grad()
        fp8(tokens, labels=labels).backward()
        g8, gp = _grads(fp8), _grads(plain)
        for n in ("output.weight", "norm.weight", last + "feed_forward.w2.weight"):
            assert torch.equal(g8[n], gp[n]), n  # upstream of the MLP's B2 and dW13
        w13 = (last + "feed_forward.w1.weight", last + "feed_forward.w3.weight")
        for n in w13:  # the e5m2 x e4m3 dW13 moves W13's gradient, the bf16 one does not
            assert torch.equal(g8[n], gp[n]) != fp8_mlp_wgrad, n
        # the e5m2 dgrad moves what flows through the MLP's B2: its dgamma and everything below
        assert torch.equal(g8[last + "ffn_norm.weight"], gp[last + "ffn_norm.weight"]) != fp8_mlp_dgrad
        assert torch.equal(g8["tok_embeddings.weight"], gp["tok_embeddings.weight"]) != fp8_mlp_dgrad
        if not fp8_mlp_dgrad:  # the wgrad alone moves W13's gradients and nothing else
            assert all(torch.equal(g8[n], gp[n]) for n in g8 if not n.endswith(("w1.weight", "w3.weight")))


def test_delayed_scales_come_from_the_history():
    _, fp8 = _models()
    tokens, labels = _batch(fp8.model_args.vocab_size)
    n_sites = 2 * fp8.model_args.n_layers
    assert fp8.fp8_scaling.activation_history.shape == (n_sites, fp8.model_args.coda.fp8_amax_history)
    with torch.no_grad():
        first = fp8(tokens, labels=labels)  # calibration: current amax
    hist = fp8.fp8_scaling.activation_history.clone()
    assert (hist[:, 0] > 0).all() and (hist[:, 1:] == 0).all()
    with torch.no_grad():
        again = fp8(tokens, labels=labels)  # same weights and data, delayed scale = the same amax
    assert torch.equal(again, first)
    assert torch.equal(fp8.fp8_scaling.activation_history[:, 1], hist[:, 0])
    # a larger history max -> coarser scale -> another result (not a power of 2: e4m3 rounding is
    # invariant under those away from the range's ends)
    fp8.fp8_scaling.activation_history.mul_(3.0)
    with torch.no_grad():
        coarse = fp8(tokens, labels=labels)
    assert coarse.item() != first.item() and torch.isfinite(coarse)
    fp8.eval()
    before = fp8.fp8_scaling.activation_history.clone()
    with torch.no_grad():
        fp8(tokens, labels=labels)
    assert torch.equal(fp8.fp8_scaling.activation_history, before)  # evaluation does not move the scales


def test_mlp_gradient_scales_come_from_the_gradient_history():
    # no headroom, so that the delayed scale is exactly the calibration step's (with headroom the two
    # grids differ by a power of two, which moves values in and out of e5m2's subnormals)
    _, fp8 = _models(fp8_mlp_dgrad=True, fp8_grad_margin=0)
    tokens, labels = _batch(fp8.model_args.vocab_size)
    hist = fp8.fp8_scaling.gradient_history
    assert hist.shape == (fp8.model_args.n_layers, fp8.model_args.coda.fp8_amax_history)
    fp8(tokens, labels=labels).backward()  # calibration: the current amax of each layer's da
    assert not fp8.fp8_scaling.gradients_calibrated and (hist == 0).all()  # the amaxes wait in the sink's gradient
    amax1 = fp8.fp8_scaling.sink.amaxes().clone()
    assert (amax1 > 0).all()
    g1 = _grads(fp8)
    fp8.zero_grad()
    fp8(tokens, labels=labels).backward()  # delayed: the scale of the recorded amax, the same numbers
    assert fp8.fp8_scaling.gradients_calibrated and torch.equal(hist[:, 0], amax1) and (hist[:, 1:] == 0).all()
    g2 = _grads(fp8)
    assert all(torch.equal(g1[n], g2[n]) for n in g1)
    fp8.fp8_scaling.gradient_history.mul_(3.0)  # an older, larger amax: a coarser e5m2 grid, other gradients
    fp8.zero_grad()
    fp8.fp8_scaling.sink = None  # (keep the history as set)
    fp8(tokens, labels=labels).backward()
    g3 = _grads(fp8)
    assert not torch.equal(g3["tok_embeddings.weight"], g1["tok_embeddings.weight"])
    assert all(g.isfinite().all() for g in g3.values())
    with torch.no_grad():  # evaluation neither needs the transposed weights nor records gradients
        fp8(tokens, labels=labels)
    assert fp8.fp8_scaling.sink is None and torch.equal(fp8.fp8_scaling.gradient_history[:, 0], hist[:, 0])


def _mlp_dgrad_error(margin: int, grown: float) -> float:
    """Worst relative gradient deviation of the e5m2 MLP dgrad from the bf16 dgrad of the same model
    (same weights, same e4m3 forward), on a step whose gradient amax is ``grown`` times the history's."""
    ref = _models()[1]
    model = _models(fp8_mlp_dgrad=True, fp8_grad_margin=margin)[1]
    tokens, labels = _batch(model.model_args.vocab_size)
    for m in (ref, model):  # calibrates the activation scales of both and the gradient scales of one
        m(tokens, labels=labels).backward()
        m.zero_grad()
    model(tokens, labels=labels)  # (moves the calibration amaxes into the gradient history) ...
    model.fp8_scaling.gradient_history.div_(grown)  # ... which is then made `grown`-fold too small
    model.fp8_scaling.sink = None
    model.zero_grad()
    for m in (ref, model):
        m(tokens, labels=labels).backward()
    g_ref, g = _grads(ref), _grads(model)
    return max(((g[n] - g_ref[n]).norm() / g_ref[n].norm()).item() for n in g_ref)


def test_mlp_gradient_scale_headroom_keeps_a_grown_gradient_from_saturating():
    """A step whose MLP gradient is 64x the history's amax: with the default 2**8 headroom its e5m2
    codes stay in range and the gradients are as close to the bf16 dgrad's as on an ordinary step;
    without headroom da saturates and they are not."""
    ok, ok_grown = _mlp_dgrad_error(8, 1.0), _mlp_dgrad_error(8, 64.0)
    bare, bare_grown = _mlp_dgrad_error(0, 1.0), _mlp_dgrad_error(0, 64.0)
    assert 0 < ok < 0.2 and 0 < bare < 0.2
    assert ok_grown < 1.5 * ok, (ok, ok_grown)
    assert bare_grown > 3 * bare, (bare, bare_grown)


def test_fp8_grad_margin_is_validated():
    with pytest.raises(ValueError, match="fp8_grad_margin"):
        _models(fp8_mlp_dgrad=True, fp8_grad_margin=-1)


def test_fp8_model_trains():
    _, fp8 = _models()
    tokens, labels = _batch(fp8.model_args.vocab_size)
    opt = torch.optim.AdamW(fp8.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        opt.zero_grad()
        loss = fp8(tokens, labels=labels)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses) and losses[-1] < 0.9 * losses[0]


def test_bad_precision_is_refused():
    with pytest.raises(ValueError, match="precision"):
        _models(precision="fp4")


# --- GPU: the kernels against the reference -------------------------------------------------------

gpu = pytest.mark.gpu
BF = torch.bfloat16


def _cuda_inputs(m, k, n, gen):
    h = (torch.randn(m, k, generator=gen, device="cuda") * 2).to(BF)
    w = (torch.randn(n, k, generator=gen, device="cuda") * k**-0.5).to(BF)
    rstd = torch.rand(m, generator=gen, device="cuda") + 0.5
    return h, w, rstd


def _torchao_linear_error(n_input, w, exact):
    """||torchao float8 tensorwise linear(n_input) - exact|| / ||exact||: the FP8 baseline's error."""
    import torch.nn as nn
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    lin = nn.Sequential(nn.Linear(w.shape[1], w.shape[0], bias=False, device="cuda", dtype=BF))
    lin[0].weight.data.copy_(w)
    convert_to_float8_training(lin, config=Float8LinearConfig.from_recipe_name("tensorwise"))
    with torch.no_grad():
        return _rel(lin(n_input), exact)


@gpu
def test_cute_fp8_programs_match_reference_within_torchao_error():
    import coda_titan.kernels.cute  # noqa: F401

    os.environ.setdefault("CODA_TITAN_AUTOTUNE", "0")
    cute = get_backend("cute")
    gen = torch.Generator(device="cuda").manual_seed(0)
    m, d, ff, seqlen = 4000, 2048, 8192, 1000
    h, _, rstd = _cuda_inputs(m, d, 8, gen)
    inv = inv_scale_from_amax(h.float().abs().amax())
    hq = quantize_e4m3(h.float(), inv)
    normed = (h.float() * rstd[:, None]).to(BF)  # what stock feeds its linears

    # F2
    w1 = (torch.randn(ff, d, generator=gen, device="cuda") * d**-0.5).to(BF)
    w3 = (torch.randn(ff, d, generator=gen, device="cuda") * d**-0.5).to(BF)
    w13 = interleave_rows(w1, w3)
    w13q, s_w = cute.quantize_tensorwise(w=w13)
    ref_q, ref_s = TORCH.quantize_tensorwise(w=w13)
    assert torch.equal(w13q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(s_w, ref_s)
    scale = s_w / inv
    y, a = cute.norm_swiglu_fp8(hq=hq, rstd=rstd, w13q=w13q, scale=scale, out_dtype=BF)
    y_ref, a_ref = TORCH.norm_swiglu_fp8(hq=hq, rstd=rstd, w13q=w13q, scale=scale, out_dtype=BF)
    exact = normed.double() @ w1.double().t()  # the gate pre-activation, no quantization
    ao_err = _torchao_linear_error(normed, w1, exact)
    ours_err = _rel(a[:, 0::2].float() * rstd[:, None], exact)
    print(f"F2: torchao {ao_err:.4g}, coda fp8 {ours_err:.4g}, kernel vs reference {_rel(a, a_ref):.3g} / {_rel(y, y_ref):.3g}")
    assert y.isfinite().all() and a.isfinite().all()
    assert _rel(a, a_ref) < 0.1 * ao_err and _rel(y, y_ref) < 0.1 * ao_err
    assert ours_err < 2 * ao_err

    # F3
    hd, hq_, hkv = 64, 32, 8
    q = (hq_ + 2 * hkv) * hd
    wqkv = (torch.randn(q, d, generator=gen, device="cuda") * d**-0.5).to(BF)
    wq8, s_q = cute.quantize_tensorwise(w=wqkv)
    # the batched weight pass of the model (one compiled call for all layers) is the same bits
    lw = [w1, w3, wqkv[: hq_ * hd], wqkv[hq_ * hd: (hq_ + hkv) * hd], wqkv[(hq_ + hkv) * hd:]]
    w13_l, s13_l, qkv_l, sqkv_l, _, _ = cute.fp8_layer_weights(
        **{k: [w, w] for k, w in zip(("w1", "w3", "wq", "wk", "wv"), lw)}, w13_t=False, wqkv_t=False)
    assert all(torch.equal(t.view(torch.uint8), ref_q.view(torch.uint8)) for t in w13_l) and torch.equal(s13_l[1], ref_s)
    assert all(torch.equal(t.view(torch.uint8), wq8.view(torch.uint8)) for t in qkv_l) and torch.equal(sqkv_l[0], s_q)
    freqs = rope_freqs(hd, 500000.0, RoPEScalingArgs()).cuda()
    kw = dict(freqs=freqs, seqlen=seqlen, n_rope_heads=hq_ + hkv, head_dim=hd, out_dtype=BF)
    out = cute.norm_rope_fp8(hq=hq, rstd=rstd, weight_q=wq8, scale=s_q / inv, **kw)
    out_ref = TORCH.norm_rope_fp8(hq=hq, rstd=rstd, weight_q=wq8, scale=s_q / inv, **kw)
    p = normed.double() @ wqkv.double().t()
    exact = _rotate(p, freqs, seqlen, n_rope_heads=hq_ + hkv, head_dim=hd, inverse=False)
    ao_err = _torchao_linear_error(normed, wqkv, p)
    print(f"F3: torchao {ao_err:.4g}, coda fp8 {_rel(out, exact):.4g}, kernel vs reference {_rel(out, out_ref):.3g}")
    assert _rel(out, out_ref) < 0.1 * ao_err and _rel(out, exact) < 2 * ao_err


@gpu
def test_cute_fp8_qkv_dgrad_matches_reference():
    """B1 -> B2 of F3 in fp8 (e5m2 gradient x e4m3 W_qkv^T) on the cute backend against the torch
    reference on the same operands, bounded by what the fp8 cast itself moves B2's output."""
    import coda_titan.kernels.cute  # noqa: F401
    from coda_titan.kernels.scaling import E5M2

    os.environ.setdefault("CODA_TITAN_AUTOTUNE", "0")
    cute = get_backend("cute")
    gen = torch.Generator(device="cuda").manual_seed(3)
    seqlen, bs, d, hd, nq, nkv = 1024, 2, 2048, 64, 32, 8
    m, q = bs * seqlen, (nq + 2 * nkv) * hd
    dy = (torch.randn(m, q, generator=gen, device="cuda") * 1e-3).to(BF)
    y = torch.randn(m, q, generator=gen, device="cuda").to(BF)
    rstd = torch.rand(m, generator=gen, device="cuda") + 0.5
    freqs = rope_freqs(hd, 500000.0, RoPEScalingArgs()).cuda()
    kw = dict(dy=dy, y=y, rstd=rstd, freqs=freqs, seqlen=seqlen, n_rope_heads=nq + nkv, head_dim=hd)
    da, zdz, daq, s_da = cute.rope_bwd_fp8(**kw)
    da_r, zdz_r, daq_r, s_da_r = TORCH.rope_bwd_fp8(**kw)
    assert daq.dtype == E5M2 and torch.allclose(s_da, s_da_r, rtol=1e-6)
    step_apart = (daq.float() != daq_r.float()).float().mean().item()  # cos/sin tables vs _rotate: ulps
    assert _rel(da, da_r) < 1e-2 and step_apart < 1e-3, step_apart
    w = (torch.randn(q, d, generator=gen, device="cuda") * d**-0.5).to(BF)
    x, dres = torch.randn(m, d, generator=gen, device="cuda").to(BF), torch.randn(m, d, generator=gen, device="cuda").to(BF)
    gamma = (torch.rand(d, generator=gen, device="cuda") + 0.5).to(BF)
    wq8, s_w = cute.quantize_tensorwise(w=w)
    for dresidual in (dres, None):
        bkw = dict(daq=daq_r, weight_tq=wq8.t().contiguous(), scale=s_da_r * s_w, x=x, gamma=gamma, rstd=rstd,
                   zdz=zdz_r, dresidual=dresidual)
        out, dg = cute.norm_residual_bwd_fp8(**bkw)
        out_r, dg_r = TORCH.norm_residual_bwd_fp8(**bkw)
        bf, bf_dg = TORCH.norm_residual_bwd(da=da_r, weight=w, x=x, gamma=gamma, rstd=rstd, zdz=zdz_r, dresidual=dresidual)
        effect = _rel(out_r - (dres if dresidual is not None else 0), bf - (dres if dresidual is not None else 0))
        print(f"B2 fp8 (residual {dresidual is not None}): kernel vs reference {_rel(out, out_r):.3g} / dgamma "
              f"{_rel(dg, dg_r):.3g}; fp8 effect {effect:.3g}")
        assert out.isfinite().all() and _rel(out, out_r) < 0.1 * effect and _rel(dg, dg_r) < 0.1 * max(_rel(dg_r, bf_dg), 1e-3)


@gpu
def test_cute_fp8_mlp_dgrad_matches_reference():
    """B3 writing e5m2 da (delayed scale) -> B2 on e5m2 da x e4m3 W13^T, cute against the torch
    reference on the same operands. The e5m2 codes may differ only where B3's fp32 GEMM sums in
    another order than the reference's and a value sits on a rounding boundary."""
    import coda_titan.kernels.cute  # noqa: F401
    from coda_titan.kernels.scaling import E5M2, E5M2_MAX

    os.environ.setdefault("CODA_TITAN_AUTOTUNE", "0")
    cute = get_backend("cute")
    gen = torch.Generator(device="cuda").manual_seed(4)
    m, d, ff = 4096, 2048, 8192
    dout = (torch.randn(m, d, generator=gen, device="cuda") * 1e-2).to(BF)
    w2 = (torch.randn(d, ff, generator=gen, device="cuda") * ff**-0.5).to(BF)
    a = (torch.randn(m, 2 * ff, generator=gen, device="cuda") * 2).to(BF)
    rstd = torch.rand(m, generator=gen, device="cuda") + 0.5
    b3 = dict(dout=dout, w_down=w2, a=a, rstd=rstd)
    da0, y0, zdz0 = cute.swiglu_bwd(**b3)
    inv_g = inv_scale_from_amax(da0.float().abs().amax() / 2, E5M2_MAX)  # a stale amax: the top saturates
    da, y, zdz, daq, amax = cute.swiglu_bwd_fp8(**b3, inv_scale=inv_g)
    da_r, y_r, zdz_r, daq_r, amax_r = TORCH.swiglu_bwd_fp8(**b3, inv_scale=inv_g)
    assert daq.dtype == E5M2 and daq.shape == a.shape and daq.is_contiguous()
    assert _rel(da, da0) < 1e-2 and _rel(y, y0) < 1e-2 and _rel(zdz, zdz0) < 1e-3  # (another GEMM config than B3 bf16)
    codes_apart = (daq.view(torch.uint8) != daq_r.view(torch.uint8)).float().mean().item()
    print(f"B3 fp8: da vs reference {_rel(da, da_r):.3g}, e5m2 codes apart {codes_apart:.2e}, "
          f"amax {amax.item():.5g} vs {amax_r.item():.5g}")
    assert _rel(da, da_r) < 1e-2 and _rel(y, y_r) < 1e-2 and _rel(zdz, zdz_r) < 1e-2
    # the reference's own fp32 GEMM (TF32 where enabled) and the kernel's sum differ in the low bits:
    # a value near an e5m2 rounding boundary lands one step apart (measured on the H200: 0.8% of codes)
    assert codes_apart < 2e-2 and torch.allclose(amax, amax_r.float(), rtol=1e-2)
    k, r = daq.float(), daq_r.float()
    assert ((k - r).abs() <= 0.25 * torch.maximum(k.abs(), r.abs()) + 2.0**-16).all()  # never more than one step
    assert daq.float().abs().max() == E5M2_MAX and daq.float().isfinite().all()
    w1 = (torch.randn(ff, d, generator=gen, device="cuda") * d**-0.5).to(BF)
    w3 = (torch.randn(ff, d, generator=gen, device="cuda") * d**-0.5).to(BF)
    w13 = interleave_rows(w1, w3)
    w13q, s_w, _, _, w13q_t, _ = cute.fp8_layer_weights(w1=[w1], w3=[w3], wq=[w1[:64]], wk=[w1[:64]], wv=[w1[:64]],
                                                       w13_t=True, wqkv_t=False)
    assert torch.equal(w13q_t[0].view(torch.uint8), w13q[0].t().contiguous().view(torch.uint8))
    x, dres = torch.randn(m, d, generator=gen, device="cuda").to(BF), torch.randn(m, d, generator=gen, device="cuda").to(BF)
    gamma = (torch.rand(d, generator=gen, device="cuda") + 0.5).to(BF)
    bkw = dict(daq=daq_r, weight_tq=w13q_t[0], scale=s_w[0] / inv_g, x=x, gamma=gamma, rstd=rstd, zdz=zdz_r, dresidual=dres)
    out, dg = cute.norm_residual_bwd_fp8(**bkw)
    out_r, dg_r = TORCH.norm_residual_bwd_fp8(**bkw)
    bf, bf_dg = TORCH.norm_residual_bwd(da=da_r, weight=w13, x=x, gamma=gamma, rstd=rstd, zdz=zdz_r, dresidual=dres)
    effect = _rel(out_r - dres, bf - dres)
    print(f"B2 fp8 (W13): kernel vs reference {_rel(out, out_r):.3g} / dgamma {_rel(dg, dg_r):.3g}; fp8 effect {effect:.3g}")
    assert out.isfinite().all() and _rel(out, out_r) < 0.1 * effect and _rel(dg, dg_r) < 0.1 * max(_rel(dg_r, bf_dg), 1e-3)
    # fp8_mlp_wgrad: dW13 = da^T H, both cast with current scales (B3's amax, and one computed for H)
    for out_dtype in (torch.float32, BF):
        wkw = dict(grad=da, grad_amax=amax, inp=x, inp_amax=None, out_dtype=out_dtype)
        dw, dw_r = cute.wgrad_fp8(**wkw), TORCH.wgrad_fp8(**wkw)
        effect = _rel(dw_r, TORCH.wgrad(grad=da, inp=x, out_dtype=torch.float32))
        print(f"dW13 fp8 ({out_dtype}): kernel vs reference {_rel(dw, dw_r):.3g}; fp8 effect {effect:.3g}")
        assert dw.dtype == out_dtype and dw.shape == (2 * ff, d) and dw.isfinite().all()
        # (cuBLAS's fp8 accumulation is not IEEE fp32's: measured 2.0e-4 apart in fp32 on the H100)
        assert _rel(dw, dw_r) < (0.02 if out_dtype == torch.float32 else 0.1) * effect


@gpu
def test_cute_f1_writes_e4m3_h():
    import coda_titan.kernels.cute  # noqa: F401

    cute = get_backend("cute")
    gen = torch.Generator(device="cuda").manual_seed(1)
    m, k, d = 4000, 2048, 2048
    y, wo, _ = _cuda_inputs(m, k, d, gen)
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


@gpu
@pytest.mark.parametrize("mlp_dgrad", [False, True])  # True: fp8_mlp_dgrad and fp8_mlp_wgrad (the defaults)
def test_whole_1b_fp8_model_cute_matches_torch_backend(mlp_dgrad):
    """The 1B model, fp8, cute vs torch backend: their gradients must differ by much less than fp8
    quantization itself moves them (torch fp8 vs torch bf16 programs). The backends' F1 GEMMs sum in
    different orders, so a value at an e4m3 rounding boundary may land one step apart: the fp8 model
    cannot match to bf16-program accuracy: the claim tested is that the two backends agree with each
    other at least as well as the fp8 model agrees with the bf16 one (a wrong kernel is far above
    that; measured on the H100: 0.60 at the worst parameter, the last layer's wq; 0.79 with the MLP's
    fp8 dgrad and wgrad, a layer's W1; the wgrad reached 1.08 before its current scales were powers
    of two: ``scripts/probes/fp8_model_grads.py``)."""
    from scripts.probes.fp8_model_grads import grad_ratios, summary

    res = grad_ratios(mlp_dgrad, mlp_dgrad)
    losses, s = res["losses"], summary(res)
    print(f"model (mlp_dgrad {mlp_dgrad}): loss cute {losses['cute']:.6f} torch {losses['torch']:.6f} bf16 {losses['bf16']:.6f}; "
          f"worst gradient deviation / fp8 effect {s['worst_ratio']:.3f} at {s['worst']}")
    assert abs(losses["cute"] - losses["torch"]) <= 0.25 * abs(losses["bf16"] - losses["torch"]) + 1e-3 * abs(losses["torch"])
    assert s["worst_ratio"] <= 1.0
