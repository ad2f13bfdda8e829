"""Probe (GPU): how much of a training step the GPU spends waiting for the host in the forward, without
a profiler.

    source .gpu/part2/activate.sh && python3 -m scripts.probes.host_slack [--config C.toml] [--sleep-ms 0 30]
        [--set coda.cuda_graphs=true ...] [--steps 30 --warmup 10]

Why: the profiled CODA fp8 step (docs/results.md) showed 64 ms of GPU idle in its forward, charged to
host launches, where the bf16 one showed 2 ms; the profiler's own host work inflates such gaps, and the
timed steps run about 16 ms longer than the profiled step's kernels. Every step starts with an empty
GPU queue (TorchTitan copies the batch with a synchronizing ``.to(device)``), so where the host enqueues
the forward slower than the GPU runs it, the GPU waits.

Method: the same config trains once per ``--sleep-ms`` value; each forward of the model first enqueues
``torch.cuda._sleep`` for that long on the GPU (cycles calibrated with CUDA events), which lets the host
run that far ahead. With host-bound idle X in the forward, a sleep S >= X lengthens the step by S - X
only; so X = S - (step(S) - step(0)). Each forward also records host and GPU (CUDA event) time from
its start (after the sleep) to the LM head's entry: the blocks' host time against their GPU span.

Each forward also counts the allocator's cudaMalloc / cudaFree calls and retries inside it
(``torch.cuda.memory_stats``), and with ``--sync-debug`` the synchronizing calls torch warns of, by
their innermost frame outside torch: what can make the host wait for the GPU inside a forward.

Writes ``$OUT/probe_host_slack_<gpu>.json`` (benchmarks/results without $OUT): per arm the median
step, the estimate X, and the per-step host / GPU forward times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ENV_SLEEP = "CODA_TITAN_PROBE_SLEEP_MS"
ENV_LOG = "CODA_TITAN_PROBE_LOG"
ENV_CPROFILE = "CODA_TITAN_PROBE_CPROFILE_FORWARD"  # the training forward (1-based) whose host time cProfile splits
ENV_SYNC_DEBUG = "CODA_TITAN_PROBE_SYNC_DEBUG"  # "1": torch's sync debug mode; each forward counts the syncs it warns of
ALLOC_STATS = ("num_device_alloc", "num_device_free", "num_alloc_retries")  # (torch.cuda.memory_stats, per forward)


def _cprofile_rows(prof, top: int = 40) -> dict:
    """The profiled forward's host time by function: the ``top`` by own time and by cumulative time."""
    import pstats

    st = pstats.Stats(prof)
    rows = [{"where": f"{Path(f).name}:{line}({fn})" if f != "~" else fn, "calls": nc, "own_ms": 1e3 * tt,
             "cum_ms": 1e3 * ct} for (f, line, fn), (_, nc, tt, ct, _) in st.stats.items()]
    return {"total_ms": 1e3 * st.total_tt,
            "by_own": sorted(rows, key=lambda r: -r["own_ms"])[:top],
            "by_cum": sorted(rows, key=lambda r: -r["cum_ms"])[:top]}


def _sync_sources(state: dict) -> None:
    """Count, per forward, the synchronizing calls torch's sync debug mode warns of, by their innermost
    frame outside torch (``state["syncs"]``, filled only while a forward is open)."""
    import traceback
    import warnings

    import torch

    torch.cuda.set_sync_debug_mode("warn")
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return shown(message, category, filename, lineno, file, line)
        if state["open"] is not None and "head_event" not in state["open"]:
            frames = [f for f in traceback.extract_stack()[:-1]
                      if "/torch/" not in f.filename and Path(f.filename).name != "warnings.py"]
            where = f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "?"
            state["syncs"][where] = state["syncs"].get(where, 0) + 1

    warnings.showwarning = show
    warnings.simplefilter("always", UserWarning)


def _install(sleep_ms: float, log_path: str, cprofile_forward: int = 0, sync_debug: bool = False) -> None:
    """Wrap the CODA model's forward and its LM head's (the child process)."""
    import cProfile

    import torch

    from coda_titan.model import model as m

    state = {"cycles_per_ms": None, "open": None, "rows": [], "forwards": 0, "prof": None, "syncs": {}}
    if sync_debug:
        _sync_sources(state)

    def alloc_stats() -> dict:
        stats = torch.cuda.memory_stats()
        return {k: stats.get(k, 0) for k in ALLOC_STATS}

    def cycles_per_ms() -> float:
        if state["cycles_per_ms"] is None:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(1000)
            a.record()
            torch.cuda._sleep(50_000_000)
            b.record()
            b.synchronize()
            state["cycles_per_ms"] = 50_000_000 / a.elapsed_time(b)
        return state["cycles_per_ms"]

    def flush() -> None:
        """Read the previous forward's events (long done) and append its row."""
        pending = state["open"]
        if pending is None or "head_event" not in pending:
            return
        state["open"] = None
        row = {"host_fwd_ms": 1e3 * (pending["head_t"] - pending["t0"]),
               "gpu_fwd_ms": pending["event"].elapsed_time(pending["head_event"]),
               **{k: pending["head_alloc"][k] - pending["alloc"][k] for k in ALLOC_STATS}}
        if sync_debug:
            row["syncs"], state["syncs"] = state["syncs"], {}
        state["rows"].append(row)
        with open(log_path, "a") as f:
            f.write(json.dumps(row) + "\n")

    model_forward, head_forward = m.CodaTransformer.forward, m.LMHead.forward

    def forward(self, tokens, *args, **kwargs):
        if tokens.is_cuda and self.training:
            flush()
            state["forwards"] += 1
            if state["forwards"] == cprofile_forward:
                state["prof"] = cProfile.Profile()
                state["prof"].enable()
            if sleep_ms > 0:
                torch.cuda._sleep(int(sleep_ms * cycles_per_ms()))
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            state["open"] = {"t0": time.perf_counter(), "event": ev, "alloc": alloc_stats()}
        return model_forward(self, tokens, *args, **kwargs)

    def head(self, *args, **kwargs):
        pending = state["open"]
        if pending is not None and "head_event" not in pending:
            pending["head_t"] = time.perf_counter()
            pending["head_alloc"] = alloc_stats()
            pending["head_event"] = torch.cuda.Event(enable_timing=True)
            pending["head_event"].record()
            if state["prof"] is not None:
                state["prof"].disable()
                Path(log_path).with_suffix(".cprofile.json").write_text(json.dumps(_cprofile_rows(state["prof"])))
                state["prof"] = None
        return head_forward(self, *args, **kwargs)

    m.CodaTransformer.forward, m.LMHead.forward = forward, head


def child(argv: list[str]) -> int:
    """``train CONFIG OVERRIDES`` as ``coda_titan.cli`` takes them, with the probe's wrappers installed."""
    _install(float(os.environ.get(ENV_SLEEP, "0")), os.environ[ENV_LOG], int(os.environ.get(ENV_CPROFILE, "0")),
             os.environ.get(ENV_SYNC_DEBUG) == "1")
    from coda_titan.cli import main as cli_main

    return cli_main(argv)


def split_by_log(rows: list[dict], warmup: int, steps: int, log_freq: int, skip: int = 0) -> dict:
    """The timed forwards' medians in two parts: ``after_log``, the forwards that follow a logged step (its
    metrics line's ``.item()`` waited for the GPU, so they start on an empty queue), and ``between_logs``.
    ``rows[i]`` is forward i + 1; the first ``warmup`` and forward ``skip`` (cProfile's) are left out."""
    from scripts.compare.run import logged_steps

    logged = set(logged_steps(steps, log_freq))
    kept = [(i, x) for i, x in enumerate(rows) if i >= warmup and i + 1 != skip]
    parts = {"after_log": [x for i, x in kept if i in logged], "between_logs": [x for i, x in kept if i not in logged]}
    return {name: {"forwards": len(part), "host_fwd_ms": statistics.median(x["host_fwd_ms"] for x in part),
                   "gpu_fwd_ms": statistics.median(x["gpu_fwd_ms"] for x in part)} for name, part in parts.items() if part}


def _arm(args, sleep_ms: float, sets: list[str], label: str, workdir: Path) -> dict:
    from scripts.compare.run import run_config, summarize

    log = workdir / f"{label}.jsonl"
    log.unlink(missing_ok=True)
    prof = log.with_suffix(".cprofile.json")
    prof.unlink(missing_ok=True)
    cprofile_forward = args.cprofile_forward if sleep_ms == 0 and not sets else 0
    r = run_config(Path(args.config), steps=args.steps, workdir=workdir / label, attention="config", sets=sets,
                   timeout=args.timeout, entry=("-m", "scripts.probes.host_slack", "child"), log_freq=args.log_freq,
                   env_extra={ENV_SLEEP: str(sleep_ms), ENV_LOG: str(log), ENV_CPROFILE: str(cprofile_forward),
                              ENV_SYNC_DEBUG: "1" if args.sync_debug else "0"})
    rows = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    timed = [r for i, r in enumerate(rows) if i >= args.warmup and i + 1 != cprofile_forward]
    out = {"label": label, "sleep_ms": sleep_ms, "sets": sets, "returncode": r["returncode"], "error": r.get("error")}
    if "error" not in r:
        out.update(summarize(r["rows"], args.warmup, r["tokens_per_step"]))
        out.pop("loss", None)
    if timed:
        out["host_fwd_ms"] = statistics.median(x["host_fwd_ms"] for x in timed)
        out["gpu_fwd_ms"] = statistics.median(x["gpu_fwd_ms"] for x in timed)
        out["fwd_raw"] = timed
        if args.log_freq > 1:
            out.update(split_by_log(rows, args.warmup, args.steps, args.log_freq, cprofile_forward))
        out["in_forwards"] = {k: sum(x.get(k, 0) for x in timed) for k in ALLOC_STATS}  # (cudaMalloc / cudaFree / retries)
        if args.sync_debug:
            syncs: dict[str, int] = {}
            for x in timed:
                for where, n in x.get("syncs", {}).items():
                    syncs[where] = syncs.get(where, 0) + n
            out["in_forwards"]["syncs"] = syncs
    if prof.exists():  # (that forward ran slower, under cProfile: its row is left out of the medians above)
        out["cprofile_forward"] = {"forward": cprofile_forward, **json.loads(prof.read_text())}
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "child":
        return child(argv[1:])
    ap = argparse.ArgumentParser(prog="python -m scripts.probes.host_slack", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/llama3_1b_fp8_coda_compile.toml")
    ap.add_argument("--sleep-ms", type=float, nargs="+", default=[0.0, 30.0])
    ap.add_argument("--set", action="append", default=[], help="an extra arm: KEY=VALUE overrides (sleep 0), e.g. "
                    "coda.cuda_graphs=true; comma-separate several")
    ap.add_argument("--sync-debug", action="store_true", help="torch's sync debug mode in every arm: each forward's "
                    "row counts the synchronizing calls inside it, by source")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--log-freq", type=int, default=1, help="a metrics line (its .item() waits for the GPU) every N "
                    "steps; 1 (default): every step, so every forward starts on an empty GPU queue; the configs log "
                    "every 10, and then the forwards after a logged step are summarized apart from the others")
    ap.add_argument("--timeout", type=int, default=240)
    ap.add_argument("--workdir", default="/tmp/host_slack")
    ap.add_argument("--cprofile-forward", type=int, default=0, help="in the no-sleep arm, split this training "
                    "forward's host time by function with cProfile (0: none; use the last steps)")
    args = ap.parse_args(argv)
    import torch

    from scripts.bench.common import header, out_json

    workdir = Path(args.workdir)
    out = out_json("probe_host_slack")
    doc = {**header(), "kind": "probe_host_slack", "config": args.config, "steps": args.steps, "warmup": args.warmup,
           "log_freq": args.log_freq,
           "method": "X = S - (step(S) - step(0)): host-bound GPU idle of the forward that a GPU sleep of S ms at the "
                     "forward's start absorbs; host_fwd_ms / gpu_fwd_ms: forward start to the LM head's entry",
           "arms": []}
    arms = [(s, [], f"sleep{s:g}") for s in args.sleep_ms]
    arms += [(0.0, spec.split(","), "set_" + "_".join(spec.replace("=", "-").split(","))) for spec in args.set]
    for sleep_ms, sets, label in arms:
        doc["arms"].append(_arm(args, sleep_ms, sets, label, workdir))
        base = next((a for a in doc["arms"] if a["sleep_ms"] == 0 and not a["sets"] and "step_ms" in a), None)
        for a in doc["arms"]:
            if base is not None and a["sleep_ms"] > 0 and "step_ms" in a:
                a["host_bound_idle_ms"] = a["sleep_ms"] - (a["step_ms"] - base["step_ms"])
        Path(out).write_text(json.dumps(doc, indent=1))
        print(json.dumps({k: v for k, v in doc["arms"][-1].items() if k not in ("fwd_raw", "step_ms_raw")}), flush=True)
    torch.cuda.empty_cache()
    print("wrote", out, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
