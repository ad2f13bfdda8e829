"""Tables and plots of the stored training results (comparisons, loss curves, profiles), and their
section of the generated results page.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from scripts.compare.common import PARITY_SKIP, PARITY_TOL, PARITY_TOL_FP8, _latest, _say
from scripts.compare.targets import budget_lines, profile_side_by_side, targets
from scripts.compare.parity import (LAST_MEAN_TOL, LAST_STEPS, against_noise_floor, against_repeats, loss_runs, parity,
                                    repeat_spread, spread_tables, track_record, track_record_table)
from scripts.report import bf16_parity, memory, png

from .notes import SLOW_STEP, _alloc_streams_line, _capped_floor_line, _f, _slow_labels  # (_slow_labels: tests)
from .profiles import profile_table  # noqa: F401  (re-exported: scripts.compare.profile prints it)


def compare_table(doc: dict) -> str:
    base = {Path(r["config"]).stem: r for r in doc["runs"] if "error" not in r}
    what = f"**{doc['tag']}** · " if doc.get("tag") else ""
    if doc.get("sets"):
        what += "overrides: " + ", ".join(f"`{kv}`" for kv in doc["sets"]) + " · "
    if doc.get("attention", "config") != "config":
        what += f"attention forced to {doc['attention']} · "
    allocs = sorted({r.get("allocator") or "default" for r in doc["runs"]})
    if allocs != ["default"]:  # (PYTORCH_CUDA_ALLOC_CONF: the caching allocator's settings, which move the peak)
        what += "allocator " + ", ".join(f"`{a}`" for a in allocs) + " · "
    lines = [
        f"{what}Device: {doc['device']} · {doc['date'][:10]} · torch {doc['versions'].get('torch')} · "
        f"quack {doc['versions'].get('quack-kernels')} · flash-attn-4 {doc['versions'].get('flash-attn-4')} · "
        f"{doc['steps']} timed steps after {doc['warmup']} warm-up steps"
        + (f" (tokens/s over {doc['log_freq']}-step log windows, one GPU synchronization each)" if doc.get("log_freq", 1) > 1 else "")
        + f" · precision {doc.get('precision', 'bf16')} · "
        f"seq {doc['runs'][0]['seq_len']} × local batch {doc['runs'][0]['local_batch_size']}"
        + (f" · {doc['nproc']} processes (GPUs) per run (torchrun, FSDP2 unless overridden; tokens/s per GPU)" if doc.get("nproc", 1) > 1 else ""),
        "",
        "| config | attention | tokens/s | step ms (median) | step / floor | peak GiB | MFU % | vs compiled baseline | final loss |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    floor = doc.get("floor")
    for r in doc["runs"]:
        stem = Path(r["config"]).stem
        if "error" in r:
            lines.append(f"| {stem} | {r['attention']} | failed: {r['error'].splitlines()[0]} | | | | | | |")
            continue
        # (a variant such as <model>_coda_compile_<what> is set against the same compiled baseline)
        ref = base.get(_stock_of(stem))
        if ref is None and (alt := _stock_in(stem, base)) and base[alt].get("compile"):  # compiled by an override
            ref = base[alt]
        ratio = f"{r['tokens_per_s'] / ref['tokens_per_s']:.3f}x" if ref else "n/a"
        fl = floor.get(r.get("precision", "bf16")) if floor else None
        over = f"{r['step_ms'] / fl:.3f}" if fl and r["attention"] == "fa4" else "n/a"
        lines.append(
            f"| {stem} | {r['attention']} | {_f(r['tokens_per_s'], 0)} | {_f(r['step_ms'])} | {over} | {_f(r['peak_gib'], 2)}"
            f"{f' ({_f(live, 1)})' if (live := r.get('peak_active_gib')) is not None else ''} | "
            f"{_f(r['mfu'], 1)} | {ratio} | {r['loss'][-1]:.4f} |"
        )
    if any("peak_active_gib" in r for r in doc["runs"]):
        lines += ["", "Peak GiB: the caching allocator's reserved peak over every step, as TorchTitan logs it; in "
                  "parentheses the peak of live tensors over the timed steps (W&B's memory/max_active)."]
    if alloc := _alloc_streams_line(doc["runs"]):
        lines += ["", alloc]
    clocks = [(Path(r["config"]).stem, r["gpu_clocks"], r.get("step_ms")) for r in doc["runs"] if r.get("gpu_clocks")]
    if clocks:  # (energy a step: median power x median step; at the power cap every config draws alike)
        lines += ["", "GPU over the timed steps (`nvidia-smi` every {} ms; median, min-max; energy a step = median power x "
                  "median step): ".format(clocks[0][1]["interval_ms"])
                  + "; ".join(f"{stem} SM {c['sm_mhz']['median']:,.0f} MHz ({c['sm_mhz']['min']:,.0f}-{c['sm_mhz']['max']:,.0f}), "
                              f"{c['power_w']['median']:,.0f} W, {c['temp_c']['median']:.0f} C"
                              + (f", {c['power_w']['median'] * ms / 1e3:,.0f} J a step" if ms else "")
                              for stem, c, ms in clocks) + "."]
    slow = [(Path(r["config"]).stem, r["step_ms"], steps) for r in doc["runs"] if (steps := _slow_labels(r))]
    if slow:
        lines += ["", f"Timed steps over {SLOW_STEP:g}x their config's median (the tokens/s column is the mean over every "
                  "timed step, so these lower it; TorchTitan's GC runs at every 50th step; where the run recorded the "
                  "host's phases, the step number and the phase that grew most: `wait` is the host waiting for the GPU, "
                  "`between` the Trainer's work between steps, GC included): "
                  + "; ".join(f"{stem} {len(steps)} ({', '.join(steps)} ms against {med:.1f})"
                              for stem, med, steps in slow) + "."]
    if floor:
        where = "same lease" if floor.get("host") else "same GPU and day; before hosts were recorded"
        lines += ["", f"Floor ({floor['file']}, {where}): every GEMM of the step at the best of cuBLAS and quack, "
                  f"FA4 forward + backward, fused AdamW: bf16 {_f(floor.get('bf16'))} ms, fp8 {_f(floor.get('fp8'))} ms "
                  "(`python -m scripts.bench.floor`)."]
        if floor.get("capped"):
            lines += ["", _capped_floor_line(doc, floor["capped"])]
    else:
        lines += ["", "Step / floor: n/a (no floor was measured in this run's lease: `bash scripts/gpu_train.sh floor compare`)."]
    if doc.get("targets"):
        lines += ["", "| target | measured | met |", "|---|---:|:---:|"]
        for t in doc["targets"]:
            lines.append(f"| {t['config']}: {t['goal']} | {_f(t['value'], 3, 'x')} | {'yes' if t['met'] else 'no'} |")
    return "\n".join(lines)


def _stock_of(stem: str) -> str | None:
    """The compiled stock config a config is set against (``m_coda[_compile][_variant]``, ``m_liger[_compile]`` and
    ``m_baseline[_compile]`` -> ``m_baseline_compile``), None for a stem of none of those kinds."""
    name, n = re.subn(r"_(coda|baseline|liger)(_compile)?(_[a-z0-9_]+)?$", "_baseline_compile", stem)
    return name if n else None


def _stock_in(stem: str, runs: dict) -> str | None:
    """The stock config of ``runs`` that ``stem`` is set against in a scaling table: its compiled
    stock config, or else the stock config of the same model under the run's own flags (the 8B pair
    runs ``m_baseline`` and ``m_coda`` with ``--set compile.enable=true``); None for stock itself."""
    eager = re.sub(r"_coda(_compile)?(_[a-z0-9_]+)?$", "_baseline", stem)
    return next((s for s in (_stock_of(stem), eager) if s in runs and s != stem and "_coda" not in s), None)


def scaling_table(multi: dict, single: dict) -> str:
    """Tokens/s per GPU of each config on N GPUs (``compare --nproc N``) against the same config on
    one GPU of the same host and day (the scaling efficiency), CODA against stock at N GPUs, and the
    loss parity of CODA against stock at N GPUs beside the same pair's on one GPU."""
    one = {Path(r["config"]).stem: r for r in single["runs"] if "error" not in r}
    many = {Path(r["config"]).stem: r for r in multi["runs"] if "error" not in r}
    n = multi.get("nproc", 1)
    lines = [f"Scaling on {multi['device']} ({multi['date'][:10]}): {n} GPUs per run against one "
             f"(compare tags `{multi.get('tag')}` and `{single.get('tag')}`), tokens/s per GPU.", "",
             f"| config | tokens/s per GPU, {n} GPUs | 1 GPU | scaling efficiency | vs stock, {n} GPUs | vs stock, 1 GPU |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in multi["runs"]:
        stem = Path(r["config"]).stem
        if "error" in r:
            lines.append(f"| {stem} | failed: {r['error'].splitlines()[0]} | | | | |")
            continue
        if stem not in one:
            continue
        base = one[stem]["tokens_per_s"]
        ref_n, ref_1 = many.get(_stock_in(stem, many)), one.get(_stock_in(stem, one))
        vs_n = f"{r['tokens_per_s'] / ref_n['tokens_per_s']:.3f}x" if ref_n else "n/a"
        vs_1 = f"{base / ref_1['tokens_per_s']:.3f}x" if ref_1 else "n/a"
        lines.append(f"| {stem} | {_f(r['tokens_per_s'], 0)} | {_f(base, 0)} | {r['tokens_per_s'] / base:.3f} | {vs_n} | {vs_1} |")
    rows = []
    for stem, r in many.items():
        ref, stock = many.get(_stock_in(stem, many)), _stock_in(stem, many)
        if ref is None or "loss" not in r:
            continue
        p_n = parity(ref["loss"], r["loss"])
        p_1 = parity(one[stock]["loss"], one[stem]["loss"]) if stem in one and stock in one else None

        def cell(p, key):
            return "n/a" if p is None or p[key] is None else f"{100 * p[key]:.2f}%"
        finite = not any(p_n["non_finite"].values()) and not (p_1 and any(p_1["non_finite"].values()))
        rows.append(f"| {stem} vs {stock} | {p_n['compared_steps']} | {cell(p_n, 'mean_abs_rel_dev')} | "
                    f"{cell(p_1, 'mean_abs_rel_dev')} | {cell(p_n, 'max_rel_dev_10step_mean')} | "
                    f"{cell(p_1, 'max_rel_dev_10step_mean')} | {'none' if finite else 'yes'} |")
    if rows:
        lines += ["", f"Loss parity, CODA against stock on the same data (steps after {PARITY_SKIP}); the one-GPU pair "
                  "is the bf16 reference for the same measure (its global batch differs, so its steps are other data):", "",
                  f"| pair | steps compared | mean abs dev, {n} GPUs | 1 GPU | largest 10-step-mean dev, {n} GPUs | 1 GPU | NaN/inf |",
                  "|---|---:|---:|---:|---:|---:|:---:|", *rows]
    return "\n".join(lines)


def scaling_pairs() -> list[tuple[dict, dict]]:
    """(compare_fsdp<N><sfx>, compare_fsdp1<sfx>) result pairs of the same device and day
    (``gpu_train.sh fsdp2``; sfx names the model, e.g. ``_8b``)."""
    docs = [json.loads(p.read_text()) for p in _latest("compare")]

    def split(tag):
        m = re.fullmatch(r"fsdp(\d+)(.*)", tag or "")
        return (int(m[1]), m[2]) if m else (None, None)
    single = {(d["device"], d["date"][:10], split(d.get("tag"))[1]): d for d in docs if split(d.get("tag"))[0] == 1}
    out = []
    for d in docs:
        k, sfx = split(d.get("tag"))
        if d.get("nproc", 1) > 1 and k and (d["device"], d["date"][:10], sfx) in single:
            out.append((d, single[(d["device"], d["date"][:10], sfx)]))
    return out


def _unrun(doc: dict) -> str:
    """The runs a loss-curve call planned and did not reach (it stopped at its time limit; the file keeps the runs
    done): named, so that a missing noise-floor row reads as not run, not as left out."""
    rest = [Path(c).stem for c in doc.get("planned", [])[len(doc["runs"]):]]
    return f" The call ended before {', '.join(f'`{c}`' for c in rest)}." if rest else ""


def parity_table(doc: dict, spreads: list[dict] | None = None) -> str:
    tol = f"{100 * max((q.get('tolerance', PARITY_TOL) for q in doc['parity']), default=PARITY_TOL):g}%"
    precisions = {r.get("precision", "bf16") for r in doc["runs"]}
    amp = (f", {'+'.join(sorted(precisions))}: every run with fp32 master weights under TorchTitan's autocast"
           if all(p.endswith("-amp") for p in precisions) else "")
    lines = [
        f"Loss parity on {doc['device']} ({doc['date'][:10]}{amp}): {doc['steps']} steps, same data and seed; "
        f"largest relative loss deviation from `{Path(doc['runs'][0]['config']).stem}` after step {PARITY_SKIP}."
        + _unrun(doc),
        "",
        f"| candidate | max rel. deviation | at step | steps over {tol} | mean abs. deviation | max over 10-step means | "
        f"non-finite loss | every step within {tol} |",
        "|---|---:|---:|---:|---:|---:|:---:|:---:|",
    ]
    pct = lambda v: "n/a" if v is None else f"{100 * v:.2f}%"  # noqa: E731
    for q in doc["parity"]:
        lines.append(
            f"| {q['candidate']} | {pct(q['max_rel_dev'])} | {q['max_rel_dev_step']} | {q['steps_over_tolerance']} of "
            f"{q['compared_steps']} | {pct(q['mean_abs_rel_dev'])} | {pct(q['max_rel_dev_10step_mean'])} | "
            f"{'yes' if q['non_finite']['candidate'] else 'no'} | {'yes' if q['met'] else 'no'} |"
        )
    verdicts = against_repeats(doc, spreads or [])
    if any(v["repeats"] for v in verdicts):
        lines += ["", "Against the baseline's own repeats (the run-to-run spread below: every pair of its repeated runs in "
                  "this cohort): max and mean abs. deviation no larger than its largest pair's, no non-finite loss, and "
                  f"the mean of the last {LAST_STEPS} steps within {100 * LAST_MEAN_TOL:g}%.", "",
                  "| candidate | baseline repeats | deviations inside their spread | last-50 mean vs baseline | met |",
                  "|---|---:|:---:|---:|:---:|"]
        for v in verdicts:
            lines.append(f"| {v['candidate']} | {v['repeats']} | {'yes' if v['inside'] else 'no'} | "
                         f"{100 * v['last_mean_rel_dev']:+.2f}% | {'yes' if v['met'] else 'no'} |")
    noise = against_noise_floor(doc)
    if noise:
        lines += ["", f"Against the noise floor (`{noise[0]['noise']}` against the same baseline in this run): mean abs. "
                  "deviation and largest 10-step-mean deviation no larger than its, no non-finite loss.", "",
                  "| candidate | both no larger than the compiled stock run's | met |", "|---|:---:|:---:|"]
        lines += [f"| {v['candidate']} | {'yes' if v['within'] else 'no'} | {'yes' if v['met'] else 'no'} |" for v in noise]
    return "\n".join(lines)


def plot_compare(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in doc["runs"] if "error" not in r]
    if not runs:
        _say("no run succeeded: no chart")
        return
    names = [Path(r["config"]).stem.replace("llama3_", "") for r in runs]
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.6 * len(runs) + 2))
    colors = ["tab:orange" if "coda" in n else "tab:gray" for n in names]
    panels = (("tokens_per_s", "{:,.0f}", 1.18, "tokens/s (higher is better)"),
              ("peak_gib", "{:.1f}", 1.15, "peak reserved memory, GiB (lower is better)"))
    for ax, (key, fmt, margin, label) in zip(axes, panels):
        values = [r[key] for r in runs]
        ax.barh(names, values, color=colors)
        for i, v in enumerate(values):
            ax.text(v, i, " " + fmt.format(v), va="center", fontsize=8)
        ax.set_xlim(0, margin * max(values))
        ax.set_xlabel(label)
        ax.invert_yaxis()
    axes[1].set_yticklabels([])
    fig.suptitle(f"{doc['device']}, {doc['date'][:10]}: {doc['steps']} timed steps per config")
    fig.tight_layout()
    png.save(fig, path)
    plt.close(fig)


def _run_labels(runs: list[dict]) -> dict[int, str]:
    """Each run's config name, a config's later runs numbered (a repeat: ``name #2``)."""
    seen: dict[str, int] = {}
    out = {}
    for r in runs:
        stem = Path(r["config"]).stem
        seen[stem] = seen.get(stem, 0) + 1
        out[id(r)] = stem if seen[stem] == 1 else f"{stem} #{seen[stem]}"
    return out


def plot_loss_curve(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    norms = [r for r in doc["runs"] if r.get("grad_norm")]  # (stored since 2026-11-28: a third panel)
    panels = 3 if norms else 2
    fig, axes = plt.subplots(panels, 1, figsize=(9, 2 * panels + 2), sharex=True,
                             gridspec_kw={"height_ratios": [3, 1, 1][:panels]})
    label = _run_labels(doc["runs"])
    for r in doc["runs"]:
        axes[0].plot(range(1, len(r["loss"]) + 1), r["loss"], label=label[id(r)], lw=1)
    for r in norms:
        axes[2].plot(range(1, len(r["grad_norm"]) + 1), r["grad_norm"], lw=0.8, label=label[id(r)])
    if norms:
        axes[2].set_ylabel("grad norm")
        axes[2].set_yscale("log")
    axes[0].set_ylabel("loss")
    axes[0].legend()
    a = doc["runs"][0]["loss"]
    for r in doc["runs"][1:]:
        b = r["loss"]
        n = min(len(a), len(b))
        axes[1].plot(range(1, n + 1), [100 * (b[i] - a[i]) / abs(a[i]) for i in range(n)], lw=1,
                     label=f"{label[id(r)]} vs {label[id(doc['runs'][0])]}")
    tol = max((p.get("tolerance", PARITY_TOL) for p in doc.get("parity", [])), default=PARITY_TOL)
    axes[1].axhline(100 * tol, ls="--", color="k", lw=0.7)
    axes[1].axhline(-100 * tol, ls="--", color="k", lw=0.7)
    axes[1].axvline(PARITY_SKIP, ls=":", color="k", lw=0.7)
    axes[1].set_ylabel("rel. diff %")
    axes[-1].set_xlabel("step")
    axes[1].legend(fontsize=7)
    fig.suptitle(f"Loss curves on {doc['device']} ({doc['date'][:10]}), same data and seed")
    fig.tight_layout()
    png.save(fig, path)
    plt.close(fig)


def _flavor(profile: dict) -> str | None:
    """The model flavor a profile ran ("1B", "8B"; its run's ``model`` is ``<name>/<flavor>``)."""
    model = profile.get("run", {}).get("model")
    return model.split("/")[-1] if model else None


def _floor_of(profile: dict) -> dict | None:
    """The complete floor file (``scripts.bench.floor``) of this profile's device and day: the one measured
    on its host (machine and boot) if kept, here or archived under another name, else the day's."""
    from scripts.compare.common import RESULTS
    from scripts.compare.run import floor_files

    run = profile.get("run", {})
    docs = [doc for _, doc in floor_files(profile["device"], profile["date"], (RESULTS,), archived=True) if doc.get("complete")
            and doc.get("model") == _flavor(profile)
            and (doc.get("seq_len"), doc.get("local_batch_size")) == (run.get("seq_len"), run.get("local_batch_size"))]
    same_host = [d for d in docs if profile.get("host") and d.get("host") == profile["host"]]
    return (same_host or docs or [None])[0]


def family_table(coda: dict, stock: dict | None, floor: dict | None) -> str:
    """GPU ms per GEMM family and direction in one profiled step of CODA and of stock (the same
    device and day), beside the floor's bare GEMMs (``scripts.bench.floor``, times its layers)."""
    from scripts.compare.families import DIRECTIONS, FAMILIES

    fc = coda["summary"]["gemm_families"]["families_ms"]
    fs = stock["summary"]["gemm_families"]["families_ms"] if stock and "gemm_families" in stock["summary"] else {}
    best = {(g["weight"], g["precision"], g["direction"]): g["best_ms"] for g in floor["gemms"]} if floor else {}
    nl = floor["n_layers"] if floor else 0
    precision = coda["run"].get("precision", "bf16")

    def fl(w, prec, dirs):
        vals = [best.get((w, prec, d)) for d in dirs]
        return None if not floor or None in vals else (1 if w == "lm_head" else nl) * sum(vals)
    rows, tot = [], {"coda": 0.0, "stock": 0.0, "bf16": 0.0, "fp8": 0.0}
    for fam in FAMILIES:
        dirs = [(d, (d,)) for d in DIRECTIONS] if fam != "lm_head" else [("fwd+dgrad+wgrad", DIRECTIONS)]
        for label, ds in dirs:
            c = fc.get(f"{fam}/all", 0.0) if fam == "lm_head" else 0.0
            c += sum(fc.get(f"{fam}/{d}", 0.0) for d in ds)
            st = sum(fs.get(f"{fam}/{d}", 0.0) for d in ds) if fs else None
            fb = fl(fam, "bf16", ds)
            f8 = fl(fam, "fp8", ds) if fam != "lm_head" else fb  # (the LM head stays bf16 in both recipes)
            ref = f8 if precision == "fp8" else fb
            rows.append(f"| {fam} {label} | {_f(c, 2)} | {_f(st, 2)} | {_f(fb, 2)} | {_f(f8, 2)} | "
                        f"{f'{c / ref:.2f}x' if ref else 'n/a'} |")
            for k, v in (("coda", c), ("stock", st or 0.0), ("bf16", fb or 0.0), ("fp8", f8 or 0.0)):
                tot[k] += v
    ref = tot["fp8"] if precision == "fp8" else tot["bf16"]
    over = f"{tot['coda'] / ref:.2f}x" if ref else "n/a"
    lines = [f"GEMM families in one step: `{Path(coda['config']).stem}` against "
             f"`{Path(stock['config']).stem if stock else 'n/a'}` ({coda['device']}, {coda['date'][:10]}), GPU ms; "
             f"floor: {'n/a (no floor of this model and shape measured that day)' if not floor else 'the best of cuBLAS and quack per GEMM, x layers'}. "
             "CODA's programs count with their epilogues and every kernel they launch.", "",
             "| GEMM | CODA ms | stock ms | floor bf16 | floor fp8 | CODA / floor |", "|---|---:|---:|---:|---:|---:|", *rows,
             f"| **all** | {tot['coda']:.2f} | {_f(tot['stock'] if fs else None, 2)} | {_f(tot['bf16'] or None, 2)} | "
             f"{_f(tot['fp8'] or None, 2)} | {over} |"]
    left = coda["summary"]["gemm_families"].get("unattributed_gemm_ms", 0.0)
    if left:
        lines += ["", f"GEMM kernels of CODA's step that no family claimed: {left:.2f} ms."]
    return "\n".join(lines)


def every_profile() -> list[dict]:
    """Every stored profile (``profile_*.json`` in benchmarks/results, not the archive's), by file name."""
    from scripts.compare.common import RESULTS

    return [json.loads(p.read_text()) for p in sorted(RESULTS.glob("profile_*.json"))]


def family_pairs(profiles: list[dict]) -> list[tuple[dict, dict | None]]:
    """(CODA profile, stock profile of the same device, day, precision and model flavor) for every CODA
    profile that has the GEMM-family attribution."""
    out = []
    for doc in profiles:
        if "gemm_families" not in doc["summary"] or "_coda" not in Path(doc["config"]).stem:
            continue
        same = [d for d in profiles if "_baseline" in Path(d["config"]).stem and d["device"] == doc["device"]
                and d["date"][:10] == doc["date"][:10] and d["run"].get("precision") == doc["run"].get("precision")
                and _flavor(d) == _flavor(doc) and "gemm_families" in d["summary"]]
        out.append((doc, same[0] if same else None))
    return out


def section(pairs: list[tuple[dict, dict | None]] | None = None) -> str:
    """The training results (comparisons, loss curves, run-to-run spread, profiles) as markdown, links
    relative to docs/; ``pairs``: ``family_pairs`` of every stored profile, when the caller has them already."""
    parts = []
    for p in _latest("compare"):
        doc = json.loads(p.read_text())
        parts += [compare_table(doc), "", f"![step-time comparison](../benchmarks/results/{p.with_suffix('.png').name})", ""]
    for multi, single in scaling_pairs():
        parts += [scaling_table(multi, single), ""]
    runs = loss_runs()
    spreads = repeat_spread(runs)
    for p in _latest("loss_curve"):
        doc = json.loads(p.read_text())
        parts += [parity_table(doc, spreads), "", f"![loss curves](../benchmarks/results/{p.with_suffix('.png').name})", ""]
    spread = spread_tables(runs)
    if spread:
        parts += [spread, ""]
    record = track_record_table(track_record(spreads=spreads))
    if record:
        parts += [record, ""]
    bf16 = bf16_parity.section(runs)
    if bf16:
        parts += [bf16, ""]
    profiles = [json.loads(p.read_text()) for p in _latest("profile")]
    if len(profiles) > 1:
        parts += [profile_side_by_side(profiles), ""]
        for line in budget_lines(profiles):
            parts += [line, ""]
    for coda, stock in family_pairs(every_profile()) if pairs is None else pairs:  # (older days keep their floor)
        parts += [family_table(coda, stock, _floor_of(coda)), ""]
    for doc in profiles:
        parts += [profile_table(doc), ""]
    for p in [p for n in (2, 4, 8) for p in _latest(f"fsdp{n}_profile")]:  # sharded steps (rank 0), apart
        parts += [profile_table(json.loads(p.read_text())), ""]
    parts += [memory.section()]
    return "\n".join(parts).rstrip()


def refresh(doc: dict) -> dict:
    """Recompute the derived fields (targets, parity) of a result from its raw per-step values; a comparison
    that ran in a call of its own after the floor, on the same host (one lease), gets that floor from
    benchmarks/results (``same_lease_floor``: the same host and shape, never another host's)."""
    if doc["kind"] == "compare":
        if not doc.get("floor"):
            from scripts.compare.common import RESULTS
            from scripts.compare.run import same_lease_floor

            found = same_lease_floor(doc, RESULTS)
            if found:
                doc["floor"] = found
        doc["targets"] = targets(doc)
    elif doc["kind"] == "loss_curve":
        ref = doc["runs"][0]
        doc["parity"] = [
            {"baseline": Path(ref["config"]).stem, "candidate": Path(r["config"]).stem,
             **parity(ref["loss"], r["loss"], tol=PARITY_TOL_FP8 if r.get("precision") == "fp8" else PARITY_TOL)}
            for r in doc["runs"][1:]
        ]
    return doc


def refresh_all(results: Path | None = None) -> None:
    """Recompute the derived fields of the newest stored results and redraw their plots; then draw the plot
    of any other result stored without one (``scripts.compare --no-plot`` on the device) in ``results``, its
    JSON untouched."""
    from scripts.compare.common import RESULTS

    results = results or RESULTS
    draw = {"compare": plot_compare, "loss_curve": plot_loss_curve}
    for kind in draw:
        for p in _latest(kind):
            doc = refresh(json.loads(p.read_text()))
            p.write_text(json.dumps(doc, indent=1) + "\n")
            draw[kind](doc, p.with_suffix(".png"))
    for kind in draw:
        for p in sorted(results.glob(f"{kind}_*.json")):  # (not the archive's: some were kept without a plot)
            if not p.with_suffix(".png").exists():
                draw[kind](refresh(json.loads(p.read_text())), p.with_suffix(".png"))
                _say(f"drew {p.with_suffix('.png').name}")
