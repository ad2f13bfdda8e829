"""The first steps' memory, replayed from the allocator's trace (``scripts/probes/mem_timeline.py``,
``gpu_train.sh memsnap``): one table of every run folder under ``benchmarks/results/memsnap/``."""

from __future__ import annotations

import json
import re
from pathlib import Path

GENERATED = re.compile(r"^[a-z0-9]{2}/c[a-z0-9]{40,}\.py:")  # (inductor's output code, as the probe names a frame)


def _last_mapped(doc: dict) -> str:
    """Where the last segment mapped at or before the step's reserved peak was allocated: its innermost frame
    outside inductor's generated code, else that code's."""
    if "timeline" not in doc:
        return "n/a (the probe's first version kept no timeline)"
    mapped = [t for t in doc["timeline"] if t[0] <= doc.get("reserved_peak_event", -1) and t[1] > 0]
    frames = mapped[-1][5] if mapped else []
    named = [f for f in frames if not GENERATED.match(f)] or frames
    return f"`{named[0]}`" if named else "n/a"


def table(folders: list[Path]) -> str:
    """Per run folder and step: the reserved peak, the live memory at it, the live peak and the reserved memory
    then, what the step left reserved, and where the last segment before the peak came from."""
    rows = ["| run | step | reserved peak GiB | live at it | live peak | reserved at the live peak | reserved after "
            "the step | last segment mapped before the peak |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for folder in folders:
        for p in sorted(folder.glob("memsnap_step*.json")):
            d = json.loads(p.read_text())
            at_live = d.get("reserved_at_allocated_peak_gib")
            rows.append(f"| {folder.name} | {d['step']} | {d['reserved_peak_gib']:.2f} | "
                        f"{d['allocated_at_reserved_peak_gib']:.2f} | {d['allocated_peak_gib']:.2f} | "
                        f"{'n/a' if at_live is None else f'{at_live:.2f}'} | {d['reserved_end_gib']:.2f} | "
                        f"{_last_mapped(d)} |")
    return "\n".join(rows)


def section(results: Path | None = None) -> str:
    """The table under its heading, or nothing where no run was traced."""
    if results is None:
        from scripts.compare.common import RESULTS as results
    folders = sorted(p for p in (results / "memsnap").glob("*") if p.is_dir())
    if not folders:
        return ""
    return "\n".join([
        "The first steps' memory, replayed from the caching allocator's own trace (`gpu_train.sh memsnap`, "
        "`scripts/probes/mem_timeline.py`; GiB; a run's reserved peak is what TorchTitan logs as `memory`):", "",
        table(folders)])
