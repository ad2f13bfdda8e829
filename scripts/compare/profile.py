"""The profile mode: one step under the torch profiler, kernels grouped by family, idle gaps and the
host calls around them.
"""

from __future__ import annotations

import glob
import gzip
import json
import shutil
from pathlib import Path

from scripts.compare.common import _header, _out_path, _say
from scripts.compare.families import _launch_stacks, _own_kernels, gemm_families, model_weights, trace_events
from scripts.compare.run import run_config


def summarize_trace(trace_path: str, top: int = 25, events: list[dict] | None = None) -> dict:
    """GPU kernel time by kernel name from a chrome trace (one profiled step). Kernels launched before the
    profiler started (no launch of theirs in the trace: the previous step's work still running on a stream
    of its own, as ``optimizer_stream``'s step and fp8 weight pass) are not the step's: they are left out
    of every sum and reported apart (``carried_in``). ``events``: the trace's, where the caller read them."""
    events = trace_events(trace_path) if events is None else events
    kernels, carried = _own_kernels(events)
    stacks = _launch_stacks(events, cats=("cpu_op", "user_annotation"))  # (correlation id -> host ops at the launch)
    total = sum(e["dur"] for e in kernels)
    by_name: dict[tuple, list] = {}  # ((name, category) -> durations: a name can fall in two categories)
    for e in kernels:
        by_name.setdefault((e["name"], launch_category(e, stacks)), []).append(e["dur"])
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))
    cats: dict[str, float] = {}
    for (_, cat), durs in by_name.items():
        cats[cat] = cats.get(cat, 0.0) + sum(durs)
    span = (max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)) if kernels else 0
    return {
        "gpu_kernel_ms": total / 1e3,
        "gpu_span_ms": span / 1e3,
        "kernel_launches": len(kernels),
        **idle_gaps(events, kernels, stacks),
        **communication(kernels),
        "carried_in": {"kernels": len(carried), "ms": round(sum(e["dur"] for e in carried) / 1e3, 3)},
        "categories_ms": {k: round(v / 1e3, 3) for k, v in sorted(cats.items(), key=lambda kv: -kv[1])},
        "top_kernels": [
            {"name": n[:160], "category": cat, "ms": round(sum(d) / 1e3, 3), "calls": len(d),
             "pct": round(100 * sum(d) / total, 2)}
            for (n, cat), d in ranked[:top]
        ],
        # every kernel outside the GEMMs, attention, the optimizer and collectives (issue 19's "elementwise"),
        # not only those among the top: what the next fusion could remove, by name
        "outside_gemms": [
            {"name": n[:160], "category": cat, "ms": round(sum(d) / 1e3, 3), "calls": len(d)}
            for (n, cat), d in ranked if cat in OUTSIDE
        ][:80],
        "outside_gemms_by_op": outside_by_op(kernels, stacks),
    }


def outside_by_op(kernels: list[dict], stacks: dict, top: int = 40) -> list[dict]:
    """The kernels outside the GEMMs (``outside_gemms``) by the host op that launched them: the innermost
    ``coda::`` op open at the launch, else the outermost one (a compiled region, ``Optimizer.step``), and
    the kernel, ms and calls: which program's own small kernels (amaxes, casts, scalar math) cost what.
    ``stacks``: ``families._launch_stacks`` of the trace."""
    out: dict[tuple, list] = {}
    for e in kernels:
        if launch_category(e, stacks) not in OUTSIDE:
            continue
        path = [str(o["name"]) for o in stacks.get(e.get("args", {}).get("correlation"), [])]
        coda = [n for n in path if n.startswith("coda::")]
        op = coda[-1] if coda else (path[0] if path else "(no host op)")
        c = out.setdefault((op[:80], e["name"][:100]), [0, 0.0])
        c[0] += 1
        c[1] += e["dur"]
    ranked = sorted(out.items(), key=lambda kv: -kv[1][1])[:top]
    return [{"op": op, "kernel": k, "ms": round(v[1] / 1e3, 3), "calls": v[0]} for (op, k), v in ranked]


OUTSIDE = ("triton (inductor)", "elementwise/reduction (eager)", "other")  # (kernel_category's non-GEMM work)


def launch_category(e: dict, stacks: dict) -> str:
    """``kernel_category`` of a kernel event, but a multi-tensor kernel that the autograd engine launched (a
    program's backward, as F4's dX and dW scaling by one ``_foreach_mul``) is the model's elementwise work,
    not the optimizer's: the optimizer and the gradient clip never run inside the backward."""
    cat = kernel_category(e["name"])
    if cat == "optimizer" and any(str(o["name"]).startswith("autograd::engine::evaluate_function")
                                  for o in stacks.get(e.get("args", {}).get("correlation"), [])):
        return "elementwise/reduction (eager)"
    return cat


def _merged(ivs: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(ivs):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _covered(ivs: list[tuple[float, float]], others: list[tuple[float, float]]) -> float:
    """The time of the merged intervals ``ivs`` that the merged intervals ``others`` cover too."""
    covered, j = 0.0, 0
    for a, b in ivs:
        while j < len(others) and others[j][1] <= a:
            j += 1
        k = j
        while k < len(others) and others[k][0] < b:
            covered += min(b, others[k][1]) - max(a, others[k][0])
            k += 1
    return covered


def communication(kernels: list[dict]) -> dict:
    """Collective kernels (NCCL) of the step: their time, and the part of it no other kernel covers
    (communication the step waits on rather than overlaps: an FSDP all-gather or reduce-scatter that
    did not run beside compute). Sums over the merged intervals, us -> ms."""
    comm = _merged([(e["ts"], e["ts"] + e["dur"]) for e in kernels if kernel_category(e["name"]) == "communication"])
    rest = _merged([(e["ts"], e["ts"] + e["dur"]) for e in kernels if kernel_category(e["name"]) != "communication"])
    covered = _covered(comm, rest)
    total = sum(b - a for a, b in comm)
    return {"communication_ms": round(total / 1e3, 3), "communication_exposed_ms": round((total - covered) / 1e3, 3)}


SYNC_CALLS = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy"}


def idle_gaps(events: list[dict], kernels: list[dict], stacks: dict, top: int = 10) -> dict:
    """Where the GPU waited for the host: the time inside the step's kernel span covered by no
    kernel, its largest intervals with the kernels on both sides and the CPU ops running at the
    interval's middle (the host work the GPU waited for), and the blocking CUDA runtime calls."""
    ivs = sorted(((e["ts"], e["ts"] + e["dur"], e["name"], e) for e in kernels), key=lambda iv: iv[:2])
    gaps, end, prev, nexts = [], None, None, []
    for t0, t1, name, ev in ivs:
        if end is not None and t0 > end:
            gaps.append((t0 - end, end, t0, prev, name))
            nexts.append(ev)
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
        **idle_attribution(events, [(g[0], g[1], ev) for g, ev in zip(gaps, nexts)], stacks),
        "allocator_calls": _allocator_calls(runtime, lo, hi),
    }


def idle_attribution(events: list[dict], gaps: list[tuple[float, float, dict]], stacks: dict, top: int = 15) -> dict:
    """Each idle interval charged to the launch of the kernel that ended it (by correlation id): the
    phase of the step that launch belongs to (the autograd thread's launches are the backward's, the
    main thread's inside ``Optimizer.step`` the optimizer's, the rest of the main thread's the forward's
    and the step's own host work) and the host ops it sat in (outermost below the profiler step, and
    innermost). A launch made after the GPU had gone idle is host-bound: the GPU waited for it."""
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    steps = [e for e in events if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("ProfilerStep")]
    main = steps[0].get("tid") if steps else None
    corrs = [ev.get("args", {}).get("correlation") for _, _, ev in gaps]
    found = [launches.get(c) for c in corrs]
    paths = [stacks.get(c, []) for c in corrs]
    phases: dict[str, list] = {}
    by_op: dict[str, list] = {}
    for (dur, g0, ev), la, path in zip(gaps, found, paths):
        if la is None:
            phase = "unknown"
        else:
            names = [str(o["name"]) for o in path]
            if main is not None and la.get("tid") != main:
                phase = "backward"
            elif any(n.startswith("Optimizer.") for n in names):
                phase = "optimizer"
            else:
                phase = "forward and step"
        c = phases.setdefault(phase, [0, 0.0, 0, 0.0])
        late = la is not None and la["ts"] >= g0
        c[0] += 1
        c[1] += dur
        c[2] += late
        c[3] += dur if late else 0.0
        key = " > ".join(dict.fromkeys(str(o["name"])[:60] for o in (path[:1] + path[-1:]))) or "(no host op)"
        b = by_op.setdefault(f"{phase}: {key}", [0, 0.0])
        b[0] += 1
        b[1] += dur
    return {
        "idle_by_phase": {k: {"intervals": v[0], "ms": round(v[1] / 1e3, 3), "host_bound_intervals": v[2],
                              "host_bound_ms": round(v[3] / 1e3, 3)} for k, v in sorted(phases.items())},
        "idle_by_host_op": [{"op": k, "intervals": v[0], "ms": round(v[1] / 1e3, 3)}
                            for k, v in sorted(by_op.items(), key=lambda kv: -kv[1][1])[:top]],
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
    if any(s in n for s in ("gemm", "sm90_xmma", "cublas", "nvjet")) or ("cutlass" in n and "reduce" not in n):
        return "gemm (cuBLAS/other)"  # (quack's rms_final_reduce is a cutlass kernel, and a reduction)
    if "triton" in n:
        return "triton (inductor)"
    if "adam" in n or "foreach" in n or "multi_tensor" in n:
        return "optimizer"
    if "nccl" in n:
        return "communication"
    if any(s in n for s in ("elementwise", "reduce", "vectorized", "copy", "cat", "index", "softmax", "norm")):
        return "elementwise/reduction (eager)"
    return "other"


def _summary(trace_path: str, model: str) -> dict:
    """``summarize_trace`` with the GPU ms per GEMM family (scripts/compare/families.py) for the family table,
    and the step read as a timeline (``scripts/probes/step_timeline.py``: from one optimizer phase to the next,
    the time any stream runs a kernel, the main stream's busy and idle time, its small kernels)."""
    from scripts.probes.step_timeline import step_timeline

    events = trace_events(trace_path)  # (read once for the three)
    s = summarize_trace(trace_path, events=events)
    s["step_timeline"] = step_timeline(events)
    try:
        s["gemm_families"] = gemm_families(events, model_weights(model.split("/")[-1]))
    except KeyError as e:
        _say(f"no GEMM-family attribution for {model} (unknown flavor {e})")
    return s


def profile(args) -> Path:
    from scripts.report.training import profile_table  # (here: the report imports this package)

    doc = _header("profile")
    cfg = Path(args.configs[0])
    steps = args.steps
    extra = ["--profiling.enable_profiling", "--profiling.profile_freq", str(steps),
             "--profiling.profiler_warmup", "3", "--profiling.profiler_active", "1"]
    nproc = getattr(args, "nproc", 1)
    log_freq = getattr(args, "log_freq", 1)  # (> 1: the steps before the profiled one wait for nothing)
    r = run_config(cfg, steps=steps, workdir=Path(args.workdir), attention=args.attention, sets=args.set,
                   timeout=args.timeout, extra=extra, nproc=nproc, log_freq=log_freq)
    rows = r.pop("rows")
    traces = sorted(glob.glob(str(Path(args.workdir) / cfg.stem / "out" / "**" / "rank0_trace.json"), recursive=True))
    if not traces:
        raise SystemExit(f"no profiler trace was written for {cfg}: {r.get('error', '')}")
    doc.update(config=r["config"], run=r, profiled_step=steps, summary=_summary(traces[-1], r["model"]), nproc=nproc,
               log_freq=log_freq)
    doc["run"]["loss"] = [x["loss"] for x in rows]
    # (a sharded run's profile, rank 0's, is filed apart: its step is not the one-GPU step of the tables)
    kind = f"fsdp{nproc}_profile" if nproc > 1 else "profile"
    path = _out_path(Path(args.out), kind, doc["device"], doc["date"], extra=f"{cfg.stem}_")
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


def resummarize(profile_path: str, trace_path: str) -> Path:
    """A stored profile's summary derived again, by this checkout's code, from the trace its run kept
    (``--keep-trace``): the run and its trace are the measurement, the summary is arithmetic on them.
    The file says so (``resummarized``)."""
    path = Path(profile_path)
    doc = json.loads(path.read_text())
    doc["summary"] = _summary(trace_path, doc["run"]["model"])
    doc["resummarized"] = {"trace": Path(trace_path).name, "by": "python -m scripts.compare --resummarize"}
    path.write_text(json.dumps(doc, indent=1) + "\n")
    _say(f"rewrote {path}'s summary from {trace_path}")
    return path
