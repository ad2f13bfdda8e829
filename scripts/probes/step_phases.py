"""Probe (GPU): where the host's time goes in each training step, phase by phase, without a profiler;
what makes the occasional slow step slow.

    source .gpu/part2/activate.sh && python3 -m scripts.probes.step_phases [--config C.toml ...]
        [--steps 40 --warmup 10] [--set KEY=VALUE ...]

Why: the compiled CODA configs have timed steps 20-80 ms over their median every 6-8 steps on some hosts
(the ``step_ms_raw`` of the 2026-11-26 headline files), the baselines almost never; the forward's own
host time in such a step is ordinary (``probe_host_slack_sync_debug_fp8_…json``), and the data loader
makes a batch in about 34 ms on a CPU (its worker runs ahead by ``prefetch_factor`` batches).

Method: the config trains in a child process whose TorchTitan ``Trainer`` is wrapped, not changed: each
step stamps the host clock at the entry of ``train_step``, around the data iterator's ``next``, around
``forward_backward_step``, ``clip_grad_norm_`` and ``optimizers.step``, and around the metrics
processor's ``log`` (with ``log_freq = 1`` its arguments, the loss's and the gradient norm's ``.item()``,
wait for the GPU: the time from the optimizer's return to ``log``'s entry is the host waiting for the
GPU). A step's phases:

* ``between``: the previous ``train_step``'s return to this one's entry (GC, checkpoint, profiler hooks);
* ``pre``: to the first ``next`` (``zero_grad``); ``data``: inside ``next``;
* ``h2d``: to ``forward_backward_step`` (the batch's copies to the GPU, which synchronize);
* ``fwd`` (to ``torch.autograd.backward``'s entry), ``bwd``, ``clip``, ``opt``: the host's time in each
  (the backward's includes whatever in it waits for the GPU); ``wait``: the ``.item()`` calls; ``log``.

A step whose time grows in ``wait`` waited for the GPU; one that grows elsewhere waited for the host.
``scripts.compare`` runs every one-process config through this wrapper (``run_config(phases=True)``)
and keeps the medians and the slow steps in its JSON (``host_phases``). Standalone, the probe writes
``$OUT/probe_step_phases_<tag>_<gpu>.json`` (benchmarks/results without $OUT): per config the
phases of every step, their medians over the timed steps, and for each timed step over 1.1x the median
step, its phases against the medians. The same wrapper also records the allocator by stream after the
last step (``alloc_streams``) and, with ``CODA_TITAN_PROBE_MEMSNAP`` set, traces the first steps' memory
(``mem_timeline``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from scripts.compare.cli import TIMED_STEPS  # (the comparisons' window: one GC step at its rate)
from scripts.probes import alloc_streams, mem_timeline

ENV_LOG = "CODA_TITAN_PROBE_PHASES_LOG"
PHASES = ("between", "pre", "data", "h2d", "fwd", "bwd", "clip", "opt", "wait", "log")
SLOW = 1.1  # a timed step over this times its config's median step is a slow step


def phases_of(marks: dict) -> dict:
    """A step's phase durations (ms) from its host time stamps (seconds): ``marks`` holds ``start``,
    ``data0`` / ``data1`` (the first ``next``'s entry, the last one's return), ``data_s`` (time inside
    every ``next``), ``fb0`` / ``bwd0`` / ``fb1``, ``clip0`` / ``clip1``, ``opt0`` / ``opt1``, ``log0`` / ``log1``,
    and ``prev_end`` (the previous step's return; absent on the first); a phase without its stamps is None."""
    def ms(a, b):
        return 1e3 * (marks[b] - marks[a]) if a in marks and b in marks else None  # (None: a phase it did not stamp)

    row = {"between": ms("prev_end", "start"), "pre": ms("start", "data0"), "data": 1e3 * marks["data_s"],
           "h2d": ms("data1", "fb0"), "fwd": ms("fb0", "bwd0"), "bwd": ms("bwd0", "fb1"), "clip": ms("clip0", "clip1"),
           "opt": ms("opt0", "opt1"), "wait": ms("opt1", "log0"), "log": ms("log0", "log1")}
    return row


def slow_steps(steps: list[dict], warmup: int) -> dict:
    """Medians of each phase over the timed steps (``step`` > ``warmup``), and the timed steps over
    ``SLOW`` x the median step time with each phase's excess over its median (ms)."""
    timed = [s for s in steps if s["step"] > warmup and s.get("step_ms") is not None]
    if not timed:
        return {"medians": {}, "slow": []}
    med = {k: statistics.median(s[k] for s in timed if s.get(k) is not None)
           for k in ("step_ms", *PHASES) if any(s.get(k) is not None for s in timed)}
    slow = [{"step": s["step"], "step_ms": s["step_ms"],
             "excess_ms": {k: round(s[k] - med[k], 2) for k in PHASES if s.get(k) is not None and k in med}}
            for s in timed if s["step_ms"] > SLOW * med["step_ms"]]
    return {"medians": med, "slow": slow}


def _install(log_path: str) -> None:
    """Wrap TorchTitan's Trainer (the child process): one JSON line of phases per step to ``log_path``."""
    import torch
    import torchtitan.train as tt

    state = {"prev_end": None}

    class Timed:
        def __init__(self, it, marks):
            self.it, self.marks = it, marks

        def __next__(self):
            t = time.perf_counter()
            self.marks.setdefault("data0", t)
            try:
                return next(self.it)
            finally:
                self.marks["data1"] = time.perf_counter()
                self.marks["data_s"] = self.marks.get("data_s", 0.0) + self.marks["data1"] - t

    def wrap_method(obj, name, before, after):
        if getattr(getattr(obj, name), "_coda_probe", False):
            return
        fn = getattr(obj, name)

        def wrapped(*a, **k):
            state["marks"][before] = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                state["marks"][after] = time.perf_counter()

        wrapped._coda_probe = True
        setattr(obj, name, wrapped)

    train_step, fwd_bwd = tt.Trainer.train_step, tt.Trainer.forward_backward_step
    backward = torch.autograd.backward

    def timed_backward(*a, **k):
        m = state.get("marks")
        if m is not None:
            m.setdefault("bwd0", time.perf_counter())
        return backward(*a, **k)

    torch.autograd.backward = timed_backward

    def step(self, data_iterator):
        marks = state["marks"] = {"start": time.perf_counter()}
        if state["prev_end"] is not None:
            marks["prev_end"] = state["prev_end"]
        wrap_method(tt.dist_utils, "clip_grad_norm_", "clip0", "clip1")  # (each step: [coda] fused_clip swaps it in
        wrap_method(self.optimizers, "step", "opt0", "opt1")               # after the Trainer is built)
        wrap_method(self.metrics_processor, "log", "log0", "log1")
        snap = os.environ.get(mem_timeline.ENV) and self.step <= int(os.environ.get(mem_timeline.ENV + "_STEPS", "2"))
        if snap and self.step == 1:
            mem_timeline.start()
        try:
            return train_step(self, Timed(data_iterator, marks))
        finally:
            if snap:
                mem_timeline.after_step(self.step)
            state["prev_end"] = time.perf_counter()
            with open(log_path, "a") as f:
                f.write(json.dumps({"step": self.step, **phases_of(marks)}) + "\n")
                if self.step == self.job_config.training.steps:  # (after the last step: its allocator, by stream)
                    f.write(json.dumps({"alloc_streams": alloc_streams.record(self)}) + "\n")

    def forward_backward(self, *a, **k):
        m = state["marks"]
        m.setdefault("fb0", time.perf_counter())
        try:
            return fwd_bwd(self, *a, **k)
        finally:
            m["fb1"] = time.perf_counter()

    tt.Trainer.train_step, tt.Trainer.forward_backward_step = step, forward_backward


def child(argv: list[str]) -> int:
    """``train CONFIG OVERRIDES`` as ``coda_titan.cli`` takes them, with the Trainer's wrappers installed."""
    _install(os.environ[ENV_LOG])
    from coda_titan.cli import main as cli_main

    return cli_main(argv)


def _run(args, config: str, workdir: Path) -> dict:
    from scripts.compare.run import run_config, step_ms_of, summarize

    r = run_config(Path(config), steps=args.warmup + args.steps, workdir=workdir, attention="config", sets=args.set,
                   timeout=args.timeout, phases=True)
    steps = r.get("phase_rows", [])
    out = {"config": config, "returncode": r["returncode"], "error": r.get("error")}
    if "error" not in r:
        s = summarize(r["rows"], args.warmup, r["tokens_per_step"])
        out.update({k: s[k] for k in ("steps", "warmup_steps", "tokens_per_s", "step_ms", "step_ms_raw")})
        step_ms = step_ms_of(r["rows"], r["tokens_per_step"])
        for st in steps:
            st["step_ms"] = step_ms.get(st["step"])
    out["phases"] = steps
    out.update(slow_steps(steps, args.warmup))
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "child":
        return child(argv[1:])
    ap = argparse.ArgumentParser(prog="python -m scripts.probes.step_phases", description=__doc__.split("\n\n")[0])
    ap.add_argument("configs", nargs="*", default=["configs/llama3_1b_fp8_coda_compile.toml"])
    ap.add_argument("--set", action="append", default=[], help="KEY=VALUE overrides for every config")
    ap.add_argument("--steps", type=int, default=TIMED_STEPS)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--timeout", type=int, default=400)
    ap.add_argument("--tag", default="")
    ap.add_argument("--workdir", default="/tmp/step_phases")
    args = ap.parse_args(argv)
    from scripts.bench.common import header, out_json

    out = out_json("probe_step_phases" + (f"_{args.tag}" if args.tag else ""))
    doc = {**header(), "kind": "probe_step_phases", "steps": args.steps, "warmup": args.warmup, "sets": args.set,
           "method": __doc__.split("\n\n")[3].replace("\n", " "), "runs": []}
    for config in args.configs:
        doc["runs"].append(_run(args, config, Path(args.workdir)))
        Path(out).write_text(json.dumps(doc, indent=1))
        last = doc["runs"][-1]
        print(json.dumps({"config": config, "step_ms": last.get("step_ms"), "medians": last["medians"],
                          "slow": last["slow"]}), flush=True)
    print("wrote", out, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
