"""``[coda] fp8_preact``: F2 saves the pre-activations a as e4m3 codes (delayed power-of-two scale), and the fp8
B3 with da^T reads them. References against fp64 and against B3 on the decoded a, the ops, the model (CPU);
the kernels bit for bit against B3 on the decoded bf16 a, and F2's codes within one rounding (GPU)."""

import os

import pytest
import torch
from torch.library import opcheck

from coda_titan.kernels import get_backend
from coda_titan.kernels.scaling import E4M3, E5M2_MAX, e4m3_step, inv_scale_from_amax, pow2_floor, quantize_e4m3

from .helpers import BF, TORCH, assert_codes_within, f2_fp8_cuda, fp8_operands, log_bound, rel
from .test_model import _batch, _grads, _models, _saved_bytes, _spy
from .test_norm_swiglu import _b3_q_operands


def test_f2_saves_a_as_the_e4m3_codes_of_its_compute_dtype_v():
    """``norm_swiglu_qa_fp8``: y's codes and amax are ``norm_swiglu_q_fp8``'s; a's codes are v (fp32, never
    rounded to bf16 first) times inv_a, saturated and rounded once; amax |a| is max |v|; in fp64, exact
    against the fp64 emulation."""
    gen = torch.Generator().manual_seed(31)
    hq, wq, scale, rstd = fp8_operands(70, 256, 2 * 96, gen)
    y32, v32 = TORCH.norm_swiglu_fp8(hq=hq, rstd=rstd, w13q=wq, scale=scale, out_dtype=torch.float32)
    inv_y = inv_scale_from_amax(y32.abs().amax())
    inv_a = pow2_floor(inv_scale_from_amax(v32.abs().amax() * 0.25))  # (a stale history: the top saturates)
    yq, aq, amax_y, amax_a = TORCH.norm_swiglu_qa_fp8(hq=hq, rstd=rstd, w13q=wq, scale=scale, inv_y=inv_y, inv_a=inv_a,
                                                      out_dtype=torch.bfloat16)
    yq0, a0, amax0 = TORCH.norm_swiglu_q_fp8(hq=hq, rstd=rstd, w13q=wq, scale=scale, inv_y=inv_y, out_dtype=torch.bfloat16)
    assert torch.equal(yq.view(torch.uint8), yq0.view(torch.uint8)) and torch.equal(amax_y, amax0)
    assert aq.dtype == E4M3 and aq.shape == a0.shape and amax_a.item() == v32.abs().amax().item()
    assert torch.equal(aq.view(torch.uint8), quantize_e4m3(v32, inv_a).view(torch.uint8))
    assert not torch.equal(aq.view(torch.uint8), quantize_e4m3(a0.float(), inv_a).view(torch.uint8))  # (bf16 first differs)
    assert aq.float().abs().max().item() == 448.0  # saturated, not overflowed
    v64 = (hq.double() @ wq.double().t()) * scale.double()
    _, aq64, _, amax64 = TORCH.norm_swiglu_qa_fp8(hq=hq, rstd=rstd.double(), w13q=wq, scale=scale.double(),
                                                  inv_y=inv_y.double(), inv_a=inv_a.double(), out_dtype=torch.float64)
    assert torch.equal(aq64.view(torch.uint8), quantize_e4m3(v64, inv_a.double()).view(torch.uint8))
    assert abs(amax64.item() - v64.abs().amax().item()) <= 1e-13 * amax64.item()


def _bytes(t):
    return t.reshape(-1).view(torch.uint8)


def _decoded(aq, a_scale, dtype):
    return (aq.to(torch.float64) * a_scale.double()).to(dtype)


def test_b3_on_a_codes_is_b3_on_the_decoded_a():
    """``swiglu_bwd_e5m2_t_qa`` with a power-of-two a_scale computes on exactly the values a bf16 a decoded
    from the codes holds (e4m3 values fit bf16's mantissa; a power of two scales exactly), so it is
    ``swiglu_bwd_e5m2_t_q`` on that bf16 a output for output, bit for bit (fp32 compute); in fp64 too."""
    gen = torch.Generator().manual_seed(32)
    m, d, f = 24, 32, 40
    _, _, a, rstd, dq, s_d, w2q_t, s_w = _b3_q_operands(gen, m, d, f)
    inv_a = pow2_floor(inv_scale_from_amax(a.abs().amax()))
    aq, a_scale = quantize_e4m3(a, inv_a), 1 / inv_a
    for ct, out in ((torch.float32, torch.bfloat16), (torch.float64, torch.float64)):
        for inv_g, inv_y in ((None, None), (torch.tensor(2.0**12, dtype=ct), torch.tensor(30.0, dtype=ct))):
            common = dict(doutq=dq, w_down_tq=w2q_t, scale=(s_d * s_w).to(ct), rstd=rstd.to(ct), inv_scale=inv_g,
                          inv_y=inv_y)
            got = TORCH.swiglu_bwd_e5m2_t_qa(**common, aq=aq, a_scale=a_scale.to(ct), out_dtype=out)
            want = TORCH.swiglu_bwd_e5m2_t_q(**common, a=_decoded(aq, a_scale, out))
            assert len(got) == len(want) == 5
            for i, (x, y) in enumerate(zip(got, want)):
                assert x.dtype == y.dtype and torch.equal(_bytes(x), _bytes(y)), (ct, i)
    with pytest.raises(TypeError, match="e4m3 codes"):
        TORCH.swiglu_bwd_e5m2_t_qa(**common, aq=a.to(torch.bfloat16), a_scale=a_scale, out_dtype=torch.bfloat16)


def test_preact_ops_schemas_and_fakes():
    gen = torch.Generator().manual_seed(33)
    hq, wq, scale, rstd = fp8_operands(32, 64, 2 * 48, gen)
    opcheck(torch.ops.coda.norm_swiglu_qa_fp8.default, (hq, rstd, wq, scale, torch.tensor(2.0), torch.tensor(4.0),
                                                        torch.bfloat16), test_utils=("test_faketensor",))
    _, _, a, rstd, dq, s_d, w2q_t, s_w = _b3_q_operands(gen, 8, 16, 24)
    aq = quantize_e4m3(a, torch.tensor(4.0))
    for inv in (None, torch.tensor(2.0**10)):
        for extra in ((), (torch.tensor(30.0),)):
            opcheck(torch.ops.coda.swiglu_bwd_e5m2_t_qa.default,
                    (dq, w2q_t, s_d * s_w, aq, torch.tensor(0.25), rstd, inv, torch.bfloat16, *extra),
                    test_utils=("test_faketensor",))


_KNOBS = dict(fp8_mlp_dgrad=True, fp8_mlp_wgrad=True, fp8_mlp_wgrad_e5m2=True, fp8_down_proj=True, fp8_down_dgrad=True,
              fp8_mlp_da_t=True, fp8_down_wgrad=True)


def _shipped_fp8_knobs() -> dict:
    """The boolean fp8 knobs of ``configs/llama3_1b_fp8_coda_compile.toml``: the schema's defaults, then the file's."""
    import dataclasses

    import tomli

    from coda_titan.titan.job_config import Coda

    from .conftest import CONFIGS

    with open(CONFIGS / "llama3_1b_fp8_coda_compile.toml", "rb") as f:
        coda = tomli.load(f)["coda"]
    knobs = {f.name: f.default for f in dataclasses.fields(Coda) if f.name.startswith("fp8_") and f.type is bool}
    return {**knobs, **{k: v for k, v in coda.items() if k in knobs}}


@pytest.mark.parametrize("knobs", ["b3", "shipped"])
def test_fp8_preact_saves_a_as_codes_once_calibrated_and_b3_reads_them(knobs):
    """The model with ``fp8_preact``: the first step calibrates (bf16 a, its amax recorded), then F2 writes
    a's e4m3 codes with the site's power-of-two scale (``norm_swiglu_qa_fp8``) and B3 reads them
    (``swiglu_bwd_e5m2_t_qa``). The forward is the model's without it bit for bit (y comes from v either
    way); the saved activations shrink by a's bytes less one byte an element; the gradients track the
    bf16 model's; the site's history is each layer's amax |a|, and its checkpoint state round-trips. "b3": the
    knobs it needs only; "shipped": on top of every fp8 knob of the compiled 1B fp8 config (its A/B's base)."""
    kw = _KNOBS if knobs == "b3" else {**_shipped_fp8_knobs(), "fp8_preact": False}
    bf16, off = _models(**kw)
    _, on = _models(**{**kw, "fp8_preact": True})
    names = ("norm_swiglu_q_fp8", "norm_swiglu_qa_fp8", "swiglu_bwd_e5m2_t_q", "swiglu_bwd_e5m2_t_qa")
    calls = _spy(on, names)
    tokens, labels = _batch(on.model_args.vocab_size)
    n, steps, saved = len(on.layers), [], []
    for _ in range(3):
        calls.clear()
        saved.append(_saved_bytes({"off": off, "on": on}, tokens, labels))
        steps.append(sorted(set(calls)))
    assert steps[0] == ["swiglu_bwd_e5m2_t_q"] and steps[1] == steps[2] == ["norm_swiglu_qa_fp8", "swiglu_bwd_e5m2_t_qa"]
    assert calls.count("swiglu_bwd_e5m2_t_qa") == n
    hist = on.fp8_scaling.input_history("preact")
    assert hist.shape[0] == n and (hist[:, :3] > 0).all()
    inv = on.fp8_scaling.input_inv_scales("preact")
    assert all(torch.equal(i, pow2_floor(i)) for i in inv)
    ff = next(iter(on.layers.values())).feed_forward.w1.weight.shape[0]
    elem = torch.empty((), dtype=torch.get_default_dtype()).element_size()
    a_elems = tokens.numel() * 2 * ff
    assert saved[0]["off"] - saved[0]["on"] == 0 and saved[2]["off"] - saved[2]["on"] == n * (a_elems * (elem - 1) - 4)
    loss_off, loss_on = off(tokens, labels=labels), on(tokens, labels=labels)
    assert torch.equal(loss_off, loss_on)
    for m in (bf16, off, on):
        m.zero_grad()
    loss = bf16(tokens, labels=labels)
    loss.backward(), loss_on.backward(), loss_off.backward()
    g, g_on, g_off = _grads(bf16), _grads(on), _grads(off)
    for k in g:
        cos = torch.nn.functional.cosine_similarity(g[k].flatten(), g_on[k].flatten(), dim=0).item()
        assert cos > 0.98, (k, cos)
    assert any(not torch.equal(g_on[k], g_off[k]) for k in g)  # (B3 read other values of a)
    state = on.fp8_scaling.checkpoint_state()
    assert torch.equal(state["preact_history"], hist) and state["preact_calibrated"].item() == 1


def test_preact_clamps_are_counted_against_the_power_of_two_scale_used():
    """The preact site's scale is rounded down to a power of two, so it covers more than its history's max x
    headroom: a step's amax is counted as clamped only past what that scale covers (448 / 128 = 3.5 for a
    history max of 3 without headroom), not past 3."""
    from coda_titan.model.fp8_scaling import SATURATION_KINDS, Fp8Scaling

    sc = Fp8Scaling(n_layers=1, history=4, grad_margin=0, act_margin=0)
    sc.record_input("preact", [torch.tensor(3.0)])
    assert torch.equal(sc.input_inv_scales("preact")[0], torch.tensor(128.0))
    row = sc.saturation[SATURATION_KINDS.index("preact")]
    sc.record_input("preact", [torch.tensor(3.4)])
    assert row[0].item() == 0
    sc.record_input("preact", [torch.tensor(3.9)])  # (history max 3.4 then: 448 / 128 covers 3.5)
    assert row[0].item() == 1 and abs(row[1].item() - 3.9 / 3.5) < 1e-6


def test_fp8_preact_needs_the_b3_that_reads_its_codes():
    from coda_titan.titan.job_config import Coda, ConfigError, validate

    validate(Coda(precision="fp8", fp8_preact=True))  # (the defaults carry it)
    for knob in ("fp8_mlp_da_t", "fp8_down_dgrad", "fp8_down_proj"):
        with pytest.raises(ConfigError, match=f"fp8_preact = true needs .*{knob} = false"):
            validate(Coda(precision="fp8", fp8_preact=True, **{knob: False}))
    with pytest.raises(ConfigError, match="fp8_preact"):
        validate(Coda(precision="bf16", fp8_preact=True))


@pytest.mark.gpu
def test_cute_b3_on_a_codes_is_the_cute_b3_on_the_decoded_a_bit_for_bit():
    """The kernel (C = the codes' bf16 view, decoded exactly in the epilogue) against the shipped fp8 B3
    with da^T on a bf16 a decoded from the same codes: the same values reach the same arithmetic, on the same
    pinned tile config, so every output must be the same bits (a wrong byte order, a flushed subnormal word
    or a lost scale shows as a difference)."""
    import coda_titan.kernels.cute  # noqa: F401

    os.environ.setdefault("CODA_TITAN_AUTOTUNE", "0")
    cute = get_backend("cute")
    gen = torch.Generator(device="cuda").manual_seed(34)
    m, d, f = 4096, 2048, 8192
    _, _, a, rstd, dq, s_d, w2q_t, s_w = _b3_q_operands(gen, m, d, f, device="cuda")
    a[0, :64] = 0.0  # (zero codes, and words whose bf16 view is subnormal: an up code of 0 under a small gate)
    a[1, 0::2], a[1, 1::2] = 2.0**-4, 0.0
    inv_a = pow2_floor(inv_scale_from_amax(a.abs().amax()))
    aq, a_scale = quantize_e4m3(a, inv_a), 1 / inv_a
    inv_g = inv_scale_from_amax(torch.tensor(0.5, device="cuda"), E5M2_MAX)
    for inv_y in (None, torch.tensor(30.0, device="cuda")):
        common = dict(doutq=dq, w_down_tq=w2q_t, scale=s_d * s_w, rstd=rstd, inv_scale=inv_g, inv_y=inv_y)
        got = cute.swiglu_bwd_e5m2_t_qa(**common, aq=aq, a_scale=a_scale, out_dtype=BF)
        want = cute.swiglu_bwd_e5m2_t_q(**common, a=_decoded(aq, a_scale, BF))
        for i, (x, y) in enumerate(zip(got, want)):
            apart = (_bytes(x) != _bytes(y)).sum().item() if x.dtype == y.dtype and x.shape == y.shape else -1
            log_bound(f"swiglu_bwd_e5m2_t_qa output {i} (inv_y {inv_y is not None}) bytes apart from the bf16-a B3",
                      err=apart, bound=0)
            assert x.dtype == y.dtype and x.shape == y.shape and apart == 0, (i, apart)


@pytest.mark.gpu
def test_cute_f2_saving_a_codes_matches_the_reference_within_one_rounding():
    """``norm_swiglu_qa_fp8`` on the GPU: y's codes and amax |y| are the shipped F2's (``norm_swiglu_q_fp8``,
    same GEMM) bit for bit; a's codes against the codes of that F2's own bf16 a: the kernel quantizes its
    fp32 v, which the bf16 a holds to within half a bf16 step (2^-9 relative), so codes of values that far
    apart (times inv_a) differ by that plus one e4m3 step of the larger (``assert_codes_within``); amax |a|
    within 2^-9 of max |a_bf16|; no NaN code (a saturating store writes none)."""
    cute, _, rstd, hq, w1, w13q, scale = f2_fp8_cuda(35)
    m, ff = hq.shape[0], w1.shape[0]
    yq0, a0, amax_y0 = cute.norm_swiglu_q_fp8(hq=hq, rstd=rstd, w13q=w13q, scale=scale, inv_y=torch.tensor(3.0, device="cuda"),
                                              out_dtype=BF)
    inv_a = pow2_floor(inv_scale_from_amax(a0.float().abs().amax()))
    yq, aq_k, amax_y, amax_a = cute.norm_swiglu_qa_fp8(hq=hq, rstd=rstd, w13q=w13q, scale=scale,
                                                       inv_y=torch.tensor(3.0, device="cuda"), inv_a=inv_a, out_dtype=BF)
    assert aq_k.dtype == E4M3 and aq_k.shape == (m, 2 * ff) and aq_k.float().isfinite().all()
    assert torch.equal(yq.view(torch.uint8), yq0.view(torch.uint8)) and torch.equal(amax_y, amax_y0)
    v = a0.double()
    err = v.abs() * 2.0**-9 * inv_a.double()
    got, want = aq_k.double(), quantize_e4m3(a0.float(), inv_a).double()
    assert_codes_within("norm_swiglu_qa_fp8 e4m3 a vs the codes of its own bf16 a", got, want,
                        e4m3_step(torch.maximum(got.abs(), want.abs())), err)
    amax_ref = v.abs().amax().item()
    log_bound("norm_swiglu_qa_fp8 amax |a| vs max |a_bf16|", err=abs(amax_a.item() - amax_ref), bound=2.0**-9 * amax_ref)
    assert abs(amax_a.item() - amax_ref) <= 2.0**-9 * amax_ref
    assert rel(got / inv_a.double(), v) < 0.05
