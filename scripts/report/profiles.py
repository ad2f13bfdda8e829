"""One profiled step's table on the results page: its kernel time by category, the GPU idle and what
launched the kernel after it, the largest kernels, and the kernels outside the GEMMs (``profile_table``)."""

from __future__ import annotations

from pathlib import Path


def profile_table(doc: dict, top: int = 12) -> str:
    s = doc["summary"]
    lines = [
        f"Profile of `{Path(doc['config']).stem}` step {doc['profiled_step']}"
        + (f" (metrics every {doc['log_freq']} steps: none waited for the GPU since the last)" if doc.get("log_freq", 1) > 1 else "")
        + f" on {doc['device']}: "
        f"{s['gpu_kernel_ms']:.1f} ms of GPU kernel time in {s['kernel_launches']} launches "
        f"(span {s['gpu_span_ms']:.1f} ms).",
        "",
    ]
    if "gpu_idle_ms" in s:
        b = s["blocking_runtime_calls"]
        lines += [f"GPU idle inside the span: {s['gpu_idle_ms']:.1f} ms in {s['gpu_idle_intervals']} intervals; "
                  f"blocking CUDA runtime calls: {b['count']} ({b['ms']:.1f} ms).", ""]
    t = s.get("step_timeline") or {}
    if t.get("main_stream"):
        m, f, b = t["main_stream"], t["forward"], t["backward"]
        lines += [f"The step as a timeline ({t['window']}, `scripts/probes/step_timeline.py`): {t['step_ms']:.1f} ms, of "
                  f"which some stream runs a kernel for {t['gpu_busy_ms']:.1f} (the GPU idle {t['step_ms'] - t['gpu_busy_ms']:.1f}); "
                  f"the main stream busy {m['busy_ms']:.1f} and idle {m['idle_ms']:.1f} (forward {f.get('idle_ms', 0):.1f}, "
                  f"backward {b.get('idle_ms', 0):.1f}); its {m['small_kernels']} kernels under {t['small_kernel_us']:.0f} us "
                  f"take {m['small_kernel_ms']:.2f} ms, with {m['gaps_before_small_ms']:.2f} ms of gaps before them.", ""]
    if counts_step_before(doc):
        lines += ["Summarized before profiles left out the step before's kernels: with `optimizer_stream` that step's "
                  "optimizer and fp8 weight pass ran into this window, so the optimizer and outside-GEMM sums below "
                  "count them too (`python -m scripts.compare --resummarize` needs the run's kept trace).", ""]
    if s.get("carried_in", {}).get("kernels"):
        c = s["carried_in"]
        lines += [f"Left out: {c['kernels']} kernels ({c['ms']:.1f} ms) launched before the profiled step (the step "
                  "before's work on a stream of its own, such as `optimizer_stream`'s); every sum here is this step's.", ""]
    if doc.get("nproc", 1) > 1 and "communication_ms" in s:
        lines += [f"Rank 0 of {doc['nproc']} (FSDP2): collectives {s['communication_ms']:.1f} ms, of which "
                  f"{s['communication_exposed_ms']:.1f} ms with no other kernel running (not overlapped).", ""]
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
    lines += _outside_lines(doc)
    if s.get("top_idle"):
        lines += ["", "| largest GPU idle (us) | after kernel | host op running meanwhile |", "|---:|---|---|"]
        for g in s["top_idle"][:5]:
            host = " / ".join(g["host_ops"][:2]).replace("|", "/") or "n/a"
            lines.append(f"| {g['us']:.0f} | `{g['after_kernel'][:50].replace('|', '/')}` | {host[:90]} |")
    if s.get("idle_by_phase"):
        lines += ["", "| GPU idle by the phase that launched the next kernel | intervals | ms | of it host-bound (launched after the GPU went idle), ms |",
                  "|---|---:|---:|---:|"]
        for k, v in s["idle_by_phase"].items():
            lines.append(f"| {k} | {v['intervals']} | {v['ms']:.1f} | {v['host_bound_ms']:.1f} |")
        lines += ["", "| GPU idle charged to the host op that launched the next kernel (outermost > innermost) | intervals | ms |",
                  "|---|---:|---:|"]
        for g in s["idle_by_host_op"][:8]:
            lines.append(f"| {g['op'][:110].replace('|', '/')} | {g['intervals']} | {g['ms']:.1f} |")
    lines += ["", "| top kernel | category | calls | ms | share |", "|---|---|---:|---:|---:|"]
    for k in s["top_kernels"][:top]:
        name = k["name"].replace("|", "/")
        name = name if len(name) <= 70 else name[:67] + "..."
        lines.append(f"| `{name}` | {k['category']} | {k['calls']} | {k['ms']:.2f} | {k['pct']:.1f}% |")
    return "\n".join(lines)


def counts_step_before(doc: dict) -> bool:
    """Whether a profile's sums count the step before's side-stream kernels too: summarized before profiles left
    out what was launched before the profiled step (no ``carried_in``), with ``optimizer_stream`` on."""
    return "carried_in" not in doc["summary"] and "optimizer_stream = true" in doc.get("run", {}).get("config_run", "")


def _outside_lines(doc: dict) -> list[str]:
    """The step's kernel time outside the GEMMs, attention, the optimizer and collectives, with its GPU idle
    (issue 19's target for CODA fp8: at most 15 ms together), and its largest kernels where the profile
    recorded them all (``outside_gemms``)."""
    from scripts.compare.profile import OUTSIDE

    s = doc["summary"]
    ms = sum(v for k, v in s["categories_ms"].items() if k in OUTSIDE)
    idle = s.get("gpu_idle_ms")
    fp8_coda = "coda" in Path(doc["config"]).stem and doc.get("run", {}).get("precision") == "fp8"
    line = (f"Outside the GEMMs, attention, the optimizer and collectives: {ms:.1f} ms of kernels"
            + (f", {ms + idle:.1f} ms with the GPU idle ({idle:.1f} ms; the profiler's host work inflates it)" if idle is not None else "")
            + (" (issue 19's target for CODA fp8: at most 15 ms)" if fp8_coda else "") + ".")
    out = ["", line]
    if s.get("outside_gemms"):
        out += ["", "| kernel outside the GEMMs | category | calls | ms |", "|---|---|---:|---:|"]
        for k in s["outside_gemms"][:10]:
            name = k["name"].replace("|", "/")
            out.append(f"| `{name if len(name) <= 70 else name[:67] + '...'}` | {k['category']} | {k['calls']} | {k['ms']:.2f} |")
    if s.get("outside_gemms_by_op"):
        out += ["", "| the same by the host op that launched them (innermost `coda::` op, else outermost) | kernel | calls | ms |",
                "|---|---|---:|---:|"]
        for k in s["outside_gemms_by_op"][:12]:
            name = k["kernel"].replace("|", "/")
            out.append(f"| {k['op'][:60].replace('|', '/')} | `{name if len(name) <= 50 else name[:47] + '...'}` | "
                       f"{k['calls']} | {k['ms']:.2f} |")
    return out
