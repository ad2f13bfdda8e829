"""Model arguments and flavors of ``coda_llama3``.

``CodaModelArgs`` is TorchTitan's ``TransformerModelArgs`` plus one field, ``coda``: the parsed
``[coda]`` section (``coda_titan.titan.job_config.Coda``), copied in by
``update_from_config``. Flavors use TorchTitan's numbers where TorchTitan defines them (8B, 70B);
1B and 3B are the Llama-3.2 shapes.

The same flavor names are added to stock ``llama3`` (only names it lacks, never changing one it
has), so that a CODA config and its baseline differ only in ``model.name`` and ``[coda]``. Stock
``debugmodel`` is multi-head; the tiny GQA model is ``debugmodel_gqa`` in both (and ``debugmodel``
in ``coda_llama3``).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field

from torchtitan.models.llama3 import TransformerModelArgs

from ..titan.job_config import Coda


@dataclass
class CodaModelArgs(TransformerModelArgs):
    coda: Coda = field(default_factory=Coda)

    def update_from_config(self, job_config, **kwargs) -> None:
        super().update_from_config(job_config, **kwargs)
        coda = getattr(job_config, "coda", None)
        if coda is not None:
            self.coda = copy.copy(coda)  # (validated when the model is built)


def _flavors(cls) -> dict[str, TransformerModelArgs]:
    tiny_gqa = dict(dim=256, n_layers=4, n_heads=16, n_kv_heads=4, vocab_size=2048, rope_theta=500000)
    return {
        "debugmodel": cls(**tiny_gqa),
        "debugmodel_gqa": cls(**tiny_gqa),
        "1B": cls(
            dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5,
            multiple_of=1024, rope_theta=500000, vocab_size=128256,
        ),
        "3B": cls(
            dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim_multiplier=1.0,
            multiple_of=256, rope_theta=500000, vocab_size=128256,
        ),
        "8B": cls(
            dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3,
            multiple_of=1024, rope_theta=500000,
        ),
        "70B": cls(
            dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3,
            multiple_of=4096, rope_theta=500000,
        ),
    }


coda_llama3_args: dict[str, CodaModelArgs] = _flavors(CodaModelArgs)


def stock_flavor_additions() -> dict[str, TransformerModelArgs]:
    """Flavors stock llama3 lacks, as plain TransformerModelArgs (same numbers as ours)."""
    return {k: v for k, v in _flavors(TransformerModelArgs).items() if k != "debugmodel"}


def same_architecture(a: TransformerModelArgs, b: TransformerModelArgs) -> bool:
    base = {f.name for f in dataclasses.fields(TransformerModelArgs)}
    return all(getattr(a, n) == getattr(b, n) for n in base)
