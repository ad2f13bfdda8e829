"""Probe (GPU): what sets a run's reserved peak in its first steps, read from the allocator's own trace.

Why: the README's peak memory is the caching allocator's reserved peak over every step. On the 1B fp8
CODA config it was set in step 1 (28.18 GiB on an H100, 2026-12-07), while every later step holds 25.3
(``gpu_train.sh allocstreams``: the first-call ``empty_cache`` of ``kernels/cute/_dispatch.py`` gives the
rest back). The first replay found the cause: the calibration step's reference fallbacks (B3's float32
temporaries, 1 GiB blocks) left the main pool 2.9 GiB larger than any later step needs; with those
fallbacks giving their blocks back the step-1 peak is 27.10, set inside the first B3 reference call
(docs/fp8.md, seventieth session).

Method: with ``CODA_TITAN_PROBE_MEMSNAP=DIR`` in a ``scripts.compare`` run's environment,
``scripts.probes.step_phases``' wrapper turns on ``torch.cuda.memory._record_memory_history`` (Python
stacks) before step 1 and, after each of the first ``CODA_TITAN_PROBE_MEMSNAP_STEPS`` steps (default 2),
reads the trace once and writes ``DIR/memsnap_step<N>.json`` (device, host, date and versions first):
the step's reserved and allocated peaks replayed from its events (segment maps and unmaps, block
allocations and frees, from the reserved and allocated bytes when the recording began), each segment
event with the totals after it (``timeline``), the largest live blocks and the segments mapped up to the
reserved peak, each with its innermost frames from this project, TorchTitan, torch's autograd and
optimizers, or inductor's generated code. The trace costs host time, so the probe's steps are not
timed steps.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

GIB = 2**30
ENV = "CODA_TITAN_PROBE_MEMSNAP"
KEEP = ("coda_titan", "torchtitan", "torchinductor", "/torch/optim", "/torch/autograd", "/torch/_functorch")
_state: dict = {}


def frames_of(entry: dict, n: int = 4) -> list[str]:
    """The entry's innermost ``n`` frames from the modules worth naming, as ``file:line name``."""
    out = []
    for f in entry.get("frames") or []:
        name = f.get("filename", "")
        if any(k in name for k in KEEP):
            out.append(f"{'/'.join(name.split('/')[-2:])}:{f.get('line')} {f.get('name')}")
            if len(out) == n:
                break
    return out


def replay(events: list[dict], reserved0: int, allocated0: int, top: int = 25) -> dict:
    """Reserved and allocated bytes over ``events`` (the allocator trace's entries, oldest first)."""
    reserved, allocated = reserved0, allocated0
    peak = {"reserved": reserved, "at": -1}
    live: dict[int, dict] = {}
    timeline: list[list] = []  # (event, +/- GiB, reserved after, allocated then, stream, frames) per segment event
    peak_alloc, reserved_at_peak_alloc = allocated, reserved
    for i, e in enumerate(events):
        act, size = e.get("action"), e.get("size", 0)
        if act in ("segment_alloc", "segment_map", "segment_free", "segment_unmap"):
            size = size if act in ("segment_alloc", "segment_map") else -size
            reserved += size
            timeline.append([i, round(size / GIB, 4), round(reserved / GIB, 3), round(allocated / GIB, 3),
                             e.get("stream"), frames_of(e) if size > 0 else []])
        elif act == "alloc":
            allocated += size
            live[e.get("addr")] = {"i": i, "size": size, "frames": frames_of(e)}
            if allocated > peak_alloc:
                peak_alloc, reserved_at_peak_alloc = allocated, reserved
        elif act == "free_completed":
            allocated -= size
            live.pop(e.get("addr"), None)
        if reserved > peak["reserved"]:
            peak = {"reserved": reserved, "at": i, "allocated": allocated,
                    "live": sorted(live.values(), key=lambda b: -b["size"])[:top]}
    at = peak["at"]
    mapped = [{"i": t[0], "gib": t[1], "stream": t[4], "allocated_gib": t[3], "frames": t[5]}
              for t in timeline if t[1] > 0]
    return {"events": len(events), "reserved_peak_gib": peak["reserved"] / GIB,
            "allocated_at_reserved_peak_gib": peak.get("allocated", allocated0) / GIB,
            "allocated_peak_gib": peak_alloc / GIB, "reserved_at_allocated_peak_gib": reserved_at_peak_alloc / GIB,
            "reserved_peak_event": at, "reserved_end_gib": reserved / GIB, "allocated_end_gib": allocated / GIB,
            "segments_mapped_to_peak": sorted([m for m in mapped if m["i"] <= at], key=lambda m: -m["gib"])[:top],
            "segments_mapped": len(mapped), "segments_mapped_gib": sum(m["gib"] for m in mapped), "timeline": timeline,
            "live_at_reserved_peak": [{**b, "gib": b.pop("size") / GIB} for b in peak.get("live", [])]}


def start() -> None:
    """Turn the trace on (before step 1), remembering the allocator's totals then."""
    import torch

    if not torch.cuda.is_available():  # (a CPU run: nothing to trace)
        return
    torch.cuda.synchronize()
    _state.update(reserved=torch.cuda.memory_reserved(), allocated=torch.cuda.memory_allocated(), done=0)
    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python", max_entries=2_000_000)


def after_step(step: int) -> None:
    """After step ``step``: that step's replay to ``DIR/memsnap_step<N>.json``; off after the last one."""
    import torch

    if "done" not in _state:
        return
    out_dir = Path(os.environ[ENV])
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.cuda.synchronize()
    trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    new = trace[_state["done"]:]
    from scripts.bench.common import header

    doc = {**header(), "kind": "probe_mem_timeline", "step": step,
           "max_reserved_gib_stat": torch.cuda.max_memory_reserved() / GIB,
           "reserved_now_gib": torch.cuda.memory_reserved() / GIB,
           "allocated_now_gib": torch.cuda.memory_allocated() / GIB,
           **replay(new, _state["reserved"], _state["allocated"])}
    (out_dir / f"memsnap_step{step}.json").write_text(json.dumps(doc, indent=1))
    _state.update(done=len(trace), reserved=torch.cuda.memory_reserved(), allocated=torch.cuda.memory_allocated())
    if step >= int(os.environ.get(ENV + "_STEPS", "2")):
        torch.cuda.memory._record_memory_history(enabled=None)
