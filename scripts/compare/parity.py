"""Loss parity of two runs, and the run-to-run spread of repeated stock runs over every stored loss
curve (the noise any parity criterion has to live with).
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from scripts.compare.common import PARITY_SKIP, PARITY_TOL, PARITY_TOL_FP8, RESULTS


PART = 1e-3  # (a loss "parts" from a reference's at this relative difference, as docs/cute_backend.md counts it)


def first_parting(losses: dict[int, float], ref: dict[int, float]) -> int | None:
    """The first step whose loss differs from the reference's by more than ``PART`` relative."""
    for s in sorted(set(losses) & set(ref)):
        if abs(losses[s] / ref[s] - 1) > PART:
            return s
    return None


def parting_step(loss: list[float], ref: list[float]) -> int | None:
    """``first_parting`` of two runs' per-step losses (step 1 first)."""
    return first_parting(dict(enumerate(loss, 1)), dict(enumerate(ref, 1)))


def parity(a: list[float], b: list[float], skip: int = PARITY_SKIP, tol: float = PARITY_TOL) -> dict:
    """Largest |b - a| / |a| over the steps after ``skip`` (1-based steps), and NaN checks."""
    n = min(len(a), len(b))
    devs = [abs(b[i] - a[i]) / abs(a[i]) for i in range(skip, n)]
    worst = max(range(len(devs)), key=lambda i: devs[i]) if devs else None
    nan_a = any(not math.isfinite(x) for x in a)
    nan_b = any(not math.isfinite(x) for x in b)
    window = 10
    smooth = [
        abs(sum(b[i - window + 1:i + 1]) - sum(a[i - window + 1:i + 1])) / abs(sum(a[i - window + 1:i + 1]))
        for i in range(max(skip, window - 1), n)
    ]
    return {
        "compared_steps": len(devs),
        "after_step": skip,
        "mean_abs_rel_dev": statistics.fmean(devs) if devs else None,
        "steps_over_tolerance": sum(d > tol for d in devs),
        "max_rel_dev_10step_mean": max(smooth) if smooth else None,
        "max_rel_dev": max(devs) if devs else None,
        "max_rel_dev_step": (worst + skip + 1) if worst is not None else None,
        "non_finite": {"baseline": nan_a, "candidate": nan_b},
        "tolerance": tol,
        "met": bool(devs) and max(devs) <= tol and not nan_a and not nan_b and len(a) == len(b),
    }


def _precision(run: dict) -> str:
    """The run's precision label (``scripts.compare.run``: bf16, fp8, bf16-amp ...; bf16 in files older than it)."""
    return run.get("precision", "bf16")


def shown(config: str, precision: str) -> str:
    """A config as the tables name it: AMP runs (fp32 master weights, another recipe) carry their label."""
    return f"{config} ({precision})" if precision.endswith("-amp") else config


def _cohort(doc: dict, run: dict) -> str:
    """Runs with the same device, step count, data, seed, optimizer and schedule see the same batches."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    t = tomllib.loads(run["config_run"])
    same = {k: t.get(k) for k in ("training", "optimizer", "lr_scheduler", "debug")}
    ov = run.get("overrides") or []
    for flag, value in zip(ov, ov[1:]):  # (a seed set on the command line, ``--set debug.seed=N``: other weights)
        if flag.startswith("--debug."):
            try:  # (as the config file would have it: 7 an integer, as ``seed = 7`` is)
                value = tomllib.loads(f"v = {value}")["v"]
            except tomllib.TOMLDecodeError:
                pass
            same["debug"] = {**(same["debug"] or {}), flag.removeprefix("--debug."): value}
    return json.dumps({"device": doc["device"], "steps": len(run["loss"]), **same}, sort_keys=True)


def _stock(run: dict) -> bool:
    """A run of stock TorchTitan's ``llama3`` (its resolved config names no ``coda_llama3`` model)."""
    return "\nname = \"coda_llama3\"" not in run["config_run"]


def _commit(doc: dict) -> str | None:
    """The coda_titan commit a file's runs ran (``-dirty`` dropped: the device calls run a committed tree with the
    kept traces and plots moved aside); None in files older than the field."""
    c = doc.get("versions", {}).get("coda_titan_commit")
    return c.removesuffix("-dirty") if c else None


def _curve_paths() -> list[Path]:
    """Every stored loss curve, ``archive/`` included."""
    return sorted(RESULTS.glob("loss_curve_*.json")) + sorted(RESULTS.glob("archive/loss_curve_*.json"))


def _label(p: Path) -> str:
    """A stored file's name as the results page cites it (``archive/`` kept)."""
    return Path(p).name if Path(p).parent.name != "archive" else f"archive/{Path(p).name}"


def loss_runs(paths: list[Path] | None = None) -> list[dict]:
    """Every run of every stored loss curve (``archive/`` included), tagged with its file."""
    if paths is None:
        paths = _curve_paths()
    out = []
    for p in paths:
        doc = json.loads(Path(p).read_text())
        for r in doc["runs"]:
            out.append({
                "file": _label(p),
                # (a run under a coda_titan switch, CODA_TITAN_CE_PASS=exp say, is another arm than its config's)
                "config": Path(r["config"]).stem + "".join(f" [{k.removeprefix('CODA_TITAN_').lower()}={v}]"
                                                           for k, v in (r.get("switches") or {}).items()),
                "stock": _stock(r),
                "precision": _precision(r),
                "cohort": _cohort(doc, r),
                "commit": _commit(doc),
                "loss": r["loss"],
            })
    return out


def _stock_groups(runs: list[dict]) -> dict[tuple, list[dict]]:
    """The stock runs by (cohort, config, precision): each group's runs are repeats of one another (an AMP run's
    ``--training.dtype float32`` is an override, not in its config: its precision label tells it apart)."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        if r["stock"]:
            groups.setdefault((r["cohort"], r["config"], r["precision"]), []).append(r)
    return groups


def repeat_spread(runs: list[dict]) -> list[dict]:
    """Stock configs trained more than once in one cohort: the parity statistics of every pair of
    repeats. Same config, data, seed and code, so they measure run-to-run nondeterminism alone."""
    out = []
    for (_, config, _), rs in _stock_groups(runs).items():
        if len(rs) < 2:
            continue
        tol = PARITY_TOL_FP8 if rs[0]["precision"] == "fp8" else PARITY_TOL
        pairs = [parity(a["loss"], b["loss"], tol=tol) for i, a in enumerate(rs) for b in rs[i + 1:]]
        worst = max(pairs, key=lambda q: q["max_rel_dev"])
        out.append({
            "cohort": rs[0]["cohort"], "config": config, "precision": rs[0]["precision"], "runs": len(rs),
            "pairs": len(pairs), "tolerance": tol,
            "max_rel_dev": worst["max_rel_dev"], "max_rel_dev_step": worst["max_rel_dev_step"],
            "min_pair_max_rel_dev": min(q["max_rel_dev"] for q in pairs),
            "steps_over_tolerance": (min(q["steps_over_tolerance"] for q in pairs),
                                     max(q["steps_over_tolerance"] for q in pairs)),
            "compared_steps": worst["compared_steps"],
            "mean_abs_rel_dev": (min(q["mean_abs_rel_dev"] for q in pairs), max(q["mean_abs_rel_dev"] for q in pairs)),
            "pairs_within_tolerance": sum(q["met"] for q in pairs),
            "max_rel_dev_10step_mean": max(q["max_rel_dev_10step_mean"] for q in pairs),
        })
    return out


LAST_STEPS, LAST_MEAN_TOL = 50, 0.01  # the fp8 issue's end-of-run criterion: mean of the last 50 steps within 1%


def against_repeats(doc: dict, spreads: list[dict]) -> list[dict]:
    """Each candidate of a loss-curve result judged by the criterion that lives with the run-to-run
    noise: its largest and its mean absolute deviation from the baseline (after the first steps) no
    larger than the largest of the baseline config's own repeat pairs in the same cohort
    (``repeat_spread``), no non-finite loss, and the mean of the last 50 steps within 1% of the
    baseline's. ``inside`` is None where the baseline has no repeats in that cohort."""
    base = doc["runs"][0]
    key = (_cohort(doc, base), Path(base["config"]).stem, _precision(base))
    spread = next((q for q in spreads if (q["cohort"], q["config"], q["precision"]) == key), None)
    out = []
    for q, run in zip(doc["parity"], doc["runs"][1:]):
        last = min(LAST_STEPS, len(run["loss"]), len(base["loss"]))
        mb, mc = (statistics.fmean(r["loss"][-last:]) for r in (base, run))
        last_ok = abs(mc - mb) <= LAST_MEAN_TOL * abs(mb)
        finite = not q["non_finite"]["candidate"]
        inside = None if spread is None else (q["max_rel_dev"] <= spread["max_rel_dev"]
                                              and q["mean_abs_rel_dev"] <= spread["mean_abs_rel_dev"][1])
        out.append({"candidate": q["candidate"], "repeats": spread["runs"] if spread else 0, "inside": inside,
                    "last_mean_rel_dev": (mc - mb) / abs(mb), "met": bool(inside) and finite and last_ok})
    return out


def against_noise_floor(doc: dict) -> list[dict]:
    """The BF16 issue's parity criterion, where a loss-curve result holds the eager stock baseline and its
    compiled twin (``<baseline>_compile``, stock): each CODA candidate's mean abs. deviation and largest 10-step
    mean deviation no larger than the compiled twin's (the run-to-run noise of the same math, measured in the
    same run), and no non-finite loss. Empty where the result has no such twin."""
    stem = lambda r: Path(r["config"]).stem  # noqa: E731
    base = doc["runs"][0]
    twin = next((q for q, r in zip(doc["parity"], doc["runs"][1:])
                 if stem(r) == stem(base) + "_compile" and _stock(r)), None)
    if twin is None:
        return []
    out = []
    for q, r in zip(doc["parity"], doc["runs"][1:]):
        if _stock(r):
            continue
        within = (q["mean_abs_rel_dev"] <= twin["mean_abs_rel_dev"]
                  and q["max_rel_dev_10step_mean"] <= twin["max_rel_dev_10step_mean"])
        out.append({"candidate": q["candidate"], "noise": twin["candidate"], "within": within,
                    "met": within and not q["non_finite"]["candidate"]})
    return out


def noise_floor_record(paths: list[Path] | None = None) -> list[dict]:
    """``against_noise_floor`` in every stored loss curve that measured it: per CODA candidate, its mean abs. and
    largest 10-step-mean deviation beside the compiled twin's, the first step where each parted from the baseline,
    the run's seed and CODA commit. One run is one draw of where the trajectories part (a loss spike whose gradient
    norm varies between stock's own runs), so the criterion is read over several."""
    paths = _curve_paths() if paths is None else paths
    out = []
    for p in paths:
        doc = json.loads(Path(p).read_text())
        if "parity" not in doc or len(doc["parity"]) != len(doc["runs"]) - 1:
            continue
        by = {q["candidate"]: (q, r) for q, r in zip(doc["parity"], doc["runs"][1:])}
        parts = lambda r: parting_step(r["loss"], doc["runs"][0]["loss"])  # noqa: E731
        for v in against_noise_floor(doc):
            (q, r), (t, tr) = by[v["candidate"]], by[v["noise"]]
            out.append({"file": _label(p), "seed": (json.loads(_cohort(doc, r))["debug"] or {}).get("seed"),
                        "commit": _commit(doc), "candidate": shown(v["candidate"], _precision(r)),
                        "mean_abs_rel_dev": (q["mean_abs_rel_dev"], t["mean_abs_rel_dev"]),
                        "max_rel_dev_10step_mean": (q["max_rel_dev_10step_mean"], t["max_rel_dev_10step_mean"]),
                        "parts_at": (parts(r), parts(tr)), "met": v["met"]})
    return out


def track_record(paths: list[Path] | None = None, spreads: list[dict] | None = None) -> list[dict]:
    """Every stored run of each candidate config judged by ``against_repeats`` (its baseline's repeats in its
    cohort), grouped by (baseline, candidate): how often one config, as it stood on each day, met the criterion.
    Only candidates judged in two or more files, where the baseline had repeats."""
    paths = _curve_paths() if paths is None else paths
    spreads = repeat_spread(loss_runs(paths)) if spreads is None else spreads
    groups: dict[tuple, list[dict]] = {}
    for p in paths:
        doc = json.loads(Path(p).read_text())
        if "parity" not in doc or len(doc["parity"]) != len(doc["runs"]) - 1:
            continue
        base = Path(doc["runs"][0]["config"]).stem
        for v, q, run in zip(against_repeats(doc, spreads), doc["parity"], doc["runs"][1:]):
            if not v["repeats"]:
                continue
            last = v["last_mean_rel_dev"]
            why = [] if v["inside"] else ["deviations outside the repeats' spread"]
            why += [] if abs(last) <= LAST_MEAN_TOL else [f"last-{LAST_STEPS} mean {100 * last:+.2f}%"]
            why += ["non-finite loss"] if q["non_finite"]["candidate"] else []
            groups.setdefault((base, v["candidate"], _precision(run)), []).append(
                {"file": _label(p), "met": v["met"], "why": why})
    return [{"baseline": b, "candidate": shown(c, prec), "runs": rs}
            for (b, c, prec), rs in sorted(groups.items()) if len(rs) > 1]


def track_record_table(rec: list[dict]) -> str:
    """``track_record``'s rows as markdown: runs, how many met, each miss with its file and reason."""
    if not rec:
        return ""
    lines = ["Each candidate config judged in more than one stored loss curve, against its baseline's repeats (the "
             "criterion of the loss-curve tables; the config as it stood on each run's day):", "",
             "| candidate | baseline | runs | met | the misses |", "|---|---|---:|---:|---|"]
    for t in rec:
        miss = "; ".join(f"`{r['file']}`: {', '.join(r['why'])}" for r in t["runs"] if not r["met"])
        lines.append(f"| {t['candidate']} | {t['baseline']} | {len(t['runs'])} | "
                     f"{sum(r['met'] for r in t['runs'])} | {miss or 'none'} |")
    return "\n".join(lines)


def fragile_step(runs: list[dict], skip: int = PARITY_SKIP) -> dict | None:
    """The step after ``skip`` where the stock runs of the largest cohort disagree most (relative
    range of their losses), with every run's loss of that cohort at that step."""
    cohorts: dict[str, list[dict]] = {}
    for r in runs:
        cohorts.setdefault(r["cohort"], []).append(r)
    rs = max(cohorts.values(), key=len, default=[])
    stock = [r for r in rs if r["stock"]]
    if len(stock) < 2:
        return None
    n = min(len(r["loss"]) for r in rs)
    spread = lambda i: (max(r["loss"][i] for r in stock) - min(r["loss"][i] for r in stock)) / min(r["loss"][i] for r in stock)  # noqa: E731
    i = max(range(skip, n), key=spread)
    return {"step": i + 1, "stock_rel_range": spread(i), "stock_runs": len(stock),
            "losses": sorted(({"file": r["file"], "config": shown(r["config"], r["precision"]), "stock": r["stock"],
                               "loss": r["loss"][i]}
                              for r in rs), key=lambda e: e["loss"])}


def consensus_spread(runs: list[dict], skip: int = PARITY_SKIP, last: int = 50) -> dict | None:
    """Every run of a cohort measured against one reference: the step-wise mean loss of the stock config
    repeated most often in that cohort (leave-one-out for its own repeats). Per config: its runs, the
    range of their mean abs. relative deviation after ``skip``, of their signed mean over the last
    ``last`` steps, and how many of them end below the reference. A pairwise criterion says whether a
    candidate deviates more than the worst repeat pair; this says in which direction and how far."""
    groups = _stock_groups(runs)
    if not groups:
        return None
    (cohort, ref_config, ref_precision), reps = max(groups.items(), key=lambda kv: len(kv[1]))
    if len(reps) < 3:
        return None
    n = min(len(r["loss"]) for r in reps)

    def reference(exclude=None):
        others = [r["loss"] for r in reps if r is not exclude]
        return [statistics.fmean(step) for step in zip(*(lo[:n] for lo in others))]

    shared = reference()
    rows: dict[str, dict] = {}
    for r in runs:
        if r["cohort"] != cohort or len(r["loss"]) < n:
            continue
        ref = reference(r) if any(r is q for q in reps) else shared
        dev = [(r["loss"][i] - ref[i]) / ref[i] for i in range(skip, n)]
        name = shown(r["config"], r["precision"])
        row = rows.setdefault(name, {"config": name, "stock": r["stock"], "mean_abs": [], "last": []})
        row["mean_abs"].append(statistics.fmean(abs(d) for d in dev))
        row["last"].append(statistics.fmean(dev[-last:]))
    return {"reference": shown(ref_config, ref_precision), "repeats": len(reps), "steps": n, "after_step": skip,
            "last_steps": last,
            "configs": sorted(rows.values(), key=lambda q: (not q["stock"], q["config"]))}


def _consensus_lines(c: dict) -> list[str]:
    pct = lambda v: f"{100 * v:+.2f}%"  # noqa: E731
    lines = [
        f"Each stored run of that cohort against `{c['reference']}`'s consensus curve (the step-wise mean of its "
        f"{c['repeats']} repeats; each repeat against the others' mean): mean abs. relative deviation after step "
        f"{c['after_step']}, the signed mean over the last {c['last_steps']} steps, and how many runs end below it.",
        "",
        "| config | stock | runs | mean abs. deviation | last-50 mean deviation | runs ending below |",
        "|---|:---:|---:|---:|---:|---:|",
    ]
    for q in c["configs"]:
        k = len(q["last"])
        lines.append(f"| {q['config']} | {'yes' if q['stock'] else 'no'} | {k} | "
                     f"{100 * min(q['mean_abs']):.2f}%-{100 * max(q['mean_abs']):.2f}% | "
                     f"{pct(min(q['last']))} to {pct(max(q['last']))} | {sum(v < 0 for v in q['last'])} of {k} |")
    return lines + [""]


def spread_tables(runs: list[dict]) -> str:
    pct = lambda v: f"{100 * v:.2f}%"  # noqa: E731
    lines = []
    rep = repeat_spread(runs)
    if rep:
        lines += [
            "Run-to-run spread of the stock baselines: every pair of repeated runs of one stock config (same "
            "data, seed, code and GPU; every stored loss curve, `archive/` included).",
            "",
            "| config | runs | largest max deviation (step) | smallest max deviation | steps over tolerance | "
            "mean abs. deviation | largest max over 10-step means | pairs within tolerance |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for q in rep:
            lo, hi = q["steps_over_tolerance"]
            mlo, mhi = q["mean_abs_rel_dev"]
            lines.append(
                f"| {shown(q['config'], q['precision'])} | {q['runs']} | {pct(q['max_rel_dev'])} ({q['max_rel_dev_step']}) | "
                f"{pct(q['min_pair_max_rel_dev'])} | {lo}-{hi} of {q['compared_steps']} (over {100 * q['tolerance']:g}%) | "
                f"{pct(mlo)}-{pct(mhi)} | {pct(q['max_rel_dev_10step_mean'])} | {q['pairs_within_tolerance']} of {q['pairs']} |")
        lines.append("")
    c = consensus_spread(runs)
    if c:
        lines += _consensus_lines(c)
    f = fragile_step(runs)
    if f:
        lines += [
            f"The step where the {f['stock_runs']} stock runs of these curves disagree most is step {f['step']} "
            f"(their losses span {pct(f['stock_rel_range'])}). Every stored run's loss there:",
            "",
            "| loss | config | stock | file |",
            "|---:|---|:---:|---|",
        ]
        for e in f["losses"]:
            lines.append(f"| {e['loss']:.3f} | {e['config']} | {'yes' if e['stock'] else 'no'} | `{e['file']}` |")
        lines.append("")
    return "\n".join(lines).rstrip()
