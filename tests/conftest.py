import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seeded():
    """Every test starts from the same global RNG state, whatever ran before it."""
    torch.manual_seed(0)


NO_NETRC = "/nonexistent/coda_titan_tests/.netrc"


@pytest.fixture(autouse=True)
def _wandb_never_online(monkeypatch):
    """No test run reaches W&B, even on a machine logged in to it: no key, no netrc."""
    for key in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("NETRC", NO_NETRC)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """One tokenizer cache for the whole session (the tokenizer is trained once)."""
    d = os.environ.get("CODA_TITAN_TEST_CACHE") or str(tmp_path_factory.mktemp("coda_cache"))
    return d


def run_cli(args, *, cwd, cache_dir, env_extra=None, timeout=600):
    """Run ``coda-titan`` as a user would (a fresh process); returns the CompletedProcess."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "MASTER_", "RANK", "LOCAL_RANK", "WORLD_SIZE"))}
    env.update({"CODA_TITAN_CACHE": str(cache_dir), "WANDB_SILENT": "true", "PYTHONUNBUFFERED": "1", "NETRC": NO_NETRC})
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-m", "coda_titan.cli", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
    )


_STEP = re.compile(r"step:\s*(\d+)\s+loss:\s*([0-9.eE+-]+)")


def logged_losses(output: str) -> dict[int, float]:
    """{step: loss} from TorchTitan's console metrics lines (printed with 5 decimals)."""
    return {int(s): float(v) for s, v in _STEP.findall(output)}
