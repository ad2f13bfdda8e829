"""The notes under a comparison's table (``training.compare_table``): the floor at the power cap, the slow timed
steps, the reserved memory by stream; and the tables' number format."""

from __future__ import annotations

from pathlib import Path


def _f(v, nd=1, suffix=""):
    return "n/a" if v is None else f"{v:,.{nd}f}{suffix}"


def _alloc_streams_line(runs: list[dict]) -> str:
    """Each run's reserved memory by CUDA stream after its last step (``scripts.probes.alloc_streams``), or ""."""
    parts = [f"{Path(r['config']).stem}: " + ", ".join(f"{s['stream']} {s['reserved_gib']:.2f} ({s['allocated_gib']:.2f})"
                                                       for s in a["streams"])
             for r in runs if (a := r.get("alloc_streams")) and a.get("streams")]
    return ("Reserved GiB by CUDA stream after the last step, in parentheses the live tensors then (the allocator "
            "keeps a pool per stream; `scripts.probes.alloc_streams`): " + "; ".join(parts) + ".") if parts else ""


def _capped_floor_line(doc: dict, capped: dict) -> str:
    """The floor's kernels back to back in step order at the power cap (``scripts.bench.floor --cap-reps``),
    and each FA4 config's step over it."""
    over = [f"{Path(r['config']).stem} {r['step_ms'] / capped[p]:.3f}" for r in doc["runs"]
            if "error" not in r and r["attention"] == "fa4" and (p := r.get("precision", "bf16")) in capped]
    return ("The same kernels back to back in a step's order, pass after pass (the power cap a step runs at; "
            "each alone above is a short burst): " + ", ".join(f"{p} {_f(v)} ms" for p, v in capped.items())
            + (f". Step / that floor: {', '.join(over)}." if over else "."))


SLOW_STEP = 1.1  # a timed step this many times its config's median step is listed under the table


def _slow(run: dict) -> list[tuple[int, float]]:
    """(step number, ms) of each timed step of a compare run over ``SLOW_STEP`` x its median step (``step_ms``)."""
    raw, med, first = run.get("step_ms_raw") or [], run.get("step_ms"), run.get("warmup_steps", 0) + 1
    steps = run.get("step_ms_steps") or range(first, first + len(raw))  # (log windows: their last steps)
    return [(step, ms) for step, ms in zip(steps, raw) if med and ms > SLOW_STEP * med]


def _slow_labels(run: dict) -> list[str]:
    """The slow timed steps (``_slow``) as text: the ms, and with the run's ``host_phases`` the step and the phase of the host's
    step (``scripts.probes.step_phases``) that grew most over its median, e.g. "302 (step 18: fwd +61)"."""
    grown = {s["step"]: s["excess_ms"] for s in (run.get("host_phases") or {}).get("slow", [])}
    out = []
    for step, ms in _slow(run):
        if grown.get(step):
            phase, extra = max(grown[step].items(), key=lambda kv: kv[1])
            out.append(f"{ms:.0f} (step {step}: {phase} {extra:+.0f})")
        else:
            out.append(f"{ms:.0f}")
    return out
