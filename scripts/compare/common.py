"""Shared pieces of the compare tooling: paths, targets, result-file naming, config loading and the
TOML writer.

The TOML writer is hand-written (the configs are flat tables of scalars and string lists): the GPU
host has no package index and its offline bundle (shared/gpu/requirements.txt) has no tomli-w.
"""

from __future__ import annotations

import datetime
import json
import re
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]


RESULTS = ROOT / "benchmarks" / "results"


# The issues' targets per precision: CODA tokens/s and peak memory over the compiled baseline's (stock +
# compile for bf16, TorchTitan float8 + compile for fp8), and CODA's step over its floor (issue 18, bf16)
TARGETS = {"bf16": {"speedup": 1.10, "memory": 0.80, "floor": 1.08}, "fp8": {"speedup": 1.25, "memory": 0.90}}


PARITY_TOL = 0.01  # relative loss deviation allowed after PARITY_SKIP steps


PARITY_TOL_FP8 = 0.015  # the same, for an fp8 candidate against the float8 baseline


PARITY_SKIP = 20


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {v!r} to TOML")


def dump_toml(doc: dict, prefix: str = "") -> str:
    out = []
    scalars = {k: v for k, v in doc.items() if not isinstance(v, dict)}
    if scalars:
        if prefix:
            out.append(f"[{prefix}]")
        out += [f"{k} = {_toml_value(v)}" for k, v in scalars.items()]
        out.append("")
    for k, v in doc.items():
        if isinstance(v, dict):
            out.append(dump_toml(v, f"{prefix}.{k}" if prefix else k))
    return "\n".join(out)


def with_attention(doc: dict, attention: str) -> dict:
    """The config with FA4 added to or removed from ``model.converters``."""
    doc = json.loads(json.dumps(doc))
    model = doc.setdefault("model", {})
    conv = [c for c in model.get("converters", []) if c != "fa4"]
    model["converters"] = (conv + ["fa4"]) if attention == "fa4" else conv
    return doc


def _load_toml(path: Path) -> dict:
    from coda_titan.cli import _load_toml as load

    return load(path)


def _attention_of(doc: dict) -> str:
    return "fa4" if "fa4" in doc.get("model", {}).get("converters", []) else "sdpa"


def _say(msg: str) -> None:
    print(f"[compare] {msg}", flush=True)


def _versions() -> dict:
    from importlib import metadata

    import torch

    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0]}
    for dist in ("torchtitan", "quack-kernels", "nvidia-cutlass-dsl", "flash-attn-4", "torchao", "coda-titan"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    try:
        out["coda_titan_commit"] = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=7"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except Exception:
        out["coda_titan_commit"] = None
    return out


def _device() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", s).strip("_")


def host_id() -> str:
    """This machine's identity for one lease: its hostname and kernel boot id (a device host started
    afresh boots anew, so two leases on one hostname differ too)."""
    import socket

    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def _header(kind: str) -> dict:
    return {
        "kind": kind,
        "device": _device(),
        "host": host_id(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "versions": _versions(),
        "command": " ".join(["python -m scripts.compare", *sys.argv[1:]]),
    }


def _out_path(out: Path, kind: str, device: str, date: str, extra: str = "") -> Path:
    return out / f"{kind}_{extra}{_slug(device)}_{date[:10]}.json"


def _latest(kind: str) -> list[Path]:
    """Newest result file of ``kind`` per device (and per config, for profiles)."""
    best: dict[str, Path] = {}
    for p in sorted(RESULTS.glob(f"{kind}_*.json")):
        key = re.sub(r"_\d{4}-\d{2}-\d{2}\.json$", "", p.name)
        best[key] = p  # sorted by name: the later date wins
    return sorted(best.values(), key=lambda p: (len(p.name), p.name))  # untagged (the 1B set) first
