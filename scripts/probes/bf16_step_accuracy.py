"""Probe (GPU): one bf16 training step's gradients of stock TorchTitan llama3 (eager and compiled) and of
CODA (eager and compiled), each against the same step in fp32, on the 1B at the configs' shapes.

    source .gpu/part2/activate.sh && python3 -m scripts.probes.bf16_step_accuracy
    python -m scripts.probes.bf16_step_accuracy --cpu --models ...   (the debug model on the CPU)

Issue 18's loss-parity criterion asks CODA's deviation from stock eager over 300 steps to be no larger
than stock compiled's. Two bf16 trainings drift apart from the first step's rounding differences on, so
that criterion reads how large each config's per-step perturbation is. This probe measures it directly:
one forward and backward from the same weights on the same tokens (the 1B's init weights in bf16 and
random tokens, seq 8192 x batch 2; with ``--state-steps N`` the weights after N steps of the stock eager
config and the batch its step N + 1 reads) in each of

* ``fp32``: the CODA torch backend in fp32 (TF32 off; SDPA), the reference,
* ``stock_eager``, ``stock_compiled`` (per-block ``torch.compile`` and the compiled loss, as TorchTitan
  compiles them), ``coda_eager``, ``coda_compiled`` (the cute backend as the bf16 configs run it), all with FA4,
* and on request ``torch_eager``: CODA's torch backend in bf16 (SDPA), the same math in the same precision as
  the cute backend, the yardstick of the whole-model GPU test (``tests/test_model.py``); ``torch_eager_fa4``: the
  same with FA4 as stock calls it (the module on contiguous q, k, v: no cute kernel to compile);
  ``torch_eager_fa4_zdz_dgrad`` and ``coda_eager_zdz_dgrad``: with the attention norm's row dot from the dgrad
  (``CODA_TITAN_ZDZ=dgrad``), not B1's sum over the rounded q, k, v; ``torch_eager_fa4_zdz_all``: every norm's
  (``dgrad_all``: the torch backend's B2 takes it from its accumulator); ``torch_eager_fa4_zdz_mlp``: the MLP norm's;
  ``torch_eager_fa4_f4zdz_{exact,target,consistent,consistent_rounded,acc,rounded}``: the final norm's
  (``lm_head_ce``'s ``F4_ZDZ_ENV``; "acc" the default since 2026-11-29, "rounded" the one before),
  ``coda_eager_f4zdz_{consistent,consistent_rounded,acc,rounded}`` and ``coda_f4zdz_acc_compiled``
  the cute F4 so;
* on request, TorchTitan's AMP (``training.dtype = "float32"``: fp32 parameters, the step under autocast to
  bf16, eager): ``stock_amp``, ``coda_amp``, and ``stock_amp_bf16_stream``, stock AMP with its embedding's output
  cast to bf16. Autocast runs stock's residual adds and norms in fp32 (only the linears and attention in bf16),
  so stock AMP's residual stream is fp32; CODA's programs keep it in bf16 in either recipe. The third model
  isolates that difference;
* on request, ``coda_eager_lse_unrounded``: ``coda_eager`` with F4's epilogue as before c6d0abd (its log-sum-exp
  and target logit of the unrounded logits, ``CODA_TITAN_F4_LSE=unrounded``; the cute backend only), so that the
  fix is measured against its predecessor on one trained state in one call;
* on request, ``coda_eager_ce_exp`` and ``coda_ce_exp_compiled``: CODA with F4 without its gradient pass
  (``CODA_TITAN_CE_PASS=exp``: the probabilities rounded, not the logits; the cute backend only);
* on request, the bisection arms of CODA's attention-side gradient error at trained states (the cute backend
  only): ``coda_eager_fa4_unpacked`` (FA4 on contiguous q, k, v, ``CODA_TITAN_FA4_PACKED=0``) and
  ``coda_eager_ref_{f3,b1,b2,wgrad,attn,all}`` (those programs as their torch references on the GPU,
  ``CODA_TITAN_REFERENCE_PROGRAMS``; ``all``: every program but the LM head's).

For each bf16 model and every parameter: the relative error ||g - g_fp32|| / ||g_fp32||, the fraction of
elements whose sign differs from fp32's (AdamW's first update is lr * sign(g), so this is the part of the
first update that moves), and both again against ``stock_eager`` (what the parity criterion compares).
With ``--tensors`` also each layer's residual stream, attention inputs and output and their gradients against fp32's
(``attention_tensors.Recorder``; the file then ends ``_tensors``); ``--tag T`` adds ``_T`` to the name.
Writes ``$OUT/probe_bf16_step_accuracy[_step<N>]_<gpu>.json`` (after each model) with every parameter's numbers and a summary per model:
the median over parameters, the largest, and the whole-model error (all gradients as one vector).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import re
import statistics
import sys
import unittest.mock

import torch
from torchtitan.tools.utils import set_default_dtype

from coda_titan.kernels import PROGRAMS, REFERENCE_ENV
from coda_titan.kernels.lm_head_ce import CE_PASS_ENV, F4_LSE_ENV, F4_ZDZ_ENV
from coda_titan.kernels._common import ZDZ_ENV
from coda_titan.titan.fa4 import FA4_PACKED_ENV

MODELS = ("stock_eager", "stock_compiled", "coda_eager", "coda_compiled")
AMP_MODELS = ("stock_amp", "coda_amp", "stock_amp_bf16_stream")
UNROUNDED = "coda_eager_lse_unrounded"  # (the cute F4 before c6d0abd: CODA_TITAN_F4_LSE=unrounded)
# the cute backend's arms, each an environment variable its kernels read: F4 before c6d0abd, and F4 without its
# gradient pass (CODA_TITAN_CE_PASS=exp), eager and compiled
ENV_ARMS = {UNROUNDED: {F4_LSE_ENV: "unrounded"}, "coda_eager_ce_exp": {CE_PASS_ENV: "exp"},
            "coda_ce_exp_compiled": {CE_PASS_ENV: "exp"}}
# the bisection of CODA's attention-side gradient error at trained states (coda_eager with one piece swapped for
# its torch reference, or FA4 called on contiguous q, k, v as stock calls it): the switches are read when the
# model is built (REFERENCE_ENV) or at each call (FA4_PACKED_ENV), so each arm builds its model under them
ATTN_PROGRAMS = "norm_rope,rope_bwd,norm_residual_bwd,wgrad"  # (the attention side's programs)
TORCH_FA4 = "torch_eager_fa4"  # (the torch backend with FA4 on contiguous q, k, v)
F4_ZDZ_MODES = ("exact", "target", "consistent", "consistent_rounded", "acc", "rounded")  # (``F4_ZDZ_ENV``'s)
ENV_ARMS.update({TORCH_FA4 + suffix: {FA4_PACKED_ENV: "0", **env} for suffix, env in (
    ("", {}), ("_zdz_dgrad", {ZDZ_ENV: "dgrad"}), ("_zdz_all", {ZDZ_ENV: "dgrad_all"}),
    ("_zdz_mlp", {ZDZ_ENV: "dgrad_mlp"}), *((f"_f4zdz_{m}", {F4_ZDZ_ENV: m}) for m in F4_ZDZ_MODES))})
ENV_ARMS.update({f"coda_eager_f4zdz_{m}": {F4_ZDZ_ENV: m} for m in F4_ZDZ_MODES[2:]})
ENV_ARMS.update({"coda_eager_fa4_unpacked": {FA4_PACKED_ENV: "0"}, "coda_eager_zdz_dgrad": {ZDZ_ENV: "dgrad"},
                 "coda_f4zdz_acc_compiled": {F4_ZDZ_ENV: "acc"},
                 "coda_eager_ref_f3": {REFERENCE_ENV: "norm_rope"}, "coda_eager_ref_b1": {REFERENCE_ENV: "rope_bwd"},
                 "coda_eager_ref_b2": {REFERENCE_ENV: "norm_residual_bwd"},
                 "coda_eager_ref_wgrad": {REFERENCE_ENV: "wgrad"},
                 "coda_eager_ref_attn": {REFERENCE_ENV: ATTN_PROGRAMS},
                 "coda_eager_ref_all": {REFERENCE_ENV: ",".join(p for p in PROGRAMS if not p.startswith("lm_head"))}})


@dataclasses.dataclass(frozen=True)
class Setup:
    """What the probe builds: the GPU run's defaults; the CPU test takes a debug flavor, the torch backend, SDPA."""
    flavor: str = "1B"
    seqlen: int = 8192
    batch: int = 2
    device: str = "cuda"
    backend: str = "cute"
    fa4: bool = True


def _stock(s: Setup, compiled: bool, dtype=torch.bfloat16) -> torch.nn.Module:
    from torchtitan.models.llama3 import Transformer, TransformerModelArgs

    from coda_titan.model.args import coda_llama3_args
    from coda_titan.titan.fa4 import swap_attention

    coda = coda_llama3_args[s.flavor]  # (the same shape as CODA's, field for field: TorchTitan's 1B is this)
    args = TransformerModelArgs(**{f.name: getattr(coda, f.name) for f in dataclasses.fields(TransformerModelArgs)
                                   if f.init})
    args = dataclasses.replace(args, max_seq_len=s.seqlen)
    with torch.device(s.device), set_default_dtype(dtype):  # (as TorchTitan's trainer builds it: RoPE stays complex64)
        model = Transformer(args)
        with torch.no_grad():
            model.init_weights()
    if s.fa4:
        swap_attention(model)
    if compiled:
        for name, block in model.layers.named_children():
            model.layers.register_module(name, torch.compile(block, fullgraph=True))
    return model


class _Fp32Attention(torch.nn.Module):
    """The reference's causal attention: k and v repeated to every q head, then SDPA's memory-efficient kernel
    (on CUDA; its math kernel with GQA materializes 16 GiB of fp32 scores a layer at seq 8192)."""

    def forward(self, q, k, v, enable_gqa: bool = False, **_):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if enable_gqa and k.shape[1] != q.shape[1]:
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        backend = SDPBackend.EFFICIENT_ATTENTION if q.is_cuda else SDPBackend.MATH
        with sdpa_kernel([backend]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def _coda(s: Setup, backend: str, dtype=torch.bfloat16, compiled: bool = False, checkpoint: bool = False) -> torch.nn.Module:
    from coda_titan.model.args import coda_llama3_args
    from coda_titan.model.model import CodaTransformer
    from coda_titan.titan.fa4 import swap_attention
    from coda_titan.titan.job_config import Coda

    coda = Coda(backend=backend, tile_n=128, ce_chunk_rows=4096)  # (the bf16 configs' [coda] section)
    args = dataclasses.replace(coda_llama3_args[s.flavor], max_seq_len=s.seqlen, coda=coda)
    with torch.device(s.device), set_default_dtype(dtype):
        model = CodaTransformer(args)
    if backend != "torch" and s.fa4:
        swap_attention(model)
    for name, block in model.layers.named_children():
        if checkpoint:  # (the fp32 reference: 16 layers of fp32 activations at 16,384 tokens do not fit beside it)
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

            block.attention.inner_attention = _Fp32Attention()
            block = checkpoint_wrapper(block, preserve_rng_state=False)
        if compiled:
            block = torch.compile(block, fullgraph=True)
        model.layers.register_module(name, block)
    return model


def _params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Parameters under their TorchTitan names (without the wrappers' prefixes)."""
    strip = re.compile(r"(_orig_mod\.|_checkpoint_wrapped_module\.)")
    return {strip.sub("", n): p for n, p in model.named_parameters()}


def _step(model: torch.nn.Module, weights: dict, tokens, labels, stock: bool, loss_fn=None,
          amp: bool = False) -> tuple[float, dict]:
    """One forward and backward from ``weights`` (copied into the model's parameters, in their dtype); ``amp``:
    under autocast to bf16, the model's forward and its loss, as TorchTitan's trainer runs them."""
    with torch.no_grad():
        for n, p in _params(model).items():
            p.copy_(weights[n])
    with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=amp):
        if stock:
            loss = loss_fn(model(tokens), labels)
        else:
            loss = model(tokens, labels=labels)
    loss.backward()
    grads = {n: p.grad for n, p in _params(model).items()}
    bad = [n for n, g in grads.items() if g is None or not g.isfinite().all()]
    if bad:
        raise AssertionError(f"missing or non-finite gradients in {bad[:3]}")
    return loss.double().item(), grads


def _compare(g: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, float]:
    """(||g - ref||^2, ||ref||^2, fraction of elements whose sign differs where ref is not zero)."""
    d, r = g.double() - ref.double(), ref.double()
    live = ref != 0
    flips = ((torch.sign(g.float()) != torch.sign(ref.float())) & live).sum().item() / max(live.sum().item(), 1)
    return (d * d).sum().item(), (r * r).sum().item(), flips


def _summary(per: dict[str, dict]) -> dict:
    rel = {n: q["err"] for n, q in per.items()}
    flips = {n: q["flips"] for n, q in per.items()}
    worst = max(rel, key=rel.get)
    return {"median_rel": statistics.median(rel.values()), "max_rel": rel[worst], "max_rel_param": worst,
            "whole_rel": (sum(q["d2"] for q in per.values()) / sum(q["r2"] for q in per.values())) ** 0.5,
            "median_flips": statistics.median(flips.values()), "max_flips": max(flips.values())}


def trained_state(s: Setup, config: str, steps: int, workdir: str,
                  sets: tuple[str, ...] = ()) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """The weights after ``steps`` steps of ``config`` and the batch its step ``steps + 1`` reads: the config
    trains in a ``coda-titan train`` process with a checkpoint at ``steps``, the weights come from that checkpoint
    (``weight_drift.load_weights``: its model keys as saved) and the batch from TorchTitan's dataloader for that
    config, its first ``steps`` batches skipped. A run's checkpoint at ``steps`` in ``workdir/checkpoint`` is used as it
    is; otherwise the probe trains in ``workdir/steps<N>``, a dump folder of that step count's own: in a folder
    holding another count's checkpoint, TorchTitan would resume from it (and fail on its model-only last save).
    ``sets``: KEY=VALUE overrides of the config (``training.dtype=bfloat16``), for its run and its loader; the
    folder's name carries them."""
    import subprocess
    import sys
    from pathlib import Path

    from torchtitan.hf_datasets.text_datasets import build_text_dataloader

    from coda_titan.cli import parse_config
    from coda_titan.titan.train_spec import build_tokenizer

    from scripts.compare.run import set_flags

    flags = set_flags(sets)
    tag = "".join(f"_{re.sub(r'[^A-Za-z0-9]+', '_', kv)}" for kv in sets)
    folder, own = Path(workdir) / "checkpoint" / f"step-{steps}", Path(workdir) / f"steps{steps}{tag}"
    if sets or not folder.exists():
        folder = own / "checkpoint" / f"step-{steps}"
    if not folder.exists():
        cmd = [sys.executable, "-m", "coda_titan.cli", "train", config, "--training.steps", str(steps),
               "--checkpoint.enable", "--checkpoint.interval", str(steps), "--checkpoint.folder", "checkpoint",
               "--job.dump_folder", str(own), *flags]
        subprocess.run(cmd, check=True)
    cfg = parse_config(config, flags)
    from scripts.probes.weight_drift import load_weights  # (here: weight_drift imports this module)

    weights = load_weights(folder)  # (the parameters as saved, on the CPU: no model built to name them)
    loader = build_text_dataloader(dp_world_size=1, dp_rank=0, tokenizer=build_tokenizer(cfg), job_config=cfg)
    for i, (inputs, labels) in enumerate(loader):
        if i == steps:
            break
    return {n: w.to(s.device) for n, w in weights.items()}, inputs["input"].to(s.device), labels.to(s.device)


def measure(s: Setup = Setup(), models: tuple[str, ...] = MODELS, state: tuple | None = None,
            done=lambda doc: None, instrument=lambda name, model: None) -> dict:
    """The probe's result document (without the header): losses, per-parameter numbers, summaries. ``state``:
    (weights, tokens, labels) to start from (``trained_state``), else the init weights and random tokens.
    ``done(doc)`` is called after each model (the GPU run writes what it has, in case its call times out);
    ``instrument(name, model)`` after each model is built ("fp32" first), before its step (hooks of a probe
    that reads the step's activations: ``attention_tensors``)."""
    from torchtitan.components.loss import cross_entropy_loss

    for arm in set(models) & set(ENV_ARMS):
        if s.backend != "cute":
            raise ValueError(f"{arm} is an arm of the cute backend's F4 (the GPU); the backend here is {s.backend}")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    if state is None:
        stock0 = _stock(s, False)
        weights = {n: p.detach().to(torch.bfloat16).clone() for n, p in _params(stock0).items()}
        vocab = stock0.model_args.vocab_size
        del stock0
        gen = torch.Generator(device=s.device).manual_seed(1)
        tokens = torch.randint(0, vocab, (s.batch, s.seqlen), generator=gen, device=s.device)
        labels = torch.randint(0, vocab, (s.batch, s.seqlen), generator=gen, device=s.device)
    else:
        weights, tokens, labels = state

    ref = _coda(s, "torch", torch.float32, checkpoint=True)
    instrument("fp32", ref)
    loss_ref, g_ref = _step(ref, {n: w.float() for n, w in weights.items()}, tokens, labels, stock=False)
    g_ref = {n: g.detach().clone() for n, g in g_ref.items()}
    del ref
    _free()
    print(f"fp32 reference: loss {loss_ref:.6f}", flush=True)
    doc = {"model": f"llama3/{s.flavor}", "seq_len": s.seqlen, "local_batch_size": s.batch,
           "reference": ("CODA torch backend, fp32 (TF32 off), SDPA on repeated k, v "
                         "(its memory-efficient kernel on CUDA)"),
           "attention": "fa4" if s.fa4 else "sdpa", "loss": {"fp32": loss_ref}, "params": {}, "summary": {}}
    compiled_loss = torch.compile(cross_entropy_loss)
    g_stock = None
    for name in models:
        stock, compiled, amp = name.startswith("stock"), name.endswith("compiled"), name in AMP_MODELS
        backend = "torch" if name.startswith("torch") else s.backend
        dtype = torch.float32 if amp else torch.bfloat16  # (AMP: fp32 parameters holding the same bf16 values)
        with unittest.mock.patch.dict(os.environ, ENV_ARMS.get(name, {})):  # (the model built under its switches too)
            model = _stock(s, compiled, dtype) if stock else _coda(s, backend, dtype, compiled=compiled)
            if name.startswith(TORCH_FA4):
                from coda_titan.titan.fa4 import swap_attention

                swap_attention(model)
            if name == "stock_amp_bf16_stream":
                model.tok_embeddings.register_forward_hook(lambda mod, args, out: out.to(torch.bfloat16))
            instrument(name, model)
            loss, grads = _step(model, weights, tokens, labels, stock,
                                loss_fn=compiled_loss if compiled else cross_entropy_loss, amp=amp)
        doc["loss"][name] = loss
        per = {n: _entry(g, g_ref[n]) for n, g in grads.items()}
        vs = {} if g_stock is None else {n: _entry(g, g_stock[n]) for n, g in grads.items()}
        if name == "stock_eager":
            g_stock = {n: g.detach().clone() for n, g in grads.items()}
        doc["params"][name] = {"vs_fp32": per, "vs_stock_eager": vs}
        doc["summary"][name] = {"vs_fp32": _summary(per), "vs_stock_eager": _summary(vs) if vs else None,
                                "loss_rel_err": (loss - loss_ref) / abs(loss_ref)}
        print(_line(name, loss, doc["summary"][name]), flush=True)
        done(doc)
        del model, grads
        _free()
    return doc


def _entry(g: torch.Tensor, ref: torch.Tensor) -> dict:
    d2, r2, flips = _compare(g, ref)
    return {"err": (d2 / r2) ** 0.5 if r2 else 0.0, "d2": d2, "r2": r2, "flips": flips}


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _line(name: str, loss: float, s: dict) -> str:
    f, v = s["vs_fp32"], s["vs_stock_eager"]
    line = (f"{name:15} loss {loss:.6f} ({s['loss_rel_err']:+.2e}); vs fp32: whole {f['whole_rel']:.3e} "
            f"median {f['median_rel']:.3e} max {f['max_rel']:.3e} ({f['max_rel_param']}), "
            f"sign flips median {f['median_flips']:.4f}")
    if v:
        line += f"; vs stock eager: whole {v['whole_rel']:.3e} flips median {v['median_flips']:.4f}"
    return line


def main(argv=None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description="One bf16 step's gradients of stock and CODA against fp32.")
    ap.add_argument("--state-steps", type=int, default=0,
                    help="start from the weights after this many steps of --state-config and its next batch "
                         "(0: the init weights and random tokens)")
    ap.add_argument("--state-config", default="configs/llama3_1b_bf16_baseline.toml")
    ap.add_argument("--workdir", default="/tmp/probe_state", help="where that training run and its checkpoint go")
    ap.add_argument("--state-set", nargs="+", default=[], metavar="KEY=VALUE",
                    help="overrides of --state-config (training.dtype=bfloat16: the CPU debug pair trained in bf16)")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=[*MODELS, "torch_eager", *AMP_MODELS, *ENV_ARMS])
    ap.add_argument("--tag", default="", help="the file's name ends _<tag>_<gpu>.json (calls of one session apart)")
    ap.add_argument("--tensors", action="store_true",
                    help="also each layer's residual stream, attention inputs and output, and their gradients, "
                         "against fp32's (``attention_tensors``; the file ends _tensors)")
    ap.add_argument("--cpu", action="store_true", help="the debug model (debugmodel_gqa, seq 256 x batch 4) on the "
                    "CPU, CODA on its torch backend, SDPA; the file goes to $OUT or benchmarks/results as _cpu.json")
    args = ap.parse_args(argv)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # (before CUDA starts)
    from scripts.bench.common import header, out_json

    s = Setup(flavor="debugmodel_gqa", seqlen=256, batch=4, device="cpu", backend="torch", fa4=False) if args.cpu else Setup()
    state = (trained_state(s, args.state_config, args.state_steps, args.workdir, tuple(args.state_set))
             if args.state_steps else None)
    name = ("probe_bf16_step_accuracy" + (f"_step{args.state_steps}" if state else "")
            + ("_amp" if set(args.models) & set(AMP_MODELS) else "") + ("_tensors" if args.tensors else "")
            + (f"_{args.tag}" if args.tag else ""))
    head, path = header(cpu=args.cpu), out_json(name, cpu=args.cpu)
    head = {**head, "kind": "probe_bf16_step_accuracy", "command": "python -m scripts.probes.bf16_step_accuracy "
            + " ".join(sys.argv[1:] if argv is None else argv),
            "state": ({"config": args.state_config, "steps": args.state_steps, "sets": args.state_set} if state
                      else "init")}

    from scripts.probes.attention_tensors import Recorder

    rec = Recorder() if args.tensors else None

    def write(doc: dict) -> None:
        if rec is not None:
            doc = {**doc, "tensors": {"rows": rec.rows, "summary": rec.summary()}}
        with open(path, "w") as f:
            json.dump({**head, **doc}, f, indent=1)

    measure(s, tuple(args.models), state=state, done=write, instrument=rec.attach if rec else lambda name, model: None)
    if rec is not None:
        print(rec.table())
    print("wrote", path)


if __name__ == "__main__":
    main()
