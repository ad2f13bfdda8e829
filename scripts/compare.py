"""Step-time comparison of training configs, a loss-parity mode, and a kernel profile.

    python -m scripts.compare CONFIG.toml [CONFIG.toml ...] [--steps 40] [--warmup 10]
    python -m scripts.compare --loss-curve BASELINE.toml CODA.toml [MORE.toml ...] [--steps 300]
    python -m scripts.compare --profile CONFIG.toml [--steps 20]
    python -m scripts.compare --report          # tables, plots and README from the committed JSON

Every run is a real ``coda-titan train`` in its own process (TorchTitan's Trainer, same data and seed),
with ``metrics.log_freq = 1`` and its own output folder. The numbers are TorchTitan's own metrics as it
prints them each step (loss, peak reserved memory, tokens/s, MFU); the step time is tokens per step /
tokens/s. The first ``--warmup`` steps (compilation, autotuning, allocator growth) are excluded from the
timing; the loss list holds every step. Each run's W&B history is read back from its offline run folder
and checked to hold the loss series.

``--attention fa4|sdpa`` sets the attention of every config (the default keeps what each config says),
so a comparison changes one thing at a time. ``--set KEY=VALUE`` passes a TorchTitan override to every
run (for example ``--set compile.enable=true``).

Results go to ``benchmarks/results/`` (``--out``): ``compare_<gpu>_<date>.json`` (+ ``.png``),
``loss_curve_<gpu>_<date>.json`` (+ ``.png``), ``profile_<config>_<gpu>_<date>.json``. Each JSON
holds the device, date, versions, exactly what was run and the raw per-step values. ``--report``
regenerates the plots and the README section from those files only; no number is typed by hand.
The README section also gets, from the stored loss curves, the run-to-run spread of repeated stock
runs (the noise any parity criterion has to live with) and the step where they disagree most, and,
from the profiles, the GEMM time a CODA config would have left for its speed-up target.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import gzip
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

TARGET_SPEEDUP = 1.20  # CODA tokens/s over the compiled baseline's
TARGET_SPEEDUP_FP8 = 1.25  # CODA fp8 tokens/s over TorchTitan float8 + compile
TARGET_MEMORY = 0.90  # CODA peak memory over the compiled baseline's
PARITY_TOL = 0.01  # relative loss deviation allowed after PARITY_SKIP steps
PARITY_TOL_FP8 = 0.015  # the same, for an fp8 candidate against the float8 baseline
PARITY_SKIP = 20

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_STEP = re.compile(
    r"step:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>\S+)\s+grad_norm:\s*(?P<gn>\S+)\s+"
    r"memory:\s*(?P<mem>[0-9.]+)GiB\((?P<mem_pct>[0-9.]+)%\)\s+tps:\s*(?P<tps>[0-9,]+)\s+"
    r"tflops:\s*(?P<tflops>[0-9.,]+)\s+mfu:\s*(?P<mfu>[0-9.]+)%"
)


# --- parsing -------------------------------------------------------------------------------------


def parse_log(text: str) -> list[dict]:
    """TorchTitan's per-step console metrics, in step order (ANSI colors removed)."""
    rows = {}
    for m in _STEP.finditer(_ANSI.sub("", text)):
        rows[int(m["step"])] = {
            "step": int(m["step"]),
            "loss": float(m["loss"]),  # "nan" / "inf" parse too
            "grad_norm": float(m["gn"]),
            "memory_gib": float(m["mem"]),
            "tps": float(m["tps"].replace(",", "")),
            "tflops": float(m["tflops"].replace(",", "")),
            "mfu": float(m["mfu"]),
        }
    return [rows[s] for s in sorted(rows)]


def summarize(rows: list[dict], warmup: int, tokens_per_step: int) -> dict:
    """Timing over the steps after ``warmup``; loss over all steps."""
    timed = [r for r in rows if r["step"] > warmup]
    if not timed:
        raise ValueError(f"no step after the {warmup} warm-up steps was logged")
    step_s = [tokens_per_step / r["tps"] for r in timed]
    return {
        "steps": len(timed),
        "warmup_steps": warmup,
        "tokens_per_step": tokens_per_step,
        "tokens_per_s": tokens_per_step * len(timed) / sum(step_s),
        "step_ms": 1e3 * statistics.median(step_s),
        "step_ms_raw": [round(1e3 * s, 3) for s in step_s],
        "peak_gib": max(r["memory_gib"] for r in rows),
        "mfu": statistics.fmean(r["mfu"] for r in timed),
        "loss": [r["loss"] for r in rows],
        "first_step": rows[0]["step"],
    }


# --- TOML (the configs are flat tables of scalars and string lists) ------------------------------


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {v!r} to TOML")


def dump_toml(doc: dict, prefix: str = "") -> str:
    out = []
    scalars = {k: v for k, v in doc.items() if not isinstance(v, dict)}
    if scalars:
        if prefix:
            out.append(f"[{prefix}]")
        out += [f"{k} = {_toml_value(v)}" for k, v in scalars.items()]
        out.append("")
    for k, v in doc.items():
        if isinstance(v, dict):
            out.append(dump_toml(v, f"{prefix}.{k}" if prefix else k))
    return "\n".join(out)


def with_attention(doc: dict, attention: str) -> dict:
    """The config with FA4 added to or removed from ``model.converters``."""
    doc = json.loads(json.dumps(doc))
    model = doc.setdefault("model", {})
    conv = [c for c in model.get("converters", []) if c != "fa4"]
    model["converters"] = (conv + ["fa4"]) if attention == "fa4" else conv
    return doc


# --- running -------------------------------------------------------------------------------------


def _load_toml(path: Path) -> dict:
    from coda_titan.cli import _load_toml as load

    return load(path)


def _attention_of(doc: dict) -> str:
    return "fa4" if "fa4" in doc.get("model", {}).get("converters", []) else "sdpa"


def _say(msg: str) -> None:
    print(f"[compare] {msg}", flush=True)


def run_config(config: Path, *, steps: int, workdir: Path, attention: str, sets: list[str], timeout: int, extra=()) -> dict:
    """Train ``config`` for ``steps`` steps in a fresh process; returns the parsed log and run facts."""
    from coda_titan.cli import parse_config

    doc = _load_toml(config)
    if attention != "config":
        doc = with_attention(doc, attention)
    stem = config.stem
    run_dir = workdir / stem
    run_dir.mkdir(parents=True, exist_ok=True)
    derived = run_dir / f"{stem}.toml"  # same stem: the W&B run name stays the config's
    derived.write_text(f"# {config} as run by scripts/compare.py\n" + dump_toml(doc))
    overrides = [
        "--training.steps", str(steps),
        "--metrics.log_freq", "1",
        "--job.dump_folder", str(run_dir / "out"),
        "--checkpoint.no-enable",
    ]
    for kv in sets:
        key, _, value = kv.partition("=")
        if value.lower() in ("true", "false"):
            overrides.append(f"--{key}" if value.lower() == "true" else f"--{key.rsplit('.', 1)[0]}.no-{key.rsplit('.', 1)[1]}")
        else:
            overrides += [f"--{key}", value]
    overrides += list(extra)
    job = parse_config(str(derived), overrides)
    tokens_per_step = job.training.local_batch_size * job.training.seq_len
    cmd = [sys.executable, "-m", "coda_titan.cli", "train", str(derived), *overrides]
    _say(f"{stem}: {steps} steps, attention {_attention_of(doc)}, compile {job.compile.enable} -> {run_dir}/train.log")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("WANDB_SILENT", "true")
    t0 = time.time()
    lines = []
    with open(run_dir / "train.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
        try:
            for line in proc.stdout:
                log.write(line)
                lines.append(line)
                row = parse_log(line)
                if row and (row[0]["step"] % 10 == 0 or row[0]["step"] in (1, steps)):
                    r = row[0]
                    _say(f"  {stem} step {r['step']}/{steps} loss {r['loss']:.4f} tps {r['tps']:,.0f} mem {r['memory_gib']:.1f}GiB")
            proc.wait(timeout=max(1, timeout - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    text = "".join(lines)
    rows = parse_log(text)
    result = {
        "config": os.path.relpath(config, ROOT) if config.is_absolute() else str(config),
        "config_run": dump_toml(doc),
        "overrides": overrides,
        "attention": _attention_of(doc),
        "compile": bool(job.compile.enable),
        "precision": _precision(job),
        "model": f"{job.model.name}/{job.model.flavor}",
        "seq_len": job.training.seq_len,
        "local_batch_size": job.training.local_batch_size,
        "returncode": proc.returncode,
        "wall_s": round(time.time() - t0, 1),
        "rows": rows,
        "tokens_per_step": tokens_per_step,
    }
    if proc.returncode != 0 or len(rows) < steps:
        tail = "".join(lines[-15:])
        result["error"] = f"exit {proc.returncode}, {len(rows)}/{steps} steps logged; log tail:\n{tail}"
        _say(f"{stem} FAILED ({result['error'].splitlines()[0]})")
    result["wandb"] = _wandb_check(run_dir / "out", rows)
    return result


def _precision(job) -> str:
    if any("float8" in c for c in job.model.converters):
        return "fp8"
    if job.model.name == "coda_llama3" and getattr(getattr(job, "coda", None), "precision", "bf16") == "fp8":
        return "fp8"
    return {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}.get(job.training.dtype, job.training.dtype)


def _wandb_check(dump_folder: Path, rows: list[dict]) -> dict:
    """Find the run's W&B folder and check that its history holds the logged loss series."""
    from coda_titan.wandb_history import read_history

    runs = sorted(glob.glob(str(dump_folder / "**" / "wandb" / "*run-*"), recursive=True), key=os.path.getmtime)
    if not runs:
        return {"run_dir": None, "loss_steps": 0, "matches_console": False}
    hist = [h for h in read_history(runs[-1]) if "loss_metrics/global_avg_loss" in h]
    by_step = {int(h["_step"]): h["loss_metrics/global_avg_loss"] for h in hist if "_step" in h}
    console = {r["step"]: r["loss"] for r in rows}
    match = bool(console) and all(
        s in by_step and (abs(by_step[s] - v) <= 1e-4 * max(1.0, abs(v)) or (math.isnan(v) and math.isnan(by_step[s])))
        for s, v in console.items()
    )
    return {"run_dir": runs[-1], "loss_steps": len(hist), "matches_console": match}


def _versions() -> dict:
    from importlib import metadata

    import torch

    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0]}
    for dist in ("torchtitan", "quack-kernels", "nvidia-cutlass-dsl", "flash-attn-4", "torchao", "coda-titan"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    try:
        out["coda_titan_commit"] = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=7"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except Exception:
        out["coda_titan_commit"] = None
    return out


def _device() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", s).strip("_")


def _header(kind: str) -> dict:
    return {
        "kind": kind,
        "device": _device(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "versions": _versions(),
        "command": " ".join(["python -m scripts.compare", *sys.argv[1:]]),
    }


def _out_path(out: Path, kind: str, device: str, date: str, extra: str = "") -> Path:
    return out / f"{kind}_{extra}{_slug(device)}_{date[:10]}.json"


# --- targets -------------------------------------------------------------------------------------


def _baseline_for(config: str) -> str | None:
    stem = Path(config).stem
    if "_coda" not in stem:
        return None
    base, n = re.subn(r"_coda(_compile)?$", "_baseline_compile", stem)
    return base if n else None  # (a variant named otherwise has no target, rather than itself)


def targets(doc: dict) -> list[dict]:
    """CODA vs the compiled stock baseline of the same model (tokens/s and peak memory)."""
    ok = {Path(r["config"]).stem: r for r in doc["runs"] if "error" not in r}
    ran = {Path(r["config"]).stem for r in doc["runs"]}
    out = []
    for r in doc["runs"]:
        base = _baseline_for(r["config"])
        if base is None or base not in ran:  # the compiled baseline was not part of this comparison
            continue
        stem = Path(r["config"]).stem
        b = ok.get(base)
        speedup = TARGET_SPEEDUP_FP8 if r.get("precision") == "fp8" else TARGET_SPEEDUP
        for goal, key, thr, better in (
            (f">= {speedup:.2f}x tokens/s of {base}", "tokens_per_s", speedup, "higher"),
            (f"<= {TARGET_MEMORY:.2f}x peak memory of {base}", "peak_gib", TARGET_MEMORY, "lower"),
        ):
            t = {"config": stem, "baseline": base, "goal": goal, "threshold": thr}
            if b is None or stem not in ok:
                t.update(value=None, met=False, why=f"{base if b is None else stem} has no result in this run")
            else:
                v = ok[stem][key] / b[key]
                t.update(value=round(v, 4), met=(v >= thr) if better == "higher" else (v <= thr))
                if not t["met"]:
                    t["why"] = f"measured {v:.3f}x, target {thr:.2f}x"
            out.append(t)
    return out


# --- modes ---------------------------------------------------------------------------------------


def compare(args) -> Path:
    doc = _header("compare")
    doc.update(tag=args.tag, steps=args.steps, warmup=args.warmup, attention=args.attention, sets=args.set, runs=[])
    for cfg in args.configs:
        r = run_config(Path(cfg), steps=args.warmup + args.steps, workdir=Path(args.workdir), attention=args.attention,
                       sets=args.set, timeout=args.timeout)
        rows = r.pop("rows")
        if "error" not in r:
            r.update(summarize(rows, args.warmup, r["tokens_per_step"]))
        else:
            r["loss"] = [x["loss"] for x in rows]
        doc["runs"].append(r)
    doc["precision"] = "+".join(sorted({r["precision"] for r in doc["runs"]}))
    refresh(doc)  # targets
    path = _out_path(Path(args.out), "compare", doc["device"], doc["date"], extra=f"{args.tag}_" if args.tag else "")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(compare_table(doc))
    plot_compare(doc, path.with_suffix(".png"))
    _say(f"wrote {path} and {path.with_suffix('.png').name}")
    return path


def parity(a: list[float], b: list[float], skip: int = PARITY_SKIP, tol: float = PARITY_TOL) -> dict:
    """Largest |b - a| / |a| over the steps after ``skip`` (1-based steps), and NaN checks."""
    n = min(len(a), len(b))
    devs = [abs(b[i] - a[i]) / abs(a[i]) for i in range(skip, n)]
    worst = max(range(len(devs)), key=lambda i: devs[i]) if devs else None
    nan_a = any(not math.isfinite(x) for x in a)
    nan_b = any(not math.isfinite(x) for x in b)
    window = 10
    smooth = [
        abs(sum(b[i - window + 1:i + 1]) - sum(a[i - window + 1:i + 1])) / abs(sum(a[i - window + 1:i + 1]))
        for i in range(max(skip, window - 1), n)
    ]
    return {
        "compared_steps": len(devs),
        "after_step": skip,
        "mean_abs_rel_dev": statistics.fmean(devs) if devs else None,
        "steps_over_tolerance": sum(d > tol for d in devs),
        "max_rel_dev_10step_mean": max(smooth) if smooth else None,
        "max_rel_dev": max(devs) if devs else None,
        "max_rel_dev_step": (worst + skip + 1) if worst is not None else None,
        "non_finite": {"baseline": nan_a, "candidate": nan_b},
        "tolerance": tol,
        "met": bool(devs) and max(devs) <= tol and not nan_a and not nan_b and len(a) == len(b),
    }


def loss_curve(args) -> Path:
    doc = _header("loss_curve")
    doc.update(tag=args.tag, steps=args.steps, attention=args.attention, sets=args.set, runs=[])
    for cfg in args.configs:
        r = run_config(Path(cfg), steps=args.steps, workdir=Path(args.workdir), attention=args.attention,
                       sets=args.set, timeout=args.timeout)
        r["loss"] = [x["loss"] for x in r.pop("rows")]
        doc["runs"].append(r)
    doc["precision"] = "+".join(sorted({r["precision"] for r in doc["runs"]}))
    refresh(doc)  # parity of each candidate against the first run
    path = _out_path(Path(args.out), "loss_curve", doc["device"], doc["date"], extra=f"{args.tag}_" if args.tag else "")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    plot_loss_curve(doc, path.with_suffix(".png"))
    for p in doc["parity"]:
        _say(f"{p['candidate']} vs {p['baseline']}: max relative loss deviation after step {p['after_step']}: "
             f"{p['max_rel_dev']} (step {p['max_rel_dev_step']}), tolerance {p['tolerance']}: {'met' if p['met'] else 'MISSED'}")
    _say(f"wrote {path}")
    return path


def summarize_trace(trace_path: str, top: int = 25) -> dict:
    """GPU kernel time by kernel name from a chrome trace (one profiled step)."""
    events = json.loads(Path(trace_path).read_text())["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    total = sum(e["dur"] for e in kernels)
    by_name: dict[str, list] = {}
    for e in kernels:
        by_name.setdefault(e["name"], []).append(e["dur"])
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))
    cats: dict[str, float] = {}
    for name, durs in by_name.items():
        cats[kernel_category(name)] = cats.get(kernel_category(name), 0.0) + sum(durs)
    span = (max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)) if kernels else 0
    return {
        "gpu_kernel_ms": total / 1e3,
        "gpu_span_ms": span / 1e3,
        "kernel_launches": len(kernels),
        **idle_gaps(events, kernels),
        "categories_ms": {k: round(v / 1e3, 3) for k, v in sorted(cats.items(), key=lambda kv: -kv[1])},
        "top_kernels": [
            {"name": n[:160], "category": kernel_category(n), "ms": round(sum(d) / 1e3, 3), "calls": len(d),
             "pct": round(100 * sum(d) / total, 2)}
            for n, d in ranked[:top]
        ],
    }


SYNC_CALLS = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy"}


def idle_gaps(events: list[dict], kernels: list[dict], top: int = 10) -> dict:
    """Where the GPU waited for the host: the time inside the step's kernel span covered by no
    kernel, its largest intervals with the kernels on both sides and the CPU ops running at the
    interval's middle (the host work the GPU waited for), and the blocking CUDA runtime calls."""
    ivs = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in kernels)
    gaps, end, prev = [], None, None
    for t0, t1, name in ivs:
        if end is not None and t0 > end:
            gaps.append((t0 - end, end, t0, prev, name))
        if end is None or t1 > end:
            end, prev = t1, name
    cpu = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation", "python_function") and "dur" in e]
    runtime = [e for e in events if e.get("cat") == "cuda_runtime" and "dur" in e]
    lo, hi = (ivs[0][0], end) if ivs else (0, 0)
    syncs = [e for e in runtime if lo <= e["ts"] <= hi and e["name"] in SYNC_CALLS]
    tops = []
    for dur, g0, g1, before, after in sorted(gaps, reverse=True)[:top]:
        mid = (g0 + g1) / 2
        host = sorted((e for e in cpu + runtime if e["ts"] <= mid <= e["ts"] + e["dur"]), key=lambda e: e["dur"])
        tops.append({"us": round(dur, 1), "after_kernel": before[:100], "before_kernel": after[:100],
                     "host_ops": [e["name"][:100] for e in host[:4]]})
    return {
        "gpu_idle_ms": round(sum(g[0] for g in gaps) / 1e3, 3),
        "gpu_idle_intervals": len(gaps),
        "blocking_runtime_calls": {"count": len(syncs), "ms": round(sum(e["dur"] for e in syncs) / 1e3, 3),
                                   "names": sorted({e["name"] for e in syncs})},
        "top_idle": tops,
        "allocator_calls": _allocator_calls(runtime, lo, hi),
    }


ALLOC_CALLS = ("Malloc", "Free", "MemMap", "MemUnmap", "MemCreate", "MemRelease", "MemSetAccess", "MemAddressReserve")


def _allocator_calls(runtime: list[dict], lo: float, hi: float) -> dict:
    """CUDA runtime/driver memory calls inside the step's kernel span: name -> [count, ms]. The
    caching allocator makes them only when it has to grow or give back memory; each can stall the host
    (cudaFree synchronizes the device)."""
    out: dict[str, list] = {}
    for e in runtime:
        if lo <= e["ts"] <= hi and any(k in e["name"] for k in ALLOC_CALLS):
            c = out.setdefault(e["name"], [0, 0.0])
            c[0] += 1
            c[1] = round(c[1] + e["dur"] / 1e3, 3)
    return out


def kernel_category(name: str) -> str:
    n = name.lower()
    if "flash" in n or "fmha" in n or "attention" in n or "flashattn" in n:
        return "attention"
    if any(s in n for s in ("epi", "quack", "gemmsm90", "gemm_sm90", "cutlass_cute", "kernel_cutlass")) and "gemm" in n:
        return "coda/quack gemm+epilogue"
    if any(s in n for s in ("gemm", "sm90_xmma", "cublas", "nvjet", "cutlass")):
        return "gemm (cuBLAS/other)"
    if "triton" in n:
        return "triton (inductor)"
    if "adam" in n or "foreach" in n or "multi_tensor" in n:
        return "optimizer"
    if "nccl" in n:
        return "communication"
    if any(s in n for s in ("elementwise", "reduce", "vectorized", "copy", "cat", "index", "softmax", "norm")):
        return "elementwise/reduction (eager)"
    return "other"


def profile(args) -> Path:
    doc = _header("profile")
    cfg = Path(args.configs[0])
    steps = args.steps
    extra = ["--profiling.enable_profiling", "--profiling.profile_freq", str(steps),
             "--profiling.profiler_warmup", "3", "--profiling.profiler_active", "1"]
    r = run_config(cfg, steps=steps, workdir=Path(args.workdir), attention=args.attention, sets=args.set,
                   timeout=args.timeout, extra=extra)
    rows = r.pop("rows")
    traces = sorted(glob.glob(str(Path(args.workdir) / cfg.stem / "out" / "**" / "rank0_trace.json"), recursive=True))
    if not traces:
        raise SystemExit(f"no profiler trace was written for {cfg}: {r.get('error', '')}")
    doc.update(config=r["config"], run=r, profiled_step=steps, summary=summarize_trace(traces[-1]))
    doc["run"]["loss"] = [x["loss"] for x in rows]
    path = _out_path(Path(args.out), "profile", doc["device"], doc["date"], extra=f"{cfg.stem}_")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    if getattr(args, "keep_trace", False):
        kept = path.with_name(f"trace_{cfg.stem}.json.gz")
        with open(traces[-1], "rb") as src, gzip.open(kept, "wb", compresslevel=6) as dst:
            shutil.copyfileobj(src, dst)
        _say(f"kept the trace as {kept} ({kept.stat().st_size / 2**20:.1f} MiB)")
    print(profile_table(doc))
    _say(f"wrote {path}")
    return path


# --- tables, plots, README -----------------------------------------------------------------------


def _f(v, nd=1, suffix=""):
    return "n/a" if v is None else f"{v:,.{nd}f}{suffix}"


def compare_table(doc: dict) -> str:
    base = {Path(r["config"]).stem: r for r in doc["runs"] if "error" not in r}
    what = f"**{doc['tag']}** · " if doc.get("tag") else ""
    if doc.get("sets"):
        what += "overrides: " + ", ".join(f"`{kv}`" for kv in doc["sets"]) + " · "
    if doc.get("attention", "config") != "config":
        what += f"attention forced to {doc['attention']} · "
    lines = [
        f"{what}Device: {doc['device']} · {doc['date'][:10]} · torch {doc['versions'].get('torch')} · "
        f"quack {doc['versions'].get('quack-kernels')} · flash-attn-4 {doc['versions'].get('flash-attn-4')} · "
        f"{doc['steps']} timed steps after {doc['warmup']} warm-up steps · precision {doc.get('precision', 'bf16')} · "
        f"seq {doc['runs'][0]['seq_len']} × local batch {doc['runs'][0]['local_batch_size']}",
        "",
        "| config | attention | tokens/s | step ms (median) | peak GiB | MFU % | vs compiled baseline | final loss |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in doc["runs"]:
        stem = Path(r["config"]).stem
        if "error" in r:
            lines.append(f"| {stem} | {r['attention']} | failed: {r['error'].splitlines()[0]} | | | | | |")
            continue
        # (a variant such as <model>_coda_compile_<what> is set against the same compiled baseline)
        name, n = re.subn(r"_(coda|baseline)(_compile)?(_[a-z0-9_]+)?$", "_baseline_compile", stem)
        ref = base.get(name) if n else None
        ratio = f"{r['tokens_per_s'] / ref['tokens_per_s']:.3f}x" if ref else "n/a"
        lines.append(
            f"| {stem} | {r['attention']} | {_f(r['tokens_per_s'], 0)} | {_f(r['step_ms'])} | {_f(r['peak_gib'], 2)} | "
            f"{_f(r['mfu'], 1)} | {ratio} | {r['loss'][-1]:.4f} |"
        )
    if doc.get("targets"):
        lines += ["", "| target | measured | met |", "|---|---:|:---:|"]
        for t in doc["targets"]:
            lines.append(f"| {t['config']}: {t['goal']} | {_f(t['value'], 3, 'x')} | {'yes' if t['met'] else 'no'} |")
    return "\n".join(lines)


def profile_table(doc: dict, top: int = 12) -> str:
    s = doc["summary"]
    lines = [
        f"Profile of `{Path(doc['config']).stem}` step {doc['profiled_step']} on {doc['device']}: "
        f"{s['gpu_kernel_ms']:.1f} ms of GPU kernel time in {s['kernel_launches']} launches "
        f"(span {s['gpu_span_ms']:.1f} ms).",
        "",
    ]
    if "gpu_idle_ms" in s:
        b = s["blocking_runtime_calls"]
        lines += [f"GPU idle inside the span: {s['gpu_idle_ms']:.1f} ms in {s['gpu_idle_intervals']} intervals; "
                  f"blocking CUDA runtime calls: {b['count']} ({b['ms']:.1f} ms).", ""]
    lines += [
        "| category | ms | share |",
        "|---|---:|---:|",
    ]
    for k, v in s["categories_ms"].items():
        lines.append(f"| {k} | {v:.1f} | {100 * v / s['gpu_kernel_ms']:.1f}% |")
    cats = s["categories_ms"]
    if not any("coda" in k for k in cats):  # a stock run: what no fusion of the rest can remove
        floor = sum(cats.get(k, 0.0) for k in ("gemm (cuBLAS/other)", "attention", "optimizer"))
        lines += ["", f"GEMMs + attention + optimizer take {floor:.1f} ms of this step's {s['gpu_kernel_ms']:.1f} ms: "
                  f"a program that fuses away everything else but runs its GEMMs at cuBLAS speed is at most "
                  f"{s['gpu_kernel_ms'] / floor:.3f}x faster than this step."]
    if s.get("top_idle"):
        lines += ["", "| largest GPU idle (us) | after kernel | host op running meanwhile |", "|---:|---|---|"]
        for g in s["top_idle"][:5]:
            host = " / ".join(g["host_ops"][:2]).replace("|", "/") or "n/a"
            lines.append(f"| {g['us']:.0f} | `{g['after_kernel'][:50].replace('|', '/')}` | {host[:90]} |")
    lines += ["", "| top kernel | category | calls | ms | share |", "|---|---|---:|---:|---:|"]
    for k in s["top_kernels"][:top]:
        name = k["name"].replace("|", "/")
        name = name if len(name) <= 70 else name[:67] + "..."
        lines.append(f"| `{name}` | {k['category']} | {k['calls']} | {k['ms']:.2f} | {k['pct']:.1f}% |")
    return "\n".join(lines)


def parity_table(doc: dict) -> str:
    tol = f"{100 * max((q.get('tolerance', PARITY_TOL) for q in doc['parity']), default=PARITY_TOL):g}%"
    lines = [
        f"Loss parity on {doc['device']} ({doc['date'][:10]}): {doc['steps']} steps, same data and seed; "
        f"largest relative loss deviation from `{Path(doc['runs'][0]['config']).stem}` after step {PARITY_SKIP}.",
        "",
        f"| candidate | max rel. deviation | at step | steps over {tol} | mean abs. deviation | max over 10-step means | "
        f"non-finite loss | every step within {tol} |",
        "|---|---:|---:|---:|---:|---:|:---:|:---:|",
    ]
    pct = lambda v: "n/a" if v is None else f"{100 * v:.2f}%"  # noqa: E731
    for q in doc["parity"]:
        lines.append(
            f"| {q['candidate']} | {pct(q['max_rel_dev'])} | {q['max_rel_dev_step']} | {q['steps_over_tolerance']} of "
            f"{q['compared_steps']} | {pct(q['mean_abs_rel_dev'])} | {pct(q['max_rel_dev_10step_mean'])} | "
            f"{'yes' if q['non_finite']['candidate'] else 'no'} | {'yes' if q['met'] else 'no'} |"
        )
    return "\n".join(lines)


GROUPS = {
    "GEMM (incl. fused epilogues)": ("coda/quack gemm+epilogue", "gemm (cuBLAS/other)"),
    "attention": ("attention",),
    "elementwise / norms / losses outside GEMMs": ("triton (inductor)", "elementwise/reduction (eager)"),
    "optimizer": ("optimizer",),
    "other": ("other", "communication"),
}


def profile_side_by_side(docs: list[dict]) -> str:
    """GPU time of one profiled step per group of kernels, for each profiled config."""
    names = [Path(d["config"]).stem for d in docs]
    lines = ["GPU kernel time of one profiled step, ms (`--profile`):", "",
             "| kernels | " + " | ".join(names) + " |", "|---|" + "---:|" * len(docs)]
    for group, cats in GROUPS.items():
        vals = [sum(d["summary"]["categories_ms"].get(c, 0.0) for c in cats) for d in docs]
        lines.append(f"| {group} | " + " | ".join(f"{v:.1f}" for v in vals) + " |")
    lines.append("| total | " + " | ".join(f"{d['summary']['gpu_kernel_ms']:.1f}" for d in docs) + " |")
    lines.append("| span: first to last kernel (total + GPU idle) | "
                 + " | ".join(f"{d['summary']['gpu_span_ms']:.1f}" for d in docs) + " |")
    return "\n".join(lines)


def budget_lines(docs: list[dict]) -> list[str]:
    """For each profiled CODA config whose compiled baseline was profiled too: the GEMM time left to
    reach the speed-up target, given the time CODA spends outside GEMMs (attention, elementwise,
    optimizer, GPU idle), against the time the baseline's GEMMs take."""
    by_stem = {Path(d["config"]).stem: d for d in docs}
    gemm = lambda d: sum(d["summary"]["categories_ms"].get(c, 0.0) for c in GROUPS["GEMM (incl. fused epilogues)"])  # noqa: E731
    out = []
    for stem, d in by_stem.items():
        base = by_stem.get(_baseline_for(d["config"]) or "")
        if base is None:
            continue
        target = TARGET_SPEEDUP_FP8 if d["run"].get("precision") == "fp8" else TARGET_SPEEDUP  # as targets()
        need = base["summary"]["gpu_span_ms"] / target
        rest = d["summary"]["gpu_span_ms"] - gemm(d)
        left = need - rest
        verdict = ("less than" if left < gemm(base) else "at least") + " what the baseline's GEMMs take"
        out.append(
            f"For {target:.2f}x over `{Path(base['config']).stem}` the span of `{stem}` would have to be "
            f"{need:.1f} ms. Outside its GEMMs (attention, elementwise, optimizer, GPU idle) it spends "
            f"{rest:.1f} ms, which leaves {left:.1f} ms for every GEMM of the step, {verdict} "
            f"({gemm(base):.1f} ms; CODA's take {gemm(d):.1f} ms now).")
    return out


# --- run-to-run spread of the stored loss curves -----------------------------------------------------


def _cohort(doc: dict, run: dict) -> str:
    """Runs with the same device, step count, data, seed, optimizer and schedule see the same batches."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    t = tomllib.loads(run["config_run"])
    same = {k: t.get(k) for k in ("training", "optimizer", "lr_scheduler", "debug")}
    return json.dumps({"device": doc["device"], "steps": len(run["loss"]), **same}, sort_keys=True)


def loss_runs(paths: list[Path] | None = None) -> list[dict]:
    """Every run of every stored loss curve (``archive/`` included), tagged with its file."""
    if paths is None:
        paths = sorted(RESULTS.glob("loss_curve_*.json")) + sorted(RESULTS.glob("archive/loss_curve_*.json"))
    out = []
    for p in paths:
        doc = json.loads(Path(p).read_text())
        for r in doc["runs"]:
            out.append({
                "file": Path(p).name if Path(p).parent.name != "archive" else f"archive/{Path(p).name}",
                "config": Path(r["config"]).stem,
                "stock": "\nname = \"coda_llama3\"" not in r["config_run"],
                "precision": r.get("precision", "bf16"),
                "cohort": _cohort(doc, r),
                "loss": r["loss"],
            })
    return out


def repeat_spread(runs: list[dict]) -> list[dict]:
    """Stock configs trained more than once in one cohort: the parity statistics of every pair of
    repeats. Same config, data, seed and code, so they measure run-to-run nondeterminism alone."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        if r["stock"]:
            groups.setdefault((r["cohort"], r["config"]), []).append(r)
    out = []
    for (_, config), rs in groups.items():
        if len(rs) < 2:
            continue
        tol = PARITY_TOL_FP8 if rs[0]["precision"] == "fp8" else PARITY_TOL
        pairs = [parity(a["loss"], b["loss"], tol=tol) for i, a in enumerate(rs) for b in rs[i + 1:]]
        worst = max(pairs, key=lambda q: q["max_rel_dev"])
        out.append({
            "config": config, "runs": len(rs), "pairs": len(pairs), "tolerance": tol,
            "max_rel_dev": worst["max_rel_dev"], "max_rel_dev_step": worst["max_rel_dev_step"],
            "min_pair_max_rel_dev": min(q["max_rel_dev"] for q in pairs),
            "steps_over_tolerance": (min(q["steps_over_tolerance"] for q in pairs),
                                     max(q["steps_over_tolerance"] for q in pairs)),
            "compared_steps": worst["compared_steps"],
            "mean_abs_rel_dev": (min(q["mean_abs_rel_dev"] for q in pairs), max(q["mean_abs_rel_dev"] for q in pairs)),
            "pairs_within_tolerance": sum(q["met"] for q in pairs),
            "max_rel_dev_10step_mean": max(q["max_rel_dev_10step_mean"] for q in pairs),
        })
    return out


def fragile_step(runs: list[dict], skip: int = PARITY_SKIP) -> dict | None:
    """The step after ``skip`` where the stock runs of the largest cohort disagree most (relative
    range of their losses), with every run's loss of that cohort at that step."""
    cohorts: dict[str, list[dict]] = {}
    for r in runs:
        cohorts.setdefault(r["cohort"], []).append(r)
    rs = max(cohorts.values(), key=len, default=[])
    stock = [r for r in rs if r["stock"]]
    if len(stock) < 2:
        return None
    n = min(len(r["loss"]) for r in rs)
    spread = lambda i: (max(r["loss"][i] for r in stock) - min(r["loss"][i] for r in stock)) / min(r["loss"][i] for r in stock)  # noqa: E731
    i = max(range(skip, n), key=spread)
    return {"step": i + 1, "stock_rel_range": spread(i), "stock_runs": len(stock),
            "losses": sorted(({"file": r["file"], "config": r["config"], "stock": r["stock"], "loss": r["loss"][i]}
                              for r in rs), key=lambda e: e["loss"])}


def spread_tables(runs: list[dict]) -> str:
    pct = lambda v: f"{100 * v:.2f}%"  # noqa: E731
    lines = []
    rep = repeat_spread(runs)
    if rep:
        lines += [
            "Run-to-run spread of the stock baselines: every pair of repeated runs of one stock config (same "
            "data, seed, code and GPU; every stored loss curve, `archive/` included).",
            "",
            "| config | runs | largest max deviation (step) | smallest max deviation | steps over tolerance | "
            "mean abs. deviation | largest max over 10-step means | pairs within tolerance |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for q in rep:
            lo, hi = q["steps_over_tolerance"]
            mlo, mhi = q["mean_abs_rel_dev"]
            lines.append(
                f"| {q['config']} | {q['runs']} | {pct(q['max_rel_dev'])} ({q['max_rel_dev_step']}) | "
                f"{pct(q['min_pair_max_rel_dev'])} | {lo}-{hi} of {q['compared_steps']} (over {100 * q['tolerance']:g}%) | "
                f"{pct(mlo)}-{pct(mhi)} | {pct(q['max_rel_dev_10step_mean'])} | {q['pairs_within_tolerance']} of {q['pairs']} |")
        lines.append("")
    f = fragile_step(runs)
    if f:
        lines += [
            f"The step where the {f['stock_runs']} stock runs of these curves disagree most is step {f['step']} "
            f"(their losses span {pct(f['stock_rel_range'])}). Every stored run's loss there:",
            "",
            "| loss | config | stock | file |",
            "|---:|---|:---:|---|",
        ]
        for e in f["losses"]:
            lines.append(f"| {e['loss']:.3f} | {e['config']} | {'yes' if e['stock'] else 'no'} | `{e['file']}` |")
        lines.append("")
    return "\n".join(lines).rstrip()


def plot_compare(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in doc["runs"] if "error" not in r]
    if not runs:
        _say("no run succeeded: no chart")
        return
    names = [Path(r["config"]).stem.replace("llama3_", "") for r in runs]
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.6 * len(runs) + 2))
    colors = ["tab:orange" if "coda" in n else "tab:gray" for n in names]
    panels = (("tokens_per_s", "{:,.0f}", 1.18, "tokens/s (higher is better)"),
              ("peak_gib", "{:.1f}", 1.15, "peak reserved memory, GiB (lower is better)"))
    for ax, (key, fmt, margin, label) in zip(axes, panels):
        values = [r[key] for r in runs]
        ax.barh(names, values, color=colors)
        for i, v in enumerate(values):
            ax.text(v, i, " " + fmt.format(v), va="center", fontsize=8)
        ax.set_xlim(0, margin * max(values))
        ax.set_xlabel(label)
        ax.invert_yaxis()
    axes[1].set_yticklabels([])
    fig.suptitle(f"{doc['device']}, {doc['date'][:10]}: {doc['steps']} timed steps per config")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_loss_curve(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(9, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    for r in doc["runs"]:
        axes[0].plot(range(1, len(r["loss"]) + 1), r["loss"], label=Path(r["config"]).stem, lw=1)
    axes[0].set_ylabel("loss")
    axes[0].legend()
    a = doc["runs"][0]["loss"]
    for r in doc["runs"][1:]:
        b = r["loss"]
        n = min(len(a), len(b))
        axes[1].plot(range(1, n + 1), [100 * (b[i] - a[i]) / abs(a[i]) for i in range(n)], lw=1,
                     label=f"{Path(r['config']).stem} vs {Path(doc['runs'][0]['config']).stem}")
    tol = max((p.get("tolerance", PARITY_TOL) for p in doc.get("parity", [])), default=PARITY_TOL)
    axes[1].axhline(100 * tol, ls="--", color="k", lw=0.7)
    axes[1].axhline(-100 * tol, ls="--", color="k", lw=0.7)
    axes[1].axvline(PARITY_SKIP, ls=":", color="k", lw=0.7)
    axes[1].set_ylabel("rel. diff %")
    axes[1].set_xlabel("step")
    axes[1].legend(fontsize=7)
    fig.suptitle(f"Loss curves on {doc['device']} ({doc['date'][:10]}), same data and seed")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _latest(kind: str) -> list[Path]:
    """Newest result file of ``kind`` per device (and per config, for profiles)."""
    best: dict[str, Path] = {}
    for p in sorted(RESULTS.glob(f"{kind}_*.json")):
        key = re.sub(r"_\d{4}-\d{2}-\d{2}\.json$", "", p.name)
        best[key] = p  # sorted by name: the later date wins
    return sorted(best.values(), key=lambda p: (len(p.name), p.name))  # untagged (the 1B set) first


def readme_section() -> str:
    parts = []
    for p in _latest("compare"):
        doc = json.loads(p.read_text())
        parts += [compare_table(doc), "", f"![step-time comparison](benchmarks/results/{p.with_suffix('.png').name})", ""]
    for p in _latest("loss_curve"):
        doc = json.loads(p.read_text())
        parts += [parity_table(doc), "", f"![loss curves](benchmarks/results/{p.with_suffix('.png').name})", ""]
    spread = spread_tables(loss_runs())
    if spread:
        parts += [spread, ""]
    profiles = [json.loads(p.read_text()) for p in _latest("profile")]
    if len(profiles) > 1:
        parts += [profile_side_by_side(profiles), ""]
        for line in budget_lines(profiles):
            parts += [line, ""]
    for doc in profiles:
        parts += [profile_table(doc), ""]
    return "\n".join(parts).rstrip()


def refresh(doc: dict) -> dict:
    """Recompute the derived fields (targets, parity) of a result from its raw per-step values."""
    if doc["kind"] == "compare":
        doc["targets"] = targets(doc)
    elif doc["kind"] == "loss_curve":
        ref = doc["runs"][0]
        doc["parity"] = [
            {"baseline": Path(ref["config"]).stem, "candidate": Path(r["config"]).stem,
             **parity(ref["loss"], r["loss"], tol=PARITY_TOL_FP8 if r.get("precision") == "fp8" else PARITY_TOL)}
            for r in doc["runs"][1:]
        ]
    return doc


def report() -> None:
    for kind in ("compare", "loss_curve"):
        for p in _latest(kind):
            doc = refresh(json.loads(p.read_text()))
            p.write_text(json.dumps(doc, indent=1) + "\n")
            (plot_compare if kind == "compare" else plot_loss_curve)(doc, p.with_suffix(".png"))
    from scripts.report import update_readme

    update_readme(readme_section(), name="compare", heading="Training comparison (one H100)")
    _say("README comparison section regenerated from benchmarks/results")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("configs", nargs="*", help="TOML configs, run in this order")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--loss-curve", action="store_true", help="train configs on the same data and seed; losses vs the first")
    mode.add_argument("--profile", action="store_true", help="profile one step of one config (torch profiler)")
    mode.add_argument("--report", action="store_true", help="regenerate plots and README from the committed JSON")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (compare: 40), total steps (loss curve: 300, profile: 20)")
    ap.add_argument("--warmup", type=int, default=10, help="steps excluded from timing (compare)")
    ap.add_argument("--attention", choices=["config", "fa4", "sdpa"], default="config")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="TorchTitan override for every run")
    ap.add_argument("--out", default=str(RESULTS), help="where result JSON and PNG go")
    ap.add_argument("--workdir", default=str(ROOT / "outputs" / "compare"), help="run folders (logs, W&B, traces)")
    ap.add_argument("--tag", default="", help="name part of the result file (compare_<tag>_<gpu>_<date>.json, loss_curve_<tag>_...)")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per run")
    ap.add_argument("--keep-trace", action="store_true", help="profile: also write the chrome trace, gzipped, next to the JSON")
    args = ap.parse_args(argv)
    if args.report:
        report()
        return 0
    if not args.configs:
        ap.error("name at least one config")
    for c in args.configs:
        if not Path(c).is_file():
            ap.error(f"config {c!r} not found")
    for kv in args.set:
        if "=" not in kv:
            ap.error(f"--set takes KEY=VALUE, got {kv!r}")
    from coda_titan.cli import UserError

    try:
        return _run_mode(ap, args)
    except UserError as e:  # a config the schema refuses: before any run starts
        print(f"compare: error: {e}", file=sys.stderr)
        return 2


def _run_mode(ap, args) -> int:
    if args.loss_curve:
        if len(args.configs) < 2:
            ap.error("--loss-curve takes two or more configs: the reference first, then the candidates")
        args.steps = args.steps or 300
        loss_curve(args)
    elif args.profile:
        if len(args.configs) != 1:
            ap.error("--profile takes one config")
        args.steps = args.steps or 20
        profile(args)
    else:
        args.steps = args.steps or 40
        path = compare(args)
        failed = [r["config"] for r in json.loads(path.read_text())["runs"] if "error" in r]
        if failed:
            _say(f"failed runs: {', '.join(failed)}")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
