"""scripts.compare: log parsing, timing and parity arithmetic, targets, the derived-config writer,
a real (CPU) comparison run end to end, and that the README section is the one generated from the
committed results."""

import json
import os
import time
import math
from pathlib import Path

import pytest

from scripts import compare
from scripts.compare import run
from scripts.report import training

from .conftest import CONFIGS, ROOT

LINE = ("[titan] 2026-11-21 21:03:10,096 - root - INFO - \x1b[31mstep: {step:2}  \x1b[32mloss: {loss:8.5f}  "
        "\x1b[38;2;180;60;0mgrad_norm:  1.1330  \x1b[38;2;54;234;195mmemory: {mem:5.2f}GiB(2.78%)  "
        "\x1b[34mtps: {tps:,}  \x1b[36mtflops: 1,234.50  \x1b[35mmfu: {mfu:.2f}%\x1b[39m\n")


def _log(rows):
    return "noise line\n" + "".join(LINE.format(**r) for r in rows)


def test_parse_log_reads_every_field_and_strips_colors():
    rows = [dict(step=s, loss=10.0 - s, mem=20.0 + s, tps=1000 * s, mfu=s / 10) for s in (1, 2, 3)]
    text = _log(rows).replace("loss:  7.00000", "loss:      nan")
    got = compare.parse_log(text)
    assert [r["step"] for r in got] == [1, 2, 3]
    assert got[1]["loss"] == 8.0 and math.isnan(got[2]["loss"])
    assert got[2]["memory_gib"] == 23.0 and got[2]["tps"] == 3000 and got[2]["tflops"] == 1234.5
    assert got[0]["mfu"] == pytest.approx(0.1)


def test_summarize_excludes_warmup_from_timing_but_keeps_all_losses_and_peak():
    tps = [100, 200, 1000, 500, 1000]
    rows = [dict(step=i + 1, loss=float(i), memory_gib=[9.0, 1, 1, 1, 1][i], tps=t, tflops=0, mfu=float(i)) for i, t in enumerate(tps)]
    s = compare.summarize(rows, warmup=2, tokens_per_step=1000)
    assert s["steps"] == 3
    assert s["step_ms_raw"] == [1000.0, 2000.0, 1000.0]
    assert s["step_ms"] == 1000.0  # median
    assert s["tokens_per_s"] == pytest.approx(3000 / 4.0)  # total tokens / total time, not the mean of tps
    assert s["peak_gib"] == 9.0 and s["loss"] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert s["mfu"] == pytest.approx(3.0)
    with pytest.raises(ValueError, match="warm-up"):
        compare.summarize(rows, warmup=5, tokens_per_step=1000)


def test_summarize_weighs_log_windows_by_their_steps():
    """With ``--log-freq`` N each logged tokens/s is the mean over the N steps since the line before: the
    timed windows are those after the warm-up, each weighed by its steps (here 1 + 10 + 10 steps logged
    at steps 1, 10, 20, 30 with a warm-up of 10: two timed windows of 10 steps)."""
    rows = [dict(step=s, loss=1.0, memory_gib=1.0, tps=t, tflops=0, mfu=1.0)
            for s, t in ((1, 10), (10, 100), (20, 1000), (30, 500))]
    s = compare.summarize(rows, warmup=10, tokens_per_step=1000)
    assert s["steps"] == 20 and s["step_ms_raw"] == [1000.0, 2000.0] and s["step_ms_steps"] == [20, 30]
    assert s["tokens_per_s"] == pytest.approx(20 * 1000 / (10 * 1.0 + 10 * 2.0))
    uneven = compare.summarize(rows[:2] + [dict(rows[2], step=12)], warmup=1, tokens_per_step=1000)
    assert uneven["steps"] == 11 and uneven["tokens_per_s"] == pytest.approx(11 * 1000 / (9 * 10.0 + 2 * 1.0))
    assert "step_ms_steps" not in compare.summarize([dict(r, step=i + 1) for i, r in enumerate(rows)], warmup=1,
                                                    tokens_per_step=1000)


def test_log_freq_reaches_torchtitan_and_the_expected_step_lines():
    o = run._overrides(60, Path("/tmp/x"), [], (), log_freq=10)
    assert o[o.index("--metrics.log_freq") + 1] == "10"
    assert run.logged_steps(60, 10) == [1, 10, 20, 30, 40, 50, 60] and run.logged_steps(3, 1) == [1, 2, 3]
    with pytest.raises(SystemExit):  # (a warm-up that is not a multiple: its first window would mix warm-up steps)
        compare.main(["--log-freq", "3", "--warmup", "10", str(CONFIGS / "debug_cpu_coda.toml")])
    with pytest.raises(SystemExit):  # (a loss curve needs every step's loss)
        compare.main(["--loss-curve", "--log-freq", "10", str(CONFIGS / "debug_cpu_baseline.toml"),
                      str(CONFIGS / "debug_cpu_coda.toml")])


def test_profile_runs_with_the_log_freq_asked(tmp_path, monkeypatch):
    """``--profile --log-freq 10``: the profiled run logs (and waits for the GPU) every 10 steps only."""
    from scripts.compare import profile as profile_mode

    seen = {}

    def fake_run_config(cfg, **kw):
        seen.update(kw)
        return {"error": "stopped here", "rows": []}

    monkeypatch.setattr(profile_mode, "run_config", fake_run_config)
    with pytest.raises(SystemExit, match="no profiler trace"):
        compare.main(["--profile", "--log-freq", "10", "--steps", "15", str(CONFIGS / "debug_cpu_coda.toml"),
                      "--out", str(tmp_path / "res"), "--workdir", str(tmp_path / "work")])
    assert seen["log_freq"] == 10 and seen["steps"] == 15


def test_parity_statistics():
    a = [10.0] * 30
    b = [10.0] * 30
    b[25] = 10.5  # 5% at step 26
    b[5] = 20.0  # before step 20: ignored
    p = compare.parity(a, b)
    assert p["max_rel_dev"] == pytest.approx(0.05) and p["max_rel_dev_step"] == 26
    assert p["steps_over_tolerance"] == 1 and p["compared_steps"] == 10 and not p["met"]
    assert p["max_rel_dev_10step_mean"] == pytest.approx(0.005)
    assert compare.parity(a, a)["met"]
    b2 = list(a)
    b2[-1] = float("nan")
    assert compare.parity(a, b2)["non_finite"]["candidate"] and not compare.parity(a, b2)["met"]


def test_targets_compare_coda_with_the_compiled_baseline_only():
    def run(stem, tps, mem):
        return {"config": f"configs/{stem}.toml", "tokens_per_s": tps, "peak_gib": mem}

    doc = {"runs": [run("x_baseline", 90, 60), run("x_baseline_compile", 100, 40), run("x_coda", 125, 30),
                    run("x_coda_compile", 105, 39)]}
    t = {(x["config"], x["goal"].split()[1]): x for x in compare.targets(doc)}
    assert t[("x_coda", "1.10x")]["met"] and t[("x_coda", "1.10x")]["value"] == 1.25  # (bf16: issue 18's targets)
    assert t[("x_coda", "0.80x")]["met"] and t[("x_coda", "0.80x")]["value"] == 0.75
    assert not t[("x_coda_compile", "1.10x")]["met"] and "1.050x" in t[("x_coda_compile", "1.10x")]["why"]
    assert not t[("x_coda_compile", "0.80x")]["met"]
    assert not any("floor" in x["goal"] for x in compare.targets(doc))  # (no floor in this lease)
    # fp8 runs against issue 19's; a floor in the lease adds bf16's step / floor target
    fp8 = {"runs": [dict(r, precision="fp8") for r in doc["runs"]]}
    assert {x["goal"].split()[1] for x in compare.targets(fp8)} == {"1.25x", "0.90x"}
    doc["floor"] = {"bf16": 100.0}
    for r, ms in zip(doc["runs"], (1, 1, 107, 109)):
        r["step_ms"] = ms
    t = {(x["config"], x["goal"].split()[1]): x for x in compare.targets(doc)}
    assert t[("x_coda", "1.08x")]["met"] and not t[("x_coda_compile", "1.08x")]["met"]
    # a failed CODA run is a missed target, a comparison without the compiled baseline has none
    doc["runs"][2]["error"] = "exit 1"
    assert not [x for x in compare.targets(doc) if x["config"] == "x_coda"][0]["met"]
    assert compare.targets({"runs": [run("y_baseline", 1, 1), run("y_coda", 2, 1)]}) == []



def test_a_config_variant_has_no_target_but_is_set_against_the_compiled_baseline():
    def run(stem, tps):
        return {"config": f"/tmp/{stem}.toml", "tokens_per_s": tps, "peak_gib": 30, "attention": "fa4",
                "step_ms": 1.0, "mfu": 1.0, "loss": [1.0], "seq_len": 8, "local_batch_size": 1}

    doc = {"runs": [run("x_baseline_compile", 100), run("x_coda_compile", 110), run("x_coda_compile_no_wgrad", 105)],
           "device": "d", "date": "2026-11-22", "versions": {}, "steps": 1, "warmup": 1}
    assert [t["config"] for t in compare.targets(doc)] == ["x_coda_compile", "x_coda_compile"]  # not the variant
    rows = {line.split(" | ")[0][2:]: line for line in training.compare_table(doc).splitlines() if line.startswith("| x_")}
    assert "| 1.050x |" in rows["x_coda_compile_no_wgrad"] and "| 1.100x |" in rows["x_coda_compile"]


def _table_run(stem, **extra):
    """A step-time comparison's run as the table reads it (one timed step; ``extra`` overrides)."""
    return {"config": f"configs/{stem}.toml", "tokens_per_s": 100, "peak_gib": 30, "attention": "fa4", "step_ms": 1.0,
            "mfu": 1.0, "loss": [1.0], "seq_len": 8, "local_batch_size": 1, **extra}


def _curve_run(config, loss, *, coda=False, seed=42):
    return {"config": f"configs/{config}.toml", "loss": loss, "precision": "fp8",
            "config_run": f'[model]\nname = "{"coda_llama3" if coda else "llama3"}"\n\n[debug]\nseed = {seed}\n'}


def test_repeat_spread_pairs_repeats_of_one_stock_config_only(tmp_path):
    base = [5.0] * 30
    bump = lambda i, v: [v if j == i else x for j, x in enumerate(base)]  # noqa: E731
    doc = {"device": "d", "runs": [_curve_run("b", base), _curve_run("c", bump(25, 9.0), coda=True)]}
    doc2 = {"device": "d", "runs": [_curve_run("b", bump(24, 5.1)), _curve_run("c", base, coda=True)]}
    doc3 = {"device": "d", "runs": [_curve_run("b", bump(26, 9.0), seed=1)]}  # other data: not a repeat
    paths = []
    for i, d in enumerate((doc, doc2, doc3)):
        paths.append(tmp_path / f"loss_curve_{i}.json")
        paths[-1].write_text(json.dumps(d))
    runs = compare.loss_runs(paths)
    assert [r["stock"] for r in runs] == [True, False, True, False, True]
    (q,) = compare.repeat_spread(runs)  # the two CODA runs are no repeats: their code may differ
    assert q["config"] == "b" and q["runs"] == 2 and q["pairs"] == 1
    assert q["max_rel_dev"] == pytest.approx(0.02) and q["max_rel_dev_step"] == 25
    assert q["steps_over_tolerance"] == (1, 1) and q["pairs_within_tolerance"] == 0
    f = compare.fragile_step(runs)
    assert f["step"] == 25 and f["stock_runs"] == 2  # not step 26 (other cohort), not CODA's step 26 bump
    assert f["stock_rel_range"] == pytest.approx(0.02)
    assert [e["loss"] for e in f["losses"]] == [5.0, 5.0, 5.0, 5.1]
    table = compare.spread_tables(runs)
    assert "| b | 2 | 2.00% (25) |" in table and "step 25" in table
    assert q["max_rel_dev_10step_mean"] == pytest.approx(0.1 / 50)  # one 10-step window holds the bump


def test_consensus_spread_measures_every_run_against_the_mean_of_the_baselines_repeats(tmp_path):
    """The most repeated stock config's step-wise mean is the reference (its own repeats each against the
    mean of the others); each config gets the range of its runs' mean abs. deviation and last-50 signed
    mean, and how many end below; runs of another cohort stay out."""
    n = 80
    reps = [[5.0 + e] * n for e in (-0.05, 0.0, 0.05)]  # three repeats: the reference is 5.0
    low = [5.0] * 30 + [4.9] * (n - 30)  # a candidate 2% below from step 31
    docs = [{"device": "d", "runs": [_curve_run("b", reps[0]), _curve_run("c", low, coda=True)]},
            {"device": "d", "runs": [_curve_run("b", reps[1]), _curve_run("b", reps[2])]},
            {"device": "d", "runs": [_curve_run("c", [1.0] * n, coda=True, seed=1)]}]  # other data
    paths = []
    for i, d in enumerate(docs):
        paths.append(tmp_path / f"loss_curve_{i}.json")
        paths[-1].write_text(json.dumps(d))
    c = compare.consensus_spread(compare.loss_runs(paths))
    assert c["reference"] == "b" and c["repeats"] == 3 and c["steps"] == n
    b, cand = c["configs"]
    assert b["config"] == "b" and b["stock"] and len(b["last"]) == 3
    # the middle repeat sits on the others' mean; the outer ones 0.075 off theirs (5.025 or 4.975)
    assert sorted(b["last"]) == pytest.approx([-0.075 / 5.025, 0.0, 0.075 / 4.975])
    assert cand["config"] == "c" and not cand["stock"] and cand["last"] == pytest.approx([-0.02])  # (steps 31-80)
    assert cand["mean_abs"] == pytest.approx([0.02 * 50 / 60])  # after step 20: 60 steps, 50 of them off
    table = compare.spread_tables(compare.loss_runs(paths))
    assert "| c | no | 1 | 1.67%-1.67% | -2.00% to -2.00% | 1 of 1 |" in table


def test_a_seed_set_on_the_command_line_is_a_cohort_of_its_own(tmp_path):
    """``gpu_train.sh parity`` with PARITY_SEED runs the configs (seed 42 in their files) with ``--debug.seed N``:
    those runs start from other weights, so they are no repeat of the configs' runs, while the overrides every
    run has (steps, dump folder) leave the cohort as it is."""
    common = ["--training.steps", "30", "--job.dump_folder", "/tmp/x", "--checkpoint.no-enable"]
    runs = [dict(_curve_run("b", [5.0] * 30), overrides=common), dict(_curve_run("b", [5.0] * 30), overrides=[]),
            dict(_curve_run("b", [5.0] * 30), overrides=common + ["--debug.seed", "7"]),
            dict(_curve_run("b", [5.0] * 30, seed=7), overrides=common)]
    path = tmp_path / "loss_curve_0.json"
    path.write_text(json.dumps({"device": "d", "runs": runs}))
    cohorts = [r["cohort"] for r in compare.loss_runs([path])]
    assert cohorts[0] == cohorts[1] != cohorts[2] == cohorts[3]


def test_a_run_under_a_coda_titan_switch_is_another_arm_than_its_config(tmp_path):
    """A loss-curve run records the coda_titan switches of its environment (``CODA_TITAN_CE_PASS=exp``: F4
    without its gradient pass, an arm its config does not name; not the compile cache's folder): the results
    page names such a run apart from its config's runs, so it is neither their repeat nor pooled with them; runs
    without the field (older files) keep their config's name."""
    from scripts.compare import run as run_mod

    runs = [_curve_run("c", [5.0] * 30, coda=True), dict(_curve_run("c", [5.0] * 30, coda=True), switches={}),
            dict(_curve_run("c", [5.0] * 30, coda=True), switches={"CODA_TITAN_CE_PASS": "exp"})]
    path = tmp_path / "loss_curve_0.json"
    path.write_text(json.dumps({"device": "d", "runs": runs}))
    assert [r["config"] for r in compare.loss_runs([path])] == ["c", "c", "c [ce_pass=exp]"]
    env = {"PATH": "/bin", "CODA_TITAN_CACHE": "/tmp/c", "CODA_TITAN_CE_PASS": "exp", "CODA_TITAN_B1_PASS": "inductor"}
    assert run_mod.switches(env) == {"CODA_TITAN_B1_PASS": "inductor", "CODA_TITAN_CE_PASS": "exp"}


def test_a_candidate_is_judged_against_the_baselines_own_repeats(tmp_path):
    """The fp8 issue's parity criterion: a candidate's max and mean abs. deviation no larger than the
    baseline's largest repeat pair's (same cohort), no NaN, and the last-50 mean within 1%; the
    results page shows the verdict under each loss-curve table."""
    base = [5.0] * 80
    bump = lambda i, v, c=base: [v if j == i else x for j, x in enumerate(c)]  # noqa: E731
    scaled = lambda f, start, c=base: [x * f if j >= start else x for j, x in enumerate(c)]  # noqa: E731
    rep = {"device": "d", "runs": [_curve_run("b", bump(40, 5.5, scaled(1.015, 20)))]}  # repeat: max 10%, mean ~1.6%
    cands = {"inside": bump(50, 5.15), "too_far": bump(50, 6.0), "last_mean": scaled(1.012, 30),
             "nan": bump(70, float("nan"))}
    doc = {"device": "d", "date": "2026-11-24", "steps": 80,
           "runs": [_curve_run("b", base)] + [_curve_run(n, c, coda=True) for n, c in cands.items()]}
    for i, d in enumerate((rep, doc)):
        (tmp_path / f"loss_curve_{i}.json").write_text(json.dumps(d))
    doc["parity"] = [{"candidate": n, **compare.parity(base, c, tol=0.015)} for n, c in cands.items()]
    spreads = compare.repeat_spread(compare.loss_runs(sorted(tmp_path.glob("loss_curve_*.json"))))
    got = {v["candidate"]: (v["inside"], v["met"]) for v in compare.against_repeats(doc, spreads)}
    assert got["inside"] == (True, True) and got["too_far"] == (False, False), got
    assert got["last_mean"] == (True, False) and not got["nan"][1], got  # inside the spread, but 1.2% off at the end
    table = training.parity_table(doc, spreads)
    assert "| inside | 2 | yes |" in table and "| too_far | 2 | no |" in table
    other = dict(doc, runs=[_curve_run("b", base, seed=1)] + doc["runs"][1:])  # a cohort without repeats
    assert {v["inside"] for v in compare.against_repeats(other, spreads)} == {None}
    assert "own repeats" not in training.parity_table(other, spreads)


def test_track_record_counts_each_candidates_verdicts_over_every_stored_curve(tmp_path):
    """A config judged in several stored loss curves gets one row: how many of its runs met the criterion
    against the baseline's repeats, and each miss with its file and reason; a candidate judged once, or
    against a baseline without repeats, gets none."""
    base = [5.0] * 80
    bump = lambda i, v, c=base: [v if j == i else x for j, x in enumerate(c)]  # noqa: E731
    scaled = lambda f, start, c=base: [x * f if j >= start else x for j, x in enumerate(c)]  # noqa: E731
    curves = [  # (the baseline's run, {candidate: loss}); the first two baselines are repeats (max 10%)
        (base, {"c": bump(50, 5.15), "once": bump(50, 5.15)}),
        (bump(40, 5.5, scaled(1.015, 20)), {"c": scaled(1.012, 30, bump(40, 5.5, scaled(1.015, 20)))}),
        (base, {"c": bump(50, 6.0)}),
    ]
    paths = []
    for i, (b, cands) in enumerate(curves):
        doc = {"device": "d", "date": "2026-11-28", "steps": 80,
               "runs": [_curve_run("b", b)] + [_curve_run(n, c, coda=True) for n, c in cands.items()],
               "parity": [{"candidate": n, **compare.parity(b, c, tol=0.015)} for n, c in cands.items()]}
        paths.append(tmp_path / f"loss_curve_{i}.json")
        paths[-1].write_text(json.dumps(doc))
    (t,) = compare.track_record(paths)
    assert (t["baseline"], t["candidate"]) == ("b", "c")
    assert [r["met"] for r in t["runs"]] == [True, False, False]
    assert t["runs"][1]["why"] == ["last-50 mean +1.20%"]  # inside the spread, 1.2% off at the end
    assert t["runs"][2]["why"] == ["deviations outside the repeats' spread"]
    table = compare.track_record_table(compare.track_record(paths))
    assert "| c | b | 3 | 1 | `loss_curve_1.json`: last-50 mean +1.20%; `loss_curve_2.json`: deviations" in table
    alone = [tmp_path / "loss_curve_0.json"]  # without the second file the baseline has no repeats
    assert compare.track_record(alone) == []


def test_amp_runs_are_repeats_only_of_amp_runs_and_keep_their_own_track_record(tmp_path):
    """An AMP run (``--training.dtype float32``: an override, not in its config text) sees the same batches as the
    pure-bf16 runs of its config but trains another recipe: its stock runs are repeats of AMP runs only, its
    candidates' verdicts are a track-record row of their own, and the tables name the precision."""
    base = [5.0] * 80
    bump = lambda i, v, c=base: [v if j == i else x for j, x in enumerate(c)]  # noqa: E731

    def doc(prec, b, cand):
        runs = [dict(_curve_run("b", b), precision=prec), dict(_curve_run("c", cand, coda=True), precision=prec)]
        return {"device": "d", "date": "2026-11-29", "steps": 80, "runs": runs,
                "parity": [{"candidate": "c", **compare.parity(b, cand)}]}

    docs = [doc("bf16", base, bump(50, 5.05)), doc("bf16", bump(40, 5.5), bump(50, 5.05, bump(40, 5.5))),
            doc("bf16-amp", base, bump(50, 5.3)), doc("bf16-amp", bump(40, 5.1), bump(50, 5.3, bump(40, 5.1)))]
    paths = []
    for i, d in enumerate(docs):
        paths.append(tmp_path / f"loss_curve_{i}.json")
        paths[-1].write_text(json.dumps(d))
    runs = compare.loss_runs(paths)
    spreads = {q["precision"]: q for q in compare.repeat_spread(runs)}
    assert set(spreads) == {"bf16", "bf16-amp"} and all(q["runs"] == 2 for q in spreads.values())
    assert spreads["bf16"]["max_rel_dev"] == pytest.approx(0.1) and spreads["bf16-amp"]["max_rel_dev"] == pytest.approx(0.02)
    # (pooled, the AMP candidate's 6% would sit inside the bf16 repeats' 10%: apart, it is outside the AMP repeats' 2%)
    rec = {t["candidate"]: [r["met"] for r in t["runs"]] for t in compare.track_record(paths)}
    assert rec == {"c": [True, True], "c (bf16-amp)": [False, False]}
    assert "| b (bf16-amp) | 2 | 2.00% (41) |" in compare.spread_tables(runs)
    assert "bf16-amp: every run with fp32 master weights" in training.parity_table(docs[2], list(spreads.values()))
    assert "bf16-amp" not in training.parity_table(docs[0], list(spreads.values()))


def test_a_bf16_candidate_is_judged_against_the_compiled_stock_runs_deviation_in_the_same_run():
    """The BF16 issue's criterion: where a result holds the eager stock baseline and its compiled twin, each CODA
    candidate's mean abs. and largest 10-step-mean deviation must be no larger than the twin's; the results
    page says so under the loss-curve table; a result without the twin gets no verdict."""
    base = [5.0] * 80
    noisy = [5.0 + (0.05 if j % 2 else -0.05) for j in range(80)]  # mean abs. 1%, 10-step means ~0
    cands = {"llama3_x_compile": noisy, "quiet": [5.0 + (0.02 if j % 2 else -0.02) for j in range(80)],
             "drift": [5.0] * 40 + [5.1] * 40}  # mean abs. 1.33% (40 of the 60 steps after 20 off by 2%)
    doc = {"device": "d", "date": "2026-11-28", "steps": 80,
           "runs": [_curve_run("llama3_x", base)] + [_curve_run(n, c, coda=n != "llama3_x_compile") for n, c in cands.items()],
           "parity": [{"candidate": n, **compare.parity(base, c)} for n, c in cands.items()]}
    got = {v["candidate"]: (v["noise"], v["met"]) for v in compare.against_noise_floor(doc)}
    assert got == {"quiet": ("llama3_x_compile", True), "drift": ("llama3_x_compile", False)}
    table = training.parity_table(doc)
    assert "| quiet | yes | yes |" in table and "| drift | no | no |" in table
    lone = dict(doc, runs=doc["runs"][:1] + doc["runs"][2:], parity=doc["parity"][1:])
    assert compare.against_noise_floor(lone) == [] and "noise floor" not in training.parity_table(lone)
    assert "The call ended" not in table  # (no plan recorded, or every planned run done)
    cut = dict(lone, planned=["configs/llama3_x.toml", "configs/quiet.toml", "configs/drift.toml", "configs/llama3_x_compile.toml"])
    assert "The call ended before `llama3_x_compile`." in training.parity_table(cut)
    assert "The call ended" not in training.parity_table(dict(cut, planned=cut["planned"][:3]))


def test_budget_lines_give_the_gemm_time_left_for_the_target():
    def prof(stem, span, gemm, other):
        return {"config": f"configs/{stem}.toml", "run": {"precision": "fp8"}, "summary": {"gpu_span_ms": span, "categories_ms": {
            "gemm (cuBLAS/other)": gemm, "attention": other}}}

    base = prof("m_fp8_baseline_compile", 250.0, 100.0, 150.0)
    (line,) = compare.budget_lines([base, prof("m_fp8_coda_compile", 240.0, 140.0, 100.0)])
    assert "200.0 ms" in line and "100.0 ms for every GEMM" in line and "at least" in line  # 250/1.25 - 100
    coda = prof("m_fp8_coda_compile", 240.0, 130.0, 110.0)
    (line,) = compare.budget_lines([base, coda])
    assert "90.0 ms for every GEMM" in line and "less than" in line and "idle (" not in line  # (not recorded)
    coda["summary"]["gpu_idle_ms"] = 15.0  # (part of the 110 ms outside the GEMMs)
    (line,) = compare.budget_lines([base, coda])
    assert "90.0 ms for every GEMM of the step, less than" in line
    assert "GPU idle (15.0 ms;" in line and "105.0 ms would be left, at least what the baseline's GEMMs take" in line
    assert compare.budget_lines([prof("m_fp8_coda_compile", 240.0, 130.0, 110.0)]) == []  # no baseline profiled


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.toml")))
def test_derived_config_round_trips(name, tmp_path):
    from coda_titan.cli import _load_toml

    doc = _load_toml(CONFIGS / name)
    out = tmp_path / name
    out.write_text(compare.dump_toml(doc))
    assert _load_toml(out) == doc
    for attention in ("fa4", "sdpa"):
        changed = compare.with_attention(doc, attention)
        assert compare._attention_of(changed) == attention
        assert {k: v for k, v in changed.items() if k != "model"} == {k: v for k, v in doc.items() if k != "model"}


def test_trace_summary_groups_kernels(tmp_path):
    events = [
        {"cat": "kernel", "name": "nvjet_sm90_tst_256x128", "ts": 0, "dur": 300},
        {"cat": "kernel", "name": "kernel_cutlass_kernel_flash_attncuteflash_bwd_sm90", "ts": 300, "dur": 200},
        {"cat": "kernel", "name": "kernel_cutlass_kernel_quackepiloguefrontendGemmMod_rms_partial_epi", "ts": 500, "dur": 400},
        {"cat": "kernel", "name": "nvjet_sm90_tst_256x128", "ts": 900, "dur": 100},
        {"cat": "kernel", "name": "triton_poi_fused_add", "ts": 1250, "dur": 50},  # after 250 us idle
        {"cat": "kernel", "name": "triton_poi_fused_mul", "ts": 1260, "dur": 10},  # overlaps: no gap
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5000},
        {"cat": "cpu_op", "name": "aten::item", "ts": 1100, "dur": 100},
        {"cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 1110, "dur": 80},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 1200, "dur": 5},
        {"cat": "cuda_runtime", "name": "cudaMalloc", "ts": 1210, "dur": 30},
        {"cat": "cuda_runtime", "name": "cudaMalloc", "ts": 9000, "dur": 30},  # outside the step's span
    ]
    (tmp_path / "t.json").write_text(json.dumps({"traceEvents": events}))
    s = compare.summarize_trace(str(tmp_path / "t.json"))
    assert s["kernel_launches"] == 6 and s["gpu_span_ms"] == 1.3
    assert s["gpu_idle_ms"] == 0.25 and s["gpu_idle_intervals"] == 1
    assert s["blocking_runtime_calls"] == {"count": 1, "ms": 0.08, "names": ["cudaStreamSynchronize"]}
    (gap,) = s["top_idle"]
    assert gap["us"] == 250 and gap["after_kernel"] == "nvjet_sm90_tst_256x128" and gap["before_kernel"] == "triton_poi_fused_add"
    assert gap["host_ops"] == ["cudaStreamSynchronize", "aten::item", "aten::mm"]
    assert s["allocator_calls"] == {"cudaMalloc": [1, 0.03]}
    assert s["idle_by_phase"] == {"unknown": {"intervals": 1, "ms": 0.25, "host_bound_intervals": 0, "host_bound_ms": 0.0}}
    events = events[:4] + events[6:7]
    (tmp_path / "t.json").write_text(json.dumps({"traceEvents": events}))
    s = compare.summarize_trace(str(tmp_path / "t.json"))
    assert s["gpu_kernel_ms"] == 1.0 and s["kernel_launches"] == 4 and s["gpu_span_ms"] == 1.0 and s["gpu_idle_ms"] == 0
    assert s["categories_ms"] == {"coda/quack gemm+epilogue": 0.4, "gemm (cuBLAS/other)": 0.4, "attention": 0.2}
    assert s["top_kernels"][0]["calls"] in (1, 2)


def test_trace_summary_lists_every_kernel_outside_the_gemms(tmp_path):
    """``outside_gemms``: every kernel that is not a GEMM, attention, the optimizer or a collective, largest
    first, beyond the top list too; quack's final rms reduction (a cutlass kernel without a GEMM) is one of
    them; the profile table states their sum with the idle, and issue 19's 15 ms for a CODA fp8 profile."""
    events = [{"cat": "kernel", "name": "nvjet_sm90_tst_256x128", "ts": 0, "dur": 1000},
              {"cat": "kernel", "name": "kernel_cutlass_kernel_quackrms_final_reduceRmsFinalReduce_object", "ts": 1000, "dur": 30},
              {"cat": "kernel", "name": "multi_tensor_apply_kernel", "ts": 1030, "dur": 40}]
    events += [{"cat": "kernel", "name": f"triton_poi_fused_{i}", "ts": 1100 + 10 * i, "dur": 10 - i} for i in range(5)]
    (tmp_path / "t.json").write_text(json.dumps({"traceEvents": events}))
    s = compare.summarize_trace(str(tmp_path / "t.json"), top=2)
    names = [k["name"] for k in s["outside_gemms"]]
    assert names[0].startswith("kernel_cutlass_kernel_quackrms_final_reduce") and len(names) == 6
    assert names[1:] == [f"triton_poi_fused_{i}" for i in range(5)] and len(s["top_kernels"]) == 2
    assert s["categories_ms"]["gemm (cuBLAS/other)"] == 1.0
    doc = {"config": "configs/x_fp8_coda_compile.toml", "run": {"precision": "fp8"}, "device": "d",
           "profiled_step": 3, "summary": s}
    text = training.profile_table(doc)
    assert "0.1 ms of kernels" in text and "at most 15 ms" in text and "| `triton_poi_fused_4` |" in text
    assert "at most 15 ms" not in training.profile_table({**doc, "run": {"precision": "bf16"}})


@pytest.mark.slow
def test_compare_end_to_end_on_cpu(tmp_path, cache_dir, monkeypatch):
    """Two real runs through coda-titan train; the JSON holds what was run and W&B holds the losses."""
    monkeypatch.setenv("CODA_TITAN_CACHE", str(cache_dir))
    monkeypatch.setenv("WANDB_MODE", "offline")
    rc = compare.main([str(CONFIGS / "debug_cpu_baseline.toml"), str(CONFIGS / "debug_cpu_coda.toml"),
                       "--steps", "2", "--warmup", "1", "--set", "metrics.enable_wandb=true",
                       "--out", str(tmp_path / "res"), "--workdir", str(tmp_path / "work")])
    assert rc == 0
    (path,) = (tmp_path / "res").glob("compare_cpu_*.json")
    doc = json.loads(path.read_text())
    assert path.with_suffix(".png").is_file()
    assert doc["device"] == "cpu" and doc["versions"]["torchtitan"] == "0.2.2"
    for r in doc["runs"]:
        assert r["returncode"] == 0 and r["steps"] == 2 and len(r["loss"]) == 3 and len(r["step_ms_raw"]) == 2
        assert r["wandb"]["loss_steps"] == 3 and r["wandb"]["matches_console"], r["wandb"]
        live = r["wandb"]["max_active_gib"]  # per step, from W&B: the timed steps' peak is reported apart
        assert sorted(live) == ["1", "2", "3"] and r["peak_active_gib"] == max(live["2"], live["3"])
        assert r["peak_active_gib_warmup"] == live["1"]
        assert "--training.steps" in r["overrides"] and "[model]" in r["config_run"]
        phases = r["host_phases"]  # (the Trainer wrapped by scripts.probes.step_phases: the host's time per phase)
        assert phases["medians"]["step_ms"] == pytest.approx(r["step_ms"]) and phases["medians"]["fwd"] > 0
        assert r["alloc_streams"] == {}  # (scripts.probes.alloc_streams after the last step: no CUDA here)
    # same data and seed: the CODA reference programs track the baseline closely
    a, b = (r["loss"] for r in doc["runs"])
    assert max(abs(x - y) / y for x, y in zip(a, b)) < 1e-3


# --- the committed results --------------------------------------------------------------------------


RESULTS = sorted((ROOT / "benchmarks" / "results").glob("*.json"))


def test_results_page_is_generated_from_the_committed_json():
    assert training.section() in (ROOT / "docs" / "results.md").read_text()


@pytest.mark.parametrize("path", [p for p in RESULTS if p.name.startswith(("compare_", "loss_curve_"))], ids=lambda p: p.name)
def test_committed_results_are_complete_and_consistent(path):
    doc = json.loads(path.read_text())
    for key in ("device", "date", "versions", "runs", "command"):
        assert doc[key], key
    assert doc["versions"]["torch"] and doc["versions"]["torchtitan"] == "0.2.2"
    derived = json.loads(json.dumps(doc))
    assert training.refresh(derived) == doc  # targets / parity are what the raw values give
    for r in doc["runs"]:
        assert r["returncode"] == 0 and "error" not in r
        assert r["wandb"]["matches_console"] and r["wandb"]["loss_steps"] == len(r["loss"])
        assert all(math.isfinite(x) for x in r["loss"])
        if doc["kind"] == "compare":  # (log windows of log_freq steps each: --log-freq)
            f = doc.get("log_freq", 1)
            assert len(r["step_ms_raw"]) * f == r["steps"] == doc["steps"]
            assert len(r["loss"]) == len(run.logged_steps(doc["steps"] + doc["warmup"], f))
            assert r["tokens_per_s"] == pytest.approx(r["tokens_per_step"] * r["steps"] / (f * sum(r["step_ms_raw"]) / 1e3), rel=1e-4)
        else:
            assert len(r["loss"]) == doc["steps"]


@pytest.mark.slow
def test_a_failing_run_is_recorded_and_fails_the_command(tmp_path, cache_dir, monkeypatch):
    """A run that dies (here: the trainer's own check of a local dataset without a path) is kept in
    the JSON with its log tail; exit status 1."""
    monkeypatch.setenv("CODA_TITAN_CACHE", str(cache_dir))
    rc = compare.main([str(CONFIGS / "debug_cpu_coda.toml"), "--steps", "2", "--warmup", "1",
                       "--set", "training.dataset=local", "--out", str(tmp_path / "res"), "--workdir", str(tmp_path / "work")])
    assert rc == 1
    (path,) = (tmp_path / "res").glob("compare_*.json")
    (run,) = json.loads(path.read_text())["runs"]
    assert run["returncode"] != 0 and "training.dataset_path" in run["error"]


def test_a_config_the_schema_refuses_stops_before_any_run(tmp_path, capsys):
    rc = compare.main([str(CONFIGS / "debug_cpu_coda.toml"), "--steps", "2", "--set", "coda.backend=triton",
                       "--out", str(tmp_path / "res"), "--workdir", str(tmp_path / "work")])
    err = capsys.readouterr().err
    assert rc == 2 and "backend = 'triton' is not allowed" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "res").exists() or not list((tmp_path / "res").glob("*.json"))


def test_bad_arguments_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        compare.main([str(tmp_path / "missing.toml")])
    assert "not found" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        compare.main(["--loss-curve", str(CONFIGS / "debug_cpu_coda.toml")])
    assert "two or more configs" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        compare.main([str(CONFIGS / "debug_cpu_coda.toml"), "--set", "training.steps"])
    assert "KEY=VALUE" in capsys.readouterr().err


def test_a_loss_curve_shorter_than_its_warm_up_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        compare.main(["--loss-curve", str(CONFIGS / "debug_cpu_baseline.toml"), str(CONFIGS / "debug_cpu_coda.toml"),
                      "--steps", "10", "--out", str(tmp_path)])
    assert e.value.code == 2 and "more than the 20 steps" in capsys.readouterr().err


def test_a_loss_curve_keeps_every_steps_loss_and_gradient_norm(tmp_path, monkeypatch):
    """Each run of a loss curve keeps its per-step gradient norm beside its loss (where two runs part, the
    norm before clipping often says why first), and its parity is judged on the losses."""
    from scripts.compare import loss_curve as lc_mod

    def fake_run(cfg, **kw):
        k = 1.0 if "baseline" in str(cfg) else 1.01
        rows = [{"step": i + 1, "loss": k * (10.0 - 0.1 * i), "grad_norm": k * (3.0 + 0.01 * i)} for i in range(25)]
        return {"config": str(cfg), "config_run": "", "precision": "bf16", "attention": "sdpa", "rows": rows,
                "seq_len": 8, "local_batch_size": 1, "tokens_per_step": 8, "returncode": 0}

    monkeypatch.setattr(lc_mod, "run_config", fake_run)
    monkeypatch.setattr("scripts.report.training.plot_loss_curve", lambda doc, path: None)
    compare.main(["--loss-curve", str(CONFIGS / "debug_cpu_baseline.toml"), str(CONFIGS / "debug_cpu_coda.toml"),
                  "--steps", "25", "--out", str(tmp_path / "res"), "--workdir", str(tmp_path / "work")])
    (path,) = (tmp_path / "res").glob("loss_curve_*.json")
    base, coda = json.loads(path.read_text())["runs"]
    assert base["grad_norm"] == [3.0 + 0.01 * i for i in range(25)] and len(coda["grad_norm"]) == len(coda["loss"]) == 25
    assert coda["grad_norm"][3] == pytest.approx(1.01 * 3.03) and "rows" not in coda


def test_a_loss_curve_cut_short_keeps_the_runs_it_finished(tmp_path, monkeypatch):
    """A loss-curve call killed during its third run (a device call's time limit) leaves its file with the two
    finished runs, their parity judged, and the three configs it planned; nothing is plotted until the last run."""
    from scripts.compare import loss_curve as lc_mod

    calls, plots = [], []

    def fake_run(cfg, **kw):
        calls.append(cfg)
        if len(calls) == 3:
            raise KeyboardInterrupt("killed")  # (what the outer timeout's signal does to the process)
        rows = [{"step": i + 1, "loss": 10.0 - 0.1 * i + 0.001 * len(calls), "grad_norm": 3.0} for i in range(25)]
        return {"config": str(cfg), "config_run": "", "precision": "bf16", "attention": "sdpa", "rows": rows,
                "seq_len": 8, "local_batch_size": 1, "tokens_per_step": 8, "returncode": 0}

    monkeypatch.setattr(lc_mod, "run_config", fake_run)
    monkeypatch.setattr("scripts.report.training.plot_loss_curve", lambda doc, path: plots.append(path))
    cfgs = [str(CONFIGS / n) for n in ("debug_cpu_baseline.toml", "debug_cpu_coda.toml", "debug_cpu_baseline.toml")]
    with pytest.raises(KeyboardInterrupt):
        compare.main(["--loss-curve", *cfgs, "--steps", "25", "--out", str(tmp_path / "res"),
                      "--workdir", str(tmp_path / "work")])
    (path,) = (tmp_path / "res").glob("loss_curve_*.json")
    doc = json.loads(path.read_text())
    assert len(doc["runs"]) == 2 and doc["planned"] == cfgs and not plots
    assert len(doc["parity"]) == 1 and doc["parity"][0]["candidate"] == "debug_cpu_coda", doc["parity"]


def test_a_loss_curve_plot_shows_the_gradient_norms_where_the_runs_stored_them(tmp_path):
    """Runs with ``grad_norm`` get a third panel (their norms, log scale); older results plot as before."""
    import matplotlib.pyplot as plt

    from scripts.report.training import plot_loss_curve

    shown = []
    real = plt.subplots
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(plt, "subplots", lambda n, *a, **k: shown.append(n) or real(n, *a, **k))
        for norms in (True, False):
            runs = [{"config": f"c{i}.toml", "loss": [3.0 - 0.01 * s for s in range(30)],
                     **({"grad_norm": [1.0 + 0.01 * s for s in range(30)]} if norms else {})} for i in range(2)]
            plot_loss_curve({"runs": runs, "device": "cpu", "date": "2026-11-28", "parity": []}, tmp_path / f"{norms}.png")
            assert (tmp_path / f"{norms}.png").stat().st_size > 0
    assert shown == [3, 2]


def test_nproc_launches_torchrun_with_fsdp_over_every_process():
    import sys
    from pathlib import Path

    from scripts.compare.run import launch_command

    one = launch_command(Path("c.toml"), ["--training.steps", "5"])
    assert one == [sys.executable, "-m", "coda_titan.cli", "train", "c.toml", "--training.steps", "5"]
    two = launch_command(Path("c.toml"), ["--training.steps", "5"], nproc=2)
    assert two[1:7] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "--local-ranks-filter"]
    assert two[-2:] == ["--parallelism.data_parallel_shard_degree", "2"] and two[9:12] == ["coda_titan.cli", "train", "c.toml"]
    ddp = launch_command(Path("c.toml"), ["--parallelism.data_parallel_replicate_degree", "2"], nproc=2)
    assert "--parallelism.data_parallel_shard_degree" not in ddp  # the user's degrees win


def test_trace_idle_is_charged_to_the_phase_and_host_op_that_launched_the_next_kernel(tmp_path):
    k = lambda name, ts, dur, corr: {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}  # noqa: E731
    launch = lambda ts, tid, corr: {"cat": "cuda_runtime", "name": "cuLaunchKernel", "ts": ts, "dur": 3, "tid": tid,  # noqa: E731
                                    "args": {"correlation": corr}}
    op = lambda name, ts, dur, tid, cat="cpu_op": {"cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}  # noqa: E731
    events = [
        op("ProfilerStep#5", 0, 10_000, 1, "user_annotation"),
        k("a", 0, 100, 1), launch(0, 1, 1),
        # forward: the next kernel is launched 50 us after the GPU went idle, from inside coda::f1
        op("CompiledFunction", 10, 300, 1), op("coda::f1", 140, 20, 1), launch(150, 1, 2), k("b", 200, 100, 2),
        # backward (another thread): launched early, so the 100 us wait is not the host's
        op("autograd::engine::evaluate_function: X", 250, 50, 2), launch(260, 2, 3), k("c", 400, 100, 3),
        # optimizer on the main thread: host-bound, 200 us
        op("Optimizer.step#AdamW.step", 550, 200, 1, "user_annotation"), op("aten::_fused_adamw_", 600, 120, 1),
        launch(650, 1, 4), k("d", 700, 50, 4),
    ]
    (tmp_path / "t.json").write_text(json.dumps({"traceEvents": events}))
    s = compare.summarize_trace(str(tmp_path / "t.json"))
    assert s["gpu_idle_ms"] == 0.4 and s["gpu_idle_intervals"] == 3
    assert s["idle_by_phase"] == {
        "backward": {"intervals": 1, "ms": 0.1, "host_bound_intervals": 0, "host_bound_ms": 0.0},
        "forward and step": {"intervals": 1, "ms": 0.1, "host_bound_intervals": 1, "host_bound_ms": 0.1},
        "optimizer": {"intervals": 1, "ms": 0.2, "host_bound_intervals": 1, "host_bound_ms": 0.2},
    }
    assert {g["op"]: g["ms"] for g in s["idle_by_host_op"]} == {
        "optimizer: Optimizer.step#AdamW.step > aten::_fused_adamw_": 0.2,
        "backward: autograd::engine::evaluate_function: X": 0.1, "forward and step: CompiledFunction > coda::f1": 0.1}
    assert s["idle_by_host_op"][0]["ms"] == 0.2


def test_trace_summary_counts_collectives_that_no_compute_overlaps(tmp_path):
    """A sharded step: an all-gather beside a GEMM is overlapped, a reduce-scatter alone is exposed,
    and a collective half under a kernel is half exposed; the profile table of an FSDP2 run says so."""
    from scripts.report.training import profile_table

    events = [
        {"cat": "kernel", "name": "nvjet_sm90_tst_256x128", "ts": 0, "dur": 400},
        {"cat": "kernel", "name": "ncclDevKernel_AllGather_RING_LL", "ts": 100, "dur": 200},  # under the GEMM
        {"cat": "kernel", "name": "ncclDevKernel_ReduceScatter_Sum_f32", "ts": 500, "dur": 300},  # alone
        {"cat": "kernel", "name": "triton_poi_fused_add", "ts": 900, "dur": 100},
        {"cat": "kernel", "name": "ncclDevKernel_ReduceScatter_Sum_f32", "ts": 900, "dur": 200},  # half under
    ]
    (tmp_path / "t.json").write_text(json.dumps({"traceEvents": events}))
    s = compare.summarize_trace(str(tmp_path / "t.json"))
    assert s["communication_ms"] == 0.7 and s["communication_exposed_ms"] == 0.4
    assert s["categories_ms"]["communication"] == 0.7
    doc = {"config": "configs/m_coda_compile.toml", "profiled_step": 3, "device": "GPU X", "nproc": 2, "summary": s}
    assert "Rank 0 of 2 (FSDP2): collectives 0.7 ms, of which 0.4 ms with no other kernel running" in profile_table(doc)


def test_gpu_clocks_keep_the_timed_steps_samples_and_the_table_shows_them(tmp_path):
    """The clock sampler reads ``nvidia-smi``'s loop lines (here a stand-in script on a CPU machine),
    skips lines it could not fill, stamps each with the host time, and stops with its block; the summary
    keeps only the samples from the last warm-up step's line to the last step's, and the compare table
    prints their medians. Without ``nvidia-smi`` nothing is recorded."""
    from scripts.compare import gpu_clocks

    assert gpu_clocks.parse_line("1755, 612.34, 61\n") == (1755.0, 612.34, 61.0)
    assert gpu_clocks.parse_line("1755, [N/A], 61") is None and gpu_clocks.parse_line("1755, 600") is None
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho '1980, 700.5, 70'\necho '[N/A], [N/A], [N/A]'\necho '1755, 650, 71'\nexec sleep 30\n")
    fake.chmod(0o755)
    with gpu_clocks.ClockSampler(exe=str(fake)) as s:
        for _ in range(100):
            if len(s.samples) == 2:
                break
            time.sleep(0.05)
    assert [x[1:] for x in s.samples] == [(1980.0, 700.5, 70.0), (1755.0, 650.0, 71.0)]
    assert s._proc.poll() is not None  # (stopped with the block)
    with gpu_clocks.ClockSampler(exe="no-such-nvidia-smi") as none:
        pass
    assert none.samples == []

    samples = [(t, 1000.0 + t, 500.0, 60.0) for t in range(10)]  # (host time, SM MHz, W, C)
    steps = {1: 1.5, 2: 2.5, 3: 3.5, 4: 6.5}  # step -> the time its log line arrived
    got = gpu_clocks.over_steps(samples, steps, warmup=2)  # the window: 2.5 .. 6.5 s
    assert got["samples"] == 4 and got["sm_mhz"] == {"median": 1004.5, "min": 1003.0, "max": 1006.0}
    assert [r[0] for r in got["raw"]] == [0.5, 1.5, 2.5, 3.5]
    assert gpu_clocks.over_steps(samples, {1: 1.0}, warmup=0) is None and gpu_clocks.over_steps([], steps, 2) is None
    assert gpu_clocks.medians_between(samples, 2.5, 6.5) == (1004.5, 500.0)  # (the samples at 3 .. 6 s)
    assert gpu_clocks.medians_between(samples, 20, 30) == (None, None)

    doc = {"runs": [_table_run("x_baseline_compile"), _table_run("x_coda_compile", gpu_clocks=got, step_ms=300.0)],
           "device": "d", "date": "2026-11-26", "versions": {}, "steps": 1, "warmup": 1}
    table = training.compare_table(doc)
    assert "x_coda_compile SM 1,004 MHz (1,003-1,006), 500 W, 60 C, 150 J a step." in table  # (500 W x 0.3 s)
    assert "x_baseline_compile SM" not in table
    assert "over 1.1x" not in table  # (no per-step times: no slow-step line)
    # timed steps over 1.1x the median are listed under the table, per config, in order
    doc["runs"][1].update(step_ms=200.0, step_ms_raw=[200.0, 221.0, 199.0, 300.0, 220.0])
    doc["runs"][0].update(step_ms=250.0, step_ms_raw=[250.0, 260.0])
    line = next(x for x in training.compare_table(doc).splitlines() if "over 1.1x" in x)
    assert "x_coda_compile 2 (221, 300 ms against 200.0)" in line and "x_baseline_compile" not in line


def test_the_default_timed_window_holds_torchtitans_gc_steps_at_their_training_rate():
    """TorchTitan collects garbage at every ``gc_freq``-th step, a slow step (float8 + compile's took 497 ms
    against 260): the default window (steps warm-up + 1 ..) holds them at the rate training pays them."""
    from torchtitan.config.job_config import Training

    from scripts.compare import cli

    gc_freq = Training().gc_freq
    window = range(cli.WARMUP + 1, cli.WARMUP + cli.TIMED_STEPS + 1)
    gc_steps = [s for s in window if s > 1 and s % gc_freq == 0]
    assert len(gc_steps) * gc_freq == cli.TIMED_STEPS, (gc_freq, gc_steps)


def test_slow_steps_are_named_with_the_phase_that_grew_most():
    """A compare run's slow steps under the table: the ms, and where the run recorded the host's phases, the
    step number and the phase of the host's step that grew most over its median."""
    run = {"step_ms": 100.0, "warmup_steps": 10, "step_ms_raw": [100.0, 150.0, 99.0, 130.0],
           "host_phases": {"slow": [{"step": 12, "step_ms": 150.0, "excess_ms": {"fwd": 3.0, "wait": 48.5, "log": -1.0}}]}}
    assert training._slow_labels(run) == ["150 (step 12: wait +48)", "130"]
    assert training._slow_labels({**run, "host_phases": None}) == ["150", "130"]


def test_compare_writes_its_runs_before_deriving_from_them(tmp_path, monkeypatch):
    """A failure after the runs (here: the floor lookup; on 2026-11-27 a floor file cut short) costs the
    derived fields, never the runs: the JSON is written with them and names the error."""
    from scripts.compare import run as run_mod

    def fake_run(cfg, **kw):
        return {"config": str(cfg), "precision": "bf16", "attention": "sdpa", "rows": [{"step": 1, "loss": 2.0}],
                "seq_len": 8, "local_batch_size": 1, "tokens_per_step": 8,
                "clock_samples": [], "step_times": {}, "error": "stopped on purpose", "returncode": 1}

    def broken_floor(doc, out):
        raise KeyError("totals")

    monkeypatch.setattr(run_mod, "run_config", fake_run)
    monkeypatch.setattr(run_mod, "same_lease_floor", broken_floor)
    monkeypatch.setattr("scripts.report.training.plot_compare", lambda doc, path: None)
    compare.main([str(CONFIGS / "debug_cpu_baseline.toml"), "--steps", "1", "--warmup", "0",
                  "--out", str(tmp_path / "res"), "--workdir", str(tmp_path / "work")])
    (path,) = (tmp_path / "res").glob("compare_*.json")
    doc = json.loads(path.read_text())
    assert [r["loss"] for r in doc["runs"]] == [[2.0]] and doc["derive_error"] == "KeyError: 'totals'"


def test_no_plot_writes_the_json_alone_and_the_report_draws_its_plot(tmp_path, monkeypatch):
    """A device call returns at most 8 files, and one that ran past its limit lost its run.log to a compare's
    PNGs (2026-11-30): ``--no-plot`` writes each result's JSON alone, and the report draws every stored result's
    missing plot (the archive's left as kept), its JSON untouched."""
    from scripts.compare import loss_curve as lc_mod, run as run_mod

    def fake_run(cfg, **kw):
        rows = [{"step": i + 1, "loss": 10.0 - 0.1 * i, "grad_norm": 3.0, "tps": 100.0, "memory_gib": 1.0, "mfu": 1.0}
                for i in range(25)]
        return {"config": str(cfg), "config_run": "", "precision": "bf16", "attention": "sdpa", "rows": rows,
                "seq_len": 8, "local_batch_size": 1, "tokens_per_step": 8, "returncode": 0,
                "clock_samples": [], "step_times": {}}

    drawn = []
    monkeypatch.setattr(run_mod, "run_config", fake_run)
    monkeypatch.setattr(lc_mod, "run_config", fake_run)
    monkeypatch.setattr(run_mod, "same_lease_floor", lambda doc, out: None)
    monkeypatch.setattr(training, "plot_compare", lambda doc, path: drawn.append(path) or path.write_bytes(b"png"))
    monkeypatch.setattr(training, "plot_loss_curve", lambda doc, path: drawn.append(path) or path.write_bytes(b"png"))
    res, work = tmp_path / "res", str(tmp_path / "work")
    base, coda = str(CONFIGS / "debug_cpu_baseline.toml"), str(CONFIGS / "debug_cpu_coda.toml")
    assert compare.main([base, "--steps", "5", "--warmup", "0", "--no-plot", "--out", str(res), "--workdir", work]) == 0
    compare.main(["--loss-curve", base, coda, "--steps", "25", "--no-plot", "--out", str(res), "--workdir", work])
    assert not drawn and sorted(p.suffix for p in res.iterdir()) == [".json", ".json"]
    (res / "archive").mkdir()
    kept = res / "archive" / "compare_old_cpu_2026-11-01.json"
    kept.write_text(next(res.glob("compare_*.json")).read_text())
    before = {p: p.read_text() for p in res.glob("*.json")}
    monkeypatch.setattr(training, "_latest", lambda kind: [])
    training.refresh_all(res)
    assert sorted(drawn) == sorted(p.with_suffix(".png") for p in before) and not kept.with_suffix(".png").exists()
    assert {p: p.read_text() for p in res.glob("*.json")} == before
    training.refresh_all(res)  # (drawn once: a stored plot is left as it is)
    assert len(drawn) == 2


def test_gpu_train_stops_before_the_call_limit_and_still_returns_its_logs(tmp_path):
    """A device call killed at its limit returns neither the tune cache nor the logs (2026-11-30: twice in one
    session). With CALL_LIMIT, gpu_train.sh stops its running phase (and every process under it) CALL_MARGIN
    seconds before the limit, starts no further phase, and its exit still writes logs.tar and tune.tar."""
    import subprocess

    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "CODA_TITAN_CACHE": str(tmp_path / "cache"), "CALL_LIMIT": "25",
           "CALL_MARGIN": "1", "HOLD_S": "120"}
    t0 = time.monotonic()
    p = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_train.sh"), "hold", "hold"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=100)
    took = time.monotonic() - t0
    assert p.returncode == 143 and took < 60, (p.returncode, took, p.stdout[-500:], p.stderr[-500:])
    assert p.stdout.count("=== hold ") == 1 and "CALL_LIMIT: stopping the phase" in p.stdout, p.stdout
    assert (out / "logs.tar").is_file() and (out / "tune.tar").is_file()


def test_trace_summary_leaves_out_kernels_launched_before_the_profiled_step(tmp_path):
    """With ``optimizer_stream`` the step before's optimizer and fp8 weight pass still run in the profiled
    window (2026-11-27, CODA fp8: 139 AdamW launches where a step has 72); their launches are not in the
    trace, so they are not this step's: left out of every sum (GEMM families too) and reported apart."""
    from scripts.compare.families import gemm_families
    from scripts.report.training import profile_table

    launch = lambda ts, corr: {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 2, "tid": 1,  # noqa: E731
                               "args": {"correlation": corr}}
    k = lambda name, ts, dur, corr: {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}  # noqa: E731
    events = [k("multi_tensor_apply_kernel", 0, 300, 7), k("triton_poi_fused_clamp_t_3", 300, 100, 8),  # (carried in)
              launch(10, 1), k("nvjet_sm90_tst_256x128", 400, 500, 1), launch(20, 2), k("triton_poi_fused_add", 900, 50, 2),
              launch(30, 3), k("multi_tensor_apply_kernel", 950, 200, 3)]
    (tmp_path / "t.json").write_text(json.dumps({"traceEvents": events}))
    s = compare.summarize_trace(str(tmp_path / "t.json"))
    assert s["kernel_launches"] == 3 and s["gpu_kernel_ms"] == 0.75 and s["categories_ms"]["optimizer"] == 0.2
    assert s["carried_in"] == {"kernels": 2, "ms": 0.4} and [x["name"] for x in s["outside_gemms"]] == ["triton_poi_fused_add"]
    flash = [k("flash_attn_bwd", 0, 80, 9), launch(40, 4), k("flash_attn_fwd", 1200, 60, 4)]  # (the first carried in)
    assert gemm_families(events + flash, {})["attention_ms"] == 0.06
    doc = {"config": "configs/m_coda_compile.toml", "profiled_step": 3, "device": "GPU X", "summary": s,
           "run": {"config_run": "[coda]\noptimizer_stream = true\n"}}
    assert "Left out: 2 kernels (0.4 ms) launched before the profiled step" in profile_table(doc)
    old = {**doc, "summary": {k: v for k, v in s.items() if k != "carried_in"}}  # (a profile summarized before)
    assert "count them too" in profile_table(old) and "count them too" not in profile_table(doc)
    assert "count them too" not in profile_table({**old, "run": {"config_run": "[coda]\n"}})


def test_trace_summary_charges_small_kernels_to_the_op_that_launched_them(tmp_path):
    """``outside_gemms_by_op``: each kernel outside the GEMMs under the innermost ``coda::`` op open at its
    launch (here an amax inside B2 inside a compiled region), else the outermost op (a compiled region), else
    "(no host op)"; GEMMs are not listed."""
    op = lambda name, ts, dur: {"cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "tid": 1}  # noqa: E731
    launch = lambda ts, corr: {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 1, "tid": 1,  # noqa: E731
                               "args": {"correlation": corr}}
    k = lambda name, ts, corr: {"cat": "kernel", "name": name, "ts": ts, "dur": 10, "args": {"correlation": corr}}  # noqa: E731
    events = [op("Torch-Compiled Region: 4/0", 0, 100), op("coda::norm_residual_bwd_fp8", 10, 50), op("aten::amax", 20, 10),
              launch(22, 1), k("reduce_kernel_amax", 200, 1), launch(40, 2), k("nvjet_sm90_gemm", 220, 2),
              launch(70, 3), k("triton_poi_fused_cast_0", 240, 3), launch(150, 4), k("triton_poi_fused_cast_0", 260, 4),
              launch(160, 5), k("reduce_kernel_amax", 280, 5)]
    (tmp_path / "t.json").write_text(json.dumps({"traceEvents": events}))
    got = {(x["op"], x["kernel"]): (x["calls"], x["ms"]) for x in compare.summarize_trace(str(tmp_path / "t.json"))["outside_gemms_by_op"]}
    assert got == {("coda::norm_residual_bwd_fp8", "reduce_kernel_amax"): (1, 0.01),
                   ("Torch-Compiled Region: 4/0", "triton_poi_fused_cast_0"): (1, 0.01),
                   ("(no host op)", "triton_poi_fused_cast_0"): (1, 0.01), ("(no host op)", "reduce_kernel_amax"): (1, 0.01)}


def test_trace_summary_counts_a_multi_tensor_kernel_of_the_backward_as_the_models_not_the_optimizers(tmp_path):
    """A multi-tensor kernel launched by the autograd engine (F4's backward scaling of dX and dW by one
    ``_foreach_mul``) is the model's elementwise work: outside the GEMMs, under its op, not in "optimizer";
    the same kernel launched by ``Optimizer.step`` stays the optimizer's."""
    op = lambda name, ts, dur: {"cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "tid": 1}  # noqa: E731
    launch = lambda ts, corr: {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 1, "tid": 1,  # noqa: E731
                               "args": {"correlation": corr}}
    k = lambda ts, dur, corr: {"cat": "kernel", "name": "multi_tensor_apply_kernel<mul>", "ts": ts, "dur": dur,  # noqa: E731
                               "args": {"correlation": corr}}
    events = [op("autograd::engine::evaluate_function: LMHeadCEBackward", 0, 50), op("aten::_foreach_mul", 10, 10),
              launch(12, 1), k(100, 30, 1), op("Optimizer.step#AdamW.step", 60, 40), launch(70, 2), k(200, 70, 2)]
    (tmp_path / "t.json").write_text(json.dumps({"traceEvents": events}))
    s = compare.summarize_trace(str(tmp_path / "t.json"))
    assert s["categories_ms"] == {"optimizer": 0.07, "elementwise/reduction (eager)": 0.03}, s["categories_ms"]
    assert [(x["name"], x["category"], x["ms"]) for x in s["outside_gemms"]] == [
        ("multi_tensor_apply_kernel<mul>", "elementwise/reduction (eager)", 0.03)]
    assert [(x["op"], x["ms"]) for x in s["outside_gemms_by_op"]] == [
        ("autograd::engine::evaluate_function: LMHeadCEBackward", 0.03)]
    assert {(x["category"], x["ms"]) for x in s["top_kernels"]} == {("optimizer", 0.07), ("elementwise/reduction (eager)", 0.03)}


def test_a_stored_profile_is_summarized_again_from_its_kept_trace(tmp_path):
    """``--resummarize PROFILE TRACE``: the summary is rebuilt by this checkout's code from the gzipped trace
    the run kept; the run's fields stay and the file says it was derived again."""
    import gzip

    events = [{"cat": "kernel", "name": "multi_tensor_apply_kernel", "ts": 0, "dur": 300, "args": {"correlation": 7}},
              {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 10, "dur": 2, "tid": 1, "args": {"correlation": 1}},
              {"cat": "kernel", "name": "triton_poi_fused_add", "ts": 400, "dur": 50, "args": {"correlation": 1}}]
    trace = tmp_path / "trace_m.json.gz"
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": events}, f)
    prof = tmp_path / "profile_m.json"
    prof.write_text(json.dumps({"run": {"model": "coda_llama3/debugmodel", "x": 1}, "summary": {"stale": True}}))
    assert compare.main(["--resummarize", str(prof), str(trace)]) == 0
    doc = json.loads(prof.read_text())
    assert doc["run"]["x"] == 1 and "stale" not in doc["summary"] and doc["resummarized"]["trace"] == trace.name
    assert doc["summary"]["carried_in"] == {"kernels": 1, "ms": 0.3} and doc["summary"]["gpu_kernel_ms"] == 0.05
    assert "gemm_families" in doc["summary"]
    # (and the step as a timeline: no optimizer phase here, so the whole trace: 300 + 50 us of kernels)
    t = doc["summary"]["step_timeline"]
    assert t["window"] == "whole trace" and t["step_ms"] == 0.45 and t["gpu_busy_ms"] == 0.35, t


def test_a_runs_precision_names_amp_apart_from_pure_bf16_and_fp32():
    from types import SimpleNamespace as NS

    from scripts.compare.run import _precision

    def job(dtype, mixed, name="llama3", converters=(), precision="bf16"):
        return NS(model=NS(name=name, converters=list(converters)), coda=NS(precision=precision),
                  training=NS(dtype=dtype, mixed_precision_param=mixed))

    assert _precision(job("bfloat16", "bfloat16")) == "bf16"
    assert _precision(job("float32", "float32")) == "fp32"
    assert _precision(job("float32", "bfloat16")) == "bf16-amp"
    assert _precision(job("bfloat16", "bfloat16", "coda_llama3", precision="fp8")) == "fp8"
    assert _precision(job("bfloat16", "bfloat16", converters=["quantize.linear.float8"])) == "fp8"


def test_a_loss_curve_call_ends_with_each_runs_deviations_and_the_noise_floor_verdict(tmp_path, monkeypatch, capsys):
    """The lines a finished loss-curve call prints: per candidate the mean abs., 10-step and max deviation and the
    step where it parts from the baseline; with stock compiled beside stock eager, each CODA run's noise-floor
    verdict (CODA here deviates more than the compiled twin: MISSED)."""
    from scripts.compare import loss_curve as lc_mod

    base = [10.0 - 0.1 * i for i in range(30)]
    offs = {"llama3_1b_bf16_baseline": (None, 0.0), "llama3_1b_bf16_coda_compile": (22, 0.02),
            "llama3_1b_bf16_baseline_compile": (25, 0.005)}

    def fake_run(cfg, **kw):
        at, by = offs[Path(cfg).stem]
        rows = [{"step": i + 1, "loss": x * (1 + by) if at and i + 1 >= at else x, "grad_norm": 3.0}
                for i, x in enumerate(base)]
        coda = "coda" in Path(cfg).stem
        return {"config": str(cfg), "config_run": f'[model]\nname = "{"coda_llama3" if coda else "llama3"}"\n',
                "precision": "bf16", "attention": "sdpa", "rows": rows, "seq_len": 8, "local_batch_size": 1,
                "tokens_per_step": 8, "returncode": 0}

    monkeypatch.setattr(lc_mod, "run_config", fake_run)
    monkeypatch.setattr("scripts.report.training.plot_loss_curve", lambda doc, path: None)
    compare.main(["--loss-curve", *(str(CONFIGS / f"{n}.toml") for n in offs), "--steps", "30",
                  "--out", str(tmp_path / "res"), "--workdir", str(tmp_path / "work")])
    cap = capsys.readouterr()
    out = cap.out + cap.err
    coda = next(line for line in out.splitlines() if "llama3_1b_bf16_coda_compile vs" in line)
    assert "mean abs. deviation 1.80%" in coda  # (9 of the 10 steps after step 20 at 2%)
    assert "largest 10-step mean 1.79%" in coda  # (steps 21-30: 2% of the sum of 22-30 over the sum of 21-30)
    assert "max 2.00% (step " in coda and "parts (past 0.001) at step 22" in coda
    assert "llama3_1b_bf16_coda_compile against the noise floor (llama3_1b_bf16_baseline_compile" in out
    assert out.rstrip().splitlines()[-2].endswith("no larger than its: MISSED")


def test_a_run_that_prints_nothing_past_its_timeout_is_killed_and_reported(tmp_path):
    """``run_config``'s ``timeout`` holds while the run is silent (a tile sweep, a hang): the process that prints one
    line and then sleeps is killed at the deadline, not when it would end, and the result says so with its log."""
    entry = ("-c", "import sys, time; print('compiling', flush=True); time.sleep(120)")
    t0 = time.time()
    res = run.run_config(CONFIGS / "debug_cpu_coda.toml", steps=2, workdir=tmp_path, attention="config", sets=[],
                         timeout=3, entry=entry)
    assert time.time() - t0 < 60, time.time() - t0
    assert res["returncode"] != 0 and "killed at the 3 s timeout" in res["error"] and "compiling" in res["error"]
    assert (tmp_path / "debug_cpu_coda" / "train.log").read_text() == "compiling\n"


def test_a_comparison_names_the_allocator_settings_its_runs_had():
    """The caching allocator's settings move the reserved peak a comparison reports (TorchTitan's ``run_train.sh``
    sets ``expandable_segments:True``): each run records them from its environment (either variable's name, None
    unset), and the table's header names them when any run had them, never when none did."""
    from scripts.compare import run as run_mod
    from scripts.report import training

    assert run_mod.allocator({"PATH": "/bin"}) is None
    assert run_mod.allocator({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}) == "expandable_segments:True"
    assert run_mod.allocator({"PYTORCH_ALLOC_CONF": "expandable_segments:True"}) == "expandable_segments:True"

    doc = {"runs": [_table_run("x_baseline_compile"), _table_run("x_coda_compile", allocator=None)], "device": "d",
           "date": "2026-11-30", "versions": {}, "steps": 1, "warmup": 1}
    assert "allocator" not in training.compare_table(doc)
    for r in doc["runs"]:
        r["allocator"] = "expandable_segments:True"
    assert "allocator `expandable_segments:True` · " in training.compare_table(doc).splitlines()[0]


def test_the_table_gives_each_runs_reserved_memory_by_stream():
    """``alloc_streams`` (recorded after a run's last step) under the table: each stream's reserved and live GiB in
    the recorded order; nothing for a run without it, or with it empty (no CUDA) or failed."""
    from scripts.report import training

    coda = _table_run("x_coda_compile")
    coda["alloc_streams"] = {"streams": [{"stream": "main", "reserved_gib": 24.0, "allocated_gib": 18.5},
                                         {"stream": "optimizer", "reserved_gib": 1.25, "allocated_gib": 0.125}]}
    base = _table_run("x_baseline_compile")
    base["alloc_streams"] = {"error": "RuntimeError: x"}
    doc = {"runs": [base, coda], "device": "d", "date": "2026-12-07", "versions": {}, "steps": 1, "warmup": 1}
    line = next(x for x in training.compare_table(doc).splitlines() if x.startswith("Reserved GiB by CUDA stream"))
    assert line.endswith(": x_coda_compile: main 24.00 (18.50), optimizer 1.25 (0.12).")
    coda["alloc_streams"] = {}
    assert "by CUDA stream" not in training.compare_table(doc)
