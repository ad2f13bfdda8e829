"""FSDP2 and HSDP for coda_llama3 on the CPU (gloo, 2 ranks): the sharded runs train the
single-process model, their checkpoints load on one process into CODA and into stock llama3, and
the real CLI trains under torchrun and resumes across world sizes (docs/design.md "FSDP2")."""

import json
import os
import shutil
import subprocess
import sys
import warnings

import pytest

from .conftest import CONFIGS, ROOT, logged_losses, run_cli

pytestmark = pytest.mark.slow

FP32_U = 2.0**-24
# The sharded step is the single-process step with its sums in another order: the loss is the global
# token sum over ranks (one more fp32 addition), each weight gradient is a reduce-scatter sum of the
# ranks' partial gradients (one more addition per element), and AdamW then moves every weight by a
# step whose size no longer depends on the gradient's scale. Each step therefore starts from weights
# a few fp32 roundings apart, and the loss difference compounds with the steps, as in the CODA vs
# stock comparison (tests/test_training.py): bound 16 u per step (measured 2 u over 6 steps).
SHARDED_VS_ONE = 16 * FP32_U


# A rank of a 2-rank gloo run has died twice in full CPU-suite runs on 2 cores (of about 10) with SIGABRT,
# "terminate called without an active exception", the second time right after a traceback through
# TorchTitan's first-step barrier (``set_pg_timeouts``); it never did in 22 runs of that test's command
# in a loop (half of them beside two CPU-bound processes), and the cause is not established. Such a run
# is repeated once from scratch, and the first one's tracebacks are reported as a warning.
_GLOO_ABORT = "terminate called without an active exception"


def _entries(root: str) -> set[str]:
    """Every path under ``root`` (a linked folder, such as a seeded checkpoint, as one entry: not followed)."""
    return {os.path.join(d, n) for d, dirs, files in os.walk(root) for n in dirs + files}


def _torchrun(args, cwd, env_extra=None, timeout=600):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "RANK", "LOCAL_RANK", "WORLD_SIZE"))}
    env.update(env_extra or {})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args]
    dump = args[args.index("--job.dump_folder") + 1] if "--job.dump_folder" in args else None
    before = _entries(dump) if dump else set()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 and _GLOO_ABORT in proc.stdout + proc.stderr:
        warnings.warn(f"a torchrun rank aborted, run repeated once: {_tracebacks(proc.stdout + proc.stderr)}")
        if dump:  # start over: what the aborted run wrote goes (no checkpoint of it is resumed), what the test put there stays
            new = _entries(dump) - before
            for path in (p for p in new if os.path.dirname(p) not in new):
                shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.unlink(path)
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return proc


def _tracebacks(out: str, lines: int = 40) -> str:
    """Every Python traceback in ``out`` (up to ``lines`` lines each), then its last 4000 characters."""
    text = out.splitlines()
    found = [i for i, line in enumerate(text) if "Traceback (most recent call last)" in line]
    return "".join("\n".join(text[i:i + lines]) + "\n---\n" for i in found) + out[-4000:]


def test_torchrun_repeats_a_run_whose_rank_aborted_once_from_scratch(tmp_path, monkeypatch):
    """The helper's one repeat: only a run that failed with the abort above, after removing what that run
    wrote to its dump folder (what the test seeded there, a linked checkpoint, stays), with the first run's
    traceback in a warning; any other failure is returned as it is."""
    dump, seeded = tmp_path / "dump", tmp_path / "seeded"
    runs = []

    def fake_run(cmd, **kw):
        runs.append((cmd, sorted(p.name for p in dump.rglob("*"))))
        failed = len(runs) == 1
        if failed:  # (the aborted run's own checkpoint)
            (dump / "checkpoint" / "step-6").mkdir(parents=True)
            (dump / "log.txt").write_text("x")
        return subprocess.CompletedProcess(cmd, 1 if failed else 0, "",
                                           f"Traceback (most recent call last):\n  boom\n{_GLOO_ABORT}" if failed else "")

    monkeypatch.setattr(subprocess, "run", fake_run)
    (seeded / "step-4").mkdir(parents=True)
    (dump / "checkpoint").mkdir(parents=True)
    os.symlink(seeded / "step-4", dump / "checkpoint" / "step-4")
    with pytest.warns(UserWarning, match="(?s)run repeated once.*boom"):
        proc = _torchrun(["-m", "x", "--job.dump_folder", str(dump)], cwd=tmp_path)
    assert proc.returncode == 0 and "--standalone" in runs[0][0]
    assert [names for _, names in runs] == [["checkpoint", "step-4"]] * 2 and (seeded / "step-4").is_dir()
    runs.clear()
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: runs.append(cmd) or subprocess.CompletedProcess(cmd, 1, "", "other"))
    assert _torchrun(["-m", "x"], cwd=tmp_path).returncode == 1 and len(runs) == 1


def test_fsdp_and_hsdp_train_the_one_process_model_and_checkpoints_load_anywhere(tmp_path):
    out = str(tmp_path)
    proc = _torchrun(["-m", "tests.fsdp_worker", "sharded", out], cwd=ROOT)
    assert proc.returncode == 0, _tracebacks(proc.stderr)
    proc = subprocess.run([sys.executable, "-m", "tests.fsdp_worker", "single", out, str(tmp_path / "fsdp_ckpt")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    one = json.loads((tmp_path / "single.json").read_text())["losses"]
    for mode in ("fsdp", "hsdp"):
        got = json.loads((tmp_path / f"{mode}.json").read_text())["losses"]
        dev = [abs(a - b) / abs(b) for a, b in zip(got, one)]
        print(f"{mode} vs one process: worst relative loss deviation {max(dev) / FP32_U:.1f} u")
        assert len(got) == len(one) and max(dev) <= SHARDED_VS_ONE, (mode, got, one)
        # bf16: the next block's gamma comes from one gamma-only gather per forward, never from gathering
        # the whole block early (an explicit unshard() runs its all-gather on the compute stream)
        run = json.loads((tmp_path / f"{mode}.json").read_text())
        assert run["unshards"] == {"sync": 0, "async": 0} and run["gammas_match"]
        # the LM head is a unit of its own, reduce-scattered first, before any block's backward ends
        # (in the root unit its fp32 reduce-scatter waited for the whole backward)
        n = run["layers"]
        assert run["reduced"][0] == "output" and run["reduced"][1:n + 1] == [f"layers.{i}" for i in reversed(range(n))]
    assert one[-1] < one[0]  # it trains
    # fp8 (the exact emulation): each rank scales its activations by its own amax (local, as torchao's
    # dynamic scaling does) while the weights' scales come from the gathered full weights, so the
    # sharded fp8 run is not the one-process fp8 run: it may differ from it by no more than fp8
    # rounding itself moves the one-process run (its distance from the bf16 run)
    fp8_one = json.loads((tmp_path / "single_fp8.json").read_text())["losses"]
    fp8_two = json.loads((tmp_path / "fsdp_fp8.json").read_text())["losses"]
    sharding = max(abs(a - b) / abs(b) for a, b in zip(fp8_two, fp8_one))
    effect = max(abs(a - b) / abs(b) for a, b in zip(fp8_one, one))
    print(f"fp8: sharded vs one process {sharding:.2e}; fp8 effect {effect:.2e}")
    assert len(fp8_two) == len(fp8_one) and 0 < effect and sharding <= effect
    # fp8: each block is gathered for its weight pass, the next one prefetched asynchronously (one
    # forward per step: every block but the first waits on a gather issued a block earlier)
    fp8_run = json.loads((tmp_path / "fsdp_fp8.json").read_text())
    n = fp8_run["layers"]
    assert fp8_run["unshards"] == {"sync": len(fp8_two) * n, "async": len(fp8_two) * (n - 1)}
    loaded = json.loads((tmp_path / "checkpoint.json").read_text())
    assert loaded == {"coda": True, "coda_keys": True, "stock": True, "stock_keys": True}


def test_cli_trains_sharded_and_resumes_across_world_sizes(tmp_path, cache_dir):
    common = ["--training.steps", "4", "--metrics.no-enable_wandb", "--checkpoint.enable", "--checkpoint.interval", "2",
              "--metrics.disable_color_printing"]
    env = {"CODA_TITAN_CACHE": str(cache_dir), "PYTHONUNBUFFERED": "1"}
    two = tmp_path / "two"
    # (with the one-GPU knobs of the 1B bf16 configs: a config tuned on one GPU runs sharded as it is, the step on
    # the main stream, said in one line)
    proc = _torchrun(["-m", "coda_titan.cli", "train", str(CONFIGS / "debug_cpu_coda.toml"), "--job.dump_folder",
                      str(two), "--parallelism.data_parallel_shard_degree", "2", "--activation_checkpoint.mode", "full",
                      "--coda.optimizer_stream", "--coda.step_chunk_layers", "1", *common], cwd=tmp_path, env_extra=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, _tracebacks(out)
    assert "Applied FSDP to the model" in out and sorted(logged_losses(out)) == [1, 2, 3, 4]
    assert "[coda] optimizer_stream runs on one GPU only: off under FSDP2 / DDP" in out
    assert sum(line.startswith("coda-titan: done:") for line in proc.stdout.splitlines()) == 1  # said once, by rank 0
    # 2 ranks -> 1 process: TorchTitan cannot reshard the data loaders' positions; said before any work
    one = tmp_path / "one"
    (one / "checkpoint").mkdir(parents=True)
    os.symlink(two / "checkpoint" / "step-2", one / "checkpoint" / "step-2")
    args = ["train", str(CONFIGS / "debug_cpu_coda.toml"), "--job.dump_folder", str(one), *common]
    proc = run_cli(args, cwd=tmp_path, cache_dir=cache_dir)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "saved by 2 data-parallel ranks and this run has 1" in err[0] and "exclude_from_loading dataloader" in err[0]
    proc = run_cli([*args, "--checkpoint.exclude_from_loading", "dataloader"], cwd=tmp_path, cache_dir=cache_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming from checkpoint step-2" in proc.stdout and sorted(logged_losses(proc.stdout + proc.stderr)) == [3, 4]
    # 1 process -> 2 ranks (DDP: data_parallel_replicate_degree 2)
    back = tmp_path / "back"
    (back / "checkpoint").mkdir(parents=True)
    os.symlink(one / "checkpoint" / "step-4", back / "checkpoint" / "step-4")
    proc = _torchrun(["-m", "coda_titan.cli", "train", str(CONFIGS / "debug_cpu_coda.toml"), "--job.dump_folder",
                      str(back), "--parallelism.data_parallel_replicate_degree", "2",
                      "--parallelism.data_parallel_shard_degree", "1", *common[2:], "--training.steps", "6",
                      "--checkpoint.exclude_from_loading", "dataloader"], cwd=tmp_path, env_extra=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, _tracebacks(out)
    assert "resuming from checkpoint step-4" in out and sorted(logged_losses(out)) == [5, 6]


def _dcp_tensors(path, tmp_path, name):
    """Every tensor of a DCP checkpoint folder, read on one process."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(path), str(tmp_path / f"{name}.pt"))
    flat = {}

    def walk(prefix, v):
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}.{k}" if prefix else str(k), x)
        elif isinstance(v, torch.Tensor):
            flat[prefix] = v
    walk("", torch.load(tmp_path / f"{name}.pt", weights_only=False))
    return flat


def test_sharded_fp8_resume_continues_bit_for_bit(tmp_path, cache_dir):
    """fp8 under FSDP2: each rank's amax histories are its own (its own batches), so each rank saves
    its own (``coda_fp8.rank<r>``) and a resume on the same ranks ends at the very parameters of the
    uninterrupted run; a resume on one process says it recalibrates."""
    import shutil

    import torch

    env = {"CODA_TITAN_CACHE": str(cache_dir), "PYTHONUNBUFFERED": "1"}
    common = ["--metrics.no-enable_wandb", "--checkpoint.enable", "--checkpoint.interval", "2", "--training.steps", "4",
              "--coda.precision", "fp8", "--parallelism.data_parallel_shard_degree", "2", "--metrics.disable_color_printing"]
    cmd = ["-m", "coda_titan.cli", "train", str(CONFIGS / "debug_cpu_coda.toml")]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    proc = _torchrun([*cmd, "--job.dump_folder", str(whole), *common], cwd=tmp_path, env_extra=env)
    assert proc.returncode == 0, _tracebacks(proc.stdout + proc.stderr)
    step2 = _dcp_tensors(whole / "checkpoint" / "step-2", tmp_path, "step2")
    assert {k for k in step2 if k.startswith("coda_fp8.")} >= {f"coda_fp8.rank{r}.activation_history" for r in (0, 1)}
    assert not torch.equal(step2["coda_fp8.rank0.activation_history"], step2["coda_fp8.rank1.activation_history"])
    (resumed / "checkpoint").mkdir(parents=True)
    shutil.copytree(whole / "checkpoint" / "step-2", resumed / "checkpoint" / "step-2")
    proc = _torchrun([*cmd, "--job.dump_folder", str(resumed), *common], cwd=tmp_path, env_extra=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "resuming from checkpoint step-2" in out, out[-4000:]
    a = _dcp_tensors(whole / "checkpoint" / "step-4", tmp_path, "a")
    b = _dcp_tensors(resumed / "checkpoint" / "step-4", tmp_path, "b")
    model = [k for k in a if not k.startswith(("optimizer.", "coda_fp8.", "train_state.", "dataloader.", "lr_scheduler."))]
    assert len(model) > 10 and "layers.0.attention.wq.weight" in model
    differ = [k for k in a if isinstance(a[k], torch.Tensor) and not torch.equal(a[k], b[k])]
    assert not differ, differ[:8]  # parameters, optimizer states and histories alike
    # one process from the 2-rank checkpoint: the histories are the ranks' own, so it calibrates afresh
    one = tmp_path / "one"
    (one / "checkpoint").mkdir(parents=True)
    shutil.copytree(whole / "checkpoint" / "step-2", one / "checkpoint" / "step-2")
    proc = run_cli(["train", str(CONFIGS / "debug_cpu_coda.toml"), "--job.dump_folder", str(one), *common[:-3],
                    "--checkpoint.exclude_from_loading", "dataloader", "--metrics.disable_color_printing"],
                   cwd=tmp_path, cache_dir=cache_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "saved by 2 data-parallel ranks and this run has 1: the fp8 scales calibrate afresh" in proc.stdout + proc.stderr


def test_sharded_full_activation_checkpointing_with_compile_trains_like_without(tmp_path, cache_dir):
    """The 8B configs' combination on 2 ranks: FSDP2 + full AC + compile, each block compiled inside its
    checkpoint (docs/design.md "Activation checkpointing with compile"), trains the same losses as
    without compile. aot_eager runs the same ops as eager, so the losses agree to the console's 5
    decimals (one unit of the last printed digit allowed for the rounding of the print itself)."""
    env = {"CODA_TITAN_CACHE": str(cache_dir), "PYTHONUNBUFFERED": "1"}
    losses = {}
    for compiled in (False, True):
        args = ["-m", "coda_titan.cli", "train", str(CONFIGS / "debug_cpu_coda.toml"), "--job.dump_folder",
                str(tmp_path / str(compiled)), "--parallelism.data_parallel_shard_degree", "2",
                "--activation_checkpoint.mode", "full", "--training.steps", "3", "--metrics.no-enable_wandb",
                "--metrics.log_freq", "1", "--metrics.disable_color_printing"]
        if compiled:
            args += ["--compile.enable", "--compile.backend", "aot_eager"]
        proc = _torchrun(args, cwd=tmp_path, env_extra=env)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, _tracebacks(out)
        assert ("inside its full activation checkpoint" in out) == compiled
        losses[compiled] = logged_losses(out)
    assert sorted(losses[True]) == [1, 2, 3]
    assert all(abs(losses[True][s] - losses[False][s]) <= 1e-5 for s in losses[False]), losses
