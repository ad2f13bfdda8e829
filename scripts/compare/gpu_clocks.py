"""The GPU's SM clock, power and temperature while a config trains, over its timed steps.

Why: the floor (``scripts.bench.floor``) times each kernel alone, and a step runs the same kernels
back to back under one power limit. On the H100 CODA's step ran FA4's backward 6% slower than stock's
step did (same kernel), and the probes time packed and separate inputs alike; the clocks each step
ran at tell the GPU's share of a step / floor gap (power) from the kernels'.

``ClockSampler`` runs ``nvidia-smi`` in its loop mode (one line every ``INTERVAL_MS``) beside the
training process and stamps each line with the host time it arrived; the compare runner stamps each
step's log line the same way, and :func:`over_steps` keeps the samples between the last warm-up step's
line (where the first timed step starts) and the last step's. Without ``nvidia-smi`` (a CPU machine) it records nothing.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import threading
import time

INTERVAL_MS = 200
FIELDS = ("clocks.sm", "power.draw", "temperature.gpu")
KEYS = ("sm_mhz", "power_w", "temp_c")


def parse_line(line: str) -> tuple[float, float, float] | None:
    """(SM MHz, power W, temperature C) of one ``--format=csv,noheader,nounits`` line, or None (a line
    ``nvidia-smi`` could not fill: "[N/A]", "[Not Supported]")."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != len(FIELDS):
        return None
    try:
        return tuple(float(p) for p in parts)  # type: ignore[return-value]
    except ValueError:
        return None


class ClockSampler:
    """``with ClockSampler() as s:`` samples the first visible GPU into ``s.samples`` as
    (host time, SM MHz, power W, temperature C) until the block ends."""

    def __init__(self, device: str | None = None, exe: str = "nvidia-smi"):
        self.device = device or (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
        self.exe = shutil.which(exe)
        self.samples: list[tuple[float, float, float, float]] = []
        self._proc = self._thread = None

    def __enter__(self) -> "ClockSampler":
        if self.exe:
            cmd = [self.exe, "-i", self.device, f"--query-gpu={','.join(FIELDS)}", "--format=csv,noheader,nounits",
                   f"-lms={INTERVAL_MS}"]
            self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            self._thread = threading.Thread(target=self._read, daemon=True)
            self._thread.start()
        return self

    def _read(self) -> None:
        for line in self._proc.stdout:
            got = parse_line(line)
            if got:
                self.samples.append((time.time(), *got))

    def __exit__(self, *exc) -> None:
        if self._proc:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
            self._thread.join(timeout=5)


def medians_between(samples: list[tuple], t0: float, t1: float) -> tuple[float | None, float | None]:
    """(SM MHz, power W): the medians of the samples stamped from ``t0`` to ``t1`` (host time), or Nones."""
    held = [s for s in samples if t0 <= s[0] <= t1]
    if not held:
        return None, None
    return statistics.median(s[1] for s in held), statistics.median(s[2] for s in held)


def over_steps(samples: list[tuple], step_times: dict[int, float], warmup: int) -> dict | None:
    """Median (and min / max) SM clock, power and temperature of the samples taken from the line of the
    last warm-up step to the last step's line, with the raw samples of that window; None without any."""
    timed = [t for s, t in step_times.items() if s >= warmup]
    if len(timed) < 2:
        return None
    start, end = min(timed), max(timed)
    window = [s for s in samples if start <= s[0] <= end]
    if not window:
        return None
    out: dict = {"samples": len(window), "interval_ms": INTERVAL_MS}
    for i, key in enumerate(KEYS, start=1):
        vals = [s[i] for s in window]
        out[key] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
    out["raw"] = [[round(s[0] - start, 3), *s[1:]] for s in window]
    return out
