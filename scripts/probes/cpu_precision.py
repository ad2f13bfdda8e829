"""Probe (CPU): what the precision recipe costs in loss, and how closely CODA tracks stock in each.

    python -m scripts.probes.cpu_precision [--steps 300] [--jobs 2]

Trains the debug pair (``configs/debug_cpu_{baseline,coda}.toml``, seq 256 x batch 4, lr 8e-4, 20 warm-up
steps) through ``coda-titan train`` in three recipes, each as TorchTitan runs it on one device:

* ``fp32``: fp32 parameters and compute (``training.dtype = mixed_precision_param = "float32"``);
* ``amp``:  fp32 parameters under autocast to bf16 (``training.dtype = "float32"``, ``mixed_precision_param =
  "bfloat16"``: fp32 master weights);
* ``bf16``: pure bf16 parameters, gradients and AdamW state (``training.dtype = "bfloat16"``, the GPU configs').

The CPU runs are deterministic, so each pair's deviation is rounding alone, no run-to-run noise. Writes
``$OUT/cpu_precision_<date>.json`` (benchmarks/results without $OUT): every run's per-step losses, and for
every pair of runs the mean absolute relative loss deviation after step 20, the largest, the largest
10-step-mean deviation, and each run's mean loss over its last 50 steps.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from scripts.compare.common import PARITY_SKIP

RECIPES = {"fp32": ("float32", "float32"), "amp": ("float32", "bfloat16"), "bf16": ("bfloat16", "bfloat16")}
MODELS = {"stock": "configs/debug_cpu_baseline.toml", "coda": "configs/debug_cpu_coda.toml"}
SHAPE = dict(seq_len=256, local_batch_size=4, lr=8e-4, warmup_steps=20)


def command(config: str, recipe: str, steps: int, dump: Path) -> list[str]:
    dtype, mixed = RECIPES[recipe]
    return [sys.executable, "-m", "coda_titan.cli", "train", config, "--training.steps", str(steps),
            "--training.seq_len", str(SHAPE["seq_len"]), "--training.local_batch_size", str(SHAPE["local_batch_size"]),
            "--optimizer.lr", str(SHAPE["lr"]), "--lr_scheduler.warmup_steps", str(SHAPE["warmup_steps"]),
            "--training.dtype", dtype, "--training.mixed_precision_param", mixed, "--job.dump_folder", str(dump),
            "--metrics.log_freq", "1", "--metrics.no-enable_wandb", "--metrics.disable_color_printing"]


def summarize(losses: dict[str, list[float]]) -> dict:
    """Each run's last-50 mean and every pair's parity measures (``scripts.compare.parity.parity``, the loss-curve
    pages' own: after step 20; the second named is the reference)."""
    from scripts.compare.parity import parity

    n = {len(ls) for ls in losses.values()}
    if len(n) != 1 or n.pop() <= PARITY_SKIP + 10:
        raise ValueError(f"need curves of one length > {PARITY_SKIP + 10} steps, got {[len(v) for v in losses.values()]}")
    last = {name: sum(ls[-50:]) / len(ls[-50:]) for name, ls in losses.items()}
    keep = ("mean_abs_rel_dev", "max_rel_dev", "max_rel_dev_step", "max_rel_dev_10step_mean")
    pairs = [{"candidate": a, "reference": b, **{k: v for k, v in parity(losses[b], losses[a]).items() if k in keep}}
             for b, a in itertools.combinations(losses, 2)]
    return {"last50_mean": last, "pairs": pairs}


def _train(name: str, config: str, recipe: str, steps: int, work: Path) -> list[float]:
    from scripts.compare.run import parse_log

    proc = subprocess.run(command(str(Path(config).resolve()), recipe, steps, work / name), capture_output=True, text=True, cwd=work,
                          env={**os.environ, "PYTHONPATH": str(Path.cwd())})
    rows = parse_log(proc.stdout + proc.stderr)
    if proc.returncode != 0 or [r["step"] for r in rows] != list(range(1, steps + 1)):
        raise RuntimeError(f"{name} failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    print(f"{name}: {steps} steps, last loss {rows[-1]['loss']:.4f}", flush=True)
    return [r["loss"] for r in rows]


def main(argv=None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--jobs", type=int, default=2, help="runs at a time")
    ap.add_argument("--resummarize", metavar="JSON", help="recompute a written file's pairs from its stored losses")
    args = ap.parse_args(argv)
    if args.resummarize:
        path = Path(args.resummarize)
        doc = json.loads(path.read_text())
        doc.update(summarize({name: r["loss"] for name, r in doc["runs"].items()}))
        doc["resummarized"] = "python -m scripts.probes.cpu_precision --resummarize " + args.resummarize
        path.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {path}")
        return path
    import torch
    import torchtitan

    runs = [(f"{model}_{recipe}", config, recipe) for recipe in RECIPES for model, config in MODELS.items()]
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.jobs) as pool:
        work = Path(tmp)
        futures = {name: pool.submit(_train, name, config, recipe, args.steps, work) for name, config, recipe in runs}
        losses = {name: f.result() for name, f in futures.items()}
    doc = {"kind": "cpu_precision", "device": "CPU", "host": platform.node(), "cpu": platform.processor() or platform.machine(),
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "versions": {"torch": torch.__version__, "torchtitan": getattr(torchtitan, "__version__", "?"),
                        "python": platform.python_version()},
           "command": "python -m scripts.probes.cpu_precision " + " ".join(argv if argv is not None else sys.argv[1:]),
           "steps": args.steps, "shape": SHAPE, "recipes": RECIPES, "models": MODELS,
           "runs": {name: {"config": config, "recipe": recipe, "loss": losses[name]} for name, config, recipe in runs},
           **summarize(losses)}
    out = Path(os.environ.get("OUT", "benchmarks/results"))
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"cpu_precision_{doc['date'][:10]}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    for p in doc["pairs"]:
        print(f"{p['candidate']:>11} vs {p['reference']:<11} mean abs {100 * p['mean_abs_rel_dev']:.3f}%  "
              f"max {100 * p['max_rel_dev']:.3f}% (step {p['max_rel_dev_step']})  "
              f"10-step {100 * p['max_rel_dev_10step_mean']:.3f}%")
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
