"""The generated pages (docs/results.md, the README's blocks) come from the committed JSON and the schema,
and kernel targets are judged right."""

import json
import random
import re
import unittest.mock
from pathlib import Path

from scripts.report import kernels as report


def _doc(rows):
    return {"device": "X", "date": "2026-01-01", "versions": {"torch": "t", "quack": "q"}, "results": rows}


def _row(op, direction, coda, gemm, compile_ms, peak=None):
    r = {"op": op, "direction": direction, "M": 16384, "d": 2048,
         "ms": {"coda": coda, "bare_gemm": gemm, "eager": 2 * compile_ms, "torch_compile": compile_ms, "liger": None}}
    if peak:
        r["peak_gib"] = {"coda": peak[0], "eager_full_logits": peak[1]}
    return r


def test_targets_judged_from_numbers():
    doc = _doc([
        _row("residual_rms", "fwd", 1.05, 1.0, 1.2),  # 1.05x GEMM: met
        _row("norm_swiglu", "fwd", 1.2, 1.0, 1.3),  # 1.2x GEMM: missed
        _row("swiglu_bwd", "bwd", 1.0, 0.9, 1.5),  # 1.5x compile: met
        _row("norm_residual_bwd", "bwd", 1.0, 0.9, 1.5),  # 1.5x < 1.6: missed
        _row("lm_head_ce", "fwd", 1.0, 1.0, 1.0, peak=(1.0, 10.0)),  # 0.1 <= 1/8: met
    ])
    met = {t["op"]: t["met"] for t in report.targets(doc)}
    assert met == {"residual_rms": True, "norm_swiglu": False, "swiglu_bwd": True,
                   "norm_residual_bwd": False, "lm_head_ce": True}
    assert all("why" in t for t in report.targets(doc) if not t["met"])
    assert report.table(doc).count("\n| ") == 1 + len(doc["results"])  # separator + one row each


def test_rows_timed_at_the_cap_get_their_own_ratio_column():
    """``bench.kernels --at-cap``: a row with the program and its bare GEMMs timed back to back shows coda / GEMM
    at the cap beside the burst ratio; a row without (an older part) shows a dash; no such row, no column."""
    capped = _row("swiglu_bwd", "bwd", 1.2, 1.0, 1.5)
    capped["ms"].update(coda_at_cap=1.3, bare_gemm_at_cap=1.04)
    text = report.table(_doc([capped, _row("norm_rope", "fwd", 0.9, 1.0, 2.0)]))
    header, _, first, second = text.splitlines()[2:6]
    assert "| coda / GEMM | coda / GEMM at the cap | compile / coda |" in header
    assert "| 1.20 | 1.25 | 1.25 |" in first and "| 0.90 | — |" in second
    assert "at the cap" not in report.table(_doc([_row("norm_rope", "fwd", 0.9, 1.0, 2.0)]))


def test_results_page_table_is_generated_from_committed_json():
    paths = [p for p in report.RESULTS.glob("kernels_*.json") if "_d" not in p.stem.rsplit("_", 1)[-1]]
    page = (report.ROOT / "docs" / "results.md").read_text()
    for path in paths:
        assert report.table(json.loads(path.read_text())) in page, f"docs/results.md table is stale for {path.name}"


def test_readme_blocks_are_generated():
    from coda_titan.titan.job_config import markdown_table
    from scripts.report import pages

    readme = pages.README.read_text()
    for name, text in (("headline", pages.headline()), ("coda-table", markdown_table())):
        m = re.search(rf"<!-- {name}:begin -->\n(.*)\n<!-- {name}:end -->", readme, flags=re.S)
        assert m and m.group(1) == text, f"README block {name} is stale: run python -m scripts.report"
    assert len(pages.README.read_text()) < 15000


def test_a_part_replaces_only_the_programs_it_measured(tmp_path, monkeypatch):
    def row(op, ms, d=64):
        return {"op": op, "direction": "fwd", "M": 8, "d": d, "precision": "fp8", "ms": {"coda": ms}}

    results = tmp_path / "results"
    results.mkdir()
    monkeypatch.setattr(report, "RESULTS", results)
    (results / "kernels_gpu.json").write_text(json.dumps(
        {"device": "gpu", "runs": ["d64: old"], "results": [row("a", 1.0), row("b", 2.0), row("a", 3.0, d=128)]}))
    parts = tmp_path / "parts"
    parts.mkdir()
    (parts / "kernels_gpu_d64.json").write_text(json.dumps({"device": "gpu", "date": "new", "results": [row("b", 5.0)]}))
    report.merge([str(parts)])
    merged = json.loads((results / "kernels_gpu.json").read_text())
    assert {(r["d"], r["op"]): r["ms"]["coda"] for r in merged["results"]} == {(64, "a"): 1.0, (64, "b"): 5.0, (128, "a"): 3.0}
    assert merged["runs"] == ["d64: new", "d64: old"]


def test_two_parts_of_one_d_keep_each_others_programs(tmp_path, monkeypatch):
    """A d benched in two calls (BENCH_OPS subsets, or a call cut off and its rest run again): both parts'
    rows land, and where both measured a program the later part's row wins."""
    def row(op, ms):
        return {"op": op, "direction": "fwd", "M": 8, "d": 64, "precision": "bf16", "ms": {"coda": ms}}

    results = tmp_path / "results"
    results.mkdir()
    monkeypatch.setattr(report, "RESULTS", results)
    first, second = tmp_path / "p1", tmp_path / "p2"
    for folder, rows in ((first, [row("a", 1.0), row("b", 2.0)]), (second, [row("b", 4.0), row("c", 3.0)])):
        folder.mkdir()
        (folder / "kernels_gpu_d64.json").write_text(json.dumps({"device": "gpu", "date": "new", "results": rows}))
    report.merge([str(first), str(second)])
    merged = json.loads((results / "kernels_gpu.json").read_text())
    assert {r["op"]: r["ms"]["coda"] for r in merged["results"]} == {"a": 1.0, "b": 4.0, "c": 3.0}


def _fp8_run_after(floor: dict, step_ms: float, tmp_path) -> dict:
    """A comparison doc of one CODA fp8 FA4 run (``step_ms``) in the lease of ``floor`` (written to ``tmp_path``),
    with the floor ``same_lease_floor`` finds for it."""
    from scripts.compare.run import same_lease_floor

    (tmp_path / "floor_GPU_X_2026-01-02.json").write_text(json.dumps(floor))
    run = {"config": "configs/m_coda.toml", "attention": "fa4", "tokens_per_s": 1.0, "step_ms": step_ms, "peak_gib": 1.0,
           "mfu": 1.0, "loss": [1.0], "precision": "fp8", "seq_len": 8, "local_batch_size": 2}
    doc = {"device": "GPU X", "host": "h1/boot-a", "date": "2026-01-02T10:00:00Z", "versions": {}, "steps": 1,
           "warmup": 1, "runs": [run]}
    doc["floor"] = same_lease_floor(doc, tmp_path)
    return doc


def test_step_over_floor_uses_the_floor_of_the_same_lease(tmp_path, monkeypatch):
    """compare embeds the floor measured in its own lease (same host and boot, device, day, seq x batch)
    and the table divides each FA4 run's step by the floor of its precision; another day's floor, and a
    floor of the same GPU and day from another host (or one that names no host) are not used. A floor
    archived under a session's name (a later floor of that day took the file's name) is still found,
    cited as ``archive/<name>``."""
    from scripts.bench.floor import totals
    from scripts.compare.run import same_lease_floor
    from scripts.report.training import compare_table

    gemms = [{"weight": w, "precision": p, "direction": d, "best_ms": 1.0 if p == "bf16" else 0.5}
             for w in ("qkv", "out", "w13", "w2", "lm_head") for p in ("bf16", "fp8") for d in ("fwd", "dgrad", "wgrad")]
    floor = {"device": "GPU X", "host": "h1/boot-a", "date": "2026-01-02", "seq_len": 8, "local_batch_size": 2,
             "n_layers": 2, "gemms": gemms, "fa4": {"ms": 2.0}, "adamw": {"ms": 3.0}}
    floor["totals"] = t = totals(floor)
    assert t["bf16"]["floor_ms"] == 2 * 12 * 1.0 + 3 * 1.0 + 2 * 2.0 + 3.0
    assert t["fp8"]["floor_ms"] == 2 * 12 * 0.5 + 3 * 1.0 + 2 * 2.0 + 3.0  # the LM head stays bf16
    doc = _fp8_run_after(floor, 51.0, tmp_path)
    assert doc["floor"]["fp8"] == t["fp8"]["floor_ms"]
    row = next(line for line in compare_table(doc).splitlines() if line.startswith("| m_coda"))
    assert f"| {51.0 / t['fp8']['floor_ms']:.3f} |" in row
    other_day = {**doc, "date": "2026-01-03T10:00:00Z"}
    assert same_lease_floor(other_day, tmp_path) is None
    assert "Step / floor: n/a" in compare_table({**other_day, "floor": None})
    for host in ("h2/boot-a", "h1/boot-b", None):  # another machine, the same hostname rebooted, no host
        assert same_lease_floor({**doc, "host": host}, tmp_path) is None, host
    (tmp_path / "floor_GPU_X_2026-01-02.json").write_text(json.dumps({k: v for k, v in floor.items() if k != "host"}))
    assert same_lease_floor(doc, tmp_path) is None  # a floor file from before hosts were recorded
    cut_short = {k: v for k, v in floor.items() if k not in ("totals", "fa4", "adamw")}
    (tmp_path / "floor_GPU_X_2026-01-02.json").write_text(json.dumps({**cut_short, "complete": False}))
    assert same_lease_floor(doc, tmp_path) is None  # a floor run cut short: no floor, and the comparison is kept
    from scripts.compare import common

    monkeypatch.setattr(common, "RESULTS", tmp_path)
    (tmp_path / "archive").mkdir()
    (tmp_path / "archive" / "floor_tenth_GPU_X_2026-01-02.json").write_text(json.dumps(floor))
    assert same_lease_floor(doc, tmp_path)["file"] == "archive/floor_tenth_GPU_X_2026-01-02.json"


def test_the_floor_at_the_cap_runs_a_steps_kernels_in_its_order_and_reaches_the_table(tmp_path):
    """``scripts.bench.floor --cap-reps``: every piece of the floor once per layer and direction (the LM head
    once, in bf16 for fp8 too; the optimizer once), the forward's layers first to last, the backward's
    last to first, the LM head between; its pass time becomes ``capped_floor_ms`` and the comparison
    table states each FA4 run's step over it."""
    from scripts.bench.floor import step_order, totals
    from scripts.report.training import compare_table

    for precision in ("bf16", "fp8"):
        order = step_order(3, precision)
        gemms = [k for k in order if isinstance(k, tuple)]
        assert len(gemms) == 3 * 12 + 3 and len(set(gemms)) == 15
        assert all(order.count(k) == 3 for k in gemms if k[0] != "lm_head")
        assert {k[1] for k in gemms if k[0] == "lm_head"} == {"bf16"} and {k[1] for k in gemms if k[0] != "lm_head"} == {precision}
        assert order.count("fa4_fwd") == order.count("fa4_bwd") == 3 and order[-1] == "adamw" and order.count("adamw") == 1
        head = order.index(("lm_head", "bf16", "fwd"))
        assert all(k in ("fa4_fwd",) or k[2] == "fwd" for k in order[:head])  # forward only before the head
        assert order[head + 3] == ("w2", precision, "dgrad") and "fa4_fwd" not in order[head:]
    gemms = [{"weight": w, "precision": p, "direction": d, "best_ms": 1.0}
             for w in ("qkv", "out", "w13", "w2", "lm_head") for p in ("bf16", "fp8") for d in ("fwd", "dgrad", "wgrad")]
    floor = {"device": "GPU X", "host": "h1/boot-a", "date": "2026-01-02", "seq_len": 8, "local_batch_size": 2,
             "n_layers": 2, "gemms": gemms, "fa4": {"ms": 2.0}, "adamw": {"ms": 3.0}}
    assert "capped_floor_ms" not in totals(floor)["bf16"]
    floor["at_cap"] = {"bf16": {"ms": 40.0}, "fp8": {"ms": 30.0}}
    floor["totals"] = t = totals(floor)
    assert t["bf16"]["capped_floor_ms"] == 40.0 and t["fp8"]["capped_floor_ms"] == 30.0
    doc = _fp8_run_after(floor, 45.0, tmp_path)
    assert doc["floor"]["capped"] == {"bf16": 40.0, "fp8": 30.0}
    assert "Step / that floor: m_coda 1.500." in compare_table(doc)


def test_the_floor_at_the_cap_sums_each_calls_time_into_the_steps_parts():
    """``parts_of_pass``: a pass timed call by call, summed per part of the step in ``step_order``'s order (the
    layer GEMMs, the LM head, FA4's forward and backward, the optimizer); every call counted once, none lost."""
    from scripts.bench.floor import STEP_PARTS, parts_of_pass, step_order

    order = step_order(2, "fp8")
    ms = [float(i) for i in range(len(order))]
    parts = parts_of_pass(order, ms)
    assert set(parts) == set(STEP_PARTS) and sum(parts.values()) == sum(ms)
    assert parts["optimizer"] == len(order) - 1.0  # (the step's last call)
    assert parts["attention_fwd"] == sum(i for i, k in enumerate(order) if k == "fa4_fwd")
    assert parts["lm_head"] == sum(i for i, k in enumerate(order) if isinstance(k, tuple) and k[0] == "lm_head")
    clock = iter(range(100))  # (timed_calls: one event after each call, each call's time the gap between two)

    class Event:
        def __init__(self, enable_timing):
            self.t = None

        def record(self):
            self.t = next(clock)

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return float(other.t - self.t)

    from scripts.bench import floor as floor_module

    calls = [lambda: None, lambda: next(clock), lambda: None]  # (the second call takes one tick more)
    with unittest.mock.patch.object(floor_module.torch.cuda, "Event", Event):
        assert floor_module.timed_calls(calls) == [1.0, 2.0, 1.0]
    try:
        parts_of_pass(order, ms[:-1])
    except ValueError as e:
        assert "timings" in str(e)
    else:
        raise AssertionError("a pass with a call's timing missing was summed")


def test_the_report_gives_a_comparison_run_after_the_floor_its_hosts_floor(tmp_path, monkeypatch):
    """A comparison that ran in a later call on the same warm host as the floor (its own ``$OUT`` had no
    floor file) gets that floor when the report refreshes it from benchmarks/results; another host's
    floor of the same GPU and day is not used, and a comparison without one keeps no floor field."""
    import scripts.compare.common as common
    from scripts.report.training import refresh

    monkeypatch.setattr(common, "RESULTS", tmp_path)  # (the one results folder every lookup reads)
    floor = {"device": "GPU X", "host": "h1/boot-a", "date": "2026-01-02", "seq_len": 8, "local_batch_size": 2,
             "totals": {"bf16": {"floor_ms": 40.0}, "fp8": {"floor_ms": 30.0}}}
    (tmp_path / "floor_GPU_X_2026-01-02.json").write_text(json.dumps(floor))
    run = {"config": "configs/m_coda.toml", "attention": "fa4", "tokens_per_s": 1.0, "step_ms": 50.0, "peak_gib": 1.0,
           "mfu": 1.0, "loss": [1.0], "precision": "bf16", "seq_len": 8, "local_batch_size": 2}
    doc = {"kind": "compare", "device": "GPU X", "host": "h1/boot-a", "date": "2026-01-02T10:05:00Z", "versions": {},
           "steps": 1, "warmup": 1, "runs": [run], "floor": None}
    assert refresh(dict(doc))["floor"] == {"file": "floor_GPU_X_2026-01-02.json", "host": "h1/boot-a", "bf16": 40.0,
                                           "fp8": 30.0}
    other = {k: v for k, v in {**doc, "host": "h2/boot-a"}.items() if k != "floor"}
    assert "floor" not in refresh(other)


def test_host_id_names_the_machine_and_its_boot(monkeypatch):
    """``host_id`` is the hostname and the kernel's boot id (a fresh device host reuses hostnames such
    as "vm", never a boot id); without a boot id it still names the host."""
    import socket

    from scripts.compare import common

    boot = Path("/proc/sys/kernel/random/boot_id")
    if boot.exists():
        assert common.host_id() == f"{socket.gethostname()}/{boot.read_text().strip()}"
    monkeypatch.setattr(socket, "gethostname", lambda: "vm")
    monkeypatch.setattr(common.Path, "read_text", lambda self, *a, **k: (_ for _ in ()).throw(OSError("no procfs")))
    assert common.host_id() == "vm/?"


def test_scaling_table_pairs_n_gpus_with_one_gpu_of_the_same_day(tmp_path, monkeypatch):
    """gpu_train.sh fsdp2 writes compare_fsdp<N>[_8b] (nproc N) and compare_fsdp1[_8b] on one host: the
    results page gets tokens/s per GPU at N over 1 GPU per config, CODA over stock at each, and CODA's
    loss deviation from stock at N GPUs beside one GPU's; another day's or another model's single-GPU
    file is not used."""
    from scripts.report import training

    rng = random.Random(0)
    stock = [4.0 - 0.01 * i for i in range(40)]

    def doc(tag, nproc, date, tps, dev):
        coda = [x * (1 + dev * rng.choice((-1, 1))) for x in stock]
        runs = [{"config": f"configs/{c}.toml", "tokens_per_s": t, "loss": loss}
                for c, t, loss in zip(("m_baseline_compile", "m_coda_compile"), tps, (stock, coda))]
        return {"kind": "compare", "device": "GPU X", "date": f"{date}T01:00:00Z", "tag": tag, "nproc": nproc, "runs": runs}

    files = {"compare_fsdp2_GPU_X_2026-01-02.json": doc("fsdp2", 2, "2026-01-02", (900.0, 1000.0), 0.002),
             "compare_fsdp1_GPU_X_2026-01-02.json": doc("fsdp1", 1, "2026-01-02", (1000.0, 1100.0), 0.001),
             "compare_fsdp2_8b_GPU_X_2026-01-02.json": doc("fsdp2_8b", 2, "2026-01-02", (90.0, 100.0), 0.0),
             "compare_fsdp4_GPU_X_2026-01-03.json": doc("fsdp4", 4, "2026-01-03", (800.0, 900.0), 0.0)}
    for name, d in files.items():
        (tmp_path / name).write_text(json.dumps(d))
    monkeypatch.setattr(training, "_latest", lambda kind: sorted(tmp_path.glob(f"{kind}_*.json")))
    pairs = training.scaling_pairs()
    assert [(m["tag"], s["tag"]) for m, s in pairs] == [("fsdp2", "fsdp1")]
    table = training.scaling_table(*pairs[0])
    assert "| m_baseline_compile | 900 | 1,000 | 0.900 | n/a | n/a |" in table
    assert "| m_coda_compile | 1,000 | 1,100 | 0.909 | 1.111x | 1.100x |" in table
    # every step deviates by exactly 0.2% at 2 GPUs and 0.1% on one; 40 steps, the first 20 skipped
    row = next(line for line in table.splitlines() if line.startswith("| m_coda_compile vs m_baseline_compile"))
    assert row.split("|")[2:5] == [" 20 ", " 0.20% ", " 0.10% "] and row.rstrip().endswith("| none |")
    # the 8B pair: stock and CODA configs named without _compile (compile set by an override)
    eager = [{**d, "runs": [{**r, "config": r["config"].replace("_compile", "")} for r in d["runs"]]} for d in pairs[0]]
    table = training.scaling_table(*eager)
    assert "| m_baseline | 900 | 1,000 | 0.900 | n/a | n/a |" in table
    assert "| m_coda | 1,000 | 1,100 | 0.909 | 1.111x | 1.100x |" in table
    assert any(line.startswith("| m_coda vs m_baseline | 20 |") for line in table.splitlines())


def test_family_table_sets_each_gemm_family_against_stock_and_the_floor(tmp_path, monkeypatch):
    """A CODA profile with its GEMM-family attribution, the stock profile of the same device, day,
    precision and model flavor, and that day's floor of that flavor: one row per family and direction,
    CODA / floor against the floor of the run's precision, totals."""
    from scripts.compare import common
    from scripts.report import training

    fams = {f"{f}/{d}": 1.0 for f in ("qkv", "out", "w13", "w2") for d in ("fwd", "dgrad", "wgrad")}

    def prof(stem, precision, families):
        return {"kind": "profile", "device": "GPU X", "date": "2026-01-02T03:00:00Z", "config": f"configs/{stem}.toml",
                "run": {"precision": precision}, "summary": {"gemm_families": {"families_ms": families, "unattributed_gemm_ms": 0.0}}}

    coda = prof("m_bf16_coda_compile", "bf16", {**fams, "lm_head/all": 6.0})
    stock = prof("m_bf16_baseline_compile", "bf16", {**{k: 0.5 for k in fams}, "lm_head/fwd": 1.0, "lm_head/dgrad": 2.0,
                                                      "lm_head/wgrad": 3.0})
    other = prof("m_fp8_baseline_compile", "fp8", fams)
    pairs = training.family_pairs([stock, other, coda])
    assert pairs == [(coda, stock)]
    gemms = [{"weight": w, "precision": p, "direction": d, "best_ms": 0.25 if p == "bf16" else 0.125}
             for w in ("qkv", "out", "w13", "w2", "lm_head") for p in ("bf16", "fp8") for d in ("fwd", "dgrad", "wgrad")]
    floor = {"device": "GPU X", "date": "2026-01-02", "n_layers": 2, "complete": True, "gemms": gemms}
    (tmp_path / "floor_GPU_X_2026-01-02.json").write_text(json.dumps(floor))
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    table = training.family_table(coda, stock, training._floor_of(coda))
    assert "| qkv fwd | 1.00 | 0.50 | 0.50 | 0.25 | 2.00x |" in table  # floor: 2 layers x 0.25 ms (bf16 run)
    assert "| lm_head fwd+dgrad+wgrad | 6.00 | 6.00 | 0.75 | 0.75 | 8.00x |" in table  # the head once, not per layer
    assert "| **all** | 18.00 | 12.00 | 6.75 | 3.75 | 2.67x |" in table
    assert "floor bf16" in training.family_table(coda, None, None) and "| qkv fwd | 1.00 | n/a | n/a | n/a | n/a |" in \
        training.family_table(coda, None, None)
    # a profile is set against the floor measured on its own host (machine and boot), archived under another name
    # if a later floor of that day took the file's name; a floor of another host only where none of its own is kept
    (tmp_path / "archive").mkdir()
    own = {**floor, "host": "h1", "gemms": [{**g, "best_ms": 2 * g["best_ms"]} for g in gemms]}
    (tmp_path / "archive" / "floor_families_GPU_X_2026-01-02.json").write_text(json.dumps(own))
    (tmp_path / "floor_GPU_X_2026-01-02.json").write_text(json.dumps({**floor, "host": "h2"}))
    assert training._floor_of({**coda, "host": "h1"})["host"] == "h1"
    assert training._floor_of({**coda, "host": "h3"})["host"] == "h2"
    # another flavor's profile of that day is set against neither that stock profile nor that floor
    shaped = {"seq_len": 8192, "local_batch_size": 2}
    (tmp_path / "floor_GPU_X_2026-01-02.json").write_text(json.dumps({**floor, "host": "h2", "model": "1B", **shaped}))
    big, small = ({**p, "run": {**p["run"], "model": f"llama3/{f}", **shaped}} for p, f in ((coda, "8B"), (stock, "1B")))
    assert training.family_pairs([small, big]) == [(big, None)]
    assert training._floor_of(big) is None and training._floor_of({**big, "run": small["run"]})["host"] == "h2"


def test_compare_table_sets_coda_against_stock_compiled_by_an_override():
    """The 8B pairs run m_baseline and m_coda with --set compile.enable=true: CODA is set against that
    compiled stock run; an eager stock run is no 'compiled baseline' (n/a)."""
    from scripts.report.training import compare_table

    def doc(compiled):
        runs = [{"config": f"configs/{c}.toml", "attention": "fa4", "tokens_per_s": t, "step_ms": 1.0, "peak_gib": 1.0,
                 "mfu": 1.0, "loss": [1.0], "compile": compiled, "seq_len": 8, "local_batch_size": 1}
                for c, t in (("m_baseline", 100.0), ("m_coda", 125.0))]
        return {"device": "GPU X", "date": "2026-01-02", "versions": {}, "steps": 1, "warmup": 1, "runs": runs}

    row = next(line for line in compare_table(doc(True)).splitlines() if line.startswith("| m_coda "))
    assert "| 1.250x |" in row
    row = next(line for line in compare_table(doc(False)).splitlines() if line.startswith("| m_coda "))
    assert "| n/a |" in row and "1.250x" not in row


def test_plots_are_saved_as_palette_pngs_smaller_than_matplotlibs(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from PIL import Image

    from scripts.report import png

    fig, ax = plt.subplots()
    ax.plot(range(50), [i * i for i in range(50)], label="x^2")
    ax.legend()
    fig.savefig(tmp_path / "plain.png", dpi=110)
    png.save(fig, tmp_path / "small.png")
    plt.close(fig)
    with Image.open(tmp_path / "small.png") as small, Image.open(tmp_path / "plain.png") as plain:
        assert small.mode == "P" and small.size == plain.size
        diff = max(abs(a - b) for a, b in zip(small.convert("RGB").tobytes(), plain.convert("RGB").tobytes()))
    assert diff <= 8  # (a line plot has under 256 colours: only anti-aliased edge pixels move, by a few steps)
    assert (tmp_path / "small.png").stat().st_size < 0.6 * (tmp_path / "plain.png").stat().st_size
    assert not png.compact(tmp_path / "small.png")  # (already a palette: left as it is)


def test_the_floor_measures_every_piece_and_runs_their_best_calls_at_the_cap(monkeypatch):
    """``scripts.bench.floor.measure`` with the timings replaced (CPU): every weight's GEMMs in both precisions
    (the LM head in bf16 only), FA4 and AdamW, then the pass at the cap gets a callable for every key of the
    step's order (the 2026-11-27 GPU run stopped in the FA4 line of this handover) and the totals carry it."""
    import torch

    from scripts.bench import floor

    def gemm_rows(m, n, k, gen):
        return [{"direction": d, "M": m, "N": n, "K": k, "ms": {"x": 1.0}, "best": "x", "best_ms": 1.0, "tflops": 1.0,
                 "_fn": lambda: None} for d in ("fwd", "dgrad", "wgrad")]

    seen = {}

    def fake_at_cap(kernels, order, reps):
        assert all(callable(kernels[k]) for k in order)
        seen[order[0][1]] = len(order)
        return {"ms": 7.0}

    monkeypatch.setattr(floor, "_generator", lambda: None)
    monkeypatch.setattr(floor, "bf16_gemm", gemm_rows)
    monkeypatch.setattr(floor, "fp8_gemm", gemm_rows)
    monkeypatch.setattr(floor, "fa4", lambda *a: {"fwd_ms": 1.0, "bwd_ms": 2.0, "ms": 3.0,
                                                    "_fns": {"fwd": lambda: None, "bwd": lambda: None}})
    monkeypatch.setattr(floor, "adamw", lambda shapes, dtype: {"ms": 4.0, "best": "coda", "params": 1, "_fn": lambda: None})
    monkeypatch.setattr(floor, "at_cap", fake_at_cap)
    monkeypatch.setattr(floor, "header", lambda: {"device": "cpu"})
    doc = floor.measure("debugmodel", 8, 1, torch.float32, lambda d: None, cap_reps=2)
    n = doc["n_layers"]
    assert doc["complete"] and len(doc["gemms"]) == 4 * 2 * 3 + 3
    assert seen == {"bf16": n * 14 + 4, "fp8": n * 14 + 4}
    assert doc["totals"]["fp8"]["capped_floor_ms"] == 7.0 and "_fns" not in doc["fa4"]


def test_bf16_pairs_of_one_day_are_gathered_by_kind_with_coda_measured_against_stock():
    from scripts.compare.parity import parity
    from scripts.report import bf16_parity

    rng = random.Random(0)
    base = [6 - 0.01 * i for i in range(60)]
    noisy = lambda s: [x * (1 + rng.gauss(0, s)) for x in base]  # noqa: E731
    run = lambda f, config, stock, loss, precision="bf16": dict(  # noqa: E731
        file=f, config=config, stock=stock, precision=precision, cohort="h100", loss=loss)
    a, b = "loss_curve_NVIDIA_X_2026-11-28.json", "loss_curve_bf16_repeat_NVIDIA_X_2026-11-28.json"
    runs = [run(a, "llama3_1b_bf16_baseline", True, base), run(a, "llama3_1b_bf16_coda_compile", False, noisy(0.02)),
            run(a, "llama3_1b_bf16_baseline_compile", True, noisy(0.001)),
            run(b, "llama3_1b_bf16_baseline", True, noisy(0.002)), run(b, "llama3_1b_bf16_coda_compile", False, noisy(0.03)),
            run(b, "llama3_1b_bf16_coda_other", False, noisy(0.01)),  # (another CODA config: no CODA / CODA class)
            run(b, "llama3_1b_fp8_baseline_compile", True, noisy(0.5), "fp8"),  # (fp8: not a bf16 pair)
            run("loss_curve_NVIDIA_X_2026-11-27.json", "llama3_1b_bf16_baseline", True, noisy(0.5))]  # (a lone day)
    groups = bf16_parity.pair_classes(runs)
    assert [g["day"] for g in groups] == ["2026-11-28"] and groups[0]["runs"] == 6
    c = groups[0]["classes"]
    assert {k: v["pairs"] for k, v in c.items()} == {"stock / stock": 3, "CODA / stock": 9, "CODA / CODA repeat": 1}
    coda = [r["loss"] for r in runs[:6] if not r["stock"]]
    stock = [r["loss"] for r in runs[:6] if r["stock"]]
    want = [parity(s, k)["mean_abs_rel_dev"] for s in stock for k in coda]  # (relative to the stock run's loss)
    assert c["CODA / stock"]["mean_abs_rel_dev"] == (min(want), max(want))
    assert c["CODA / CODA repeat"]["mean_abs_rel_dev"][0] == parity(coda[0], coda[1])["mean_abs_rel_dev"]
    assert c["stock / stock"]["max_rel_dev"][1] < c["CODA / stock"]["max_rel_dev"][0]
    table = bf16_parity.pair_table(groups)
    assert table.count("| 2026-11-28 | 6 (2) |") == 3 and "2026-11-27" not in table
    assert bf16_parity.pair_table([]) == ""
    one = [run("loss_curve_NVIDIA_X_2026-11-29.json", c, True, noisy(0.001)) for c in ("a", "b")]  # (no repeat)
    assert bf16_parity.pair_classes(one) == []
    one.append(run("loss_curve_NVIDIA_X_2026-11-29.json", "a", True, noisy(0.001)))  # (a repeat in one file)
    assert [(g["day"], g["classes"]["stock / stock"]["pairs"]) for g in bf16_parity.pair_classes(one)] == [("2026-11-29", 3)]
    amp = [run("loss_curve_bf16_amp_NVIDIA_X_2026-11-29.json", c, True, noisy(0.001), "bf16-amp") for c in ("a", "a")]
    got = [(g["day"], g["runs"]) for g in bf16_parity.pair_classes(one + amp)]  # (AMP runs: a group of their own)
    assert got == [("2026-11-29", 3), ("2026-11-29 (bf16-amp)", 2)]
    # two commits of CODA on one day: a set each, with every stock run; no CODA / CODA pair across them
    day = "loss_curve_NVIDIA_X_2026-11-30.json"
    two = [run(day, "llama3_1b_bf16_baseline", True, base), run(day, "llama3_1b_bf16_baseline", True, noisy(0.002)),
           dict(run(day, "llama3_1b_bf16_coda_compile", False, noisy(0.03)), commit="aaa"),
           dict(run(day, "llama3_1b_bf16_coda_compile", False, noisy(0.01)), commit="bbb")]
    got = {g["day"]: {k: v["pairs"] for k, v in g["classes"].items()} for g in bf16_parity.pair_classes(two)}
    assert got == {f"2026-11-30, CODA at {c}": {"stock / stock": 1, "CODA / stock": 2} for c in ("aaa", "bbb")}
    spans = [g["classes"]["CODA / stock"]["mean_abs_rel_dev"] for g in bf16_parity.pair_classes(two)]
    assert spans[0][0] > spans[1][1]  # (the noisier commit's span apart from the other's, not pooled with it)


def test_bf16_pairs_name_the_steps_where_their_trajectories_part():
    from scripts.report import bf16_parity
    from scripts.compare.parity import PART

    base = [6 - 0.01 * i for i in range(60)]
    parted = lambda at, by: base[:at - 1] + [x * (1 + by) for x in base[at - 1:]]  # noqa: E731
    day = "loss_curve_NVIDIA_X_2026-12-01.json"
    run = lambda config, stock, loss: dict(file=day, config=config, stock=stock, precision="bf16",  # noqa: E731
                                           cohort="h100", loss=loss)
    runs = [run("s", True, base), run("s", True, parted(40, 3 * PART)), run("s", True, parted(50, 0.5 * PART)),
            run("c", False, parted(12, 2 * PART))]
    c = bf16_parity.pair_classes(runs)[0]["classes"]
    # stock pairs: base/second part at 40, base/third never (below the threshold), second/third at 40
    assert c["stock / stock"]["parts_at"] == (40, 40) and c["stock / stock"]["never_parted"] == 1
    assert c["CODA / stock"]["parts_at"] == (12, 12) and c["CODA / stock"]["never_parted"] == 0
    table = bf16_parity.pair_table(bf16_parity.pair_classes(runs))
    assert "| 40 (1 never) |" in table and "| 12 |" in table
    assert bf16_parity.pair_table(bf16_parity.pair_classes(runs[:1] + runs[2:3])).rstrip().endswith("| never |")


def test_a_configs_repeats_in_one_loss_curve_are_numbered_in_its_plot():
    from scripts.report.training import _run_labels

    runs = [{"config": "configs/x.toml"}, {"config": "configs/y.toml"}, {"config": "other/x.toml"}]
    assert [_run_labels(runs)[id(r)] for r in runs] == ["x", "y", "x #2"]


def test_the_cpu_precision_table_lists_every_pair_with_its_runs_last_50_mean():
    from scripts.probes.cpu_precision import SHAPE, summarize
    from scripts.report import bf16_parity

    ref = [5.0 + 0.001 * s for s in range(60)]
    losses = {"stock_fp32": ref, "coda_fp32": ref, "stock_bf16": [v * 1.02 for v in ref]}
    doc = {"steps": 60, "shape": SHAPE, "date": "2026-11-28T23:00:00Z", **summarize(losses)}
    table = bf16_parity.precision_table(doc)
    rows = [line for line in table.splitlines() if line.startswith("| stock_bf16 |") or line.startswith("| coda_fp32 |")]
    assert len(rows) == 3 and "| coda_fp32 | stock_fp32 | 0.000% |" in table
    assert "| stock_bf16 | stock_fp32 | 2.000% | 2.000% | 2.000% |" in table
    assert f"{1.02 * sum(ref[-50:]) / 50:.4f} against {sum(ref[-50:]) / 50:.4f}" in table


def test_the_bf16_noise_floor_criterion_is_gathered_over_every_stored_run_that_measured_it(tmp_path):
    """Each file with stock eager, its compiled twin and a CODA run gives one row: the two deviations beside the
    twin's, where each parted, the seed (a ``--debug.seed`` override over the config's), the commit and the verdict;
    a file without the twin gives none; the table counts the runs that met."""
    from scripts.compare.parity import PART, noise_floor_record, parity
    from scripts.report import bf16_parity

    base = [6 - 0.01 * i for i in range(60)]
    off = lambda at, by: base[:at - 1] + [x * (1 + by) for x in base[at - 1:]]  # noqa: E731
    cfg = lambda coda: '[model]\nname = "' + ("coda_llama3" if coda else "llama3") + '"\n\n[debug]\nseed = 42\n'  # noqa: E731
    run = lambda name, loss, coda=False, ov=(): {"config": f"configs/{name}.toml", "loss": loss, "precision": "bf16",  # noqa: E731
                                                 "config_run": cfg(coda), "overrides": list(ov)}

    def doc(coda_loss, twin_loss, ov=(), twin=True, commit="abc1234-dirty"):
        runs = [run("x", base, ov=ov), run("x_coda", coda_loss, True, ov)] + ([run("x_compile", twin_loss, ov=ov)] if twin else [])
        return {"device": "d", "versions": {"coda_titan_commit": commit}, "runs": runs,
                "parity": [{"candidate": Path(r["config"]).stem, **parity(base, r["loss"])} for r in runs[1:]]}

    docs = {"loss_curve_a.json": doc(off(30, 2 * PART), off(25, 4 * PART)),  # CODA closer: met
            "loss_curve_b.json": doc(off(30, 6 * PART), off(40, 4 * PART), ov=("--debug.seed", "7")),  # farther
            "loss_curve_c.json": doc(off(30, 2 * PART), None, twin=False)}  # no twin: no verdict
    paths = []
    for name, d in docs.items():
        paths.append(tmp_path / name)
        paths[-1].write_text(json.dumps(d))
    rec = noise_floor_record(paths)
    assert [(r["file"], r["seed"], r["commit"], r["parts_at"], r["met"]) for r in rec] == [
        ("loss_curve_a.json", 42, "abc1234", (30, 25), True), ("loss_curve_b.json", 7, "abc1234", (30, 40), False)]
    assert rec[1]["mean_abs_rel_dev"][0] > rec[1]["mean_abs_rel_dev"][1]
    table = bf16_parity.noise_floor_table(rec)
    assert "met in 1 of 2" in table and table.count("| abc1234 | x_coda |") == 3  # (two runs, their average)
    assert "| 30 / 40 | no |" in table and bf16_parity.noise_floor_table([]) == ""
    mean = lambda i: sum(r["mean_abs_rel_dev"][i] for r in rec) / 2  # noqa: E731
    assert f"| abc1234 | x_coda | 2 | 1 | {100 * mean(0):.2f}% / {100 * mean(1):.2f}% |" in table  # (one commit's rows)


def test_the_headline_gives_each_gpu_models_newest_comparison(tmp_path, monkeypatch):
    from scripts.report import pages

    def compare(device, date, tps, step_ms, floor):
        cfg = "llama3_1b_bf16_coda_compile"
        return {"device": device, "date": date, "floor": {"bf16": floor},
                "runs": [{"config": f"configs/{cfg}.toml", "step_ms": step_ms}],
                "targets": [{"config": cfg, "baseline": "stock", "metric": "tokens_per_s", "value": tps},
                            {"config": cfg, "baseline": "stock", "metric": "peak_gib", "value": 0.75}]}

    monkeypatch.setattr(pages, "RESULTS", tmp_path)
    for name, doc in (("compare_NVIDIA_A_2026-11-20.json", compare("A", "2026-11-20T10:00", 1.01, 300.0, 250.0)),
                      ("compare_NVIDIA_A_2026-11-27.json", compare("A", "2026-11-27T10:00", 1.07, 275.0, 250.0)),
                      ("compare_NVIDIA_B_2026-11-29.json", compare("B", "2026-11-29T10:00", 1.05, 270.0, 240.0))):
        (tmp_path / name).write_text(json.dumps(doc))
    rows = pages.headline().splitlines()[2:]
    assert [r.split(" | ")[3] for r in rows] == ["1.050x", "1.070x"]  # (B's, the newest GPU first; A's newest only)
    assert [r.split(" | ")[6:8] for r in rows] == [["B", "2026-11-29 |"], ["A", "2026-11-27 |"]]
    assert rows[0].split(" | ")[5] == f"{270.0 / 240.0:.3f}"


def test_the_headline_targets_say_which_goal_each_newest_comparison_met(tmp_path, monkeypatch):
    from scripts.report import pages

    monkeypatch.setattr(pages, "RESULTS", tmp_path)
    assert pages.headline_targets() == ""  # (no comparison, no table)
    goal = lambda v, met: {"config": "x_coda", "baseline": "x", "metric": "tokens_per_s",  # noqa: E731
                           "goal": ">= 1.25x tokens/s of x", "value": v, "met": met}
    for name, date, target in (("compare_fp8_coda_NVIDIA_A_2026-11-20.json", "2026-11-20T10:00", goal(1.31, True)),
                               ("compare_fp8_coda_NVIDIA_A_2026-11-27.json", "2026-11-27T10:00", goal(1.2049, False))):
        (tmp_path / name).write_text(json.dumps({"device": "A", "date": date, "runs": [], "targets": [target]}))
    rows = pages.headline_targets().splitlines()[2:]
    assert rows == ["| FP8 | A | 2026-11-27 | `x_coda`: >= 1.25x tokens/s of x | 1.205x | **no** |"]  # (the newest)


def test_the_memory_table_reads_each_traced_step(tmp_path):
    """``scripts.report.memory`` on a hand-made run folder: a step with a timeline names the last segment
    mapped before its reserved peak by its innermost frame outside inductor's generated code; a step of the
    probe's first version says it has no timeline; no folder, no section."""
    from scripts.report import memory

    assert memory.section(tmp_path) == ""
    run = tmp_path / "memsnap" / "fp8_coda_GPU_2026-12-07"
    run.mkdir(parents=True)
    gen = "ab/c" + "x" * 50 + ".py:12 call"
    step1 = {"step": 1, "reserved_peak_gib": 27.1, "allocated_at_reserved_peak_gib": 23.38, "allocated_peak_gib": 24.38,
             "reserved_at_allocated_peak_gib": 27.1, "reserved_end_gib": 13.08, "reserved_peak_event": 9,
             "timeline": [[3, 1.0, 20.0, 18.0, 0, ["cute/casts.py:5 cast", "x.py:1 f"]], [5, -1.0, 19.0, 18.0, 0, []],
                          [9, 0.5, 27.1, 23.38, 0, [gen, "kernels/norm_swiglu.py:121 _dswiglu"]],
                          [11, 2.0, 29.1, 20.0, 0, ["later.py:1 g"]]]}
    step2 = {"step": 2, "reserved_peak_gib": 28.18, "allocated_at_reserved_peak_gib": 13.05, "allocated_peak_gib": 23.62,
             "reserved_end_gib": 22.36}
    for d in (step1, step2):
        (run / f"memsnap_step{d['step']}.json").write_text(json.dumps(d))
    text = memory.section(tmp_path)
    rows = [r for r in text.splitlines() if r.startswith("| fp8_coda")]
    assert rows[0].endswith("| 1 | 27.10 | 23.38 | 24.38 | 27.10 | 13.08 | `kernels/norm_swiglu.py:121 _dswiglu` |")
    assert "| 2 | 28.18 | 13.05 | 23.62 | n/a | 22.36 | n/a (the probe's first version kept no timeline) |" in rows[1]


def test_the_floor_parts_table_partitions_each_step_and_sets_it_against_its_floor():
    """``scripts.report.floor_parts`` on hand-made profiles: the parts add up to the step's kernel time (GEMMs: every
    family and the unclaimed GEMM kernels; attention; optimizer; the rest), each beside the floor's part of the run's
    precision; only the newest configured CODA profile of a device, precision and model that has a floor is shown."""
    from scripts.report import floor_parts

    def prof(stem, date, families, attention, optimizer, total, timeline=None):
        s = {"gpu_kernel_ms": total, "categories_ms": {"attention": attention + 1.0, "optimizer": optimizer},
             "gemm_families": {"families_ms": families, "unattributed_gemm_ms": 0.5, "attention_ms": attention},
             "carried_in": {"kernels": 0, "ms": 0.0}}
        if timeline:
            s["step_timeline"] = timeline
        return {"device": "GPU X", "date": date, "config": f"configs/{stem}.toml",
                "run": {"precision": "fp8", "model": "llama3/1B"}, "summary": s}

    tl = {"step_ms": 60.0, "main_stream": {"busy_ms": 55.0, "idle_ms": 5.0}, "optimizer": {"on_main_stream": False}}
    coda = prof("m_fp8_coda_compile", "2026-01-02", {"qkv/fwd": 10.0, "lm_head/all": 9.5}, 20.0, 4.0, 50.0, tl)
    stock = prof("m_fp8_baseline_compile", "2026-01-02", {"qkv/fwd": 12.0}, 19.0, 3.0, 70.0)
    assert floor_parts.parts_ms(coda) == {"GEMMs": 20.0, "attention": 20.0, "optimizer": 4.0, "every other kernel": 6.0}
    assert sum(floor_parts.parts_ms(stock).values()) == 70.0
    assert floor_parts.parts_ms({"summary": {}}) is None  # (no family attribution: no parts)
    totals = {p: {"layer_gemms_ms": 11.0 if p == "fp8" else 22.0, "lm_head_ms": 5.0, "attention_ms": 15.0,
                  "optimizer_ms": 2.0, "floor_ms": 33.0 if p == "fp8" else 44.0} for p in ("bf16", "fp8")}
    floor = {"totals": totals, "at_cap": {"fp8": {"ms": 36.5}}}
    table = floor_parts.floor_parts_table(coda, stock, floor)
    assert "| GEMMs | 16.0 | 20.0 | +4.0 | 12.5 | -3.5 |" in table  # (the fp8 floor's layer GEMMs + its LM head)
    assert "| every other kernel | 0.0 | 6.0 | +6.0 | 35.5 | +35.5 |" in table
    assert "| all kernels | 33.0 | 50.0 | +17.0 | 70.0 | +37.0 |" in table
    assert "main stream ran kernels for 55.0 ms" in table and "cap: 36.5 ms" in table
    assert "| attention | 15.0 | 20.0 | +5.0 | n/a | n/a |" in floor_parts.floor_parts_table(coda, None, floor)
    older = {**coda, "date": "2026-01-01"}
    variant = {**coda, "date": "2026-01-03", "config": "configs/m_fp8_coda_compile_probe.toml"}
    pairs = [(older, None), (coda, stock), (variant, None)]
    shown = floor_parts.section(pairs, lambda doc: floor)
    assert shown.count("against its floor") == 1 and "2026-01-02" in shown and "| stock - floor |" in shown
    assert floor_parts.section(pairs, lambda doc: None) == ""  # (no floor that day: no table)
    assert floor_parts.section(pairs, lambda doc: {"totals": {}}) == ""  # (a floor without its totals: none)
    # with the pass at the cap timed by part, a column of its own (GEMMs: layer + head, attention: fwd + bwd)
    parts = {"layer_gemms": 12.0, "lm_head": 5.5, "attention_fwd": 5.0, "attention_bwd": 11.0, "optimizer": 3.0}
    capped = {**floor, "at_cap": {"fp8": {"ms": 36.5, "parts_ms": parts}}}
    table = floor_parts.floor_parts_table(coda, stock, capped)
    assert "| part | floor | floor at the cap | CODA |" in table and "cap: 36.5 ms" not in table
    assert "| GEMMs | 16.0 | 17.5 | 20.0 | +4.0 |" in table and "| attention | 15.0 | 16.0 | 20.0 | +5.0 |" in table
    assert "| all kernels | 33.0 | 36.5 | 50.0 | +17.0 |" in table
