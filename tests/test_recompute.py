"""Full activation checkpointing recomputes each block up to its down-projection's GEMM (``kernels/recompute.py``):
the same training, bit for bit, with one F1 GEMM a layer fewer, eager and compiled, on the programs' ops
(whose CPU kernels skip as the CUDA kernels do); the skipped call's outputs are the op's, in shape and dtype."""

import copy
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from coda_titan.kernels import op_backend, recompute
from coda_titan.kernels import residual_rms as f1_kernels
from coda_titan.model.args import coda_llama3_args
from coda_titan.model.model import CodaTransformer
from coda_titan.titan.job_config import Coda

FP8 = dict(precision="fp8")
VARIANTS = {"bf16": {}, "fp8": FP8, "fp8_down": {**FP8, "fp8_down_proj": True, "fp8_out_proj": True},
            "fp8_down_h_t": {**FP8, "fp8_down_proj": True, "fp8_qkv_wgrad": True}}


def _model(**coda):
    """The debug model on the programs' custom ops (``op_backend``: opaque to torch.compile, as on the GPU)."""
    args = copy.deepcopy(coda_llama3_args["debugmodel"])
    args.coda = dataclasses.replace(Coda(backend="torch"), **coda)
    torch.manual_seed(0)
    model = CodaTransformer(args)
    with torch.no_grad():
        model.init_weights()
    cfg = dataclasses.replace(model.program_config(), backend=op_backend())
    model.program_config = lambda: cfg
    return model


def _batch(vocab):
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, vocab, (2, 32), generator=g), torch.randint(0, vocab, (2, 32), generator=g)


def _parallelize(model, ac: str, compile_: bool = False):
    from torchtitan.config.job_config import ActivationCheckpoint, Compile

    from coda_titan.titan.parallelize import parallelize_coda

    torch._dynamo.reset()
    job = SimpleNamespace(compile=Compile(enable=compile_, components=["model"], backend="aot_eager"),
                          activation_checkpoint=ActivationCheckpoint(mode=ac), job=SimpleNamespace(dump_folder="."))
    dims = SimpleNamespace(tp_enabled=False, cp_enabled=False, pp_enabled=False, fsdp_enabled=False,
                           dp_replicate_enabled=False)
    return parallelize_coda(model, dims, job)


_GEMMS = ("residual_acc", "residual_q_acc")  # (every F1 variant's GEMM, bf16 or e4m3)


def _train(model, steps=2):
    """Per step: (loss, gradients by TorchTitan's names, F1 GEMMs run in the step's forward and backward)."""
    tokens, labels = _batch(model.model_args.vocab_size)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    original = {name: getattr(f1_kernels, name) for name in _GEMMS}
    calls = {"n": 0}

    def counted(fn):
        def call(*a, **k):
            calls["n"] += 1
            return fn(*a, **k)
        return call

    out = []
    for _ in range(steps):
        calls["n"] = 0
        for name, fn in original.items():
            setattr(f1_kernels, name, counted(fn))
        try:
            opt.zero_grad()
            loss = model(tokens, labels=labels)
            loss.backward()
        finally:
            for name, fn in original.items():
                setattr(f1_kernels, name, fn)
        opt.step()
        grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad.clone() for n, p in model.named_parameters()}
        out.append((loss.detach(), grads, calls["n"]))
    return out


@pytest.mark.parametrize("variant", ["bf16", "fp8", "fp8_down"])
@pytest.mark.parametrize("compile_", [False, True], ids=["eager", "compiled"])
def test_full_ac_trains_bit_for_bit_without_the_last_gemm_in_its_recompute(monkeypatch, variant, compile_):
    layers = coda_llama3_args["debugmodel"].n_layers
    plain = _train(_model(**VARIANTS[variant]))
    runs = {}
    for tail in ("skip", "recompute"):
        monkeypatch.setenv(recompute.ENV, tail)
        runs[tail] = _train(_parallelize(_model(**VARIANTS[variant]), "full", compile_))
    for (loss, grads, n), *others in zip(plain, *runs.values()):
        assert n == 2 * layers  # two F1 programs a layer: the out- and the down-projection
        for loss_ac, grads_ac, _ in others:
            assert torch.equal(loss_ac, loss)
            assert grads_ac.keys() == grads.keys()
            for name, g in grads.items():
                assert torch.equal(grads_ac[name], g), name
    assert [n for *_, n in runs["recompute"]] == [4 * layers] * len(plain)  # each F1 again in the recompute
    assert [n for *_, n in runs["skip"]] == [3 * layers] * len(plain)  # the out-projection's only
    assert not recompute.RECOMPUTING


@pytest.mark.parametrize("name", ["residual_rms", "residual_rms_fp8", "residual_rms_q", "residual_rms_q_fp8",
                                  "residual_rms_q_fp8_t"])
def test_a_skipped_f1_returns_its_ops_outputs_in_shape_and_dtype(monkeypatch, name):
    from coda_titan.kernels.scaling import E4M3

    op = getattr(f1_kernels, f"{name}_op")
    m, k, d = 32, 48, 64
    y, residual, gamma = torch.randn(m, k), torch.randn(m, d), torch.randn(d)
    if "_q" in name:
        args = (y.to(E4M3), torch.randn(d, k).to(E4M3), torch.tensor(0.5), residual, gamma, 16)
    else:
        args = (y, torch.randn(d, k), residual, gamma, 16)
    if name.endswith(("fp8", "fp8_t")):
        args += (torch.tensor(2.0),)
    spec = lambda outs: [(tuple(o.shape), o.dtype) for o in outs]  # noqa: E731
    real = op(*args)
    gemms = []
    for gemm in _GEMMS:
        monkeypatch.setattr(f1_kernels, gemm, lambda *a, _g=getattr(f1_kernels, gemm): gemms.append(a) or _g(*a))
    with recompute._recompute():
        assert not recompute.take_tail()  # the out-projection's F1 runs
        skipped = op(*args)  # the down-projection's does not
    assert spec(skipped) == spec(real) and gemms == []
    assert not recompute.RECOMPUTING and not recompute.take_tail()


def test_install_leaves_reentrant_and_unwrapped_blocks_and_refuses_a_bad_env(monkeypatch):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    layers = torch.nn.ModuleDict({"0": checkpoint_wrapper(torch.nn.Linear(2, 2)), "1": torch.nn.Linear(2, 2),
                                  "2": checkpoint_wrapper(torch.nn.Linear(2, 2), checkpoint_impl=CheckpointImpl.REENTRANT)})
    assert recompute.install(layers) == 1
    assert layers["0"].checkpoint_fn.keywords["context_fn"] is recompute.contexts
    monkeypatch.setenv(recompute.ENV, "sometimes")
    with pytest.raises(ValueError, match=recompute.ENV):
        recompute.install(layers)


def _gpu_steps(precision: str, compile_: bool, steps: int = 2):
    """The cute programs on a 1B-wide, 2-layer model (seq 2048, batch 2) under full AC, compiled by inductor
    or eager: each step's (loss, gradients, F1 GEMMs launched), FA4's attention with deterministic algorithms on
    (its backward and the embedding's otherwise sum in a varying order)."""
    from coda_titan.kernels.cute import residual_rms as cute_f1

    from .helpers import compiled_1b_width_model

    torch._dynamo.reset()
    coda = Coda(backend="cute", ce_chunk_rows=4096, precision=precision)
    # (FA4, as the configs: its backward repeats its bits when deterministic)
    model = compiled_1b_width_model(coda, 2048, fa4=True, ac="full", compile_=compile_)
    args = model.model_args
    g = torch.Generator(device="cuda").manual_seed(1)
    tokens, labels = (torch.randint(0, args.vocab_size, (2, 2048), generator=g, device="cuda") for _ in range(2))
    launched, gemm = [], cute_f1.gemm
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    out = []
    cute_f1.gemm = lambda *a, **k: launched.append(1) or gemm(*a, **k)
    try:
        for _ in range(steps):
            launched.clear()
            opt.zero_grad()
            loss = model(tokens, labels=labels)
            loss.backward()
            torch.cuda.synchronize()
            out.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, len(launched)))
            opt.step()
    finally:
        cute_f1.gemm = gemm
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("compile_", [True, False], ids=["inductor", "eager"])
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_cute_full_ac_recompute_skips_the_down_projection_gemm_bit_for_bit(monkeypatch, precision, compile_):
    """With the cute programs, compiled by inductor (as the 8B comparisons run) or eager (the 8B configs as
    shipped): the recompute launches one F1 GEMM a layer (the out-projection's), not two, and the losses
    and gradients are the old recompute's bits."""
    from coda_titan.titan import fa4 as fa

    if fa.fa4_unavailable_reason():
        pytest.skip(fa.fa4_unavailable_reason())
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        runs = {}
        for arm, tail in (("recompute", "recompute"), ("again", "recompute"), ("skip", "skip")):
            monkeypatch.setenv(recompute.ENV, tail)
            runs[arm] = _gpu_steps(precision, compile_=compile_)
    finally:
        torch.use_deterministic_algorithms(was)
    for (loss, grads, _), (loss_again, grads_again, _) in zip(runs["recompute"], runs["again"]):  # (the control)
        assert torch.equal(loss_again, loss) and all(torch.equal(grads_again[n], g) for n, g in grads.items())
    for step, ((loss, grads, n_old), (loss_new, grads_new, n_new)) in enumerate(zip(runs["recompute"], runs["skip"])):
        if precision == "bf16" or step > 0:  # (fp8's first step calibrates: F1 on e4m3 H runs the reference)
            assert (n_old, n_new) == (4 * 2, 3 * 2)
        assert torch.equal(loss_new, loss)
        for name, g in grads.items():
            assert torch.equal(grads_new[name], g), name
