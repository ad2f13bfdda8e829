"""The BF16 parity evidence of the results page: every pair of one day's BF16 loss curves on one GPU by kind
(stock against stock, CODA against stock, CODA against its own repeat), and one bf16 step's gradients
against the same step in fp32 (``scripts/probes/bf16_step_accuracy.py``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from scripts.compare.common import RESULTS
from scripts.compare.parity import PART, loss_runs, noise_floor_record, parity, parting_step

KINDS = ("stock / stock", "CODA / stock", "CODA / CODA repeat")


def _kind(a: dict, b: dict) -> str | None:
    if a["stock"] and b["stock"]:
        return KINDS[0]
    if a["stock"] != b["stock"]:
        return KINDS[1]
    return KINDS[2] if a["config"] == b["config"] else None  # (two different CODA configs: no class)


def pair_classes(runs: list[dict] | None = None) -> list[dict]:
    """For each (cohort, day) whose bf16 runs repeat a config (in one stored curve or across several): the
    parity statistics of every pair of its runs, gathered by kind of pair (a CODA run's deviation is taken
    against the stock run)."""
    runs = loss_runs() if runs is None else runs
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        day = re.search(r"\d{4}-\d{2}-\d{2}", r["file"])
        if r["precision"] in ("bf16", "bf16-amp") and day:  # (pure bf16 and AMP runs apart: two recipes)
            groups.setdefault((r["cohort"], day.group(0), r["precision"]), []).append(r)
    out = []
    for (_, day, precision), rs in sorted(groups.items(), key=lambda kv: kv[0][1:]):
        for commit, rs in _by_coda_commit(rs):
            if len({r["config"] for r in rs}) == len(rs):  # (no config ran twice: no run-to-run spread to set against)
                continue
            label = day if precision == "bf16" else f"{day} ({precision})"
            out.append(_classes(rs, f"{label}, CODA at {commit}" if commit else label))
    return out


def _by_coda_commit(rs: list[dict]) -> list[tuple[str | None, list[dict]]]:
    """A day's runs as one set per coda_titan commit its CODA runs ran (each with every stock run of the day:
    stock TorchTitan is the same code whatever our commit), so that two versions of CODA's kernels are neither
    pooled in one "CODA / stock" span nor paired as a "CODA / CODA repeat"; no commit named where there is one."""
    stock = [r for r in rs if r["stock"]]
    commits = sorted({r.get("commit") for r in rs if not r["stock"]}, key=str)
    if len(commits) <= 1:
        return [(None, rs)]
    return [(c, stock + [r for r in rs if not r["stock"] and r.get("commit") == c]) for c in commits]


def _classes(rs: list[dict], day: str) -> dict:
    """Every pair of one set's runs, by kind."""
    classes: dict[str, list[dict]] = {}
    for i, a in enumerate(rs):
        for b in rs[i + 1:]:
            kind = _kind(a, b)
            if kind is not None:
                base, cand = (b, a) if b["stock"] and not a["stock"] else (a, b)
                parts = parting_step(cand["loss"], base["loss"])
                classes.setdefault(kind, []).append({**parity(base["loss"], cand["loss"]), "parts_at": parts})
    return {"day": day, "files": sorted({r["file"] for r in rs}), "runs": len(rs),
            "classes": {k: _spread(classes[k]) for k in KINDS if k in classes}}


def _spread(pairs: list[dict]) -> dict:
    span = lambda key: (min(p[key] for p in pairs), max(p[key] for p in pairs))  # noqa: E731
    parted = [p["parts_at"] for p in pairs if p.get("parts_at") is not None]
    return {"pairs": len(pairs), "mean_abs_rel_dev": span("mean_abs_rel_dev"),
            "max_rel_dev_10step_mean": span("max_rel_dev_10step_mean"), "max_rel_dev": span("max_rel_dev"),
            "parts_at": (min(parted), max(parted)) if parted else None, "never_parted": len(pairs) - len(parted)}


def pair_table(groups: list[dict]) -> str:
    if not groups:
        return ""
    pct = lambda v: f"{100 * v[0]:.2f}-{100 * v[1]:.2f}%"  # noqa: E731
    lines = ["BF16 runs of one day on one GPU (same data, seed and step count), every pair by kind. Two bf16 runs of "
             "one config differ by their nondeterministic kernels alone (FA4's backward), two configs also by their "
             "rounding: a CODA config at parity deviates from stock about as much as stock deviates from itself. "
             f"Parts at: the first step whose losses differ by more than {PART:g} relative (the earliest and latest "
             "over the pairs; the runs share their trajectory until then).", "",
             "| day | runs (files) | pair | pairs | mean abs. deviation | largest 10-step-mean deviation | "
             "max deviation | parts at |", "|---|---:|---|---:|---:|---:|---:|---:|"]
    for g in groups:
        for kind, s in g["classes"].items():
            lines.append(f"| {g['day']} | {g['runs']} ({len(g['files'])}) | {kind} | {s['pairs']} | "
                         f"{pct(s['mean_abs_rel_dev'])} | {pct(s['max_rel_dev_10step_mean'])} | {pct(s['max_rel_dev'])} | "
                         f"{_parts(s)} |")
    return "\n".join(lines)


def noise_floor_table(rec: list[dict]) -> str:
    """``noise_floor_record`` as markdown: every stored run judged by the BF16 issue's criterion, with how many met."""
    if not rec:
        return ""
    pair = lambda v: f"{100 * v[0]:.2f}% / {100 * v[1]:.2f}%"  # noqa: E731
    at = lambda s: "never" if s is None else str(s)  # noqa: E731
    lines = ["The BF16 issue's parity criterion (CODA's mean abs. and largest 10-step-mean deviation from stock eager "
             "no larger than stock compiled's, in the same run) in every stored run that measured it: met in "
             f"{sum(r['met'] for r in rec)} of {len(rec)}. Each run is one draw of where the trajectories part "
             f"(parts at: the first step past {PART:g} relative).", "",
             "| file | seed | CODA commit | candidate | mean abs., CODA / compiled | largest 10-step mean, CODA / "
             "compiled | parts at, CODA / compiled | met |", "|---|---:|---|---|---:|---:|---:|:---:|"]
    for r in rec:
        lines.append(f"| `{r['file']}` | {r['seed']} | {r['commit'] or '-'} | {r['candidate']} | "
                     f"{pair(r['mean_abs_rel_dev'])} | {pair(r['max_rel_dev_10step_mean'])} | "
                     f"{at(r['parts_at'][0])} / {at(r['parts_at'][1])} | {'yes' if r['met'] else 'no'} |")
    by: dict[tuple, list[dict]] = {}
    for r in rec:
        by.setdefault((r["commit"], r["candidate"]), []).append(r)
    mean = lambda rs, key, i: sum(r[key][i] for r in rs) / len(rs)  # noqa: E731
    lines += ["", "The same, averaged over each commit's runs (each run one draw of where the trajectories part):", "",
              "| CODA commit | candidate | runs | met | mean abs., CODA / compiled | largest 10-step mean, CODA / compiled |",
              "|---|---|---:|---:|---:|---:|"]
    for (commit, cand), rs in by.items():
        lines.append(f"| {commit or '-'} | {cand} | {len(rs)} | {sum(r['met'] for r in rs)} | "
                     f"{pair((mean(rs, 'mean_abs_rel_dev', 0), mean(rs, 'mean_abs_rel_dev', 1)))} | "
                     f"{pair((mean(rs, 'max_rel_dev_10step_mean', 0), mean(rs, 'max_rel_dev_10step_mean', 1)))} |")
    return "\n".join(lines)


def _parts(s: dict) -> str:
    span, never = s["parts_at"], s["never_parted"]
    if span is None:
        return "never"
    text = f"{span[0]}" if span[0] == span[1] else f"{span[0]}-{span[1]}"
    return f"{text} ({never} never)" if never else text


WD_KINDS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1", "feed_forward.w2",
            "feed_forward.w3", "output", "tok_embeddings")


def step_accuracy_table(doc: dict, name: str | None = None) -> str:
    """The probe's summary: each bf16 model's first-step loss and gradients against fp32 and against stock eager."""
    state = doc.get("state", "init")
    start = ("the init weights and random tokens" if state == "init" else
             f"the weights after {state['steps']} steps of `{Path(state['config']).stem}`"
             + (f" (with {', '.join(state['sets'])})" if state.get("sets") else "") + " and its next batch")
    lines = [f"One bf16 step against the same step in fp32 ({f'`{name}`, ' if name else ''}{doc['model']}, seq "
             f"{doc['seq_len']} x batch "
             f"{doc['local_batch_size']}, {start}; {doc['device']}, {doc['date'][:10]}; "
             f"reference: {doc['reference']}). Gradient error: ||g - g_ref|| / ||g_ref|| over all gradients as one "
             "vector, and per parameter; sign flips: the share of elements whose sign differs (AdamW's first "
             "update is lr * sign(g)).", "",
             "| model | loss error | gradient error, whole | per parameter, median | largest (parameter) | "
             "sign flips, median | against stock eager: error | sign flips |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, s in doc["summary"].items():
        f, v = s["vs_fp32"], s["vs_stock_eager"]
        vs = f"{v['whole_rel']:.2e} | {100 * v['median_flips']:.2f}%" if v else "- | -"
        lines.append(f"| {name} | {s['loss_rel_err']:+.1e} | {f['whole_rel']:.2e} | {f['median_rel']:.2e} | "
                     f"{f['max_rel']:.2e} (`{f['max_rel_param']}`) | {100 * f['median_flips']:.2f}% | {vs} |")
    return "\n".join(lines + ["", step_accuracy_kinds(doc)] + (["", step_tensors_table(doc)] if "tensors" in doc else []))


def step_tensors_table(doc: dict) -> str:
    """``--tensors``: per model, each recorded tensor's error against fp32's, the median over layers and the largest
    (its layer)."""
    from scripts.probes.attention_tensors import KEYS

    lines = ["Each layer's residual stream `x`, attention inputs `q k v` (post-RoPE) and output `o`, and their "
             "gradients, against fp32's (`dx_sum`, `do_sum`: summed over the tokens): the median over layers / the "
             "largest (layer).", "", "| model | " + " | ".join(KEYS) + " |", "|---|" + "---:|" * len(KEYS)]
    for name, per in doc["tensors"]["summary"].items():
        lines.append(f"| {name} | " + " | ".join(
            f"{per[k]['median']:.2e} / {per[k]['max']:.2e} ({per[k]['max_layer']})" if k in per else "-"
            for k in KEYS) + " |")
    return "\n".join(lines)


STEP_KINDS = (*WD_KINDS[:7], "attention_norm", "ffn_norm", "norm", *WD_KINDS[7:])


def step_accuracy_kinds(doc: dict) -> str:
    """The same gradient errors per parameter kind (layers pooled: sqrt of the summed squared differences over
    the summed squared references), against fp32 and against stock eager: the whole-model number is mostly the LM
    head's (its gradient is most of the squared norm)."""
    from scripts.probes.weight_drift import kind

    lines = ["The same per parameter kind (layers pooled), against fp32, then against stock eager:", "",
             "| model | against | " + " | ".join(k.split(".")[-1] for k in STEP_KINDS) + " |",
             "|---|---|" + "---:|" * len(STEP_KINDS)]
    for against in ("vs_fp32", "vs_stock_eager"):
        for name, per in doc["params"].items():
            pooled: dict[str, list[float]] = {}
            for n, e in per.get(against, {}).items():
                acc = pooled.setdefault(kind(n), [0.0, 0.0])
                acc[0] += e["d2"]
                acc[1] += e["r2"]
            if pooled:
                cells = [f"{(pooled[k][0] / pooled[k][1]) ** 0.5:.2e}" if pooled.get(k, [0, 0])[1] else "-"
                         for k in STEP_KINDS]
                lines.append(f"| {name} | {against.removeprefix('vs_')} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ce_rounding_table(doc: dict) -> str:
    """``scripts/probes/ce_rounding.py``: the bf16 logits' rounding in the cross-entropy's gradient, two ways."""
    sh = doc["shape"]
    lines = [f"The cross-entropy's gradient with its logits rounded to bf16, in fp64 otherwise (CPU, {doc['date'][:10]}; "
             f"{sh['rows']} rows, vocab {sh['vocab']}, d {sh['dim']}; a calibrated model's rows, targets drawn from "
             "their softmax, sigma the logits' scale). `stored`: log-sum-exp, loss and softmax all of the rounded "
             "logits (stock's bf16 head; CODA's F4 since c6d0abd); `lse_fp32`: the softmax of the rounded logits "
             "with the log-sum-exp of the unrounded ones (CODA's F4 before); `_e5m2`: dlogits then cast to e5m2 (the "
             "fp8 head's); `stored_bf16`: `stored` with dlogits rounded to bf16 (the bf16 head's gradient pass); "
             "`exp_stored_bound`: a head without that pass (bf16 exp(l - c), c from the Cauchy-Schwarz bound less 70, "
             "the target's term apart in fp32; its margin: the smallest max l - c, above -87 for a normal bf16). "
             "Relative error against exact.", "",
             "| sigma | top p, median | dlogits: stored | lse_fp32 | dH = dlogits W: stored | lse_fp32 | "
             "dlogits row sum, lse_fp32 | dlogits: stored_e5m2 | lse_fp32_e5m2 | stored_bf16 | exp_stored_bound | "
             "margin |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in doc["rows"]:
        a, b = r["stored"], r["lse_fp32"]
        e5 = (f" {r['stored_e5m2']['dlogits']:.2e} | {r['lse_fp32_e5m2']['dlogits']:.2e} |" if "stored_e5m2" in r
              else " - | - |")
        ex = (f" {r['stored_bf16']['dlogits']:.2e} | {r['exp_stored_bound']['dlogits']:.2e} | {r['c_margin_min']:.1f} |"
              if "exp_stored_bound" in r else " - | - | - |")
        lines.append(f"| {r['sigma']:g} | {r['top_p_median']:.2f} | {a['dlogits']:.2e} | {b['dlogits']:.2e} | "
                     f"{a['dh']:.2e} | {b['dh']:.2e} | {b['row_sum_abs']:.1e} |" + e5 + ex)
    return "\n".join(lines)


def dw_rounding_table(doc: dict) -> str:
    """``scripts/probes/ce_rounding.py``'s ``dw_rounding``: dW_out's error under each cast of dlogits, per batch and
    summed over batches (empty where the file predates it), and dH's where the file has it."""
    rows = doc.get("dw_rounding")
    if not rows:
        return ""
    lines = [f"dW_out = dlogits^T H with dlogits cast three ways (same file, {rows[0]['batches']} batches of the rows "
             "above; `shared`: a direction every row of H shares, as a multiple of a row's own norm). `e5m2`: "
             "round-to-nearest-even (`fp8_lm_head_dw` before the sixty-third session); `e5m2_sr`: stochastic "
             "(`quantize_e5m2_sr`, a seed a batch); `bf16`. Relative error of one batch's dW, of the dW summed over "
             "the batches, and the coherence of the batches' errors (1: independent, sqrt(batches): one error "
             "repeated).", "", *_cast_rows(rows, ("one batch", "summed"), ("dw", "dw_sum", "coherence"))]
    if "dh" in rows[0]["bf16"]:
        tx = ("e5m2_sr_tx",) if "e5m2_sr_tx" in rows[0] else ()
        lines += ["", "The same casts in the head's dgrad (`fp8_lm_head_dgrad`: B2 on the codes): the relative error "
                  "of one batch's dH = dlogits W, and of G = sum over the batches of dH^T H (what a weight gradient "
                  "below the head sums of dH) with the coherence of its batches' errors."
                  + (" `e5m2_sr_tx`: the stochastic codes with each row's target entry exact (the knob's form since "
                     "the sixty-seventh session)." if tx else ""), "",
                  *_cast_rows(rows, ("dH one batch", "G summed"), ("dh", "dh_wgrad_sum", "dh_coherence"),
                              ("e5m2", "e5m2_sr", *tx, "bf16"))]
    return "\n".join(lines)


def _cast_rows(rows: list, names: tuple, keys: tuple, casts: tuple = ("e5m2", "e5m2_sr", "bf16")) -> list:
    """A table over (sigma, shared) of each cast's two relative errors (``names``) and coherence (``keys``)."""
    out = ["| sigma | shared | " + " | ".join(f"{c}: {names[0]} | {names[1]} | coherence" for c in casts) + " |",
           "|---:|---:|" + "---:|" * (3 * len(casts))]
    for r in rows:
        out.append(f"| {r['sigma']:g} | {r['shared']:g} | " + " | ".join(
            f"{r[c][keys[0]]:.2e} | {r[c][keys[1]]:.2e} | {r[c][keys[2]]:.2f}" for c in casts) + " |")
    return out


def precision_table(doc: dict) -> str:
    """``scripts/probes/cpu_precision.py``: each recipe's last-50 mean loss, and each pair's deviations."""
    sh = doc["shape"]
    lines = [f"Precision recipes on the CPU (the debug pair, {doc['steps']} steps, seq {sh['seq_len']} x batch "
             f"{sh['local_batch_size']}, lr {sh['lr']}; {doc['date'][:10]}; deterministic runs, so a pair differs by "
             "rounding alone): fp32; AMP (fp32 parameters, bf16 autocast); pure bf16 (the GPU configs' recipe). "
             "Deviations after step 20.", "",
             "| run | against | mean abs. deviation | largest 10-step-mean deviation | max deviation | last-50 mean loss |",
             "|---|---|---:|---:|---:|---:|"]
    last = doc["last50_mean"]
    for p in doc["pairs"]:
        lines.append(f"| {p['candidate']} | {p['reference']} | {100 * p['mean_abs_rel_dev']:.3f}% | "
                     f"{100 * p['max_rel_dev_10step_mean']:.3f}% | {100 * p['max_rel_dev']:.3f}% | "
                     f"{last[p['candidate']]:.4f} against {last[p['reference']]:.4f} |")
    return "\n".join(lines)


def _planned_arms(doc: dict) -> list[str]:
    """The arms a weight-drift call meant to run: its ``planned`` list, else its command's ``--arms`` (files written
    before the probe recorded it), else the probe's default."""
    from scripts.probes.weight_drift import CPU_DEFAULT, DEFAULT

    if "planned" in doc:
        return doc["planned"]
    words = doc["command"].split()
    if "--arms" not in words:
        return list(CPU_DEFAULT if "--cpu" in words else DEFAULT)
    rest = words[words.index("--arms") + 1:]
    return rest[:next((i for i, w in enumerate(rest) if w.startswith("--")), len(rest))]


def weight_drift_table(doc: dict, name: str) -> str:
    """``scripts/probes/weight_drift.py``: every (run, reference) pair's weight distance at each checkpoint, and at the
    last per parameter kind in units of the reference's own move between the last two checkpoints."""
    steps = [str(s) for s in doc["steps"]]
    last, prev = steps[-1], steps[-2] if len(steps) > 1 else None
    runs, planned = ", ".join(doc["arms"]), _planned_arms(doc)
    if len(planned) > len(doc["arms"]):
        runs += f" (the call ended before {', '.join(planned[len(doc['arms']):])})"
    lines = [f"Weights of bf16 runs from one init (`{name}`, {doc['device']}, {doc['date']}, `{doc['command']}`; runs in "
             f"order: {runs}): ||W - W_ref|| / ||W_ref|| over all parameters at each checkpoint; at step {last}, the "
             f"same distance in units of the reference's own move from step {prev} to {last} ({'whole' if prev else '-'} "
             "and per kind, layers pooled); the first step at which the run's loss differs from the reference's by more "
             f"than {doc['parting_threshold']:g} relative.", "",
             "| run | against | " + " | ".join(f"step {s}" for s in steps) + f" | moves @{last} | "
             + " | ".join(k.split(".")[-1] for k in WD_KINDS) + " | loss parts at |",
             "|---|---|" + "---:|" * (len(steps) + 2 + len(WD_KINDS))]
    zero = None
    for key, per in doc["distances"].items():
        run, ref = key.split("|")
        at = per[last]
        equal = {k for k, v in at.items() if v["rel"] == 0.0}
        zero = equal if zero is None else zero & equal
        moves = [at[k].get("per_update") if k in at else None for k in ("all", *WD_KINDS)]
        lines.append(f"| {run} | {ref} | " + " | ".join(f"{per[s]['all']['rel']:.2e}" for s in steps) + " | "
                     + " | ".join("-" if m is None else f"{m:.3f}" for m in moves)
                     + f" | {doc['arms'][run].get('parts_from', {}).get(ref) or '-'} |")
    if zero:
        lines += ["", f"Equal in every pair at step {last}: {', '.join(sorted(zero))}."]
    return "\n".join(lines)


def section(runs: list[dict] | None = None) -> str:
    parts = [pair_table(pair_classes(runs)), noise_floor_table(noise_floor_record())]
    for p in sorted(RESULTS.glob("probe_bf16_step_accuracy_*.json")):
        parts.append(step_accuracy_table(json.loads(p.read_text()), p.name))
    for p in sorted(RESULTS.glob("probe_ce_rounding_*.json")):
        doc = json.loads(p.read_text())
        parts += [ce_rounding_table(doc), dw_rounding_table(doc)]
    for p in sorted(RESULTS.glob("cpu_precision_*.json")):
        parts.append(precision_table(json.loads(p.read_text())))
    for p in sorted(RESULTS.glob("probe_weight_drift_*.json")):
        parts.append(weight_drift_table(json.loads(p.read_text()), p.name))
    return "\n\n".join(x for x in parts if x)
