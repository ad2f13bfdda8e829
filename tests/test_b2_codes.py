"""The fp8 B2 that writes D's e5m2 codes itself (``norm_residual_bwd_fp8_codes``): its reference is the fp8 B2
and then the gradient cast of its D (CPU), and its kernel gives that cast's bytes whatever its provisional scale,
writing them in the epilogue where the guess holds (GPU)."""

import pytest
import torch
from torch.library import opcheck

from coda_titan.kernels.scaling import E5M2, E5M2_MAX, inv_scale_from_amax, pow2_floor, quantize_e5m2

from .helpers import BF, TORCH, rel


def _operands(m, n, d, device="cpu", dtype=torch.float32, seed=5):
    gen = torch.Generator(device=device).manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=gen, device=device)

    da, w = r(m, n) * 1e-2, r(n, d) * d**-0.5
    inv_da = inv_scale_from_amax(da.abs().amax(), E5M2_MAX)
    wq, s_w = TORCH.quantize_tensorwise(w=w)
    kw = dict(daq=quantize_e5m2(da, inv_da), weight_tq=wq.t().contiguous(), scale=s_w / inv_da, x=r(m, d).to(dtype),
              gamma=(torch.rand(d, generator=gen, device=device) + 0.5).to(dtype),
              rstd=torch.rand(m, generator=gen, device=device) + 0.5, zdz=r(m), dresidual=r(m, d).to(dtype))
    return kw, da, w


def _bytes(t):
    return t.reshape(-1).contiguous().view(torch.uint8)


def _current_inv(amax):
    return pow2_floor(inv_scale_from_amax(amax.float(), E5M2_MAX)).reshape(1)


def test_b2_codes_reference_is_the_fp8_b2_then_its_gradient_cast():
    """(D, dgamma, amax) are the fp8 B2's; the codes are D cast at its current power-of-two scale (each within
    half an e5m2 step of D times the scale, or D's value below the subnormal step), token-major the same bytes,
    s = 1 / that scale; a provisional scale, right or wrong, changes nothing."""
    kw, _, _ = _operands(32, 96, 64, dtype=BF)
    d, dg, amax = TORCH.norm_residual_bwd_fp8(**kw)
    inv = _current_inv(amax)
    outs = [TORCH.norm_residual_bwd_fp8_codes(**kw, inv_prov=p) for p in (inv, inv * 2, inv / 4)]
    for o in outs[1:]:
        assert all(torch.equal(_bytes(a), _bytes(b)) for a, b in zip(o, outs[0]))
    d2, dg2, amax2, dq, dq_t, s = outs[0]
    assert torch.equal(d2, d) and torch.equal(dg2, dg) and torch.equal(amax2, amax)
    assert dq.dtype == dq_t.dtype == E5M2 and dq_t.shape == (64, 32) and torch.equal(_bytes(dq_t), _bytes(dq.t()))
    assert torch.equal(s.reshape(1), 1 / inv)
    v = d.float() * inv  # (exact: a power of two), within the e5m2 range by the scale's choice
    assert v.abs().max() <= E5M2_MAX
    step = torch.maximum(2.0 ** (torch.floor(torch.log2(v.abs().clamp(min=2.0**-14))) - 2), torch.tensor(2.0**-16))
    assert ((dq.float() - v).abs() <= step / 2).all()


def test_b2_codes_op_schema_and_fake():
    kw, _, _ = _operands(16, 48, 64)
    args = tuple(kw[k] for k in ("daq", "weight_tq", "scale", "x", "gamma", "rstd", "zdz", "dresidual"))
    opcheck(torch.ops.coda.norm_residual_bwd_fp8_codes.default, (*args, torch.ones(1)),
            test_utils=("test_faketensor",))


def _cuda():
    pytest.importorskip("quack")
    import coda_titan.kernels.cute  # noqa: F401  (the CUDA kernels)
    from coda_titan.kernels import get_backend

    return get_backend("cute")


@pytest.mark.gpu
def test_cute_b2_codes_are_the_gradient_cast_of_its_d_for_any_provisional_scale():
    """On the GPU: the kernel's codes, token-major codes and s are, byte for byte, the cute gradient cast
    (``quantize_grad_t``) of its own D at its own amax, with the provisional scale right (the epilogue's codes
    kept), a power of two too high or too low (made again from D), and NaN; D within the fp8 B2 kernel's
    bound against the reference (a tenth of the fp8 effect, as ``test_norm_swiglu``'s B2 check)."""
    cute = _cuda()
    kw, da, w = _operands(1024, 768, 512, device="cuda", dtype=BF)
    d0, _, amax0 = cute.norm_residual_bwd_fp8(**kw)
    inv = _current_inv(amax0)
    d_r, dg_r, _ = TORCH.norm_residual_bwd_fp8(**kw)
    rest = {k: kw[k] for k in ("x", "gamma", "rstd", "zdz", "dresidual")}
    bf, bf_dg = TORCH.norm_residual_bwd(da=da.to(BF), weight=w.to(BF), **rest)  # (no fp8: what fp8 moves)
    effect = rel(d_r - kw["dresidual"], bf - kw["dresidual"])
    for name, prov in (("hit", inv), ("high", inv * 2), ("low", inv / 2), ("nan", torch.full_like(inv, float("nan")))):
        d, dg, amax, dq, dq_t, s = cute.norm_residual_bwd_fp8_codes(**kw, inv_prov=prov)
        want_q, want_t, want_s = cute.quantize_grad_t(t=d, amax=amax)
        print(f"B2 codes ({name}): D vs reference {rel(d, d_r):.3g}, vs fp8 B2 kernel {rel(d, d0):.3g}")
        assert torch.equal(amax, d.float().abs().amax().reshape(amax.shape))
        assert torch.equal(_bytes(dq), _bytes(want_q)) and torch.equal(_bytes(dq_t), _bytes(want_t)), name
        assert torch.equal(s, want_s.reshape(s.shape)), name
        assert rel(d, d_r) < 0.1 * effect and rel(dg, dg_r) < 0.1 * max(rel(dg_r, bf_dg), 1e-3), name


@pytest.mark.gpu
def test_cute_b2_codes_recast_touches_the_codes_only_where_the_guess_missed():
    """``recast``: with the provisional scale D's current one it writes s alone (codes filled with 0xFF before
    stay 0xFF, so the hit case above checked the epilogue's own codes); with another it writes every code."""
    _cuda()
    from coda_titan.kernels.cute.b2_codes import recast

    gen = torch.Generator(device="cuda").manual_seed(3)
    d = (torch.randn(640, 320, generator=gen, device="cuda") * 3).to(BF)
    amax = d.float().abs().amax().reshape(1)
    inv = _current_inv(amax)
    for prov, touched in ((inv, False), (inv * 4, True)):
        dq = torch.full((640, 320), 0xFF, dtype=torch.uint8, device="cuda").view(E5M2)
        dq_t = torch.full((320, 640), 0xFF, dtype=torch.uint8, device="cuda").view(E5M2)
        s = recast(d, amax, prov.float(), dq, dq_t)
        assert torch.equal(s.reshape(1), 1 / inv)
        if touched:
            want = quantize_e5m2(d.float(), inv)
            assert torch.equal(_bytes(dq), _bytes(want)) and torch.equal(_bytes(dq_t), _bytes(want.t()))
        else:
            assert (_bytes(dq) == 0xFF).all() and (_bytes(dq_t) == 0xFF).all()
