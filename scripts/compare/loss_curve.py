"""The loss-parity mode: train configs on the same data and seed; losses against the first.
"""

from __future__ import annotations

import json
from pathlib import Path

from scripts.compare.common import _header, _out_path, _say
from scripts.compare.run import run_config


def loss_curve(args) -> Path:
    """Each finished run is written at once (the file rewritten with every run so far, ``planned`` naming them
    all), so a call cut short by a device's time limit keeps the runs it finished; the plot and the parity lines
    come with the last one."""
    from scripts.report.training import plot_loss_curve, refresh  # (here: the report imports this package)

    doc = _header("loss_curve")
    doc.update(tag=args.tag, steps=args.steps, attention=args.attention, sets=args.set, runs=[],
               planned=[str(c) for c in args.configs])
    path = _out_path(Path(args.out), "loss_curve", doc["device"], doc["date"], extra=f"{args.tag}_" if args.tag else "")
    path.parent.mkdir(parents=True, exist_ok=True)
    for cfg in args.configs:
        r = run_config(Path(cfg), steps=args.steps, workdir=Path(args.workdir), attention=args.attention,
                       sets=args.set, timeout=args.timeout)
        rows = r.pop("rows")  # (each step's loss, and its gradient norm before clipping: where runs part)
        r["loss"], r["grad_norm"] = [x["loss"] for x in rows], [x["grad_norm"] for x in rows]
        doc["runs"].append(r)
        doc["precision"] = "+".join(sorted({r["precision"] for r in doc["runs"]}))
        refresh(doc)  # parity of each candidate against the first run
        path.write_text(json.dumps(doc, indent=1) + "\n")
        if len(doc["runs"]) < len(args.configs):
            _say(f"wrote {path} ({len(doc['runs'])} of {len(args.configs)} runs)")
    if not getattr(args, "no_plot", False):
        plot_loss_curve(doc, path.with_suffix(".png"))
    for line in summary_lines(doc):
        _say(line)
    _say(f"wrote {path}")
    return path


def summary_lines(doc: dict) -> list[str]:
    """What a finished loss-curve call says: each candidate's deviations from the first run (the measures the
    results page judges by) and the step where it parts from it; where the call ran stock compiled beside stock
    eager, each CODA run's verdict against that noise floor."""
    from scripts.compare.parity import PART, against_noise_floor, parting_step

    pct = lambda v: "n/a" if v is None else f"{100 * v:.2f}%"  # noqa: E731
    out = []
    for p, r in zip(doc["parity"], doc["runs"][1:]):
        parts = parting_step(r["loss"], doc["runs"][0]["loss"])
        out.append(f"{p['candidate']} vs {p['baseline']} after step {p['after_step']}: mean abs. deviation "
                   f"{pct(p['mean_abs_rel_dev'])}, largest 10-step mean {pct(p['max_rel_dev_10step_mean'])}, max "
                   f"{pct(p['max_rel_dev'])} (step {p['max_rel_dev_step']}; every step within {pct(p['tolerance'])}: "
                   f"{'yes' if p['met'] else 'no'}); parts (past {PART:g}) "
                   + (f"at step {parts}" if parts else "never"))
    for v in against_noise_floor(doc):
        out.append(f"{v['candidate']} against the noise floor ({v['noise']} vs the same baseline): mean abs. and "
                   f"10-step deviations no larger than its: {'met' if v['met'] else 'MISSED'}")
    return out
