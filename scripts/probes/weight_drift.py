"""Probe (GPU): how far the weights of bf16 training runs part, parameter kind by parameter kind, before the first
loss spike: where issue 18's loss-parity miss begins (docs/cute_backend.md, "BF16 loss parity").

    source .gpu/part2/activate.sh && python3 -m scripts.probes.weight_drift --steps 20 40
    python -m scripts.probes.weight_drift --cpu          (the debug pair on the CPU: the machinery, in seconds)

The one-step probe (``bf16_step_accuracy``) starts every model from the same weights, so it cannot see what the
steps before a spike accumulate: at the 1B its CODA step is as close to stock eager's as compile's is, yet CODA's
300-step curves part from stock eager's further. This probe trains each arm (a config, its overrides and its
``CODA_TITAN_*`` switches) from the same init weights and batches, with a checkpoint at each of ``--steps``, and
compares the weights of every arm with those of each reference arm (``--refs``: stock eager, the criterion's
reference, and stock under TorchTitan's AMP, fp32 master weights, the nearer to exact training), per parameter
kind (``attention.wq``, ``feed_forward.w2``, ``ffn_norm``, ``output``, ...; layers pooled) and whole:

* ``rel``: ||W_arm - W_ref|| / ||W_ref||;
* ``per_update`` (every step after the first listed): ||W_arm - W_ref|| over ||W_ref(s) - W_ref(s_prev)||, the
  distance in units of how far the reference itself moved between the two checkpoints.

A second run of one config (the arms' list may name one twice) gives the run-to-run floor of that config (FA4's
backward accumulates in a nondeterministic order). Each arm's per-step losses (and gradient norms: the clip's
divisor) are kept, with the first step at which they differ from each reference's by more than 1e-3 relative.
Writes ``$OUT/probe_weight_drift_<gpu>.json`` after every arm (``--tag T``: ``probe_weight_drift_T_<gpu>.json``),
so a call cut by its time limit keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from coda_titan.kernels import REFERENCE_ENV
from coda_titan.kernels.lm_head_ce import CE_PASS_ENV, F4_ZDZ_ENV
from coda_titan.titan.fa4 import FA4_PACKED_ENV
from scripts.compare.parity import PART, first_parting
from scripts.probes.bf16_step_accuracy import ATTN_PROGRAMS

_BASE, _COMPILED = "configs/llama3_1b_bf16_baseline.toml", "configs/llama3_1b_bf16_baseline_compile.toml"
_CODA = "configs/llama3_1b_bf16_coda_compile.toml"
# name: (config, TorchTitan overrides, environment)
ARMS = {
    "stock_eager": (_BASE, [], {}),
    "stock_compiled": (_COMPILED, [], {}),
    "coda_compiled": (_CODA, [], {}),
    "coda_compiled_ce_exp": (_CODA, [], {CE_PASS_ENV: "exp"}),
    "stock_amp": (_BASE, ["--training.dtype", "float32"], {}),
    # (the one-step probe's bisection arms as training runs: a fix's trajectory checked before it becomes code)
    "coda_compiled_fa4_unpacked": (_CODA, [], {FA4_PACKED_ENV: "0"}),
    "coda_compiled_ref_attn": (_CODA, [], {REFERENCE_ENV: ATTN_PROGRAMS}),
    "coda_compiled_f4zdz_acc": (_CODA, [], {F4_ZDZ_ENV: "acc"}),  # (the LM head's zdz from B2's accumulator: default)
    "coda_compiled_f4zdz_rounded": (_CODA, [], {F4_ZDZ_ENV: "rounded"}),  # (... from the pass: the previous default)
    "coda_compiled_f4zdz_consistent": (_CODA, [], {F4_ZDZ_ENV: "consistent"}),  # (the pass's zdz of its rounded da)
}
CPU_ARMS = {
    "stock": ("configs/debug_cpu_baseline.toml", [], {}),
    "coda": ("configs/debug_cpu_coda.toml", [], {}),
}
DEFAULT = ("stock_eager", "stock_compiled", "coda_compiled", "stock_amp", "stock_eager", "coda_compiled_ce_exp")
CPU_DEFAULT = ("stock", "coda", "stock")
_MODEL_ROOTS = ("tok_embeddings", "layers", "norm", "output")


def kind(name: str) -> str:
    """A parameter's kind: its name without the layer index and the ``.weight``."""
    return re.sub(r"^layers\.\d+\.", "", name).removesuffix(".weight")


def load_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The model's parameters in a TorchTitan checkpoint folder (full or model-only: both keep them flat), on the
    CPU in the dtype saved."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    sd = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in meta.items()
          if isinstance(m, TensorStorageMetadata) and k.split(".")[0] in _MODEL_ROOTS}
    if not sd:
        raise RuntimeError(f"no model parameters in the checkpoint at {folder}")
    dcp.load(sd, checkpoint_id=str(folder))
    return sd


def _sq(a: torch.Tensor, b: torch.Tensor | None = None) -> float:
    """||a - b||^2 (||a||^2 without b), summed in fp64 on the GPU when there is one."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x = a.to(dev, torch.float64)
    if b is not None:
        x -= b.to(dev, torch.float64)
    return float(x.square().sum())


def distances(w: dict, ref: dict, ref_prev: dict | None) -> dict:
    """Per kind and whole: ``rel`` and, given the reference's weights at the checkpoint before, ``per_update``."""
    acc: dict[str, list[float]] = {}
    for n, r in ref.items():
        s = acc.setdefault(kind(n), [0.0, 0.0, 0.0])
        s[0] += _sq(w[n], r)
        s[1] += _sq(r)
        if ref_prev is not None:
            s[2] += _sq(r, ref_prev[n])
    acc["all"] = [sum(v[i] for v in acc.values()) for i in range(3)]
    out = {}
    for k, (d, norm, moved) in acc.items():
        out[k] = {"rel": (d / norm) ** 0.5 if norm else 0.0}
        if ref_prev is not None:
            out[k]["per_update"] = (d / moved) ** 0.5 if moved else None
    return out


def train(config: str, overrides: list, env: dict, steps: list[int], folder: Path,
          timeout: int) -> dict[int, tuple[float, float]]:
    """One run from the config's seed with a checkpoint at each of ``steps`` (their spacing the interval); its
    per-step (loss, gradient norm) from TorchTitan's log (in ``folder/train.log``)."""
    from scripts.compare.common import ROOT
    from scripts.compare.run import parse_log

    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    cmd = [sys.executable, "-m", "coda_titan.cli", "train", str(ROOT / config), "--training.steps", str(steps[-1]),
           "--metrics.log_freq", "1", "--checkpoint.enable", "--checkpoint.interval", str(steps[0]),
           "--checkpoint.folder", "checkpoint", "--job.dump_folder", str(folder), *overrides]
    log = folder / "train.log"
    with open(log, "w") as f:
        subprocess.run(cmd, check=True, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **env}, timeout=timeout)
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in parse_log(log.read_text())}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="How far bf16 runs' weights part, per parameter kind.")
    ap.add_argument("--arms", nargs="+", help=f"arms in order (default {' '.join(DEFAULT)}); one of {', '.join(ARMS)}")
    ap.add_argument("--refs", nargs="+", help="the arms every arm is compared with (default stock_eager stock_amp)")
    ap.add_argument("--steps", type=int, nargs="+", default=[20, 40],
                    help="checkpoints, multiples of the first (before the 1B's first spike at step 44-47)")
    ap.add_argument("--workdir", default="/tmp/weight_drift")
    ap.add_argument("--timeout", type=int, default=900, help="seconds a run may take")
    ap.add_argument("--cpu", action="store_true", help="the debug pair on the CPU (arms stock, coda, stock)")
    ap.add_argument("--tag", default="", help="the file's name: probe_weight_drift_<tag>_<gpu>.json")
    args = ap.parse_args(argv)
    steps = sorted(args.steps)
    if any(s % steps[0] for s in steps):
        ap.error("--steps must be multiples of the first (one checkpoint interval)")
    table = CPU_ARMS if args.cpu else ARMS
    arms = args.arms or list(CPU_DEFAULT if args.cpu else DEFAULT)
    refs = args.refs or (["stock"] if args.cpu else ["stock_eager", "stock_amp"])
    unknown = [a for a in arms + refs if a not in table]
    if unknown:
        ap.error(f"unknown arm(s) {unknown}; known: {', '.join(table)}")

    from scripts.bench.common import header, out_json

    path = out_json("probe_weight_drift" + (f"_{args.tag}" if args.tag else ""), cpu=args.cpu)
    doc = {**header(cpu=args.cpu), "kind": "probe_weight_drift",
           "command": "python -m scripts.probes.weight_drift " + " ".join(sys.argv[1:] if argv is None else argv),
           "steps": steps, "refs": refs, "planned": arms, "parting_threshold": PART, "arms": {}, "distances": {}}
    weights: dict[str, dict[int, dict]] = {}
    losses: dict[str, dict[int, float]] = {}
    names: list[str] = []
    for i, a in enumerate(arms):
        name = a if a not in arms[:i] else f"{a}_{arms[:i].count(a) + 1}"
        names.append(name)
        config, overrides, env = table[a]
        t0 = time.monotonic()
        folder = Path(args.workdir) / name
        logged = train(config, overrides, env, steps, folder, args.timeout)
        losses[name] = {s: v[0] for s, v in logged.items()}
        weights[name] = {s: load_weights(folder / "checkpoint" / f"step-{s}") for s in steps}
        shutil.rmtree(folder / "checkpoint", ignore_errors=True)
        doc["arms"][name] = {"arm": a, "config": config, "overrides": overrides, "env": env,
                             "wall_s": round(time.monotonic() - t0, 1),
                             "losses": {str(s): v for s, v in sorted(losses[name].items())},
                             "grad_norms": {str(s): v[1] for s, v in sorted(logged.items())}}
        _compare(doc, names, weights, losses, refs, steps)
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)
        whole = {r: doc["distances"].get(f"{name}|{r}", {}).get(str(steps[-1]), {}).get("all") for r in refs}
        print(f"{name}: {doc['arms'][name]['wall_s']} s; at step {steps[-1]} against "
              + "; ".join(f"{r} {v}" for r, v in whole.items() if v), flush=True)
    print("wrote", path)


def _compare(doc: dict, names: list[str], weights: dict, losses: dict, refs: list[str], steps: list[int]) -> None:
    """Every pair (arm, reference run) not yet in ``doc``: the reference run is the first run of a ref arm."""
    for ref in (r for r in refs if r in names):
        for n in names:
            key = f"{n}|{ref}"
            if n == ref or key in doc["distances"]:
                continue
            doc["distances"][key] = {str(s): distances(weights[n][s], weights[ref][s],
                                                       weights[ref][steps[i - 1]] if i else None)
                                     for i, s in enumerate(steps)}
            doc["arms"][n].setdefault("parts_from", {})[ref] = first_parting(losses[n], losses[ref])


if __name__ == "__main__":
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    main()
