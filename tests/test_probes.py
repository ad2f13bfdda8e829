"""The step-phases probe (scripts/probes/step_phases.py): its arithmetic, and its wrappers on TorchTitan's
own Trainer (a real CPU run: a TorchTitan that renamed what the probe wraps fails here, not on the GPU)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from scripts.probes.step_phases import ENV_LOG, PHASES, phases_of, slow_steps

from .conftest import CONFIGS, NO_NETRC, ROOT


def test_phases_are_the_gaps_between_the_stamps():
    t = dict(prev_end=0.0, start=0.010, data0=0.011, data1=0.015, data_s=0.004, fb0=0.016, bwd0=0.050, fb1=0.120,
             clip0=0.121, clip1=0.123, opt0=0.124, opt1=0.130, log0=0.200, log1=0.201)
    row = phases_of(t)
    want = dict(between=10, pre=1, data=4, h2d=1, fwd=34, bwd=70, clip=2, opt=6, wait=70, log=1)
    assert set(row) == set(PHASES)
    assert row == pytest.approx(want)
    first = phases_of({k: v for k, v in t.items() if k not in ("prev_end", "log0", "log1")})
    assert first["between"] is None and first["wait"] is None and first["log"] is None


def test_slow_steps_are_timed_steps_over_the_median_with_their_excess():
    base = {k: 1.0 for k in PHASES}
    steps = [{"step": i, "step_ms": 100.0, **base} for i in range(1, 13)]
    steps[0]["step_ms"] = 900.0  # a warm-up step: never slow, never in the medians
    steps[7].update(step_ms=160.0, wait=61.0)
    got = slow_steps(steps, warmup=1)
    assert got["medians"]["step_ms"] == 100.0 and got["medians"]["wait"] == 1.0
    assert [s["step"] for s in got["slow"]] == [8]
    assert got["slow"][0]["excess_ms"]["wait"] == 60.0
    assert all(v == 0.0 for k, v in got["slow"][0]["excess_ms"].items() if k != "wait")


@pytest.mark.parametrize("extra", [(), ("--coda.fused_clip",)], ids=["clip", "fused_clip"])
def test_the_child_stamps_every_phase_of_a_real_training_run(tmp_path, cache_dir, extra):
    log = tmp_path / "phases.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update({ENV_LOG: str(log), "CODA_TITAN_CACHE": str(cache_dir), "WANDB_SILENT": "true", "NETRC": NO_NETRC,
                "PYTHONPATH": str(ROOT)})
    cmd = [sys.executable, "-m", "scripts.probes.step_phases", "child", "train", str(CONFIGS / "debug_cpu_coda.toml"),
           "--training.steps", "3", "--job.dump_folder", str(tmp_path / "out"), *extra]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    *rows, last = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        stamped = {k for k, v in r.items() if v is not None}
        assert stamped == {"step", *PHASES} - ({"between"} if r["step"] == 1 else set())
        assert all(r[k] >= 0 for k in stamped - {"step"})
        assert r["fwd"] > 0 and r["bwd"] > 0  # the model ran between the stamps
    assert last == {"alloc_streams": {}}  # (after the last step only; nothing to read without CUDA)


def test_alloc_streams_sums_a_snapshot_by_named_stream():
    """``scripts.probes.alloc_streams`` on a hand-made snapshot: three segments on the main stream and the
    optimizer's, one on a stream nobody named; the sums, the largest free block and the names by hand."""
    import types

    from scripts.probes.alloc_streams import GIB, by_stream, stream_names

    side = types.SimpleNamespace(cuda_stream=7)
    trainer = types.SimpleNamespace(model_parts=[types.SimpleNamespace(optimizer_stream=types.SimpleNamespace(
        stream=side), _side_stream=None)])
    names = stream_names(trainer, current=0)
    assert names == {0: "main", 7: "optimizer"}

    def seg(stream, total, allocated, free):
        return {"stream": stream, "total_size": total * GIB, "allocated_size": allocated * GIB,
                "blocks": [{"size": f * GIB, "state": "inactive"} for f in free]
                + [{"size": allocated * GIB, "state": "active_allocated"}]}

    rows = by_stream([seg(0, 4, 3, [1]), seg(7, 2, 0.5, [0.25, 1.25]), seg(0, 2, 2, []), seg(9, 1, 0, [1])], names)
    assert [r["stream"] for r in rows] == ["main", "optimizer", "other"]  # the largest reserved first
    assert rows[0] == {"stream": "main", "handle": 0, "segments": 2, "reserved_gib": 6.0, "allocated_gib": 5.0,
                       "largest_free_gib": 1.0}
    assert (rows[1]["reserved_gib"], rows[1]["allocated_gib"], rows[1]["largest_free_gib"]) == (2.0, 0.5, 1.25)
    assert rows[2]["handle"] == 9 and rows[2]["segments"] == 1


def test_mem_timeline_replays_a_hand_made_trace_to_its_reserved_peak():
    """``scripts.probes.mem_timeline.replay`` on a hand-made allocator trace: two segments mapped, blocks
    allocated and freed, one segment given back; the peaks, the live blocks at the reserved peak and the
    named frames by hand (a frame outside the named modules is left out)."""
    from scripts.probes.mem_timeline import GIB, replay

    fr = [{"filename": "/usr/lib/python3/threading.py", "line": 1, "name": "run"},
          {"filename": "/x/coda_titan/model/block.py", "line": 42, "name": "forward"}]
    ev = [{"action": "segment_alloc", "size": 2 * GIB, "stream": 0, "frames": fr},
          {"action": "alloc", "addr": 1, "size": GIB, "frames": fr},
          {"action": "alloc", "addr": 2, "size": GIB // 2, "frames": []},
          {"action": "free_requested", "addr": 1, "size": GIB},
          {"action": "free_completed", "addr": 1, "size": GIB},
          {"action": "segment_alloc", "size": 3 * GIB, "stream": 5, "frames": []},
          {"action": "alloc", "addr": 3, "size": 2 * GIB, "frames": []},
          {"action": "free_completed", "addr": 3, "size": 2 * GIB},
          {"action": "segment_free", "size": 3 * GIB}]
    r = replay(ev, reserved0=10 * GIB, allocated0=4 * GIB)
    assert r["reserved_peak_gib"] == 15 and r["reserved_peak_event"] == 5
    assert r["allocated_at_reserved_peak_gib"] == 4.5 and r["allocated_peak_gib"] == 6.5
    assert (r["reserved_end_gib"], r["allocated_end_gib"]) == (12, 4.5)
    assert [b["gib"] for b in r["live_at_reserved_peak"]] == [0.5]  # (block 1 was freed before the peak)
    assert [(m["gib"], m["stream"]) for m in r["segments_mapped_to_peak"]] == [(3, 5), (2, 0)]
    assert r["segments_mapped_to_peak"][1]["frames"] == ["model/block.py:42 forward"]
    assert r["segments_mapped"] == 2 and r["segments_mapped_gib"] == 5
    assert r["reserved_at_allocated_peak_gib"] == 15  # (the allocated peak, 6.5, came after the second segment)
    assert [(t[1], t[2]) for t in r["timeline"]] == [(2, 12), (3, 15), (-3, 12)]


def test_the_pin_thread_probe_reads_the_state_each_batch_carries(cache_dir, monkeypatch):
    """``scripts.probes.pin_thread``: TorchTitan's text dataset keeps its leftover tokens in its state as a
    Python list, and torchdata's loader sends that state with every batch (``snapshot_every_n_steps``
    defaults to 1), so the pin-memory thread walks the list each step. A TorchTitan or torchdata that
    changed either premise fails here."""
    import inspect

    from torchdata.stateful_dataloader import StatefulDataLoader

    from scripts.probes.pin_thread import measure

    assert inspect.signature(StatefulDataLoader.__init__).parameters["snapshot_every_n_steps"].default == 1
    monkeypatch.setenv("CODA_TITAN_CACHE", str(cache_dir))
    doc = measure(batches=4, seq_len=64, batch=2)
    assert len(doc["batches"]) == 4 and all(r["pin_python_ms"] > 0 for r in doc["batches"])
    assert all(0 <= r["token_buffer"] for r in doc["batches"]) and max(r["token_buffer"] for r in doc["batches"]) > 0


def test_the_step_timeline_reads_a_trace_from_one_optimizer_phase_to_the_next(tmp_path):
    """A synthetic chrome trace: the optimizer on a side stream at 0 and 1000 us (two phases), the main stream's
    forward (two attention forwards 300 us apart, small kernels with gaps) and backward, a weight pass on a third
    stream. Every figure of the probe's JSON is checked against the hand count."""
    import gzip

    from scripts.probes.step_timeline import main as timeline_main

    def k(name, tid, ts, dur):
        return {"ph": "X", "cat": "kernel", "name": name, "tid": tid, "ts": ts, "dur": dur}

    opt = "multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata<4>>"
    events = [k(opt, 9, 0, 50), k(opt, 9, 60, 40),  # phase 1 (0-100 us), phase 2 at 30,000 us (> 20 ms later)
              k("gather", 7, 120, 5), k("flash_fwd_sm90", 7, 130, 200), k("amax", 7, 340, 4),  # forward
              k("flash_fwd_sm90", 7, 430, 200), k("gemm", 7, 640, 100),
              k("FlashAttentionBackwardSm90", 7, 800, 300), k("fill", 7, 1110, 2), k("gemm", 7, 1120, 500),  # backward
              k("cast", 17, 90, 30), k("outside", 7, 40_000, 10), k(opt, 9, 30_000, 50)]
    events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "tid": 1, "ts": 0, "dur": 1})
    trace = tmp_path / "trace_x.json.gz"
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": events, "deviceProperties": [{"name": "GPU X"}]}, f)
    os.environ["OUT"] = str(tmp_path)
    try:
        timeline_main([str(trace)])
    finally:
        del os.environ["OUT"]
    doc = json.loads((tmp_path / "timeline_x.json").read_text())
    assert doc["device"] == "GPU X" and doc["window"] == "optimizer to optimizer" and doc["step_ms"] == 30.0
    # any stream busy: 0-50, 60-125 (the optimizer, the weight pass 90-120, the gather), then the main stream's
    assert doc["gpu_busy_ms"] == pytest.approx((50 + 65 + 200 + 4 + 200 + 100 + 300 + 2 + 500) / 1e3)
    fwd, bwd, main = doc["forward"], doc["backward"], doc["main_stream"]
    assert fwd["kernels"] == 5 and fwd["busy_ms"] == pytest.approx(0.509) and fwd["small_kernels"] == 2
    assert fwd["idle_ms"] == pytest.approx((5 + 10 + 86 + 10) / 1e3) and fwd["gaps_before_small_ms"] == pytest.approx(0.010)
    assert bwd["kernels"] == 3 and bwd["small_kernels"] == 1 and bwd["idle_ms"] == pytest.approx(0.018)
    assert main["kernels"] == 8 and main["first_kernel_after_ms"] == pytest.approx(0.12)  # ("outside" is past the window)
    assert doc["layer_forward_ms"] == [0.3] and doc["first_attention_after_ms"] == pytest.approx(0.13)
    assert doc["optimizer"]["kernels"] == 2 and doc["optimizer"]["span_ms"] == pytest.approx(0.1)
    assert doc["optimizer"]["main_stream_kernel_ms_inside"] == 0.0 and not doc["optimizer"]["on_main_stream"]
    assert doc["other_streams_kernel_ms"] == {"9": pytest.approx(0.09), "17": pytest.approx(0.03)}


def test_the_folds_probes_one_launch_sums_are_sums_within_the_probes_bound():
    """``scripts/probes/folds.py``'s one-launch candidates (B3's zdz and B2's dgamma from their epilogues'
    partials, a 2-d tile a program) in Triton's interpreter (``tests/folds_interpreter_check.py``): within
    the bound the probe judges them by (two fp32 sums of n terms in different orders: 2 (n - 1) units of the
    sum of the terms' magnitudes times the factor, plus a unit of the product), on ragged row and column
    blocks and rows wider than one tile; a result 0.1% off is far over that bound."""
    from .helpers import run_interpreter_check

    got = run_interpreter_check("folds_interpreter_check.py")
    assert all(v <= 1.0 for k, v in got.items() if k != "wrong_over_bound"), got
    assert got["wrong_over_bound"] > 10, got


def test_b1s_pass_at_other_shapes_writes_the_same_bits():
    """B1's pass at the shapes of ``scripts/probes/b1_pass.py`` (rows a program, the row in column blocks: a
    ragged last block, blocks inside a head, one row, the row's power of two) in Triton's interpreter
    (``tests/b1_chunk_interpreter_check.py``) against one power-of-two block of a row a program: da, the e5m2
    codes and the row amax bit for bit, zdz within its derived bound (the same exact fp32 terms y * dy summed in
    another order: 2 gamma_{n-1} sum |y dy| over the row's n = 40 columns)."""
    from .helpers import run_interpreter_check

    got = run_interpreter_check("b1_chunk_interpreter_check.py")
    assert len(got) == 24, got
    assert all(v for k, v in got.items() if k.endswith("_equal")), got
    assert all(v <= 1.0 for k, v in got.items() if k.endswith("_zdz_over_bound")), got


def test_b1_reading_fa4s_accumulators_gives_the_configured_passs_bits():
    """The probe's B1 passes over FlashAttention's fp32 accumulators in their measured order (``scripts/probes/
    b1_accum.py``: by token rows at two block shapes, and by tiles read in storage order), in Triton's
    interpreter: da, its e5m2 codes and the amax (per row; per tensor for the tiles) are the
    configured pass's bits on the bf16 gradients the accumulators stand for; zdz sums its Q terms in another
    order: within 2 Q u sum |y dy| (u = 2^-24), the bound of two fp32 summation orders."""
    from .helpers import run_interpreter_check

    got = run_interpreter_check("b1_accum_interpreter_check.py")
    assert got.pop("offsets_are_a_permutation")
    assert set(got) == {"r16", "r64", "tiles"}
    for shape in got.values():
        assert shape["da"] == shape["daq"] == shape["amax"] == 0, shape
        assert shape["zdz_over_reassociation"] <= 1.0, shape


def test_bf16_step_accuracy_measures_stock_and_coda_bf16_against_the_same_step_in_fp32():
    """``scripts.probes.bf16_step_accuracy`` on the CPU (debug flavor, the torch backend, SDPA): stock llama3 and
    CODA's reference math in bf16 are the same function in the same precision, so each one's gradient error
    against fp32 is within twice the other's (docs/design.md's bound for another summation order). A stock model
    cast with ``.to(bfloat16)`` (its complex RoPE table cast to real) was 50x off on ``wq`` and fails here."""
    from scripts.probes.bf16_step_accuracy import Setup, _compare, measure
    from scripts.report.bf16_parity import step_accuracy_table

    g = torch.randn(1000, dtype=torch.float64)
    flipped = g.clone()
    flipped[:10] *= -1
    d2, r2, flips = _compare(g, g)
    assert d2 == 0 and r2 == pytest.approx((g * g).sum().item()) and flips == 0
    assert _compare(flipped, g)[2] == pytest.approx(0.01)

    doc = measure(Setup(flavor="debugmodel", seqlen=64, batch=2, device="cpu", backend="torch", fa4=False),
                  models=("stock_eager", "coda_eager"))
    stock, coda = (doc["summary"][n]["vs_fp32"] for n in ("stock_eager", "coda_eager"))
    assert 0 < stock["whole_rel"] <= 2 * coda["whole_rel"] and 0 < coda["whole_rel"] <= 2 * stock["whole_rel"]
    assert stock["max_rel"] <= 2 * coda["max_rel"] and coda["max_rel"] <= 2 * stock["max_rel"]
    assert set(doc["params"]["coda_eager"]["vs_fp32"]) == set(doc["params"]["stock_eager"]["vs_fp32"])
    assert set(doc["params"]["coda_eager"]["vs_stock_eager"]) == set(doc["params"]["coda_eager"]["vs_fp32"])
    assert doc["summary"]["stock_eager"]["vs_stock_eager"] is None
    # (the loss, a mean of fp32 sums over bf16 operands: within two bf16 roundings of fp32's)
    assert all(abs(doc["loss"][n] / doc["loss"]["fp32"] - 1) < 2 ** -7 for n in ("stock_eager", "coda_eager"))
    table = step_accuracy_table({**doc, "device": "cpu", "date": "2026-11-28"})
    assert "| stock_eager |" in table and "| coda_eager |" in table and f"{coda['whole_rel']:.2e}" in table


def test_attention_tensors_records_each_layer_against_the_reference_models_values():
    """``bf16_step_accuracy --tensors`` (``attention_tensors.Recorder``): every layer's residual stream, attention
    inputs and output and their gradients, for stock and CODA's torch backend alike (stock's (b, s, d) stream read
    in CODA's (b * s, d) order), each against the fp32 reference's value; a tensor scaled by 1 + 2^-7 reads 2^-7;
    the embedding output, exact in every precision here, reads 0; a tensor without a reference of its size fails."""
    from scripts.probes.attention_tensors import KEYS, Recorder
    from scripts.probes.bf16_step_accuracy import Setup, measure

    rec = Recorder()
    rec.name = "fp32"
    rec._record(0, "q", torch.ones(4, 8))
    rec.name, rec.rows["scaled"] = "scaled", {}
    rec._record(0, "q", torch.full((32,), 1 + 2 ** -7))
    assert rec.rows["scaled"][0]["q"] == pytest.approx(2 ** -7)
    with pytest.raises(AssertionError, match="no reference"):
        rec._record(0, "k", torch.ones(4, 8))

    rec = Recorder()
    s = Setup(flavor="debugmodel", seqlen=64, batch=2, device="cpu", backend="torch", fa4=False)
    measure(s, models=("stock_eager", "torch_eager"), instrument=rec.attach)
    for name in ("stock_eager", "torch_eager"):
        rows = rec.rows[name]
        assert sorted(rows) == list(range(len(rows))) and len(rows) >= 2 and all(set(r) == set(KEYS) for r in rows.values())
        assert rows[0]["x"] == 0  # (the embedding's rows, bf16 in both)
        assert all(0 < rows[i][k] < 2 ** -4 for i in rows for k in KEYS if (i, k) != (0, "x")), rows
    assert rec.summary()["stock_eager"]["q"]["max"] == max(r["q"] for r in rec.rows["stock_eager"].values())


def test_bf16_step_accuracy_amp_models_run_under_autocast_on_fp32_parameters():
    """The probe's AMP models (CPU, debug flavor): CODA under AMP runs its bf16 programs on bf16 casts, so its
    step is the bf16 model's to the bit (but for the embedding's gradient, whose repeated rows the fp32 table sums
    in fp32); stock under AMP keeps its residual stream in fp32 (autocast casts only the
    linears and attention), so its error against fp32 is below its pure-bf16 error, and with that stream cast to
    bf16 it is back in pure bf16's class (within twice, either way: another summation order's bound)."""
    from scripts.probes.bf16_step_accuracy import Setup, measure

    doc = measure(Setup(flavor="debugmodel", seqlen=64, batch=2, device="cpu", backend="torch", fa4=False),
                  models=("stock_eager", "coda_eager", "stock_amp", "coda_amp", "stock_amp_bf16_stream"))
    whole = {n: doc["summary"][n]["vs_fp32"]["whole_rel"] for n in doc["summary"]}
    amp, bf16 = (dict(doc["params"][n]["vs_fp32"]) for n in ("coda_amp", "coda_eager"))
    amp.pop("tok_embeddings.weight"), bf16.pop("tok_embeddings.weight")  # (repeated tokens: summed in fp32 under AMP)
    assert amp == bf16
    assert doc["loss"]["coda_amp"] == doc["loss"]["coda_eager"]
    assert 0 < whole["stock_amp"] < whole["stock_eager"], whole
    assert whole["stock_eager"] / 2 <= whole["stock_amp_bf16_stream"] <= 2 * whole["stock_eager"], whole


def test_bf16_step_accuracy_starts_from_a_trained_state_at_the_batch_its_next_step_reads(tmp_path, cache_dir, monkeypatch):
    """``trained_state``: the weights of a training run's checkpoint at step 3 and the batch of its step 4. Stock
    llama3 in fp32 on them gives the loss the run logged at step 4 (the same ops on the same CPU: equal up to
    the 5 printed decimals), so the weights and the batch are that step's; a batch or checkpoint one step off
    gives another loss. Then the probe runs from that state."""
    from torchtitan.components.loss import cross_entropy_loss

    from scripts.probes.bf16_step_accuracy import Setup, _step, _stock, measure, trained_state
    from scripts.report.bf16_parity import step_accuracy_table

    from .conftest import logged_losses, run_cli

    config, run = str(CONFIGS / "debug_cpu_baseline.toml"), tmp_path / "run"
    proc = run_cli(["train", config, "--training.steps", "4", "--checkpoint.enable", "--checkpoint.interval", "3",
                    "--job.dump_folder", str(run), "--metrics.disable_color_printing"], cwd=tmp_path, cache_dir=cache_dir)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    logged = logged_losses(proc.stdout + proc.stderr)
    monkeypatch.setenv("CODA_TITAN_CACHE", str(cache_dir))
    s = Setup(flavor="debugmodel_gqa", seqlen=128, batch=4, device="cpu", backend="torch", fa4=False)
    state = trained_state(s, config, 3, str(run))  # (the run's checkpoint: no training here)
    loss, _ = _step(_stock(s, False, torch.float32), state[0], state[1], state[2], True, loss_fn=cross_entropy_loss)
    assert abs(loss / state[2].numel() - logged[4]) <= 5e-6 + 4 * 2.0**-24 * logged[4]
    assert abs(logged[4] - logged[3]) > 1e-3  # (so a batch one step off would show)

    # (another step count in the same folder trains a run of its own: resuming the run above from its step-4
    # checkpoint, a model-only last save, failed on the GPU with "Missing key in checkpoint state_dict")
    state2 = trained_state(s, config, 2, str(run))
    loss2, _ = _step(_stock(s, False, torch.float32), state2[0], state2[1], state2[2], True, loss_fn=cross_entropy_loss)
    assert abs(loss2 / state2[2].numel() - logged[3]) <= 5e-6 + 4 * 2.0**-24 * logged[3]
    assert (run / "steps2" / "checkpoint" / "step-2").is_dir()

    doc = measure(s, models=("stock_eager", "coda_eager"), state=state)
    assert doc["loss"]["fp32"] == pytest.approx(loss, rel=2.0**-20)
    doc.update(device="cpu", date="2026-11-28", state={"config": config, "steps": 3})
    assert "the weights after 3 steps of `debug_cpu_baseline` and its next batch" in step_accuracy_table(doc)

    # (overrides of the config: a run of their own, in a folder named by them, its weights in the dtype they set)
    sets = ("training.dtype=bfloat16", "training.mixed_precision_param=bfloat16")
    state3 = trained_state(s, config, 2, str(run), sets)
    assert all(w.dtype == torch.bfloat16 for w in state3[0].values()) and torch.equal(state3[1], state2[1])
    assert (run / "steps2_training_dtype_bfloat16_training_mixed_precision_param_bfloat16" / "checkpoint").is_dir()
    doc["state"]["sets"] = list(sets)
    assert "steps of `debug_cpu_baseline` (with training.dtype=bfloat16, training" in step_accuracy_table(doc)


def test_cpu_precision_measures_each_pair_after_step_20_against_the_second_named():
    from scripts.probes.cpu_precision import command, summarize

    ref = [10.0 - 0.01 * s for s in range(40)]
    cand = list(ref)
    cand[25] *= 1.03  # (step 26: 3% high)
    cand[5] *= 2.0  # (step 6: before step 20, not counted)
    s = summarize({"a": ref, "b": cand, "c": ref})
    assert [(p["candidate"], p["reference"]) for p in s["pairs"]] == [("b", "a"), ("c", "a"), ("c", "b")]
    d = s["pairs"][0]
    assert d["max_rel_dev"] == pytest.approx(0.03) and d["max_rel_dev_step"] == 26
    assert d["mean_abs_rel_dev"] == pytest.approx(0.03 / 20)
    assert d["max_rel_dev_10step_mean"] == pytest.approx(0.03 * ref[25] / sum(ref[25:35]))  # (the 10-step sums')
    assert s["last50_mean"]["a"] == pytest.approx(sum(ref) / len(ref))
    with pytest.raises(ValueError):
        summarize({"a": ref[:30], "b": cand[:30]})
    with pytest.raises(ValueError):
        summarize({"a": ref, "b": cand[:39]})
    cmd = command("configs/debug_cpu_coda.toml", "amp", 7, ROOT / "x")
    assert cmd[cmd.index("--training.dtype") + 1] == "float32" and cmd[cmd.index("--training.mixed_precision_param") + 1] == "bfloat16"
    assert cmd[cmd.index("--training.steps") + 1] == "7"


def test_ce_rounding_probe_finds_the_unrounded_lse_worse_only_on_confident_rows():
    """The probe's two ways of a bf16-rounded cross-entropy: with lse, loss and softmax of the same rounded logits
    each row's dlogits sums to zero (fp64's error); with the unrounded logits' lse it does not, and on confident
    rows (sigma 6: the median row's top probability over 0.3) its dlogits error is over 1.5x the stored way's,
    where on diffuse rows (sigma 0.5) the two are within 5% of each other. The report renders the file."""
    from scripts.probes.ce_rounding import measure
    from scripts.report.bf16_parity import ce_rounding_table

    rows = measure(rows=128, vocab=1024, dim=64, sigmas=(0.5, 6.0))
    low, high = rows
    assert all(r["stored"]["row_sum_abs"] < 1e-12 for r in rows)
    assert high["lse_fp32"]["row_sum_abs"] > 1e-4 and high["top_p_median"] > 0.3
    assert high["lse_fp32"]["dlogits"] > 1.5 * high["stored"]["dlogits"]
    assert abs(low["lse_fp32"]["dlogits"] / low["stored"]["dlogits"] - 1) < 0.05
    # a head without its gradient pass (bf16 exp(l - c), the target's term apart): below the stored bf16 dlogits'
    # error on diffuse and on confident rows, with c from the Cauchy-Schwarz bound keeping the top e a normal bf16
    for r in rows:
        assert r["c_margin_min"] > -87, r["c_margin_min"]
        assert r["exp_stored_bound"]["dlogits"] < r["stored_bf16"]["dlogits"], r
        assert r["exp_stored_bound"]["dw"] < r["stored_bf16"]["dw"], r
    doc = {"date": "2026-11-29", "shape": {"rows": 128, "vocab": 1024, "dim": 64}, "rows": rows}
    table = ce_rounding_table(doc)
    assert "| 6 | " in table and f"{high['exp_stored_bound']['dlogits']:.2e}" in table


def test_ce_rounding_probe_finds_round_to_nearest_e5m2_dws_error_repeated_over_batches_where_rows_share_a_direction():
    """``dw_rounding``: with a direction every row of H shares, round-to-nearest e5m2 dlogits give dW_out errors
    that repeat from batch to batch (coherence over 1.5 of at most sqrt(8)), so the summed dW's relative error
    exceeds one batch's; stochastic rounding's errors are independent (coherence within 0.8-1.25), and without the
    shared direction round-to-nearest's are too. The same for dH = dlogits W summed into a weight gradient below the
    head (``fp8_lm_head_dgrad``'s B2 on the codes). The report renders the rows."""
    from scripts.probes.ce_rounding import dw_rounding
    from scripts.report.bf16_parity import dw_rounding_table

    plain, shared = dw_rounding(rows=256, vocab=2048, dim=64, sigmas=(1.0,), shared=(0.0, 2.0))
    assert shared["e5m2"]["coherence"] > 1.5 and shared["e5m2"]["dw_sum"] > 1.5 * shared["e5m2"]["dw"], shared
    for r in (plain, shared):
        assert 0.8 < r["e5m2_sr"]["coherence"] < 1.25, r
    assert 0.8 < plain["e5m2"]["coherence"] < 1.25, plain
    # (dH = dlogits W, ``fp8_lm_head_dgrad``: G = sum dH^T H over the batches repeats round-to-nearest's error
    # where the rows share a direction, as dW does; stochastic rounding's stays independent)
    assert shared["e5m2"]["dh_coherence"] > 1.5 and shared["e5m2"]["dh_wgrad_sum"] > shared["e5m2_sr"]["dh_wgrad_sum"]
    for r in (plain, shared):
        assert 0.75 < r["e5m2_sr"]["dh_coherence"] < 1.25 and r["bf16"]["dh"] < 0.2 * r["e5m2_sr"]["dh"], r
        assert r["e5m2_sr_tx"]["dh"] < 0.75 * r["e5m2_sr"]["dh"], r  # (the target's entry exact: fp8_lm_head_dgrad)
    table = dw_rounding_table({"dw_rounding": [plain, shared]})
    assert "| 1 | 2 | " in table and f"{shared['e5m2']['coherence']:.2f}" in table
    assert f"{shared['e5m2']['dh_coherence']:.2f}" in table and "dH one batch" in table
    assert f"{shared['e5m2_sr_tx']['dh']:.2e}" in table  # (the dH table has the tx cast)


def test_bf16_step_accuracy_refuses_the_unrounded_f4_arm_off_the_cute_backend():
    """``coda_eager_lse_unrounded`` and the ``ce_exp`` arms are the cute F4's (an environment variable its kernels
    read): on the torch backend each would be a CODA model under another name, so the probe refuses it before it
    runs anything."""
    from scripts.probes.bf16_step_accuracy import UNROUNDED, Setup, measure

    s = Setup(flavor="debugmodel_gqa", seqlen=64, batch=2, device="cpu", backend="torch", fa4=False)
    for arm in (UNROUNDED, "coda_eager_ce_exp", "coda_ce_exp_compiled", "coda_eager_ref_b1",
                "coda_eager_fa4_unpacked"):
        with pytest.raises(ValueError, match="cute backend"):
            measure(s, models=("stock_eager", arm))


def test_bf16_step_accuracy_builds_each_arms_model_under_its_switches(monkeypatch):
    """The bisection arms' switches are read when the model builds its backend (``CODA_TITAN_REFERENCE_PROGRAMS``),
    so the probe builds each arm's model, not only runs its step, under the arm's environment; the fp32 reference
    and the plain arm without it."""
    from coda_titan.kernels import REFERENCE_ENV
    from scripts.probes import bf16_step_accuracy as probe

    monkeypatch.delenv(REFERENCE_ENV, raising=False)
    built = []

    def coda(s, backend, dtype=torch.bfloat16, compiled=False, checkpoint=False):
        built.append((backend, dtype, os.environ.get(REFERENCE_ENV)))
        return torch.nn.Module()

    w = {"a.weight": torch.ones(2, 2)}
    monkeypatch.setattr(probe, "_coda", coda)
    monkeypatch.setattr(probe, "_step",
                        lambda model, weights, *a, **k: (1.0, {n: v.float() for n, v in weights.items()}))
    s = probe.Setup(flavor="debugmodel_gqa", seqlen=8, batch=1, device="cpu", backend="cute", fa4=False)
    doc = probe.measure(s, models=("coda_eager", "coda_eager_ref_b1", "coda_eager_ref_attn"), state=(w, None, None))
    assert built == [("torch", torch.float32, None), ("cute", torch.bfloat16, None),
                     ("cute", torch.bfloat16, "rope_bwd"), ("cute", torch.bfloat16, "norm_rope,rope_bwd,norm_residual_bwd,wgrad")]
    assert set(doc["loss"]) == {"fp32", "coda_eager", "coda_eager_ref_b1", "coda_eager_ref_attn"}


def test_ce_offset_slack_measures_the_cauchy_schwarz_bound_over_each_rows_largest_logit():
    """``scripts.probes.ce_offset_slack``: a row along W's longest row meets the bound (slack 0), a row orthogonal to
    every W row has slack ||h|| max ||W_n|| (its largest logit 0) and counts over the limit when that passes 157;
    the probe's own forward (CPU, debug model, init weights) reads the head's input and logits off stock llama3."""
    from scripts.probes.bf16_step_accuracy import Setup
    from scripts.probes.ce_offset_slack import SLACK_LIMIT, measure, slack

    w = torch.zeros(4, 8, dtype=torch.float64)
    w[:, :4] = torch.diag(torch.tensor([1.0, 2.0, 0.5, 1.5], dtype=torch.float64))
    h = torch.zeros(3, 8, dtype=torch.float64)
    h[0, 1] = 3.0  # (along W's longest row, norm 2: logit 6 = the bound)
    h[1, 5] = 10.0  # (orthogonal: slack 20)
    h[2, 6] = 100.0  # (orthogonal: slack 200, over the limit)
    r = slack(h, w, h @ w.t())
    assert r["slack"]["q0"] == 0.0 and r["slack_max"] == 200.0 and r["rows_over_limit"] == 1 and r["rows_over_warn"] == 1
    assert r["weight_row_norm_max"] == 2.0 and r["max_logit"]["q100"] == 6.0 and SLACK_LIMIT == 157.0
    got = measure(Setup(flavor="debugmodel_gqa", seqlen=64, batch=2, device="cpu", backend="torch", fa4=False), None)
    assert got["rows"] == 128 and got["slack"]["q0"] >= 0 and got["bound"]["q50"] > got["max_logit"]["q50"] > 0


def test_the_host_slack_probe_puts_the_forwards_after_a_logged_step_apart():
    from scripts.probes.host_slack import split_by_log

    # forward i + 1 follows step i; with a line every 10 steps, forwards 11 and 21 start on an empty queue
    rows = [{"host_fwd_ms": 30.0 if i in (10, 20) else 90.0 + i, "gpu_fwd_ms": 50.0 if i in (10, 20) else 58.0}
            for i in range(25)]
    got = split_by_log(rows, warmup=5, steps=25, log_freq=10, skip=25)  # (forward 25: cProfile's, left out)
    assert got["after_log"] == {"forwards": 2, "host_fwd_ms": 30.0, "gpu_fwd_ms": 50.0}
    between = [90.0 + i for i in range(5, 24) if i not in (10, 20)]
    assert got["between_logs"]["forwards"] == len(between) == 17
    assert got["between_logs"]["host_fwd_ms"] == sorted(between)[8] and got["between_logs"]["gpu_fwd_ms"] == 58.0
    early = split_by_log(rows[:10], warmup=0, steps=10, log_freq=10)  # (TorchTitan logs step 1 too: forward 2 follows it)
    assert early["after_log"] == {"forwards": 1, "host_fwd_ms": 91.0, "gpu_fwd_ms": 58.0}
