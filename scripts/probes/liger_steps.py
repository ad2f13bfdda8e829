"""Probe (GPU): does the Liger baseline train as stock llama3 does, over many steps, at a size that runs in seconds?

    source .gpu/part2/activate.sh && python3 -m scripts.probes.liger_steps        (gpu_train.sh ligersteps)

At the 1B (``compare_liger_…2026-12-07.json``) the compiled Liger model started at stock's loss (12.2530 at step 1)
and then trained slower (10.51 against 10.05 at step 10, 6.56 against 4.32 at step 50), while its one-step GPU
test (debug model, eager, whole-model gradient against float64) passed. This probe trains TorchTitan's llama3 debug
model (dim 256, 6 layers, vocab 2048; seq 512 x batch 8) in pure bf16 as the configs do (``training.dtype =
"bfloat16"``), with AdamW as TorchTitan builds it (betas 0.9 / 0.95, weight decay 0.1; lr 1e-3) and its clip (max
norm 1), on learnable tokens (each the previous one's fixed successor, one in four random), from the same initial
weights and the same batches, in arms:

* ``stock`` / ``stock_compile``: llama3, eager / each block compiled as TorchTitan compiles it (fullgraph);
* ``liger`` / ``liger_compile``: ``liger_llama3`` with Liger's three kernels;
* ``liger_compile_torch_<op>``: the compiled Liger model with one kernel as torch's math (the bisection);
* ``liger_compile_outofplace``: Liger's RMSNorm with ``in_place=False`` (its backward's dX in a buffer of its own);
* ``liger_compile_nomix``: inductor's mix-order reductions off (pytorch/pytorch#193061: wrong gradients of chained
  norms under them since torch 2.10);
* ``liger_compile_torch_all``: every kernel as torch's math (the wrapper alone: it must train as stock does).

Each arm's per-step loss and gradient norm; the summary gives each arm's mean loss over the last ten steps beside
``stock_compile``'s, and the first step at which its loss parts from that arm's by more than 2%. Writes
``$OUT/probe_liger_steps_<gpu>.json`` after every arm; the default order runs the compiled pair first, then eager
Liger and stock, then the bisection, so that a call cut short keeps what tells most.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from coda_titan.titan.liger import LigerOps
from scripts.bench.common import header, out_json

OPS = tuple(f.name for f in dataclasses.fields(LigerOps))  # (the kernels an arm may swap for torch's math)
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # (on the CPU: ``--cpu``, the machinery with torch's math)
MIX_ORDER = torch._inductor.config.triton.mix_order_reduction  # (this process's setting, every arm's but ``_nomix``)


def _batches(steps: int, batch: int, seq: int, vocab: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(tokens, labels) per step: token t+1 = successor(token t), one in four replaced by a random token."""
    g = torch.Generator().manual_seed(seed)
    succ = torch.randperm(vocab, generator=g)
    out = []
    for _ in range(steps):
        t = torch.empty(batch, seq + 1, dtype=torch.long)
        t[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
        for i in range(seq):
            t[:, i + 1] = succ[t[:, i]]
            noise = torch.rand(batch, generator=g) < 0.25
            t[noise, i + 1] = torch.randint(0, vocab, (int(noise.sum()),), generator=g)
        out.append((t[:, :-1].to(DEV), t[:, 1:].to(DEV)))
    return out


def _model(cls, args, state):
    from torchtitan.tools.utils import set_default_dtype

    with torch.device(DEV), set_default_dtype(torch.bfloat16):
        model = cls(args)
        with torch.no_grad():
            model.init_weights()  # (as TorchTitan's trainer: the RoPE table too, which the state dict lacks)
    if state is not None:
        model.load_state_dict(state)
    return model


def _liger_ops(name: str):
    """The arm's kernels: Liger's, those named ``_torch_<op>`` (or ``_torch_all``) as torch's math, and for
    ``_outofplace`` Liger's RMSNorm with its backward writing dX to a buffer of its own (``in_place=False``)."""
    from coda_titan.titan import liger

    if name.endswith("_torch_all"):
        return liger.torch_ops()
    return liger.liger_ops(torch_names=[op for op in OPS if name.endswith(f"_torch_{op}")],
                           rms_in_place=not name.endswith("_outofplace"))


def _arm(name: str, args, state, batches, lr: float) -> dict:
    """One arm's run (``_compile``: every block compiled, from a fresh dynamo cache; ``_nomix``: inductor's mix-order
    reductions off, TORCHINDUCTOR_MIX_ORDER_REDUCTION=0)."""
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.models.llama3 import Transformer

    from coda_titan.titan import liger

    is_liger = name.startswith("liger")
    if is_liger:
        liger.OPS = _liger_ops(name)
    model = _model(liger.LigerTransformer if is_liger else Transformer, args, state)
    if "_compile" in name:
        torch._dynamo.reset()
        torch._inductor.config.triton.mix_order_reduction = MIX_ORDER and "_nomix" not in name
        for key, block in model.layers.named_children():
            model.layers.register_module(key, torch.compile(block, fullgraph=True))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)
    losses, norms = [], []
    for tokens, labels in batches:
        opt.zero_grad(set_to_none=True)
        n = labels.numel()
        loss = (model(tokens, labels=labels) if is_liger else cross_entropy_loss(model(tokens), labels)) / n
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
        opt.step()
        losses.append(loss.item())
    liger.OPS = None
    return {"arm": name, "loss": losses, "grad_norm": norms}


def _summary(rows: list[dict], ref: str = "stock_compile") -> list[dict]:
    by = {r["arm"]: r for r in rows}
    if ref not in by:
        return []
    base = by[ref]["loss"]
    out = []
    for r in rows:
        part = next((i + 1 for i, (a, b) in enumerate(zip(r["loss"], base)) if abs(a - b) > 0.02 * abs(b)), None)
        tail = min(10, len(base))
        out.append({"arm": r["arm"], "last10": sum(r["loss"][-tail:]) / tail, f"{ref}_last10": sum(base[-tail:]) / tail,
                    "first_step_2pct_apart": part})
    return out


def main(argv=None) -> None:
    import json

    from torchtitan.models.llama3 import Transformer, llama3_args

    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--cpu", action="store_true", help="the machinery on the CPU: stock and liger_torch_all, 4 steps")
    p.add_argument("--arms", nargs="*", default=["stock_compile", "liger_compile", "liger", "stock",
                                                 *(f"liger_compile_torch_{op}" for op in OPS),
                                                 "liger_compile_outofplace", "liger_compile_nomix",
                                                 "liger_compile_torch_all"])
    a = p.parse_args(argv)
    if a.cpu:
        a.steps, a.arms = min(a.steps, 4), ["stock", "liger_torch_all"]
    args = dataclasses.replace(llama3_args["debugmodel"], max_seq_len=512)
    torch.manual_seed(0)
    state = {k: v.clone() for k, v in _model(Transformer, args, None).state_dict().items()}
    batches = _batches(a.steps, 2 if a.cpu else 8, 512, args.vocab_size)
    doc = {**header(), "model": "debugmodel, seq 512 x batch 8, pure bf16", "steps": a.steps, "lr": a.lr, "arms": []}
    path = out_json("probe_liger_steps", cpu=a.cpu or None)
    for name in a.arms:
        row = _arm(name, args, state, batches, a.lr)
        doc["arms"].append(row)
        doc["summary"] = _summary(doc["arms"], "stock" if a.cpu else "stock_compile")
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)
        seen = [round(row["loss"][i], 4) for i in (0, min(9, len(row["loss"]) - 1), -1)]
        print(json.dumps({"arm": name, "loss@1,10,last": seen}), flush=True)
    for s in doc["summary"]:
        print(json.dumps(s), flush=True)


if __name__ == "__main__":
    main()
