"""The command line of ``python -m scripts.compare`` (see the package docstring).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from scripts.compare.common import PARITY_SKIP, RESULTS, ROOT, _say
from scripts.compare.run import compare
from scripts.compare.loss_curve import loss_curve
from scripts.compare.profile import profile


TIMED_STEPS, WARMUP = 50, 10


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.compare", description="Step-time comparison of training configs, a loss-parity mode, and a kernel profile.")
    ap.add_argument("configs", nargs="*", help="TOML configs, run in this order")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--loss-curve", action="store_true", help="train configs on the same data and seed; losses vs the first")
    mode.add_argument("--profile", action="store_true", help="profile one step of one config (torch profiler)")
    mode.add_argument("--report", action="store_true", help="regenerate plots, docs/results.md and the README headline from the committed JSON")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (compare: 50), total steps (loss curve: 300, profile: 20)")
    ap.add_argument("--warmup", type=int, default=WARMUP, help="steps excluded from timing (compare)")
    ap.add_argument("--attention", choices=["config", "fa4", "sdpa"], default="config")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="TorchTitan override for every run")
    ap.add_argument("--out", default=str(RESULTS), help="where result JSON and PNG go")
    ap.add_argument("--no-plot", action="store_true", help="write the result JSON without its PNG (a device call returns "
                    "few files); the report (--report) draws every result's missing plot")
    ap.add_argument("--workdir", default=str(ROOT / "outputs" / "compare"), help="run folders (logs, W&B, traces)")
    ap.add_argument("--log-freq", type=int, default=1, help="compare and profile: TorchTitan's metrics.log_freq (1: a line, "
                    "and a GPU synchronization, every step; N: tokens/s over N-step windows, as a config logging every N "
                    "steps trains, and a profiled step the host enqueued ahead); compare: the warm-up must be a multiple of it")
    ap.add_argument("--tag", default="", help="name part of the result file (compare_<tag>_<gpu>_<date>.json, loss_curve_<tag>_...)")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per run")
    ap.add_argument("--nproc", type=int, default=1, help="compare and profile: GPUs of this host per run (torchrun; FSDP2 over all "
                    "of them unless --set gives parallelism.data_parallel_* degrees); tokens/s is per GPU; a "
                    "profile is rank 0's, written as fsdp<N>_profile_*.json")
    ap.add_argument("--keep-trace", action="store_true", help="profile: also write the chrome trace, gzipped, next to the JSON")
    mode.add_argument("--resummarize", nargs=2, metavar=("PROFILE_JSON", "TRACE"),
                      help="derive a stored profile's summary again from the trace its run kept (--keep-trace)")
    args = ap.parse_args(argv)
    if args.resummarize:
        from scripts.compare.profile import resummarize

        resummarize(*args.resummarize)
        return 0
    if args.report:
        from scripts.report.pages import write_all

        write_all()
        return 0
    if not args.configs:
        ap.error("name at least one config")
    for c in args.configs:
        if not Path(c).is_file():
            ap.error(f"config {c!r} not found")
    for kv in args.set:
        if "=" not in kv:
            ap.error(f"--set takes KEY=VALUE, got {kv!r}")
    if args.log_freq < 1 or (args.log_freq > 1 and args.loss_curve) or (not args.profile and args.warmup % args.log_freq):
        ap.error("--log-freq takes a positive count (in the step-time comparison one that divides --warmup), "
                 "not in the loss-curve mode")
    if args.nproc < 1 or (args.nproc > 1 and args.loss_curve):
        ap.error("--nproc takes a positive count, and only in the step-time comparison and the profile")
    from coda_titan.cli import UserError

    try:
        return _run_mode(ap, args)
    except UserError as e:  # a config the schema refuses: before any run starts
        print(f"compare: error: {e}", file=sys.stderr)
        return 2


def _run_mode(ap, args) -> int:
    if args.loss_curve:
        if args.steps is not None and args.steps <= PARITY_SKIP:
            ap.error(f"--loss-curve needs more than the {PARITY_SKIP} steps its parity skips as warm-up; got --steps {args.steps}")
        if len(args.configs) < 2:
            ap.error("--loss-curve takes two or more configs: the reference first, then the candidates")
        args.steps = args.steps or 300
        loss_curve(args)
    elif args.profile:
        if len(args.configs) != 1:
            ap.error("--profile takes one config")
        args.steps = args.steps or 20
        profile(args)
    else:
        # (50: after 10 warm-up steps the window holds one of TorchTitan's GC steps, every 50th, at the rate
        # training pays it; 40 weighed it 1.25x, and float8's GC step costs more than CODA's)
        args.steps = args.steps or TIMED_STEPS
        path = compare(args)
        failed = [r["config"] for r in json.loads(path.read_text())["runs"] if "error" in r]
        if failed:
            _say(f"failed runs: {', '.join(failed)}")
            return 1
    return 0

