"""The real TorchTitan Trainer, launched as a user would (``coda-titan train``), on the CPU.

One module-scoped set of runs (about two minutes on 2 cores):
  A  CODA      20 steps, checkpoints at 10 and 20, offline W&B
  B  baseline  20 steps, same data and seed, checkpoints, offline W&B
  C  CODA      resumed from A's step-10 checkpoint (save 10, resume 10 more)
  D  CODA      resumed from B's (baseline) step-10 checkpoint
  E  baseline  resumed from A's (CODA) step-10 checkpoint
  F  CODA      3 steps with full activation checkpointing
Losses come from each run's offline W&B history (full precision).
"""

import glob
import shutil
from pathlib import Path

import pytest

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
    return r


def _rel(a, b):
    return abs(a - b) / abs(b)


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


def test_baseline_loss_curve_matches_within_1e4(runs):
    a, b = runs["A"]["losses"], runs["B"]["losses"]
    assert sorted(b) == list(range(1, STEPS + 1))
    worst = max(range(1, STEPS + 1), key=lambda s: _rel(a[s], b[s]))
    assert _rel(a[worst], b[worst]) <= 1e-4, f"step {worst}: coda {a[worst]} vs baseline {b[worst]}"


def test_save_and_resume_equals_uninterrupted(runs):
    a, c = runs["A"]["losses"], runs["C"]["losses"]
    assert sorted(c) == list(range(11, STEPS + 1)), "resumed run must start at step 11"
    for s in c:
        assert _rel(c[s], a[s]) <= 1e-6, f"step {s}: resumed {c[s]} vs uninterrupted {a[s]}"


def test_baseline_checkpoint_resumes_in_coda(runs):
    b, d = runs["B"]["losses"], runs["D"]["losses"]
    assert sorted(d) == list(range(11, STEPS + 1))
    for s in d:
        assert _rel(d[s], b[s]) <= 1e-4, f"step {s}: coda-from-baseline {d[s]} vs baseline {b[s]}"


def test_coda_checkpoint_resumes_in_baseline(runs):
    a, e = runs["A"]["losses"], runs["E"]["losses"]
    assert sorted(e) == list(range(11, STEPS + 1))
    for s in e:
        assert _rel(e[s], a[s]) <= 1e-4, f"step {s}: baseline-from-coda {e[s]} vs coda {a[s]}"


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
    a, f = runs["A"]["losses"], runs["F"]["losses"]
    assert "Applied full activation checkpointing" in runs["F"]["out"]
    assert sorted(f) == [1, 2, 3]
    for s in f:
        assert _rel(f[s], a[s]) <= 1e-6, f"step {s}: with AC {f[s]} vs without {a[s]}"


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
    import os
    import re
    import signal
    import subprocess
    import sys

    args = ["train", str(CONFIGS / "debug_cpu_coda.toml"), "--training.steps", "100000", "--job.dump_folder",
            str(tmp_path / "o"), "--checkpoint.enable", "--checkpoint.interval", "5", "--metrics.no-enable_wandb"]
    env = dict(os.environ, CODA_TITAN_CACHE=str(cache_dir), PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, "-m", "coda_titan.cli", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env, cwd=tmp_path)
    for line in p.stdout:
        if re.search(r"step:\s+7\s", line):
            p.send_signal(signal.SIGINT)
            break
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130 and "Traceback" not in err, err[-2000:]
    (msg,) = [ln for ln in err.splitlines() if ln.startswith("coda-titan:")]
    assert "interrupted during step" in msg and "step-5" in msg and "resume with: coda-titan " + " ".join(args) in msg


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
