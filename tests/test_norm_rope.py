"""F3 norm_rope and B1 rope_bwd: backward (gradcheck, fp64) and the zdz identity, the fp8 programs
against an fp64 emulation, the ops, and the cute kernels against the reference (GPU)."""

import dataclasses
import os

import pytest
import torch
from torch.library import opcheck

from coda_titan.kernels import get_backend
from coda_titan.kernels.norm_rope import rotate
from coda_titan.kernels.scaling import inv_scale_from_amax
from coda_titan.model.autograd import NormRoPE
from coda_titan.model.rope import rope_freqs
from torchtitan.models.llama3.model.args import RoPEScalingArgs

from .helpers import BF, CFG, D, DIMS, HD, HKV, HQ, M, SEQ, TORCH, check_cute_matches_reference, deferred_norm, fp8_operands, op_cases, rand64, rel, run_interpreter_check


@pytest.mark.parametrize("stacked", [False, True])
def test_norm_rope_backward(stacked):
    """The QKV Function's backward against finite differences, with W_qkv a copy or ([coda] stacked_weights) the
    three weights given apart to F3 and B2."""
    freqs = rope_freqs(HD, 10000.0, RoPEScalingArgs())
    x, gamma = rand64(M, D), rand64(D)
    wq, wk, wv = rand64(HQ * HD, D), rand64(HKV * HD, D), rand64(HKV * HD, D)
    cfg = dataclasses.replace(CFG, stacked_weights=stacked)

    def f(x, gamma, wq, wk, wv):
        h, r = deferred_norm(x, gamma)
        return NormRoPE.apply(h, r, x, gamma, wq, wk, wv, freqs, SEQ, cfg, HQ + HKV, HD)

    assert torch.autograd.gradcheck(f, (x, gamma, wq, wk, wv))


def test_rope_bwd_zdz_is_invariant():
    """zdz from post-RoPE values equals sum p * dp from pre-RoPE values (R is orthogonal)."""
    freqs = rope_freqs(HD, 500000.0, RoPEScalingArgs())
    rope = dict(freqs=freqs, seqlen=SEQ, n_rope_heads=HQ + HKV, head_dim=HD)
    h, r = deferred_norm(torch.randn(M, D, dtype=torch.float64), torch.randn(D, dtype=torch.float64))
    w = torch.randn((HQ + 2 * HKV) * HD, D, dtype=torch.float64)
    y = CFG.backend.norm_rope(h=h, rstd=r, weight=w, **rope)
    dy = torch.randn_like(y)
    da, zdz = CFG.backend.rope_bwd(dy=dy, y=y, rstd=r, **rope)
    p = (h @ w.t()) * r[:, None]
    dp = da / r[:, None]
    torch.testing.assert_close(zdz, (p * dp).sum(-1), rtol=1e-12, atol=1e-12)
    v0 = (HQ + HKV) * HD
    torch.testing.assert_close(y[:, v0:], p[:, v0:])  # v is not rotated


def test_norm_rope_fp8_matches_fp64_emulation():
    gen = torch.Generator().manual_seed(3)
    hd, hq_, hkv, seqlen = 32, 4, 2, 16
    q = (hq_ + 2 * hkv) * hd
    hq, wq, scale, rstd = fp8_operands(2 * seqlen, 128, q, gen)
    freqs = rope_freqs(hd, 500000.0, RoPEScalingArgs())
    kw = dict(freqs=freqs, seqlen=seqlen, n_rope_heads=hq_ + hkv, head_dim=hd)
    y = TORCH.norm_rope_fp8(hq=hq, rstd=rstd, weight_q=wq, scale=scale, out_dtype=torch.float32, **kw)
    p = (hq.double() @ wq.double().t()) * (rstd.double() * scale.double())[:, None]
    y64 = rotate(p, freqs, seqlen, n_rope_heads=hq_ + hkv, head_dim=hd, inverse=False)
    assert rel(y, y64) < 1e-6
    assert y.dtype == torch.float32 and y.shape == (2 * seqlen, q)


def test_b1_fp8_casts_its_gradient_to_e5m2_with_a_current_or_delayed_scale():
    """Calibrating (no scale), B1 casts da with its current amax's scale; with a delayed one (the QKV
    gradient site's history, ``fp8_dgrad``) it casts with that, saturating what lies beyond its range;
    either way it reports amax |da| of the fp32 da."""
    from coda_titan.kernels.scaling import E5M2, E5M2_MAX, quantize_e5m2

    gen = torch.Generator().manual_seed(12)
    hd, nh, seqlen = 16, 3, 8
    q = (nh + 1) * hd
    dy, y = torch.randn(2 * seqlen, q, generator=gen) * 1e-3, torch.randn(2 * seqlen, q, generator=gen)
    rstd = torch.rand(2 * seqlen, generator=gen) + 0.5
    kw = dict(dy=dy, y=y, rstd=rstd, freqs=rope_freqs(hd, 500000.0, RoPEScalingArgs()), seqlen=seqlen,
              n_rope_heads=nh, head_dim=hd)
    da, zdz, daq, amax = TORCH.rope_bwd_fp8(**kw, inv_scale=None)
    da0, zdz0 = TORCH.rope_bwd(**kw)
    assert torch.equal(da, da0) and torch.equal(zdz, zdz0)  # the bf16 outputs are B1's own
    assert daq.dtype == E5M2 and daq.shape == da.shape and amax.shape == ()
    assert daq.float().abs().max() == E5M2_MAX  # current scale: the amax lands on the top of the range
    da32 = rotate(dy, kw["freqs"], seqlen, n_rope_heads=nh, head_dim=hd, inverse=True) * rstd[:, None]
    inv = inv_scale_from_amax(da32.abs().amax(), E5M2_MAX)
    assert amax == da32.abs().amax() and torch.equal(daq.float(), quantize_e5m2(da32, inv).float())  # from fp32 da
    for delayed in (inv / 8, inv * 4):  # a history 8x larger (headroom), or 4x smaller (this step outgrew it)
        got = TORCH.rope_bwd_fp8(**kw, inv_scale=delayed)
        assert torch.equal(got[0], da) and torch.equal(got[1], zdz) and got[3] == amax
        want = (da32 * delayed).clamp(-E5M2_MAX, E5M2_MAX)
        assert torch.equal(got[2].float(), want.to(E5M2).float()), delayed
        assert (got[2].float().abs().max() == E5M2_MAX) == (delayed > inv)  # saturated only beyond the range
    s = inv.reciprocal()
    rel = ((daq.double() * s.double() - da.double()).abs() / da.double().abs().clamp(min=1e-30))
    big = da.double().abs() > da.double().abs().max() * 2.0**-14  # e5m2 normals under this scale
    assert (rel[big] <= 2.0**-3 + 1e-6).all()  # 2 mantissa bits: half a step is 2^-3 relative


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ['norm_rope', 'rope_bwd'])
def test_opcheck(name, dtype):
    """Schema, fake and aot_dispatch of the op (its reference kernel on CPU)."""
    opcheck(getattr(torch.ops.coda, name).default, op_cases(dtype)[name])


def test_f3_on_three_weights_is_f3_on_their_rows_stacked():
    """``norm_rope(weight=wq, weight2=wk, weight3=wv)`` ([coda] stacked_weights) is F3 on torch.cat of them, bit for
    bit; through the op too (schema, fake, dispatch)."""
    h, rstd, w, *rope = op_cases(torch.float32)["norm_rope"]
    q = w.shape[0] // 3
    parts = [w[:q].clone(), w[q:2 * q].clone(), w[2 * q:].clone()]
    assert torch.equal(torch.ops.coda.norm_rope(h, rstd, *parts[:1], *rope, *parts[1:]),
                       torch.ops.coda.norm_rope(h, rstd, w, *rope))
    opcheck(torch.ops.coda.norm_rope.default, (h, rstd, parts[0], *rope, *parts[1:]))


def test_fp8_ops_schemas_and_fakes():
    freqs = rope_freqs(16, 500000.0, RoPEScalingArgs())
    dy, yq = torch.randn(16, 48), torch.randn(16, 48)
    for inv in (None, torch.tensor(100.0)):
        opcheck(torch.ops.coda.rope_bwd_fp8.default, (dy, yq, torch.rand(16) + 0.5, freqs, 8, 2, 16, inv),
                test_utils=("test_faketensor",))


def test_rope_tables_op_is_rope_cos_sin():
    """The tables a traced B1 reads through ``coda::rope_tables`` are ``rope_cos_sin``'s, in fp32."""
    from coda_titan.kernels.norm_rope import rope_cos_sin

    freqs = rope_freqs(16, 500000.0, RoPEScalingArgs())
    cos, sin = torch.ops.coda.rope_tables(freqs, 8)
    c, s = rope_cos_sin(freqs, 8, torch.float32)
    assert cos.dtype == torch.float32 and torch.equal(cos, c) and torch.equal(sin, s)
    opcheck(torch.ops.coda.rope_tables.default, (freqs, 8))


def test_f3_on_row_slices_of_w_qkv_is_the_packed_program():
    """The probe's F3 splits (``scripts/probes/fa4_layouts.py``: q then k v, or q, k, v apart, each call
    rotating its leading heads) give the packed program's columns, bf16 and fp8 alike. Integer-valued
    operands: every sum is exact in any order, so the reference's outputs must be equal bit for bit."""
    from scripts.probes.fa4_layouts import f3_calls, f3_splits

    from coda_titan.kernels.scaling import E4M3

    n_q, n_kv, hd, seqlen, m, d = 4, 2, 16, 6, 12, 32
    freqs = rope_freqs(hd, 500000.0, RoPEScalingArgs())
    g = torch.Generator().manual_seed(0)
    h = torch.randint(-3, 4, (m, d), generator=g).double()
    w = torch.randint(-3, 4, ((n_q + 2 * n_kv) * hd, d), generator=g).double()
    rstd = torch.rand(m, dtype=torch.float64, generator=g) + 0.5
    cases = {"fp64": (h, w, None), "fp8": (h.to(E4M3), w.to(E4M3), torch.tensor(0.25))}
    splits = f3_splits(n_q, n_kv, hd)
    assert [sum(rows for _, rows, _ in s) for s in splits.values()] == [(n_q + 2 * n_kv) * hd] * 3
    for prec, (a, b, scale) in cases.items():
        outs = {name: torch.cat(f3_calls(split, a, rstd, b, freqs, seqlen, hd, scale)(), dim=1)
                for name, split in splits.items()}
        for name, got in outs.items():
            assert torch.equal(got, outs["packed"]), (prec, name)
        v = outs["packed"][:, (n_q + n_kv) * hd:]  # v is not rotated: the plain GEMM's columns times r
        plain = (a.double() @ b.double().t())[:, (n_q + n_kv) * hd:] * rstd[:, None]
        assert torch.equal(v.double(), (plain * (1 if scale is None else scale.double())).to(v.dtype).double()), prec


@pytest.mark.gpu
@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("name", ['norm_rope', 'rope_bwd'])
def test_cute_matches_reference(name, d):
    check_cute_matches_reference(name, d)


@pytest.mark.gpu
@pytest.mark.parametrize("d", DIMS)
def test_cute_f3_on_three_weights_matches_reference(d):
    """F3 given W_q, W_k, W_v apart ([coda] stacked_weights): a view of their one buffer where they share one, a
    copy where not, against the reference within the derived bound, and bit for bit F3 on the stacked weight."""
    from .helpers import gpu_inputs

    gen = torch.Generator(device="cuda").manual_seed(43)
    kw = gpu_inputs("norm_rope", d, gen)
    w = kw.pop("weight")
    kv = w.shape[0] - kw["n_rope_heads"] * kw["head_dim"]  # (W_v's rows, W_k's alike: v is not rotated)
    q = w.shape[0] - 2 * kv
    parts = (w[:q], w[q:q + kv], w[q + kv:])
    check_cute_matches_reference("norm_rope", d, weight=parts[0], weight2=parts[1], weight3=parts[2])
    cute = get_backend("cute")
    whole = cute.norm_rope(weight=w, **kw)
    for p in (parts, [t.clone() for t in parts]):
        assert torch.equal(cute.norm_rope(weight=p[0], weight2=p[1], weight3=p[2], **kw), whole)


@pytest.mark.gpu
def test_cute_fp8_qkv_dgrad_matches_reference():
    """B1 -> B2 of F3 in fp8 (e5m2 gradient x e4m3 W_qkv^T) on the cute backend against the torch
    reference on the same operands, bounded by what the fp8 cast itself moves B2's output. B1 both
    calibrating and with a delayed scale (``fp8_dgrad``)."""
    import coda_titan.kernels.cute  # noqa: F401
    from coda_titan.kernels.scaling import E5M2, E5M2_MAX

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
    da, zdz, daq, amax = cute.rope_bwd_fp8(**kw, inv_scale=None)
    da_r, zdz_r, daq_r, amax_r = TORCH.rope_bwd_fp8(**kw, inv_scale=None)
    assert daq.dtype == E5M2 and torch.allclose(amax, amax_r, rtol=1e-6)
    step_apart = (daq.float() != daq_r.float()).float().mean().item()  # cos/sin tables vs rotate: ulps
    assert rel(da, da_r) < 1e-2 and step_apart < 1e-3, step_apart
    delayed = inv_scale_from_amax(amax_r * 4.0, E5M2_MAX)  # a history's scale, with headroom
    got, want = cute.rope_bwd_fp8(**kw, inv_scale=delayed), TORCH.rope_bwd_fp8(**kw, inv_scale=delayed)
    step_apart = (got[2].float() != want[2].float()).float().mean().item()
    assert got[2].dtype == E5M2 and torch.allclose(got[3], amax_r, rtol=1e-6) and step_apart < 1e-3, step_apart
    s_da_r = inv_scale_from_amax(amax_r, E5M2_MAX).reciprocal()
    w = (torch.randn(q, d, generator=gen, device="cuda") * d**-0.5).to(BF)
    x, dres = torch.randn(m, d, generator=gen, device="cuda").to(BF), torch.randn(m, d, generator=gen, device="cuda").to(BF)
    gamma = (torch.rand(d, generator=gen, device="cuda") + 0.5).to(BF)
    wq8, s_w = cute.quantize_tensorwise(w=w)
    for dresidual in (dres, None):
        bkw = dict(daq=daq_r, weight_tq=wq8.t().contiguous(), scale=s_da_r * s_w, x=x, gamma=gamma, rstd=rstd,
                   zdz=zdz_r, dresidual=dresidual)
        out, dg, am = cute.norm_residual_bwd_fp8(**bkw)
        out_r, dg_r, _ = TORCH.norm_residual_bwd_fp8(**bkw)
        # (the epilogue's amax of the fp32 D, rounded as D's stores are: D's own amax, bit for bit)
        assert am.dtype == torch.float32 and torch.equal(am, out.float().abs().amax()), (am, out.float().abs().amax())
        bf, bf_dg = TORCH.norm_residual_bwd(da=da_r, weight=w, x=x, gamma=gamma, rstd=rstd, zdz=zdz_r, dresidual=dresidual)
        effect = rel(out_r - (dres if dresidual is not None else 0), bf - (dres if dresidual is not None else 0))
        print(f"B2 fp8 (residual {dresidual is not None}): kernel vs reference {rel(out, out_r):.3g} / dgamma "
              f"{rel(dg, dg_r):.3g}; fp8 effect {effect:.3g}")
        assert out.isfinite().all() and rel(out, out_r) < 0.1 * effect and rel(dg, dg_r) < 0.1 * max(rel(dg_r, bf_dg), 1e-3)


def test_b1_triton_pass_is_the_inductor_programs_arithmetic_in_the_interpreter():
    """B1's one-pass Triton kernel (the cute backend's, ``kernels/cute/rope_bwd_pass.py``) run by Triton's
    CPU interpreter (``tests/b1_interpreter_check.py``, a subprocess: TRITON_INTERPRET is read at import)
    against the fp32 arithmetic of the inductor program it replaces. The interpreter rounds fp32 to bf16
    by truncation, so da must equal the reference truncated, bit for bit (the GPU rounds to nearest:
    the GPU tests); zdz differs only by the row sum's order: at most 2 (q - 1) fp32 units of the sum of
    its terms' magnitudes (two orders, each within (q - 1) u of the exact sum); the fp8 pass's amax is the reference's exactly (a max). Its e5m2 codes are
    checked on the GPU only (``test_cute_fp8_qkv_dgrad_matches_reference``): the interpreter's fp32 to
    e5m2 conversion is its own (1.93 became 1.0), not the hardware's round to nearest. With dy and y
    slices of wider buffers (rows further apart than their width) the pass writes the same bytes."""
    got = run_interpreter_check("b1_interpreter_check.py")
    wide = got.pop("wide_same")
    assert all(wide.values()), wide
    assert got["da_dtype"] == "torch.bfloat16" and got["da_bits_apart"] == 0, got
    assert got["zdz_err_over_bound"] <= 1.0 and got["zdz_fp8_same"], got
    assert got["daq_is_e5m2"] and got["amax_equal"] and got["amax_shape"] == [], got
