"""B2 norm_residual_bwd: the fp8 program against an fp64 emulation and its bf16 twin, the ops (with and
without a residual), and the cute kernel against the reference (GPU)."""

import pytest
import torch
from torch.library import opcheck

from coda_titan.kernels.scaling import inv_scale_from_amax
from coda_titan.model.rope import rope_freqs
from torchtitan.models.llama3.model.args import RoPEScalingArgs

from .helpers import DIMS, TORCH, check_cute_matches_reference, op_cases, rel, run_interpreter_check


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
        out, dgamma, amax = TORCH.norm_residual_bwd_fp8(daq=daq, weight_tq=wq.t().contiguous(), scale=scale, **kw)
        acc = (daq.double() @ wq.double()) * scale.double()  # exact products, fp64 sum
        want, want_dg = norm_residual_apply(acc, **{k: (v.double() if v is not None else None) for k, v in kw.items()})
        assert rel(out, want) < 1e-6 and rel(dgamma, want_dg) < 1e-6
        assert amax.dtype == torch.float32 and amax.shape == () and torch.equal(amax, out.abs().amax())  # (D's own)
        ref, ref_dg = TORCH.norm_residual_bwd(da=da, weight=w, **kw)  # no quantization
        assert 1e-4 < rel(out, ref) < 0.1 and rel(dgamma, ref_dg) < 0.1
    with pytest.raises(TypeError, match="e5m2/e4m3"):
        TORCH.norm_residual_bwd_fp8(daq=da, weight_tq=wq.t().contiguous(), scale=scale, **kw)
    assert daq.dtype == E5M2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ['norm_residual_bwd'])
def test_opcheck(name, dtype):
    """Schema, fake and aot_dispatch of the op (its reference kernel on CPU)."""
    opcheck(getattr(torch.ops.coda, name).default, op_cases(dtype)[name])


def test_b2_on_two_weights_is_b2_on_their_rows_stacked():
    """``norm_residual_bwd(weight=a, weight2=b[, weight3=c])`` ([coda] stacked_weights: [w1; w3], [wq; wk; wv]) is
    B2 on torch.cat of them, bit for bit; through the op too (schema, fake, dispatch)."""
    args = list(op_cases(torch.float32)["norm_residual_bwd"])
    w = args[1]
    k = w.shape[0] // 4
    ref = torch.ops.coda.norm_residual_bwd(*args)
    for parts in ((w[:2 * k], w[2 * k:]), (w[:2 * k], w[2 * k:3 * k], w[3 * k:])):
        parts = [p.clone() for p in parts]
        split = (args[0], parts[0], *args[2:], *parts[1:])
        assert all(torch.equal(p, q) for p, q in zip(ref, torch.ops.coda.norm_residual_bwd(*split)))
        opcheck(torch.ops.coda.norm_residual_bwd.default, split)


def test_opcheck_without_residual():
    args = list(op_cases(torch.float32)["norm_residual_bwd"])
    args[-1] = None
    opcheck(torch.ops.coda.norm_residual_bwd.default, tuple(args))


def test_fp8_ops_schemas_and_fakes():
    freqs = rope_freqs(16, 500000.0, RoPEScalingArgs())
    dy, yq, res, g = torch.randn(16, 48), torch.randn(16, 48), torch.randn(16, 64), torch.rand(64)
    daq = TORCH.rope_bwd_fp8(dy=dy, y=yq, rstd=torch.rand(16), freqs=freqs, seqlen=8, n_rope_heads=2, head_dim=16,
                           inv_scale=None)[2]
    wt = TORCH.quantize_tensorwise(w=torch.randn(48, 64))[0].t().contiguous()
    for dres in (res, None):
        opcheck(torch.ops.coda.norm_residual_bwd_fp8.default,
                (daq, wt, torch.tensor(0.5), res, g, torch.rand(16), torch.randn(16), dres),
                test_utils=("test_faketensor",))


def test_b2_vectors_in_one_launch_give_the_eager_ops_bits():
    """B2's epilogue vectors from one Triton launch (``kernels/cute/row_vectors.py``), run by Triton's CPU
    interpreter (``tests/b2_vectors_interpreter_check.py``): corr = -(r^2/d) zdz and gamma (times the fp8
    scale) bit for bit as the eager ops the B2 op ran (aten divides by a scalar through its fp32 reciprocal;
    at a power-of-two d that is the division itself), for rstd / zdz as (M,) and (M, 1), gamma in bf16 and
    fp32, M above and below d; the fp8 B2's amax fold (``fold_amax``, one launch) bit for bit as
    ``partials.amax().to(dtype).float()`` for bf16 and fp16, a ragged last block and ties, past 128 blocks (more
    programs, the count reset for the next call), a NaN partial winning as
    in torch.amax and an infinite one kept, and unrounded (fp32) as ``partials.amax()``; and the refusals of
    mismatched shapes, a non-fp32 scale, non-fp32 partials and a rounding dtype other than bf16 / fp16 / fp32."""
    got = run_interpreter_check("b2_vectors_interpreter_check.py")
    cases = [v for k, v in got.items() if k != "refusals" and not k.startswith("fold")]
    assert len(cases) == 3
    for case in cases:
        assert case["corr_apart"] == 0 and case["w_apart"] == 0 and case["w_sc_apart"] == 0, case
        assert case["pow2_matches_division"] and case["dtypes"] == ["torch.float32"] * 2, case
    folds = [v for k, v in got.items() if k.startswith("fold_") and isinstance(v, dict)]
    assert len(folds) == 4 and all(f["apart"] == 0 and f["dtype"] == "torch.float32" for f in folds), folds
    assert got["fold_ties_apart"] == 0 and got["fold_fp32_apart"] == 0 and got["fold_nan_wins"] and got["fold_inf"], got
    # past 128 blocks of partials the fold runs on more programs, and leaves the count at 0 for the next call
    assert got["fold_programs"] == [64, 256, 256], got
    assert got["fold_fp32_large_apart"] == 0 and got["fold_after_large_apart"] == 0, got
    assert got["fold_div_apart"] == 0, got  # (B3's amax: divided by its scale, as partials.amax() / div)
    assert all(got["refusals"].values()), got["refusals"]


@pytest.mark.gpu
@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("name", ['norm_residual_bwd'])
def test_cute_matches_reference(name, d):
    check_cute_matches_reference(name, d)


@pytest.mark.gpu
@pytest.mark.parametrize("d", DIMS)
def test_cute_b2_on_two_weights_matches_reference(d):
    """B2 with ``weight2`` ([coda] stacked_weights): the two weights' rows as one B, a view where they share a
    buffer and a copy where not, against the reference within the derived bound, and bit for bit the op on the
    stacked weight."""
    from coda_titan.kernels import get_backend
    from .helpers import gpu_inputs

    gen = torch.Generator(device="cuda").manual_seed(41)
    kw = gpu_inputs("norm_residual_bwd", d, gen)
    w = kw.pop("weight")
    k = w.shape[0] // 2
    check_cute_matches_reference("norm_residual_bwd", d, weight=w[:k], weight2=w[k:])
    cute = get_backend("cute")
    whole = cute.norm_residual_bwd(weight=w, **kw)
    for lo, hi in ((w[:k], w[k:]), (w[:k].clone(), w[k:].clone())):
        assert all(torch.equal(p, q) for p, q in zip(cute.norm_residual_bwd(weight=lo, weight2=hi, **kw), whole))


def _b2_operands(seed, fp8):
    """B2's operands on the GPU (2048 tokens, K 1024, d 512): (a, b_kn, X, dres, gamma, corr); ``fp8``: a and
    b_kn as the fp8 B2 takes them (e5m2 da, e4m3 W^T as a K-major view)."""
    from coda_titan.kernels import get_backend

    gen = torch.Generator(device="cuda").manual_seed(seed)
    m, k, d = 2048, 1024, 512
    bf = torch.bfloat16
    da = (torch.randn(m, k, generator=gen, device="cuda") * 1e-2).to(bf)
    w = (torch.randn(k, d, generator=gen, device="cuda") * k**-0.5).to(bf)
    x, dres = torch.randn(m, d, generator=gen, device="cuda").to(bf), torch.randn(m, d, generator=gen, device="cuda").to(bf)
    gamma, rstd = 1 + 0.1 * torch.randn(d, generator=gen, device="cuda"), torch.rand(m, generator=gen, device="cuda") + 0.5
    corr = -(rstd**2 / d) * (torch.randn(m, generator=gen, device="cuda") * 1e-3)
    if fp8:
        be = get_backend("cute")
        a = be.quantize_grad(t=da)[0]
        b_kn = be.quantize_tensorwise(w=w.t().contiguous())[0].t()
    else:
        a, b_kn = da, w
    return a, b_kn, x, dres, gamma, corr


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_cute_b2_with_a_lower_c_stage_base_gives_the_same_bits(fp8, monkeypatch):
    """``CODA_TITAN_EPI_C_STAGES`` (``coda_titan.kernels.cute.stages``) changes only how B2's shared memory
    is split into pipeline stages: on the same tile config (256 x 128 cooperative, where it moves stages
    from the epilogue's C loads to the mainloop) D and the dgamma partials are bit for bit quack's. The
    op with it set (autotuned, our own copy of the epilogue) passes the reference check of every B2."""
    import coda_titan.kernels.cute  # noqa: F401
    from coda_titan.kernels.cute import epilogues, stages
    from quack.gemm_config import GemmConfig

    a, b_kn, x, dres, gamma, corr = _b2_operands(5, fp8)
    keep, outs = [], {}
    for base in (None, 2):
        cfg = GemmConfig(tile_m=256, tile_n=128, pingpong=False, cluster_m=1, cluster_n=2, is_dynamic_persistent=False,
                         device_capacity=9)
        keep.append(cfg)  # (quack's eager call cache keys a pinned config by its id)
        out = {"D": torch.empty_like(x)}
        with stages.capped(base):
            r = epilogues.norm_residual_bwd_epi(a, b_kn, dres, out=out, tuned=False, config=cfg, y=x, w=gamma, corr=corr)
        outs[base] = (out["D"], r["dw"])
    assert all(torch.equal(p, q) for p, q in zip(outs[None], outs[2]))
    if not fp8:
        monkeypatch.setenv(stages.ENV, "2")
        check_cute_matches_reference("norm_residual_bwd", DIMS[0])
        for bad in ("0", "two"):  # (a value that is not a base is an error, not quack's default)
            monkeypatch.setenv(stages.ENV, bad)
            with pytest.raises(ValueError, match=stages.ENV):
                stages.requested_base()


@pytest.mark.gpu
def test_fold_amax_launched_directly_folds_as_its_first_launch():
    """``fold_amax`` launches its kernel through Triton's JIT the first time for a specialization key and directly
    after that (``row_vectors._launch_fold``): every call, first or later, gives the amax of the partials as
    aten reduces it (exact: a maximum), rounded to the dtype asked for, or divided (rounded to nearest) where a
    divisor is given; across counts a multiple of 16 or not, a count of 1, and partials at a 4-byte offset
    (another alignment, so another compiled kernel)."""
    from coda_titan.kernels.cute import row_vectors as rv

    gen = torch.Generator(device="cuda").manual_seed(5)
    base = torch.rand(262144 + 32, generator=gen, device="cuda") * 100
    div = torch.tensor([3.0], device="cuda")
    for n in (262144, 262149, 4000, 1):
        for off in (0, 1):
            parts = base[off:off + n]
            for _ in range(3):
                for dt in (torch.bfloat16, torch.float16, torch.float32):
                    got, want = rv.fold_amax(parts, dt), parts.amax().to(dt).float()
                    assert torch.equal(got.reshape(1), want.reshape(1)), (n, off, dt, got.item(), want.item())
                got, want = rv.fold_amax(parts, torch.float32, div=div), parts.amax() / div.reshape(())
                assert torch.equal(got.reshape(1), want.reshape(1)), (n, off, "div", got.item(), want.item())
    assert len(rv._FOLDS) >= 8  # (the keys met above, each compiled once)
