"""The weight-drift probe (scripts/probes/weight_drift.py): its arithmetic, and the whole probe on the CPU's debug
pair (real TorchTitan runs with checkpoints: a TorchTitan that moved its checkpoint's model keys fails here)."""

import json

import pytest
import torch

from scripts.compare.parity import first_parting
from scripts.probes.weight_drift import distances, kind, main


def test_distances_are_per_kind_and_whole_relative_to_the_reference_and_to_its_own_move():
    ref_prev = {"layers.0.attention.wq.weight": torch.zeros(2, 2), "layers.1.attention.wq.weight": torch.zeros(2, 2),
                "norm.weight": torch.ones(2)}
    ref = {"layers.0.attention.wq.weight": torch.full((2, 2), 1.0),
           "layers.1.attention.wq.weight": torch.full((2, 2), 1.0), "norm.weight": torch.ones(2)}
    w = {k: v.clone() for k, v in ref.items()}
    w["layers.1.attention.wq.weight"][0, 0] += 0.5
    w["norm.weight"][1] = 2.0
    d = distances(w, ref, ref_prev)
    assert set(d) == {"attention.wq", "norm", "all"}
    assert d["attention.wq"]["rel"] == pytest.approx(0.5 / 8**0.5)  # (|| (0.5, 0...) || over the two layers' norm)
    assert d["attention.wq"]["per_update"] == pytest.approx(0.5 / 8**0.5)  # (the layers moved by all-ones)
    assert d["norm"]["rel"] == pytest.approx(1 / 2**0.5) and d["norm"]["per_update"] is None  # (it did not move)
    assert d["all"]["rel"] == pytest.approx((0.25 + 1) ** 0.5 / 10**0.5)
    assert "per_update" not in distances(w, ref, None)["all"]
    assert kind("layers.12.feed_forward.w2.weight") == "feed_forward.w2" and kind("output.weight") == "output"


def test_first_parting_is_the_first_step_past_the_threshold():
    ref = {1: 10.0, 2: 9.0, 3: 8.0}
    assert first_parting({1: 10.0, 2: 9.0 * (1 + 2e-3), 3: 8.0}, ref) == 2
    assert first_parting({1: 10.0, 2: 9.0 * (1 + 5e-4), 3: 8.0}, ref) is None


def test_the_probe_on_the_debug_pair(tmp_path, cache_dir, monkeypatch):
    """Three CPU runs (stock, CODA's torch backend, stock again) with checkpoints at steps 1 and 2: stock against its
    own repeat is 0 everywhere (the CPU is deterministic), CODA differs from stock by its rounding (fp32: well under
    1e-4 of the weights), and every parameter kind of the debug model is compared."""
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    monkeypatch.setenv("CODA_TITAN_CACHE", str(cache_dir))
    main(["--cpu", "--steps", "1", "2", "--workdir", str(tmp_path / "runs")])
    doc = json.loads((tmp_path / "out" / "probe_weight_drift_cpu.json").read_text())
    assert list(doc["arms"]) == ["stock", "coda", "stock_2"]
    rep, coda = doc["distances"]["stock_2|stock"], doc["distances"]["coda|stock"]
    assert set(rep) == {"1", "2"} and "per_update" in rep["2"]["all"] and "per_update" not in rep["1"]["all"]
    assert all(v["rel"] == 0.0 for v in rep["2"].values())
    assert 0 < coda["2"]["all"]["rel"] < 1e-4
    kinds = {"tok_embeddings", "attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1",
             "feed_forward.w2", "feed_forward.w3", "attention_norm", "ffn_norm", "norm", "output", "all"}
    assert set(coda["2"]) == kinds
    assert doc["arms"]["coda"]["losses"].keys() == {"1", "2"} and doc["arms"]["coda"]["parts_from"] == {"stock": None}
    assert doc["arms"]["coda"]["grad_norms"].keys() == {"1", "2"} and doc["arms"]["stock_2"]["grad_norms"]["2"] > 0
    from scripts.report.bf16_parity import weight_drift_table

    table = weight_drift_table(doc, "probe_weight_drift_cpu.json")
    assert "| coda | stock | " in table and "| stock_2 | stock | " in table and "ended before" not in table
    doc["planned"] = doc["planned"] + ["coda"]  # (a call cut before its last run: the table says which)
    assert "(the call ended before coda)" in weight_drift_table(doc, "x.json")
    del doc["planned"]  # (a file from before the probe kept its plan: the command's --arms, else the default)
    assert "(the call ended before" not in weight_drift_table(doc, "x.json")


def test_the_report_reads_a_cut_calls_plan_off_its_command():
    from scripts.probes.weight_drift import DEFAULT
    from scripts.report.bf16_parity import _planned_arms

    assert _planned_arms({"command": "python -m scripts.probes.weight_drift --arms a b --steps 20 40"}) == ["a", "b"]
    assert _planned_arms({"command": "python -m scripts.probes.weight_drift --steps 20 40 --arms a b"}) == ["a", "b"]
    assert _planned_arms({"command": "python -m scripts.probes.weight_drift --steps 20 40"}) == list(DEFAULT)
