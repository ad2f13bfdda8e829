"""The Liger baseline (``model.name = "liger_llama3"``): stock TorchTitan llama3 with Liger's RMSNorm, SiLU-mul and
fused linear cross-entropy. Liger's kernels run on CUDA only, so on the CPU the model runs with torch's own math in
their place (``liger.OPS``): what is tested here is that the model is stock llama3 (parameters, names, values, loss
and gradients) with exactly those calls swapped, that its train spec feeds it the labels and passes its loss
through, and that it is refused in one line where Liger cannot run. The GPU test sets Liger's kernels against the
same model in float64."""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

import pytest
import torch

from coda_titan import cli
from coda_titan.titan import liger

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _torch_ops(calls: Counter) -> liger.LigerOps:
    """torch's math for Liger's three kernels (``liger.torch_ops``), counting the calls."""
    plain = liger.torch_ops()

    def counted(name):
        def call(*args):
            calls[name] += 1
            return getattr(plain, name)(*args)
        return call

    return liger.LigerOps(*(counted(f.name) for f in dataclasses.fields(liger.LigerOps)))


def _build(cls, args, dtype, device="cpu"):
    """As TorchTitan's trainer builds a model: its parameters in ``dtype`` (RoPE's table stays complex64)."""
    from torchtitan.tools.utils import set_default_dtype

    with torch.device(device), set_default_dtype(dtype):
        model = cls(args)
        with torch.no_grad():
            model.init_weights()
    return model


def _models(dtype=torch.float64):
    from torchtitan.models.llama3 import Transformer, llama3_args

    args = dataclasses.replace(llama3_args["debugmodel"], max_seq_len=32)
    torch.manual_seed(0)
    stock, ours = _build(Transformer, args, dtype), _build(liger.LigerTransformer, args, dtype)
    ours.load_state_dict(stock.state_dict())
    return stock, ours, args


def test_the_liger_model_is_stock_llama3_with_its_kernels_swapped(monkeypatch):
    """Same parameters under the same names; with labels the loss sum (TorchTitan's ``cross_entropy_loss``) and
    every gradient equal to stock's, each RMSNorm, SwiGLU and the head + loss through the kernels' calls; without
    labels (the validator's call) stock's logits."""
    from torchtitan.components.loss import cross_entropy_loss

    calls = Counter()
    monkeypatch.setattr(liger, "OPS", _torch_ops(calls))
    stock, ours, args = _models()
    assert [n for n, _ in stock.named_parameters()] == [n for n, _ in ours.named_parameters()]
    tokens = torch.randint(0, args.vocab_size, (2, 32))
    labels = torch.randint(0, args.vocab_size, (2, 32))
    labels[0, :5] = liger.IGNORE_INDEX
    ref = cross_entropy_loss(stock(tokens), labels)
    ref.backward()
    calls.clear()
    loss = ours(tokens, labels=labels)
    assert loss.dim() == 0 and torch.allclose(loss, ref, rtol=1e-12, atol=0)
    assert calls == {"rms_norm": 2 * args.n_layers + 1, "silu_mul": args.n_layers, "linear_ce": 1}
    loss.backward()
    for (name, p), q in zip(stock.named_parameters(), ours.parameters()):
        assert torch.allclose(q.grad, p.grad, rtol=1e-10, atol=1e-14), name
    with torch.no_grad():
        assert torch.allclose(ours(tokens), stock(tokens), rtol=1e-12, atol=1e-14)


def test_the_liger_train_spec_feeds_the_labels_and_passes_the_loss_through(monkeypatch):
    """``liger_llama3`` is registered with the Liger model and llama3's flavors, its dataloader adds the labels to
    the model's inputs, its loss function returns the model's 0-dim loss as it is (logits: stock cross-entropy)."""
    import coda_titan  # noqa: F401  (registers the specs)
    from torchtitan.models.llama3 import llama3_args
    from torchtitan.protocols.train_spec import get_train_spec

    from coda_titan.titan.train_spec import LabelsInInputs

    spec = get_train_spec(liger.NAME)
    assert spec.model_cls is liger.LigerTransformer and set(llama3_args) <= set(spec.model_args)
    batch = [({"input": torch.zeros(1, 4, dtype=torch.long)}, torch.ones(1, 4, dtype=torch.long))]
    (inputs, labels), = list(LabelsInInputs(batch))
    assert inputs["labels"] is labels
    cfg = cli.parse_config(str(CONFIGS / "llama3_1b_bf16_liger.toml"), [])
    loss_fn = spec.build_loss_fn(cfg)
    scalar = torch.tensor(3.5)
    assert loss_fn(scalar, None) is scalar
    logits, target = torch.randn(1, 4, 7), torch.randint(0, 7, (1, 4))
    stock = torch.nn.functional.cross_entropy(logits[0], target[0], reduction="sum")
    assert torch.allclose(loss_fn(logits, target), stock)


def test_liger_is_refused_in_one_line_where_it_cannot_run(monkeypatch):
    """No CUDA GPU (or no liger-kernel): ``coda-titan train`` stops with one line before anything is built, and a
    model built anyway raises before allocating a weight."""
    from torchtitan.models.llama3 import llama3_args

    monkeypatch.setattr(liger, "OPS", None)
    monkeypatch.setattr(liger, "liger_unavailable_reason", lambda: "no GPU here")
    config = cli.parse_config(str(CONFIGS / "llama3_1b_bf16_liger.toml"), [])
    with pytest.raises(cli.UserError) as err:
        cli.validate(config)
    assert "\n" not in str(err.value) and "liger_llama3" in str(err.value) and "no GPU here" in str(err.value)
    with pytest.raises(RuntimeError, match="no GPU here"), torch.device("meta"):
        liger.LigerTransformer(llama3_args["debugmodel"])


@pytest.mark.parametrize("variant", ["", "_compile"])
def test_the_liger_configs_are_the_baselines_but_for_the_model_name(variant):
    from tests.test_titan import OUTPUT_ONLY, _flatten

    b = dict(_flatten(cli._load_toml(CONFIGS / f"llama3_1b_bf16_baseline{variant}.toml")))
    g = dict(_flatten(cli._load_toml(CONFIGS / f"llama3_1b_bf16_liger{variant}.toml")))
    assert {k for k in b.keys() | g.keys() if b.get(k) != g.get(k)} - OUTPUT_ONLY == {("model", "name")}
    assert g[("model", "name")] == liger.NAME


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_liger_kernels_match_the_model_in_float64_as_stock_bf16_does(compiled):
    """On the GPU, with Liger's kernels, eager and with each block compiled as TorchTitan compiles it: the bf16 Liger
    model's loss and every parameter's gradient against the same model in float64 (torch's math) are no further than
    stock bf16 llama3's (compiled alike) against that float64 model, times 2 (Liger's kernels round differently from
    torch's, in the same precision; the bound is the same math's own bf16 error), plus 2^-8 of the gradient for a
    parameter whose stock error happens to be near zero."""
    if liger.liger_unavailable_reason():
        pytest.skip(liger.liger_unavailable_reason())
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.models.llama3 import Transformer, llama3_args

    args = dataclasses.replace(llama3_args["debugmodel"], max_seq_len=256)
    torch.manual_seed(0)
    ref64 = _build(Transformer, args, torch.float64, "cuda")
    tokens = torch.randint(0, args.vocab_size, (2, 256), device="cuda")
    labels = torch.randint(0, args.vocab_size, (2, 256), device="cuda")

    def run(model, ops=None):
        model.zero_grad(set_to_none=True)
        if ops is None:
            loss = cross_entropy_loss(model(tokens), labels)
        else:
            loss = model(tokens, labels=labels)
        loss.backward()
        return loss.double(), [p.grad.double() for p in model.parameters()]

    l64, g64 = run(ref64)
    stock = _build(Transformer, args, torch.bfloat16, "cuda")
    ours = _build(liger.LigerTransformer, args, torch.bfloat16, "cuda")
    stock.load_state_dict(ref64.state_dict())
    ours.load_state_dict(ref64.state_dict())
    if compiled:
        for model in (stock, ours):
            for name, block in model.layers.named_children():
                model.layers.register_module(name, torch.compile(block, fullgraph=True))
    ls, gs = run(stock)
    lg, gg = run(ours, ops=True)
    # (+ half a bf16 ulp of the loss: stock's own error may happen to be near zero)
    assert (lg - l64).abs() <= 2 * (ls - l64).abs() + 2**-9 * l64.abs()
    names = [n for n, _ in ref64.named_parameters()]
    for name, a, b, r in zip(names, gg, gs, g64):
        err_liger, err_stock = ((a - r).norm() / r.norm()).item(), ((b - r).norm() / r.norm()).item()
        assert err_liger <= 2 * err_stock + 2**-8, (name, err_liger, err_stock)


@pytest.mark.gpu
def test_liger_head_weight_gradient_at_the_1b_chunk_count_is_as_close_to_float64_as_stock_bf16s():
    """Liger's fused linear cross-entropy cuts the 1B step's 16,384 rows into 32 chunks (its rows a chunk: the next
    power of two of rows / ceil(vocab / dim)); here the same count (8,192 rows, dim 256, vocab 8,192: 32 chunks of
    256). Its dW_out (summed over the chunks in ``liger_ops``' fp32, Liger's ``accum_dtype``), and its dH, against
    float64 are no further than stock bf16's (bf16 logits, one GEMM each with fp32 accumulation), times 2. Summed in
    bf16, Liger's default, dW's running sum is rounded 32 times."""
    if liger.liger_unavailable_reason():
        pytest.skip(liger.liger_unavailable_reason())
    torch.manual_seed(0)
    rows, dim, vocab = 8192, 256, 8192
    h64 = torch.randn(rows, dim, device="cuda", dtype=torch.float64)
    w64 = torch.randn(vocab, dim, device="cuda", dtype=torch.float64) * dim**-0.5
    t = torch.randint(0, vocab, (rows,), device="cuda")

    def grads(h, w, head):
        h, w = h.detach().requires_grad_(), w.detach().requires_grad_()
        head(h, w).backward()
        return h.grad.double(), w.grad.double()

    def stock(h, w):
        return torch.nn.functional.cross_entropy((h @ w.t()).float(), t, reduction="sum")

    ref = grads(h64, w64, lambda h, w: torch.nn.functional.cross_entropy(h @ w.t(), t, reduction="sum"))
    hb, wb = h64.bfloat16(), w64.bfloat16()
    ops = liger.liger_ops()
    ours, base = grads(hb, wb, lambda h, w: ops.linear_ce(h, w, t)), grads(hb, wb, stock)
    for name, o, b, r in zip(("dH", "dW"), ours, base, ref):
        err_o, err_b = ((o - r).norm() / r.norm()).item(), ((b - r).norm() / r.norm()).item()
        assert err_o <= 2 * err_b, (name, err_o, err_b)


def test_the_bisection_switch_swaps_the_named_kernels_for_torchs_math(monkeypatch):
    """``CODA_TITAN_LIGER_TORCH_OPS``: the named fields of ``LigerOps`` are torch's math, the rest Liger's; a name
    that is not a field is refused. (Liger itself stood in for by a stub module: the CPU machines lack it.)"""
    import sys
    import types

    stub = types.ModuleType("liger_stub")
    stub.LigerRMSNormFunction = stub.LigerSiLUMulFunction = types.SimpleNamespace(apply=lambda *a: "liger")
    stub.LigerFusedLinearCrossEntropyLoss = lambda **kw: (lambda w, h, t: "liger")
    for name in ("liger_kernel", "liger_kernel.ops", "liger_kernel.ops.rms_norm", "liger_kernel.ops.swiglu",
                 "liger_kernel.transformers"):
        monkeypatch.setitem(sys.modules, name, stub)
    monkeypatch.setenv(liger.TORCH_OPS_ENV, "silu_mul,linear_ce")
    ops = liger.liger_ops()
    x = torch.randn(3, 4)
    assert ops.rms_norm(x, torch.ones(4), 1e-5) == "liger"
    assert torch.equal(ops.silu_mul(x, x), torch.nn.functional.silu(x) * x)
    assert ops.linear_ce(x, torch.randn(5, 4), torch.tensor([0, 1, 2])).dim() == 0
    monkeypatch.setenv(liger.TORCH_OPS_ENV, "rope")
    with pytest.raises(ValueError, match="rope"):
        liger.liger_ops()


def test_the_liger_model_on_torchs_math_trains_as_stock_does_over_steps(tmp_path, monkeypatch):
    """The multi-step probe's machinery (``scripts/probes/liger_steps.py --cpu``): with torch's math in the kernels'
    place the Liger model trains step for step as stock llama3 does (pure bf16, AdamW, clip), and its batches are
    learnable (the loss falls): what the GPU probe then compares with Liger's kernels in, eager and compiled."""
    import json

    from scripts.probes import liger_steps

    monkeypatch.setenv("OUT", str(tmp_path))
    liger_steps.main(["--cpu", "--steps", "4"])
    doc = json.loads(next(tmp_path.glob("probe_liger_steps_*.json")).read_text())
    arms = {r["arm"]: r for r in doc["arms"]}
    assert set(arms) == {"stock", "liger_torch_all"}
    assert arms["liger_torch_all"]["loss"] == arms["stock"]["loss"]
    assert arms["liger_torch_all"]["grad_norm"] == arms["stock"]["grad_norm"]
    assert arms["stock"]["loss"][-1] < arms["stock"]["loss"][0]
    assert [s["first_step_2pct_apart"] for s in doc["summary"]] == [None, None]
