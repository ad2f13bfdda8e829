"""The model's precision under TorchTitan's autocast (docs/design.md, "Precision: autocast and TorchTitan's AMP").

On one device (or DDP) TorchTitan runs every step under ``torch.autocast(mixed_precision_param)``. The model runs
its programs with autocast off; with parameters wider than autocast's dtype (``training.dtype = "float32"``: AMP,
fp32 master weights) each program reads bf16 casts of them (``ProgramConfig.weight``). Under FSDP2 its mixed
precision gathers the parameters in ``param_dtype`` and TorchTitan runs no autocast: nothing to cast.
"""

from __future__ import annotations

import torch


def amp_dtype(embedding: torch.nn.Module | None, device: torch.device, precision: str) -> torch.dtype | None:
    """The 16-bit dtype TorchTitan's AMP asks the programs to read the parameters in (autocast on for ``device``
    and the parameters, the token embedding's, wider than its dtype), else None; AMP with ``precision`` fp8 is an
    error (its weight pass and scales read bf16 parameters)."""
    kind = device.type
    if embedding is None or not torch.is_autocast_enabled(kind):
        return None
    dtype = torch.get_autocast_dtype(kind)
    if embedding.weight.dtype.itemsize <= dtype.itemsize:
        return None
    if precision == "fp8":
        raise ValueError(
            '[coda] precision = "fp8" runs on bf16 parameters, not under TorchTitan\'s AMP (fp32 parameters, '
            'autocast): set training.dtype = "bfloat16", or shard with FSDP2 (data_parallel_shard_degree > 1)')
    return dtype
