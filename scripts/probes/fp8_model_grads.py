"""Probe (GPU): how far the 1B fp8 model's gradients on the cute backend are from the torch backend's,
per parameter, measured against how far fp8 itself moves them (torch fp8 against torch bf16).

    source .gpu/part2/activate.sh && python3 -m scripts.probes.fp8_model_grads

For each combination of ``fp8_mlp_dgrad`` and ``fp8_mlp_wgrad`` it builds four 1B models with the
same weights (torch fp8, cute fp8, torch fp8 with reordered sums, torch bf16), calibrates the fp8
scales once on the torch backend and hands every fp8 model the same amax histories, then runs one
forward and backward on random tokens (seq 2048 x batch 2). For every parameter it records

* ``dev``: ||g_cute - g_torch|| / ||g_torch|| (backend disagreement),
* ``order``: ||g_reordered - g_torch|| / ||g_torch||: the same fp8 math in the same precisions,
  with every program GEMM summed over K in 256-wide tiles in sequence (``reordered_sums``), as a
  GEMM kernel's K loop does, instead of in cuBLAS's order: how far a correct fp8 model moves when
  only its fp32 summation order changes (a value at an e4m3 rounding boundary lands one step away),
* ``effect``: ||g_bf16 - g_torch|| / ||g_torch|| (what fp8 moves),

and the ratios dev / effect and order / effect, and the step's amax |H| of every fp8 site and amax |da| of every MLP (B3) on both
backends (the current scales of the fp8 weight gradient come from them). The whole-model GPU test (``tests/test_model.py``) calls :func:`grad_ratios`. Writes
``$OUT/probe_fp8_model_grads_<gpu>.json`` with every parameter's numbers and a summary per kind of
weight and, for W1/W3 (the weight gradient ``fp8_mlp_wgrad`` computes on fp8), per layer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import statistics

import torch


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.double(), ref.double()
    return ((a - ref).norm() / ref.norm()).item()


@contextlib.contextmanager
def reordered_sums(tile_k: int = 256):
    """Every program GEMM of the torch backend that goes through ``_common.mm`` or
    ``scaling.fp8_mm`` sums over K tile by tile (fp32 accumulator, ``tile_k`` at a time)."""
    from coda_titan.kernels import gemm, lm_head_ce, norm_residual_bwd, norm_rope, norm_swiglu, residual_rms
    from coda_titan.kernels._common import mm

    def tiled_mm(a, b):
        acc = mm(a[:, :tile_k], b[:tile_k])
        for k in range(tile_k, a.shape[1], tile_k):
            acc = acc + mm(a[:, k:k + tile_k], b[k:k + tile_k])
        return acc

    def tiled_fp8_mm(aq, bq, ct):
        return tiled_mm(aq.to(ct), bq.to(ct).t())

    mods = (gemm, lm_head_ce, norm_residual_bwd, norm_rope, norm_swiglu, residual_rms)
    fp8_mods = tuple(m for m in mods if hasattr(m, "fp8_mm"))
    saved_mm, saved_fp8_mm = {m: m.mm for m in mods}, {m: m.fp8_mm for m in fp8_mods}
    for m in mods:
        m.mm = tiled_mm
    for m in fp8_mods:
        m.fp8_mm = tiled_fp8_mm
    try:
        yield
    finally:
        for m, f in saved_mm.items():
            m.mm = f
        for m, f in saved_fp8_mm.items():
            m.fp8_mm = f


def grad_ratios(mlp_dgrad: bool, mlp_wgrad: bool, seqlen: int = 2048, bs: int = 2, down_proj: bool = False,
                out_proj: bool = False, down_dgrad: bool = False, layer_wgrads: bool = False,
                wgrad_e5m2: bool = True, da_t: bool = False, down_wgrad: bool = False, h_t: bool = False,
                qkv_wgrad: bool = False, out_bwd: bool = False, preact: bool = False) -> dict:
    """Losses and per-parameter (dev, effect) of the cute fp8 model against the torch fp8 one."""
    from coda_titan.model.args import coda_llama3_args
    from coda_titan.model.model import CodaTransformer
    from coda_titan.titan.job_config import Coda

    models = {}
    for name, be, precision in (("torch", "torch", "fp8"), ("cute", "cute", "fp8"), ("reordered", "torch", "fp8"),
                                ("bf16", "torch", "bf16")):
        fp8 = dict(fp8_mlp_dgrad=mlp_dgrad, fp8_mlp_wgrad=mlp_wgrad, fp8_down_proj=down_proj, fp8_out_proj=out_proj,
                   fp8_down_dgrad=down_dgrad, fp8_layer_wgrads=layer_wgrads,
                   fp8_mlp_wgrad_e5m2=wgrad_e5m2, fp8_mlp_da_t=da_t,
                   fp8_down_wgrad=down_wgrad, fp8_mlp_h_t=h_t,
                   fp8_qkv_wgrad=qkv_wgrad, fp8_out_bwd=out_bwd, fp8_preact=preact) if precision == "fp8" else {}  # (the bf16 model: no fp8 knob)
        coda = Coda(backend=be, precision=precision, **fp8)
        args = dataclasses.replace(coda_llama3_args["1B"], max_seq_len=seqlen, coda=coda)
        torch.manual_seed(0)
        with torch.device("cuda"):
            models[name] = CodaTransformer(args)
            with torch.no_grad():
                models[name].init_weights()
        models[name] = models[name].to(torch.bfloat16)
    for name in ("cute", "reordered", "bf16"):
        models[name].load_state_dict(models["torch"].state_dict())
    gen = torch.Generator(device="cuda").manual_seed(1)
    vocab = models["torch"].model_args.vocab_size
    tokens = torch.randint(0, vocab, (bs, seqlen), generator=gen, device="cuda")
    labels = torch.randint(0, vocab, (bs, seqlen), generator=gen, device="cuda")
    ref = models["torch"]
    with torch.no_grad():  # calibration step on the torch backend; both fp8 models then share its history
        ref(tokens, labels=labels)
    if mlp_dgrad or mlp_wgrad:  # and of the gradients (recorded by the next forward)
        ref(tokens, labels=labels).backward()
        ref.zero_grad(set_to_none=True)
        with torch.no_grad():
            ref(tokens, labels=labels)
        for name in ("cute", "reordered"):
            models[name].fp8_scaling.gradient_history.copy_(ref.fp8_scaling.gradient_history)
            models[name].fp8_scaling.gradients_calibrated = True
    for name in ("cute", "reordered"):
        models[name].fp8_scaling.activation_history.copy_(ref.fp8_scaling.activation_history)
        models[name].fp8_scaling.activations_calibrated = True
        for site, calibrated in ref.fp8_scaling.input_calibrated.items():
            models[name].fp8_scaling.input_history(site).copy_(ref.fp8_scaling.input_history(site))
            models[name].fp8_scaling.input_calibrated[site] = calibrated
    losses, grads, amaxes = {}, {}, {}
    for name, model in models.items():
        with reordered_sums() if name == "reordered" else contextlib.nullcontext():
            loss = model(tokens, labels=labels)
            loss.backward()
        losses[name] = loss.float().item()
        grads[name] = {n: p.grad.float() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        if name in ("torch", "cute"):  # this step's amax |H| of every site, and amax |da| of every MLP (B3)
            sink = model.fp8_scaling.sink
            amaxes[name] = {"sites": model.fp8_scaling.activation_history[:, 0].tolist(),
                            "grad": None if sink is None or sink.amaxes() is None else sink.amaxes().tolist()}
        bad = [n for n, g in grads[name].items() if not g.isfinite().all()]
        if bad:
            raise AssertionError(f"{name}: non-finite gradients in {bad[:3]}")
    params = {n: {"dev": _rel(grads["cute"][n], g), "order": _rel(grads["reordered"][n], g),
                  "effect": _rel(grads["bf16"][n], g)} for n, g in grads["torch"].items()}
    for p in params.values():
        p["ratio"] = p["dev"] / max(p["effect"], 1e-12)
        p["order_ratio"] = p["order"] / max(p["effect"], 1e-12)
    del models, grads
    torch.cuda.empty_cache()
    return {"mlp_dgrad": mlp_dgrad, "mlp_wgrad": mlp_wgrad, "down_proj": down_proj, "out_proj": out_proj,
            "down_dgrad": down_dgrad,
            "losses": losses, "params": params,
            "amax": amaxes}


def _kind(name: str) -> str:
    m = re.match(r"layers\.\d+\.(.*)\.weight$", name)
    return m.group(1) if m else name.removesuffix(".weight")


def summary(res: dict) -> dict:
    kinds: dict[str, list[float]] = {}
    for n, p in res["params"].items():
        kinds.setdefault(_kind(n), []).append(p["ratio"])
    worst = max(res["params"], key=lambda n: res["params"][n]["ratio"])
    worst_order = max(res["params"], key=lambda n: res["params"][n]["order_ratio"])
    w13 = {n: round(p["ratio"], 3) for n, p in res["params"].items() if re.search(r"feed_forward\.w[13]\.", n)}
    return {
        "worst": worst, "worst_ratio": res["params"][worst]["ratio"],
        "worst_order": worst_order, "worst_order_ratio": res["params"][worst_order]["order_ratio"],
        "per_kind": {k: {"median": statistics.median(v), "max": max(v), "n": len(v)} for k, v in sorted(kinds.items())},
        "w1_w3_by_layer": w13,
    }


def main() -> None:
    from scripts.bench.common import header

    doc = {**header(), "kind": "probe_fp8_model_grads", "seq_len": 2048, "local_batch_size": 2, "model": "coda_llama3/1B",
           "runs": []}
    for dgrad, wgrad in ((False, False), (True, False), (False, True), (True, True)):
        res = grad_ratios(dgrad, wgrad)
        res["summary"] = summary(res)
        doc["runs"].append(res)
        s = res["summary"]
        print(f"mlp_dgrad {dgrad!s:5} mlp_wgrad {wgrad!s:5}: losses {res['losses']}; worst ratio {s['worst_ratio']:.3f} "
              f"at {s['worst']}; reordered sums: worst {s['worst_order_ratio']:.3f} at {s['worst_order']}", flush=True)
        for k, v in s["per_kind"].items():
            print(f"    {k:28} median {v['median']:.3f} max {v['max']:.3f}", flush=True)
        a = res["amax"]
        rel = lambda u, v: [round(abs(x / y - 1), 4) for x, y in zip(u, v)]  # noqa: E731
        print("    amax |H| per site, cute/torch - 1:", rel(a["cute"]["sites"], a["torch"]["sites"]))
        if a["cute"]["grad"] is not None:
            print("    amax |da| per layer, cute/torch - 1:", rel(a["cute"]["grad"], a["torch"]["grad"]))
        print("    w1/w3 by layer:", " ".join(f"{n.split('.')[1]}.{n.split('.')[3]}={r}" for n, r in s["w1_w3_by_layer"].items()))
    out = os.environ.get("OUT", "outputs")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"probe_fp8_model_grads_{re.sub(r'[^A-Za-z0-9]+', '_', doc['device']).strip('_')}.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
