"""The speed-up and memory targets of a comparison, and the GEMM-time budget they leave (from the
profiles).
"""

from __future__ import annotations

import re
from pathlib import Path

from scripts.compare.common import TARGETS


def _baseline_for(config: str) -> str | None:
    stem = Path(config).stem
    if "_coda" not in stem:
        return None
    base, n = re.subn(r"_coda(_compile)?$", "_baseline_compile", stem)
    return base if n else None  # (a variant named otherwise has no target, rather than itself)


def targets(doc: dict) -> list[dict]:
    """CODA vs the compiled stock baseline of the same model (tokens/s and peak memory), and CODA's step
    over the floor of its lease where the comparison has one, per precision (``TARGETS``)."""
    ok = {Path(r["config"]).stem: r for r in doc["runs"] if "error" not in r}
    ran = {Path(r["config"]).stem for r in doc["runs"]}
    floor = doc.get("floor") or {}
    out = []
    for r in doc["runs"]:
        base = _baseline_for(r["config"])
        if base is None or base not in ran:  # the compiled baseline was not part of this comparison
            continue
        stem = Path(r["config"]).stem
        b = ok.get(base)
        prec = r.get("precision", "bf16")
        goal = TARGETS[prec]
        checks = [("tokens_per_s", f">= {goal['speedup']:.2f}x tokens/s of {base}", goal["speedup"], "higher",
                   lambda c, b: c["tokens_per_s"] / b["tokens_per_s"]),
                  ("peak_gib", f"<= {goal['memory']:.2f}x peak memory of {base}", goal["memory"], "lower",
                   lambda c, b: c["peak_gib"] / b["peak_gib"])]
        if "floor" in goal and floor.get(prec):
            checks.append(("step_floor", f"<= {goal['floor']:.2f}x its step floor ({floor[prec]:.1f} ms)", goal["floor"],
                           "lower", lambda c, b: c["step_ms"] / floor[prec]))
        for metric, text, thr, better, ratio in checks:
            t = {"config": stem, "baseline": base, "metric": metric, "goal": text, "threshold": thr}
            if b is None or stem not in ok:
                t.update(value=None, met=False, why=f"{base if b is None else stem} has no result in this run")
            else:
                v = ratio(ok[stem], b)
                t.update(value=round(v, 4), met=(v >= thr) if better == "higher" else (v <= thr))
                if not t["met"]:
                    t["why"] = f"measured {v:.3f}x, target {thr:.2f}x"
            out.append(t)
    return out


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
        target = TARGETS[d["run"].get("precision", "bf16")]["speedup"]  # as targets()
        need = base["summary"]["gpu_span_ms"] / target
        rest = d["summary"]["gpu_span_ms"] - gemm(d)
        left = need - rest
        verdict = lambda ms: ("less than" if ms < gemm(base) else "at least") + " what the baseline's GEMMs take"  # noqa: E731
        line = (f"For {target:.2f}x over `{Path(base['config']).stem}` the span of `{stem}` would have to be "
                f"{need:.1f} ms. Outside its GEMMs (attention, elementwise, optimizer, GPU idle) it spends "
                f"{rest:.1f} ms, which leaves {left:.1f} ms for every GEMM of the step, {verdict(left)} "
                f"({gemm(base):.1f} ms; CODA's take {gemm(d):.1f} ms now).")
        idle = d["summary"].get("gpu_idle_ms")  # (older profiles did not record it)
        if idle is not None:
            line += (f" Without the profiled step's GPU idle ({idle:.1f} ms; the profiler's own host work inflates it "
                     f"where the host launches the next kernel late) {left + idle:.1f} ms would be left, "
                     f"{verdict(left + idle)}.")
        out.append(line)
    return out
