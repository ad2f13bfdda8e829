"""The profiled step against its floor, part by part: GEMMs, attention, optimizer and every other kernel, for
CODA and for stock, beside the floor measured that day (``scripts.bench.floor``).

Where a step is above its floor is the question issues 18 and 19 leave open; the family tables split the GEMMs,
this table says how much of the gap is in the GEMMs at all. The parts partition the step's kernel time:
- GEMMs: every GEMM family (CODA's programs with their epilogues and every kernel they launch; stock's GEMM
  kernels) and the GEMM kernels no family claimed; floor: the layer GEMMs and the LM head at their best.
- attention: FlashAttention's kernels (forward, backward and its pre- and post-processing); floor: FA4 forward
  and backward on contiguous q, k, v.
- optimizer: the optimizer's kernels (``--profile``'s category), the clip's norm and multiply included; floor:
  the fastest fused AdamW step over the same parameters.
- every other kernel: what the floor has none of (norms, casts, copies, the CE pass, inductor's kernels).
"""

from __future__ import annotations

import re
from pathlib import Path

from .profiles import counts_step_before

PARTS = ("GEMMs", "attention", "optimizer", "every other kernel")


def parts_ms(profile: dict) -> dict[str, float] | None:
    """The step's kernel time by part (``PARTS``), ms; None for a profile without the GEMM-family attribution."""
    s = profile["summary"]
    fam = s.get("gemm_families")
    if not fam:
        return None
    gemms = sum(fam["families_ms"].values()) + fam.get("unattributed_gemm_ms", 0.0)
    attention = fam.get("attention_ms", s["categories_ms"].get("attention", 0.0))
    optimizer = s["categories_ms"].get("optimizer", 0.0)
    return {"GEMMs": gemms, "attention": attention, "optimizer": optimizer,
            "every other kernel": s["gpu_kernel_ms"] - gemms - attention - optimizer}


def floor_parts(floor: dict, precision: str) -> dict[str, float] | None:
    """The floor's parts for the run's precision (None where the floor file predates its totals)."""
    t = (floor or {}).get("totals", {}).get(precision)
    if not t:
        return None
    return {"GEMMs": t["layer_gemms_ms"] + t["lm_head_ms"], "attention": t["attention_ms"],
            "optimizer": t["optimizer_ms"], "every other kernel": 0.0}


def capped_parts(floor: dict, precision: str) -> dict[str, float] | None:
    """The same parts timed call by call in the floor's pass at the power cap (``at_cap``'s ``parts_ms``; None
    where the floor file predates them)."""
    p = ((floor or {}).get("at_cap") or {}).get(precision, {}).get("parts_ms")
    if not p:
        return None
    return {"GEMMs": p["layer_gemms"] + p["lm_head"], "attention": p["attention_fwd"] + p["attention_bwd"],
            "optimizer": p["optimizer"], "every other kernel": 0.0}


def _cell(v: float | None, ref: float | None = None) -> str:
    if v is None:
        return "n/a"
    return f"{v:.1f}" if ref is None else f"{v - ref:+.1f}"


def floor_parts_table(coda: dict, stock: dict | None, floor: dict) -> str:
    """One profiled CODA step (and stock's of that device and day) against the floor of its precision, by part."""
    precision = coda["run"].get("precision", "bf16")
    fl, c = floor_parts(floor, precision), parts_ms(coda)
    st = parts_ms(stock) if stock else None
    total = floor["totals"][precision]["floor_ms"]
    stem = Path(coda["config"]).stem
    cap = capped_parts(floor, precision)
    lines = [f"`{stem}` against its floor ({coda['device']}, {coda['date'][:10]}, {precision}), GPU ms of one "
             f"profiled step; stock: `{Path(stock['config']).stem if stock else 'n/a'}`"
             + ("; the floor at the cap: its pass in a step's order, timed call by call" if cap else "") + ".", "",
             "| part | floor |" + (" floor at the cap |" if cap else "")
             + " CODA | CODA - floor | stock | stock - floor |",
             "|---|---:|" + ("---:|" if cap else "") + "---:|---:|---:|---:|"]
    for part in PARTS:
        s_v = st[part] if st else None
        lines.append(f"| {part} | {_cell(fl[part])} |" + (f" {_cell(cap[part])} |" if cap else "")
                     + f" {_cell(c[part])} | {_cell(c[part], fl[part])} | {_cell(s_v)} | {_cell(s_v, fl[part])} |")
    s_total, c_total = stock["summary"]["gpu_kernel_ms"] if stock else None, coda["summary"]["gpu_kernel_ms"]
    capped = floor["at_cap"][precision]["ms"] if cap else None
    lines.append(f"| all kernels | {total:.1f} |" + (f" {capped:.1f} |" if cap else "")
                 + f" {c_total:.1f} | {_cell(c_total, total)} | {_cell(s_total)} | {_cell(s_total, total)} |")
    lines += _notes(coda, floor, precision)
    return "\n".join(lines)


def _notes(coda: dict, floor: dict, precision: str) -> list[str]:
    """Where CODA's main stream spent the step, and the floor's kernels run back to back at the power cap."""
    out = []
    if counts_step_before(coda):
        out += ["", "This profile was summarized before profiles left out the step before's kernels: its optimizer and "
                    "other sums count that step's side-stream work too."]
    t = coda["summary"].get("step_timeline") or {}
    if t.get("main_stream"):
        opt = t.get("optimizer") or {}
        where = ("" if not opt else " The optimizer ran on the main stream." if opt.get("on_main_stream")
                 else " The optimizer ran on a stream of its own, beside the next forward (`optimizer_stream`): "
                      "its kernels overlap the main stream's, so the step is the main stream's time.")
        m = t["main_stream"]
        out += ["", f"CODA's profiled step took {t['step_ms']:.1f} ms from optimizer to optimizer; its main stream ran "
                    f"kernels for {m['busy_ms']:.1f} ms of it and idled {m['idle_ms']:.1f} ms (the profiler's own host "
                    f"work lengthens a host-bound step's gaps).{where}"]
    cap = (floor.get("at_cap") or {}).get(precision, {}).get("ms")
    if cap and capped_parts(floor, precision) is None:  # (with its parts, the table's column says it)
        out += ["", f"The floor's kernels back to back in a step's order at the power cap: {cap:.1f} ms "
                    f"(each part above alone is a short burst)."]
    return out


def section(pairs: list[tuple[dict, dict | None]], floor_of) -> str:
    """The table of the newest CODA profile of each device, precision and model flavor that has a floor with its
    totals (``pairs``: ``training.family_pairs``; ``floor_of``: ``training._floor_of``), newest first."""
    newest: dict[tuple, tuple[dict, dict | None, dict]] = {}
    for coda, stock in pairs:
        if not re.search(r"_coda(_compile)?$", Path(coda["config"]).stem):  # (a configured run, not a variant's)
            continue
        floor = floor_of(coda)
        if not floor or floor_parts(floor, coda["run"].get("precision", "bf16")) is None:
            continue
        key = (coda["device"], coda["run"].get("precision", "bf16"), coda["run"].get("model"))
        if key not in newest or (coda["date"], coda["config"]) > (newest[key][0]["date"], newest[key][0]["config"]):
            newest[key] = (coda, stock, floor)
    chosen = sorted(newest.values(), key=lambda v: v[0]["date"], reverse=True)
    return "\n\n".join(floor_parts_table(*v) for v in chosen)
