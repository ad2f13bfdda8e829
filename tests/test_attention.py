"""FlashAttention-4 as TorchTitan attention: the custom ops, the module, the ``fa4`` converter.

On CPU the ops run the exact float32 reference, which must equal SDPA; that checks the op schemas,
fakes, the autograd formula and the (b, h, s, d) <-> (b, s, h, d) plumbing in both model families.
On the GPU (``gpu`` mark) FA4's kernels must be as close to float64 attention as SDPA in bf16 is.
"""

import pytest
import torch
import torch.nn.functional as F

from coda_titan.titan import fa4 as fa
from coda_titan.model.args import CodaModelArgs
from coda_titan.titan.job_config import Coda
from coda_titan.model.model import CodaTransformer


def _qkv(b=2, s=33, h=4, h_kv=2, d=16, dtype=torch.float64, device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    mk = lambda n: torch.randn(b, s, n, d, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)  # noqa: E731
    return mk(h), mk(h_kv), mk(h_kv)


def _sdpa(q, k, v):  # (b, s, h, d) in and out
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True)
    return o.transpose(1, 2)


@pytest.mark.parametrize("h_kv", [4, 2, 1])
def test_reference_op_equals_sdpa_with_gradients(h_kv):
    q, k, v = (t.requires_grad_() for t in _qkv(h_kv=h_kv))
    scale = q.shape[-1] ** -0.5
    out, lse = fa.flash_attn_fwd(q, k, v, scale, True)
    want = _sdpa(q, k, v)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)  # the reference computes in float32
    # lse: log-sum-exp of the causal scores of each query row
    s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(4 // h_kv, 2)) * scale
    s = s.masked_fill(torch.ones(33, 33, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(s, -1).float(), rtol=1e-5, atol=1e-5)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    ref = torch.autograd.grad(want, (q, k, v), dout)
    for g, r, name in zip(got, ref, "qkv"):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5, msg=f"d{name}")


def test_opcheck_cpu():
    q, k, v = _qkv(dtype=torch.float32)
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    torch.library.opcheck(fa.flash_attn_fwd, (q, k, v, 0.25, True))
    out, lse = fa.flash_attn_fwd(q.detach(), k.detach(), v.detach(), 0.25, True)
    torch.library.opcheck(fa.flash_attn_bwd, (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, 0.25, True))


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


# --- GPU -----------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2, 2048, 32, 8, 64), (1, 1000, 32, 8, 128), (1, 4096, 16, 16, 128)])
def test_fa4_kernels_match_float64_like_sdpa(shape):
    """FA4 forward and backward error vs float64 attention <= 2x SDPA-in-bf16's error (+ tiny floor)."""
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
    got = run(lambda q, k, v: fa.flash_attn_fwd(q, k, v, d ** -0.5, True)[0])
    base = run(_sdpa)
    for name, g, bl, r in zip(("out", "dq", "dk", "dv"), got, base, (ref, *ref_g)):
        assert torch.isfinite(g).all(), name
        err = (g.double() - r).abs().max().item()
        err_sdpa = (bl.double() - r).abs().max().item()
        assert err <= 2 * err_sdpa + 1e-6, f"{name}: fa4 {err:.3e} vs sdpa {err_sdpa:.3e}"


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
