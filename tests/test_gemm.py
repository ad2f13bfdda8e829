"""The plain GEMMs of the step: wgrad / dgrad ops, the fp8 weight pass, and the fp8 weight gradient
(torchao's recipe, power-of-two scales) against its definition."""

import math
from pathlib import Path

import pytest
import torch
from torch.library import opcheck

from coda_titan.kernels.scaling import E4M3, E4M3_MAX

from .helpers import TORCH, op_cases, rel, run_interpreter_check


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ['wgrad', 'dgrad'])
def test_opcheck(name, dtype):
    """Schema, fake and aot_dispatch of the op (its reference kernel on CPU)."""
    opcheck(getattr(torch.ops.coda, name).default, op_cases(dtype)[name])


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
    assert dw.shape == (n, k) and rel(dw, want) < 1e-12
    # the amaxes may come from the producers or be computed here: the same thing
    assert torch.equal(dw, TORCH.wgrad_fp8(grad=g, grad_amax=None, inp=x, inp_amax=None, out_dtype=torch.float64))
    # it is the exact wgrad up to the e5m2 / e4m3 rounding of the operands
    exact = TORCH.wgrad(grad=g, inp=x, out_dtype=torch.float64)
    assert 1e-4 < rel(dw, exact) < 0.2
    # a current scale: no saturation, whatever the gradient's size (a delayed one would clip it)
    big = TORCH.wgrad_fp8(grad=g * 2.0**20, grad_amax=None, inp=x, inp_amax=None, out_dtype=torch.float64)
    assert rel(big, dw * 2.0**20) < 1e-12
    assert TORCH.wgrad_fp8(grad=g.float(), grad_amax=None, inp=x.float(), inp_amax=None,
                           out_dtype=torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="same rows"):
        TORCH.wgrad_fp8(grad=g[1:], grad_amax=None, inp=x, inp_amax=None, out_dtype=torch.float64)


def test_wgrad_fp8_e5m2_is_the_fp8_weight_gradient_of_a_given_e5m2_gradient():
    """``wgrad_fp8_e5m2`` (dW13 on B3's e5m2 da): the gradient's codes are taken as they are, times
    their dequantization scale; the input is cast as ``wgrad_fp8`` casts it. In fp64 it equals the
    exact product of the decoded operands."""
    from coda_titan.kernels.scaling import E5M2, E5M2_MAX, quantize_e5m2

    gen = torch.Generator().manual_seed(19)
    m, n, k = 96, 32, 48
    g = torch.randn(m, n, generator=gen, dtype=torch.float64) * 1e-3
    x = torch.randn(m, k, generator=gen, dtype=torch.float64) * 3
    inv = torch.tensor(3.0e5, dtype=torch.float64)  # a delayed scale: not a power of two, not g's amax
    gq = quantize_e5m2(g, inv)
    dw = TORCH.wgrad_fp8_e5m2(gradq=gq, grad_scale=1 / inv, inp=x, inp_amax=x.abs().amax(), out_dtype=torch.float64)
    s_x = 2.0 ** math.ceil(math.log2(x.abs().max().item() / E4M3_MAX))
    xq = (x / s_x).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).double() * s_x
    want = torch.einsum("mn,mk->nk", gq.double() / inv, xq)
    assert dw.shape == (n, k) and rel(dw, want) < 1e-12
    exact = TORCH.wgrad(grad=g, inp=x, out_dtype=torch.float64)  # the exact wgrad up to the fp8 roundings
    assert 1e-4 < rel(dw, exact) < 0.2
    assert gq.dtype == E5M2 and gq.double().abs().max() < E5M2_MAX
    assert torch.equal(dw, TORCH.wgrad_fp8_e5m2(gradq=gq, grad_scale=1 / inv, inp=x, inp_amax=None, out_dtype=torch.float64))
    with pytest.raises(TypeError, match="e5m2 gradient"):
        TORCH.wgrad_fp8_e5m2(gradq=g, grad_scale=1 / inv, inp=x, inp_amax=None, out_dtype=torch.float64)
    opcheck(torch.ops.coda.wgrad_fp8_e5m2.default, (gq.float().to(E5M2), (1 / inv).float(), x.float(), None, torch.float32),
            test_utils=("test_faketensor",))


def test_wgrad_fp8_e4m3_is_the_fp8_weight_gradient_of_a_given_e4m3_input():
    """``wgrad_fp8_e4m3`` (dW2 on B3's e4m3 y): the input's codes taken as they are times their
    scale, the gradient cast as ``wgrad_fp8`` casts it; in fp64 the exact product of the decoded
    operands."""
    from coda_titan.kernels.scaling import E5M2, E5M2_MAX, quantize_e4m3

    gen = torch.Generator().manual_seed(23)
    m, n, k = 96, 32, 48
    g = torch.randn(m, n, generator=gen, dtype=torch.float64) * 1e-3
    x = torch.randn(m, k, generator=gen, dtype=torch.float64) * 3
    inv = torch.tensor(37.0, dtype=torch.float64)  # a delayed scale: not a power of two
    xq = quantize_e4m3(x, inv)
    dw = TORCH.wgrad_fp8_e4m3(grad=g, grad_amax=g.abs().amax(), inpq=xq, inp_scale=1 / inv, out_dtype=torch.float64)
    s_g = 2.0 ** math.ceil(math.log2(g.abs().max().item() / E5M2_MAX))
    gq = (g / s_g).clamp(-E5M2_MAX, E5M2_MAX).to(E5M2).double() * s_g
    assert dw.shape == (n, k) and rel(dw, torch.einsum("mn,mk->nk", gq, xq.double() / inv)) < 1e-12
    assert 1e-4 < rel(dw, TORCH.wgrad(grad=g, inp=x, out_dtype=torch.float64)) < 0.2
    assert torch.equal(dw, TORCH.wgrad_fp8_e4m3(grad=g, grad_amax=None, inpq=xq, inp_scale=1 / inv, out_dtype=torch.float64))
    with pytest.raises(TypeError, match="e4m3 input"):
        TORCH.wgrad_fp8_e4m3(grad=g, grad_amax=None, inpq=x, inp_scale=1 / inv, out_dtype=torch.float64)
    opcheck(torch.ops.coda.wgrad_fp8_e4m3.default, (g.float(), None, xq.float().to(E4M3), (1 / inv).float(), torch.float32),
            test_utils=("test_faketensor",))


def test_wgrad_fp8_q_is_the_weight_gradient_of_two_given_fp8_operands():
    """``wgrad_fp8_q`` (dW13 on B3's e5m2 da and F1's e4m3 H^T, ``fp8_mlp_h_t``): both operands' codes
    taken as they are times their scales, no cast; in fp64 the exact product of the decoded operands."""
    from coda_titan.kernels.scaling import E5M2, quantize_e4m3, quantize_e5m2

    gen = torch.Generator().manual_seed(24)
    m, n, k = 96, 32, 48
    g = torch.randn(m, n, generator=gen, dtype=torch.float64) * 1e-3
    x = torch.randn(m, k, generator=gen, dtype=torch.float64) * 3
    inv_g, inv_x = torch.tensor(3.0e7, dtype=torch.float64), torch.tensor(37.0, dtype=torch.float64)  # delayed scales
    gq, xq = quantize_e5m2(g, inv_g), quantize_e4m3(x, inv_x)
    dw = TORCH.wgrad_fp8_q(gradq=gq, grad_scale=1 / inv_g, inpq=xq, inp_scale=1 / inv_x, out_dtype=torch.float64)
    assert dw.shape == (n, k) and rel(dw, torch.einsum("mn,mk->nk", gq.double() / inv_g, xq.double() / inv_x)) < 1e-12
    assert 1e-4 < rel(dw, TORCH.wgrad(grad=g, inp=x, out_dtype=torch.float64)) < 0.2
    with pytest.raises(TypeError, match="e5m2 gradient and an e4m3 input"):
        TORCH.wgrad_fp8_q(gradq=xq, grad_scale=1 / inv_g, inpq=xq, inp_scale=1 / inv_x, out_dtype=torch.float64)
    opcheck(torch.ops.coda.wgrad_fp8_q.default, (gq.float().to(E5M2), (1 / inv_g).float(), xq.float().to(xq.dtype),
                                                 (1 / inv_x).float(), torch.float32), test_utils=("test_faketensor",))


def test_dgrad_fp8_q_is_the_input_gradient_of_an_e5m2_gradient_and_the_e4m3_transposed_weight():
    """``dgrad_fp8_q`` (the W_o dgrad with ``fp8_out_bwd``): dX = (s_g gq) @ (s_w Wq) with the weight given
    as its e4m3 transpose, codes taken as they are; in fp64 the exact product of the decoded operands."""
    from coda_titan.kernels.scaling import E5M2, quantize_e4m3, quantize_e5m2

    gen = torch.Generator().manual_seed(25)
    m, n, k = 96, 32, 48  # grad (m, n) = dX (m, k) @ W^T, W (n, k)
    g = torch.randn(m, n, generator=gen, dtype=torch.float64) * 1e-3
    w = torch.randn(n, k, generator=gen, dtype=torch.float64) * 0.05
    inv_g, inv_w = torch.tensor(2.0**24, dtype=torch.float64), torch.tensor(3000.0, dtype=torch.float64)
    gq, wq_t = quantize_e5m2(g, inv_g), quantize_e4m3(w.t().contiguous(), inv_w)
    dx = TORCH.dgrad_fp8_q(gradq=gq, grad_scale=1 / inv_g, weight_tq=wq_t, w_scale=1 / inv_w, out_dtype=torch.float64)
    assert dx.shape == (m, k) and rel(dx, (gq.double() / inv_g) @ (wq_t.double().t() / inv_w)) < 1e-12
    assert 1e-4 < rel(dx, TORCH.dgrad(grad=g, weight=w, out_dtype=torch.float64)) < 0.2
    with pytest.raises(TypeError, match="e5m2 gradient and an e4m3 weight"):
        TORCH.dgrad_fp8_q(gradq=wq_t, grad_scale=1 / inv_g, weight_tq=wq_t, w_scale=1 / inv_w, out_dtype=torch.float64)
    with pytest.raises(ValueError, match="against W"):
        TORCH.dgrad_fp8_q(gradq=gq, grad_scale=1 / inv_g, weight_tq=wq_t.t().contiguous(), w_scale=1 / inv_w,
                          out_dtype=torch.float64)
    opcheck(torch.ops.coda.dgrad_fp8_q.default, (gq.float().to(E5M2), (1 / inv_g).float(), wq_t.float().to(wq_t.dtype),
                                                 (1 / inv_w).float(), torch.float32), test_utils=("test_faketensor",))


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


def test_fp8_ops_schemas_and_fakes():
    wo = torch.randn(64, 48)
    opcheck(torch.ops.coda.quantize_tensorwise.default, (wo,), test_utils=("test_faketensor",))
    ws = [[torch.randn(n, 16) for _ in range(2)] for n in (8, 8, 8, 4, 4)]
    for flags in ((False, False), (True, True)):
        opcheck(torch.ops.coda.fp8_layer_weights.default, (*ws, *flags), test_utils=("test_faketensor",))
    dy, x = torch.randn(16, 48), torch.randn(16, 64)
    for amaxes in ((None, None), (torch.tensor(2.0), torch.tensor(3.0))):
        opcheck(torch.ops.coda.wgrad_fp8.default, (dy, amaxes[0], x, amaxes[1], torch.float32),
                test_utils=("test_faketensor",))


def test_first_call_gives_the_autotune_memory_back_once_per_shape(monkeypatch, request):
    """After a program's first call for a shape (compile + autotune on 4-16 clones of its tensors), the
    caching allocator's freed blocks go back to the device, so a run that tuned does not keep the
    sweep's memory reserved; later calls of that shape, and a call that raised, do not."""
    import importlib
    import sys
    import types

    import coda_titan.kernels as kernels

    if "coda_titan.kernels.cute" not in sys.modules:  # (CPU: the package itself needs quack; its plumbing does not)
        pkg = types.ModuleType("coda_titan.kernels.cute")
        pkg.__path__ = [str(Path(kernels.__file__).parent / "cute")]
        monkeypatch.setitem(sys.modules, "coda_titan.kernels.cute", pkg)
        request.addfinalizer(lambda: sys.modules.pop("coda_titan.kernels.cute._dispatch", None))
    _dispatch = importlib.import_module("coda_titan.kernels.cute._dispatch")

    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(_dispatch, "TUNE", True)
    monkeypatch.setattr(_dispatch, "_seen", set())
    a, b = torch.empty(8, 16), torch.empty(16, 8)
    with pytest.raises(RuntimeError):
        with _dispatch.first_call("prog", a, b):
            raise RuntimeError("launch failed")
    assert calls == []
    for _ in range(2):
        with _dispatch.first_call("prog", a, b):
            pass
    assert calls == ["empty_cache"]
    with _dispatch.first_call("prog", torch.empty(4, 16), b):  # a new shape tunes again
        pass
    assert calls == ["empty_cache"] * 2
    monkeypatch.setattr(_dispatch, "TUNE", False)  # compile only: nothing was cloned
    with _dispatch.first_call("prog", torch.empty(2, 16), b):
        pass
    assert calls == ["empty_cache"] * 2


def test_a_calibration_fallback_gives_its_temporaries_back(monkeypatch, request):
    """A fallback to the reference for the calibration step (``CALIBRATION``) returns the reference's result
    and then empties the allocator's cache, once per call; a fallback for any other reason, or during a
    CUDA graph capture, does not (those run every step)."""
    import importlib
    import sys
    import types

    import coda_titan.kernels as kernels

    if "coda_titan.kernels.cute" not in sys.modules:  # (CPU: as in the test above)
        pkg = types.ModuleType("coda_titan.kernels.cute")
        pkg.__path__ = [str(Path(kernels.__file__).parent / "cute")]
        monkeypatch.setitem(sys.modules, "coda_titan.kernels.cute", pkg)
        request.addfinalizer(lambda: sys.modules.pop("coda_titan.kernels.cute._dispatch", None))
    _dispatch = importlib.import_module("coda_titan.kernels.cute._dispatch")

    calls, capturing = [], [False]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))

    def program_op(x):
        return x * 2

    op = types.SimpleNamespace(reference=program_op)
    x = torch.arange(4.0)
    assert torch.equal(_dispatch.fallback(op, _dispatch.CALIBRATION, x), x * 2)
    assert calls == ["empty_cache"]
    assert torch.equal(_dispatch.fallback(op, "dtype torch.float32", x), x * 2)
    capturing[0] = True
    _dispatch.fallback(op, _dispatch.CALIBRATION, x)
    assert calls == ["empty_cache"]
    capturing[0] = False
    _dispatch.fallback(op, _dispatch.CALIBRATION, x)
    assert calls == ["empty_cache"] * 2


@pytest.mark.parametrize("inv", [None, 8.0])
def test_quantize_delayed_and_fp8_weights(inv):
    """y to e4m3 with its site's delayed scale (None: the current amax) and its amax, and with the codes'
    token-major copy (``quantize_delayed_t``); a gradient's e5m2 codes with theirs (``quantize_grad_t``); the weight pass
    of one kind: per layer the tensorwise e4m3 weight and its scale, as ``quantize_tensorwise``, and
    with ``transposed`` the same codes transposed (W2^T for B3's fp8 GEMM)."""
    from coda_titan.kernels import TORCH
    from coda_titan.kernels.scaling import inv_scale_from_amax, quantize_e4m3

    gen = torch.Generator().manual_seed(3)
    t = torch.randn(24, 32, generator=gen).to(torch.bfloat16) * 30
    inv_t = None if inv is None else torch.tensor(inv)
    q, amax = TORCH.quantize_delayed(t=t, inv_scale=inv_t)
    assert amax == t.float().abs().amax() and q.dtype == E4M3
    used = inv_scale_from_amax(amax) if inv is None else inv_t
    assert torch.equal(q.float(), quantize_e4m3(t.float(), used).float())
    if inv is not None:  # an older, smaller amax: the outliers saturate
        assert q.float().abs().max() == E4M3_MAX
    opcheck(torch.ops.coda.quantize_delayed.default, (t, inv_t), test_utils=("test_faketensor",))
    # with the codes' token-major copy (o's for dW_o): the same codes and amax, transposed and contiguous
    q2, q2_t, amax2 = TORCH.quantize_delayed_t(t=t, inv_scale=inv_t)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(amax2, amax)
    assert q2_t.is_contiguous() and torch.equal(q2_t.view(torch.uint8), q.t().contiguous().view(torch.uint8))
    opcheck(torch.ops.coda.quantize_delayed_t.default, (t, inv_t), test_utils=("test_faketensor",))
    g = torch.randn(24, 32, generator=gen).to(torch.bfloat16)
    (gq, s_g), (gq2, gq2_t, s_g2) = TORCH.quantize_grad(t=g), TORCH.quantize_grad_t(t=g)
    assert torch.equal(gq2.view(torch.uint8), gq.view(torch.uint8)) and torch.equal(s_g2, s_g)
    assert gq2_t.is_contiguous() and torch.equal(gq2_t.view(torch.uint8), gq.t().contiguous().view(torch.uint8))
    opcheck(torch.ops.coda.quantize_grad_t.default, (g,), test_utils=("test_faketensor",))
    ws = [torch.randn(16, 8, generator=gen) * (i + 1) for i in range(3)]
    qs, scales, none = TORCH.fp8_weights(ws=ws)
    qs2, scales2, qts = TORCH.fp8_weights(ws=ws, transposed=True)
    assert scales.shape == (3,) and none == [] and len(qts) == 3 and torch.equal(scales, scales2)
    for w, wq, wq2, wqt, sc in zip(ws, qs, qs2, qts, scales):
        want, s = TORCH.quantize_tensorwise(w=w)
        assert torch.equal(wq.float(), want.float()) and torch.equal(wq2.float(), want.float()) and sc == s
        assert wqt.is_contiguous() and torch.equal(wqt.view(torch.uint8), want.t().contiguous().view(torch.uint8))
    for transposed in (False, True):
        opcheck(torch.ops.coda.fp8_weights.default, (ws, transposed), test_utils=("test_faketensor",))
    # fp8_weight_t: the backward's transpose of W's codes, the codes the pass would have transposed
    for wq, wqt in zip(qs, qts):
        got = TORCH.fp8_weight_t(w=wq)
        assert got.is_contiguous() and torch.equal(got.view(torch.uint8), wqt.view(torch.uint8))
        opcheck(torch.ops.coda.fp8_weight_t.default, (wq,), test_utils=("test_faketensor",))


@pytest.mark.gpu
def test_cute_quantize_delayed_and_fp8_weights_equal_the_reference():
    """Inductor-fused on the GPU: the same elementwise math as the reference, bit for bit; the backward's
    transpose of a weight's codes (``fp8_weight_t``, ``transpose_8bit``'s pass) is the pass's transposed codes."""
    from coda_titan.kernels import TORCH, get_backend

    cute = get_backend("cute")
    gen = torch.Generator(device="cuda").manual_seed(5)
    t = (torch.randn(4096, 8192, generator=gen, device="cuda") * 3).to(torch.bfloat16)
    for inv in (None, torch.tensor(100.0, device="cuda")):
        q, amax = cute.quantize_delayed(t=t, inv_scale=inv)
        q0, amax0 = TORCH.quantize_delayed(t=t, inv_scale=inv)
        assert amax == amax0, (inv, amax, amax0)
        diff = (q.view(torch.uint8) != q0.view(torch.uint8)).nonzero()
        examples = [(t[i, j].item(), q[i, j].item(), q0[i, j].item()) for i, j in diff[:4].tolist()]
        assert len(diff) == 0, f"inv {inv}: {len(diff)} codes differ; (t, got, want): {examples}"
    ws = [torch.randn(2048, 8192, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(2)]
    for transposed in (False, True):
        (qs, s, qts), (qs0, s0, qts0) = cute.fp8_weights(ws=ws, transposed=transposed), TORCH.fp8_weights(ws=ws, transposed=transposed)
        assert torch.equal(s, s0) and len(qts) == len(qts0)
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(qs + qts, qs0 + qts0))
    for wq, wqt in zip(qs, qts):  # (the last ``transposed`` call's): the backward's transpose, the pass's codes
        got = cute.fp8_weight_t(w=wq)
        assert got.is_contiguous() and torch.equal(got.view(torch.uint8), wqt.view(torch.uint8))


def _step(t: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    """One rounding step of ``dtype`` at |t|: at most 2 eps |t| (2^-7 for bf16, 2^-23 for fp32), plus
    the subnormal step."""
    fi = torch.finfo(dtype)
    return 2 * fi.eps * t.abs() + fi.smallest_normal * fi.eps


def test_transpose_8bit_moves_the_bytes_in_the_interpreter():
    """The 8-bit transpose pass (``kernels/cute/transpose_8bit.py``, the token-major copy a weight gradient
    takes of a row-major fp8 operand) run by Triton's CPU interpreter (``tests/transpose_interpreter_check.py``,
    a subprocess) against ``x.t().contiguous()``: every byte the same (NaN codes included: nothing may
    convert them), on whole and partial tiles, both fp8 dtypes kept; a transposed view of a token-major
    buffer is that buffer (no copy), a strided input is refused, and ``launch`` writes into a column block of a
    wider buffer (its rows at their stride) and nothing beside it; ``token_major`` takes the pass or
    inductor's copy as its operand and ``CODA_TITAN_T8`` say, the same bytes either way. The cast-and-transpose
    pass (``cast_transpose_e5m2``, B1's da for dW_qkv) on values it must map to exact e5m2 codes, and beyond
    the range: the saturated codes of ``quantize_e5m2``, token-major (its rounding: the GPU test)."""
    got = run_interpreter_check("transpose_interpreter_check.py")
    block = got.pop("into_a_column_block")  # (``launch`` into a column block of a wider buffer: that block only)
    assert block == {"bytes_apart": 0, "outside_kept": True} and got.pop("refuses_a_column_out"), block
    cast = got.pop("cast_e5m2")
    assert cast["bytes_apart"] == 0 and cast["shape"] == [70, 100] and cast["contiguous"], cast
    assert cast["dtype"] == "torch.float8_e5m2" and cast["saturated"] == [57344.0, -57344.0, 57344.0], cast
    assert got.pop("cast_refuses_torch.bfloat16_0") and got.pop("cast_refuses_torch.float32_1"), got
    for key, case in got.items():
        if key.startswith("torch.float8"):
            m, k = (int(n) for n in key.rsplit("_", 1)[1].split("x"))
            assert case["bytes_apart"] == 0 and case["shape"] == [k, m] and case["contiguous"], (key, case)
            assert case["dtype"] == key.rsplit("_", 1)[0], (key, case)
    assert got["token_major_of_a_view_is_the_buffer"] and got["refuses_a_strided_input"], got
    # which copy token_major takes: the pass for a gradient, inductor's for a traced input (o's codes:
    # the pass cost 0.5 GiB there), CODA_TITAN_T8 one of them for both; every way the same bytes
    want = {"None_0": True, "None_1": False, "inductor_0": False, "inductor_1": False, "triton_0": True,
            "triton_1": True}
    for mode, through_the_pass in want.items():
        case = got[f"token_major_{mode}"]
        assert case["same"] and case["pass"] is through_the_pass, (mode, case)
    assert got["token_major_refuses_an_unknown_mode"], got


def test_cast_passes_give_the_references_codes_and_scales_in_the_interpreter():
    """``quantize_grad``'s Triton passes (``grad_e5m2``: the amax over the bits of |x|, then the cast that derives
    the power-of-two scale itself and stores the codes row-major and token-major) run by Triton's CPU
    interpreter (``tests/grad_e5m2_interpreter_check.py``) against the reference ``quantize_grad``: the scale of
    every amax a bf16 gradient can have (all 32,768 non-negative bit patterns, NaN and inf included) bit for
    bit; on gradients of exact e5m2 values times a power of two, every code in both layouts and the scale;
    a NaN anywhere makes the scale and every code NaN, as the reference's (not saturated away); an all-zero
    gradient takes the amax floor's scale and zero codes; a strided or fp32 input is refused; with the amax
    given (its producer's), the same codes and scale, and an amax not one fp32 element is refused. And
    ``quantize_delayed_t``'s one pass (``delayed_e4m3_t``) likewise (below)."""
    got = run_interpreter_check("grad_e5m2_interpreter_check.py")
    assert got.pop("scales") == {"n": 32768, "apart": 0, "nan_kept": True}
    assert got.pop("nan") == {"s_nan": True, "ref_s_nan": True, "codes_nan": True, "t_codes_nan": True}
    zeros = got.pop("zeros")
    assert zeros["s"] == zeros["s_ref"] and 0 < zeros["s"] < 1e-12 / 57344 * 2 and zeros["codes_zero"], zeros
    assert got.pop("refuses_torch.bfloat16_0") and got.pop("refuses_torch.float32_1") and got.pop("refuses_amax"), got
    # the delayed e4m3 cast (delayed_e4m3_t, quantize_delayed_t's one pass): the reference's codes in both layouts
    # and its amax (fp32), saturated beyond the range; a NaN is the amax; a strided input or a scale of more
    # than one element is refused
    for shape in ("128x192", "100x70"):
        case = got.pop(f"delayed_{shape}")
        assert case["bytes_apart"] == 0 and case["t_bytes_apart"] == 0 and case["t_contiguous"], (shape, case)
        assert case["amax"] == case["amax_ref"] == 9984.0 and case["amax_dtype"] == "torch.float32", (shape, case)
        assert case["saturated"] == [448.0, -448.0], (shape, case)
    assert got.pop("delayed_nan_amax") and got.pop("delayed_refuses_0_1") and got.pop("delayed_refuses_1_2"), got
    assert len(got) == 6, got
    for key, case in got.items():
        m, k = (int(n) for n in key.split("_")[0].split("x"))
        token_major = key.endswith("_1")
        assert case["bytes_apart"] == 0 and case["shape"] == [m, k] and case["s"] == case["s_ref"], (key, case)
        assert case["given_same"], (key, case)  # (the amax given: the same codes and scale)
        assert (case["t_bytes_apart"], case["t_contiguous"]) == ((0, True) if token_major else (None, None)), (key, case)


@pytest.mark.gpu
def test_cute_quantize_grad_passes_give_the_references_bits():
    """``quantize_grad`` and ``quantize_grad_t`` on the GPU (``grad_e5m2``'s Triton passes), eager and traced
    into a compiled caller, at the residual stream's shape (16384 tokens x 2048): the reference's codes (``quantize_e5m2`` of the fp32 product at the
    current amax's power-of-two scale: saturated, nearest even) and scale, bit for bit, the token-major codes
    those codes transposed; the previous kernels (``CODA_TITAN_CAST_PASS=inductor``) give the same; and the scale
    of amaxes across the bf16 range (every 16th non-negative bit pattern as a one-element gradient, inf and NaN
    included; the interpreter test takes all of them) is the reference's, bit for bit (NaN for NaN)."""
    import os

    from coda_titan.kernels import TORCH, get_backend

    cute = get_backend("cute")
    gen = torch.Generator(device="cuda").manual_seed(11)
    g = (torch.randn(16384, 2048, generator=gen, device="cuda") * 1e-4).to(torch.bfloat16)
    g[::997, ::17] *= 3e3  # (a wide range of binades: some codes subnormal, the amax from a few rows)
    want, s_want = TORCH.quantize_grad(t=g)
    for env in ("triton", "inductor"):
        os.environ["CODA_TITAN_CAST_PASS"] = env
        try:
            (q, s), (q2, q2_t, s2) = cute.quantize_grad(t=g), cute.quantize_grad_t(t=g)
        finally:
            os.environ.pop("CODA_TITAN_CAST_PASS")
        for how, codes, scale in (("quantize_grad", q, s), ("quantize_grad_t", q2, s2)):
            assert torch.equal(codes.view(torch.uint8), want.view(torch.uint8)), f"{env} {how} codes"
            assert scale.dtype == s_want.dtype and torch.equal(scale, s_want), (env, how, scale, s_want)
        assert q2_t.is_contiguous() and torch.equal(q2_t.view(torch.uint8), want.t().contiguous().view(torch.uint8)), env
        # with the amax given (the fp8 B2's, edges.amax_token): no amax pass, the same codes and scale
        amax = g.float().abs().amax()
        (q3, s3), (q4, q4_t, s4) = cute.quantize_grad(t=g, amax=amax), cute.quantize_grad_t(t=g, amax=amax)
        for codes, scale in ((q3, s3), (q4, s4)):
            assert torch.equal(codes.view(torch.uint8), want.view(torch.uint8)) and torch.equal(scale, s_want), env
        assert torch.equal(q4_t.view(torch.uint8), want.t().contiguous().view(torch.uint8)), env
    # as a compiled backward runs them (TRACED: grad_e5m2's triton_ops, whose kernels inductor launches), with and
    # without the amax given
    import coda_titan.kernels.cute as cute_pkg
    for name in ("quantize_grad", "quantize_grad_t"):
        for given in ({}, {"amax": g.float().abs().amax()}):
            got = torch.compile(lambda **kw: cute_pkg.TRACED[name](**kw), fullgraph=True, dynamic=False)(t=g, **given)
            assert torch.equal(got[0].view(torch.uint8), want.view(torch.uint8)) and torch.equal(got[-1], s_want), name
            if name == "quantize_grad_t":
                assert torch.equal(got[1].view(torch.uint8), want.t().contiguous().view(torch.uint8)), name
    bits = torch.cat([torch.arange(0, 0x8000, 16), torch.tensor([0x7F80, 0x7FC0])])  # (+inf, NaN)
    values = bits.to(device="cuda", dtype=torch.int16).view(torch.bfloat16)
    scales = torch.stack([cute.quantize_grad(t=values[i:i + 1].view(1, 1))[1] for i in range(values.numel())])
    ref = torch.stack([TORCH.quantize_grad(t=values[i:i + 1].view(1, 1))[1] for i in range(0, values.numel(), 67)])
    from coda_titan.kernels.scaling import E5M2_MAX, inv_scale_from_amax, pow2_floor
    s_ref = pow2_floor(inv_scale_from_amax(values.float(), E5M2_MAX)).reciprocal()
    assert torch.equal(ref, s_ref[::67]), "the reference's scale as a vector (the comparison's own check)"
    same = (scales.view(torch.int32) == s_ref.view(torch.int32)) | (scales.isnan() & s_ref.isnan())
    assert same.all(), f"{int((~same).sum())} scales apart, e.g. amax {values[~same][:4].tolist()}"


@pytest.mark.gpu
def test_cute_quantize_delayed_t_gives_the_references_bits():
    """``quantize_delayed_t`` on the GPU (``delayed_e4m3_t``'s one pass) at the out-projection input's shape
    (16384 tokens x 2048), eager and traced into a compiled caller: with a delayed scale, the reference's codes
    (``quantize_e4m3`` of the fp32 product: saturated, nearest even) row-major and token-major, bit for bit,
    and its amax; calibrating (no scale), the reference's math; ``CODA_TITAN_CAST_PASS=inductor`` the same."""
    import os

    import coda_titan.kernels.cute as cute_pkg
    from coda_titan.kernels import TORCH, get_backend

    cute = get_backend("cute")
    gen = torch.Generator(device="cuda").manual_seed(13)
    o = (torch.randn(16384, 2048, generator=gen, device="cuda") * 0.3).to(torch.bfloat16)
    o[::1009, ::7] *= 40.0
    for inv in (448.0 / (o.float().abs().amax() * 0.7), None):  # (a delayed scale some values exceed; calibration)
        want, amax_want = TORCH.quantize_delayed(t=o, inv_scale=inv)
        assert inv is None or (want.float().abs() == 448.0).any()  # (saturation is exercised)
        for env in ("triton", "inductor"):
            torch._dynamo.reset()  # (the switch is read while tracing: a graph of the other arm must not be reused)
            traced = torch.compile(lambda **kw: cute_pkg.TRACED["quantize_delayed_t"](**kw), fullgraph=True, dynamic=False)
            os.environ["CODA_TITAN_CAST_PASS"] = env
            try:
                runs = (("eager", cute.quantize_delayed_t(t=o, inv_scale=inv)), ("traced", traced(t=o, inv_scale=inv)))
            finally:
                os.environ.pop("CODA_TITAN_CAST_PASS")
            for how, (q, q_t, amax) in runs:
                key = (env, how, inv is None)
                assert torch.equal(q.view(torch.uint8), want.view(torch.uint8)), key
                assert q_t.is_contiguous() and torch.equal(q_t.view(torch.uint8), want.t().contiguous().view(torch.uint8)), key
                assert amax.dtype == amax_want.dtype and torch.equal(amax, amax_want), (key, amax, amax_want)


@pytest.mark.gpu
def test_cute_transpose_8bit_moves_the_bytes():
    """The 8-bit transpose pass on the GPU at B1's codes' shape (16384 tokens x 3072, e5m2) and o's (e4m3),
    eager and inside a compiled caller (inductor launches the Triton kernel of the ``triton_op``): the bytes
    of ``x.t().contiguous()``, every one; and the cast-and-transpose pass: ``quantize_e5m2``'s codes."""
    from coda_titan.kernels.cute.transpose_8bit import token_major

    gen = torch.Generator(device="cuda").manual_seed(5)
    compiled = torch.compile(lambda t: token_major(t), fullgraph=True, dynamic=False)
    for dtype, (m, k) in ((torch.float8_e5m2, (16384, 3072)), (torch.float8_e4m3fn, (16384, 2048))):
        x = torch.randint(0, 256, (m, k), generator=gen, device="cuda", dtype=torch.uint8).view(dtype)
        want = x.t().contiguous().view(torch.uint8)
        for how, y in (("eager", token_major(x)), ("compiled", compiled(x))):
            assert y.dtype == dtype and y.shape == (k, m) and y.is_contiguous(), (how, y.dtype, y.shape)
            assert torch.equal(y.view(torch.uint8), want), f"{how} transpose_8bit of {dtype} {(m, k)}"
    # the cast-and-transpose of a bf16 gradient at B1's shape: quantize_e5m2's codes (fp32 product, saturated,
    # round to nearest even), token-major, bit for bit, eager and compiled; some values beyond the range
    from coda_titan.kernels.cute.transpose_8bit import cast_transpose_e5m2
    from coda_titan.kernels.scaling import quantize_e5m2

    cast = torch.compile(lambda t, inv: cast_transpose_e5m2(t, inv), fullgraph=True, dynamic=False)
    g = (torch.randn(16384, 3072, generator=gen, device="cuda") * 1e-3).to(torch.bfloat16)
    g[::977, ::13] *= 1e4
    inv = torch.tensor([2.0**24], device="cuda")
    want = quantize_e5m2(g.float(), inv).t().contiguous().view(torch.uint8)
    assert (want.view(torch.float8_e5m2).float().abs() == 57344.0).any()  # (saturation is exercised)
    for how, y in (("eager", cast_transpose_e5m2(g, inv)), ("compiled", cast(g, inv))):
        assert y.dtype == torch.float8_e5m2 and y.shape == (3072, 16384) and y.is_contiguous(), (how, y.shape)
        assert torch.equal(y.view(torch.uint8), want), f"{how} cast_transpose_e5m2"


@pytest.mark.gpu
def test_cute_traced_programs_under_compile_equal_their_ops():
    """The cute backend's TRACED programs as the compiled model runs them (traced, inductor-fused)
    against their ops, on the same inputs. Bounds: the same math in a possibly different fusion, so
    * a GEMM (wgrad, dgrad, the fp8 wgrad on the same fp8 codes): two fp32-accumulated sums of the same
      K products, each within gamma_K = K u sum|a b| of the exact one (u = 2^-24), so at most
      2 gamma_K sum|a b| apart before the output rounding, which adds at most one step of the larger;
    * B1's da: per element at most 3 fp32 roundings of terms of magnitude mag = (|x0| + |x1|) r (the
      rotated pair; |dy| r off the rotary columns), so 6 u mag apart, plus one bf16 step; zdz: two
      fp32 sums of the same Q products, 2 Q u sum|y dy|; the e5m2 codes of the fp8 B1: values at most
      da's fp32 bound apart (times the scale), so their codes one e5m2 step plus that apart."""
    import coda_titan.kernels.cute as cute_pkg
    from coda_titan.kernels import TRACEABLE, get_backend
    from coda_titan.kernels.scaling import E5M2_MAX
    from coda_titan.model.rope import rope_freqs
    from torchtitan.models.llama3.model.args import RoPEScalingArgs

    from .helpers import assert_codes_within

    assert set(cute_pkg.TRACED) == set(TRACEABLE)
    cute = get_backend("cute")
    u = 2.0**-24
    gen = torch.Generator(device="cuda").manual_seed(11)
    bf = torch.bfloat16
    m, d, q = 4096, 2048, 3072

    def r(*s, scale=1.0):
        return (torch.randn(*s, generator=gen, device="cuda") * scale).to(bf)

    def compiled(name):
        torch._dynamo.reset()
        return torch.compile(lambda **kw: cute_pkg.TRACED[name](**kw), fullgraph=True, dynamic=False)

    def gemm_check(name, got, want, a, b):  # got, want = a @ b in two orders, each rounded once to got's dtype
        dtype = got.dtype  # (the output rounding's step is of that dtype, not of the fp64 copies compared)
        got, want, sab = got.double(), want.double(), a.double().abs() @ b.double().abs()
        assert_codes_within(f"traced {name} vs op", got, want, _step(torch.maximum(got.abs(), want.abs()), dtype),
                            2 * a.shape[1] * u * sab)

    g, x, w = r(m, q, scale=1e-2), r(m, d), r(q, d, scale=d**-0.5)
    for name, kw, a, b in (("wgrad", dict(grad=g, inp=x, out_dtype=torch.float32), g.t(), x),
                           ("dgrad", dict(grad=g, weight=w, out_dtype=bf), g, w)):
        gemm_check(name, compiled(name)(**kw), getattr(cute, name)(**kw), a, b)

    from coda_titan.kernels.gemm import wgrad_fp8_operands
    kw = dict(grad=g, grad_amax=None, inp=x, inp_amax=None, out_dtype=bf)
    gq, s_g, xq, s_x = wgrad_fp8_operands(g, None, x, None)  # the codes both paths cast (elementwise, exact)
    gemm_check("wgrad_fp8", compiled("wgrad_fp8")(**kw), cute.wgrad_fp8(**kw), gq.double().t() * s_g.double(),
               xq.double() * s_x.double())
    # wgrad_fp8_e5m2: the gradient's codes given (a delayed, non-power-of-two scale), the input cast as above
    from coda_titan.kernels.scaling import quantize_e5m2
    inv = 0.7 * E5M2_MAX / g.float().abs().amax()
    gq8 = quantize_e5m2(g.float(), inv)
    kw = dict(gradq=gq8, grad_scale=1 / inv, inp=x, inp_amax=None, out_dtype=bf)
    gemm_check("wgrad_fp8_e5m2", compiled("wgrad_fp8_e5m2")(**kw), cute.wgrad_fp8_e5m2(**kw),
               gq8.double().t() / inv.double(), xq.double() * s_x.double())
    from coda_titan.kernels.scaling import quantize_e4m3
    inv_x = 300 / x.float().abs().amax()
    xq8 = quantize_e4m3(x.float(), inv_x)
    kw = dict(grad=g, grad_amax=None, inpq=xq8, inp_scale=1 / inv_x, out_dtype=bf)
    gemm_check("wgrad_fp8_e4m3", compiled("wgrad_fp8_e4m3")(**kw), cute.wgrad_fp8_e4m3(**kw),
               gq.double().t() * s_g.double(), xq8.double() / inv_x.double())
    # wgrad_fp8_q: both operands' codes given, each as the transposed view of a token-major buffer (B3's da^T,
    # F1's H^T), as the model passes them
    gq_t, xq_t = gq8.t().contiguous(), xq8.t().contiguous()
    kw = dict(gradq=gq_t.t(), grad_scale=1 / inv, inpq=xq_t.t(), inp_scale=1 / inv_x, out_dtype=bf)
    gemm_check("wgrad_fp8_q", compiled("wgrad_fp8_q")(**kw), cute.wgrad_fp8_q(**kw),
               gq8.double().t() / inv.double(), xq8.double() / inv_x.double())
    # dgrad_fp8_q (fp8_out_bwd): the gradient's codes and W^T's (K-major, as the weight pass writes it), traced
    # against the op and the op against the exact product of the decoded operands (rounded once to bf16)
    wq_t8 = quantize_e4m3(w.float().t().contiguous(), 300 / w.float().abs().amax())
    s_w = w.float().abs().amax() / 300
    kw = dict(gradq=gq8, grad_scale=1 / inv, weight_tq=wq_t8, w_scale=s_w, out_dtype=bf)
    a, b = gq8.double() / inv.double(), wq_t8.double().t() * s_w.double()
    gemm_check("dgrad_fp8_q", compiled("dgrad_fp8_q")(**kw), cute.dgrad_fp8_q(**kw), a, b)
    gemm_check("dgrad_fp8_q vs exact", cute.dgrad_fp8_q(**kw), (a @ b).to(bf), a, b)
    # dW2 on B3's e5m2 D (the model's default): quantize_grad's codes and scale are wgrad_fp8_e4m3's own cast
    # of the gradient (the same amax, power-of-two scale and codes), so the traced GEMM on them is that op's
    dq, s_d = cute.quantize_grad(t=g)
    assert torch.equal(dq.view(torch.uint8), gq.view(torch.uint8)) and torch.equal(s_d.float(), s_g.float())
    kw = dict(gradq=dq, grad_scale=s_d, inpq=xq8, inp_scale=1 / inv_x, out_dtype=bf)
    gemm_check("wgrad_fp8_q on quantize_grad", compiled("wgrad_fp8_q")(**kw),
               cute.wgrad_fp8_e4m3(grad=g, grad_amax=None, inpq=xq8, inp_scale=1 / inv_x, out_dtype=bf),
               gq.double().t() * s_g.double(), xq8.double() / inv_x.double())
    # wgrad_fp8_e4m3 with the gradient's amax given (B1's, fp8_qkv_wgrad): its cast-and-transpose is
    # cast_transpose_e5m2's pass, the same codes and scale as its own amax gives (the bf16 gradient's amax is
    # exact in fp32), so the same GEMM bit for bit, as an op and traced
    base = cute.wgrad_fp8_e4m3(grad=g, grad_amax=None, inpq=xq8, inp_scale=1 / inv_x, out_dtype=bf)
    kw_amax = dict(grad=g, grad_amax=g.float().abs().amax(), inpq=xq8, inp_scale=1 / inv_x, out_dtype=bf)
    for how, got in (("op", cute.wgrad_fp8_e4m3(**kw_amax)), ("traced", compiled("wgrad_fp8_e4m3")(**kw_amax))):
        assert torch.equal(got, base), f"wgrad_fp8_e4m3 with its amax given ({how})"
    # and the eager op on those row-major codes (dW_o with fp8_out_bwd: both operands row-major), whose
    # token-major copies transpose_8bit makes, against the traced program
    gemm_check("wgrad_fp8_q op on row-major codes", cute.wgrad_fp8_q(**kw), compiled("wgrad_fp8_q")(**kw),
               gq.double().t() * s_g.double(), xq8.double() / inv_x.double())

    # quantize_delayed: the amax is a max, exact in any order. With a delayed scale both paths round the
    # same fp32 product t * inv once to e4m3: codes bit for bit. Calibrating (no scale), each path divides
    # 448 by the same amax in fp32, eager correctly rounded and inductor's within 2 ulp (CUDA's fp32
    # division), so the scales are at most 2^-22 inv apart, the scaled values |t| inv (2^-22 + 2u) apart
    # (the products' own roundings), and their codes that plus one e4m3 step of the larger
    from coda_titan.kernels.scaling import e4m3_step, inv_scale_from_amax
    t = r(m, q, scale=3.0)
    amax0 = t.float().abs().amax()
    for inv in (inv_scale_from_amax(amax0 * 1.5), None):
        (yq, amax), (yq0, amax_op) = compiled("quantize_delayed")(t=t, inv_scale=inv), cute.quantize_delayed(t=t, inv_scale=inv)
        assert amax.item() == amax_op.item() == amax0.item()
        if inv is not None:
            assert torch.equal(yq.view(torch.uint8), yq0.view(torch.uint8)), "traced quantize_delayed codes"
            continue
        got, want = yq.double(), yq0.double()
        inv0 = inv_scale_from_amax(amax0).double()
        assert_codes_within("traced quantize_delayed codes, calibrating", got, want,
                            e4m3_step(torch.maximum(got.abs(), want.abs())), t.double().abs() * inv0 * (2.0**-22 + 2 * u))

    seqlen, hd, nrot = 1024, 64, 40
    dy, y = r(m, q, scale=1e-3), r(m, q)
    rstd = torch.rand(m, generator=gen, device="cuda") + 0.5
    freqs = rope_freqs(hd, 500000.0, RoPEScalingArgs()).cuda()
    kw = dict(dy=dy, y=y, rstd=rstd, freqs=freqs, seqlen=seqlen, n_rope_heads=nrot, head_dim=hd)
    rot = nrot * hd
    a = dy.double().abs()
    pair = a[:, :rot].reshape(m, rot // 2, 2).sum(-1).repeat_interleave(2, dim=1)
    mag = torch.cat([pair, a[:, rot:]], dim=1) * rstd.double()[:, None]
    zdz_bound = 2 * q * u * (y.double().abs() * a).sum(-1)
    delayed = inv_scale_from_amax(mag.max().float() * 2.0, E5M2_MAX)  # (a history's scale: 2x the headroom)
    for name, extra in (("rope_bwd", {}), ("rope_bwd_fp8", dict(inv_scale=None)), ("rope_bwd_fp8", dict(inv_scale=delayed))):
        got, want = compiled(name)(**kw, **extra), getattr(cute, name)(**kw, **extra)
        da, da0 = got[0].double(), want[0].double()
        assert_codes_within(f"traced {name} da vs op", da, da0, _step(torch.maximum(da.abs(), da0.abs())), 6 * u * mag)
        assert ((got[1].double() - want[1].double()).abs() <= zdz_bound).all(), f"{name} zdz"
        if name == "rope_bwd_fp8":  # the scale: each path's own s = amax / E5M2_MAX (calibrating), else the given one
            # amax |da| is a max over the fp32 da (exact in any order), so the two paths' amaxes differ by at
            # most the largest difference of their fp32 da elements: da's own bound
            assert (got[3].double() - want[3].double()).abs() <= (6 * u * mag).max()
            inv = [inv_scale_from_amax(t[3], E5M2_MAX) if extra["inv_scale"] is None else delayed for t in (got, want)]
            sc, sc0 = (i.double().reciprocal() for i in inv)
            assert (sc - sc0).abs() <= (6 * u * mag).max() / E5M2_MAX + 4 * u * sc0, (sc, sc0)
            # dequantized: q = RN(v / s) s and q0 = RN(v0 / s0) s0 lie within half a step of v and v0
            qv, qv0 = got[2].double() * sc, want[2].double() * sc0
            step = 0.25 * torch.maximum(qv.abs(), qv0.abs()) + 2.0**-16 * torch.maximum(sc, sc0)
            assert_codes_within(f"traced {name} e5m2 da", qv, qv0, step, 6 * u * mag + 2 * u * qv0.abs())
