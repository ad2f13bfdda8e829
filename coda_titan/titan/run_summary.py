"""What a user sees at the end of a run: steps, final loss, median tokens/s, peak memory, and where
the checkpoints went, read from TorchTitan's own per-step metrics lines as the Trainer logs them."""

from __future__ import annotations

import logging
import re
import statistics
from pathlib import Path

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_STEP = re.compile(r"step:\s*(\d+)\s+loss:\s*(\S+).*?memory:\s*([0-9.]+)GiB.*?tps:\s*([0-9,]+)")


class StepLog(logging.Handler):
    """Collects (step, loss, memory GiB, tokens/s) from the metrics lines while attached."""

    def __init__(self):
        super().__init__(level=logging.INFO)
        self.rows: list[tuple[int, float, float, float]] = []

    def emit(self, record: logging.LogRecord) -> None:
        m = _STEP.search(_ANSI.sub("", record.getMessage()))
        if m:
            step, loss, mem, tps = m.groups()
            self.rows.append((int(step), float(loss), float(mem), float(tps.replace(",", ""))))


def summary(rows, warmup: int = 1) -> str:
    """One line: steps logged, final loss, median tokens/s (after ``warmup`` steps), peak memory."""
    if not rows:
        return "no step was logged"
    timed = rows[warmup:] or rows
    return (f"{rows[-1][0]} steps, final loss {rows[-1][1]:.4f}, median {statistics.median(r[3] for r in timed):,.0f} "
            f"tokens/s, peak memory {max(r[2] for r in rows):.2f} GiB")


def lm_head_repairs() -> str:
    """", N LM-head rows repaired" when F4 without its gradient pass ran (``CODA_TITAN_CE_PASS=exp``: rows whose
    largest logit fell out of its offset's range, rewritten by its repair kernel; a host sync, at the run's end),
    else "". Many of them mean the offsets' bound is loose for this model: each repaired row costs a GEMV."""
    import sys

    mod = sys.modules.get("coda_titan.kernels.cute.lm_head_ce")
    if mod is None or not getattr(mod, "_REPAIRED", None):
        return ""
    return f", {mod.take_repaired():,} LM-head rows repaired (CODA_TITAN_CE_PASS=exp)"


def newest_checkpoint(config) -> str | None:
    """The newest complete checkpoint step folder of the run, or None."""
    if not config.checkpoint.enable:
        return None
    folder = Path(config.job.dump_folder) / config.checkpoint.folder
    steps = sorted((int(p.name[5:]), p) for p in folder.glob("step-*") if (p / ".metadata").is_file()) if folder.is_dir() else []
    return str(steps[-1][1]) if steps else None
