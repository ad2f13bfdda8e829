"""Let TorchTitan 0.2.2's Trainer run on a machine without an accelerator.

TorchTitan picks its device once, at import, with ``_get_available_device_type() or "cuda"``: on a
CPU-only machine it chooses "cuda" and the Trainer dies in ``torch.cuda.set_device``. Nothing on
disk is changed here. When (and only when) no accelerator is visible, ``install()`` points the
module-level ``device_type`` / ``device_module`` that TorchTitan reads at run time to "cpu" and to
a small stand-in of the ``torch.cuda`` API that the Trainer calls (names, memory statistics, sync).
Peak memory on CPU is the process's peak resident set size.
"""

from __future__ import annotations

import os
import platform
import resource
import sys
import types

import torch


class _CpuDeviceModule:
    """The part of the ``torch.cuda`` API that TorchTitan's Trainer and metrics call."""

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def set_device(device) -> None:
        return None

    @staticmethod
    def synchronize(device=None) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def reset_peak_memory_stats(device=None) -> None:
        return None

    @staticmethod
    def get_device_name(device=None) -> str:
        return f"CPU ({platform.machine()}, {os.cpu_count()} cores)"

    @staticmethod
    def get_device_properties(device=None):
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return types.SimpleNamespace(name=_CpuDeviceModule.get_device_name(), total_memory=total)

    @staticmethod
    def memory_stats(device=None) -> dict[str, int]:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux
        return {
            "active_bytes.all.peak": peak,
            "reserved_bytes.all.peak": peak,
            "num_alloc_retries": 0,
            "num_ooms": 0,
        }


cpu_device_module = _CpuDeviceModule()


def accelerator_present() -> bool:
    return torch._utils._get_available_device_type() is not None


def install() -> bool:
    """Route TorchTitan to the CPU if no accelerator exists. Returns True if it did."""
    if accelerator_present():
        return False
    import torchtitan.tools.utils as tt_utils

    if tt_utils.device_type == "cpu":
        return True
    old_type, old_module = tt_utils.device_type, tt_utils.device_module
    for name, mod in list(sys.modules.items()):
        if not name.startswith("torchtitan") or mod is None:
            continue
        if getattr(mod, "device_type", None) is old_type and isinstance(old_type, str):
            mod.device_type = "cpu"
        if getattr(mod, "device_module", None) is old_module:
            mod.device_module = cpu_device_module
    tt_utils.device_type, tt_utils.device_module = "cpu", cpu_device_module
    return True
