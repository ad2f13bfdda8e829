"""Where one training step's time goes on the GPU's streams, read from a kept profiler trace (CPU only).

    python -m scripts.probes.step_timeline TRACE.json.gz [TRACE ...] [--tag NAME] [--small-us 15]

``scripts.compare --profile --keep-trace`` keeps a gzipped chrome trace of one profiled step and the steps
around it. Its summary adds kernel time over every stream; this probe reads the trace as a timeline:

* the step: from the first fused-optimizer kernel of one step to the first of the next (a step that runs
  its optimizer on a side stream, ``[coda] optimizer_stream``, overlaps it with the next forward, so the
  step's boundary is the optimizer's start, not the profiler's step range); without two optimizer phases,
  the whole trace; and the time in it during which any stream runs a kernel (the rest: the GPU idle);
* the main stream (the one with the most kernel time): busy and idle time, split into the forward (to
  the first attention-backward kernel) and the backward; in each, the kernels shorter than ``--small-us``
  (scale arithmetic, reductions of epilogue partials, fills), their time and the gaps before them;
* each layer's forward period (between consecutive attention-forward kernels);
* the optimizer phase: its wall span, its kernel time, and how much main-stream kernel time ran inside it;
* the other streams' kernel time (the fp8 weight pass's side stream).

Writes ``benchmarks/results/timeline_<TAG or the trace's stem>.json`` (``$OUT`` if set) with the trace's
path and the numbers; prints one line per trace.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
from collections import defaultdict
from pathlib import Path

from scripts.compare.families import trace_doc
from scripts.compare.profile import _covered, _merged

OPTIMIZER = "FusedOptimizer"  # (torch's fused AdamW: multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata<4>>)
ATTN_FWD = ("flash_fwd", "FlashAttentionForward", "flash_attn_fwd")
ATTN_BWD = ("flash_bwd", "FlashAttentionBackward", "flash_attn_bwd")


def kernels_of(events: list[dict]) -> list[dict]:
    """A trace's GPU kernels, (name, stream, start, duration in us), in start order."""
    ks = [{"name": e["name"], "stream": e.get("tid", 0), "ts": float(e["ts"]), "dur": float(e["dur"])}
          for e in events if e.get("cat") == "kernel"]
    return sorted(ks, key=lambda k: k["ts"])


def step_window(ks: list[dict]) -> tuple[float, float, int]:
    """(start, end, number of optimizer phases seen): between the first kernels of two optimizer phases."""
    opt = [k for k in ks if OPTIMIZER in k["name"]]
    phases, last_end = [], None
    for k in opt:  # (a phase: optimizer kernels with no main-step gap longer than 20 ms between them)
        if last_end is None or k["ts"] - last_end > 20_000:
            phases.append(k["ts"])
        last_end = k["ts"] + k["dur"]
    if len(phases) >= 2:
        return phases[0], phases[1], len(phases)
    return ks[0]["ts"], max(k["ts"] + k["dur"] for k in ks), len(phases)


def _gaps(seq: list[dict]) -> list[float]:
    return [max(0.0, b["ts"] - a["ts"] - a["dur"]) for a, b in zip(seq, seq[1:])]


def segment(seq: list[dict], small_us: float) -> dict:
    """Busy, idle and small-kernel figures of a run of main-stream kernels (ms; counts)."""
    if not seq:
        return {"kernels": 0}
    gaps = _gaps(seq)
    small = [i for i, k in enumerate(seq) if k["dur"] < small_us]
    return {
        "span_ms": (seq[-1]["ts"] + seq[-1]["dur"] - seq[0]["ts"]) / 1e3,
        "busy_ms": sum(k["dur"] for k in seq) / 1e3,
        "idle_ms": sum(gaps) / 1e3,
        "kernels": len(seq),
        "small_kernels": len(small),
        "small_kernel_ms": sum(seq[i]["dur"] for i in small) / 1e3,
        "gaps_before_small_ms": sum(gaps[i - 1] for i in small if i > 0) / 1e3,
        "median_gap_us": statistics.median(gaps) if gaps else 0.0,
    }


def _spans(ks: list[dict], w0: float = -math.inf, w1: float = math.inf) -> list[tuple[float, float]]:
    """The kernels' run times clipped to [w0, w1), merged where they overlap (us)."""
    return _merged([(max(k["ts"], w0), min(k["ts"] + k["dur"], w1)) for k in ks if k["ts"] < w1 and k["ts"] + k["dur"] > w0])


def timeline(path: str, small_us: float = 15.0) -> dict:
    """``step_timeline`` of the trace at ``path``, with the path, its GPU's name and today's date."""
    doc = trace_doc(path)
    device = next((d.get("name") for d in doc.get("deviceProperties") or []), None)
    return {"trace": str(path), "device": device, "derived": datetime.date.today().isoformat(),
            **step_timeline(doc["traceEvents"], small_us)}


def step_timeline(events: list[dict], small_us: float = 15.0) -> dict:
    """The step's timeline from a trace's events (the module's docstring says what is in it)."""
    ks = kernels_of(events)
    if not ks:
        return {"kernels": 0}
    w0, w1, n_phases = step_window(ks)
    inside = [k for k in ks if w0 <= k["ts"] < w1]
    per_stream = defaultdict(float)
    for k in inside:
        per_stream[k["stream"]] += k["dur"]
    main_id = max(per_stream, key=per_stream.get)
    main = [k for k in inside if k["stream"] == main_id]
    bwd0 = next((k["ts"] for k in main if any(s in k["name"] for s in ATTN_BWD)), w1)
    fwd, bwd = [k for k in main if k["ts"] < bwd0], [k for k in main if k["ts"] >= bwd0]
    attn = [k["ts"] for k in fwd if any(s in k["name"] for s in ATTN_FWD)]
    opt = [k for k in inside if OPTIMIZER in k["name"]]
    opt_end = max((k["ts"] + k["dur"] for k in opt), default=w0)
    return {
        "window": "optimizer to optimizer" if n_phases >= 2 else "whole trace",
        "step_ms": (w1 - w0) / 1e3,
        "gpu_busy_ms": sum(b - a for a, b in _spans(ks, w0, w1)) / 1e3,  # (any stream running a kernel; the rest of the step the GPU is idle)
        "small_kernel_us": small_us,
        "main_stream": {**segment(main, small_us), "first_kernel_after_ms": (main[0]["ts"] - w0) / 1e3 if main else None},
        "forward": segment(fwd, small_us),
        "backward": segment(bwd, small_us),
        "layer_forward_ms": [round((b - a) / 1e3, 3) for a, b in zip(attn, attn[1:])],
        "first_attention_after_ms": (attn[0] - w0) / 1e3 if attn else None,
        "optimizer": {
            "kernels": len(opt), "kernel_ms": sum(k["dur"] for k in opt) / 1e3, "span_ms": (opt_end - w0) / 1e3,
            "main_stream_kernel_ms_inside": _covered(_spans(opt), _spans(main)) / 1e3 if opt and opt[0]["stream"] != main_id
            else 0.0,
            "on_main_stream": bool(opt) and opt[0]["stream"] == main_id,
        },
        "other_streams_kernel_ms": {str(s): v / 1e3 for s, v in per_stream.items() if s != main_id},
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--tag", help="the result file's name (one trace only); default: the trace's stem")
    ap.add_argument("--small-us", type=float, default=15.0, help="kernels shorter than this count as small")
    args = ap.parse_args(argv)
    if args.tag and len(args.traces) > 1:
        ap.error("--tag names one result file: give one trace")
    out = Path(os.environ.get("OUT", "benchmarks/results"))
    out.mkdir(parents=True, exist_ok=True)
    for trace in args.traces:
        doc = {"kind": "step_timeline", **timeline(trace, args.small_us)}
        stem = args.tag or Path(trace).name.split(".json")[0].removeprefix("trace_")
        path = out / f"timeline_{stem}.json"
        path.write_text(json.dumps(doc, indent=1) + "\n")
        m, f, b = doc["main_stream"], doc["forward"], doc["backward"]
        print(f"{path}: step {doc['step_ms']:.1f} ms, GPU busy {doc['gpu_busy_ms']:.1f}; main stream busy {m['busy_ms']:.1f}, idle {m['idle_ms']:.1f} "
              f"(forward {f.get('idle_ms', 0):.1f}, backward {b.get('idle_ms', 0):.1f}); small kernels "
              f"{m['small_kernels']} ({m['small_kernel_ms']:.2f} ms + {m['gaps_before_small_ms']:.2f} ms of gaps)")


if __name__ == "__main__":
    main()
