"""What TorchTitan calls (coda_titan.titan): the fa4 converter and its ops (CPU reference equals SDPA;
on the GPU FA4 is as close to float64 as SDPA in bf16), the shipped configs (each CODA config differs
from its baseline only in model.name and [coda]), and the offline data and tokenizer."""

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torchtitan.components.tokenizer import HuggingFaceTokenizer
from torchtitan.hf_datasets.text_datasets import DATASETS, HuggingFaceTextDataset
from torchtitan.models.llama3 import llama3_args

from coda_titan import cli
from coda_titan.model.args import CodaModelArgs, coda_llama3_args, same_architecture
from coda_titan.model.model import CodaTransformer
from coda_titan.titan import data
from coda_titan.titan import fa4 as fa
from coda_titan.titan.data import DataError, ensure_tokenizer
from coda_titan.titan.job_config import Coda

from .conftest import CONFIGS, logged_losses, run_cli


# --- fa4: FlashAttention-4 as TorchTitan attention (ops, module, converter) -------------------------


def _qkv(b=2, s=33, h=4, h_kv=2, d=16, dtype=torch.float64, device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    mk = lambda n: torch.randn(b, s, n, d, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)  # noqa: E731
    return mk(h), mk(h_kv), mk(h_kv)


def _sdpa(q, k, v):  # (b, s, h, d) in and out
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True)
    return o.transpose(1, 2)


@pytest.mark.parametrize("h_kv", [4, 2, 1])
def test_reference_op_equals_sdpa_with_gradients(h_kv):
    """float64 in, float64 reference: equal to SDPA's float64 math up to its summation order."""
    q, k, v = (t.requires_grad_() for t in _qkv(h_kv=h_kv))
    scale = q.shape[-1] ** -0.5
    out, lse = fa.flash_attn_fwd(q, k, v, scale, True)
    want = _sdpa(q, k, v)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    # lse: log-sum-exp of the causal scores of each query row, returned in float32 as FA4's
    s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(4 // h_kv, 2)) * scale
    s = s.masked_fill(torch.ones(33, 33, dtype=torch.bool).triu(1), float("-inf"))
    assert lse.dtype == torch.float32
    torch.testing.assert_close(lse, torch.logsumexp(s, -1).float(), rtol=2**-23, atol=0)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    got = torch.autograd.grad(out, (q, k, v), dout)
    ref = torch.autograd.grad(want, (q, k, v), dout)
    for g, r, name in zip(got, ref, "qkv"):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12, msg=f"d{name}")


def test_opcheck_cpu():
    q, k, v = _qkv(dtype=torch.float32)
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    torch.library.opcheck(fa.flash_attn_fwd, (q, k, v, 0.25, True))
    out, lse = fa.flash_attn_fwd(q.detach(), k.detach(), v.detach(), 0.25, True)
    torch.library.opcheck(fa.flash_attn_bwd, (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, 0.25, True))


def _packed(q, k, v):
    """F3's packed (tokens, (h + 2 h_kv) d) buffer of (b, s, heads, d) q, k, v."""
    return torch.cat([t.flatten(2) for t in (q, k, v)], dim=2).flatten(0, 1)


def test_packed_ops_equal_the_ops_on_separate_tensors():
    """The packed ops (q, k, v read as slices of one buffer, dq, dk, dv returned as one) compute exactly
    the separate ops' values, bit for bit, in every dtype's reference; opcheck checks schema and fake."""
    q, k, v = _qkv(dtype=torch.float32)
    qkv = _packed(q, k, v).requires_grad_()
    args = (33, 4, 2, 0.25, True)
    out, lse = fa.flash_attn_packed_fwd(qkv, *args)
    want, want_lse = fa.flash_attn_fwd(q, k, v, 0.25, True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse) and out.is_contiguous()
    assert all(torch.equal(a, b) for a, b in zip(fa.split_packed(qkv.detach(), 33, 4, 2), (q, k, v)))
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (dqkv,) = torch.autograd.grad(out, qkv, dout)
    assert dqkv.shape == qkv.shape and dqkv.is_contiguous()
    assert torch.equal(dqkv, _packed(*fa.flash_attn_bwd(dout, q, k, v, want, want_lse, 0.25, True)))
    torch.library.opcheck(fa.flash_attn_packed_fwd, (qkv, *args))
    torch.library.opcheck(fa.flash_attn_packed_bwd, (dout, qkv.detach(), out.detach(), lse.detach(), *args))


def test_fa4_on_contiguous_copies_is_the_packed_call_in_value_and_gradient(monkeypatch):
    """``CODA_TITAN_FA4_PACKED=0`` (a bisection arm): FA4 on contiguous q, k, v as stock calls it, the same values
    and packed-buffer gradient as the packed ops (reference math, float64), eager and traced whole."""
    qkv = _packed(*_qkv())
    x = qkv.clone().requires_grad_()
    want = fa.attention_on_packed(fa.FA4Attention(), x, 33, 4, 2, True)
    (g_want,) = torch.autograd.grad(want.square().sum(), x)
    monkeypatch.setenv(fa.FA4_PACKED_ENV, "0")
    calls = []
    monkeypatch.setattr(fa, "flash_attn_packed_fwd", lambda *a: calls.append(a))  # (never reached when unpacked)
    got = fa.attention_on_packed(fa.FA4Attention(), x, 33, 4, 2, True)
    (g,) = torch.autograd.grad(got.square().sum(), x)
    assert not calls and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g, g_want, rtol=1e-12, atol=1e-12)
    fn = torch.compile(lambda t: fa.attention_on_packed(fa.FA4Attention(), t, 33, 4, 2, True), backend="aot_eager",
                       fullgraph=True)
    torch.testing.assert_close(fn(x), want, rtol=1e-12, atol=1e-12)


def test_attention_on_packed_runs_either_module_and_checks_gqa():
    """The model's attention call: SDPA's wrapper on the slices and FA4's packed ops agree (both
    reference math in float64), and FA4 refuses mismatched heads without enable_gqa as its module does."""
    from torchtitan.models.attention import ScaledDotProductAttentionWrapper

    qkv = _packed(*_qkv())
    got = fa.attention_on_packed(fa.FA4Attention(), qkv, 33, 4, 2, True)
    want = fa.attention_on_packed(ScaledDotProductAttentionWrapper(), qkv, 33, 4, 2, True)
    assert got.shape == (2 * 33, 4 * 16)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="enable_gqa"):
        fa.attention_on_packed(fa.FA4Attention(), qkv, 33, 4, 2, False)
    # traced whole (fullgraph, its fakes and autograd formula), with the same value and gradient
    x = qkv.clone().requires_grad_()
    fn = torch.compile(lambda t: fa.attention_on_packed(fa.FA4Attention(), t, 33, 4, 2, True), backend="aot_eager", fullgraph=True)
    y = fn(x)
    torch.testing.assert_close(y, got, rtol=0, atol=0)
    (g,) = torch.autograd.grad(y.square().sum(), x)
    (g_eager,) = torch.autograd.grad(fa.attention_on_packed(fa.FA4Attention(), x, 33, 4, 2, True).square().sum(), x)
    torch.testing.assert_close(g, g_eager, rtol=0, atol=0)


def _swap_to_reference_ops(model):
    n = fa.swap_attention(model)
    assert n == len(model.layers)
    assert all(isinstance(layer.attention.inner_attention, fa.FA4Attention) for layer in model.layers.values())


@pytest.mark.parametrize("family", ["llama3", "coda_llama3"])
def test_module_swap_keeps_the_model_function(family):
    """Loss and every gradient equal with SDPA and with the FA4 module (reference kernels) swapped in."""
    from torchtitan.models.llama3 import Transformer, TransformerModelArgs

    torch.manual_seed(0)
    kw = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=61, multiple_of=32, max_seq_len=16)
    if family == "llama3":
        model = Transformer(TransformerModelArgs(**kw))
    else:
        model = CodaTransformer(CodaModelArgs(**kw, coda=Coda(backend="torch", tile_n=32)))
    with torch.no_grad():
        model.init_weights()
    model = model.double()
    tokens, labels = torch.randint(0, 61, (2, 16)), torch.randint(0, 61, (2, 16))

    def loss_and_grads():
        model.zero_grad()
        if family == "llama3":
            loss = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten(), reduction="sum")
        else:
            loss = model(tokens, labels=labels)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    loss0, grads0 = loss_and_grads()
    _swap_to_reference_ops(model)
    loss1, grads1 = loss_and_grads()
    # the reference kernels run in float32 (like FA4's accumulators), the model in float64
    torch.testing.assert_close(loss1, loss0, rtol=1e-6, atol=0)
    for n in grads0:
        torch.testing.assert_close(grads1[n], grads0[n], rtol=1e-4, atol=1e-6, msg=n)


def test_module_refuses_mismatched_heads_without_gqa():
    q, k, v = (t.transpose(1, 2) for t in _qkv())
    with pytest.raises(ValueError, match="enable_gqa"):
        fa.FA4Attention()(q, k, v)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU refusal")
def test_converter_refuses_without_gpu():
    from torchtitan.protocols.model_converter import _registry_model_converter_cls

    assert _registry_model_converter_cls["fa4"] is fa.FA4Converter
    with pytest.raises(RuntimeError, match="no CUDA GPU here"):
        fa.FA4Converter(None, None)


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("shape", [(2, 2048, 32, 8, 64), (1, 1000, 32, 8, 128), (1, 4096, 16, 16, 128)])
def test_fa4_kernels_match_float64_like_sdpa(shape, packed):
    """FA4 forward and backward error vs float64 attention <= 2x SDPA-in-bf16's error (+ tiny floor);
    ``packed``: FA4's packed ops (CODA's F3 layout; dq, dk, dv written as slices of one buffer)."""
    if fa.fa4_unavailable_reason():
        pytest.skip(fa.fa4_unavailable_reason())
    b, s, h, h_kv, d = shape
    q64, k64, v64 = (t.requires_grad_() for t in _qkv(b, s, h, h_kv, d, device="cuda"))
    ref = _sdpa(q64, k64, v64)
    dout = torch.randn_like(ref)
    ref_g = torch.autograd.grad(ref, (q64, k64, v64), dout)

    def run(fn):
        q, k, v = (t.detach().to(torch.bfloat16).requires_grad_() for t in (q64, k64, v64))
        o = fn(q, k, v)
        return (o, *torch.autograd.grad(o, (q, k, v), dout.to(torch.bfloat16)))

    # poison the allocator so that an unwritten output shows up as NaN
    torch.cuda.empty_cache()
    torch.full((1 << 28,), float("nan"), device="cuda")
    if packed:
        def fa4(q, k, v):  # (the gradients flow back through the concatenation to q, k, v)
            return fa.flash_attn_packed_fwd(_packed(q, k, v), s, h, h_kv, d ** -0.5, True)[0]
    else:
        def fa4(q, k, v):
            return fa.flash_attn_fwd(q, k, v, d ** -0.5, True)[0]
    got = run(fa4)
    base = run(_sdpa)
    for name, g, bl, r in zip(("out", "dq", "dk", "dv"), got, base, (ref, *ref_g)):
        assert torch.isfinite(g).all(), name
        err = (g.double() - r).abs().max().item()
        err_sdpa = (bl.double() - r).abs().max().item()
        assert err <= 2 * err_sdpa + 1e-6, f"{name}: fa4 {err:.3e} vs sdpa {err_sdpa:.3e}"


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True])
def test_fa4_backward_under_deterministic_algorithms_repeats_its_bits(packed):
    """With ``torch.use_deterministic_algorithms`` (TorchTitan's ``debug.deterministic``) FA4's backward
    gives the same dq, dk, dv bits on every call (GQA: dK and dV are summed across query heads too)."""
    if fa.fa4_unavailable_reason():
        pytest.skip(fa.fa4_unavailable_reason())
    b, s, h, h_kv, d = 2, 2048, 32, 8, 64
    q, k, v = (t.to(torch.bfloat16) for t in _qkv(b, s, h, h_kv, d, device="cuda"))
    out, lse = fa.flash_attn_fwd(q, k, v, d ** -0.5, True)
    dout = torch.randn_like(out)
    qkv = _packed(q, k, v)

    def grads():
        if packed:
            return (fa.flash_attn_packed_bwd(dout, qkv, out, lse, s, h, h_kv, d ** -0.5, True),)
        return fa.flash_attn_bwd(dout, q, k, v, out, lse, d ** -0.5, True)

    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        first = grads()
        for _ in range(4):
            assert all(torch.equal(a, b) for a, b in zip(first, grads()))
    finally:
        torch.use_deterministic_algorithms(was)


@pytest.mark.gpu
def test_fa4_in_a_compiled_1b_layer():
    """Inductor compiles a stock llama3 layer with FA4 swapped in; same output as eager."""
    if fa.fa4_unavailable_reason():
        pytest.skip(fa.fa4_unavailable_reason())
    from torchtitan.models.llama3 import Transformer, TransformerModelArgs

    torch.manual_seed(0)
    args = TransformerModelArgs(dim=2048, n_layers=1, n_heads=32, n_kv_heads=8, vocab_size=512, max_seq_len=2048)
    with torch.device("cuda"):
        model = Transformer(args)
    with torch.no_grad():
        model.init_weights()
    model = model.to(torch.bfloat16)
    fa.swap_attention(model)
    tokens = torch.randint(0, 512, (2, 2048), device="cuda")
    eager = model(tokens)
    eager.float().square().mean().backward()
    g_eager = model.layers["0"].attention.wq.weight.grad.clone()
    model.zero_grad()
    model.layers["0"].compile(fullgraph=True)
    compiled = model(tokens)
    compiled.float().square().mean().backward()
    torch.testing.assert_close(compiled, eager, rtol=2e-2, atol=2e-2)
    cos = F.cosine_similarity(model.layers["0"].attention.wq.weight.grad.flatten().float(), g_eager.flatten().float(), dim=0)
    assert cos > 0.999


# --- the shipped configs --------------------------------------------------------------------------------


PAIRS = [
    ("debug_cpu_baseline.toml", "debug_cpu_coda.toml"),
    ("llama3_1b_bf16_baseline.toml", "llama3_1b_bf16_coda.toml"),
    ("llama3_1b_bf16_baseline_compile.toml", "llama3_1b_bf16_coda_compile.toml"),
    ("llama3_8b_bf16_baseline.toml", "llama3_8b_bf16_coda.toml"),
]


# each *_compile config is its eager twin plus [compile] (and its own output folder)
COMPILE_TWINS = [("llama3_1b_bf16_baseline.toml", "llama3_1b_bf16_baseline_compile.toml"),
                 ("llama3_1b_bf16_coda.toml", "llama3_1b_bf16_coda_compile.toml"),
                 ("llama3_1b_fp8_coda.toml", "llama3_1b_fp8_coda_compile.toml"),
                 ("llama3_1b_bf16_liger.toml", "llama3_1b_bf16_liger_compile.toml")]


OUTPUT_ONLY = {("job", "dump_folder"), ("job", "description")}


def _flatten(d, prefix=()):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _flatten(v, prefix + (k,))
        else:
            yield prefix + (k,), v


@pytest.mark.parametrize("baseline,coda", PAIRS)
def test_pair_differs_only_in_model_name_and_coda(baseline, coda):
    b = dict(_flatten(cli._load_toml(CONFIGS / baseline)))
    c = dict(_flatten(cli._load_toml(CONFIGS / coda)))
    diff = {k for k in b.keys() | c.keys() if b.get(k) != c.get(k)} - OUTPUT_ONLY
    assert diff - {("model", "name")} == {k for k in c if k[0] == "coda"}
    assert b[("model", "name")] == "llama3" and c[("model", "name")] == "coda_llama3"


@pytest.mark.parametrize("name", sorted(p.name for p in Path(CONFIGS).glob("*.toml")))
def test_config_parses(name):
    config = cli.parse_config(str(CONFIGS / name), [])
    assert config.experimental.custom_import == "coda_titan"
    assert config.model.flavor in (coda_llama3_args if config.model.name == "coda_llama3" else llama3_args)


def test_flavors_mean_the_same_in_both_models():
    for flavor in ("debugmodel_gqa", "1B", "3B", "8B", "70B"):
        assert same_architecture(coda_llama3_args[flavor], llama3_args[flavor]), flavor
    assert same_architecture(coda_llama3_args["debugmodel"], coda_llama3_args["debugmodel_gqa"])
    a = coda_llama3_args["debugmodel"]
    assert a.n_kv_heads < a.n_heads  # GQA


def test_1b_shape():
    import torch

    from coda_titan.model.model import CodaTransformer

    a = coda_llama3_args["1B"]
    assert (a.dim, a.n_layers, a.n_heads, a.n_kv_heads, a.vocab_size) == (2048, 16, 32, 8, 128256)
    with torch.device("meta"):
        m = CodaTransformer(dataclasses.replace(a, coda=Coda(backend="torch")))
    assert m.layers["0"].feed_forward.w1.weight.shape == (8192, 2048)
    assert m.layers["0"].attention.wk.weight.shape == (512, 2048)


@pytest.mark.parametrize("eager,compiled", COMPILE_TWINS)
def test_compile_twin_differs_only_in_compile(eager, compiled):
    e = dict(_flatten(cli._load_toml(CONFIGS / eager)))
    c = dict(_flatten(cli._load_toml(CONFIGS / compiled)))
    diff = {k for k in e.keys() | c.keys() if e.get(k) != c.get(k)} - OUTPUT_ONLY
    assert diff == {("compile", "enable"), ("compile", "components")}
    assert c[("compile", "enable")] is True and e[("compile", "enable")] is False


@pytest.mark.parametrize("size,kind", [("1b", "baseline"), ("1b", "baseline_compile"), ("8b", "baseline")])
def test_fp8_baseline_is_its_bf16_twin_plus_float8(size, kind):
    b = dict(_flatten(cli._load_toml(CONFIGS / f"llama3_{size}_bf16_{kind}.toml")))
    f = dict(_flatten(cli._load_toml(CONFIGS / f"llama3_{size}_fp8_{kind}.toml")))
    diff = {k for k in b.keys() | f.keys() if b.get(k) != f.get(k)} - OUTPUT_ONLY
    assert diff == {("model", "converters"), ("quantize", "linear", "float8", "recipe_name"),
                    ("quantize", "linear", "float8", "filter_fqns")}
    assert f[("model", "converters")] == ["fa4", "quantize.linear.float8"]
    assert f[("quantize", "linear", "float8", "filter_fqns")] == ["output"]  # LM head in bf16
    config = cli.parse_config(str(CONFIGS / f"llama3_{size}_fp8_{kind}.toml"), [])
    assert config.quantize.linear.float8.recipe_name == "tensorwise"


def test_1b_and_8b_configs_use_fa4_on_both_sides():
    for p in list(CONFIGS.glob("llama3_1b_*.toml")) + list(CONFIGS.glob("llama3_8b_*.toml")):
        assert cli._load_toml(p)["model"]["converters"][0] == "fa4", p.name


@pytest.mark.parametrize("size,kind", [("1b", "coda"), ("1b", "coda_compile"), ("8b", "coda")])
def test_fp8_coda_is_its_bf16_twin_plus_precision(size, kind):
    b = dict(_flatten(cli._load_toml(CONFIGS / f"llama3_{size}_bf16_{kind}.toml")))
    f = dict(_flatten(cli._load_toml(CONFIGS / f"llama3_{size}_fp8_{kind}.toml")))
    diff = {k for k in b.keys() | f.keys() if b.get(k) != f.get(k)} - OUTPUT_ONLY
    # the 1B fp8 configs also save B3's pre-activations as e4m3 codes (fp8_preact: their memory target, measured
    # and its parity met on the 1B compiled config, docs/fp8.md) and run the clip inside the fused AdamW step
    # (measured faster in fp8, level in bf16: docs/history.md); the optimizer step runs on its own stream in
    # both, in chunks of 4 layers (docs/cute_backend.md, docs/fp8.md); and dW_qkv on fp8 (fp8_qkv_wgrad:
    # measured and its parity met on the 1B compiled config, docs/fp8.md), and dW13 on F1's e4m3 H^T
    # (fp8_mlp_h_t, the same); and the batch's copies on their own stream (input_stream: measured faster in fp8,
    # level in bf16, docs/history.md); and the LM head's logits on fp8 (fp8_lm_head_fwd: measured and its parity
    # met on the 1B compiled config, docs/fp8.md), and dW_out on da's stochastically rounded e5m2 codes
    # (fp8_lm_head_dw: the same), and the head's dX on those codes too (fp8_lm_head_dgrad: the same)
    only = ({("coda", "fp8_preact"), ("coda", "fused_clip"), ("coda", "fp8_qkv_wgrad"), ("coda", "fp8_mlp_h_t"),
             ("coda", "input_stream"), ("coda", "fp8_lm_head_fwd"), ("coda", "fp8_lm_head_dw"),
             ("coda", "fp8_lm_head_dgrad")} if size == "1b" else set())
    assert diff == {("coda", "precision"), ("coda", "fp8_amax_history")} | only
    if only:
        assert f[("coda", "fp8_preact")] is True and b[("coda", "ce_chunk_rows")] == f[("coda", "ce_chunk_rows")]
        assert b[("coda", "optimizer_stream")] and f[("coda", "optimizer_stream")]
        assert (b[("coda", "step_chunk_layers")], f[("coda", "step_chunk_layers")]) == (4, 4)
        assert f[("coda", "fp8_qkv_wgrad")] is True and f[("coda", "input_stream")] is True
        assert f[("coda", "fp8_mlp_h_t")] is True and f[("coda", "fp8_lm_head_fwd")] is True
        assert f[("coda", "fp8_lm_head_dw")] is True and f[("coda", "fp8_lm_head_dgrad")] is True
    config = cli.parse_config(str(CONFIGS / f"llama3_{size}_fp8_{kind}.toml"), [])
    assert config.coda.precision == "fp8" and config.model.converters == ["fa4"]


# --- offline data: the embedded corpus, the BPE tokenizer, local files -----------------------------------


DOCS = [f"def f{i}(x):\n    '''Document {i}.'''\n    return x * {i}\n" * 20 for i in range(12)]


@pytest.fixture(scope="module")
def tokenizer(cache_dir, monkeypatch_module):
    monkeypatch_module.setenv("CODA_TITAN_CACHE", cache_dir)
    return HuggingFaceTokenizer(ensure_tokenizer("coda:stdlib-bpe-2048", log=lambda m: None))


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_embedded_corpus_is_real_python_text():
    files = data.stdlib_files()
    assert len(files) > 200 and files == sorted(files)
    texts = data.stdlib_texts(max_bytes=200_000)
    assert any("def " in t for t in texts) and any('"""' in t for t in texts)


def test_tokenizer_round_trip_and_cache(tokenizer, cache_dir):
    text = "def add(a, b):\n    return a + b  # sum\n"
    ids = tokenizer.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == tokenizer.bos_id and ids[-1] == tokenizer.eos_id and tokenizer.bos_id != tokenizer.eos_id
    assert tokenizer.decode(ids[1:-1]) == text
    assert tokenizer.get_vocab_size() == 2048
    assert len(ids) < len(text) / 2  # merges learned, not bytes
    path = ensure_tokenizer("coda:stdlib-bpe-2048", log=lambda m: pytest.fail("retrained a cached tokenizer"))
    assert path.startswith(str(cache_dir))


@pytest.mark.parametrize("spec", ["coda:stdlib-bpe-abc", "coda:stdlib-bpe-12"])
def test_bad_tokenizer_spec(spec):
    with pytest.raises(DataError, match="coda:stdlib-bpe-<vocab>"):
        ensure_tokenizer(spec)


def test_missing_tokenizer_folder(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        ensure_tokenizer(str(tmp_path / "nope"))


def _write(tmp_path, kind):
    if kind == "jsonl":
        p = tmp_path / "corpus.jsonl"
        p.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(DOCS)))
    elif kind == "txt":
        p = tmp_path / "corpus.txt"
        p.write_text("\n\n".join(DOCS))  # DOCS hold no blank lines: one paragraph each
    else:
        from datasets import Dataset

        p = tmp_path / "corpus.parquet"
        Dataset.from_dict({"text": DOCS}).to_parquet(str(p))
    return p


@pytest.mark.parametrize("kind", ["jsonl", "txt", "parquet"])
def test_local_files_feed_torchtitan_dataset(tmp_path, tokenizer, kind):
    path = _write(tmp_path, kind)
    ds = HuggingFaceTextDataset("local", str(path), tokenizer, seq_len=64)
    batches = [b for _, b in zip(range(3), iter(ds))]
    assert len(batches) == 3
    (inp, labels) = batches[0]
    assert inp["input"].shape == (64,) and labels.shape == (64,)
    assert (inp["input"][1:] == labels[:-1]).all()
    text = tokenizer.decode(inp["input"].tolist())
    assert "Document" in text


def test_local_folder_and_bad_inputs(tmp_path):
    (tmp_path / "a").mkdir()
    _write(tmp_path / "a", "jsonl")
    assert data.local_files(tmp_path / "a")[0] == "json"
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "x.csv").write_text("text\nhello\n")
    with pytest.raises(DataError, match="no .jsonl"):
        data.local_files(tmp_path / "b")
    with pytest.raises(DataError, match="does not exist"):
        data.local_files(tmp_path / "missing.jsonl")
    no_text = tmp_path / "notext.jsonl"
    no_text.write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(DataError, match="'text' field"):
        DATASETS["local"].loader(str(no_text))


@pytest.mark.slow
def test_train_on_local_jsonl(tmp_path, cache_dir):
    path = _write(tmp_path, "jsonl")
    proc = run_cli(
        ["train", str(CONFIGS / "debug_cpu_coda.toml"), "--training.dataset", "local", "--training.dataset_path",
         str(path), "--training.steps", "3", "--job.dump_folder", str(tmp_path / "out"),
         "--metrics.disable_color_printing"],
        cwd=tmp_path, cache_dir=cache_dir,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert sorted(logged_losses(proc.stdout + proc.stderr)) == [1, 2, 3]


# --- parallelize: what is refused -----------------------------------------------------------------


@pytest.mark.parametrize("key", ["tp", "cp", "pp"])
def test_tensor_context_and_pipeline_parallelism_are_refused_in_one_line(key):
    """coda_llama3 takes FSDP2 / HSDP / DDP; TP, CP and PP stop with one line naming what is supported,
    before anything touches the model."""
    from types import SimpleNamespace

    from coda_titan.titan.parallelize import parallelize_coda

    dims = SimpleNamespace(tp_enabled=key == "tp", cp_enabled=key == "cp", pp_enabled=key == "pp", fsdp_enabled=False,
                           dp_replicate_enabled=False)
    name = {"tp": "tensor", "cp": "context", "pp": "pipeline"}[key]
    with pytest.raises(ValueError) as err:
        parallelize_coda(None, dims, SimpleNamespace())
    msg = str(err.value)
    assert "\n" not in msg and f"parallelism.{name}_parallel_degree" in msg and "data_parallel_shard_degree (FSDP2)" in msg


@pytest.mark.parametrize("case", ["no_compile", "aot_eager", "full_ac", "fsdp"])
def test_cuda_graphs_outside_what_they_hold_is_refused_in_one_line(case):
    """``[coda] cuda_graphs`` needs compiled blocks on inductor, no activation checkpointing and one
    GPU; each missing piece is named in one line before the model is touched."""
    from types import SimpleNamespace

    from torchtitan.config.job_config import ActivationCheckpoint, Compile

    from coda_titan.titan.job_config import ConfigError
    from coda_titan.titan.parallelize import parallelize_coda

    job = SimpleNamespace(
        coda=Coda(cuda_graphs=True),
        compile=Compile(enable=case != "no_compile", components=["model"], backend="aot_eager" if case == "aot_eager" else "inductor"),
        activation_checkpoint=ActivationCheckpoint(mode="full" if case == "full_ac" else "none"),
    )
    dims = SimpleNamespace(tp_enabled=False, cp_enabled=False, pp_enabled=False, fsdp_enabled=case == "fsdp",
                           dp_replicate_enabled=False)
    with pytest.raises(ConfigError) as err:
        parallelize_coda(None, dims, job)
    msg = str(err.value)
    expect = {"no_compile": "compile.enable = true", "aot_eager": 'compile.backend = "inductor" (got "aot_eager")',
              "full_ac": 'activation_checkpoint.mode = "none" (got "full")', "fsdp": "a single GPU"}[case]
    assert "\n" not in msg and msg.startswith("[coda] cuda_graphs = true needs") and expect in msg, msg


@pytest.mark.parametrize("env", [None, "3"])
@pytest.mark.parametrize("backend", ["cute", "torch"])
def test_b2_c_stages_reaches_the_kernels_environment_unless_it_is_set(monkeypatch, env, backend):
    """``[coda] b2_c_stages`` > 0 sets the cute kernels' C-stage variable (``cute/stages.py`` reads it at
    each call) where the model runs them; an explicit environment variable wins; 0 leaves quack's base."""
    from types import SimpleNamespace

    from torchtitan.config.job_config import ActivationCheckpoint, Compile

    from coda_titan.kernels import EPI_C_STAGES_ENV
    from coda_titan.titan.parallelize import parallelize_coda

    dims = SimpleNamespace(tp_enabled=False, cp_enabled=False, pp_enabled=False, fsdp_enabled=False,
                           dp_replicate_enabled=False)
    model = torch.nn.Module()
    model.layers, model.backend_name = torch.nn.ModuleDict(), backend
    for base, want in ((0, env), (2, env or ("2" if backend == "cute" else None))):
        if env is None:
            monkeypatch.delenv(EPI_C_STAGES_ENV, raising=False)
        else:
            monkeypatch.setenv(EPI_C_STAGES_ENV, env)
        job = SimpleNamespace(coda=Coda(b2_c_stages=base), compile=Compile(enable=False),
                              activation_checkpoint=ActivationCheckpoint(mode="none"))
        parallelize_coda(model, dims, job)
        assert os.environ.get(EPI_C_STAGES_ENV) == want, (base, env)


@pytest.mark.gpu
def test_cuda_graph_replays_compute_what_the_compiled_blocks_compute():
    """cute fp8, two 1B-width layers: blocks compiled in reduce-overhead mode (``[coda] cuda_graphs``)
    give, bit for bit, the loss of blocks compiled as TorchTitan does, at every step of a short run
    (after the first, which runs the blocks uncompiled) in which the graphs are recorded and then replayed on weights the optimizer updated in place, a
    prefetched fp8 weight pass and fresh delayed scales: each step's state (weights, optimizer state,
    fp8 histories) is copied into the plain model first, so only the replay can differ. The forward
    is deterministic (the same kernels on the same inputs), so any stale or overwritten input shows."""
    from torchtitan.config import Optimizer as OptimizerConfig

    from coda_titan.titan.train_spec import build_coda_optimizers

    from .helpers import compiled_1b_width_model

    torch._dynamo.reset()
    seqlen = 1024
    models = {graphs: compiled_1b_width_model(Coda(backend="cute", precision="fp8", cuda_graphs=graphs), seqlen)
              for graphs in (True, False)}
    graphed, plain = models[True], models[False]
    opt = build_coda_optimizers([graphed], OptimizerConfig(name="AdamW", lr=1e-3), parallel_dims=None)
    # (a failure names the stack that allocated any tensor the graphs' pool keeps beyond their outputs)
    with torch._inductor.config.patch({"triton.cudagraph_trees_history_recording": True}):
        _replay_steps(graphed, plain, opt, seqlen)


def _replay_steps(graphed, plain, opt, seqlen: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(1)
    for step in range(5):  # uncompiled (the programs' lasting state made outside the pool), warm-up, record, replays
        tokens, labels = (torch.randint(0, 128256, (2, seqlen), generator=g, device="cuda") for _ in range(2))
        plain.load_state_dict(graphed.state_dict())
        plain.fp8_scaling.load_checkpoint_state({k: v.clone() for k, v in graphed.fp8_scaling.checkpoint_state().items()})
        want = plain(tokens, labels=labels).float().item()  # (with grad: the training forward's graph)
        loss = graphed(tokens, labels=labels)
        got = loss.float().item()
        assert torch.isfinite(loss) and (step == 0 or got == want), (step, got, want)
        loss.backward()
        opt.step()
        opt.zero_grad()


# --- parallelize: activation checkpointing with compile ---------------------------------------------


def _saved_bytes_and_grads(ac_mode: str, compile_: bool, device: str = "cpu", trace_passes: bool = True):
    """Bytes of the activations (tensors other than parameters) the autograd graph keeps from one forward of a small CODA model
    parallelized by ``parallelize_coda`` (as the Trainer does), and its gradients after backward.
    CPU: debug size, torch programs, ``aot_eager``; GPU: 1B width, 2 layers, cute programs, inductor."""
    from types import SimpleNamespace

    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torchtitan.config.job_config import ActivationCheckpoint, Compile

    from coda_titan.titan.parallelize import parallelize_coda

    torch._dynamo.reset()
    torch.manual_seed(0)
    gpu = device == "cuda"
    if gpu:  # the 1B shapes of the whole-1B GPU tests (their tuned kernels), two layers
        coda = Coda(backend="cute", ce_chunk_rows=4096, trace_passes=trace_passes)
        args = dataclasses.replace(coda_llama3_args["1B"], n_layers=2, max_seq_len=2048, coda=coda)
    else:
        coda = Coda(backend="torch", tile_n=32, ce_chunk_rows=32)
        args = CodaModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=61, multiple_of=32, max_seq_len=32,
                             coda=coda)
    with torch.device(device):
        model = CodaTransformer(args)
        with torch.no_grad():
            model.init_weights()
    if gpu:
        model = model.to(torch.bfloat16)
    job = SimpleNamespace(compile=Compile(enable=compile_, components=["model"], backend="inductor" if gpu else "aot_eager"),
                          activation_checkpoint=ActivationCheckpoint(mode=ac_mode), job=SimpleNamespace(dump_folder="."))
    dims = SimpleNamespace(tp_enabled=False, cp_enabled=False, pp_enabled=False, fsdp_enabled=False,
                           dp_replicate_enabled=False)
    parallelize_coda(model, dims, job)
    g = torch.Generator(device=device).manual_seed(1)
    tokens, labels = (torch.randint(0, args.vocab_size, (2, args.max_seq_len), generator=g, device=device) for _ in range(2))
    storages = {}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}  # (a compiled graph lists them as saved)

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens, labels=labels)
    loss.backward()
    # the checkpoint keys (DCP's FQNs) stay TorchTitan's llama3 names, wrappers or not
    with torch.device("meta"):
        plain = CodaTransformer(dataclasses.replace(args, coda=Coda(backend="torch")))
    assert set(get_model_state_dict(model)) == set(plain.state_dict())
    clean = lambda n: n.replace("_checkpoint_wrapped_module.", "")  # noqa: E731
    return sum(storages.values()), {clean(n): p.grad for n, p in model.named_parameters()}


def test_full_activation_checkpointing_under_compile_keeps_only_what_it_keeps_without():
    """Full AC with compile keeps what full AC keeps eagerly (each block's inputs; the block reruns
    its compiled forward in the backward), far less than no AC, and trains the same model. Compiled
    *through* the checkpoint (TorchTitan's order), the partitioner kept CODA's program outputs."""
    eager_ac, grads = _saved_bytes_and_grads("full", compile_=False)
    compiled_ac, grads_c = _saved_bytes_and_grads("full", compile_=True)
    compiled_none, _ = _saved_bytes_and_grads("none", compile_=True)
    assert compiled_ac == eager_ac < compiled_none / 2, (eager_ac, compiled_ac, compiled_none)
    for n, g in grads.items():  # aot_eager runs the same ops: only the graph capture differs
        torch.testing.assert_close(grads_c[n], g, rtol=1e-5, atol=1e-7, msg=n)


@pytest.mark.gpu
@pytest.mark.parametrize("trace_passes", [True, False])
def test_full_activation_checkpointing_under_inductor_with_cute_programs(trace_passes):
    """The same on the GPU, where it failed unseen: with the cute programs and inductor, full AC
    compiled through the checkpoint kept the programs' outputs (8B with compile recomputed nothing).
    Compiled inside the checkpoint, the compiled model keeps exactly the eager one's bytes. What AC
    must drop: without it each block keeps at least F2's pre-activation a (M x 2F bf16, which B3
    reads and nothing can recompute but F2's GEMM); with it only the block's inputs x, h (M x d bf16)
    and r (M fp32). (The LM head's gradients, made in the forward, are kept either way.)"""
    from .helpers import log_bound

    eager_ac, _ = _saved_bytes_and_grads("full", compile_=False, device="cuda", trace_passes=trace_passes)
    compiled_ac, _ = _saved_bytes_and_grads("full", compile_=True, device="cuda", trace_passes=trace_passes)
    compiled_none, _ = _saved_bytes_and_grads("none", compile_=True, device="cuda", trace_passes=trace_passes)
    a = coda_llama3_args["1B"]
    m, d, layers = 2 * 2048, a.dim, 2  # the helper's batch, width and depth
    with torch.device("meta"):
        ffn = CodaTransformer(dataclasses.replace(a, n_layers=1, coda=Coda(backend="torch"))).layers["0"].feed_forward.w1.weight.shape[0]
    must_drop = layers * (m * 2 * ffn * 2 - (2 * m * d * 2 + 4 * m))
    log_bound(f"full AC under inductor, trace_passes={trace_passes} (bytes kept: eager AC, compiled AC, compiled no AC)",
              err=float(compiled_ac), bound=float(compiled_none - must_drop), eager_ac=eager_ac, compiled_none=compiled_none)
    assert compiled_ac == eager_ac <= compiled_none - must_drop, (eager_ac, compiled_ac, compiled_none, must_drop)
