"""Running one config in its own process and reading its log; the step-time comparison mode.
"""

from __future__ import annotations

import contextlib
import glob
import json
import math
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from scripts.compare import common, gpu_clocks
from scripts.compare.common import ROOT, _attention_of, _header, _load_toml, _out_path, _say, _slug, dump_toml, with_attention


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


_STEP = re.compile(
    r"step:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>\S+)\s+grad_norm:\s*(?P<gn>\S+)\s+"
    r"memory:\s*(?P<mem>[0-9.]+)GiB\((?P<mem_pct>[0-9.]+)%\)\s+tps:\s*(?P<tps>[0-9,]+)\s+"
    r"tflops:\s*(?P<tflops>[0-9.,]+)\s+mfu:\s*(?P<mfu>[0-9.]+)%"
)


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
    """Timing over the steps after ``warmup``; loss over all steps. Each logged row's tokens/s is TorchTitan's
    mean over the steps since the row before (``metrics.log_freq`` of them: a window), so each window's
    step time weighs by its steps in the total (tokens/s); the median is over the windows."""
    timed = [(r, r["step"] - prev["step"]) for prev, r in zip([{"step": 0}, *rows], rows) if r["step"] > warmup]
    if not timed:
        raise ValueError(f"no step after the {warmup} warm-up steps was logged")
    step_s = [tokens_per_step / r["tps"] for r, _ in timed]
    steps = sum(w for _, w in timed)
    return {
        "steps": steps,
        "warmup_steps": warmup,
        "tokens_per_step": tokens_per_step,
        "tokens_per_s": tokens_per_step * steps / sum(s * w for s, (_, w) in zip(step_s, timed)),
        "step_ms": 1e3 * statistics.median(step_s),
        "step_ms_raw": [round(1e3 * s, 3) for s in step_s],
        **({"step_ms_steps": [r["step"] for r, _ in timed]} if any(w != 1 for _, w in timed) else {}),
        "peak_gib": max(r["memory_gib"] for r in rows),
        "mfu": statistics.fmean(r["mfu"] for r, _ in timed),
        "loss": [r["loss"] for r in rows],
        "first_step": rows[0]["step"],
    }


def launch_command(derived: Path, overrides: list[str], nproc: int = 1, entry=("-m", "coda_titan.cli")) -> list[str]:
    """The training command: ``coda_titan.cli train`` in one process, or under torchrun on ``nproc``
    processes of this host (FSDP2 over all of them unless the overrides set the data-parallel
    degrees), with only rank 0's output (its tokens/s is per GPU, as TorchTitan logs it). ``entry``:
    the module that takes ``train CONFIG OVERRIDES`` (a probe's wrapper of ``coda_titan.cli``)."""
    train = [*entry, "train", str(derived), *overrides]
    if nproc == 1:
        return [sys.executable, *train]
    if not any(o.startswith("--parallelism.data_parallel_") for o in overrides):
        train += ["--parallelism.data_parallel_shard_degree", str(nproc)]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
            "--local-ranks-filter", "0", *train]


def logged_steps(steps: int, log_freq: int) -> list[int]:
    """The steps TorchTitan logs in a run of ``steps`` steps: the first and every ``log_freq``-th."""
    return [s for s in range(1, steps + 1) if s == 1 or s % log_freq == 0]


def _overrides(steps: int, run_dir: Path, sets: list[str], extra, log_freq: int = 1) -> list[str]:
    """TorchTitan's command-line overrides of a comparison run: its steps, a metrics line every ``log_freq``
    steps (each line's ``.item()`` calls wait for the GPU), its folder, no checkpoints, then ``--set``
    KEY=VALUE pairs (booleans as TorchTitan's flags) and ``extra``."""
    overrides = [
        "--training.steps", str(steps),
        "--metrics.log_freq", str(log_freq),
        "--job.dump_folder", str(run_dir / "out"),
        "--checkpoint.no-enable",
    ]
    return overrides + set_flags(sets) + list(extra)


def set_flags(sets) -> list[str]:
    """``--set`` KEY=VALUE pairs as TorchTitan's command-line flags (booleans as its ``--key`` / ``--no-key``)."""
    flags = []
    for kv in sets:
        key, _, value = kv.partition("=")
        if value.lower() in ("true", "false"):
            flags.append(f"--{key}" if value.lower() == "true" else f"--{key.rsplit('.', 1)[0]}.no-{key.rsplit('.', 1)[1]}")
        else:
            flags += [f"--{key}", value]
    return flags


def _phase_entry(phase_log: Path, env_extra: dict | None) -> tuple[tuple[str, ...], dict]:
    """The entry and environment of a run whose Trainer ``scripts.probes.step_phases`` wraps, logging to ``phase_log``."""
    from scripts.probes import step_phases

    phase_log.unlink(missing_ok=True)
    return ("-m", "scripts.probes.step_phases", "child"), {**(env_extra or {}), step_phases.ENV_LOG: str(phase_log)}


def switches(env) -> dict[str, str]:
    """The coda_titan switches a run's kernels read from its environment (``CODA_TITAN_CE_PASS=exp`` say: an A/B's
    arm its config does not name); the compile cache's folder is not one."""
    return {k: v for k, v in sorted(env.items()) if k.startswith("CODA_TITAN_") and k != "CODA_TITAN_CACHE"}


def allocator(env) -> str | None:
    """The caching allocator's settings a run's environment gives it (``PYTORCH_CUDA_ALLOC_CONF``, or its newer
    name ``PYTORCH_ALLOC_CONF``; TorchTitan's ``run_train.sh`` sets ``expandable_segments:True``), None when unset."""
    return env.get("PYTORCH_CUDA_ALLOC_CONF") or env.get("PYTORCH_ALLOC_CONF") or None


def run_config(config: Path, *, steps: int, workdir: Path, attention: str, sets: list[str], timeout: int, extra=(),
               nproc: int = 1, entry=("-m", "coda_titan.cli"), env_extra=None, clocks: bool = False,
               phases: bool = False, log_freq: int = 1) -> dict:
    """Train ``config`` for ``steps`` steps in a fresh process (``nproc`` > 1: under torchrun);
    returns the parsed log and run facts (``clocks``: also the GPU's clock samples and each step
    line's arrival time, for :func:`gpu_clocks.over_steps`; ``phases``, one process only: TorchTitan's
    Trainer wrapped by ``scripts.probes.step_phases``, and each step's host phases as ``phase_rows``)."""
    from coda_titan.cli import parse_config

    doc = _load_toml(config)
    if attention != "config":
        doc = with_attention(doc, attention)
    stem = config.stem
    run_dir = workdir / stem
    run_dir.mkdir(parents=True, exist_ok=True)
    derived = run_dir / f"{stem}.toml"  # same stem: the W&B run name stays the config's
    derived.write_text(f"# {config} as run by python -m scripts.compare\n" + dump_toml(doc))
    overrides = _overrides(steps, run_dir, sets, extra, log_freq)
    job = parse_config(str(derived), overrides)
    tokens_per_step = job.training.local_batch_size * job.training.seq_len
    phase_log = run_dir / "phases.jsonl" if phases and nproc == 1 else None
    if phase_log is not None:
        entry, env_extra = _phase_entry(phase_log, env_extra)
    cmd = launch_command(derived, overrides, nproc, entry)
    _say(f"{stem}: {steps} steps, attention {_attention_of(doc)}, compile {job.compile.enable}"
         f"{f', {nproc} processes' if nproc > 1 else ''} -> {run_dir}/train.log")
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env_extra or {}))
    env.setdefault("WANDB_SILENT", "true")
    t0 = time.time()
    sampling = gpu_clocks.ClockSampler() if clocks else contextlib.nullcontext()
    # (line-buffered: a run cut short by a time limit keeps its log up to there)
    with open(run_dir / "train.log", "w", buffering=1) as log, sampling as sampler:
        proc, lines, step_times = _follow(cmd, env, log, stem, steps, t0 + timeout)
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
        "switches": switches(env),
        "allocator": allocator(env),
    }
    if clocks:
        result.update(clock_samples=sampler.samples, step_times=step_times)
    if phase_log is not None and phase_log.exists():
        logged = [json.loads(line) for line in phase_log.read_text().splitlines()]
        result["phase_rows"] = [r for r in logged if "alloc_streams" not in r]
        for r in logged:  # (scripts.probes.alloc_streams: after the last step)
            if "alloc_streams" in r:
                result["alloc_streams"] = r["alloc_streams"]
    expected = len(logged_steps(steps, log_freq))
    if proc.returncode != 0 or len(rows) < expected:
        tail = "".join(lines[-15:])
        late = f" (killed at the {timeout} s timeout)" if result["wall_s"] >= timeout and proc.returncode else ""
        result["error"] = f"exit {proc.returncode}{late}, {len(rows)}/{expected} step lines logged; log tail:\n{tail}"
        _say(f"{stem} FAILED ({result['error'].splitlines()[0]})")
    result["wandb"] = _wandb_check(run_dir / "out", rows)
    return result


def _follow(cmd: list[str], env: dict, log, stem: str, steps: int, deadline: float):
    """Run ``cmd``, each output line into ``log`` and every 10th step's line onto the console, until it exits or
    ``deadline`` (``time.time()``) passes, when it is killed; returns (the finished process, its lines, each step
    line's arrival time by step)."""
    lines, step_times = [], {}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    # (the read below blocks while the run prints nothing, a tile sweep or a hang: the deadline kills it there too)
    watchdog = threading.Timer(max(1.0, deadline - time.time()), proc.kill)
    watchdog.daemon = True
    watchdog.start()
    try:
        for line in proc.stdout:
            log.write(line)
            lines.append(line)
            row = parse_log(line)
            if row:
                step_times[row[0]["step"]] = time.time()
            if row and (row[0]["step"] % 10 == 0 or row[0]["step"] in (1, steps)):
                r = row[0]
                _say(f"  {stem} step {r['step']}/{steps} loss {r['loss']:.4f} tps {r['tps']:,.0f} mem {r['memory_gib']:.1f}GiB")
        proc.wait(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    finally:
        watchdog.cancel()
    return proc, lines, step_times


def _precision(job) -> str:
    if any("float8" in c for c in job.model.converters):
        return "fp8"
    if job.model.name == "coda_llama3" and getattr(getattr(job, "coda", None), "precision", "bf16") == "fp8":
        return "fp8"
    if job.training.dtype == "float32" and job.training.mixed_precision_param == "bfloat16":
        return "bf16-amp"  # (fp32 master weights, bf16 compute: TorchTitan's AMP on one device, FSDP2's mixed precision)
    return {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}.get(job.training.dtype, job.training.dtype)


def _wandb_check(dump_folder: Path, rows: list[dict]) -> dict:
    """Find the run's W&B folder and check that its history holds the logged loss series."""
    from scripts.compare.wandb_history import read_history

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
    # the console's memory is the allocator's reserved peak; W&B also has the peak of live tensors
    active = {str(int(h["_step"])): h["memory/max_active(GiB)"] for h in hist if "_step" in h and "memory/max_active(GiB)" in h}
    return {"run_dir": runs[-1], "loss_steps": len(hist), "matches_console": match, "max_active_gib": active}


def step_ms_of(rows: list[dict], tokens_per_step: int) -> dict[int, float]:
    """Each logged step's time (ms) from its tokens/s, by step number."""
    return {r["step"]: 1e3 * tokens_per_step / r["tps"] for r in rows}


def host_phases(phase_rows: list[dict], rows: list[dict], warmup: int, tokens_per_step: int) -> dict:
    """The host's time per training step by phase (``scripts.probes.step_phases``) over the timed steps:
    each phase's median, and each step over its median step with the phases it grew in (ms)."""
    from scripts.probes.step_phases import slow_steps

    step_ms = step_ms_of(rows, tokens_per_step)
    return slow_steps([{**p, "step_ms": step_ms.get(p["step"])} for p in phase_rows], warmup)


def peak_active(wandb: dict, warmup: int) -> dict:
    """The peak of live tensors (W&B's ``memory/max_active``) over the timed steps and over the warm-up
    steps (which hold compilation and autotuning), or {} when the run's W&B history lacks it."""
    active = {int(k): v for k, v in (wandb or {}).get("max_active_gib", {}).items()}
    timed = [v for k, v in active.items() if k > warmup]
    first = [v for k, v in active.items() if k <= warmup]
    return {"peak_active_gib": max(timed), "peak_active_gib_warmup": max(first) if first else None} if timed else {}


def floor_files(device: str, date: str, dirs, archived: bool = False) -> list[tuple[Path, dict]]:
    """(path, doc) of every floor file (``scripts.bench.floor``) of this device and day in ``dirs``,
    in that order, the newest name first within a folder; with ``archived``, then those kept in
    benchmarks/results/archive under a session's name (``floor_<session>_<gpu>_<day>.json``)."""
    name = f"{_slug(device)}_{date[:10]}.json"
    archive = common.RESULTS / "archive"  # (read at the call: the tests point it elsewhere)
    globs = [(Path(d), f"floor_{name}") for d in dirs] + ([(archive, f"floor_*{name}")] if archived else [])
    out = []
    for d, pattern in globs:
        for p in sorted(d.glob(pattern), reverse=True):
            f = json.loads(p.read_text())
            if f["device"] == device:
                out.append((p, f))
    return out


def _floor_name(p: Path) -> str:
    """A floor file's name as the tables cite it: ``archive/<name>`` for an archived one."""
    return f"archive/{p.name}" if p.parent == common.RESULTS / "archive" else p.name


def same_lease_floor(doc: dict, out: Path) -> dict | None:
    """The step floor (``scripts.bench.floor``) measured in this lease (the same ``host_id``: machine and
    boot) for this model shape, before this run, found in ``out`` or benchmarks/results (or its archive,
    once a later floor of that day took the name): its file and its
    floor ms per precision, or None (the tables then say n/a). A floor of the same GPU and day from
    another host is not this lease's: hosts differ by several percent."""
    seq, bs = doc["runs"][0].get("seq_len"), doc["runs"][0].get("local_batch_size")
    for p, f in floor_files(doc["device"], doc["date"], (out, common.RESULTS), archived=True):
        if "totals" not in f:  # (a floor run cut short: its GEMM rows stand, it has no floor to judge a step by)
            continue
        if doc.get("host") and f.get("host") == doc["host"] and (f["seq_len"], f["local_batch_size"]) == (seq, bs):
            capped = {k: v["capped_floor_ms"] for k, v in f["totals"].items() if "capped_floor_ms" in v}
            return {"file": _floor_name(p), "host": f["host"], **{k: v["floor_ms"] for k, v in f["totals"].items()},
                    **({"capped": capped} if capped else {})}
    return None


def compare(args) -> Path:
    from scripts.report.training import compare_table, plot_compare, refresh  # (here: the report imports this package)

    doc = _header("compare")
    doc.update(tag=args.tag, steps=args.steps, warmup=args.warmup, attention=args.attention, sets=args.set, runs=[],
               nproc=getattr(args, "nproc", 1), log_freq=getattr(args, "log_freq", 1))
    for cfg in args.configs:
        r = run_config(Path(cfg), steps=args.warmup + args.steps, workdir=Path(args.workdir), attention=args.attention,
                       nproc=getattr(args, "nproc", 1), sets=args.set, timeout=args.timeout, clocks=True, phases=True,
                       log_freq=getattr(args, "log_freq", 1))
        rows = r.pop("rows")
        phase_rows = r.pop("phase_rows", None)
        gpu = gpu_clocks.over_steps(r.pop("clock_samples"), r.pop("step_times"), args.warmup)
        if gpu:
            r["gpu_clocks"] = gpu
        if "error" not in r:
            r.update(summarize(rows, args.warmup, r["tokens_per_step"]))
            r.update(peak_active(r.get("wandb"), args.warmup))
            if phase_rows:
                r["host_phases"] = host_phases(phase_rows, rows, args.warmup, r["tokens_per_step"])
        else:
            r["loss"] = [x["loss"] for x in rows]
        doc["runs"].append(r)
    doc["precision"] = "+".join(sorted({r["precision"] for r in doc["runs"]}))
    path = _out_path(Path(args.out), "compare", doc["device"], doc["date"], extra=f"{args.tag}_" if args.tag else "")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")  # the runs first: nothing after them may lose them
    try:
        doc["floor"] = same_lease_floor(doc, Path(args.out))
        refresh(doc)  # targets
    except Exception as e:  # (the runs stand; ``python -m scripts.compare --report`` derives the rest again)
        doc["derive_error"] = f"{type(e).__name__}: {e}"[:500]
        _say(f"the runs are written; deriving the floor and targets failed: {doc['derive_error']}")
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(compare_table(doc))
    if getattr(args, "no_plot", False):
        _say(f"wrote {path} (no plot: the report draws it)")
        return path
    plot_compare(doc, path.with_suffix(".png"))
    _say(f"wrote {path} and {path.with_suffix('.png').name}")
    return path
