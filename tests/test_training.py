"""The real TorchTitan Trainer, launched as a user would (``coda-titan train``), on the CPU.

One module-scoped set of runs (about two minutes on 2 cores):
  A  CODA      20 steps, checkpoints at 10 and 20, offline W&B
  B  baseline  20 steps, same data and seed, checkpoints, offline W&B
  C  CODA      resumed from A's step-10 checkpoint (save 10, resume 10 more)
  D  CODA      resumed from B's (baseline) step-10 checkpoint
  E  baseline  resumed from A's (CODA) step-10 checkpoint
  F  CODA      3 steps with full activation checkpointing
  G  CODA      20 steps with [coda] fused_clip (as A otherwise)
  H, I         CODA and baseline in TorchTitan's AMP (fp32 parameters, bf16 autocast)
  J, K         CODA and baseline in pure bf16 (training.dtype = "bfloat16", as the GPU configs)
Losses come from each run's offline W&B history (full precision).
"""

import glob
import shutil
from pathlib import Path

import pytest
import torch

from scripts.compare.wandb_history import read_history

from .conftest import CONFIGS, logged_losses, run_cli

pytestmark = pytest.mark.slow
STEPS = 20


def _train(name, config, workdir, cache_dir, *extra):
    dump = workdir / name
    proc = run_cli(
        ["train", str(CONFIGS / config), "--job.dump_folder", str(dump), "--metrics.enable_wandb",
         "--checkpoint.enable", "--checkpoint.interval", "10", "--metrics.disable_color_printing", *extra],
        cwd=workdir, cache_dir=cache_dir,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"run {name} failed:\n{out[-4000:]}"
    runs = glob.glob(str(dump / "tb" / "**" / "wandb" / "offline-run-*"), recursive=True)
    assert len(runs) == 1, f"run {name}: expected one offline W&B run, found {runs}"
    history = read_history(runs[0])
    losses = {row["_step"]: row["loss_metrics/global_avg_loss"] for row in history if "loss_metrics/global_avg_loss" in row}
    return {"dir": dump, "out": out, "losses": losses, "wandb_dir": runs[0]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cache_dir):
    work = tmp_path_factory.mktemp("train")
    r = {}
    r["A"] = _train("A", "debug_cpu_coda.toml", work, cache_dir)
    r["B"] = _train("B", "debug_cpu_baseline.toml", work, cache_dir)
    # C: a fresh dump folder holding only A's step-10 checkpoint; TorchTitan resumes from it.
    (work / "C" / "checkpoint").mkdir(parents=True)
    shutil.copytree(r["A"]["dir"] / "checkpoint" / "step-10", work / "C" / "checkpoint" / "step-10")
    r["C"] = _train("C", "debug_cpu_coda.toml", work, cache_dir)
    cross = ["--checkpoint.no-initial_load_model_only", "--checkpoint.initial_load_path"]
    r["D"] = _train("D", "debug_cpu_coda.toml", work, cache_dir, *cross, str(r["B"]["dir"] / "checkpoint" / "step-10"))
    r["E"] = _train("E", "debug_cpu_baseline.toml", work, cache_dir, *cross, str(r["A"]["dir"] / "checkpoint" / "step-10"))
    r["F"] = _train("F", "debug_cpu_coda.toml", work, cache_dir, "--training.steps", "3",
                    "--activation_checkpoint.mode", "full")
    r["G"] = _train("G", "debug_cpu_coda.toml", work, cache_dir, "--coda.fused_clip")
    r["L"] = _train("L", "debug_cpu_coda.toml", work, cache_dir, "--coda.stacked_weights")
    r["M"] = _train("M", "debug_cpu_baseline.toml", work, cache_dir, *cross,
                    str(r["L"]["dir"] / "checkpoint" / "step-10"))
    for name, config, dtype in (("H", "coda", "float32"), ("I", "baseline", "float32"),
                                ("J", "coda", "bfloat16"), ("K", "baseline", "bfloat16")):
        r[name] = _train(name, f"debug_cpu_{config}.toml", work, cache_dir, "--training.dtype", dtype,
                         "--training.mixed_precision_param", "bfloat16")
    return r


def _rel(a, b):
    return abs(a - b) / abs(b)


# CODA against stock llama3, fp32 on the CPU, same data, seed and initial weights. Both evaluate the
# same function; CODA sums in another order (deferred RMSNorm, partial sums, fused epilogues), so at
# equal parameters a token loss differs by reassociation error, a few units of fp32 roundoff
# u = 2**-24 relative, and the step's loss is the mean of such losses (the error does not grow with
# the token count). The parameters then differ by lr times the normalized (Adam) update's own O(u)
# difference, which moves the next losses by the same order, not more: the deviation does not
# compound over 20 steps at lr 3e-4. Bound: 16 u (measured: 2.2 u for A vs B, 1.1 u across the
# checkpoint swaps D and E, 2026-11-23, CPU).
FP32_U = 2.0**-24
CODA_VS_STOCK = 16 * FP32_U


def test_coda_trains_and_loss_falls(runs):
    a = runs["A"]
    losses = a["losses"]
    assert sorted(losses) == list(range(1, STEPS + 1))
    first, last = sum(losses[s] for s in range(1, 6)) / 5, sum(losses[s] for s in range(16, 21)) / 5
    assert last < first - 0.2, f"loss did not fall: first-5 mean {first:.4f}, last-5 mean {last:.4f}"
    assert "coda_llama3" in a["out"] and "'torch' programs" in a["out"]
    # the console log the user watches carries the same losses
    printed = logged_losses(a["out"])
    assert all(abs(printed[s] - losses[s]) <= 1e-5 for s in losses)


def test_baseline_loss_curve_matches_within_fp32_reassociation(runs):
    a, b = runs["A"]["losses"], runs["B"]["losses"]
    assert sorted(b) == list(range(1, STEPS + 1))
    worst = max(range(1, STEPS + 1), key=lambda s: _rel(a[s], b[s]))
    assert _rel(a[worst], b[worst]) <= CODA_VS_STOCK, f"step {worst}: coda {a[worst]} vs baseline {b[worst]}"



# CODA against stock llama3 with bf16 GEMM operands (TorchTitan's AMP, or pure bf16 parameters), same data,
# seed and initial weights. Both round the same function's operands to bf16 (unit roundoff u = 2**-8), at
# different places (CODA: H = X * gamma and its residual stream; stock: the normalized input, then its
# product with gamma). At equal parameters a token's loss moves by such roundings, at most u/2 relative
# each, with signs that cancel in the step's mean over its 512 tokens (batch 4 x 128): about u/2 / sqrt(512)
# = u/45. The parameters' own difference then moves the next losses by the same order (as CODA_VS_STOCK
# argues for fp32), at most doubling it: u/22. Bound: u/8 (measured, 2026-11-28, CPU: 0.031 u with AMP,
# 0.007 u in bf16; before the model ran its programs with autocast off, autocast rounded the reference's
# fp32 accumulators and the loss to bf16: 1.6 u in bf16).
BF16_U = 2.0**-8
CODA_VS_STOCK_BF16 = BF16_U / 8


@pytest.mark.parametrize("coda,stock", [("H", "I"), ("J", "K")], ids=["amp", "bf16"])
def test_bf16_and_amp_training_track_stock_within_bf16_roundoff(runs, coda, stock):
    c, b = runs[coda]["losses"], runs[stock]["losses"]
    assert "Mixed precision training is handled by AMP" in runs[coda]["out"]
    assert sorted(c) == sorted(b) == list(range(1, STEPS + 1))
    worst = max(range(1, STEPS + 1), key=lambda s: _rel(c[s], b[s]))
    assert _rel(c[worst], b[worst]) <= CODA_VS_STOCK_BF16, f"step {worst}: coda {c[worst]} vs baseline {b[worst]}"


def test_fused_clip_trains_as_the_clip_pass_does(runs):
    """``[coda] fused_clip`` in the real trainer: the fused path runs (it says so), and where it clips the
    gradients the step reads differ from the clip pass's by a few fp32 roundings (tests/test_fused_clip.py),
    which moves the parameters by lr times the normalized update's O(u) difference, as CODA_VS_STOCK's."""
    a, g = runs["A"]["losses"], runs["G"]["losses"]
    assert "[coda] fused_clip: the gradient clip's scale is applied inside the fused AdamW step" in runs["G"]["out"]
    assert sorted(g) == list(range(1, STEPS + 1)) and g[1] == a[1]  # (step 1's loss comes before any step)
    worst = max(range(1, STEPS + 1), key=lambda s: _rel(g[s], a[s]))
    assert _rel(g[worst], a[worst]) <= CODA_VS_STOCK, f"step {worst}: fused_clip {g[worst]} vs {a[worst]}"


def test_save_and_resume_equals_uninterrupted(runs):
    """Bit for bit: the same process, data order, RNG state and fp32 CPU kernels after the load."""
    a, c = runs["A"]["losses"], runs["C"]["losses"]
    assert sorted(c) == list(range(11, STEPS + 1)), "resumed run must start at step 11"
    for s in c:
        assert c[s] == a[s], f"step {s}: resumed {c[s]!r} vs uninterrupted {a[s]!r}"


def test_baseline_checkpoint_resumes_in_coda(runs):
    b, d = runs["B"]["losses"], runs["D"]["losses"]
    assert sorted(d) == list(range(11, STEPS + 1))
    for s in d:
        assert _rel(d[s], b[s]) <= CODA_VS_STOCK, f"step {s}: coda-from-baseline {d[s]} vs baseline {b[s]}"


def test_coda_checkpoint_resumes_in_baseline(runs):
    a, e = runs["A"]["losses"], runs["E"]["losses"]
    assert sorted(e) == list(range(11, STEPS + 1))
    for s in e:
        assert _rel(e[s], a[s]) <= CODA_VS_STOCK, f"step {s}: baseline-from-coda {e[s]} vs coda {a[s]}"


def test_stacked_weights_trains_as_stock_and_its_checkpoint_resumes_in_baseline(runs):
    """``--coda.stacked_weights`` (wq, wk, wv and w1, w3 in one buffer each, B3's da as [gate | up]): the same function,
    so the same bound against the baseline; its checkpoint (written from the shared buffers) resumes in stock llama3."""
    b, l, m = runs["B"]["losses"], runs["L"]["losses"], runs["M"]["losses"]
    assert sorted(l) == list(range(1, STEPS + 1)) and sorted(m) == list(range(11, STEPS + 1))
    for s in l:
        assert _rel(l[s], b[s]) <= CODA_VS_STOCK, f"step {s}: coda stacked_weights {l[s]} vs baseline {b[s]}"
    for s in m:
        assert _rel(m[s], l[s]) <= CODA_VS_STOCK, f"step {s}: baseline-from-stacked_weights {m[s]} vs coda {l[s]}"


def test_wandb_offline_run_holds_loss_series(runs):
    a = runs["A"]
    assert Path(a["wandb_dir"]).name.startswith("offline-run-")
    assert "W&B runs in offline mode" in a["out"]
    assert f"wandb sync {a['wandb_dir']}" in a["out"]
    history = read_history(a["wandb_dir"])
    steps = [row["_step"] for row in history if "loss_metrics/global_avg_loss" in row]
    assert steps == list(range(1, STEPS + 1))
    printed = logged_losses(a["out"])
    assert all(abs(row["loss_metrics/global_avg_loss"] - printed[row["_step"]]) <= 1e-5 for row in history)


def test_activation_checkpointing_gives_the_same_losses(runs):
    """Bit for bit: the recomputed forward runs the same fp32 kernels on the same inputs."""
    a, f = runs["A"]["losses"], runs["F"]["losses"]
    assert "Applied full activation checkpointing" in runs["F"]["out"]
    assert sorted(f) == [1, 2, 3]
    for s in f:
        assert f[s] == a[s], f"step {s}: with AC {f[s]!r} vs without {a[s]!r}"


def test_the_run_ends_with_a_summary(runs):
    out = runs["A"]["out"]
    assert f"done: {STEPS} steps, final loss" in out and "tokens/s, peak memory" in out
    assert f"newest checkpoint {runs['A']['dir'] / 'checkpoint' / f'step-{STEPS}'}" in out


def _resume_from_copy(runs, tmp_path, cache_dir, damage):
    """A's dump folder copied, ``damage`` applied to it, then the run restarted on the copy."""
    dump = tmp_path / "copy"
    shutil.copytree(runs["A"]["dir"] / "checkpoint", dump / "checkpoint")
    damage(dump / "checkpoint")
    return run_cli(["train", str(CONFIGS / "debug_cpu_coda.toml"), "--job.dump_folder", str(dump), "--checkpoint.enable",
                    "--checkpoint.interval", "10", "--training.steps", str(STEPS + 2), "--metrics.no-enable_wandb"],
                   cwd=tmp_path, cache_dir=cache_dir)


def test_a_truncated_shard_is_named_before_anything_runs(runs, tmp_path, cache_dir):
    def truncate(folder):
        shard = next((folder / f"step-{STEPS}").glob("*.distcp"))
        shard.write_bytes(shard.read_bytes()[:1000])

    proc = _resume_from_copy(runs, tmp_path, cache_dir, truncate)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and len(err) == 1, proc.stderr[-2000:]
    assert f"step-{STEPS}" in err[0] and "is damaged" in err[0] and "1000 bytes" in err[0]


def test_a_step_without_metadata_is_skipped_and_said(runs, tmp_path, cache_dir):
    proc = _resume_from_copy(runs, tmp_path, cache_dir, lambda folder: (folder / f"step-{STEPS}" / ".metadata").unlink())
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"step-{STEPS} in" in proc.stdout and "has no .metadata" in proc.stdout and "resuming from step-10" in proc.stdout


def test_ctrl_c_says_where_it_stopped_and_how_to_resume(tmp_path, cache_dir):
    """Ctrl-C at step 7: one line with the step, the newest checkpoint and the resume command, exit 130,
    no traceback. If shutdown hangs, the CLI's watchdog ends the process after SHUTDOWN_S with the same
    line and leaves every thread's stack in the dump folder, which this test reports as a warning."""
    import os
    import re
    import signal

    from coda_titan.cli import SHUTDOWN_S
    import subprocess
    import sys

    args = ["train", str(CONFIGS / "debug_cpu_coda.toml"), "--training.steps", "100000", "--job.dump_folder",
            str(tmp_path / "o"), "--checkpoint.enable", "--checkpoint.interval", "5", "--metrics.no-enable_wandb"]
    env = dict(os.environ, CODA_TITAN_CACHE=str(cache_dir), PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
    # stderr goes to a file: a pipe nobody reads while stdout is scanned could fill and block the run
    with open(tmp_path / "stderr.txt", "w+") as errf:
        p = subprocess.Popen([sys.executable, "-m", "coda_titan.cli", *args], stdout=subprocess.PIPE, stderr=errf,
                             text=True, env=env, cwd=tmp_path)
        for line in p.stdout:
            if re.search(r"step:\s+7\s", line):
                p.send_signal(signal.SIGINT)
                break
        try:
            p.communicate(timeout=2 * SHUTDOWN_S)
        except subprocess.TimeoutExpired:  # the watchdog did not end it either: show every thread's stack
            p.send_signal(signal.SIGABRT)
            p.communicate(timeout=30)
        errf.seek(0)
        err = errf.read()
    stacks = tmp_path / "o" / "interrupt_stacks.txt"
    if stacks.exists():  # the watchdog ended a hung shutdown: what the user needs still holds; say where it hung
        import warnings

        warnings.warn(f"shutdown after Ctrl-C hung until the watchdog; stacks:\n{stacks.read_text()[-4000:]}")
    assert p.returncode == 130 and "Traceback" not in err, err[-4000:]
    (msg,) = [ln for ln in err.splitlines() if ln.startswith("coda-titan:")]
    assert "interrupted during step" in msg and "resume with: coda-titan " + " ".join(args) in msg
    # the checkpoint named is the newest complete one (step-5, or step-10 when the Ctrl-C came during
    # its save: the save finishes first)
    done = sorted(int(d.name[5:]) for d in (tmp_path / "o" / "checkpoint").iterdir() if (d / ".metadata").is_file())
    assert done and f"the last checkpoint is {tmp_path / 'o' / 'checkpoint' / f'step-{done[-1]}'};" in msg, (msg, done)
    assert all(s % 5 == 0 for s in done) and done[-1] >= 5


def test_ctrl_c_during_a_checkpoint_save_lets_the_save_finish():
    """The first Ctrl-C inside TorchTitan's save is deferred until the save returns, then stops the
    run; outside a save it stops at once."""
    from coda_titan.cli import CheckpointSafeInterrupts

    intr, calls = CheckpointSafeInterrupts(), []

    def save(step):
        intr.handler(2, None)  # Ctrl-C while writing
        calls.append(step)  # the write goes on to the end
        return "saved"

    with pytest.raises(KeyboardInterrupt):
        intr.guard(save)(10)
    assert calls == [10] and not intr.saving and not intr.pending
    assert intr.guard(lambda: "ok")() == "ok"  # nothing pending afterwards
    with pytest.raises(KeyboardInterrupt):
        intr.handler(2, None)


def test_a_hung_shutdown_after_ctrl_c_still_ends_the_process(tmp_path):
    """The watchdog armed at Ctrl-C: a shutdown that blocks is ended with exit 130, the one
    interruption line and every thread's stack in the dump folder."""
    import subprocess
    import sys

    code = ("import time; from coda_titan.cli import _exit_if_shutdown_hangs as w; "
            f"w('interrupted during step 3; resume with: x', {str(tmp_path)!r}, seconds=1); time.sleep(60)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert proc.returncode == 130, proc.stderr[-2000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("coda-titan: interrupted during step 3; resume with: x") and "did not finish in 1 s" in line
    assert 'File "<string>", line 1 in <module>' in (tmp_path / "interrupt_stacks.txt").read_text()  # the blocked main thread


@pytest.mark.parametrize("config", ["debug_cpu_coda.toml", "debug_cpu_baseline.toml"])
def test_torchtitans_own_launcher_runs_the_shipped_configs(tmp_path, cache_dir, config):
    import os
    import subprocess
    import sys

    env = dict(os.environ, CODA_TITAN_CACHE=str(cache_dir), WANDB_MODE="offline", WANDB_SILENT="true")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "-m", "torchtitan.train",
           "--job.config_file", str(CONFIGS / config), "--experimental.custom_import", "coda_titan",
           "--training.steps", "2", "--job.dump_folder", str(tmp_path / "o"), "--metrics.no-enable_wandb",
           "--metrics.disable_color_printing"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert sorted(logged_losses(out)) == [1, 2]


def _saved_calibration(step_dir, sites):
    """The ``<site>_calibrated`` flags of a checkpoint's fp8 histories (1: the site ran calibrated)."""
    import torch.distributed.checkpoint as dcp

    flags = {site: torch.zeros(1, dtype=torch.int8) for site in sites}
    dcp.load({"coda_fp8": {f"{site}_calibrated": t for site, t in flags.items()}}, checkpoint_id=str(step_dir))
    return [int(flags[site]) for site in sites]


def test_fp8_trains_through_the_real_trainer_and_resumes(tmp_path, cache_dir):
    """precision = "fp8" on the CPU (the exact emulation of the fp8 programs) through TorchTitan's
    Trainer: it trains, checkpoints its amax histories beside the model (``coda_fp8``), and a resume
    continues bit for bit. A stock checkpoint has no histories: an fp8 run resumes from it with a
    fresh calibration, and stock llama3 loads an fp8 CODA checkpoint (it ignores the histories)."""
    # (the F1 input sites are on by default: the bit-for-bit resume needs their histories restored too; the LM
    # head's fp8 forward and dW with it, as the 1B configs may run them: the dW's stochastic rounding draws its
    # bits from the batch, so the resume repeats them)
    fp8 = ["--training.steps", "10", "--checkpoint.interval", "5", "--coda.precision", "fp8", "--coda.fp8_lm_head_fwd",
           "--coda.fp8_lm_head_dw"]
    a = _train("G", "debug_cpu_coda.toml", tmp_path, cache_dir, *fp8)
    assert "exact fp8 emulation" in a["out"] and sorted(a["losses"]) == list(range(1, 11))
    assert _saved_calibration(a["dir"] / "checkpoint" / "step-5", ("down", "out")) == [1, 1]
    (tmp_path / "H" / "checkpoint").mkdir(parents=True)
    shutil.copytree(a["dir"] / "checkpoint" / "step-5", tmp_path / "H" / "checkpoint" / "step-5")
    h = _train("H", "debug_cpu_coda.toml", tmp_path, cache_dir, *fp8)
    assert sorted(h["losses"]) == list(range(6, 11)) and "resuming from checkpoint step-5" in h["out"]
    assert all(h["losses"][s] == a["losses"][s] for s in h["losses"]), (h["losses"], a["losses"])
    cross = ["--checkpoint.initial_load_path", "--checkpoint.no-initial_load_model_only"]
    stock = _train("I", "debug_cpu_baseline.toml", tmp_path, cache_dir, "--training.steps", "7",
                   *cross[:1], str(a["dir"] / "checkpoint" / "step-5"), cross[1])
    assert sorted(stock["losses"]) == [6, 7]
    back = _train("J", "debug_cpu_coda.toml", tmp_path, cache_dir, "--training.steps", "10", "--coda.precision", "fp8",
                  *cross[:1], str(stock["dir"] / "checkpoint" / "step-7"), cross[1])
    assert sorted(back["losses"]) == [8, 9, 10]
